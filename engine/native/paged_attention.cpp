#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "cpu_dispatch.h"
#include "inputs.h"
#include "paged_attention_rows.h"
#include "workers.h"

// The op: its checks, the units of work a step's rows make and the threads that run them
// (paged_attention_rows.h describes the arithmetic).

namespace batchscope {

using attention::LANES;
using attention::Scratch;
using attention::Shapes;
using attention::Unit;

namespace {

constexpr Check check{"paged_attention"};

// A call's attention goes to the worker threads from this cost (keys x query heads / 16 for
// each unit, a kv head of a sequence's rows, summed) on; below it, handing it over costs more
// than it saves. 30 is one decode row of the embedded model (3 kv heads of 3 query heads, so
// its units go 2:1 to two threads) at ~53 keys: against the row on one thread, the step was
// level at 40 keys and faster from 70 on (benchmarks/results/attention_threads.md).
std::atomic<double> parallel_cost{30};

template <typename R, typename T>
void run_units(const std::vector<Unit>& units, const std::vector<int>& row0s, const R* q,
               const T* k, const T* v, const int32_t* tables, const int32_t* ctx_lens,
               const int32_t* q_lens, R* out, const Shapes& s) {
  auto part = [&](int begin, int end) {
    thread_local Scratch scratch;
    Scratch& w = scratch;  // one lookup of the thread's scratch, not one per use
    for (int i = begin; i < end; ++i) {
      const Unit& u = units[i];
      const int32_t* table = tables + static_cast<size_t>(u.seq) * s.max_blocks;
      if (q_lens[u.seq] == 1) {
        Unit d = u;
        d.row_begin = row0s[u.seq];
        decode_unit<R, T>(d, q, k, v, table, ctx_lens[u.seq], out, s, w);
      } else {
        tile_unit<R, T>(u, row0s[u.seq], q, k, v, table, ctx_lens[u.seq], q_lens[u.seq], out,
                        s, w);
      }
    }
  };
  const int count = static_cast<int>(units.size());
  double cost = 0;
  for (const Unit& u : units) cost += u.cost;
  if (cost < parallel_cost.load(std::memory_order_relaxed) || !parallel_for(count, 1, part)) {
    part(0, count);
  }
}

}  // namespace

mx::array paged_attention(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                          const mx::array& block_tables, const mx::array& context_lens,
                          const mx::array& query_lens, float scale, int block_size, int window,
                          mx::StreamOrDevice s) {
  check(q.ndim() == 3, "q must be (rows, heads, dim)");
  check(k_pool.ndim() == 3 && v_pool.shape() == k_pool.shape(),
        "k_pool and v_pool must both be (kv_heads, slots, dim)");
  check(k_pool.shape(2) == q.shape(2), "q and the pool disagree on dim");
  check(q.shape(1) % k_pool.shape(0) == 0, "heads must be a multiple of kv_heads");
  check(block_size > 0 && k_pool.shape(1) % block_size == 0,
        "the pool's slots must be whole blocks");
  check(block_tables.ndim() == 2, "block_tables must be (seqs, max_blocks)");
  check(context_lens.ndim() == 1 && context_lens.shape(0) == block_tables.shape(0) &&
            query_lens.ndim() == 1 && query_lens.shape(0) == block_tables.shape(0),
        "block_tables must be (seqs, max_blocks), context_lens and query_lens (seqs,)");
  check(window >= 0, "window must be >= 0 (0: the whole context)");
  auto floating = [](mx::Dtype t) {
    return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
  };
  check(floating(q.dtype()), "q must be float32, float16 or bfloat16");
  check(k_pool.dtype() == v_pool.dtype() && floating(k_pool.dtype()),
        "the pool must be float32, float16 or bfloat16, keys and values alike");
  check(k_pool.dtype() == q.dtype() || q.dtype() == mx::float32,
        "a pool of another dtype than q needs float32 q (q and the pool must have one dtype "
        "otherwise)");
  auto stream = mx::to_stream(s);
  auto int32 = [&](const mx::array& a) {
    return row_contiguous(a.dtype() == mx::int32 ? a : mx::astype(a, mx::int32, stream), stream);
  };
  std::vector<mx::array> inputs = {
      row_contiguous(q, stream), row_contiguous(k_pool, stream),
      row_contiguous(v_pool, stream), int32(block_tables), int32(context_lens),
      int32(query_lens)};
  return mx::array({q.shape(0), q.shape(1) * q.shape(2)}, q.dtype(),
                   std::make_shared<PagedAttention>(stream, scale, block_size, window),
                   std::move(inputs));
}

void check_block_tables(const int32_t* tables, const int32_t* context_lens,
                        const int32_t* query_lens, int seqs, int max_blocks, int block_size,
                        int slots) {
  const int blocks = slots / block_size;
  for (int i = 0; i < seqs; ++i) {
    const int len = context_lens[i], qlen = query_lens[i];
    if (len < 1 || (len + block_size - 1) / block_size > max_blocks) {
      throw std::invalid_argument("paged_attention: a context length is out of range");
    }
    if (qlen < 1 || qlen > len) {
      throw std::invalid_argument(
          "paged_attention: a query length is out of range (1 to its context length)");
    }
    for (int b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int id = tables[static_cast<size_t>(i) * max_blocks + b];
      if (id < 0 || id >= blocks) {
        throw std::invalid_argument("paged_attention: a block id is out of range");
      }
    }
  }
}

double attention_parallel_cost() {
  return parallel_cost.load();
}

double set_attention_parallel_cost(double cost) {
  check(cost >= 0, "the parallel cost must be >= 0");
  return parallel_cost.exchange(cost);
}

void paged_attention_rows(const PagedAttentionArgs& a) {
  const Shapes s{a.rows,       a.seqs,       a.heads,      a.kv_heads,
                 a.dim,        a.slots,      a.max_blocks, a.block_size,
                 a.window,     (a.dim + 7) / 8 * 8,        (a.dim + 15) / 16 * 16,
                 a.scale};
  const int32_t* table_ptr = a.block_tables;
  const int32_t* len_ptr = a.context_lens;
  const int32_t* qlen_ptr = a.query_lens;
  // Bad tables would read outside the pool: check everything before touching it.
  check_block_tables(table_ptr, len_ptr, qlen_ptr, s.seqs, s.max_blocks, s.block_size, s.slots);
  long total_rows = 0;
  std::vector<int> row0s(s.seqs);
  std::vector<Unit> units;
  const int rep = s.heads / s.kv_heads;
  for (int i = 0; i < s.seqs; ++i) {
    const int len = len_ptr[i], qlen = qlen_ptr[i];
    row0s[i] = static_cast<int>(total_rows);
    total_rows += qlen;
    for (int g = 0; g < s.kv_heads; ++g) {
      if (qlen == 1) {
        const int span = s.window > 0 ? std::min(len, s.window) : len;
        units.push_back({i, g, 0, 1, static_cast<double>(span) * rep / LANES});
        continue;
      }
      for (int r = 0; r < qlen; r += LANES) {
        const int rows = std::min(LANES, qlen - r);
        const int last = len - qlen + r + rows;  // keys up to here
        const int span = s.window > 0 ? std::min(last, s.window + rows) : last;
        units.push_back({i, g, r, rows, static_cast<double>(span) * rep});
      }
    }
  }
  if (total_rows != s.rows) {
    throw std::invalid_argument("paged_attention: query_lens must add up to q's rows");
  }
  // The longest first, so the threads finish together; a unit's bits do not depend on
  // which thread runs it, or when.
  std::stable_sort(units.begin(), units.end(),
                   [](const Unit& x, const Unit& y) { return x.cost > y.cost; });
  auto run = [&](auto* r_tag, auto* t_tag) {
    using R = std::remove_pointer_t<decltype(r_tag)>;
    using T = std::remove_pointer_t<decltype(t_tag)>;
    run_units<R, T>(units, row0s, static_cast<const R*>(a.q), static_cast<const T*>(a.k),
                    static_cast<const T*>(a.v), table_ptr, len_ptr, qlen_ptr,
                    static_cast<R*>(a.out), s);
  };
  auto pool_is = [&](auto* r_tag) {
    switch (a.pool_dtype) {
      case mx::float32: return run(r_tag, static_cast<float*>(nullptr));
      case mx::float16: return run(r_tag, static_cast<mx::float16_t*>(nullptr));
      default: return run(r_tag, static_cast<mx::bfloat16_t*>(nullptr));
    }
  };
  switch (a.q_dtype) {
    case mx::float32: return pool_is(static_cast<float*>(nullptr));
    case mx::float16: return run(static_cast<mx::float16_t*>(nullptr),
                                 static_cast<mx::float16_t*>(nullptr));
    default: return run(static_cast<mx::bfloat16_t*>(nullptr),
                        static_cast<mx::bfloat16_t*>(nullptr));
  }
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  auto& out = allocate(outputs[0]);
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  PagedAttentionArgs args{nullptr, q.dtype(), nullptr, nullptr, k.dtype(), nullptr, nullptr,
                          nullptr, nullptr, static_cast<int>(q.shape(0)),
                          static_cast<int>(inputs[3].shape(0)), static_cast<int>(q.shape(1)),
                          static_cast<int>(k.shape(0)), static_cast<int>(q.shape(2)),
                          static_cast<int>(k.shape(1)), static_cast<int>(inputs[3].shape(1)),
                          block_size_, window_, scale_};
  dispatch(stream(), inputs, out,
           [q = mx::array::unsafe_weak_copy(q), k = mx::array::unsafe_weak_copy(k),
            v = mx::array::unsafe_weak_copy(inputs[2]),
            tables = mx::array::unsafe_weak_copy(inputs[3]),
            lens = mx::array::unsafe_weak_copy(inputs[4]),
            qlens = mx::array::unsafe_weak_copy(inputs[5]),
            out = mx::array::unsafe_weak_copy(out), args]() mutable {
             args.q = q.data<void>();
             args.k = k.data<void>();
             args.v = v.data<void>();
             args.block_tables = tables.data<int32_t>();
             args.context_lens = lens.data<int32_t>();
             args.query_lens = qlens.data<int32_t>();
             args.out = out.data<void>();
             paged_attention_rows(args);
           });
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "paged_attention runs on the CPU only; on a GPU the engine uses MLX's fused attention");
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedAttention&>(other);
  return scale_ == o.scale_ && block_size_ == o.block_size_ && window_ == o.window_;
}

}  // namespace batchscope
