#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "workers.h"

namespace batchscope {

namespace {

void check(bool ok, const std::string& message) {
  if (!ok) {
    throw std::invalid_argument("paged_decode_attention: " + message);
  }
}

// Dot product over dim with 8 independent float accumulators: the compiler can keep them in
// one vector register without reassociating anything, and the order of additions is fixed by
// the code, so every row gets the same arithmetic whatever else is in the step.
template <typename T>
inline float dot(const float* q, const T* k, int dim) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= dim; d += 8) {
    for (int j = 0; j < 8; ++j) {
      acc[j] += q[d + j] * static_cast<float>(k[d + j]);
    }
  }
  for (; d < dim; ++d) {
    acc[d % 8] += q[d] * static_cast<float>(k[d]);
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

struct Shapes {
  int rows, heads, kv_heads, dim, slots, max_blocks, block_size, window;
  float scale;
};

// Round to T and back: for float16/bfloat16, keep the intermediate precision of MLX's own
// attention (scaled queries, scores and probabilities are arrays of the model's dtype there).
template <typename T>
inline float in(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// One (row, kv head) at a time: the row's `rep` query heads that share this kv head read each
// cached key and value once. Scores are kept, then a max, exp and sum pass, then the values.
// Each row's arithmetic depends on its own query and context only, so a request gets the
// same bits whatever else shares the step.
template <typename T>
void decode_attention(const T* q, const T* k_pool, const T* v_pool, const int32_t* tables,
                      const int32_t* lens, T* out, Shapes s, int unit_begin, int unit_end) {
  const int rep = s.heads / s.kv_heads;
  const int dim = s.dim;
  std::vector<float> qf(rep * dim), scores, acc(rep * dim), sums(rep);
  for (int unit = unit_begin; unit < unit_end; ++unit) {
    const int r = unit / s.kv_heads;
    const int g = unit % s.kv_heads;
    // A sliding-window layer reads positions [first, context) only.
    const int first = s.window > 0 ? std::max(0, lens[r] - s.window) : 0;
    const int len = lens[r] - first;
    const int32_t* table = tables + static_cast<size_t>(r) * s.max_blocks;
    scores.resize(static_cast<size_t>(rep) * len);
    {
      for (int i = 0; i < rep * dim; ++i) {
        qf[i] = in<T>(static_cast<float>(q[(static_cast<size_t>(r) * s.heads + g * rep) * dim + i]) *
                      s.scale);
      }
      const T* kg = k_pool + static_cast<size_t>(g) * s.slots * dim;
      const T* vg = v_pool + static_cast<size_t>(g) * s.slots * dim;
      for (int t = 0; t < len; ++t) {
        const int p = first + t;
        size_t slot = static_cast<size_t>(table[p / s.block_size]) * s.block_size +
                      p % s.block_size;
        const T* key = kg + slot * dim;
        for (int h = 0; h < rep; ++h) {
          scores[static_cast<size_t>(h) * len + t] = in<T>(dot(qf.data() + h * dim, key, dim));
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int h = 0; h < rep; ++h) {
        float* sc = scores.data() + static_cast<size_t>(h) * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int t = 0; t < len; ++t) m = std::max(m, sc[t]);
        float sum = 0.0f;
        for (int t = 0; t < len; ++t) {
          sc[t] = std::exp(sc[t] - m);
          sum += sc[t];
        }
        sums[h] = sum;
        const float inv = 1.0f / sum;
        for (int t = 0; t < len; ++t) sc[t] = in<T>(sc[t] * inv);
      }
      for (int t = 0; t < len; ++t) {
        const int p = first + t;
        size_t slot = static_cast<size_t>(table[p / s.block_size]) * s.block_size +
                      p % s.block_size;
        const T* value = vg + slot * dim;
        for (int h = 0; h < rep; ++h) {
          const float p = scores[static_cast<size_t>(h) * len + t];
          float* a = acc.data() + h * dim;
          for (int d = 0; d < dim; ++d) a[d] += p * static_cast<float>(value[d]);
        }
      }
      for (int h = 0; h < rep; ++h) {
        T* o = out + (static_cast<size_t>(r) * s.heads + g * rep + h) * dim;
        for (int d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[h * dim + d]);
      }
    }
  }
}

}  // namespace

mx::array paged_decode_attention(const mx::array& q, const mx::array& k_pool,
                                 const mx::array& v_pool, const mx::array& block_tables,
                                 const mx::array& context_lens, float scale, int block_size,
                                 int window, mx::StreamOrDevice s) {
  check(q.ndim() == 3, "q must be (rows, heads, dim)");
  check(k_pool.ndim() == 3 && v_pool.shape() == k_pool.shape(),
        "k_pool and v_pool must both be (kv_heads, slots, dim)");
  check(k_pool.shape(2) == q.shape(2), "q and the pool disagree on dim");
  check(q.shape(1) % k_pool.shape(0) == 0, "heads must be a multiple of kv_heads");
  check(block_size > 0 && k_pool.shape(1) % block_size == 0,
        "the pool's slots must be whole blocks");
  check(block_tables.ndim() == 2 && block_tables.shape(0) == q.shape(0),
        "block_tables must be (rows, max_blocks)");
  check(context_lens.ndim() == 1 && context_lens.shape(0) == q.shape(0),
        "context_lens must be (rows,)");
  check(window >= 0, "window must be >= 0 (0: the whole context)");
  check(q.dtype() == k_pool.dtype() && q.dtype() == v_pool.dtype(),
        "q and the pool must have one dtype");
  check(q.dtype() == mx::float32 || q.dtype() == mx::float16 || q.dtype() == mx::bfloat16,
        "only float32, float16 and bfloat16 are supported");
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {
      mx::contiguous(q, false, stream), mx::contiguous(k_pool, false, stream),
      mx::contiguous(v_pool, false, stream),
      mx::contiguous(mx::astype(block_tables, mx::int32, stream), false, stream),
      mx::contiguous(mx::astype(context_lens, mx::int32, stream), false, stream)};
  return mx::array({q.shape(0), q.shape(1) * q.shape(2)}, q.dtype(),
                   std::make_shared<PagedDecodeAttention>(stream, scale, block_size, window),
                   std::move(inputs));
}

void PagedDecodeAttention::eval_cpu(const std::vector<mx::array>& inputs,
                                    std::vector<mx::array>& outputs) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const auto& tables = inputs[3];
  const auto& lens = inputs[4];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));

  Shapes shapes{static_cast<int>(q.shape(0)), static_cast<int>(q.shape(1)),
                static_cast<int>(k.shape(0)), static_cast<int>(q.shape(2)),
                static_cast<int>(k.shape(1)), static_cast<int>(tables.shape(1)), block_size_,
                window_, scale_};
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(q);
  encoder.set_input_array(k);
  encoder.set_input_array(v);
  encoder.set_input_array(tables);
  encoder.set_input_array(lens);
  encoder.set_output_array(out);
  encoder.dispatch([q = mx::array::unsafe_weak_copy(q), k = mx::array::unsafe_weak_copy(k),
                    v = mx::array::unsafe_weak_copy(v),
                    tables = mx::array::unsafe_weak_copy(tables),
                    lens = mx::array::unsafe_weak_copy(lens),
                    out = mx::array::unsafe_weak_copy(out), shapes]() mutable {
    const int32_t* table_ptr = tables.data<int32_t>();
    const int32_t* len_ptr = lens.data<int32_t>();
    // Bad tables would read outside the pool: check before touching it.
    const int blocks = shapes.slots / shapes.block_size;
    for (int r = 0; r < shapes.rows; ++r) {
      const int len = len_ptr[r];
      if (len < 1 || (len + shapes.block_size - 1) / shapes.block_size > shapes.max_blocks) {
        throw std::invalid_argument("paged_decode_attention: a context length is out of range");
      }
      for (int b = 0; b < (len + shapes.block_size - 1) / shapes.block_size; ++b) {
        int id = table_ptr[static_cast<size_t>(r) * shapes.max_blocks + b];
        if (id < 0 || id >= blocks) {
          throw std::invalid_argument("paged_decode_attention: a block id is out of range");
        }
      }
    }
    // The (row, kv head) units are shared by the threads (batchscope::parallel_for); a unit's
    // arithmetic does not depend on which thread runs it.
    const int units = shapes.rows * shapes.kv_heads;
    auto run = [&](auto* type_tag) {
      using T = std::remove_pointer_t<decltype(type_tag)>;
      auto part = [&](int begin, int end) {
        decode_attention(q.data<T>(), k.data<T>(), v.data<T>(), table_ptr, len_ptr,
                         out.data<T>(), shapes, begin, end);
      };
      if (!parallel_for(units, 1, part)) part(0, units);
    };
    switch (out.dtype()) {
      case mx::float32:
        run(static_cast<float*>(nullptr));
        break;
      case mx::float16:
        run(static_cast<mx::float16_t*>(nullptr));
        break;
      default:
        run(static_cast<mx::bfloat16_t*>(nullptr));
        break;
    }
  });
}

void PagedDecodeAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "paged_decode_attention runs on the CPU only; on a GPU the engine uses MLX's fused "
      "attention");
}

bool PagedDecodeAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedDecodeAttention&>(other);
  return scale_ == o.scale_ && block_size_ == o.block_size_ && window_ == o.window_;
}

}  // namespace batchscope
