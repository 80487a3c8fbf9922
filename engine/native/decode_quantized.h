// MLX's affine-quantized linear layer (nn.QuantizedLinear, 4 or 8 bits) for the few rows of a
// decode step: each packed weight group is read once for all of the step's rows and
// dequantized on the CPU, with the same arithmetic for a row whatever else is in the call
// (batch-invariant by construction) and on every instruction set it runs on.
#pragma once

#include <cstdint>
#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace batchscope {

namespace mx = mlx::core;

// x: (..., in) float32; w: (out, in * bits / 32) uint32 as MLX packs it (lowest bits first);
// scales, biases: (out, in / group_size), float16, bfloat16 or float32. Returns (..., out)
// float32: x @ (scales * q + biases).T. int8_activations: x quantized to 8 bits per row in
// blocks of 32 first, and the products summed as integers (quantized_int8.cpp): faster, and
// not the float32 result (an option, never the default).
mx::array decode_quantized_linear(const mx::array& x, const mx::array& w,
                                  const mx::array& scales, const mx::array& biases,
                                  int group_size, int bits, bool int8_activations = false,
                                  mx::StreamOrDevice s = {});

// The op's arithmetic on memory in place: x (M, K) float32 rows, w/scales/biases as above
// (scales and biases of scale_dtype), out (M, N). Runs on the calling thread and the worker
// pool; for ops that run linear layers inside their own evaluation (decoder_layer.h).
void quantized_linear_rows(const float* x, int M, int K, const uint32_t* w, const void* scales,
                           const void* biases, mx::Dtype scale_dtype, int N, int group_size,
                           int bits, float* out, bool int8_activations = false);

// The int8-activation arithmetic of quantized_linear_rows (quantized_int8.cpp).
void quantized_linear_rows_int8(const float* x, int M, int K, const uint32_t* w,
                                const void* scales, const void* biases, mx::Dtype scale_dtype,
                                int N, int group_size, int bits, float* out);

// Whether the int8-activation kernel has its AVX-512 VNNI path in this build (else portable).
bool quantized_int8_vnni_built();

// The instruction set the op uses: "avx512", "avx2" or "portable" (the best the build has: it is
// built for this CPU, simd.h), unless BATCHSCOPE_QUANTIZED_ISA or set_decode_quantized_isa
// chose another it also has).
std::string decode_quantized_isa();

// Forces a path (tests compare them): "auto", "avx512", "avx2" or "portable". Returns the one
// now in use; raises for a path this CPU (or build) does not have.
std::string set_decode_quantized_isa(const std::string& name);

class DecodeQuantizedLinear : public mx::Primitive {
 public:
  DecodeQuantizedLinear(mx::Stream stream, int group_size, int bits, bool int8_activations)
      : mx::Primitive(stream),
        group_size_(group_size),
        bits_(bits),
        int8_activations_(int8_activations) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "DecodeQuantizedLinear";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeQuantizedLinear&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ &&
           int8_activations_ == o.int8_activations_;
  }

 private:
  int group_size_;
  int bits_;
  bool int8_activations_;
};

}  // namespace batchscope
