#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_quantized.h"
#include "quantized_common.h"
#include "workers.h"

// The affine 4/8-bit linear layer with its activations quantized to 8 bits (int8 activations,
// an option: decode_quantized.h), as llama.cpp's Q8_0 does. Per row, in blocks of ACT_BLOCK
// activations (or the weight group, if smaller):
//   d = max |x| / 127, xq[k] = nearbyint(x[k] * (127 / max |x|)) in [-127, 127] (0 where the
//   block is all zeros)
// and per weight group g, xs = the sum over its blocks, in order, of d * (sum of xq): the
// quantized activations' sum, so that an output is exactly the dot product of the dequantized
// weights with the dequantized activations d * xq (the error is the sum of w[k] * (d * xq[k]
// - x[k]), centred like w), up to the float rounding of
//   sum over g of s[g] * (sum over blocks of d * (sum of q[k] * xq[k])) + b[g] * xs.
// The integer sums are exact, so the instruction set only decides how fast they come. The
// float arithmetic around them is fixed by a 16-lane structure every path follows:
// - the packed weights of an output are cut into 32-byte units; unit u feeds lanes
//   8 * (u % 2) + j, j < 8, lane j taking its bytes 4j..4j+3 (4 bits: both nibbles of each,
//   8 weights; one block and one group hold them all);
//   per unit and lane, acc = fma(float(integer dot), s[g] * d, acc), units in increasing u;
// - lane l of a second accumulator takes fma(b[g], xs[g], .) for g = l, l + 16, ... in order;
// - out = lane_sum(acc) + lane_sum(bias accumulator) (vector_math.h's tree).
// The file is built with -ffp-contract=off: no fma but the written ones.

namespace batchscope {

namespace {

// The rows of x, quantized once per call and laid out as the kernel reads them.
struct QuantizedRows {
  int M = 0, K = 0, G = 0, G16 = 0;  // G groups, padded to a multiple of 16 (zeros)
  int pairs = 0;                     // 64-byte pairs of units per output row of weights
  int bits = 4, group_size = 64;
  // Per row, per pair: the 64 activations that meet the low nibbles (or the 8-bit weights),
  // then (4 bits) the 64 that meet the high ones; zeros past the end of the row.
  std::vector<int8_t> q;
  std::vector<float> dl;   // (M, pairs, 16): d of each lane's group, 0 past the row's end
  std::vector<float> xs;   // (M, G16): the groups' d * sum of xq, 0 past G
  std::vector<int32_t> lane_group;  // (pairs, 16): the group each lane's bytes belong to

