// Paged attention for decode rows (one row per sequence): the scores with the dot across dim,
// 8 keys' trees at a time, then the softmax and the values (paged_attention_rows.h has the
// arithmetic).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_attention_rows.h"

namespace batchscope::attention {

namespace {

// dot(q, k) over dim_pad (a multiple of 8, zero-padded): 8 partial sums, then the tree.
template <typename T = float>
inline float dot8(const float* q, const T* k, int dim_pad) {
#if BATCHSCOPE_HAS_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (int d = 0; d < dim_pad; d += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  }
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
#else
  float acc[8] = {};
  for (int d = 0; d < dim_pad; d += 8) {
    for (int j = 0; j < 8; ++j) acc[j] = std::fma(q[d + j], to_float(k[d + j]), acc[j]);
  }
  for (int w = 4; w >= 1; w /= 2) {
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  }
  return acc[0];
#endif
}

#if BATCHSCOPE_HAS_AVX2
// dot8 of H heads' queries (q + h * q_stride) against 8 keys at once, into out + h * out_stride
// [0..8) in key order: the same fmas per (head, key), and the same tree (the halves, then lanes
// j and j + 2, then j and j + 1) done for 8 keys together. Each key chunk is loaded (and a
// 16-bit one widened) once for the H heads.
template <int H, typename T>
inline void dot8_keys8(const float* q, int q_stride, const T* const* k, int dim8, float* out,
                       int out_stride) {
  __m256 a[H][8];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < 8; ++c) a[h][c] = _mm256_setzero_ps();
  for (int d = 0; d < dim8; d += 8) {
    __m256 qv[H];
    for (int h = 0; h < H; ++h) qv[h] = _mm256_loadu_ps(q + h * q_stride + d);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256 kc = load8(k[c] + d);
      for (int h = 0; h < H; ++h) a[h][c] = _mm256_fmadd_ps(qv[h], kc, a[h][c]);
    }
  }
  for (int h = 0; h < H; ++h) {
    __m256 x[4];  // x[i] = [keys 2i: lanes j + (j + 4) | key 2i + 1: the same]
    for (int i = 0; i < 4; ++i) {
      x[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[h][2 * i], a[h][2 * i + 1], 0x20),
                           _mm256_permute2f128_ps(a[h][2 * i], a[h][2 * i + 1], 0x31));
    }
    __m256 y[2];  // lanes j + (j + 2), two per key
    for (int i = 0; i < 2; ++i) {
      y[i] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                           _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    }
    // keys in the lanes as 0, 2, 4, 6 | 1, 3, 5, 7
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], 0x88),
                                   _mm256_shuffle_ps(y[0], y[1], 0xDD));
    _mm256_storeu_ps(out + static_cast<size_t>(h) * out_stride,
                     _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}

// Query heads per pass of dot8_keys8: 8 keys x H accumulators, H queries and a key chunk in the
// registers (AVX-512's 32 ymm registers: 3; AVX2's 16: 1).
#if defined(__AVX512VL__)
constexpr int DOT_HEADS = 3;
#else
constexpr int DOT_HEADS = 1;
#endif

// dot8_keys8 for heads [0, rep), DOT_HEADS at a time.
template <typename T>
inline void dot8_keys8_heads(const float* q, int q_stride, int rep, const T* const* k, int dim8,
                             float* out, int out_stride) {
  auto at = [&](int h) { return out + static_cast<size_t>(h) * out_stride; };
  int h = 0;
  for (; h + DOT_HEADS <= rep; h += DOT_HEADS) {
    dot8_keys8<DOT_HEADS>(q + h * q_stride, q_stride, k, dim8, at(h), out_stride);
  }
  if (DOT_HEADS == 3 && rep - h == 2) {
    dot8_keys8<2>(q + h * q_stride, q_stride, k, dim8, at(h), out_stride);
    return;
  }
  for (; h < rep; ++h) dot8_keys8<1>(q + h * q_stride, q_stride, k, dim8, at(h), out_stride);
}
#endif

inline float partial_sum(const float* e, int n) {
  V acc = V::zero();
  int t = 0;
  for (; t + LANES <= n; t += LANES) acc = add(acc, V::load(e + t));
  if (t < n) {
    alignas(64) float tail[LANES] = {};
    std::copy(e + t, e + n, tail);
    acc = add(acc, V::load(tail));
  }
  return lane_sum(acc);
}

