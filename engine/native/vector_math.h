// Elementwise math shared by the native ops, written so the compiler can vectorize the loops
// that call it without changing a bit (each lane does the scalar code's operations). The
// files that include it are built with -ffp-contract=off.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace batchscope {

// exp(x) for x <= 0 by the formula MLX's CPU exp uses (Cephes' exp2 polynomial on the
// fraction of x * log2(e), with fused multiply-adds, times 2^integer part; 0 below -88, and
// for -inf), so each value is the one mlx.core.exp gives.
inline float exp_nonpositive(float x) {
  const float t = x * 1.442695f;
  const float ipart = std::floor(t + 0.5f);
  const float f = t - ipart;
  float p = 1.535336188319500e-4f;
  p = std::fma(p, f, 1.339887440266574e-3f);
  p = std::fma(p, f, 9.618437357674640e-3f);
  p = std::fma(p, f, 5.550332471162809e-2f);
  p = std::fma(p, f, 2.402264791363012e-1f);
  p = std::fma(p, f, 6.931472028550421e-1f);
  p = std::fma(p, f, 1.0f);
  const int32_t bits = (static_cast<int32_t>(x < -88.0f ? 0.0f : ipart) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -88.0f ? 0.0f : scale * p;
}

// exp(x) for any x by MLX's CPU exp formula (the one above, with its NaN, overflow and
// underflow cases), as mlx.core.exp and MLX's sigmoid compute it. Branch-free, so a loop over
// it vectorizes: the integer part is clamped where the result is replaced anyway.
inline float exp_mlx(float x) {
  const float t = x * 1.442695f;
  const float ipart = std::floor(t + 0.5f);
  const float f = t - ipart;
  float p = 1.535336188319500e-4f;
  p = std::fma(p, f, 1.339887440266574e-3f);
  p = std::fma(p, f, 9.618437357674640e-3f);
  p = std::fma(p, f, 5.550332471162809e-2f);
  p = std::fma(p, f, 2.402264791363012e-1f);
  p = std::fma(p, f, 6.931472028550421e-1f);
  p = std::fma(p, f, 1.0f);
  const float clamped = std::fmin(std::fmax(ipart, -127.0f), 127.0f);  // |x| <= 88: as is
  const int32_t bits = (static_cast<int32_t>(clamped) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  float r = scale * p;
  r = x > 88.0f ? INFINITY : r;
  r = x < -88.0f ? 0.0f : r;
  return x != x ? x : r;  // NaN
}

}  // namespace batchscope
