#include "decode_linear.h"

#include <algorithm>
#include <cmath>

#include "cpu_dispatch.h"
#include "inputs.h"
#include "simd.h"
#include "workers.h"

namespace batchscope {

namespace {

// A tile is 8 x rows by 3 weight rows: 24 accumulators and 8 x vectors fill the 32 AVX-512
// registers, and each k step loads 11 vectors for 24 multiply-adds (a 4 x 4 tile loads 8 for
// 16, and the compiler folded its x loads into the multiply-adds, loading each x 4 times).
constexpr int ROWS = 8;
constexpr int COLS = 3;
// Prefetch the weight rows this far ahead (two tiles): memory, not arithmetic, bounds a
// few-row step, and the prefetch hides the next rows' latency behind this tile's work
// (measured by benchmarks/decode_linear.py --rows 8 16 on builds without and with it). Past
// the last row it is harmless: a prefetch never faults.
constexpr int PREFETCH_ROWS = 2 * COLS;

// s plus the k % 16 tail's n < 16 products x[k] * w[k], in k order, in the steps the kernel has
// always taken (those of its compiler's vectorized tail when it was built with contraction): a
// chunk of 8 if there are 8, then one of 4 if 4 are left, each product rounded and then added,
// and the last (at most 3) one fma each.
inline float tail_sum(float s, const float* x, const float* w, int n) {
  int k = 0;
  for (int chunk = 8; chunk >= 4; chunk /= 2) {
    if (n - k < chunk) continue;
    for (const int end = k + chunk; k < end; ++k) s += x[k] * w[k];
  }
  for (; k < n; ++k) s = std::fma(x[k], w[k], s);
  return s;
}

// out[m][n] for m in [m0, m0+MR), n in [n0, n0+NR). Each output sums x[m][k] * w[n][k] in 16
// lanes (lane l takes k = l, l+16, ..., one fma each), then lane_sum's tree (vector_math.h),
// then tail_sum: the same steps for any MR and NR, so a row's result does not depend on the
// tile it lands in.
template <int MR, int NR>
inline void tile(const float* x, const float* w, float* out, int K, int N, int m0, int n0) {
  V acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = V::zero();
  const int k16 = K - K % 16;
  for (int k = 0; k < k16; k += 16) {
    V xv[MR];
    for (int i = 0; i < MR; ++i) {
      xv[i] = V::load(x + static_cast<size_t>(m0 + i) * K + k);
      pin(xv[i]);  // keep it in a register: loaded once, used NR times
    }
    for (int j = 0; j < NR; ++j) {
      const float* wr = w + static_cast<size_t>(n0 + j) * K + k;
      __builtin_prefetch(wr + static_cast<size_t>(PREFETCH_ROWS) * K);
      const V wv = V::load(wr);
      for (int i = 0; i < MR; ++i) acc[i][j] = fma(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = lane_sum(acc[i][j]);
      const float* xr = x + static_cast<size_t>(m0 + i) * K;
      const float* wr = w + static_cast<size_t>(n0 + j) * K;
      out[static_cast<size_t>(m0 + i) * N + n0 + j] = tail_sum(s, xr + k16, wr + k16, K - k16);
    }
  }
}

template <int NR>
void column_tile(const float* x, const float* w, float* out, int M, int K, int N, int n0) {
  int m = 0;
  for (; m + ROWS <= M; m += ROWS) tile<ROWS, NR>(x, w, out, K, N, m, n0);
  switch (M - m) {
    case 7: tile<7, NR>(x, w, out, K, N, m, n0); break;
    case 6: tile<6, NR>(x, w, out, K, N, m, n0); break;
    case 5: tile<5, NR>(x, w, out, K, N, m, n0); break;
    case 4: tile<4, NR>(x, w, out, K, N, m, n0); break;
    case 3: tile<3, NR>(x, w, out, K, N, m, n0); break;
    case 2: tile<2, NR>(x, w, out, K, N, m, n0); break;
    case 1: tile<1, NR>(x, w, out, K, N, m, n0); break;
    default: break;
  }
}

// Outputs [n_begin, n_end) for all M rows. Weight rows are the outer loop: each is read from
// memory once and reused from cache for every x row.
void linear_range(const float* x, const float* w, float* out, int M, int K, int N, int n_begin,
                  int n_end) {
  int n = n_begin;
  for (; n + COLS <= n_end; n += COLS) column_tile<COLS>(x, w, out, M, K, N, n);
  for (; n < n_end; ++n) column_tile<1>(x, w, out, M, K, N, n);
}

constexpr Check check{"decode_linear"};

}  // namespace

void linear_rows(const float* x, const float* w, float* out, int M, int K, int N) {
  // Column tiles in chunks, shared by the threads (batchscope::parallel_for): a thread that
  // starts late or runs slow takes fewer. Below ~64k multiply-adds one thread is faster.
  const int tiles = (N + COLS - 1) / COLS;
  if (static_cast<int64_t>(M) * K * N >= (1 << 16)) {
    const int chunk = std::max(1, tiles / (parallel_threads() * 8));
    auto columns = [&](int begin, int end) {
      linear_range(x, w, out, M, K, N, begin * COLS, std::min(N, end * COLS));
    };
    if (parallel_for(tiles, chunk, columns)) return;
  }
  linear_range(x, w, out, M, K, N, 0, N);
}

mx::array decode_linear(const mx::array& x, const mx::array& weight, mx::StreamOrDevice s) {
  check(x.ndim() >= 1 && weight.ndim() == 2, "x must be (..., in) and weight (out, in)");
  check(x.shape(-1) == weight.shape(1), "x and weight disagree on in_features");
  check(weight.shape(1) > 0, "in_features must be at least 1");
  check(x.dtype() == mx::float32 && weight.dtype() == mx::float32,
        "only float32 is supported (other formats keep MLX's matmul)");
  auto stream = mx::to_stream(s);
  auto shape = x.shape();
  shape.back() = weight.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<DecodeLinear>(stream),
                   {row_contiguous(x, stream), row_contiguous(weight, stream)});
}

void DecodeLinear::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  auto& out = allocate(outputs[0]);
  const int K = static_cast<int>(w.shape(1));
  const int N = static_cast<int>(w.shape(0));
  const int M = static_cast<int>(x.size() / std::max(K, 1));
  dispatch(stream(), inputs, out,
           [x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
            out = mx::array::unsafe_weak_copy(out), M, K, N]() mutable {
             linear_rows(x.data<float>(), w.data<float>(), out.data<float>(), M, K, N);
           });
}

void DecodeLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("decode_linear runs on the CPU only; on a GPU MLX's matmul is used");
}

}  // namespace batchscope
