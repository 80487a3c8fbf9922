#include "decode_quantized.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_dispatch.h"
#include "inputs.h"
#include "quantized_common.h"
#include "simd.h"
#include "workers.h"

// The arithmetic, the same on every path (so every path gives the same bits):
//   w[k] = fma(scale, q[k], bias) in float32 (exact for float16 and bfloat16 scales: the
//   product has at most 19 significant bits), then out = sum over k of x[k] * w[k] as 16
//   lanes: lane l takes the k's of lane l, in increasing k, with one fma each, then the fixed
//   tree of lane_sum. For 8 bits lane l takes k = l, l + 16, ...; for 4 bits each 32 k's
//   (16 bytes) split into the low nibbles (even k: lane l takes k = 2l) and then the high
//   ones (odd k: k = 2l + 1), the order a byte-to-int widening gives with no shuffle. Each
//   thread puts x into that order once per call (lane_ordered). in_features is a multiple of
//   the group (>= 32), so there is no tail. The file is built with -ffp-contract=off: no fma
//   but the written ones.
// Each path is a Kern below (its tile sizes and its dequantization); the dot products are
// dot<Kern> on Vec<Kern::ISA> (simd.h). The build has every path up to the CPU's best, and
// one is picked at run time (decode_quantized_isa), so the tests compare them here.

