#include "workers.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <pthread.h>
#include <thread>

namespace batchscope {

namespace {

constexpr int MAX_THREADS = 64;  // BATCHSCOPE_NATIVE_THREADS' cap

void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Workers spin up to ~1 ms after a job (in a decode step the next op that uses them comes
// within that), then sleep until woken: an idle engine costs nothing.
class Workers {
 public:
  explicit Workers(int count) : count_(count) {
    for (int i = 0; i < count; ++i) {
      std::thread([this] { loop(); }).detach();  // never joined: lives as long as the process
    }
  }

  int count() const {
    return count_;
  }

  // Runs job() on the calling thread and on every worker that arrives while it is open; the
  // job must be safe to run any number of times at once (parallel_for's claims chunks until
  // none are left). Returns once the calling thread's run has ended and
  // no worker is inside it: a worker still waking up is not waited for, it finds the job
  // closed and goes back to waiting.
  bool run(const std::function<void()>& job) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    job_ = &job;
    closed_.store(false);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    closed_.store(true);
    // Sequentially consistent with the workers' check. A worker inside the job may have been
    // preempted (more threads than cores: OpenBLAS's spin after a BLAS call): after a short
    // spin, yield this core to it.
    for (int spins = 0; active_.load() != 0; ++spins) {
      if (spins < 2048) {
        relax();
      } else {
        std::this_thread::yield();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error) error = worker_error_;
      worker_error_ = nullptr;
    }
    if (error) std::rethrow_exception(error);
    return true;
  }

 private:
  void loop() {
    unsigned seen = 0;
    for (;;) {
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(1000);
      int spins = 0;
      while (generation_.load() == seen) {
        if (++spins % 256 != 0 || std::chrono::steady_clock::now() < spin_until) {
          relax();
          continue;
        }
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
      }
      seen = generation_.load();
      active_.fetch_add(1);
      if (!closed_.load()) {  // else the caller is done: do not touch its job
        try {
          (*job_)();
        } catch (...) {  // handed to the caller, which rethrows it
          std::lock_guard<std::mutex> lock(mutex_);
          if (!worker_error_) worker_error_ = std::current_exception();
        }
      }
      active_.fetch_sub(1);
    }
  }

  int count_;
  std::mutex busy_, mutex_;
  std::condition_variable wake_;
  std::atomic<unsigned> generation_{0};
  std::atomic<bool> closed_{true};
  std::atomic<int> active_{0};  // workers inside run's job (or checking whether it is open)
  const std::function<void()>* job_ = nullptr;
  std::exception_ptr worker_error_;
};

std::mutex pool_guard;
std::atomic<Workers*> current_pool{nullptr};

// A forked child has none of its parent's threads: it starts its own pool when it first needs
// one. (Settled at the fork, not by comparing getpid() on every call: that is a system call,
// and a one-row step asks for the pool a few hundred times.) The guard is held across the
// fork, so the child never inherits it locked by a thread it does not have.
void lock_pool_guard() {
  pool_guard.lock();
}
void unlock_pool_guard() {
  pool_guard.unlock();
}
void forget_pool_in_child() {
  current_pool.store(nullptr);
  pool_guard.unlock();
}

Workers& pool() {
  if (Workers* workers = current_pool.load(std::memory_order_acquire)) return *workers;
  std::lock_guard<std::mutex> lock(pool_guard);
  Workers* workers = current_pool.load();
  if (workers == nullptr) {
    static const bool registered =
        pthread_atfork(lock_pool_guard, unlock_pool_guard, forget_pool_in_child) == 0;
    (void)registered;
    // BATCHSCOPE_NATIVE_THREADS caps the threads (1: the calling thread only).
    int threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 8);
    const char* env = std::getenv("BATCHSCOPE_NATIVE_THREADS");
    if (env != nullptr && *env != 0) {  // set and not empty
      threads = std::clamp(std::atoi(env), 1, MAX_THREADS);
    }
    workers = new Workers(threads - 1);
    current_pool.store(workers, std::memory_order_release);
  }
  return *workers;
}

// A thread's share of a parallel_for: [begin, end) packed in one word, so that its owner
// (from the front) and a helper (from the back) claim chunks with one compare-exchange.
struct alignas(64) Share {
  std::atomic<uint64_t> range{0};
};

uint64_t pack(uint32_t begin, uint32_t end) {
  return static_cast<uint64_t>(end) << 32 | begin;
}

// Claims up to `chunk` items of the share and at most half of what is left of it (at least
// one), from its front or its back; false when it is empty. The last claims of a call are
// small, so a thread that has run out of work waits little for another's last claim.
bool take(Share& share, int chunk, bool front, int* begin, int* end) {
  uint64_t now = share.range.load(std::memory_order_relaxed);
  for (;;) {
    const auto lo = static_cast<uint32_t>(now), hi = static_cast<uint32_t>(now >> 32);
    if (lo >= hi) return false;
    const uint32_t n = std::min(static_cast<uint32_t>(chunk), (hi - lo + 1) / 2);
    const uint64_t next = front ? pack(lo + n, hi) : pack(lo, hi - n);
    if (share.range.compare_exchange_weak(now, next, std::memory_order_relaxed)) {
      *begin = static_cast<int>(front ? lo : hi - n);
      *end = *begin + static_cast<int>(n);
      return true;
    }
  }
}

}  // namespace

int parallel_threads() {
  return pool().count() + 1;
}

bool parallel_for(int count, int chunk, const std::function<void(int, int)>& body) {
  Workers& workers = pool();
  if (workers.count() == 0 || count <= chunk) return false;
  // Each thread takes its own contiguous share front to back, then helps the others from the
  // back of theirs. A thread's chunks follow one another in memory, so the weights it streams
  // stay one sequential stream (chunks dealt out in turn made every chunk start cold: a
  // one-row decode step took ~15% longer), and a thread that is late or preempted still has
  // its share finished by the others.
  const int threads = workers.count() + 1;
  Share shares[MAX_THREADS];
  for (int t = 0; t < threads; ++t) {
    const auto begin = static_cast<uint32_t>(static_cast<int64_t>(count) * t / threads);
    const auto end = static_cast<uint32_t>(static_cast<int64_t>(count) * (t + 1) / threads);
    shares[t].range.store(pack(begin, end), std::memory_order_relaxed);
  }
  std::atomic<int> arrived{0};
  const std::function<void()> job = [&] {
    const int me = arrived.fetch_add(1, std::memory_order_relaxed) % threads;
    int begin, end;
    while (take(shares[me], chunk, true, &begin, &end)) body(begin, end);
    for (int k = 1; k < threads; ++k) {
      Share& other = shares[(me + k) % threads];
      while (take(other, chunk, false, &begin, &end)) body(begin, end);
    }
  };
  return workers.run(job);
}

}  // namespace batchscope
