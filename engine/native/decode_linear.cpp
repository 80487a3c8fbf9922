#include "decode_linear.h"

#include <algorithm>
#include <cstring>

#include "cpu_dispatch.h"
#include "inputs.h"
#include "workers.h"

namespace batchscope {

namespace {

// Each output is one chain of fused multiply-adds over k in order:
//   out[m][n] = fma(x[m][K-1], w[n][K-1], ... fma(x[m][1], w[n][1], fma(x[m][0], w[n][0], 0))).
// A tile runs many chains side by side (x[m][k] broadcast, 16 outputs a vector) and changes
// none of them, so a row's bits are the same in a call of any size, in any tile, with any
// thread count and on every instruction-set path.
//
// The tile per path: rows x vectors of 16 outputs. AVX-512: 6 x 4 (24 accumulators, 4 weight
// vectors and a broadcast in 32 registers; each k step loads 10 values for 24 multiply-adds).
// AVX2: a vector is two registers, so 2 x 2 (8 + 4 + 2 of 16). Portable: the compiler's.
// A call of 7 or 8 rows takes MR x 3 and then MR x 1 (one_pass). Measured by hand over the
// model's 211 linear layers at 8 rows and not kept: 8 x 4, which spills, and 8 x 2 over half
// a panel at a time, which reads each panel from memory twice; neither beat 6 x 4 then 2 x 4.
template <Isa I>
struct TileShape {
  static constexpr int rows = 4, vecs = 4;
};
template <>
struct TileShape<Isa::avx512> {
  static constexpr int rows = 6, vecs = 4;
};
template <>
struct TileShape<Isa::avx2> {
  static constexpr int rows = 2, vecs = 2;
};

// Prefetch the panel this many k steps ahead. Measured by hand over the model's 211 linear
// layers on 2 threads, without it and with it: 32 -> 24 ms at 4 rows, 45 -> 32 ms at 8
// (32 steps ahead measured the same as 16).
constexpr int PREFETCH_K = 16;

// out[m0 .. m0+MR)[n0 .. n0 + 16 NV) from `panel` (the packed rows of those outputs, stride
// LINEAR_PANEL per k); outputs at or past N are computed on the panel's zeros and not stored.
template <Isa I, int MR, int NV>
inline void tile(const float* x, const float* panel, float* out, int K, int N, int m0, int n0) {
  using W = Vec<I>;
  W acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = W::zero();
  const float* xr = x + static_cast<size_t>(m0) * K;
  for (int k = 0; k < K; ++k) {
    const float* wk = panel + static_cast<size_t>(k) * LINEAR_PANEL;
    for (int j = 0; j < NV; ++j) __builtin_prefetch(wk + PREFETCH_K * LINEAR_PANEL + 16 * j);
    W w[NV];
    for (int j = 0; j < NV; ++j) w[j] = W::load(wk + 16 * j);
    for (int i = 0; i < MR; ++i) {
      const W xb = W::bcast(xr[static_cast<size_t>(i) * K + k]);
      for (int j = 0; j < NV; ++j) acc[i][j] = fma(xb, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* o = out + static_cast<size_t>(m0 + i) * N;
    for (int j = 0; j < NV; ++j) {
      const int n = n0 + 16 * j;
      if (n + 16 <= N) {
        acc[i][j].store(o + n);
      } else if (n < N) {
        float last[16];
        acc[i][j].store(last);
        std::memcpy(o + n, last, sizeof(float) * (N - n));
      }
    }
  }
}

// The last M % rows rows: one tile of exactly that many.
template <Isa I, int NV, int MR>
inline void last_rows(int left, const float* x, const float* panel, float* out, int K, int N,
                      int m0, int n0) {
  if constexpr (MR > 0) {
    if (left == MR) tile<I, MR, NV>(x, panel, out, K, N, m0, n0);
    else last_rows<I, NV, MR - 1>(left, x, panel, out, K, N, m0, n0);
  }
}

// All MR rows of panels [p_begin, p_end) in one pass over each panel from memory: MR rows x
// 3 vectors (27 registers at MR = 8), then the panel's last 16 outputs from cache, where
// 6 + 2 rows would walk the panel twice (AVX-512, 7 or 8 rows).
template <Isa I, int MR>
void one_pass(const float* x, const float* packed, float* out, int K, int N, int p_begin,
              int p_end) {
  for (int p = p_begin; p < p_end; ++p) {
    const float* panel = packed + static_cast<size_t>(p) * K * LINEAR_PANEL;
    const int n0 = p * LINEAR_PANEL;
    tile<I, MR, 3>(x, panel, out, K, N, 0, n0);
    if (n0 + 48 < N) tile<I, MR, 1>(x, panel + 48, out, K, N, 0, n0 + 48);
  }
}

// Outputs of panels [p_begin, p_end) for all M rows: a panel's column group is read from
// memory once and reused from cache for every tile of rows.
template <Isa I>
void panels(const float* x, const float* packed, float* out, int M, int K, int N, int p_begin,
            int p_end) {
  constexpr int R = TileShape<I>::rows, NV = TileShape<I>::vecs;
  if constexpr (I == Isa::avx512) {
    if (M == 8) return one_pass<I, 8>(x, packed, out, K, N, p_begin, p_end);
    if (M == 7) return one_pass<I, 7>(x, packed, out, K, N, p_begin, p_end);
  }
  for (int p = p_begin; p < p_end; ++p) {
    for (int c = 0; c < LINEAR_PANEL && p * LINEAR_PANEL + c < N; c += 16 * NV) {
      const float* panel = packed + static_cast<size_t>(p) * K * LINEAR_PANEL + c;
      const int n0 = p * LINEAR_PANEL + c;
      int m = 0;
      for (; m + R <= M; m += R) tile<I, R, NV>(x, panel, out, K, N, m, n0);
      last_rows<I, NV, R - 1>(M - m, x, panel, out, K, N, m, n0);
    }
  }
}

template <Isa I>
void linear_with(const float* x, const float* packed, float* out, int M, int K, int N) {
  // Panels in chunks, shared by the threads (batchscope::parallel_for): a thread that starts
  // late or runs slow takes fewer. Below ~64k multiply-adds one thread is faster.
  const int count = (N + LINEAR_PANEL - 1) / LINEAR_PANEL;
  if (static_cast<int64_t>(M) * K * N >= (1 << 16)) {
    const int chunk = std::max(1, count / (parallel_threads() * 4));
    auto some = [&](int begin, int end) { panels<I>(x, packed, out, M, K, N, begin, end); };
    if (parallel_for(count, chunk, some)) return;
  }
  panels<I>(x, packed, out, M, K, N, 0, count);
}

constexpr Check check{"decode_linear"};

}  // namespace

void linear_rows(const float* x, const float* packed, float* out, int M, int K, int N,
                 Isa isa) {
  switch (isa) {
#if BATCHSCOPE_HAS_AVX512
    case Isa::avx512: linear_with<Isa::avx512>(x, packed, out, M, K, N); return;
#endif
#if BATCHSCOPE_HAS_AVX2
    case Isa::avx2: linear_with<Isa::avx2>(x, packed, out, M, K, N); return;
#endif
    default: linear_with<Isa::portable>(x, packed, out, M, K, N); return;
  }
}

mx::array pack_linear_weight(const mx::array& weight, mx::StreamOrDevice s) {
  check(weight.ndim() == 2, "weight must be (out, in), not " + shape_str(weight));
  check(weight.dtype() == mx::float32, "only float32 is supported (other formats keep MLX's "
                                       "matmul)");
  check(weight.shape(0) > 0 && weight.shape(1) > 0, "weight must not be empty");
  const int N = static_cast<int>(weight.shape(0));
  const int K = static_cast<int>(weight.shape(1));
  const int panels = (N + LINEAR_PANEL - 1) / LINEAR_PANEL;
  mx::array w = weight;
  if (panels * LINEAR_PANEL != N) w = mx::pad(w, {{0, panels * LINEAR_PANEL - N}, {0, 0}},
                                              mx::array(0.0f), "constant", s);
  w = mx::transpose(mx::reshape(w, {panels, LINEAR_PANEL, K}, s), {0, 2, 1}, s);
  return mx::contiguous(w, false, s);
}

mx::array decode_linear(const mx::array& x, const mx::array& packed, int out_features,
                        const std::string& isa, mx::StreamOrDevice s) {
  check(x.ndim() >= 1, "x must be (..., in)");
  check(out_features > 0, "out_features must be at least 1");
  check(x.dtype() == mx::float32 && packed.dtype() == mx::float32,
        "only float32 is supported (other formats keep MLX's matmul)");
  const int panels = (out_features + LINEAR_PANEL - 1) / LINEAR_PANEL;
  check(packed.ndim() == 3 && packed.shape(0) == panels && packed.shape(2) == LINEAR_PANEL,
        "weight " + shape_str(packed) + " is not packed for " + std::to_string(out_features) +
            " outputs: pack_linear_weight makes (" + std::to_string(panels) + ", in, " +
            std::to_string(LINEAR_PANEL) + ")");
  check(x.shape(-1) == packed.shape(1), "x and weight disagree on in_features");
  check(packed.shape(1) > 0, "in_features must be at least 1");
  Isa path;
  check(parse_isa(isa, &path), "unknown path '" + isa + "' (auto, avx512, avx2 or portable)");
  check(isa_built(path), "this CPU or build has no " + isa + " path");
  auto stream = mx::to_stream(s);
  auto shape = x.shape();
  shape.back() = out_features;
  return mx::array(shape, mx::float32, std::make_shared<DecodeLinear>(stream, out_features, path),
                   {row_contiguous(x, stream), row_contiguous(packed, stream)});
}

void DecodeLinear::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  auto& out = allocate(outputs[0]);
  const int K = static_cast<int>(w.shape(1));
  const int N = out_features_;
  const int M = static_cast<int>(x.size() / std::max(K, 1));
  dispatch(stream(), inputs, out,
           [x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
            out = mx::array::unsafe_weak_copy(out), M, K, N, isa = isa_]() mutable {
             linear_rows(x.data<float>(), w.data<float>(), out.data<float>(), M, K, N, isa);
           });
}

void DecodeLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("decode_linear runs on the CPU only; on a GPU MLX's matmul is used");
}

}  // namespace batchscope