namespace batchscope {

namespace {

struct Problem {
  const float* x;  // (M, K); 4 bits: as given, each thread reads its own copy in lane order
  const uint32_t* w;
  const void* scales;
  const void* biases;
  ScaleType scale_type;
  float* out;  // (M, N)
  int M, K, N, group_size, bits;
};

// Prefetch the packed weights of the outputs this many rows ahead: memory bounds a few-row
// step, and the next tile's loads then overlap this one's arithmetic.
constexpr int PREFETCH_ROWS = 6;

// 8-bit weights in a step of one or two rows are also prefetched into L2 this many tiles
// ahead, where the range goes on that far: the embedded model's 8-bit head, read last in a
// step, 1.17x at one row and 1.09x at two (benchmarks/build_ab.py --measure kernel,
// results/build_ab_kernel_far_prefetch.md). 4-bit layers and steps of 4 rows or more keep the
// one prefetch: the far one is measured only where it applies. A prefetch changes no
// arithmetic: the same bits.
constexpr int FAR_TILES = 12;

inline size_t row_words(const Problem& p) {
  return static_cast<size_t>(p.K) * p.bits / 32;
}

// Outputs per fused tile for a step of R rows: at most what leaves registers for the
// dequantized weights (each output still sums alone, in the same order: the tile width changes
// no bit). Wider tiles read each row's x once for more outputs; at one row x is one load per
// fma either way, and fewer outputs mean fewer weight streams and no spilled row pointers.
template <class Kern>
constexpr int fused_nr(int R) {
  return R == 1 ? Kern::FUSED_NR1 : R == 2 ? Kern::FUSED_NR2 : R <= 4 ? Kern::FUSED_NR4
                                                                    : Kern::NR;
}

// out[m0 + i][n0 + j] for an mr x nr tile, from weights dequantized into wt (nr rows of K, in
// lane order): one Vec<Kern::ISA> accumulator per output, one fma per 16 k's.
template <class Kern, int mr, int nr>
void dot(const Problem& p, const float* wt, int m0, int n0) {
  using W = Vec<Kern::ISA>;
  W acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = W::zero();
  for (int k = 0; k < p.K; k += 16) {
    W xv[mr];
    for (int i = 0; i < mr; ++i) {
      xv[i] = W::load(p.x + static_cast<size_t>(m0 + i) * p.K + k);
      // AVX-512's 32 registers hold them: loaded once, used nr times
      if constexpr (Kern::ISA == Isa::avx512) pin(xv[i]);
    }
    for (int j = 0; j < nr; ++j) {
      const W wv = W::load(wt + static_cast<size_t>(j) * p.K + k);
      for (int i = 0; i < mr; ++i) acc[i][j] = fma(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j)
      p.out[static_cast<size_t>(m0 + i) * p.N + n0 + j] = lane_sum(acc[i][j]);
}

// ---- portable: plain C++ -----------------------------------------------------------------

struct Portable {
  static constexpr Isa ISA = Isa::portable;
  static constexpr int MR = 4, NR = 2;
  static constexpr int FUSED_MR = 0;  // no buffer-free path: the buffer serves every step
  static constexpr int FUSED_NR1 = NR, FUSED_NR2 = NR, FUSED_NR4 = NR;

  // Output n's weights, dequantized into dst[K] in lane order.
  static void dequant(const Problem& p, int n, float* dst) {
    const uint32_t* wr = p.w + static_cast<size_t>(n) * row_words(p);
    const int groups = p.K / p.group_size;
    for (int g = 0; g < groups; ++g) {
      const size_t at = static_cast<size_t>(n) * groups + g;
      const float s = scale_at(p.scales, p.scale_type, at);
      const float b = scale_at(p.biases, p.scale_type, at);
      const int k0 = g * p.group_size;
      if (p.bits == 4) {
        for (int k = k0; k < k0 + p.group_size; k += 32) {
          const uint32_t* q = wr + k / 8;
          for (int j = 0; j < 16; ++j) {
            const uint32_t byte = (q[j / 4] >> (8 * (j % 4))) & 0xffu;
            dst[k + j] = std::fma(s, static_cast<float>(byte & 0xfu), b);
            dst[k + 16 + j] = std::fma(s, static_cast<float>(byte >> 4), b);
          }
        }
      } else {
        for (int k = k0; k < k0 + p.group_size; k += 16) {
          const uint32_t* q = wr + k / 4;
          for (int j = 0; j < 16; ++j) {
            const uint32_t byte = (q[j / 4] >> (8 * (j % 4))) & 0xffu;
            dst[k + j] = std::fma(s, static_cast<float>(byte), b);
          }
        }
      }
    }
  }
};

// ---- AVX2 + FMA: a 16-lane vector is two 8-float registers --------------------------------

#if BATCHSCOPE_HAS_AVX2
struct Avx2 {
  static constexpr Isa ISA = Isa::avx2;
  // 2 x 2 tiles: 8 accumulator registers, 4 for x and 2 for the weights, of the 16.
  static constexpr int MR = 2, NR = 2;
  static constexpr int FUSED_MR = 2;  // steps of up to 2 rows skip the buffer (see Avx512)
  static constexpr int FUSED_NR1 = 4, FUSED_NR2 = 2, FUSED_NR4 = 2;  // see fused_nr

  static void dequant(const Problem& p, int n, float* dst) {
    const uint32_t* wr = p.w + static_cast<size_t>(n) * row_words(p);
    const uint32_t* ahead = wr + PREFETCH_ROWS * row_words(p);
    const int groups = p.K / p.group_size;
    const __m256i mask = _mm256_set1_epi32(0xf);
    for (int g = 0; g < groups; ++g) {
      const size_t at = static_cast<size_t>(n) * groups + g;
      const __m256 s = _mm256_set1_ps(scale_at(p.scales, p.scale_type, at));
      const __m256 b = _mm256_set1_ps(scale_at(p.biases, p.scale_type, at));
      const int k0 = g * p.group_size;
      const int step = p.bits == 4 ? 32 : 16;  // weights per 16 bytes
      for (int k = k0; k < k0 + p.group_size; k += step) {
        const size_t word = static_cast<size_t>(k) * p.bits / 32;
        __builtin_prefetch(ahead + word);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + word));
        const __m256i v0 = _mm256_cvtepu8_epi32(bytes);
        const __m256i v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
        float* d = dst + k;
        if (p.bits == 4) {
          _mm256_storeu_ps(d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, mask)), s, b));
          _mm256_storeu_ps(d + 8,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, mask)), s, b));
          _mm256_storeu_ps(d + 16,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), s, b));
          _mm256_storeu_ps(d + 24,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), s, b));
        } else {
          _mm256_storeu_ps(d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v0), s, b));
          _mm256_storeu_ps(d + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v1), s, b));
        }
      }
    }
  }

  // As Avx512::fused: each 16 k's weights dequantized in registers as one VecAvx2 (lanes 0-7,
  // 8-15), fed to the rows in dot's order. No far prefetch (not measured on an AVX2 CPU);
  // GS: as Avx512's.
  template <int BITS, int mr, int nr, int GS = 0>
  static void fused(const Problem& p, int n0, bool /*far*/) {
    VecAvx2 acc[mr][nr];
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) acc[i][j] = VecAvx2::zero();
    const size_t rw = row_words(p);
    const uint32_t* w0 = p.w + static_cast<size_t>(n0) * rw;
    const int groups = p.K / p.group_size;
    const __m256i mask = _mm256_set1_epi32(0xf);
    constexpr int step = BITS == 4 ? 32 : 16;
    for (int g = 0; g < groups; ++g) {
      __m256 s[nr], b[nr];
      for (int j = 0; j < nr; ++j) {
        const size_t at = static_cast<size_t>(n0 + j) * groups + g;
        s[j] = _mm256_set1_ps(scale_at(p.scales, p.scale_type, at));
        b[j] = _mm256_set1_ps(scale_at(p.biases, p.scale_type, at));
      }
      const int group_size = GS ? GS : p.group_size;
      const int k0 = g * group_size;
      for (int k = k0; k < k0 + group_size; k += step) {
        const size_t word = static_cast<size_t>(k) * BITS / 32;
        for (int j = 0; j < nr; ++j) {
          const uint32_t* q = w0 + j * rw + word;
          __builtin_prefetch(q + 2 * nr * rw);  // two tiles ahead
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
          const __m256i v0 = _mm256_cvtepu8_epi32(bytes);
          const __m256i v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
          if constexpr (BITS == 4) {
            const VecAvx2 low = {
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, mask)), s[j], b[j]),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, mask)), s[j], b[j])};
            const VecAvx2 high = {
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), s[j], b[j]),
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), s[j], b[j])};
            for (int i = 0; i < mr; ++i) {
              const float* xr = p.x + static_cast<size_t>(i) * p.K + k;
              acc[i][j] = fma(VecAvx2::load(xr), low, acc[i][j]);
              acc[i][j] = fma(VecAvx2::load(xr + 16), high, acc[i][j]);
            }
          } else {
            const VecAvx2 wv = {_mm256_fmadd_ps(_mm256_cvtepi32_ps(v0), s[j], b[j]),
                                _mm256_fmadd_ps(_mm256_cvtepi32_ps(v1), s[j], b[j])};
            for (int i = 0; i < mr; ++i) {
              const float* xr = p.x + static_cast<size_t>(i) * p.K + k;
              acc[i][j] = fma(VecAvx2::load(xr), wv, acc[i][j]);
            }
          }
        }
      }
    }
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j)
        p.out[static_cast<size_t>(i) * p.N + n0 + j] = lane_sum(acc[i][j]);
  }

  static void fused_range(const Problem& p, int n_begin, int n_end);
};
#endif  // BATCHSCOPE_HAS_AVX2

