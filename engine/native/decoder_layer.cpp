#include "decoder_layer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>

#include "decode_linear.h"
#include "decode_quantized.h"
#include "cpu_dispatch.h"
#include "inputs.h"
#include "mlx/transforms.h"
#include "paged_attention.h"
#include "row_ops.h"
#include "vector_math.h"
#include "workers.h"

// Built with -ffp-contract=off: every product and sum below rounds on its own, as MLX's
// separate elementwise ops round them.

namespace batchscope {

namespace {

constexpr Check check{"decoder_layer"};

// What a layer reads besides x, addressed by the layout's indices as one list: the weights
// from 1 (held by the spec, evaluated once: not graph inputs, so a step's op has a handful of
// inputs to schedule, not ~20 a layer), then from `pool` on the layer's pools and the step's
// tables (slots, positions, block tables, context and query lengths).
struct LayerInputs {
  const std::vector<mx::array>& weights;
  const mx::array& k_pool;
  const mx::array& v_pool;
  const mx::array* tables;  // the step's five
  int pool;
  const mx::array& operator[](int i) const {
    return i < pool ? weights[i - 1] : i == pool ? k_pool : i == pool + 1 ? v_pool
                                                                          : tables[i - pool - 2];
  }
};

// x (M, K) @ the linear's weights -> out (M, N), with the native kernel its kind takes.
void run_linear(const LayerLayout& s, int which, const LayerInputs& in,
                const float* x, int M, int K, int N, float* out) {
  const mx::array& w = in[s.first[which]];
  if (s.bits[which] == 0) {
    linear_rows(x, w.data<float>(), out, M, K, N);
    return;
  }
  const mx::array& scales = in[s.first[which] + 1];
  const mx::array& biases = in[s.first[which] + 2];
  quantized_linear_rows(x, M, K, w.data<uint32_t>(), scales.data<void>(), biases.data<void>(),
                        scales.dtype(), N, s.group_size[which], s.bits[which], out,
                        s.int8_activations[which]);
}

// Rows [0, rows) of body(begin, end) on the worker pool when there is enough of them.
template <class Body>
void rows_in_parallel(int rows, size_t per_row, Body body) {
  if (static_cast<size_t>(rows) * per_row >= (1u << 16)) {
    const int chunk = std::max(1, rows / (parallel_threads() * 4));
    if (parallel_for(rows, chunk, body)) return;
  }
  body(0, rows);
}

// mlx.nn.silu(gate) * up, each value as MLX computes it: sigmoid(g) = 1 / (1 + exp(|g|)),
// taken as is for g < 0 and as 1 - it otherwise (MLX's Sigmoid), then g * sigmoid(g), then
// that times up.
inline float silu_times(float g, float u) {
  const float y = 1.0f / (1.0f + exp_mlx(std::fabs(g)));
  const float sig = g < 0.0f ? y : 1.0f - y;
  return (g * sig) * u;
}

template <typename T>
void write_kv(const float* src, size_t src_stride, const int32_t* slots, int rows, int kv_heads,
              int dim, size_t pool_slots, T* pool) {
  for (int r = 0; r < rows; ++r) {
    const float* row = src + r * src_stride;
    for (int g = 0; g < kv_heads; ++g) {
      T* dst = pool + (static_cast<size_t>(g) * pool_slots + slots[r]) * dim;
      const float* from = row + static_cast<size_t>(g) * dim;
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(dst, from, sizeof(float) * dim);
      } else {
        for (int d = 0; d < dim; ++d) dst[d] = static_cast<T>(from[d]);
      }
    }
  }
}

void write_pool(const mx::array& pool, const float* src, size_t src_stride,
                const int32_t* slots, int rows, int kv_heads, int dim) {
  const size_t pool_slots = pool.shape(1);
  switch (pool.dtype()) {
    case mx::float32:
      return write_kv(src, src_stride, slots, rows, kv_heads, dim, pool_slots,
                      const_cast<float*>(pool.data<float>()));
    case mx::float16:
      return write_kv(src, src_stride, slots, rows, kv_heads, dim, pool_slots,
                      const_cast<mx::float16_t*>(pool.data<mx::float16_t>()));
    default:
      return write_kv(src, src_stride, slots, rows, kv_heads, dim, pool_slots,
                      const_cast<mx::bfloat16_t*>(pool.data<mx::bfloat16_t>()));
  }
}

// The scratch one layer needs, kept by the evaluating thread between calls.
struct Buffers {
  std::vector<float> h, qkv, q, k, qr, kr, attn, o, x1, gu, act, d;
};

// One layer on `rows` rows: xs (rows, hidden) in, out (rows, hidden) written last, so out may
// be xs (a stack of layers runs in place).
void run_layer(const LayerLayout& s, const LayerInputs& in, const float* xs, int rows,
               float* out) {
  const mx::array& k_pool = in[s.pool];
  const mx::array& v_pool = in[s.pool + 1];
  const int H = s.hidden, I = s.intermediate, D = s.head_dim;
  const int nq = s.heads * D, nkv = s.kv_heads * D, nqkv = nq + 2 * nkv;
  const int32_t* slots = in[s.pool + 2].data<int32_t>();
  const int32_t* positions = in[s.pool + 3].data<int32_t>();
  const mx::array& tables = in[s.pool + 4];
  const int32_t* ctx_lens = in[s.pool + 5].data<int32_t>();
  const int32_t* q_lens = in[s.pool + 6].data<int32_t>();

  // The tables and slots are checked before the pool is written: a bad one must not touch it.
  const int seqs = static_cast<int>(tables.shape(0)), max_blocks = static_cast<int>(tables.shape(1));
  for (int r = 0; r < rows; ++r) {
    check(slots[r] >= 0 && slots[r] < static_cast<int>(k_pool.shape(1)),
          "a write slot is out of the pool");
  }
  const int32_t* table = tables.data<int32_t>();
  check_block_tables(table, ctx_lens, q_lens, seqs, max_blocks, s.block_size,
                     static_cast<int>(k_pool.shape(1)));

  // The evaluating thread's scratch, named through a reference: worker threads running the
  // lambdas below must see this thread's buffers, not their own thread_local ones.
  thread_local Buffers scratch;
  Buffers& b = scratch;
  b.h.resize(static_cast<size_t>(rows) * H);
  b.qkv.resize(static_cast<size_t>(rows) * nqkv);
  b.q.resize(static_cast<size_t>(rows) * nq);
  b.k.resize(static_cast<size_t>(rows) * nkv);
  b.qr.resize(static_cast<size_t>(rows) * nq);
  b.kr.resize(static_cast<size_t>(rows) * nkv);
  b.attn.resize(static_cast<size_t>(rows) * nq);
  b.o.resize(static_cast<size_t>(rows) * H);
  b.x1.resize(static_cast<size_t>(rows) * H);
  b.gu.resize(static_cast<size_t>(rows) * 2 * I);
  b.act.resize(static_cast<size_t>(rows) * I);
  b.d.resize(static_cast<size_t>(rows) * H);

  // Attention block.
  rms_norm_rows_into(xs, in[s.attn_norm].data<float>(), rows, H, s.norm_eps, b.h.data());
  run_linear(s, 0, in, b.h.data(), rows, H, nqkv, b.qkv.data());
  if (s.qkv_bias) {
    const float* bias[3] = {in[s.bias].data<float>(), in[s.bias + 1].data<float>(),
                            in[s.bias + 2].data<float>()};
    const int starts[4] = {0, nq, nq + nkv, nqkv};
    for (int r = 0; r < rows; ++r) {
      float* row = b.qkv.data() + static_cast<size_t>(r) * nqkv;
      for (int p = 0; p < 3; ++p) {
        for (int j = starts[p]; j < starts[p + 1]; ++j) row[j] = row[j] + bias[p][j - starts[p]];
      }
    }
  }
  // q and k as (rows, heads, D), in b.q and b.k: normed per head (qk_norm), then rotated
  // (RoPE) into b.qr and b.kr, or copied out of the qkv rows.
  const float* q_src = b.qkv.data();
  const float* k_src = b.qkv.data() + nq;
  size_t q_stride = nqkv, k_stride = nqkv;
  if (s.qk_norm) {
    for (int r = 0; r < rows; ++r) {
      const float* row = b.qkv.data() + static_cast<size_t>(r) * nqkv;
      rms_norm_rows_into(row, in[s.qk_norms].data<float>(), s.heads, D, s.qk_norm_eps,
                         b.q.data() + static_cast<size_t>(r) * nq);
      rms_norm_rows_into(row + nq, in[s.qk_norms + 1].data<float>(), s.kv_heads, D,
                         s.qk_norm_eps, b.k.data() + static_cast<size_t>(r) * nkv);
    }
    q_src = b.q.data();
    k_src = b.k.data();
    q_stride = nq;
    k_stride = nkv;
  }
  const float* q = q_src;
  const float* k = k_src;
  if (s.rope) {
    const float* inv = in[s.inv_freqs].data<float>();
    rope_rows_into(q_src, q_stride, positions, inv, rows, s.heads, D, s.rope_dims,
                   s.rope_traditional, s.rope_scale, b.qr.data());
    rope_rows_into(k_src, k_stride, positions, inv, rows, s.kv_heads, D, s.rope_dims,
                   s.rope_traditional, s.rope_scale, b.kr.data());
    q = b.qr.data();
    k = b.kr.data();
  } else if (!s.qk_norm) {
    for (int r = 0; r < rows; ++r) {
      std::memcpy(b.q.data() + static_cast<size_t>(r) * nq, q_src + r * q_stride,
                  sizeof(float) * nq);
      std::memcpy(b.k.data() + static_cast<size_t>(r) * nkv, k_src + r * k_stride,
                  sizeof(float) * nkv);
    }
    q = b.q.data();
    k = b.k.data();
  }
  write_pool(k_pool, k, nkv, slots, rows, s.kv_heads, D);
  write_pool(v_pool, b.qkv.data() + nq + nkv, nqkv, slots, rows, s.kv_heads, D);
  PagedAttentionArgs args{q,                   mx::float32,
                          k_pool.data<void>(), v_pool.data<void>(),
                          k_pool.dtype(),      table,
                          ctx_lens,            q_lens,
                          b.attn.data(),       rows,
                          seqs,                s.heads,
                          s.kv_heads,          D,
                          static_cast<int>(k_pool.shape(1)), max_blocks,
                          s.block_size,        s.window,
                          s.attn_scale};
  paged_attention_rows(args);
  run_linear(s, 1, in, b.attn.data(), rows, nq, H, b.o.data());
  for (size_t i = 0; i < static_cast<size_t>(rows) * H; ++i) b.x1[i] = xs[i] + b.o[i];

  // MLP block.
  rms_norm_rows_into(b.x1.data(), in[s.mlp_norm].data<float>(), rows, H, s.norm_eps, b.h.data());
  run_linear(s, 2, in, b.h.data(), rows, H, 2 * I, b.gu.data());
  rows_in_parallel(rows, I, [&](int begin, int end) {
    for (int r = begin; r < end; ++r) {
      const float* g = b.gu.data() + static_cast<size_t>(r) * 2 * I;
      float* a = b.act.data() + static_cast<size_t>(r) * I;
      for (int j = 0; j < I; ++j) a[j] = silu_times(g[j], g[I + j]);
    }
  });
  run_linear(s, 3, in, b.act.data(), rows, I, H, b.d.data());
  for (size_t i = 0; i < static_cast<size_t>(rows) * H; ++i) out[i] = b.x1[i] + b.d[i];
}

// A linear layer's in_features as its weight says them (0 for a weight of the wrong rank).
int in_features(const Linear& l) {
  const auto& w = l.weight;
  if (l.bits == 0) return w.ndim() == 3 ? static_cast<int>(w.shape(1)) : 0;
  return w.ndim() == 2 && (l.bits == 4 || l.bits == 8)
             ? static_cast<int>(w.shape(1) * 32 / l.bits) : 0;
}

void check_linear(const Linear& l, const char* name, int in, int out) {
  const std::string n(name);
  const auto& w = l.weight;
  if (l.bits == 0) {
    check(!l.scales && !l.biases, n + ": a float32 layer (bits 0) has no scales or biases");
    const int panels = (out + LINEAR_PANEL - 1) / LINEAR_PANEL;
    check(w.ndim() == 3 && w.dtype() == mx::float32 && w.shape(0) == panels &&
              w.shape(1) == in && w.shape(2) == LINEAR_PANEL,
          n + ": weight " + shape_str(w) + " must be float32 packed by pack_linear_weight (" +
              std::to_string(panels) + ", " + std::to_string(in) + ", " +
              std::to_string(LINEAR_PANEL) + ") for " + std::to_string(out) + " outputs");
    return;
  }
  check(l.bits == 4 || l.bits == 8, n + ": bits must be 0 (float32), 4 or 8");
  check(l.group_size == 32 || l.group_size == 64 || l.group_size == 128,
        n + ": group_size must be 32, 64 or 128");
  check(l.scales && l.biases, n + ": a quantized layer has scales and biases");
  const auto& sc = *l.scales;
  check(in % l.group_size == 0, n + ": in_features must be a multiple of group_size");
  check(w.ndim() == 2 && w.dtype() == mx::uint32 && w.shape(0) == out &&
            static_cast<int64_t>(w.shape(1)) * 32 == static_cast<int64_t>(in) * l.bits,
        n + ": weight " + shape_str(w) + " does not hold (" + std::to_string(out) + ", " +
            std::to_string(in) + ") " + std::to_string(l.bits) + "-bit values");
  check(sc.ndim() == 2 && sc.shape(0) == out && sc.shape(1) == in / l.group_size &&
            l.biases->shape() == sc.shape() && l.biases->dtype() == sc.dtype() &&
            (sc.dtype() == mx::float16 || sc.dtype() == mx::bfloat16 || sc.dtype() == mx::float32),
        n + ": scales and biases must be (out, in / group_size), float16, bfloat16 or float32");
}

void check_vector(const mx::array& a, int n, const std::string& name) {
  check(a.ndim() == 1 && a.dtype() == mx::float32 && a.shape(0) == n,
        name + " must be float32 (" + std::to_string(n) + ",), not " + shape_str(a));
}

}  // namespace

