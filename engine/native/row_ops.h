// Per-row ops of a step on the CPU: RMS norm, RoPE at each row's own position, greedy sampling
// and the quantized embedding of each row's token, one MLX primitive each instead of the
// handful of ops MLX's CPU ops build (on a decode step of a few rows each op costs more in
// dispatch than in arithmetic). Each row is computed alone, in a fixed order, so a row gets the
// same bits whatever shares its step.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace batchscope {

namespace mx = mlx::core;

// x: (..., D) float32, weight: (D,) float32. x * rsqrt(mean(x * x) + eps) * weight, as
// mlx.core.fast.rms_norm computes it (the mean summed in another order).
mx::array rms_norm_rows(const mx::array& x, const mx::array& weight, float eps,
                        mx::StreamOrDevice s = {});

// x: (rows, heads, head_dim) float32, positions: (rows,) int32, inv_freqs: (dims / 2,)
// float32. Rotates the first `dims` of every head of row r at angle positions[r] * scale *
// inv_freqs[i], pairs (i, i + dims / 2), or (2i, 2i + 1) when traditional, as
// mlx.core.fast.rope does with an array offset; the rest of each head is copied.
mx::array rope_rows(const mx::array& x, const mx::array& positions, const mx::array& inv_freqs,
                    int dims, bool traditional, float scale, mx::StreamOrDevice s = {});

// x: (rows, V) float32. max + log(sum(exp(x - max))) of each row, each exp the value
// mlx.core.exp gives (the sum in another order), as mlx.core.logsumexp(x, axis=-1) computes it
// up to float32 rounding, and faster than MLX's CPU op over a vocabulary's worth of columns
// (tests/engine/test_row_ops.py checks the bits).
mx::array logsumexp_rows(const mx::array& x, mx::StreamOrDevice s = {});

// x: (rows, V) float32 logits. Per row, the greedy token and its logprob as the sampler's MLX
// ops give them: i = argmax(x - logsumexp(x)) (the first index of the largest, MLX's argmax),
// and x[i] - logsumexp(x), the logsumexp that of logsumexp_rows. Returns {(rows,) uint32,
// (rows,) float32}: one op where MLX's ops take seven, and after the logsumexp one pass over
// the vocabulary where theirs make two (the subtraction written out, then the argmax).
std::vector<mx::array> greedy_rows(const mx::array& x, mx::StreamOrDevice s = {});

// MLX's affine-quantized embedding (mlx.nn.QuantizedEmbedding) of `ids`, (rows,) int32 or
// uint32: w
// (V, D * bits / 32) uint32, scales and biases (V, D / group_size) float32, float16 or
// bfloat16, bits 4 or 8. Row r is table row ids[r] as mlx.core.dequantize computes it on the
// CPU: each packed value converted to the scales' type, times its group's scale, plus its
// bias, each step rounded in that type (MLX's astype, multiply and add ops). Returns (rows, D)
// in the scales' type. One op where MLX's CPU dequantize builds ~40 for a step's tokens; an
// id outside [0, V) gives a row of NaN (the engine refuses such ids before a step).
mx::array quantized_embedding_rows(const mx::array& w, const mx::array& scales,
                                   const mx::array& biases, const mx::array& ids,
                                   int group_size, int bits, mx::StreamOrDevice s = {});

// The norm's and RoPE's arithmetic on memory in place (out may be x for the norm), for ops
// that run them inside their own evaluation (decoder_layer.h). x: `rows` rows of D floats;
// for RoPE row r's heads start at x + r * row_stride and out is (rows, heads, dim).
void rms_norm_rows_into(const float* x, const float* w, size_t rows, int D, float eps,
                        float* out);
void rope_rows_into(const float* x, size_t row_stride, const int32_t* positions,
                    const float* inv_freqs, int rows, int heads, int dim, int dims,
                    bool traditional, float scale, float* out);

class LogSumExpRows : public mx::Primitive {
 public:
  explicit LogSumExpRows(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "LogSumExpRows";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

class RmsNormRows : public mx::Primitive {
 public:
  RmsNormRows(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "RmsNormRows";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNormRows&>(other).eps_;
  }

 private:
  float eps_;
};

class GreedyRows : public mx::Primitive {
 public:
  explicit GreedyRows(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "GreedyRows";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

class QuantizedEmbeddingRows : public mx::Primitive {
 public:
  QuantizedEmbeddingRows(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "QuantizedEmbeddingRows";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedEmbeddingRows&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

 private:
  int group_size_;
  int bits_;
};

class RopeRows : public mx::Primitive {
 public:
  RopeRows(mx::Stream stream, int dims, bool traditional, float scale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "RopeRows";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RopeRows&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

}  // namespace batchscope