// ---- AVX-512F: a 16-lane vector is one register -------------------------------------------

#if BATCHSCOPE_HAS_AVX512
// n scales (or biases) from index `at` as float32 into dst, the values scale_at gives. A
// tile's outputs' scales follow one another, so the tile converts them in one pass: per output
// there are often fewer than 16 (9 groups for 576 inputs). Sixteen at a time, the last ones in
// one masked conversion where the build has AVX-512BW (scales16); else float16 sixteen at a
// time and the rest one at a time.
inline void scales_to_float(const void* p, ScaleType t, size_t at, int n, float* dst) {
#if BATCHSCOPE_HAS_AVX512BW
  for (int i = 0; i < n; i += 16) {
    const __m512 v = t == ScaleType::f16    ? scales16<ScaleType::f16>(p, at, i, n)
                     : t == ScaleType::bf16 ? scales16<ScaleType::bf16>(p, at, i, n)
                                            : scales16<ScaleType::f32>(p, at, i, n);
    _mm512_mask_storeu_ps(dst + i, first_lanes(n - i), v);
  }
#else
  int i = 0;
  if (t == ScaleType::f16) {
    const mx::float16_t* h = static_cast<const mx::float16_t*>(p) + at;
    for (; i + 16 <= n; i += 16) VecAvx512::load(h + i).store(dst + i);
  }
  for (; i < n; ++i) dst[i] = scale_at(p, t, at + i);
#endif
}

