// Attention read straight from the paged KV pool, for all of a step's sequences in one MLX
// op: decode rows, prefill chunks and any other run of consecutive positions, each over its
// own context through its block table (no gather copy).
//
// A row's arithmetic depends on its query, its position and its context alone: the same bits
// whether it is a decode row, one row of a prefill chunk of any length, or shares the step
// with anything else (tests/engine/test_attention.py checks this).
#pragma once

#include <cstdint>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace batchscope {

namespace mx = mlx::core;

// q: (rows, heads, dim), the step's rows, sequence after sequence.
// k_pool, v_pool: (kv_heads, num_blocks * block_size, dim), as engine/kv_cache.py lays them
// out; float32, float16 or bfloat16: q's dtype, or any of them when q is float32 (a pool
// stored narrower than the model computes).
// block_tables: (seqs, max_blocks) int32, each sequence's blocks in order (padding is never
// read).
// context_lens: (seqs,) int32, how many positions each sequence's context holds, its rows
// included.
// query_lens: (seqs,) int32, how many rows of q each sequence has (1 <= n <= its context):
// its last positions, row i at position context_len - n + i, seeing positions up to its own.
// window: a sliding-window layer's row at position p sees only (p - window, p] (0: all).
// Returns (rows, heads * dim) in q's dtype.
mx::array paged_attention(
    const mx::array& q,
    const mx::array& k_pool,
    const mx::array& v_pool,
    const mx::array& block_tables,
    const mx::array& context_lens,
    const mx::array& query_lens,
    float scale,
    int block_size,
    int window = 0,
    mx::StreamOrDevice s = {});

// The kernel on memory already in place, for the op above and for ops that attend inside
// their own evaluation (decoder_layer.h): checks the tables before reading the pool, then
// runs on the calling thread and the worker pool. Shapes and dtypes as paged_attention's.
struct PagedAttentionArgs {
  const void* q;  // (rows, heads, dim)
  mx::Dtype q_dtype;
  const void* k;  // (kv_heads, slots, dim)
  const void* v;
  mx::Dtype pool_dtype;
  const int32_t* block_tables;  // (seqs, max_blocks)
  const int32_t* context_lens;  // (seqs,)
  const int32_t* query_lens;    // (seqs,)
  void* out;                    // (rows, heads * dim), q's dtype
  int rows, seqs, heads, kv_heads, dim, slots, max_blocks, block_size, window;
  float scale;
};
void paged_attention_rows(const PagedAttentionArgs& args);

// The cost (keys x query heads / 16, summed over a call's units of work) from which a call's
// attention is shared with the worker threads; returns the one it replaces. For the benchmark
// that measures the default (benchmarks/attention_threads.py); which thread computes a unit
// changes no bit.
double set_attention_parallel_cost(double cost);
double attention_parallel_cost();

// Throws std::invalid_argument naming the first bad context length, query length or block id
// (outside a pool of `slots` slots); paged_attention_rows calls it before reading the pool.
void check_block_tables(const int32_t* tables, const int32_t* context_lens,
                        const int32_t* query_lens, int seqs, int max_blocks, int block_size,
                        int slots);

class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(mx::Stream stream, float scale, int block_size, int window)
      : mx::Primitive(stream), scale_(scale), block_size_(block_size), window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "PagedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  int block_size_;
  int window_;
};

}  // namespace batchscope
