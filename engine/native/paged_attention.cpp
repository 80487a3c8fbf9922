#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <tuple>
#include <vector>

#include "inputs.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "simd.h"
#include "workers.h"

// The arithmetic of one row (a query head at one position), the same on every path:
//   q' = round_R(q * scale); the score of key t is round_R(dot(q', k_t)), where dot is 8
//   partial sums (lane j takes d = j, j + 8, ... in increasing d, one fma each, from 0) and
//   then the tree (j + 4, then j + 2, then j + 1); m = the maximum score; e_t = exp(s_t - m)
//   by MLX's exp formula (vector_math.h, simd.h's exp_lanes); sum = 16 partial sums by t mod 16 (each in t order),
//   then their tree (partial_sum);
//   p_t = round_R(e_t * (1 / sum)); out[d] = the fmas p_t * v_t[d] in t order, from 0.
// round_R rounds to q's dtype, where MLX's own attention keeps its intermediates (a no-op for
// float32). Decode rows (one per sequence) run it with the dot across dim (8 keys' trees done
// together); runs of rows (prefill chunks) 16 rows at a time, one row per vector lane, for the
// dot (one partial sum of KEYS_AT_ONCE keys at a time, each key element broadcast), the
// softmax and the values (16 of d at a time, each value broadcast): the same operations on the
// same numbers, so the same bits. Rows outside a key's range take exact zeros (probability 0 adds
// nothing to a sum). The file is built with -ffp-contract=off: no fma but the written ones.

namespace batchscope {

namespace {

constexpr Check check{"paged_attention"};

constexpr int LANES = 16;  // rows per tile of a run, floats per vector of the value loops

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

template <typename R>
inline float round_to(float x) {
  if constexpr (std::is_same_v<R, float>) {
    return x;
  } else {
    return static_cast<float>(static_cast<R>(x));
  }
}

// Asks for a row (from the pool or scratch) ahead of its use, a cache line at a time.
template <typename T>
inline void prefetch_row(const T* row, int dim) {
  for (int d = 0; d < dim; d += 64 / sizeof(T)) __builtin_prefetch(row + d);
}

struct Shapes {
  int rows, seqs, heads, kv_heads, dim, slots, max_blocks, block_size, window;
  int dim8, dim16;  // dim rounded up to 8 (the dot's partial sums) and to 16 (value vectors)
  float scale;
};

// One piece of work: kv head g of sequence seq, its rows [row_begin, row_begin + rows) (a
// tile of up to 16 rows of a run, or a decode row), all the query heads of the group (they
// read each key and value once).
struct Unit {
  int seq, g, row_begin, rows;
  double cost;
};

// Pointers to the key and value rows a unit reads, of type T: a 16-bit pool's own rows, or
// float32 ones (a float32 pool's, or scratch's).
template <typename T>
struct RowPointers {
  std::vector<const T*> keys, values;
};

// Per-thread scratch.
struct Scratch {
  std::vector<float> q, scores, keys, values, acc, part, key_block, row_max;
  std::vector<const float*> probs;
  std::tuple<RowPointers<float>, RowPointers<mx::float16_t>, RowPointers<mx::bfloat16_t>> rows;