struct Avx512 {
  static constexpr Isa ISA = Isa::avx512;
  // 8 x 3 tiles, as decode_linear: 24 accumulators and 8 x vectors in the 32 registers.
  static constexpr int MR = 8, NR = 3;
  static constexpr int FUSED_MR = 8;
  // 1 row: 4 outputs a tile, not 8 (a one-row step 7% shorter on a Zen 4; see fused_nr)
  static constexpr int FUSED_NR1 = 4, FUSED_NR2 = 6, FUSED_NR4 = 4;
  // A tile's scales and biases as float32 on its stack up to this many groups an output (4096
  // inputs in groups of 64); more go to a thread-local buffer.
  static constexpr int STACK_GROUPS = 64;

  static void dequant(const Problem& p, int n, float* dst) {
    const uint32_t* wr = p.w + static_cast<size_t>(n) * row_words(p);
    const uint32_t* ahead = wr + PREFETCH_ROWS * row_words(p);
    const int groups = p.K / p.group_size;
    const __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int g = 0; g < groups; ++g) {
      const size_t at = static_cast<size_t>(n) * groups + g;
      const __m512 s = _mm512_set1_ps(scale_at(p.scales, p.scale_type, at));
      const __m512 b = _mm512_set1_ps(scale_at(p.biases, p.scale_type, at));
      const __m512 table = _mm512_fmadd_ps(nibbles, s, b);  // 4 bits: see fused
      const int k0 = g * p.group_size;
      const int step = p.bits == 4 ? 32 : 16;
      for (int k = k0; k < k0 + p.group_size; k += step) {
        const size_t word = static_cast<size_t>(k) * p.bits / 32;
        __builtin_prefetch(ahead + word);
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + word)));
        float* d = dst + k;
        if (p.bits == 4) {
          _mm512_storeu_ps(d, _mm512_permutexvar_ps(v, table));
          _mm512_storeu_ps(d + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table));
        } else {
          _mm512_storeu_ps(d, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, b));
        }
      }
    }
  }

  // One row's fmas for 16 (8 bits) or 32 (4 bits: lo then hi) k's from x.
  template <int BITS>
  static void multiply_add(const float* x, const VecAvx512& lo, const VecAvx512& hi,
                           VecAvx512& acc) {
    acc = fma(VecAvx512::load(x), lo, acc);
    if constexpr (BITS == 4) acc = fma(VecAvx512::load(x + 16), hi, acc);
  }

  // A step of at most MR rows: each chunk of packed weights is dequantized in registers and
  // multiplied with every row at once, with no buffer (the same fmas in the same order as
  // dequant + dot, so the same bits). GS: the group size where the caller knows it at compile
  // time (0: p.group_size), so that a group's few chunks unroll into straight code.
  template <int BITS, int mr, int nr, int GS = 0>
  static void fused(const Problem& p, int n0, bool far) {
    VecAvx512 acc[mr][nr];
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) acc[i][j] = VecAvx512::zero();
    const size_t rw = row_words(p);
    const uint32_t* w0 = p.w + static_cast<size_t>(n0) * rw;
    const int groups = p.K / p.group_size;
    constexpr int step = BITS == 4 ? 32 : 16;
    // The 16 values a 4-bit weight can take in this group, scale * q + bias (the fma dequant
    // computes, so the same bits), looked up by the nibble: one permute per 16 weights where
    // the conversion and the fma were three instructions (benchmarks/decode_linear.py).
    const __m512 nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // The tile's scales and biases as float32, converted once up front rather than a
    // conversion and a broadcast per group and output inside the loop
    // (benchmarks/decode_linear.py --weights q4 times the kernel), into a buffer on the stack
    // where they fit: a thread-local vector cost a TLS lookup and a resize per tile.
    alignas(64) float on_stack[2 * nr * STACK_GROUPS];
    float* sc = on_stack;
    if (groups > STACK_GROUPS) {
      thread_local std::vector<float> converted;
      converted.resize(static_cast<size_t>(2 * nr) * groups);
      sc = converted.data();
    }
    float* bi = sc + static_cast<size_t>(nr) * groups;
    const size_t at = static_cast<size_t>(n0) * groups;
    scales_to_float(p.scales, p.scale_type, at, nr * groups, sc);
    scales_to_float(p.biases, p.scale_type, at, nr * groups, bi);
    // With float16 scales (11 significant bits, at most 65504) scale * q (q < 16) is exact in
    // float32, so a multiply and then an add give the fma's bits for the table; each reads
    // its scalar straight from memory, where the fma needed a broadcast instruction of its own
    // (the linears 1.05x at 1-4 rows: results/build_ab_kernel_table_multiply.md). Not for
    // bfloat16 or float32 scales: a product near float32's largest value could round or
    // overflow where the fma's does not.
    const bool exact_products = p.scale_type == ScaleType::f16;
    for (int g = 0; g < groups; ++g) {
      __m512 s[nr], b[nr];
      for (int j = 0; j < nr; ++j) {
        s[j] = _mm512_set1_ps(sc[static_cast<size_t>(j) * groups + g]);
        b[j] = _mm512_set1_ps(bi[static_cast<size_t>(j) * groups + g]);
        if constexpr (BITS == 4) {  // the table
          s[j] = exact_products ? _mm512_add_ps(_mm512_mul_ps(nibbles, s[j]), b[j])
                                : _mm512_fmadd_ps(nibbles, s[j], b[j]);
        }
      }
      const int group_size = GS ? GS : p.group_size;
      const int k0 = g * group_size;
#pragma GCC unroll 4
      for (int k = k0; k < k0 + group_size; k += step) {
        const size_t word = static_cast<size_t>(k) * BITS / 32;
        // Above one row, the tile's weights for these k's first, then each row's x loaded
        // once and used for every output: x loaded per output made one load per fma, which
        // bound a step of a few rows (benchmarks/results/build_ab_kernel_rows.md). At one row
        // x is loaded once either way, and each output's weights go straight to their fmas as
        // before. Either way each accumulator takes the same fmas in the same order: the same
        // bits.
        VecAvx512 lo[nr], hi[nr];
        for (int j = 0; j < nr; ++j) {
          const uint32_t* q = w0 + j * rw + word;
          if constexpr (BITS == 4) {
            __builtin_prefetch(q + 2 * nr * rw);  // two tiles ahead
          } else if ((word & 15) == 0) {
            // 8 bits: one prefetch per 64 bytes of the row, not one per 16-byte chunk (measured
            // with the stack-converted scales: results/build_ab_kernel_tile_overhead.md)
            __builtin_prefetch(q + 2 * nr * rw);
            if (mr <= 2 && far) __builtin_prefetch(q + FAR_TILES * nr * rw, 0, 2);  // into L2
          }
          const __m512i v =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
          if constexpr (BITS == 4) {
            // The permute reads the low 4 bits of each lane: the low nibble as it is.
            lo[j] = {_mm512_permutexvar_ps(v, s[j])};
            hi[j] = {_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), s[j])};
          } else {
            lo[j] = {_mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s[j], b[j])};
          }
          if constexpr (mr == 1) multiply_add<BITS>(p.x + k, lo[j], hi[j], acc[0][j]);
        }
        if constexpr (mr > 1) {
          for (int i = 0; i < mr; ++i) {
            const float* xr = p.x + static_cast<size_t>(i) * p.K + k;
            VecAvx512 x_lo = VecAvx512::load(xr), x_hi;
            pin(x_lo);
            if constexpr (BITS == 4) {
              x_hi = VecAvx512::load(xr + 16);
              pin(x_hi);
            }
            for (int j = 0; j < nr; ++j) {
              acc[i][j] = fma(x_lo, lo[j], acc[i][j]);
              if constexpr (BITS == 4) acc[i][j] = fma(x_hi, hi[j], acc[i][j]);
            }
          }
        }
      }
    }
    for (int i = 0; i < mr; ++i) {
      for (int j = 0; j < nr; ++j) {
        p.out[static_cast<size_t>(i) * p.N + n0 + j] = lane_sum(acc[i][j]);
      }
    }
  }

  static void fused_range(const Problem& p, int n_begin, int n_end);
};
#endif  // BATCHSCOPE_HAS_AVX512