  int q_per_pair() const { return bits == 4 ? 128 : 64; }
  const int8_t* row_q(int m) const { return q.data() + static_cast<size_t>(m) * pairs * q_per_pair(); }
};

// The weight index of lane l's first byte in pair p, and how many bytes the row has.
inline int lane_weight(int bits, int p, int l) {
  const int byte = 64 * p + 4 * l;
  return bits == 4 ? 2 * byte : byte;
}

// Activations share a scale d in blocks of this many (or the weight group, if smaller): each
// lane's bytes lie in one block, so finer blocks cost the kernel nothing but a per-lane d.
constexpr int ACT_BLOCK = 32;

void quantize_rows(const float* x, int M, int K, int group_size, int bits, QuantizedRows& r) {
  r.M = M, r.K = K, r.bits = bits, r.group_size = group_size;
  r.G = K / group_size;
  r.G16 = (r.G + 15) / 16 * 16;
  const int row_bytes = K * bits / 8;
  r.pairs = (row_bytes + 63) / 64;
  const int per_pair = r.q_per_pair();
  r.q.assign(static_cast<size_t>(M) * r.pairs * per_pair, 0);
  r.dl.assign(static_cast<size_t>(M) * r.pairs * 16, 0.0f);
  r.xs.assign(static_cast<size_t>(M) * r.G16, 0.0f);
  r.lane_group.assign(static_cast<size_t>(r.pairs) * 16, 0);
  for (int p = 0; p < r.pairs; ++p) {
    for (int l = 0; l < 16; ++l) {
      const int k = lane_weight(bits, p, l);
      r.lane_group[p * 16 + l] = k < K ? k / group_size : 0;
    }
  }
  const int block = std::min(ACT_BLOCK, group_size);
  std::vector<float> d(K / block);
  for (int m = 0; m < M; ++m) {
    const float* xr = x + static_cast<size_t>(m) * K;
    int8_t* qr = r.q.data() + static_cast<size_t>(m) * r.pairs * per_pair;
    for (int g = 0; g < r.G; ++g) {
      float xs = 0.0f;
      for (int b = g * group_size / block; b < (g + 1) * group_size / block; ++b) {
        const float* xb = xr + b * block;
        float amax = 0.0f;
        for (int k = 0; k < block; ++k) amax = std::max(amax, std::fabs(xb[k]));
        d[b] = amax / 127.0f;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int k = b * block; k < (b + 1) * block; ++k) {
          const float v = std::nearbyint(xr[k] * inv);
          const int8_t qv = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
          sum += qv;
          // Where weight k's byte sits in its pair (see QuantizedRows::q).
          if (bits == 4) {
            const int byte = k / 2, p = byte / 64;
            qr[static_cast<size_t>(p) * 128 + (k % 2) * 64 + byte % 64] = qv;
          } else {
            qr[k] = qv;
          }
        }
        const float part = d[b] * static_cast<float>(sum);
        xs = b == g * group_size / block ? part : xs + part;
      }
      r.xs[static_cast<size_t>(m) * r.G16 + g] = xs;
    }
    float* dr = r.dl.data() + static_cast<size_t>(m) * r.pairs * 16;
    for (int p = 0; p < r.pairs; ++p) {
      for (int l = 0; l < 16; ++l) {
        const int k = lane_weight(bits, p, l);
        dr[p * 16 + l] = k < K ? d[k / block] : 0.0f;
      }
    }
  }
}

struct Job {
  const QuantizedRows& rows;
  const uint32_t* w;
  const void* scales;
  const void* biases;
  ScaleType scale_type;
  float* out;
  int N;
};

// The output's scales and biases as float32, G16 each (zeros past G).
void output_scales(const Job& j, int n, float* s, float* b) {
  const int G = j.rows.G;
  for (int g = 0; g < j.rows.G16; ++g) {
    const size_t at = static_cast<size_t>(n) * G + g;
    s[g] = g < G ? scale_at(j.scales, j.scale_type, at) : 0.0f;
    b[g] = g < G ? scale_at(j.biases, j.scale_type, at) : 0.0f;
  }
}

// The bias accumulator's lane_sum for row m and an output's biases b (the structure above).
float bias_term(const Job& j, int m, const float* b) {
  float acc[16] = {};
  const float* xs = j.rows.xs.data() + static_cast<size_t>(m) * j.rows.G16;
  for (int g0 = 0; g0 < j.rows.G16; g0 += 16)
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(b[g0 + l], xs[g0 + l], acc[l]);
  return lane_sum(acc);
}

// ---- portable: plain C++, the reference for the structure ---------------------------------

void portable_outputs(const Job& j, int n_begin, int n_end) {
  const QuantizedRows& r = j.rows;
  const size_t row_bytes = static_cast<size_t>(r.K) * r.bits / 8;
  std::vector<float> s(r.G16), b(r.G16);
  for (int n = n_begin; n < n_end; ++n) {
    output_scales(j, n, s.data(), b.data());
    const uint8_t* wr = reinterpret_cast<const uint8_t*>(j.w) + n * row_bytes;
    for (int m = 0; m < r.M; ++m) {
      const int8_t* xq = r.row_q(m);
      const float* dl = r.dl.data() + static_cast<size_t>(m) * r.pairs * 16;
      float acc[16] = {};
      for (int p = 0; p < r.pairs; ++p) {
        const int8_t* xp = xq + static_cast<size_t>(p) * r.q_per_pair();
        for (int l = 0; l < 16; ++l) {
          const size_t byte0 = static_cast<size_t>(p) * 64 + 4 * l;
          if (byte0 >= row_bytes) continue;  // a half pair: the lane is left as it is
          int32_t dot = 0;
          for (int i = 0; i < 4; ++i) {
            const int byte = 4 * l + i;
            const uint8_t v = wr[byte0 + i];
            if (r.bits == 4) {
              dot += static_cast<int32_t>(v & 0xf) * xp[byte] +
                     static_cast<int32_t>(v >> 4) * xp[64 + byte];
            } else {
              dot += static_cast<int32_t>(v) * xp[byte];
            }
          }
          const float sd = s[r.lane_group[p * 16 + l]] * dl[p * 16 + l];
          acc[l] = std::fma(static_cast<float>(dot), sd, acc[l]);
        }
      }
      j.out[static_cast<size_t>(m) * j.N + n] = lane_sum(acc) + bias_term(j, m, b.data());
    }
  }
}

// ---- AVX-512 VNNI: a pair of units is one register; vpdpbusd takes 4 bytes a lane ----------

#if BATCHSCOPE_HAS_VNNI
// Scales and biases are read straight from the weights' arrays (scales16) where a pair or the
// bias term needs them, so their cache misses overlap the packed weights' own.

// One pair of units for outputs n0..n0+NR and rows m0..m0+MR: each output's weights are
// unpacked once and meet each row's activations in one or two vpdpbusd. FULL: both units
// (else the first only: the row's last, half pair).
template <int BITS, ScaleType T, int MR, int NR, bool FULL>
inline void vnni_pair(const Job& j, int m0, int n0, const uint8_t* w0, size_t row_bytes, int p,
                      __m512 (&acc)[MR][NR]) {
  const QuantizedRows& r = j.rows;
  const __mmask64 bytes = FULL ? ~__mmask64{0} : __mmask64{0xffffffff};
  const __mmask16 lanes = FULL ? __mmask16{0xffff} : __mmask16{0x00ff};
  // each lane's group scale: 16 groups per block, a pair's lanes in one block
  const int block = r.lane_group[p * 16] / 16 * 16;
  const __m512i local = _mm512_sub_epi32(_mm512_loadu_si512(r.lane_group.data() + p * 16),
                                         _mm512_set1_epi32(block));
  __m512i xlo[MR], xhi[MR];
  __m512 dl[MR];
  for (int i = 0; i < MR; ++i) {
    const int8_t* xp = r.row_q(m0 + i) + static_cast<size_t>(p) * r.q_per_pair();
    xlo[i] = _mm512_loadu_si512(xp);
    if constexpr (BITS == 4) xhi[i] = _mm512_loadu_si512(xp + 64);
    dl[i] = _mm512_loadu_ps(r.dl.data() + (static_cast<size_t>(m0 + i) * r.pairs + p) * 16);
  }
  for (int o = 0; o < NR; ++o) {
    const uint8_t* wp = w0 + o * row_bytes + static_cast<size_t>(p) * 64;
    __builtin_prefetch(wp + NR * row_bytes);  // the next tile's weights
    const __m512i v = FULL ? _mm512_loadu_si512(wp) : _mm512_maskz_loadu_epi8(bytes, wp);
    const size_t at = static_cast<size_t>(n0 + o) * r.G;
    const __m512 sl = _mm512_permutexvar_ps(local, scales16<T>(j.scales, at, block, r.G));
    __m512i lo = v, hi;
    if constexpr (BITS == 4) {
      const __m512i nibble = _mm512_set1_epi8(0x0f);
      lo = _mm512_and_si512(v, nibble);
      hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
    for (int i = 0; i < MR; ++i) {
      __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[i]);
      if constexpr (BITS == 4) dot = _mm512_dpbusd_epi32(dot, hi, xhi[i]);
      const __m512 f = _mm512_cvtepi32_ps(dot);
      const __m512 sd = _mm512_mul_ps(sl, dl[i]);
      acc[i][o] = FULL ? _mm512_fmadd_ps(f, sd, acc[i][o])
                       : _mm512_mask3_fmadd_ps(f, sd, acc[i][o], lanes);
    }
  }
}

// Outputs n0..n0+NR for rows m0..m0+MR.
template <int BITS, ScaleType T, int MR, int NR>
void vnni_tile(const Job& j, int m0, int n0) {
  const QuantizedRows& r = j.rows;
  const size_t row_bytes = static_cast<size_t>(r.K) * BITS / 8;
  const uint8_t* w0 = reinterpret_cast<const uint8_t*>(j.w) + n0 * row_bytes;
  const int full = static_cast<int>(row_bytes / 64);  // pairs with both units
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int o = 0; o < NR; ++o) acc[i][o] = _mm512_setzero_ps();
  for (int p = 0; p < full; ++p) vnni_pair<BITS, T, MR, NR, true>(j, m0, n0, w0, row_bytes, p, acc);
  if (full < r.pairs) vnni_pair<BITS, T, MR, NR, false>(j, m0, n0, w0, row_bytes, full, acc);
  for (int i = 0; i < MR; ++i) {
    const float* xs = r.xs.data() + static_cast<size_t>(m0 + i) * r.G16;
    for (int o = 0; o < NR; ++o) {
      // bias_term's lanes, sixteen at once
      const size_t at = static_cast<size_t>(n0 + o) * r.G;
      __m512 bacc = _mm512_setzero_ps();
      for (int g = 0; g < r.G16; g += 16)
        bacc = _mm512_fmadd_ps(scales16<T>(j.biases, at, g, r.G), _mm512_loadu_ps(xs + g), bacc);
      j.out[static_cast<size_t>(m0 + i) * j.N + n0 + o] =
          lane_sum(VecAvx512{acc[i][o]}) + lane_sum(VecAvx512{bacc});
    }
  }
}

