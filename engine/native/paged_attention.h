// Decode attention read straight from the paged KV pool: one MLX op for all of a step's
// decode rows, whatever their context lengths, instead of a few small ops per sequence.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace batchscope {

namespace mx = mlx::core;

// q: (rows, heads, dim), one query row per sequence.
// k_pool, v_pool: (kv_heads, num_blocks * block_size, dim), as engine/kv_cache.py lays them out.
// block_tables: (rows, max_blocks) int32, each row's blocks in order (padding is never read).
// context_lens: (rows,) int32, how many positions each row's context holds (>= 1).
// window: a sliding-window layer attends only to the last `window` positions of the context
// (0: all of them).
// Returns (rows, heads * dim) in q's dtype.
mx::array paged_decode_attention(
    const mx::array& q,
    const mx::array& k_pool,
    const mx::array& v_pool,
    const mx::array& block_tables,
    const mx::array& context_lens,
    float scale,
    int block_size,
    int window = 0,
    mx::StreamOrDevice s = {});

class PagedDecodeAttention : public mx::Primitive {
 public:
  PagedDecodeAttention(mx::Stream stream, float scale, int block_size, int window)
      : mx::Primitive(stream), scale_(scale), block_size_(block_size), window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "PagedDecodeAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  int block_size_;
  int window_;
};

}  // namespace batchscope