// far: the range goes on FAR_TILES tiles past this one (Avx512's far prefetch). 4-bit weights
// in the usual group sizes take a kernel with the group size built in.
template <class Kern, int R, int nr>
void fused_tile(const Problem& p, int n0, bool far) {
  if (p.bits == 4) {
    if (p.group_size == 32) return Kern::template fused<4, R, nr, 32>(p, n0, far);
    if (p.group_size == 64) return Kern::template fused<4, R, nr, 64>(p, n0, far);
    Kern::template fused<4, R, nr>(p, n0, far);
  } else {
    Kern::template fused<8, R, nr>(p, n0, far);
  }
}

// Prefetch the scales and biases of outputs [n, n + count) (quantized_common.h).
inline void prefetch_scales(const Problem& p, int n, int count) {
  batchscope::prefetch_scales(p.scales, p.biases, p.scale_type,
                              static_cast<size_t>(p.K / p.group_size), n, count);
}

// Prefetch everything output n's packed weights occupy.
inline void prefetch_weights(const Problem& p, int n) {
  const char* row = reinterpret_cast<const char*>(p.w + static_cast<size_t>(n) * row_words(p));
  const size_t bytes = row_words(p) * 4;
  for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
}

// Outputs [n_begin, n_end) of a step of exactly R rows. A range starts cold (a chunk of a
// parallel_for, or a small layer): its first tiles' weights and every tile's scales are
// prefetched a tile ahead, where the kernel's own prefetch does not reach. No arithmetic
// changes: the same bits.
template <class Kern, int R>
void fused_rows(const Problem& p, int n_begin, int n_end) {
  constexpr int nr = fused_nr<Kern>(R);
  const int head = std::min(n_end, n_begin + 2 * nr);
  for (int n = n_begin; n < head; ++n) prefetch_weights(p, n);
  prefetch_scales(p, n_begin, std::min(n_end, n_begin + 2 * nr) - n_begin);
  int n = n_begin;
  for (; n + nr <= n_end; n += nr) {
    if (n + 2 * nr < n_end) prefetch_scales(p, n + 2 * nr, std::min(nr, n_end - n - 2 * nr));
    fused_tile<Kern, R, nr>(p, n, n + (FAR_TILES + 1) * nr <= n_end);
  }
  for (; n < n_end; ++n) fused_tile<Kern, R, 1>(p, n, false);
}

