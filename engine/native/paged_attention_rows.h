// The paged attention kernel's parts shared by its decode rows (paged_attention_decode.cpp)
// and its runs of rows (paged_attention_prefill.cpp): the shapes, the units of work, the
// per-thread scratch and where a unit's key and value rows are found in the pool.
//
// The arithmetic of one row (a query head at one position), the same on every path:
//   q' = round_R(q * scale); the score of key t is round_R(dot(q', k_t)), where dot is 8
//   partial sums (lane j takes d = j, j + 8, ... in increasing d, one fma each, from 0) and
//   then the tree (j + 4, then j + 2, then j + 1); m = the maximum score; e_t = exp(s_t - m)
//   by MLX's exp formula (vector_math.h, simd.h's exp_lanes); sum = 16 partial sums by t mod
//   16 (each in t order), then their tree (below);
//   p_t = round_R(e_t * (1 / sum)); out[d] = the fmas p_t * v_t[d] in t order, from 0.
// round_R rounds to q's dtype, where MLX's own attention keeps its intermediates (a no-op for
// float32). Decode rows (one per sequence) run it with the dot across dim (8 keys' trees done
// together); runs of rows (prefill chunks) 16 rows at a time, one row per vector lane, for the
// dot (one partial sum of KEYS_AT_ONCE keys at a time, each key element broadcast), the
// softmax and the values (16 of d at a time, each value broadcast): the same operations on the
// same numbers, so the same bits. Rows outside a key's range take exact zeros (probability 0
// adds nothing to a sum). The files are built with -ffp-contract=off: no fma but the written
// ones.
//
// The softmax's sum: 16 partial sums, partial j taking the keys t = j (mod 16) in t order from
// 0, then lane_sum's tree over them (vector_math.h). The partials are one vector's lanes for a
// decode row (partial_sum) and 16 vectors for a tile's rows (softmax_lanes). A tree that pairs
// partials 8, 4, 2 and 1 apart gives the same sum for any rotation of them, so a tile and a
// decode row agree whatever key each counts from; a masked or absent key adds an exact zero
// (the partials are sums of non-negative numbers).
#pragma once

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "mlx/ops.h"
#include "simd.h"

namespace batchscope::attention {

constexpr int LANES = 16;  // rows per tile of a run, floats per vector of the value loops

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

// A decode row's unit (u.row_begin: its row in q and out) over its context of ctx positions.
template <typename R, typename T>
void decode_unit(const Unit& u, const R* q, const T* k_pool, const T* v_pool,
                 const int32_t* table, int ctx, R* out, const Shapes& s, Scratch& w);

// A unit of up to 16 consecutive rows of a run: the sequence's rows start at row0 of q and out,
// its last qlen positions of ctx.
template <typename R, typename T>
void tile_unit(const Unit& u, int row0, const R* q, const T* k_pool, const T* v_pool,
               const int32_t* table, int ctx, int qlen, R* out, const Shapes& s, Scratch& w);

// Calls X(R, T) for each (q dtype, pool dtype) pair the kernel takes.
#define BATCHSCOPE_ATTENTION_TYPES(X) \
  X(float, float) X(float, mx::float16_t) X(float, mx::bfloat16_t) \
  X(mx::float16_t, mx::float16_t) X(mx::bfloat16_t, mx::bfloat16_t)

}  // namespace batchscope::attention
