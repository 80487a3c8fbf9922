// The native kernels' vector of 16 floats, and the instruction sets it is built for.
//
// The module is compiled on the machine that runs it, for that CPU (-march=native where the
// compiler takes it; CMakeLists.txt), so an instruction set is chosen at compile time:
// Vec<Isa::avx512> (one 512-bit register) exists when the build has AVX-512F, Vec<Isa::avx2>
// (two 256-bit registers) when it has AVX2, FMA and F16C, and Vec<Isa::portable> (plain C++,
// which the compiler vectorizes for what the CPU has, NEON included) always. BEST_ISA is the
// widest of them, the one the kernels use; the quantized linear keeps the narrower ones too
// and picks one at run time (decode_quantized.h), so the tests compare them on one machine.
//
// Each operation rounds once per lane (fma: one fused multiply-add) at every level, so code
// written with them gives the same bits on each. The files that use it are built with
// -ffp-contract=off: no fma but the written ones.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/types/half_types.h"
#include "vector_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BATCHSCOPE_HAS_AVX2 1
#else
#define BATCHSCOPE_HAS_AVX2 0
#endif
#if defined(__AVX512F__) && BATCHSCOPE_HAS_AVX2
#define BATCHSCOPE_HAS_AVX512 1
#else
#define BATCHSCOPE_HAS_AVX512 0
#endif

namespace batchscope {

namespace mx = mlx::core;

enum class Isa { portable = 0, avx2 = 1, avx512 = 2 };

constexpr Isa BEST_ISA = BATCHSCOPE_HAS_AVX512 ? Isa::avx512
                         : BATCHSCOPE_HAS_AVX2 ? Isa::avx2
                                               : Isa::portable;

// Whether this build has Vec<isa> (every level up to BEST_ISA).
constexpr bool isa_built(Isa isa) {
  return static_cast<int>(isa) <= static_cast<int>(BEST_ISA);
}

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "portable";
  }
}

// An instruction set by name: "auto" (BEST_ISA), "avx512", "avx2" or "portable"; false for
// any other name. Whether this build has it is isa_built's question.
inline bool parse_isa(const std::string& name, Isa* isa) {
  if (name == "auto") *isa = BEST_ISA;
  else if (name == "avx512") *isa = Isa::avx512;
  else if (name == "avx2") *isa = Isa::avx2;
  else if (name == "portable") *isa = Isa::portable;
  else return false;
  return true;
}

// Exact conversions of the pools' and scales' storage to float32.
inline float to_float(float x) {
  return x;
}
inline float to_float(mx::float16_t x) {
#if defined(__F16C__)
  uint16_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(x);
#endif
}
inline float to_float(mx::bfloat16_t x) {
  uint16_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

template <Isa I>
struct Vec;

// Each level below defines, for V = Vec<its Isa>: V::zero(), V::bcast(x), V::load(p) (16
// floats, or 16 float16 / bfloat16 values widened exactly), v.store(p); fma(a, b, c) = a * b + c
// rounded once; add, sub, mul, max; exp_lanes (exp_nonpositive of vector_math.h on each lane,
// the same operations); lane_sum (vector_math.h's tree); pin (keeps a loaded vector in its
// register where the compiler would reload it from memory for each use).

// ---- portable: plain C++ -----------------------------------------------------------------

template <>
struct Vec<Isa::portable> {
  float x[16];
  static Vec zero() { return {}; }
  static Vec bcast(float s) {
    Vec r;
    std::fill(r.x, r.x + 16, s);
    return r;
  }
  static Vec load(const float* p) {
    Vec r;
    std::memcpy(r.x, p, sizeof(r.x));
    return r;
  }
  template <typename T>
  static Vec load(const T* p) {
    Vec r;
    for (int l = 0; l < 16; ++l) r.x[l] = to_float(p[l]);
    return r;
  }
  void store(float* p) const { std::memcpy(p, x, sizeof(x)); }
};
using VecPortable = Vec<Isa::portable>;

inline VecPortable fma(VecPortable a, VecPortable b, VecPortable c) {
  for (int l = 0; l < 16; ++l) c.x[l] = std::fma(a.x[l], b.x[l], c.x[l]);
  return c;
}
inline VecPortable add(VecPortable a, VecPortable b) {
  for (int l = 0; l < 16; ++l) a.x[l] += b.x[l];
  return a;
}
inline VecPortable sub(VecPortable a, VecPortable b) {
  for (int l = 0; l < 16; ++l) a.x[l] -= b.x[l];
  return a;
}
inline VecPortable mul(VecPortable a, VecPortable b) {
  for (int l = 0; l < 16; ++l) a.x[l] *= b.x[l];
  return a;
}
inline VecPortable max(VecPortable a, VecPortable b) {
  for (int l = 0; l < 16; ++l) a.x[l] = b.x[l] > a.x[l] ? b.x[l] : a.x[l];
  return a;
}
inline VecPortable exp_lanes(VecPortable x) {
  for (int l = 0; l < 16; ++l) x.x[l] = exp_nonpositive(x.x[l]);
  return x;
}
inline float lane_sum(VecPortable a) {
  return lane_sum(a.x);
}
inline void pin(VecPortable&) {}

// ---- AVX2 + FMA + F16C: two 8-float registers --------------------------------------------

#if BATCHSCOPE_HAS_AVX2
// 8 floats of a row as float32 (exact).
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, mx::float16_t>) return _mm256_cvtph_ps(h);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <>
struct Vec<Isa::avx2> {
  __m256 lo, hi;  // lanes 0-7, 8-15
  static Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec bcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  template <typename T>
  static Vec load(const T* p) {
    return {load8(p), load8(p + 8)};
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
};
using VecAvx2 = Vec<Isa::avx2>;

inline VecAvx2 fma(VecAvx2 a, VecAvx2 b, VecAvx2 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline VecAvx2 add(VecAvx2 a, VecAvx2 b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
inline VecAvx2 sub(VecAvx2 a, VecAvx2 b) {
  return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
}
inline VecAvx2 mul(VecAvx2 a, VecAvx2 b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
inline VecAvx2 max(VecAvx2 a, VecAvx2 b) {
  return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
}
inline __m256 exp_half(__m256 x) {
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E));
  const __m256 ipart = _mm256_round_ps(_mm256_add_ps(t, _mm256_set1_ps(0.5f)),
                                       _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, ipart);
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < EXP_TERMS; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_POLY[i]));
  const __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LOWEST), _CMP_LT_OQ);
  const __m256 ip = _mm256_blendv_ps(ipart, _mm256_setzero_ps(), small);
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(ip), _mm256_set1_epi32(127)), 23);
  const __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(bits), p);
  return _mm256_blendv_ps(r, _mm256_setzero_ps(), small);
}
inline VecAvx2 exp_lanes(VecAvx2 x) {
  return {exp_half(x.lo), exp_half(x.hi)};
}
// lane_sum's tree in vector adds: lanes i + (i + 8) is lo + hi, then the halves of that, then
// (0 + 2) + (1 + 3).
inline float lane_sum_8x2(__m256 lo, __m256 hi) {
  const __m256 b = _mm256_add_ps(lo, hi);
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));  // c0 + c2, c1 + c3
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}
inline float lane_sum(VecAvx2 a) {
  return lane_sum_8x2(a.lo, a.hi);
}
inline void pin(VecAvx2& a) {
  asm("" : "+v"(a.lo), "+v"(a.hi));
}
#endif