// Outputs [n_begin, n_end) of a step of at most FUSED_MR rows.
template <class Kern, int R = Kern::FUSED_MR>
void fused_outputs(const Problem& p, int n_begin, int n_end) {
  if constexpr (R >= 1) {
    if (p.M == R) return fused_rows<Kern, R>(p, n_begin, n_end);
    fused_outputs<Kern, R - 1>(p, n_begin, n_end);
  }
}

#if BATCHSCOPE_HAS_AVX2
void Avx2::fused_range(const Problem& p, int n_begin, int n_end) {
  fused_outputs<Avx2>(p, n_begin, n_end);
}
#endif

#if BATCHSCOPE_HAS_AVX512
void Avx512::fused_range(const Problem& p, int n_begin, int n_end) {
  fused_outputs<Avx512>(p, n_begin, n_end);
}
#endif


// ---- shared driver -----------------------------------------------------------------------

template <class Kern, int NR, int R = Kern::MR - 1>
void row_tail(const Problem& p, const float* wt, int m, int n0, int rows) {
  if constexpr (R >= 1) {
    if (rows == R) {
      dot<Kern, R, NR>(p, wt, m, n0);
    } else {
      row_tail<Kern, NR, R - 1>(p, wt, m, n0, rows);
    }
  }
}

template <class Kern, int NR>
void all_rows(const Problem& p, const float* wt, int n0) {
  int m = 0;
  for (; m + Kern::MR <= p.M; m += Kern::MR) dot<Kern, Kern::MR, NR>(p, wt, m, n0);
  row_tail<Kern, NR>(p, wt, m, n0, p.M - m);
}

// Outputs [n_begin, n_end): a tile's weights are dequantized once into a per-thread buffer
// (NR x K floats, in L1 or L2), then every row tile of the step reads them from there.
template <class Kern>
void output_range(const Problem& p, int n_begin, int n_end) {
  if constexpr (Kern::FUSED_MR > 0) {
    if (p.M <= Kern::FUSED_MR) return Kern::fused_range(p, n_begin, n_end);
  }
  thread_local std::vector<float> buffer;
  const size_t K = static_cast<size_t>(p.K);
  if (buffer.size() < Kern::NR * K) buffer.resize(Kern::NR * K);
  float* wt = buffer.data();
  int n = n_begin;
  for (; n + Kern::NR <= n_end; n += Kern::NR) {
    for (int j = 0; j < Kern::NR; ++j) Kern::dequant(p, n + j, wt + j * K);
    all_rows<Kern, Kern::NR>(p, wt, n);
  }
  for (; n < n_end; ++n) {
    Kern::dequant(p, n, wt);
    all_rows<Kern, 1>(p, wt, n);
  }
}

