// The Gated DeltaNet recurrence (Qwen3.5 / Qwen3-Next linear attention) of a step's packed rows
// as one MLX op on the CPU, float32: per sequence (group), the depthwise conv over its conv
// state and rows then SiLU, q and k L2-normalized (q scaled by 1 / Dk), beta = sigmoid(b),
// g = exp(-exp(A_log) * softplus(a + dt_bias)), and per value head the delta rule
//
//   S *= g;  kv = S k;  delta = (v - kv) * beta;  S += delta k^T;  y = S q
//
// (S: Dv x Dk, float32), as mlx-lm's GatedDeltaNet computes it (engine/recurrence.py holds the
// MLX-ops version). Threads split the (group, value head) pairs, each sequential over its rows;
// every sum has a fixed order and a row's arithmetic reads only its own sequence, so a row's
// bits do not depend on what shares the step, nor on how a sequence is cut into steps.
//
// The conv and recurrent states are written into the pool arrays given, in place, when the op
// is evaluated, for the reason decoder_layer.h gives for its KV pool: a returned pool would be
// a copy per layer and step. Callers evaluate y before they read the pools.
#pragma once

#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace batchscope {

namespace mx = mlx::core;

struct GatedDeltaLayout {
  int k_heads, v_heads, k_dim, v_dim, kernel;  // kernel: the conv's taps (K)
  std::vector<int> row_group;                  // each row's group
  std::vector<int> group_first, group_slot;    // each group's first row and slot
  std::vector<int> snap_slot;                  // per row: its snapshot slot, or -1
};

// qkv: (rows, 2 * Hk * Dk + Hv * Dv) float32 ([q | k | v], before the conv); a, b: (rows, Hv);
// conv_weight: (conv_dim, K, 1); A_log, dt_bias: (Hv,); conv_pool: (slots, K - 1, conv_dim);
// state_pool: (slots, Hv, Dv, Dk); all float32, the pools evaluated and row-contiguous.
// groups: (num_rows, slot) per sequence in row order; snapshots: (row, slot), the row's group's
// states after that row also written to that slot. Returns y (rows, Hv, Dv).
mx::array gated_delta_rows(const mx::array& qkv, const mx::array& a, const mx::array& b,
                           const mx::array& conv_weight, const mx::array& A_log,
                           const mx::array& dt_bias, const mx::array& conv_pool,
                           const mx::array& state_pool,
                           const std::vector<std::pair<int, int>>& groups,
                           const std::vector<std::pair<int, int>>& snapshots, int k_heads,
                           int v_heads, int k_dim, int v_dim, mx::StreamOrDevice s = {});

class GatedDeltaRows : public mx::Primitive {
 public:
  GatedDeltaRows(mx::Stream stream, GatedDeltaLayout layout)
      : mx::Primitive(stream), layout_(std::move(layout)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "GatedDeltaRows";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return false;  // it writes its pools: never merged with another
  }

 private:
  GatedDeltaLayout layout_;
};

}  // namespace batchscope
