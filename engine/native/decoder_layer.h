// A whole llama-style decoder layer as one MLX op on the CPU, for a step's packed rows:
//
//   h = x + o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v)),  q, k, v = qkv(norm1(x))
//   out = h + down(silu(gate) * up),                                  gate, up = gate_up(norm2(h))
//
// with the step's keys and values written into the layer's paged pool before attention. Each
// part is the arithmetic of the native op it replaces (rms_norm_rows, the quantized or float32
// linear kernels, rope_rows, paged_attention) and the elementwise steps round as MLX's ops do
// (silu by MLX's sigmoid formula, then the products and sums one rounding each), so a layer
// gives the bits of the ops it fuses (tests/engine/test_decoder_layer.py). What it saves is
// dispatch: one op instead of the ~25 MLX ops of a layer, each of which costs more to schedule
// than to compute on a step of a few rows.
//
// The step's keys and values are written into the pool arrays given, in place, when the op is
// evaluated: MLX does not see that write (its multi-output ops keep one reference to their
// inputs per output, so a returned pool could never reuse the input's memory, and a copy of
// the pool per layer and step would cost more than the op saves). The engine's pool arrays
// are read only by later ops of the same stream, which run after it, and callers evaluate the
// op's output before they read the pool (engine/model_runner.py).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace batchscope {

namespace mx = mlx::core;

// One linear layer's weights: `weight` float32 with bits 0, in the layout pack_linear_weight
// makes of (out, in) (decode_linear.h); or MLX's affine
// quantization, `weight` uint32 (out, in * bits / 32) with `scales` and `biases` (out, in /
// group_size), bits 4 or 8, group_size 32, 64 or 128.
struct Linear {
  mx::array weight;
  std::optional<mx::array> scales, biases;
  int bits = 0;
  int group_size = 0;
  bool int8_activations = false;  // quantized layers: decode_quantized_linear's option
};

// RoPE of q and k at each row's position, as rope_rows takes it (row_ops.h): inv_freqs
// (dims / 2,) float32.
struct Rope {
  mx::array inv_freqs;
  int dims;
  bool traditional;
  float scale;
};

// A layer as its caller names it. qkv: q, k and v stacked by output ((heads + 2 * kv_heads) *
// head_dim outputs); gate_up: gate and up stacked (2 * intermediate outputs). The q, k and v
// biases: all three or none; q_norm and k_norm (per-head RMS norm weights, (head_dim,)): both
// or neither; rope: none for a layer without RoPE. block_size: the pool's; window: a sliding
// layer's (0: the whole context).
struct LayerFields {
  mx::array attn_norm, mlp_norm;
  float norm_eps;
  Linear qkv, o, gate_up, down;
  std::optional<mx::array> q_bias, k_bias, v_bias;
  std::optional<mx::array> q_norm, k_norm;
  float qk_norm_eps;
  int heads, kv_heads, head_dim;
  std::optional<Rope> rope;
  float attn_scale;
  int block_size, window;
};

// What the op needs besides its inputs: the sizes, the kinds of its linear layers and where
// each array it reads sits in one list (x first, then the spec's weights, then the step's pool
// and tables from `pool` on; the op's graph inputs are only x and the step's arrays).
struct LayerLayout {
  int hidden, intermediate, heads, kv_heads, head_dim;
  float norm_eps, qk_norm_eps;
  bool qkv_bias, qk_norm, rope;
  int rope_dims;
  bool rope_traditional;
  float rope_scale, attn_scale;
  int block_size, window;
  int bits[4], group_size[4];  // qkv, o, gate_up, down
  bool int8_activations[4];
  int first[4];                // index of each linear's first input
  int attn_norm, mlp_norm, bias, qk_norms, inv_freqs, pool;
};

// A layer's fields, checked once when it is made (std::invalid_argument naming the field),
// with what every step's op takes from them: the layout and the weights in input order.
class LayerSpec : public LayerFields {
 public:
  explicit LayerSpec(LayerFields fields);

  const LayerLayout& layout() const {
    return layout_;
  }
  const std::shared_ptr<const std::vector<mx::array>>& weights() const {
    return weights_;
  }

 private:
  LayerLayout layout_;
  std::shared_ptr<const std::vector<mx::array>> weights_;
};

// Consecutive layers (specs, in order) as one op on one step's rows: the first reads x, each
// later one the output of the one before. x: (rows, hidden) or (1, rows, hidden) float32;
// k_pools, v_pools: each layer's, as paged_attention takes them; slots: the pool slot each row
// writes (rows,) int32; positions (rows,) int32; block tables, context and query lengths: as
// paged_attention takes them, one set for all the layers (which share a window). Returns out
// (x's shape) and writes each layer's rows' keys and values into its pools at `slots` (rounded
// to the pool's dtype). The same bits as one op per layer, with one op to schedule.
mx::array decoder_layers(const mx::array& x, const std::vector<const LayerSpec*>& specs,
                         const std::vector<mx::array>& k_pools,
                         const std::vector<mx::array>& v_pools, const mx::array& slots,
                         const mx::array& positions, const mx::array& block_tables,
                         const mx::array& context_lens, const mx::array& query_lens,
                         mx::StreamOrDevice s = {});

class DecoderLayer : public mx::Primitive {
 public:
  // A layer as the op runs it: its layout and its spec's weights, which the op reads besides
  // its inputs (they stay evaluated and alive as long as an op holds them).
  struct Layer {
    LayerLayout layout;
    std::shared_ptr<const std::vector<mx::array>> weights;
  };

  DecoderLayer(mx::Stream stream, std::shared_ptr<const std::vector<Layer>> layers)
      : mx::Primitive(stream), layers_(std::move(layers)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DecoderLayer";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return false;  // never merged with another layer's op
  }

 private:
  std::shared_ptr<const std::vector<Layer>> layers_;  // shared with the evaluating task
};

}  // namespace batchscope