std::atomic<uint64_t> calls{0};

// x (n values) in lane order, in a buffer of the calling thread's own, ordered once per call:
// each 32 values' even ones, then the odd ones (4 bits, see the top). Every thread that takes
// a share of a call orders its own copy: one copy written by the caller and read by a worker
// had its cache lines move between the cores on every call, and the caller's writes waited
// for them.
const float* lane_ordered(const float* x, size_t n, uint64_t call) {
  thread_local std::vector<float> buffer;
  thread_local uint64_t ordered_call = 0;
  if (ordered_call == call) return buffer.data();
  buffer.resize(n);
  float* to = buffer.data();
#if BATCHSCOPE_HAS_AVX512
  // Two permutes per 32 values where the scalar loop moves each value alone.
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                         28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (size_t base = 0; base < n; base += 32) {
    const __m512 a = _mm512_loadu_ps(x + base), b = _mm512_loadu_ps(x + base + 16);
    _mm512_storeu_ps(to + base, _mm512_permutex2var_ps(a, even, b));
    _mm512_storeu_ps(to + base + 16, _mm512_permutex2var_ps(a, odd, b));
  }
#else
  for (size_t base = 0; base < n; base += 32) {
    for (int j = 0; j < 16; ++j) {
      to[base + j] = x[base + 2 * j];
      to[base + 16 + j] = x[base + 2 * j + 1];
    }
  }
#endif
  ordered_call = call;
  return to;
}

// Outputs [n_begin, n_end) on the calling thread, with x as the kernels read it.
template <class Kern>
void outputs_here(const Problem& p, int n_begin, int n_end, uint64_t call) {
  if (p.bits != 4) return output_range<Kern>(p, n_begin, n_end);
  Problem here = p;
  here.x = lane_ordered(p.x, static_cast<size_t>(p.M) * p.K, call);
  output_range<Kern>(here, n_begin, n_end);
}

template <class Kern>
void compute_with(const Problem& p) {
  const uint64_t call = calls.fetch_add(1, std::memory_order_relaxed) + 1;
  // Output tiles in chunks shared by the threads (parallel_for); which thread takes a tile
  // does not change its arithmetic. Below ~64k multiply-adds one thread is faster.
  // A tile: the outputs the step's kernel takes at once (chunk edges on tile edges).
  const int unit = p.M <= Kern::FUSED_MR ? fused_nr<Kern>(p.M) : Kern::NR;
  const int tiles = (p.N + unit - 1) / unit;
  if (static_cast<int64_t>(p.M) * p.K * p.N >= (1 << 16)) {
    const int chunk = std::max(1, tiles / (parallel_threads() * 8));
    auto outputs = [&](int begin, int end) {
      outputs_here<Kern>(p, begin * unit, std::min(p.N, end * unit), call);
    };
    if (parallel_for(tiles, chunk, outputs)) return;
  }
  outputs_here<Kern>(p, 0, p.N, call);
}

std::atomic<int> chosen{-1};

Isa current_isa() {
  int c = chosen.load();
  if (c < 0) {
    // BATCHSCOPE_QUANTIZED_ISA picks a path this build has (it is built for this CPU: simd.h);
    // an unknown or missing one: the best.
    Isa isa = BEST_ISA;
    const char* env = std::getenv("BATCHSCOPE_QUANTIZED_ISA");
    Isa wanted;
    if (env != nullptr && parse_isa(env, &wanted) && isa_built(wanted)) isa = wanted;
    int expected = -1;
    chosen.compare_exchange_strong(expected, static_cast<int>(isa));
    c = chosen.load();
  }
  return static_cast<Isa>(c);
}

void compute(const Problem& p) {
  switch (current_isa()) {
#if BATCHSCOPE_HAS_AVX512
    case Isa::avx512: compute_with<Avx512>(p); return;
#endif
#if BATCHSCOPE_HAS_AVX2
    case Isa::avx2: compute_with<Avx2>(p); return;
#endif
    default: compute_with<Portable>(p); return;
  }
}

constexpr Check check{"decode_quantized_linear"};

}  // namespace

std::string decode_quantized_isa() {
  return isa_name(current_isa());
}

