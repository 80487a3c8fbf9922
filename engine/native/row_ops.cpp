#include "row_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_dispatch.h"
#include "inputs.h"
#include "mlx/backend/cpu/encoder.h"
#include "vector_math.h"
#include "workers.h"

// Built with -ffp-contract=off (a * c - b * s rounds each product, as MLX's separate ops do)
// and for this machine's CPU (the fused multiply-adds of exp_nonpositive are instructions).

namespace batchscope {

namespace {

// The same fixed order for every row: 16 running sums, then a tree over them.
float sum_of_squares(const float* x, int n) {
  float lanes[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) lanes[l] += x[i + l] * x[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) lanes[l] += x[i] * x[i];
  for (int w = 8; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  }
  return lanes[0];
}

}  // namespace

mx::array rms_norm_rows(const mx::array& x, const mx::array& weight, float eps,
                        mx::StreamOrDevice s) {
  constexpr Check check{"rms_norm_rows"};
  check(x.ndim() >= 1 && x.dtype() == mx::float32, "x must be float32 (..., D)");
  check(weight.ndim() == 1 && weight.dtype() == mx::float32 && weight.shape(0) == x.shape(-1),
        "weight must be float32 (D,) with x's last dimension");
  auto stream = mx::to_stream(s);
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNormRows>(stream, eps),
                   {row_contiguous(x, stream), row_contiguous(weight, stream)});
}

void rms_norm_rows_into(const float* x, const float* w, size_t rows, int D, float eps,
                        float* out) {
  const float inv_d = static_cast<float>(1.0 / D);  // mean = sum * (1 / D), as MLX
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* o = out + r * D;
    const float scale = 1.0f / std::sqrt(sum_of_squares(xr, D) * inv_d + eps);
    for (int i = 0; i < D; ++i) o[i] = (xr[i] * scale) * w[i];
  }
}

void RmsNormRows::eval_cpu(const std::vector<mx::array>& inputs,
                           std::vector<mx::array>& outputs) {
  auto& out = allocate(outputs[0]);
  dispatch(stream(), inputs, out,
           [x = mx::array::unsafe_weak_copy(inputs[0]),
            w = mx::array::unsafe_weak_copy(inputs[1]), out = mx::array::unsafe_weak_copy(out),
            eps = eps_]() mutable {
             const int D = static_cast<int>(w.shape(0));
             rms_norm_rows_into(x.data<float>(), w.data<float>(), x.size() / D, D, eps,
                                out.data<float>());
           });
}

namespace {

// As MLX's CPU logsumexp computes it: the maximum, then the exps summed one after another in
// index order (MLX's Linux CPU build sums them so), then log of the sum plus the maximum. Only
// the exps are vectorized, into `scratch`; the bits are mlx.core.logsumexp's.
float logsumexp_row(const float* x, int n, std::vector<float>& scratch) {
  float m = x[0];
  for (int i = 1; i < n; ++i) m = std::max(m, x[i]);
  if (std::isinf(m)) return m;
  scratch.resize(n);
  float* e = scratch.data();
  for (int i = 0; i < n; ++i) e[i] = exp_nonpositive(x[i] - m);
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += e[i];
  return std::log(sum) + m;
}

}  // namespace

mx::array logsumexp_rows(const mx::array& x, mx::StreamOrDevice s) {
  constexpr Check check{"logsumexp_rows"};
  check(x.ndim() == 2 && x.dtype() == mx::float32 && x.shape(1) > 0,
        "x must be float32 (rows, V)");
  auto stream = mx::to_stream(s);
  return mx::array({x.shape(0)}, mx::float32, std::make_shared<LogSumExpRows>(stream),
                   {row_contiguous(x, stream)});
}

void LogSumExpRows::eval_cpu(const std::vector<mx::array>& inputs,
                             std::vector<mx::array>& outputs) {
  auto& out = allocate(outputs[0]);
  dispatch(stream(), inputs, out,
           [x = mx::array::unsafe_weak_copy(inputs[0]),
            out = mx::array::unsafe_weak_copy(out)]() mutable {
             const int rows = static_cast<int>(x.shape(0)), n = static_cast<int>(x.shape(1));
             const float* xs = x.data<float>();
             float* os = out.data<float>();
             auto body = [&](int begin, int end) {
               thread_local std::vector<float> scratch;
               for (int r = begin; r < end; ++r) {
                 os[r] = logsumexp_row(xs + static_cast<size_t>(r) * n, n, scratch);
               }
             };
             if (!parallel_for(rows, 1, body)) body(0, rows);
           });
}