LayerSpec::LayerSpec(LayerFields fields) : LayerFields(std::move(fields)), layout_{} {
  check(attn_norm.ndim() == 1 && attn_norm.shape(0) > 0,
        "attn_norm must be (hidden,), not " + shape_str(attn_norm));
  const int H = static_cast<int>(attn_norm.shape(0));
  check_vector(attn_norm, H, "attn_norm");
  check_vector(mlp_norm, H, "mlp_norm");
  check(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
        "heads must be a positive multiple of kv_heads");
  check(head_dim > 0, "head_dim must be positive");
  const int nq = heads * head_dim, nkv = kv_heads * head_dim;
  // The intermediate size is down's in_features (gate_up's outputs are padded to whole panels
  // where they are packed float32); check_linear checks gate_up against it.
  const int two_i = 2 * in_features(down);
  check(two_i > 0, "down must have in_features (the intermediate size)");
  check_linear(qkv, "qkv", H, nq + 2 * nkv);
  check_linear(o, "o", nq, H);
  check_linear(down, "down", two_i / 2, H);
  check_linear(gate_up, "gate_up", H, two_i);
  const bool biased = q_bias.has_value();
  check(k_bias.has_value() == biased && v_bias.has_value() == biased,
        "q_bias, k_bias and v_bias: all three or none");
  if (biased) {
    check_vector(*q_bias, nq, "q_bias");
    check_vector(*k_bias, nkv, "k_bias");
    check_vector(*v_bias, nkv, "v_bias");
  }
  check(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm: both or neither");
  if (q_norm) {
    check_vector(*q_norm, head_dim, "q_norm");
    check_vector(*k_norm, head_dim, "k_norm");
  }
  if (rope) {
    check(rope->dims > 0 && rope->dims % 2 == 0 && rope->dims <= head_dim,
          "rope.dims must be even and at most head_dim");
    check_vector(rope->inv_freqs, rope->dims / 2, "rope.inv_freqs");
  }
  check(block_size > 0, "block_size must be positive");
  check(window >= 0, "window must be >= 0 (0: the whole context)");

  LayerLayout& l = layout_;
  l.hidden = H;
  l.intermediate = two_i / 2;
  l.heads = heads;
  l.kv_heads = kv_heads;
  l.head_dim = head_dim;
  l.norm_eps = norm_eps;
  l.qk_norm_eps = qk_norm_eps;
  l.qkv_bias = biased;
  l.qk_norm = q_norm.has_value();
  l.rope = rope.has_value();
  l.rope_dims = rope ? rope->dims : 0;
  l.rope_traditional = rope && rope->traditional;
  l.rope_scale = rope ? rope->scale : 1.0f;
  l.attn_scale = attn_scale;
  l.block_size = block_size;
  l.window = window;
  // What the op reads: x, then these weights (made row-contiguous and evaluated once, here),
  // then the step's pool and tables.
  const auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> weights;
  auto add = [&](const mx::array& a) {
    weights.push_back(row_contiguous(a, stream));
    return static_cast<int>(weights.size());  // its index in LayerInputs (x is 0)
  };
  l.attn_norm = add(attn_norm);
  l.mlp_norm = add(mlp_norm);
  const Linear* linears[4] = {&qkv, &o, &gate_up, &down};
  for (int i = 0; i < 4; ++i) {
    l.bits[i] = linears[i]->bits;
    l.group_size[i] = linears[i]->group_size;
    l.int8_activations[i] = linears[i]->int8_activations;
    l.first[i] = add(linears[i]->weight);
    if (linears[i]->bits) {
      add(*linears[i]->scales);
      add(*linears[i]->biases);
    }
  }
  l.bias = static_cast<int>(weights.size()) + 1;
  if (biased) {
    for (const auto* b : {&q_bias, &k_bias, &v_bias}) add(**b);
  }
  l.qk_norms = static_cast<int>(weights.size()) + 1;
  if (q_norm) {
    add(*q_norm);
    add(*k_norm);
  }
  l.inv_freqs = static_cast<int>(weights.size()) + 1;
  if (rope) add(rope->inv_freqs);
  l.pool = static_cast<int>(weights.size()) + 1;
  mx::eval(weights);
  weights_ = std::make_shared<const std::vector<mx::array>>(std::move(weights));
}

mx::array decoder_layers(const mx::array& x, const std::vector<const LayerSpec*>& specs,
                         const std::vector<mx::array>& k_pools,
                         const std::vector<mx::array>& v_pools, const mx::array& slots,
                         const mx::array& positions, const mx::array& block_tables,
                         const mx::array& context_lens, const mx::array& query_lens,
                         mx::StreamOrDevice s) {
  check(!specs.empty() && k_pools.size() == specs.size() && v_pools.size() == specs.size(),
        "one k_pool and one v_pool for each of at least one layer");
  const int hidden = specs[0]->layout().hidden;
  // (rows, hidden), or (1, rows, hidden) as a model's layers pass their hidden states on: the
  // output has x's shape, so a stack of layers needs no reshaping op between them.
  check((x.ndim() == 2 || (x.ndim() == 3 && x.shape(0) == 1)) && x.dtype() == mx::float32 &&
            x.shape(-1) == hidden,
        "x must be float32 (rows, " + std::to_string(hidden) + ") or (1, rows, " +
            std::to_string(hidden) + "), not " + shape_str(x));
  const int rows = static_cast<int>(x.shape(-2));
  check(rows >= 1, "a step has at least one row");
  std::vector<DecoderLayer::Layer> layers;
  for (size_t i = 0; i < specs.size(); ++i) {
    const LayerLayout& l = specs[i]->layout();
    const mx::array &k_pool = k_pools[i], &v_pool = v_pools[i];
    check(l.hidden == hidden, "the layers must share one hidden size");
    check(k_pool.ndim() == 3 && v_pool.shape() == k_pool.shape() &&
              k_pool.dtype() == v_pool.dtype() && k_pool.shape(0) == l.kv_heads &&
              k_pool.shape(2) == l.head_dim,
          "k_pool and v_pool must be (kv_heads, slots, head_dim) of one dtype");
    check(k_pool.dtype() == mx::float32 || k_pool.dtype() == mx::float16 ||
              k_pool.dtype() == mx::bfloat16,
          "the pool must be float32, float16 or bfloat16");
    check(k_pool.shape(1) % l.block_size == 0, "the pool's slots must be whole blocks");
    const LayerLayout& first = specs[0]->layout();
    check(k_pool.shape(1) == k_pools[0].shape(1) && l.window == first.window &&
              l.block_size == first.block_size,
          "the layers must share the pool's slots, the block size and the window (one step's "
          "tables serve them all)");
    layers.push_back({l, specs[i]->weights()});
  }
  check(slots.ndim() == 1 && slots.shape(0) == rows && positions.ndim() == 1 &&
            positions.shape(0) == rows,
        "slots and positions must be (rows,)");
  check(block_tables.ndim() == 2 && context_lens.ndim() == 1 && query_lens.ndim() == 1 &&
            context_lens.shape(0) == block_tables.shape(0) &&
            query_lens.shape(0) == block_tables.shape(0),
        "block_tables must be (seqs, max_blocks), context_lens and query_lens (seqs,)");

  auto stream = mx::to_stream(s);
  auto int32 = [&](const mx::array& a) {
    return row_contiguous(a.dtype() == mx::int32 ? a : mx::astype(a, mx::int32, stream), stream);
  };
  std::vector<mx::array> inputs;
  inputs.reserve(2 * layers.size() + 6);
  // Another layers op's output is row-contiguous by construction (eval_cpu allocates it
  // whole): no contiguous node to schedule between two of them.
  const bool from_layers = x.has_primitive() && typeid(x.primitive()) == typeid(DecoderLayer);
  inputs.push_back(from_layers ? x : row_contiguous(x, stream));
  // The pools as they are: the op writes the rows into them (see decoder_layer.h).
  for (size_t i = 0; i < layers.size(); ++i) {
    inputs.push_back(k_pools[i]);
    inputs.push_back(v_pools[i]);
  }
  for (const auto* a : {&slots, &positions, &block_tables, &context_lens, &query_lens}) {
    inputs.push_back(int32(*a));
  }
  return mx::array(
      x.shape(), mx::float32,
      std::make_shared<DecoderLayer>(
          stream, std::make_shared<const std::vector<DecoderLayer::Layer>>(std::move(layers))),
      std::move(inputs));
}

void DecoderLayer::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  auto& out = allocate(outputs[0]);
  dispatch(stream(), inputs, out,
           [in = weak_copies(inputs), out = mx::array::unsafe_weak_copy(out),
            layers = layers_]() mutable {
    const mx::array& x = in[0];
    const int rows = static_cast<int>(x.shape(x.ndim() - 2));
    const mx::array* tables = &in[1 + 2 * layers->size()];
    float* o = out.data<float>();
    // Layer 0 reads x; each later one the previous layer's output, in place in out.
    for (size_t i = 0; i < layers->size(); ++i) {
      const DecoderLayer::Layer& layer = (*layers)[i];
      const LayerLayout& l = layer.layout;
      run_layer(l, LayerInputs{*layer.weights, in[1 + 2 * i], in[2 + 2 * i], tables, l.pool},
                i == 0 ? x.data<float>() : o, rows, o);
    }
  });
}

void DecoderLayer::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("decoder_layer runs on the CPU only");
}

}  // namespace batchscope