// Rows in tiles of up to 4; at 3-4 rows two outputs at a time, so that the accumulators, the
// rows' activations and the unpacked weights stay in the 32 registers.
template <int BITS, ScaleType T, int NT, int MR = 4>
void vnni_rows(const Job& j, int m0, int rows, int n0) {
  if constexpr (MR >= 1) {
    if (rows < MR) return vnni_rows<BITS, T, NT, MR - 1>(j, m0, rows, n0);
    constexpr int NR = MR <= 2 ? NT : (NT >= 2 ? 2 : 1);
    for (int o = 0; o < NT; o += NR) vnni_tile<BITS, T, MR, NR>(j, m0, n0 + o);
  }
}

constexpr int VNNI_NR = 4;

template <int BITS, ScaleType T, int NT>
void vnni_outputs_nt(const Job& j, int n0) {
  for (int m = 0; m < j.rows.M;) {
    const int rows = std::min(4, j.rows.M - m);
    vnni_rows<BITS, T, NT>(j, m, rows, n0);
    m += rows;
  }
}

template <int BITS, ScaleType T>
void vnni_outputs(const Job& j, int n_begin, int n_end) {
  int n = n_begin;
  const size_t G = j.rows.G;
  prefetch_scales(j.scales, j.biases, T, G, n, std::min(VNNI_NR, n_end - n));
  for (; n + VNNI_NR <= n_end; n += VNNI_NR) {
    const int ahead = n + VNNI_NR;  // the next tile's, a tile ahead
    if (ahead < n_end) {
      prefetch_scales(j.scales, j.biases, T, G, ahead, std::min(VNNI_NR, n_end - ahead));
    }
    vnni_outputs_nt<BITS, T, VNNI_NR>(j, n);
  }
  for (; n < n_end; ++n) vnni_outputs_nt<BITS, T, 1>(j, n);
}