std::vector<mx::array> greedy_rows(const mx::array& x, mx::StreamOrDevice s) {
  constexpr Check check{"greedy_rows"};
  check(x.ndim() == 2 && x.dtype() == mx::float32 && x.shape(1) > 0,
        "x must be float32 (rows, V)");
  auto stream = mx::to_stream(s);
  return mx::array::make_arrays({{x.shape(0)}, {x.shape(0)}}, {mx::uint32, mx::float32},
                                std::make_shared<GreedyRows>(stream),
                                {row_contiguous(x, stream)});
}

void GreedyRows::eval_cpu(const std::vector<mx::array>& inputs,
                          std::vector<mx::array>& outputs) {
  auto& ids = allocate(outputs[0]);
  auto& lps = allocate(outputs[1]);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(ids);
  encoder.set_output_array(lps);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                    ids = mx::array::unsafe_weak_copy(ids),
                    lps = mx::array::unsafe_weak_copy(lps)]() mutable {
    const int rows = static_cast<int>(x.shape(0)), n = static_cast<int>(x.shape(1));
    auto body = [&](int begin, int end) {
      thread_local std::vector<float> scratch;
      for (int r = begin; r < end; ++r) {
        const float* xr = x.data<float>() + static_cast<size_t>(r) * n;
        const float lse = logsumexp_row(xr, n, scratch);
        // MLX's argmax of the logprobs: start at index 0, move on a strictly larger value.
        uint32_t at = 0;
        float best = xr[0] - lse;
        for (int j = 1; j < n; ++j) {
          const float v = xr[j] - lse;
          if (v > best) {
            best = v;
            at = static_cast<uint32_t>(j);
          }
        }
        ids.data<uint32_t>()[r] = at;
        lps.data<float>()[r] = best;
      }
    };
    if (!parallel_for(rows, 1, body)) body(0, rows);
  });
}

void GreedyRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("greedy_rows runs on the CPU only");
}

void LogSumExpRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("logsumexp_rows runs on the CPU only");
}

void RmsNormRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("rms_norm_rows runs on the CPU only");
}

mx::array rope_rows(const mx::array& x, const mx::array& positions, const mx::array& inv_freqs,
                    int dims, bool traditional, float scale, mx::StreamOrDevice s) {
  constexpr Check check{"rope_rows"};
  check(x.ndim() == 3 && x.dtype() == mx::float32,
        "x must be float32 (rows, heads, head_dim)");
  check(positions.ndim() == 1 && positions.dtype() == mx::int32 &&
            positions.shape(0) == x.shape(0),
        "positions must be int32 (rows,)");
  check(dims > 0 && dims % 2 == 0 && dims <= x.shape(2),
        "dims must be even and at most head_dim, not " + std::to_string(dims));
  check(inv_freqs.ndim() == 1 && inv_freqs.dtype() == mx::float32 &&
            inv_freqs.shape(0) == dims / 2,
        "inv_freqs must be float32 (dims / 2,)");
  auto stream = mx::to_stream(s);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<RopeRows>(stream, dims, traditional, scale),
                   {row_contiguous(x, stream), row_contiguous(positions, stream),
                    row_contiguous(inv_freqs, stream)});
}

void rope_rows_into(const float* x, size_t row_stride, const int32_t* positions,
                    const float* inv_freqs, int rows, int heads, int dim, int dims,
                    bool traditional, float scale, float* out) {
  const int half = dims / 2;
  std::vector<float> c(half), sn(half);
  for (int r = 0; r < rows; ++r) {
    const float p = static_cast<float>(positions[r]) * scale;
    for (int i = 0; i < half; ++i) {
      const float theta = p * inv_freqs[i];
      c[i] = std::cos(theta);
      sn[i] = std::sin(theta);
    }
    for (int h = 0; h < heads; ++h) {
      const float* xr = x + r * row_stride + static_cast<size_t>(h) * dim;
      float* o = out + (static_cast<size_t>(r) * heads + h) * dim;
      for (int i = 0; i < half; ++i) {
        const int a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
        o[a] = xr[a] * c[i] - xr[b] * sn[i];
        o[b] = xr[a] * sn[i] + xr[b] * c[i];
      }
      for (int i = dims; i < dim; ++i) o[i] = xr[i];
    }
  }
}

void RopeRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = allocate(outputs[0]);
  dispatch(stream(), inputs, out,
           [x = mx::array::unsafe_weak_copy(inputs[0]),
            pos = mx::array::unsafe_weak_copy(inputs[1]),
            inv = mx::array::unsafe_weak_copy(inputs[2]), out = mx::array::unsafe_weak_copy(out),
            dims = dims_, traditional = traditional_, scale = scale_]() mutable {
             const int heads = static_cast<int>(x.shape(1)), dim = static_cast<int>(x.shape(2));
             rope_rows_into(x.data<float>(), static_cast<size_t>(heads) * dim,
                            pos.data<int32_t>(), inv.data<float>(),
                            static_cast<int>(x.shape(0)), heads, dim, dims, traditional, scale,
                            out.data<float>());
           });
}

void RopeRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("rope_rows runs on the CPU only");
}

mx::array quantized_embedding_rows(const mx::array& w, const mx::array& scales,
                                   const mx::array& biases, const mx::array& ids,
                                   int group_size, int bits, mx::StreamOrDevice s) {
  constexpr Check check{"quantized_embedding_rows"};
  check(bits == 4 || bits == 8, "bits must be 4 or 8, not " + std::to_string(bits));
  check(w.ndim() == 2 && w.dtype() == mx::uint32, "w must be uint32 (V, D * bits / 32)");
  const auto dtype = scales.dtype();
  check(dtype == mx::float32 || dtype == mx::float16 || dtype == mx::bfloat16,
        "scales must be float32, float16 or bfloat16");
  const int64_t dims = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  check(group_size > 0 && dims % group_size == 0,
        "group_size must divide the row's " + std::to_string(dims) + " values");
  for (const auto* a : {&scales, &biases}) {
    check(a->ndim() == 2 && a->dtype() == dtype && a->shape(0) == w.shape(0) &&
              a->shape(1) == dims / group_size,
          "scales and biases must be (V, D / group_size) of one dtype, not " + shape_str(*a));
  }
  check(ids.ndim() == 1 && (ids.dtype() == mx::int32 || ids.dtype() == mx::uint32),
        "ids must be int32 or uint32 (rows,)");
  auto stream = mx::to_stream(s);
  return mx::array({ids.shape(0), static_cast<int>(dims)}, dtype,
                   std::make_shared<QuantizedEmbeddingRows>(stream, group_size, bits),
                   {row_contiguous(w, stream), row_contiguous(scales, stream),
                    row_contiguous(biases, stream), row_contiguous(ids, stream)});
}

namespace {

// T is the scales' type. MLX's half types compute each operation in float32 and round the
// result to T (mlx/types/fp16.h, bf16.h), as MLX's CPU multiply and add ops do.
template <class T, class Id>
void embed_rows(const uint32_t* w, const T* scales, const T* biases, const Id* ids,
                int rows, int64_t vocab, int dims, int group_size, int bits, T* out) {
  const int per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1;
  const int64_t words = dims / per_word, groups = dims / group_size;
  for (int r = 0; r < rows; ++r) {
    T* o = out + static_cast<size_t>(r) * dims;
    const int64_t id = ids[r];
    if (id < 0 || id >= vocab) {
      std::fill(o, o + dims, static_cast<T>(std::numeric_limits<float>::quiet_NaN()));
      continue;
    }
    const uint32_t* wr = w + id * words;
    const T* sr = scales + id * groups;
    const T* br = biases + id * groups;
    for (int k = 0; k < dims; ++k) {
      const uint32_t q = (wr[k / per_word] >> ((k % per_word) * bits)) & mask;
      const T product = static_cast<T>(static_cast<float>(q)) * sr[k / group_size];
      o[k] = product + br[k / group_size];
    }
  }
}

}  // namespace

void QuantizedEmbeddingRows::eval_cpu(const std::vector<mx::array>& inputs,
                                      std::vector<mx::array>& outputs) {
  auto& out = allocate(outputs[0]);
  dispatch(stream(), inputs, out,
           [w = mx::array::unsafe_weak_copy(inputs[0]),
            scales = mx::array::unsafe_weak_copy(inputs[1]),
            biases = mx::array::unsafe_weak_copy(inputs[2]),
            ids = mx::array::unsafe_weak_copy(inputs[3]), out = mx::array::unsafe_weak_copy(out),
            group_size = group_size_, bits = bits_]() mutable {
             const int rows = static_cast<int>(ids.shape(0));
             const int dims = static_cast<int>(out.shape(1));
             auto run = [&](auto* type) {
               using T = std::remove_pointer_t<decltype(type)>;
               if (ids.dtype() == mx::uint32) {  // a step's sampled tokens (argmax's type)
                 embed_rows(w.data<uint32_t>(), scales.data<T>(), biases.data<T>(),
                            ids.data<uint32_t>(), rows, w.shape(0), dims, group_size, bits,
                            out.data<T>());
               } else {
                 embed_rows(w.data<uint32_t>(), scales.data<T>(), biases.data<T>(),
                            ids.data<int32_t>(), rows, w.shape(0), dims, group_size, bits,
                            out.data<T>());
               }
             };
             switch (out.dtype()) {
               case mx::float16: return run(static_cast<mx::float16_t*>(nullptr));
               case mx::bfloat16: return run(static_cast<mx::bfloat16_t*>(nullptr));
               default: return run(static_cast<float*>(nullptr));
             }
           });
}

void QuantizedEmbeddingRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("quantized_embedding_rows runs on the CPU only");
}

}  // namespace batchscope
