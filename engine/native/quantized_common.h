// What the affine-quantized linear kernels share: how they read and prefetch a scale or bias,
// and which of their vector paths this build has.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mlx/dtype.h"
#include "simd.h"

// AVX-512 with the byte/word and 256-bit extensions: masked 16-bit loads (scales16).
#if BATCHSCOPE_HAS_AVX512 && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BATCHSCOPE_HAS_AVX512BW 1
#else
#define BATCHSCOPE_HAS_AVX512BW 0
#endif

// The int8-activation kernel's vector path (quantized_int8.cpp): that, and the VNNI extension
// (vpdpbusd).
#if BATCHSCOPE_HAS_AVX512BW && defined(__AVX512VNNI__)
#define BATCHSCOPE_HAS_VNNI 1
#else
#define BATCHSCOPE_HAS_VNNI 0
#endif

namespace batchscope {

enum class ScaleType { f32, f16, bf16 };

inline ScaleType scale_type_of(mx::Dtype dtype) {
  return dtype == mx::float16 ? ScaleType::f16 : dtype == mx::bfloat16 ? ScaleType::bf16
                                                                       : ScaleType::f32;
}

// A scale or bias as float32 (exact; float16 through F16C where the build has it: a scale and a
// bias are read per group per output, and a software conversion slowed a 1-row call in
// benchmarks/decode_linear.py --weights q4).
inline float scale_at(const void* p, ScaleType t, size_t i) {
  switch (t) {
    case ScaleType::f16: return to_float(static_cast<const mx::float16_t*>(p)[i]);
    case ScaleType::bf16: return to_float(static_cast<const mx::bfloat16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

#if BATCHSCOPE_HAS_AVX512BW
// The first min(n, 16) of sixteen lanes (n > 0).
inline __mmask16 first_lanes(int n) {
  return n >= 16 ? __mmask16{0xffff} : __mmask16((1u << n) - 1);
}

// Sixteen scales (or biases) from index at + g0 as float32: the values scale_at gives (exact
// conversions), zeros from index at + G on (the masked load reads nothing there).
template <ScaleType T>
inline __m512 scales16(const void* from, size_t at, int g0, int G) {
  const __mmask16 in = first_lanes(G - g0);
  if constexpr (T == ScaleType::f32) {
    return _mm512_maskz_loadu_ps(in, static_cast<const float*>(from) + at + g0);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(in, static_cast<const uint16_t*>(from) + at + g0);
    return T == ScaleType::f16
               ? _mm512_cvtph_ps(h)
               : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
#endif

// Prefetch the scales and biases of outputs [n, n + count), each output `groups` of them:
// a stream of their own beside the packed weights (which the kernels prefetch themselves), a
// cold miss per tile without it.
inline void prefetch_scales(const void* scales, const void* biases, ScaleType t, size_t groups,
                            int n, int count) {
  const size_t size = t == ScaleType::f32 ? 4 : 2;
  const size_t begin = n * groups * size, end = (n + count) * groups * size;
  for (const void* a : {scales, biases}) {
    const char* base = static_cast<const char*>(a);
    for (size_t b = begin; b < end; b += 64) __builtin_prefetch(base + b);
    __builtin_prefetch(base + end - 1);
  }
}

}  // namespace batchscope