template <int BITS>
void vnni_outputs_bits(const Job& j, int n_begin, int n_end) {
  switch (j.scale_type) {
    case ScaleType::f16: return vnni_outputs<BITS, ScaleType::f16>(j, n_begin, n_end);
    case ScaleType::bf16: return vnni_outputs<BITS, ScaleType::bf16>(j, n_begin, n_end);
    default: return vnni_outputs<BITS, ScaleType::f32>(j, n_begin, n_end);
  }
}
#endif  // BATCHSCOPE_HAS_VNNI

void outputs(const Job& j, int n_begin, int n_end, bool vnni) {
#if BATCHSCOPE_HAS_VNNI
  if (vnni) {
    if (j.rows.bits == 4) return vnni_outputs_bits<4>(j, n_begin, n_end);
    return vnni_outputs_bits<8>(j, n_begin, n_end);
  }
#endif
  (void)vnni;
  portable_outputs(j, n_begin, n_end);
}

}  // namespace

bool quantized_int8_vnni_built() {
  return BATCHSCOPE_HAS_VNNI;
}

void quantized_linear_rows_int8(const float* x, int M, int K, const uint32_t* w,
                                const void* scales, const void* biases, mx::Dtype scale_dtype,
                                int N, int group_size, int bits, float* out) {
  thread_local QuantizedRows rows;  // reused: no allocation per call once grown
  quantize_rows(x, M, K, group_size, bits, rows);
  const Job j{rows, w, scales, biases, scale_type_of(scale_dtype), out, N};
  // The vector path where the quantized kernel's instruction set is AVX-512 (and the build
  // has VNNI), else the portable one: the same bits (tests/engine/test_quantized_int8.py).
  const bool vnni = BATCHSCOPE_HAS_VNNI && decode_quantized_isa() == "avx512";
  constexpr int unit = 4;
  const int tiles = (N + unit - 1) / unit;
  if (static_cast<int64_t>(M) * K * N >= (1 << 16)) {
    const int chunk = std::max(1, tiles / (parallel_threads() * 8));
    auto body = [&](int begin, int end) {
      outputs(j, begin * unit, std::min(N, end * unit), vnni);
    };
    if (parallel_for(tiles, chunk, body)) return;
  }
  outputs(j, 0, N, vnni);
}

}  // namespace batchscope