std::string set_decode_quantized_isa(const std::string& name) {
  Isa isa;
  check(parse_isa(name, &isa), "unknown path '" + name + "' (auto, avx512, avx2 or portable)");
  check(isa_built(isa), "this CPU or build has no " + name + " path");
  chosen.store(static_cast<int>(isa));
  return isa_name(isa);
}

void quantized_linear_rows(const float* x, int M, int K, const uint32_t* w, const void* scales,
                           const void* biases, mx::Dtype scale_dtype, int N, int group_size,
                           int bits, float* out, bool int8_activations) {
  if (int8_activations) {
    quantized_linear_rows_int8(x, M, K, w, scales, biases, scale_dtype, N, group_size, bits,
                               out);
    return;
  }
  const ScaleType st = scale_type_of(scale_dtype);
  Problem p{x, w, scales, biases, st, out, M, K, N, group_size, bits};
  compute(p);
}

mx::array decode_quantized_linear(const mx::array& x, const mx::array& w,
                                  const mx::array& scales, const mx::array& biases,
                                  int group_size, int bits, bool int8_activations,
                                  mx::StreamOrDevice s) {
  check(bits == 4 || bits == 8, "bits must be 4 or 8, not " + std::to_string(bits));
  check(group_size == 32 || group_size == 64 || group_size == 128,
        "group_size must be 32, 64 or 128, not " + std::to_string(group_size));
  check(x.ndim() >= 1 && w.ndim() == 2 && scales.ndim() == 2 && biases.ndim() == 2,
        "x must be (..., in), w (out, in * bits / 32), scales and biases (out, in / group_size)");
  check(x.dtype() == mx::float32,
        "x must be float32 (float16 and bfloat16 activations keep MLX's quantized_matmul)");
  check(w.dtype() == mx::uint32, "w must be uint32 (MLX's packed quantized weights)");
  check(scales.dtype() == mx::float16 || scales.dtype() == mx::bfloat16 ||
            scales.dtype() == mx::float32,
        "scales must be float16, bfloat16 or float32");
  check(biases.dtype() == scales.dtype(), "biases must have the scales' dtype");
  const int64_t K = x.shape(-1);
  check(K > 0 && K % group_size == 0,
        "in_features (" + std::to_string(K) + ") must be a positive multiple of group_size");
  check(static_cast<int64_t>(w.shape(1)) * 32 == K * bits,
        "w " + shape_str(w) + " does not hold " + std::to_string(K) + " " +
            std::to_string(bits) + "-bit values per row");
  check(scales.shape(0) == w.shape(0) && scales.shape(1) == K / group_size,
        "scales " + shape_str(scales) + " must be (out, in / group_size)");
  check(biases.shape() == scales.shape(),
        "biases " + shape_str(biases) + " must have the scales' shape");
  check(static_cast<int64_t>(w.shape(0)) * K < (int64_t{1} << 31) &&
            static_cast<int64_t>(x.size()) < (int64_t{1} << 31),
        "too large");
  auto stream = mx::to_stream(s);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32,
                   std::make_shared<DecodeQuantizedLinear>(stream, group_size, bits,
                                                           int8_activations),
                   {row_contiguous(x, stream), row_contiguous(w, stream),
                    row_contiguous(scales, stream),
                    row_contiguous(biases, stream)});
}

void DecodeQuantizedLinear::eval_cpu(const std::vector<mx::array>& inputs,
                                     std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  const auto& scales = inputs[2];
  const auto& biases = inputs[3];
  auto& out = allocate(outputs[0]);
  const int K = static_cast<int>(x.shape(-1));
  const int N = static_cast<int>(w.shape(0));
  const int M = static_cast<int>(x.size() / K);
  dispatch(stream(), inputs, out,
           [x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
            scales = mx::array::unsafe_weak_copy(scales),
            biases = mx::array::unsafe_weak_copy(biases),
            out = mx::array::unsafe_weak_copy(out), M, K, N, gs = group_size_, bits = bits_,
            int8 = int8_activations_]() mutable {
             quantized_linear_rows(x.data<float>(), M, K, w.data<uint32_t>(),
                                   scales.data<void>(), biases.data<void>(), scales.dtype(), N,
                                   gs, bits, out.data<float>(), int8);
           });
}

void DecodeQuantizedLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "decode_quantized_linear runs on the CPU only; on a GPU MLX's quantized_matmul is used");
}

}  // namespace batchscope