  template <typename T>
  RowPointers<T>& rows_of() {
    return std::get<RowPointers<T>>(rows);
  }
};

// Calls f(i, row) for the rows of positions [lo, hi] of kv head g in the pool (i = position -
// lo): one table lookup (and no division) per block, not per row.
template <typename T, typename F>
void for_pool_rows(const T* pool, int g, const int32_t* table, int lo, int hi, const Shapes& s,
                   F&& f) {
  const T* base = pool + static_cast<size_t>(g) * s.slots * s.dim;
  for (int p = lo; p <= hi;) {
    const int b = p / s.block_size, end = std::min(hi, (b + 1) * s.block_size - 1);
    const T* row = base + (static_cast<size_t>(table[b]) * s.block_size + p % s.block_size) * s.dim;
    for (; p <= end; ++p, row += s.dim) f(p - lo, row);
  }
}

// Key/value rows [lo, hi] of kv head g, read in place in the pool (dim a multiple of 16).
template <typename T>
void pool_rows(const T* pool, int g, const int32_t* table, int lo, int hi, const Shapes& s,
               std::vector<const T*>& rows) {
  rows.resize(hi - lo + 1);
  for_pool_rows(pool, g, table, lo, hi, s, [&](int i, const T* row) { rows[i] = row; });
}

// Where key/value rows [lo, hi] of kv head g live as float32 rows of dim16 readable floats
// (zero beyond dim): straight in the pool when it is float32 with dim a multiple of 16, else
// converted once into scratch.
template <typename T>
void locate_rows(const T* pool, int g, const int32_t* table, int lo, int hi, const Shapes& s,
                 std::vector<float>& buf, std::vector<const float*>& rows) {
  if constexpr (std::is_same_v<T, float>) {
    if (s.dim == s.dim16) return pool_rows(pool, g, table, lo, hi, s, rows);
  }
  const int n = hi - lo + 1;
  rows.resize(n);
  buf.assign(static_cast<size_t>(n) * s.dim16, 0.0f);
  for_pool_rows(pool, g, table, lo, hi, s, [&](int i, const T* src) {
    float* dst = buf.data() + static_cast<size_t>(i) * s.dim16;
    int d = 0;
    for (; d + LANES <= s.dim; d += LANES) V::load(src + d).store(dst + d);
    for (; d < s.dim; ++d) dst[d] = to_float(src[d]);
    rows[i] = dst;
  });
}

// The softmax's sum: 16 partial sums, partial j taking the keys t = j (mod 16) in t order from
// 0, then lane_sum's tree over them (vector_math.h). The partials are one vector's lanes for a
// decode row and 16 vectors for a tile's rows. A tree that pairs partials 8, 4, 2 and 1 apart
// gives the same sum for any rotation of them, so a tile and a decode row agree whatever key
// each counts from; a masked or absent key adds an exact zero (the partials are sums of
// non-negative numbers).
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

// The same, for 16 rows at once: s is key-major (n, 16), lane l one row, and m the rows'
// maxima (m = max(s_t, m) for t in order from -inf). Entries outside a row's range must be -inf
// (they become exact zeros).
template <typename R>
void softmax_lanes(float* s, int n, V m) {
  V part[LANES];
  for (int j = 0; j < LANES; ++j) part[j] = V::zero();
  for (int t = 0; t < n; ++t) {
    float* row = s + static_cast<size_t>(t) * LANES;
    const V e = exp_lanes(sub(V::load(row), m));
    e.store(row);
    V& p = part[t % LANES];
    p = add(p, e);
  }
  for (int j = 0; j < 8; ++j) part[j] = add(part[j], part[j + 8]);
  for (int j = 0; j < 4; ++j) part[j] = add(part[j], part[j + 4]);
  for (int j = 0; j < 2; ++j) part[j] = add(part[j], part[j + 2]);
  alignas(64) float inv[LANES];
  add(part[0], part[1]).store(inv);
  for (int l = 0; l < LANES; ++l) inv[l] = 1.0f / inv[l];
  const V iv = V::load(inv);
  for (int t = 0; t < n; ++t) {
    float* row = s + static_cast<size_t>(t) * LANES;
    if constexpr (std::is_same_v<R, float>) {
      mul(V::load(row), iv).store(row);
    } else {
      for (int l = 0; l < LANES; ++l) row[l] = round_to<R>(row[l] * inv[l]);
    }
  }
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

template <typename R, typename T>
void decode_unit(const Unit& u, const R* q, const T* k_pool, const T* v_pool,
                 const int32_t* table, int ctx, R* out, const Shapes& s, Scratch& w) {
  if (s.dim == s.dim16) decode_unit_rows<R, T, true>(u, q, k_pool, v_pool, table, ctx, out, s, w);
  else decode_unit_rows<R, T, false>(u, q, k_pool, v_pool, table, ctx, out, s, w);
}

// The scores of 16 rows (lanes) against C keys, rows of a key block `stride` floats apart
// (KS: the stride when known at compile time, so every key's element is a fixed offset from
// one pointer). One partial sum at a time: partial j (d = j, j + 8, ... in increasing d, one
// fma each, from 0) of all C keys, each query vector loaded once for the C keys and each key
// element broadcast into its fma; then the tree over the 8 partials into out[c * LANES]. The
// operations of a decode row's dot, per (row, key).
template <int C, int KS>
inline void scores_across_rows(const float* qt, const float* k, int stride, int dim8, float* out,
                               float* part) {
  const int ks = KS > 0 ? KS : stride;
  for (int j = 0; j < 8; ++j) {
    V a[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) a[c] = V::zero();
    const float* kj = k + j;
    for (int d = j; d < dim8; d += 8, kj += 8) {
      const V qv = V::load(qt + static_cast<size_t>(d) * LANES);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) a[c] = fma(qv, V::bcast(kj[c * ks]), a[c]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) a[c].store(part + (static_cast<size_t>(j) * C + c) * LANES);
  }
  auto p = [&](int j, int c) { return V::load(part + (static_cast<size_t>(j) * C + c) * LANES); };
  for (int c = 0; c < C; ++c) {
    const V s04 = add(p(0, c), p(4, c)), s15 = add(p(1, c), p(5, c));
    const V s26 = add(p(2, c), p(6, c)), s37 = add(p(3, c), p(7, c));
    add(add(s04, s26), add(s15, s37)).store(out + static_cast<size_t>(c) * LANES);
  }
}

// Keys per pass of scores_across_rows: C accumulators and a query vector in the registers
// (AVX-512: 32 of 16 floats; AVX2: 16 of 8 floats, two per V).
#if BATCHSCOPE_HAS_AVX512
constexpr int KEYS_AT_ONCE = 12;
#else
constexpr int KEYS_AT_ONCE = 6;
#endif

// Keys are taken in blocks of this many, copied `stride` floats apart, and used by all of a
// unit's heads while they are in the L1 cache (with AVX-512, 24 KiB for a 64-dim head).
constexpr int KEY_BLOCK = 8 * KEYS_AT_ONCE;

// The scores of one head's 16 rows against keys [t0, t1) of the key block at kb (t1 - t0 a
// multiple of KEYS_AT_ONCE), into scores + t * LANES.
template <int KS>
void block_scores(const float* qh, const float* kb, int stride, int t0, int t1, int dim8,
                  float* scores, float* part) {
  for (int t = t0; t < t1; t += KEYS_AT_ONCE) {
    scores_across_rows<KEYS_AT_ONCE, KS>(qh, kb + static_cast<size_t>(t - t0) * stride, stride,
                                         dim8, scores + static_cast<size_t>(t) * LANES, part);
  }
}

// acc[d] (16 rows in lanes) += p(t) * v_t[d] for t in [t0, t1), in t order, continuing the
// sums acc holds: the values' fmas of 16 rows at once (row l's probability for key t at
// probs[t * LANES + l]), 16 of d at a time, each value broadcast into its fma.
inline void values_across_rows(const float* probs, const float* const* vrow, int t0, int t1,
                               float* acc, int dim16) {
  for (int d0 = 0; d0 < dim16; d0 += 16) {
    V a[16];
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) a[c] = V::load(acc + static_cast<size_t>(d0 + c) * LANES);
    for (int t = t0; t < t1; ++t) {
      const V p = V::load(probs + static_cast<size_t>(t) * LANES);
      const float* v = vrow[t] + d0;
      // Hidden from the optimizer, so each element is a fixed offset from v instead of a
      // register of its own per offset (which spills).
      asm("" : "+r"(v));
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) a[c] = fma(p, V::bcast(v[c]), a[c]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) a[c].store(acc + static_cast<size_t>(d0 + c) * LANES);
  }
}

// Up to 16 consecutive rows of a run (positions p0, p0 + 1, ...): all query heads of kv head
// g over the keys of the tile's range, 16 rows at a time.
template <typename R, typename T>
void tile_unit(const Unit& u, int row0, const R* q, const T* k_pool, const T* v_pool,
               const int32_t* table, int ctx, int qlen, R* out, const Shapes& s, Scratch& w) {
  RowPointers<float>& rows = w.rows_of<float>();
  const int rep = s.heads / s.kv_heads;
  const int p0 = ctx - qlen + u.row_begin;  // the tile's first position
  const int last = p0 + u.rows - 1;
  auto first_of = [&](int p) { return s.window > 0 ? std::max(0, p - s.window + 1) : 0; };
  const int lo = first_of(p0);
  const int n = last - lo + 1;
  // Keys every row of the tile sees (lanes past u.rows are padding; their values are unused).
  const int all_from = first_of(last) - lo, all_to = p0 - lo;
  // Scores for n keys padded to whole passes of scores_across_rows (the padding keys are zero
  // rows, their scores never read).
  const int n_pad = (n + KEYS_AT_ONCE - 1) / KEYS_AT_ONCE * KEYS_AT_ONCE;
  const size_t q_size = static_cast<size_t>(s.dim8) * LANES;
  const size_t s_size = static_cast<size_t>(n_pad) * LANES;
  // The queries, dim-major: q[h][d][l] is row l's q'[d] (zero for padding rows and d >= dim).
  w.q.assign(rep * q_size, 0.0f);
  for (int h = 0; h < rep; ++h) {
    for (int l = 0; l < u.rows; ++l) {
      const R* qr = q + (static_cast<size_t>(row0 + u.row_begin + l) * s.heads + u.g * rep + h) *
                            s.dim;
      for (int d = 0; d < s.dim; ++d) {
        w.q[h * q_size + static_cast<size_t>(d) * LANES + l] =
            round_to<R>(static_cast<float>(qr[d]) * s.scale);
      }
    }
  }
  // The key rows of each block copied stride floats apart (a compile-time stride for the usual
  // head dims).
  const int stride = s.dim16 <= 64 ? 64 : s.dim16 <= 128 ? 128 : s.dim16 <= 256 ? 256 : s.dim16;
  w.scores.resize(rep * s_size);
  w.part.resize(static_cast<size_t>(8) * KEYS_AT_ONCE * LANES);
  w.key_block.resize(static_cast<size_t>(KEY_BLOCK) * stride);
  const float inf = std::numeric_limits<float>::infinity();
  w.row_max.assign(static_cast<size_t>(rep) * LANES, -inf);
  for (int t0 = 0; t0 < n; t0 += KEY_BLOCK) {
    const int t1 = std::min(n, t0 + KEY_BLOCK), t1_pad = std::min(n_pad, t0 + KEY_BLOCK);
    // A block at a time, so a 16-bit pool is widened in scratch that stays in the cache.
    locate_rows(k_pool, u.g, table, lo + t0, lo + t1 - 1, s, w.keys, rows.keys);
    for (int t = t0; t < t1_pad; ++t) {
      float* dst = w.key_block.data() + static_cast<size_t>(t - t0) * stride;
      if (t < t1) {
        const float* src = rows.keys[t - t0];
        for (int d = 0; d < s.dim16; d += LANES) V::load(src + d).store(dst + d);
      } else {
        std::fill(dst, dst + s.dim16, 0.0f);
      }
    }
    for (int h = 0; h < rep; ++h) {
      const float* qh = w.q.data() + h * q_size;
      float* sh = w.scores.data() + h * s_size;
      const float* kb = w.key_block.data();
      switch (stride) {
        case 64: block_scores<64>(qh, kb, stride, t0, t1_pad, s.dim8, sh, w.part.data()); break;
        case 128: block_scores<128>(qh, kb, stride, t0, t1_pad, s.dim8, sh, w.part.data()); break;
        case 256: block_scores<256>(qh, kb, stride, t0, t1_pad, s.dim8, sh, w.part.data()); break;
        default: block_scores<0>(qh, kb, stride, t0, t1_pad, s.dim8, sh, w.part.data());
      }
      // Masks and rounds the block's scores, and takes the rows' maxima while they are hot.
      V m = V::load(w.row_max.data() + h * LANES);
      for (int t = t0; t < t1; ++t) {
        float* st = sh + static_cast<size_t>(t) * LANES;
        if (t >= all_from && t <= all_to) {
          if constexpr (!std::is_same_v<R, float>) {
            for (int l = 0; l < LANES; ++l) st[l] = round_to<R>(st[l]);
          }
        } else {
          const int p = lo + t;
          for (int l = 0; l < LANES; ++l) {
            const bool seen = l < u.rows && p <= p0 + l && p >= first_of(p0 + l);
            st[l] = seen ? round_to<R>(st[l]) : -inf;
          }
        }
        m = max(V::load(st), m);
      }
      m.store(w.row_max.data() + h * LANES);
    }
  }
  for (int h = 0; h < rep; ++h) {
    softmax_lanes<R>(w.scores.data() + h * s_size, n, V::load(w.row_max.data() + h * LANES));
  }
  // The values, dim-major like the queries: acc[h][d][l] is row l's out[d].
  const size_t acc_size = static_cast<size_t>(s.dim16) * LANES;
  w.acc.assign(rep * acc_size, 0.0f);
  for (int t0 = 0; t0 < n; t0 += KEY_BLOCK) {
    const int t1 = std::min(n, t0 + KEY_BLOCK);
    locate_rows(v_pool, u.g, table, lo + t0, lo + t1 - 1, s, w.values, rows.values);
    for (int h = 0; h < rep; ++h) {
      values_across_rows(w.scores.data() + h * s_size + static_cast<size_t>(t0) * LANES,
                         rows.values.data(), 0, t1 - t0, w.acc.data() + h * acc_size, s.dim16);
    }
  }
  for (int h = 0; h < rep; ++h) {
    for (int l = 0; l < u.rows; ++l) {
      R* o = out + (static_cast<size_t>(row0 + u.row_begin + l) * s.heads + u.g * rep + h) *
                       s.dim;
      const float* a = w.acc.data() + h * acc_size + l;
      for (int d = 0; d < s.dim; ++d) o[d] = static_cast<R>(a[static_cast<size_t>(d) * LANES]);
    }
  }
}

template <typename R, typename T>
void run_units(const std::vector<Unit>& units, const std::vector<int>& row0s, const R* q,
               const T* k, const T* v, const int32_t* tables, const int32_t* ctx_lens,
               const int32_t* q_lens, R* out, const Shapes& s) {
  auto part = [&](int begin, int end) {
    thread_local Scratch scratch;
    Scratch& w = scratch;  // one lookup of the thread's scratch, not one per use
    for (int i = begin; i < end; ++i) {
      const Unit& u = units[i];
      const int32_t* table = tables + static_cast<size_t>(u.seq) * s.max_blocks;
      if (q_lens[u.seq] == 1) {
        Unit d = u;
        d.row_begin = row0s[u.seq];
        decode_unit<R, T>(d, q, k, v, table, ctx_lens[u.seq], out, s, w);
      } else {
        tile_unit<R, T>(u, row0s[u.seq], q, k, v, table, ctx_lens[u.seq], q_lens[u.seq], out,
                        s, w);
      }
    }
  };
  const int count = static_cast<int>(units.size());
  // A few short decode rows (cost: keys x query heads / 16 each) take less time than handing
  // them to the workers: 200 is a decode row of ~1000 keys for 3 query heads per kv head.
  double cost = 0;
  for (const Unit& u : units) cost += u.cost;
  if (cost < 200 || !parallel_for(count, 1, part)) part(0, count);
}

}  // namespace

mx::array paged_attention(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                          const mx::array& block_tables, const mx::array& context_lens,
                          const mx::array& query_lens, float scale, int block_size, int window,
                          mx::StreamOrDevice s) {
  check(q.ndim() == 3, "q must be (rows, heads, dim)");
  check(k_pool.ndim() == 3 && v_pool.shape() == k_pool.shape(),
        "k_pool and v_pool must both be (kv_heads, slots, dim)");
  check(k_pool.shape(2) == q.shape(2), "q and the pool disagree on dim");
  check(q.shape(1) % k_pool.shape(0) == 0, "heads must be a multiple of kv_heads");
  check(block_size > 0 && k_pool.shape(1) % block_size == 0,
        "the pool's slots must be whole blocks");
  check(block_tables.ndim() == 2, "block_tables must be (seqs, max_blocks)");
  check(context_lens.ndim() == 1 && context_lens.shape(0) == block_tables.shape(0) &&
            query_lens.ndim() == 1 && query_lens.shape(0) == block_tables.shape(0),
        "block_tables must be (seqs, max_blocks), context_lens and query_lens (seqs,)");
  check(window >= 0, "window must be >= 0 (0: the whole context)");
  auto floating = [](mx::Dtype t) {
    return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
  };
  check(floating(q.dtype()), "q must be float32, float16 or bfloat16");
  check(k_pool.dtype() == v_pool.dtype() && floating(k_pool.dtype()),
        "the pool must be float32, float16 or bfloat16, keys and values alike");
  check(k_pool.dtype() == q.dtype() || q.dtype() == mx::float32,
        "a pool of another dtype than q needs float32 q (q and the pool must have one dtype "
        "otherwise)");
  auto stream = mx::to_stream(s);
  auto int32 = [&](const mx::array& a) {
    return row_contiguous(a.dtype() == mx::int32 ? a : mx::astype(a, mx::int32, stream), stream);
  };
  std::vector<mx::array> inputs = {
      row_contiguous(q, stream), row_contiguous(k_pool, stream),
      row_contiguous(v_pool, stream), int32(block_tables), int32(context_lens),
      int32(query_lens)};
  return mx::array({q.shape(0), q.shape(1) * q.shape(2)}, q.dtype(),
                   std::make_shared<PagedAttention>(stream, scale, block_size, window),
                   std::move(inputs));
}

void check_block_tables(const int32_t* tables, const int32_t* context_lens,
                        const int32_t* query_lens, int seqs, int max_blocks, int block_size,
                        int slots) {
  const int blocks = slots / block_size;
  for (int i = 0; i < seqs; ++i) {
    const int len = context_lens[i], qlen = query_lens[i];
    if (len < 1 || (len + block_size - 1) / block_size > max_blocks) {
      throw std::invalid_argument("paged_attention: a context length is out of range");
    }
    if (qlen < 1 || qlen > len) {
      throw std::invalid_argument(
          "paged_attention: a query length is out of range (1 to its context length)");
    }
    for (int b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int id = tables[static_cast<size_t>(i) * max_blocks + b];
      if (id < 0 || id >= blocks) {
        throw std::invalid_argument("paged_attention: a block id is out of range");
      }
    }
  }
}

void paged_attention_rows(const PagedAttentionArgs& a) {
  const Shapes s{a.rows,       a.seqs,       a.heads,      a.kv_heads,
                 a.dim,        a.slots,      a.max_blocks, a.block_size,
                 a.window,     (a.dim + 7) / 8 * 8,        (a.dim + 15) / 16 * 16,
                 a.scale};
  const int32_t* table_ptr = a.block_tables;
  const int32_t* len_ptr = a.context_lens;
  const int32_t* qlen_ptr = a.query_lens;
  // Bad tables would read outside the pool: check everything before touching it.
  check_block_tables(table_ptr, len_ptr, qlen_ptr, s.seqs, s.max_blocks, s.block_size, s.slots);
  long total_rows = 0;
  std::vector<int> row0s(s.seqs);
  std::vector<Unit> units;
  const int rep = s.heads / s.kv_heads;
  for (int i = 0; i < s.seqs; ++i) {
    const int len = len_ptr[i], qlen = qlen_ptr[i];
    row0s[i] = static_cast<int>(total_rows);
    total_rows += qlen;
    for (int g = 0; g < s.kv_heads; ++g) {
      if (qlen == 1) {
        const int span = s.window > 0 ? std::min(len, s.window) : len;
        units.push_back({i, g, 0, 1, static_cast<double>(span) * rep / LANES});
        continue;
      }
      for (int r = 0; r < qlen; r += LANES) {
        const int rows = std::min(LANES, qlen - r);
        const int last = len - qlen + r + rows;  // keys up to here
        const int span = s.window > 0 ? std::min(last, s.window + rows) : last;
        units.push_back({i, g, r, rows, static_cast<double>(span) * rep});
      }
    }
  }
  if (total_rows != s.rows) {
    throw std::invalid_argument("paged_attention: query_lens must add up to q's rows");
  }
  // The longest first, so the threads finish together; a unit's bits do not depend on
  // which thread runs it, or when.
  std::stable_sort(units.begin(), units.end(),
                   [](const Unit& x, const Unit& y) { return x.cost > y.cost; });
  auto run = [&](auto* r_tag, auto* t_tag) {
    using R = std::remove_pointer_t<decltype(r_tag)>;
    using T = std::remove_pointer_t<decltype(t_tag)>;
    run_units<R, T>(units, row0s, static_cast<const R*>(a.q), static_cast<const T*>(a.k),
                    static_cast<const T*>(a.v), table_ptr, len_ptr, qlen_ptr,
                    static_cast<R*>(a.out), s);
  };
  auto pool_is = [&](auto* r_tag) {
    switch (a.pool_dtype) {
      case mx::float32: return run(r_tag, static_cast<float*>(nullptr));
      case mx::float16: return run(r_tag, static_cast<mx::float16_t*>(nullptr));
      default: return run(r_tag, static_cast<mx::bfloat16_t*>(nullptr));
    }
  };
  switch (a.q_dtype) {
    case mx::float32: return pool_is(static_cast<float*>(nullptr));
    case mx::float16: return run(static_cast<mx::float16_t*>(nullptr),
                                 static_cast<mx::float16_t*>(nullptr));
    default: return run(static_cast<mx::bfloat16_t*>(nullptr),
                        static_cast<mx::bfloat16_t*>(nullptr));
  }
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  PagedAttentionArgs args{nullptr, q.dtype(), nullptr, nullptr, k.dtype(), nullptr, nullptr,
                          nullptr, nullptr, static_cast<int>(q.shape(0)),
                          static_cast<int>(inputs[3].shape(0)), static_cast<int>(q.shape(1)),
                          static_cast<int>(k.shape(0)), static_cast<int>(q.shape(2)),
                          static_cast<int>(k.shape(1)), static_cast<int>(inputs[3].shape(1)),
                          block_size_, window_, scale_};
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([q = mx::array::unsafe_weak_copy(q), k = mx::array::unsafe_weak_copy(k),
                    v = mx::array::unsafe_weak_copy(inputs[2]),
                    tables = mx::array::unsafe_weak_copy(inputs[3]),
                    lens = mx::array::unsafe_weak_copy(inputs[4]),
                    qlens = mx::array::unsafe_weak_copy(inputs[5]),
                    out = mx::array::unsafe_weak_copy(out), args]() mutable {
    args.q = q.data<void>();
    args.k = k.data<void>();
    args.v = v.data<void>();
    args.block_tables = tables.data<int32_t>();
    args.context_lens = lens.data<int32_t>();
    args.query_lens = qlens.data<int32_t>();
    args.out = out.data<void>();
    paged_attention_rows(args);
  });
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "paged_attention runs on the CPU only; on a GPU the engine uses MLX's fused attention");
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedAttention&>(other);
  return scale_ == o.scale_ && block_size_ == o.block_size_ && window_ == o.window_;
}

}  // namespace batchscope
