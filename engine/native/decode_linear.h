// A float32 linear layer for the few rows of a decode step: x @ weight.T, reading each weight
// row once for all of the step's rows, with the same arithmetic for a row whatever else is in
// the call (batch-invariant by construction).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace batchscope {

namespace mx = mlx::core;

// x: (..., in_features) float32; weight: (out_features, in_features) float32, as an mlx
// nn.Linear holds it. Returns (..., out_features).
mx::array decode_linear(const mx::array& x, const mx::array& weight, mx::StreamOrDevice s = {});

// The op's arithmetic on memory in place: x (M, K), w (N, K), out (M, N), float32. Runs on the
// calling thread and the worker pool (decoder_layer.h).
void linear_rows(const float* x, const float* w, float* out, int M, int K, int N);

class DecodeLinear : public mx::Primitive {
 public:
  explicit DecodeLinear(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DecodeLinear";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

}  // namespace batchscope
