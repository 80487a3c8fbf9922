#include "workers.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <unistd.h>

namespace batchscope {

namespace {

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
  explicit Workers(int count) : pid_(getpid()), count_(count) {
    for (int i = 0; i < count; ++i) {
      std::thread([this] { loop(); }).detach();  // never joined: lives as long as the process
    }
  }

  int count() const {
    return count_;
  }
  pid_t pid() const {
    return pid_;
  }

  // Runs job() on the calling thread and on every worker that arrives while it is open; the
  // job must be safe to run any number of times at once (parallel_for's takes chunks from a
  // shared counter until none are left). Returns once the calling thread's run has ended and
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

  pid_t pid_;
  int count_;
  std::mutex busy_, mutex_;
  std::condition_variable wake_;
  std::atomic<unsigned> generation_{0};
  std::atomic<bool> closed_{true};
  std::atomic<int> active_{0};  // workers inside run's job (or checking whether it is open)
  const std::function<void()>* job_ = nullptr;
  std::exception_ptr worker_error_;
};

Workers& pool() {
  static std::mutex guard;
  static Workers* current = nullptr;
  std::lock_guard<std::mutex> lock(guard);
  // A forked child has none of its parent's threads: start its own.
  if (current == nullptr || current->pid() != getpid()) {
    // BATCHSCOPE_NATIVE_THREADS caps the threads (1: the calling thread only).
    int threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 8);
    const char* env = std::getenv("BATCHSCOPE_NATIVE_THREADS");
    if (env != nullptr && *env != 0) {  // set and not empty
      threads = std::clamp(std::atoi(env), 1, 64);
    }
    current = new Workers(threads - 1);
  }
  return *current;
}

}  // namespace

int parallel_threads() {
  return pool().count() + 1;
}

bool parallel_for(int count, int chunk, const std::function<void(int, int)>& body) {
  Workers& workers = pool();
  if (workers.count() == 0 || count <= chunk) return false;
  std::atomic<int> next{0};
  const std::function<void()> job = [&] {
    for (;;) {
      const int begin = next.fetch_add(chunk, std::memory_order_relaxed);
      if (begin >= count) return;
      body(begin, std::min(count, begin + chunk));
    }
  };
  return workers.run(job);
}

}  // namespace batchscope