// Softmax of one row's scores in place, as the header describes: p_t = round_R(e_t / sum).
template <typename R>
void softmax_row(float* s, int n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) m = std::max(m, s[t]);
  const V mv = V::bcast(m);
  int t = 0;
  for (; t + LANES <= n; t += LANES) exp_lanes(sub(V::load(s + t), mv)).store(s + t);
  for (; t < n; ++t) s[t] = exp_nonpositive(s[t] - m);
  const float inv = 1.0f / partial_sum(s, n);
  for (t = 0; t < n; ++t) s[t] = round_to<R>(s[t] * inv);
}

// acc[g] (dim16 floats each, for G rows) += p_g(t) * v_t for t in [t0, t1), in t order,
// continuing the sums acc holds; row g's probability for key t at probs[g][t].
template <int NV, int G, typename T>
void values_fixed(const float* const* probs, const T* const* vrow, int t0,
                  int t1, float* acc, int dim16) {
  V a[G][NV];
  for (int g = 0; g < G; ++g) {
    const float* ag = acc + static_cast<size_t>(g) * dim16;
    for (int j = 0; j < NV; ++j) a[g][j] = V::load(ag + j * LANES);
  }
  for (int t = t0; t < t1; ++t) {
    const T* v = vrow[t];
    if (t + 8 < t1) prefetch_row(vrow[t + 8], NV * LANES);
    V vt[NV];
    for (int j = 0; j < NV; ++j) vt[j] = V::load(v + j * LANES);
    for (int g = 0; g < G; ++g) {
      const V p = V::bcast(probs[g][t]);
      for (int j = 0; j < NV; ++j) a[g][j] = fma(p, vt[j], a[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < NV; ++j) a[g][j].store(acc + static_cast<size_t>(g) * dim16 + j * LANES);
  }
}

template <typename T>
void values_any(const float* const* probs, const T* const* vrow, int t0, int t1,
                float* acc, int dim16) {
  for (int t = t0; t < t1; ++t) {
    const V p = V::bcast(probs[0][t]);
    for (int j = 0; j < dim16; j += LANES) {
      fma(p, V::load(vrow[t] + j), V::load(acc + j)).store(acc + j);
    }
  }
}

// Rows in register-sized groups: with AVX-512's 32 registers, 16 vectors of accumulators at a
// time; elsewhere a row at a time.
#if BATCHSCOPE_HAS_AVX512
constexpr bool MANY_REGISTERS = true;
#else
constexpr bool MANY_REGISTERS = false;
#endif

template <typename T>
void values(const float* const* probs, const T* const* vrow, int t0, int t1,
            float* acc, int rows, int dim16) {
  const int nv = dim16 / LANES;
  for (int g = 0; g < rows;) {
    const float* const* p = probs + g;
    float* a = acc + static_cast<size_t>(g) * dim16;
    const int left = rows - g;
    if (MANY_REGISTERS && nv == 4 && left >= 4) {
      values_fixed<4, 4>(p, vrow, t0, t1, a, dim16), g += 4;
    } else if (MANY_REGISTERS && nv == 4 && left == 3) {
      values_fixed<4, 3>(p, vrow, t0, t1, a, dim16), g += 3;
    } else if (MANY_REGISTERS && nv == 4 && left == 2) {
      values_fixed<4, 2>(p, vrow, t0, t1, a, dim16), g += 2;
    } else if (nv == 4) {
      values_fixed<4, 1>(p, vrow, t0, t1, a, dim16), g += 1;
    } else if (MANY_REGISTERS && nv == 8 && left >= 2) {
      values_fixed<8, 2>(p, vrow, t0, t1, a, dim16), g += 2;
    } else if (nv == 8) {
      values_fixed<8, 1>(p, vrow, t0, t1, a, dim16), g += 1;
    } else if (MANY_REGISTERS && nv == 16) {
      values_fixed<16, 1>(p, vrow, t0, t1, a, dim16), g += 1;
    } else {
      values_any(p, vrow, t0, t1, a, dim16), g += 1;
    }
  }
}

template <typename R>
void write_out(const float* acc, R* out, int dim) {
  for (int d = 0; d < dim; ++d) out[d] = static_cast<R>(acc[d]);
}

// Keys (and values) per block of a decode row: the block's row pointers are looked up together
// (and, for a head dim that is not a multiple of 16, its rows widened into scratch that stays
// in the cache).
constexpr int DECODE_BLOCK = 128;

// A decode row: its query heads of kv head g over the keys of its range. IN_PLACE: the
// arithmetic reads the pool's rows (any dtype, widened in registers) where they are; else
// float32 copies with zeros to dim16.
template <typename R, typename T, bool IN_PLACE>
void decode_unit_rows(const Unit& u, const R* q, const T* k_pool, const T* v_pool,
                      const int32_t* table, int ctx, R* out, const Shapes& s, Scratch& w) {
  using U = std::conditional_t<IN_PLACE, T, float>;
  RowPointers<U>& rows = w.rows_of<U>();
  auto fetch = [&](const T* pool, int lo, int hi, std::vector<float>& buf,
                   std::vector<const U*>& rows) {
    if constexpr (IN_PLACE) pool_rows(pool, u.g, table, lo, hi, s, rows);
    else locate_rows(pool, u.g, table, lo, hi, s, buf, rows);
  };
  const int rep = s.heads / s.kv_heads;
  const int first = s.window > 0 ? std::max(0, ctx - s.window) : 0;
  const int n = ctx - first;
  w.q.assign(static_cast<size_t>(rep) * s.dim16, 0.0f);
  const int head0 = u.g * rep;
  const R* qr = q + (static_cast<size_t>(u.row_begin) * s.heads + head0) * s.dim;
  for (int h = 0; h < rep; ++h) {
    for (int d = 0; d < s.dim; ++d) {
      w.q[h * s.dim16 + d] = round_to<R>(static_cast<float>(qr[h * s.dim + d]) * s.scale);
    }
  }
  w.scores.resize(static_cast<size_t>(rep) * n);
  for (int t0 = 0; t0 < n; t0 += DECODE_BLOCK) {
    const int t1 = std::min(n, t0 + DECODE_BLOCK);
    fetch(k_pool, first + t0, first + t1 - 1, w.keys, rows.keys);
    const U* const* krow = rows.keys.data();  // key t at krow[t - t0]
    int t = t0;
#if BATCHSCOPE_HAS_AVX2
    for (; t + 8 <= t1; t += 8) {
      for (int c = 8; c < 16 && t + c < t1; ++c) prefetch_row(krow[t - t0 + c], s.dim);
      dot8_keys8_heads(w.q.data(), s.dim16, rep, krow + (t - t0), s.dim8, w.scores.data() + t, n);
      if constexpr (!std::is_same_v<R, float>) {
        for (int h = 0; h < rep; ++h) {
          float* out = w.scores.data() + static_cast<size_t>(h) * n + t;
          for (int c = 0; c < 8; ++c) out[c] = round_to<R>(out[c]);
        }
      }
    }
#endif
    for (; t < t1; ++t) {
      for (int h = 0; h < rep; ++h) {
        w.scores[static_cast<size_t>(h) * n + t] =
            round_to<R>(dot8(w.q.data() + h * s.dim16, krow[t - t0], s.dim8));
      }
    }
  }
  std::vector<const float*>& probs = w.probs;
  probs.resize(rep);
  for (int h = 0; h < rep; ++h) softmax_row<R>(w.scores.data() + static_cast<size_t>(h) * n, n);
  w.acc.assign(static_cast<size_t>(rep) * s.dim16, 0.0f);
  for (int t0 = 0; t0 < n; t0 += DECODE_BLOCK) {
    const int t1 = std::min(n, t0 + DECODE_BLOCK);
    fetch(v_pool, first + t0, first + t1 - 1, w.values, rows.values);
    for (int h = 0; h < rep; ++h) probs[h] = w.scores.data() + static_cast<size_t>(h) * n + t0;
    values(probs.data(), rows.values.data(), 0, t1 - t0, w.acc.data(), rep, s.dim16);
  }
  R* o = out + (static_cast<size_t>(u.row_begin) * s.heads + head0) * s.dim;
  for (int h = 0; h < rep; ++h) write_out(w.acc.data() + h * s.dim16, o + h * s.dim, s.dim);
}

}  // namespace

template <typename R, typename T>
void decode_unit(const Unit& u, const R* q, const T* k_pool, const T* v_pool,
                 const int32_t* table, int ctx, R* out, const Shapes& s, Scratch& w) {
  if (s.dim == s.dim16) decode_unit_rows<R, T, true>(u, q, k_pool, v_pool, table, ctx, out, s, w);
  else decode_unit_rows<R, T, false>(u, q, k_pool, v_pool, table, ctx, out, s, w);
}

#define BATCHSCOPE_DECODE_UNIT(R, T) \
  template void decode_unit<R, T>(const Unit&, const R*, const T*, const T*, const int32_t*, \
                                  int, R*, const Shapes&, Scratch&);
BATCHSCOPE_ATTENTION_TYPES(BATCHSCOPE_DECODE_UNIT)

}  // namespace batchscope::attention
