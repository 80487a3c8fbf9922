// A float32 linear layer for the rows of a step: x @ weight.T from weights packed once for it
// (pack_linear_weight), with the same arithmetic for a row whatever else is in the call
// (batch-invariant by construction) and on every instruction-set path.
#pragma once

#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "simd.h"

namespace batchscope {

namespace mx = mlx::core;

// The packed layout: weight (out, in) as (panels, in, LINEAR_PANEL), panels = ceil(out / 64).
// Panel p holds outputs [64p, 64p + 64) k-major (element [p][k][j] is weight[64p + j][k]),
// zero past `out`. A k step of the kernel reads one panel row: 64 contiguous weights.
constexpr int LINEAR_PANEL = 64;

// weight (out, in) float32 -> its packed layout (a new array: the kernel's own copy).
mx::array pack_linear_weight(const mx::array& weight, mx::StreamOrDevice s = {});

// x: (..., in) float32; packed: pack_linear_weight of an (out_features, in) weight. Returns
// (..., out_features). isa: "auto" (the best this build has), "avx512", "avx2" or "portable".
mx::array decode_linear(const mx::array& x, const mx::array& packed, int out_features,
                        const std::string& isa = "auto", mx::StreamOrDevice s = {});

// The op's arithmetic on memory in place: x (M, K), packed (ceil(N / 64), K, 64), out (M, N),
// float32. Runs on the calling thread and the worker pool (decoder_layer.h).
void linear_rows(const float* x, const float* packed, float* out, int M, int K, int N,
                 Isa isa = BEST_ISA);

class DecodeLinear : public mx::Primitive {
 public:
  DecodeLinear(mx::Stream stream, int out_features, Isa isa)
      : mx::Primitive(stream), out_features_(out_features), isa_(isa) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DecodeLinear";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeLinear&>(other);
    return out_features_ == o.out_features_ && isa_ == o.isa_;
  }

 private:
  int out_features_;
  Isa isa_;
};

}  // namespace batchscope