// ---- AVX-512F: one register --------------------------------------------------------------

#if BATCHSCOPE_HAS_AVX512
template <>
struct Vec<Isa::avx512> {
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec bcast(float x) { return {_mm512_set1_ps(x)}; }
  template <typename T>
  static Vec load(const T* p) {
    if constexpr (std::is_same_v<T, float>) {
      return {_mm512_loadu_ps(p)};
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      if constexpr (std::is_same_v<T, mx::float16_t>) return {_mm512_cvtph_ps(h)};
      else return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
    }
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
using VecAvx512 = Vec<Isa::avx512>;

inline VecAvx512 fma(VecAvx512 a, VecAvx512 b, VecAvx512 c) {
  return {_mm512_fmadd_ps(a.v, b.v, c.v)};
}
inline VecAvx512 add(VecAvx512 a, VecAvx512 b) {
  return {_mm512_add_ps(a.v, b.v)};
}
inline VecAvx512 sub(VecAvx512 a, VecAvx512 b) {
  return {_mm512_sub_ps(a.v, b.v)};
}
inline VecAvx512 mul(VecAvx512 a, VecAvx512 b) {
  return {_mm512_mul_ps(a.v, b.v)};
}
inline VecAvx512 max(VecAvx512 a, VecAvx512 b) {
  return {_mm512_max_ps(a.v, b.v)};
}
inline VecAvx512 exp_lanes(VecAvx512 x) {
  const __m512 t = _mm512_mul_ps(x.v, _mm512_set1_ps(EXP_LOG2E));
  const __m512 ipart = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)),
                                            _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, ipart);
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < EXP_TERMS; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP_POLY[i]));
  const __mmask16 small = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(EXP_LOWEST), _CMP_LT_OQ);
  const __m512 ip = _mm512_mask_blend_ps(small, ipart, _mm512_setzero_ps());
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(ip), _mm512_set1_epi32(127)), 23);
  const __m512 r = _mm512_mul_ps(_mm512_castsi512_ps(bits), p);
  return {_mm512_mask_blend_ps(small, r, _mm512_setzero_ps())};
}
inline float lane_sum(VecAvx512 a) {
  return lane_sum_8x2(_mm512_castps512_ps256(a.v),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
}
inline void pin(VecAvx512& a) {
  asm("" : "+v"(a.v));
}
#endif

// The vector the kernels use.
using V = Vec<BEST_ISA>;

}  // namespace batchscope
