// Elementwise math and a fixed-order lane sum shared by the native ops, written so the compiler
// can vectorize the loops that call it without changing a bit (each lane does the scalar code's
// operations). The files that include it are built with -ffp-contract=off.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace batchscope {

// MLX's CPU exp formula (Cephes' exp2 polynomial on the fraction of x * log2(e), with fused
// multiply-adds), written once: log2(e) as MLX rounds it, the polynomial's coefficients from
// the highest power down (each step one fma, p = fma(p, f, c)), and the input below which the
// result is 0 (above its negation, inf). The vector versions (simd.h) take the same steps.
constexpr float EXP_LOG2E = 1.442695f;
constexpr int EXP_TERMS = 7;
constexpr float EXP_POLY[EXP_TERMS] = {1.535336188319500e-4f, 1.339887440266574e-3f,
                                       9.618437357674640e-3f, 5.550332471162809e-2f,
                                       2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
constexpr float EXP_LOWEST = -88.0f;

// The polynomial, and in *ipart the integer part it is scaled by.
inline float exp_fraction(float x, float* ipart) {
  const float t = x * EXP_LOG2E;
  *ipart = std::floor(t + 0.5f);
  const float f = t - *ipart;
  float p = EXP_POLY[0];
  p = std::fma(p, f, EXP_POLY[1]);
  p = std::fma(p, f, EXP_POLY[2]);
  p = std::fma(p, f, EXP_POLY[3]);
  p = std::fma(p, f, EXP_POLY[4]);
  p = std::fma(p, f, EXP_POLY[5]);
  return std::fma(p, f, EXP_POLY[6]);
}

// 2^ipart as a float, for an integer-valued ipart in [-127, 127].
inline float exp2_int(float ipart) {
  const int32_t bits = (static_cast<int32_t>(ipart) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return scale;
}

// exp(x) for x <= 0 by MLX's formula (0 below -88, and for -inf), so each value is the one
// mlx.core.exp gives.
inline float exp_nonpositive(float x) {
  float ipart;
  const float p = exp_fraction(x, &ipart);
  return x < EXP_LOWEST ? 0.0f : exp2_int(x < EXP_LOWEST ? 0.0f : ipart) * p;
}

// exp(x) for any x by MLX's formula, with its NaN, overflow and underflow cases, as
// mlx.core.exp and MLX's sigmoid compute it. Branch-free, so a loop over it vectorizes: the
// integer part is clamped where the result is replaced anyway.
inline float exp_mlx(float x) {
  float ipart;
  const float p = exp_fraction(x, &ipart);
  // The clamp as compares, not std::fmin/fmax: those are library calls (their NaN rule) that
  // keep the loop scalar; a NaN ipart (x NaN) is replaced below either way.
  ipart = ipart < -127.0f ? -127.0f : ipart;
  ipart = ipart > 127.0f ? 127.0f : ipart;
  float r = exp2_int(ipart) * p;  // |x| <= 88: as is
  r = x > -EXP_LOWEST ? INFINITY : r;
  r = x < EXP_LOWEST ? 0.0f : r;
  return x != x ? x : r;  // NaN
}

// The sum of 16 lanes by a fixed tree: lane i + lane i + 8, then + 4, then (0 + 2) + (1 + 3)
// (decode_linear's tree, and the paged attention's softmax sum).
inline float lane_sum(const float* a) {
  float b[8], c[4];
  for (int i = 0; i < 8; ++i) b[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) c[i] = b[i] + b[i + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

}  // namespace batchscope
