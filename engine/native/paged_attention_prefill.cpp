// Paged attention for runs of consecutive rows (prefill chunks): 16 rows at a time, one row per
// vector lane, for the scores, the softmax and the values (paged_attention_rows.h has the
// arithmetic).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_attention_rows.h"

namespace batchscope::attention {

namespace {

// The softmax (p_t = round_R(e_t / sum), paged_attention_rows.h) of 16 rows at once, in place:
// s is key-major (n, 16), lane l one row, and m the rows' maxima (m = max(s_t, m) for t in order from -inf). Entries outside a row's range must be -inf
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

}  // namespace

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

#define BATCHSCOPE_TILE_UNIT(R, T) \
  template void tile_unit<R, T>(const Unit&, int, const R*, const T*, const T*, const int32_t*, \
                                int, int, R*, const Shapes&, Scratch&);
BATCHSCOPE_ATTENTION_TYPES(BATCHSCOPE_TILE_UNIT)

}  // namespace batchscope::attention
