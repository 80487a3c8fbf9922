#include "gated_delta.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu_dispatch.h"
#include "inputs.h"
#include "row_ops.h"
#include "simd.h"
#include "vector_math.h"
#include "workers.h"

// Built with -ffp-contract=off: every product and sum below rounds on its own, as mlx-lm's
// separate ops round them (the sums in another, fixed, order).

namespace batchscope {

namespace {

constexpr Check check{"gated_delta_rows"};

// MLX's sigmoid: 1 / (1 + exp(|x|)), as is for x < 0 and 1 minus it otherwise.
inline float sigmoid_mlx(float x) {
  const float y = 1.0f / (1.0f + exp_mlx(std::fabs(x)));
  return x < 0.0f ? y : 1.0f - y;
}

// mlx.nn.softplus: logaddexp(x, 0) by MLX's formula.
inline float softplus_mlx(float x) {
  const float hi = std::fmax(x, 0.0f), lo = std::fmin(x, 0.0f);
  if (hi == INFINITY || lo == -INFINITY) return hi;
  return hi + std::log1p(exp_mlx(lo - hi));
}

// body(begin, end) over [0, count) on the worker pool when the work (count * per_item) is
// large enough to pay for waking it; chunks of `chunk`.
template <class Body>
void in_parallel(int count, size_t per_item, int chunk, Body body) {
  if (count > 1 && static_cast<size_t>(count) * per_item >= (1u << 16) &&
      parallel_for(count, chunk, body)) {
    return;
  }
  body(0, count);
}

// sum over j < n of (x[j] * y[j]), in 16 running sums and lane_sum's tree.
inline float dot(const float* x, const float* y, int n) {
  V acc = V::zero();
  int j = 0;
  for (; j + 16 <= n; j += 16) acc = add(acc, mul(V::load(x + j), V::load(y + j)));
  float lanes[16];
  acc.store(lanes);
  for (int l = 0; j < n; ++j, ++l) lanes[l] += x[j] * y[j];
  return lane_sum(lanes);
}

// One row of one value head: the delta rule on S (Dv x Dk) in place, y (Dv) out.
void delta_row(float* S, const float* q, const float* k, const float* v, float g, float beta,
               int Dk, int Dv, float* y) {
  const V gv = V::bcast(g);
  for (int i = 0; i < Dv; ++i) {
    float* s = S + static_cast<size_t>(i) * Dk;
    // s *= g, and kv = s . k
    V acc = V::zero();
    int j = 0;
    for (; j + 16 <= Dk; j += 16) {
      const V d = mul(V::load(s + j), gv);
      d.store(s + j);
      acc = add(acc, mul(d, V::load(k + j)));
    }
    float lanes[16];
    acc.store(lanes);
    for (int l = 0; j < Dk; ++j, ++l) {
      s[j] = s[j] * g;
      lanes[l] += s[j] * k[j];
    }
    const float delta = (v[i] - lane_sum(lanes)) * beta;
    // s += k * delta, then y = s . q
    const V dv = V::bcast(delta);
    acc = V::zero();
    j = 0;
    for (; j + 16 <= Dk; j += 16) {
      const V u = add(V::load(s + j), mul(V::load(k + j), dv));
      u.store(s + j);
      acc = add(acc, mul(u, V::load(q + j)));
    }
    acc.store(lanes);
    for (int l = 0; j < Dk; ++j, ++l) {
      s[j] = s[j] + k[j] * delta;
      lanes[l] += s[j] * q[j];
    }
    y[i] = lane_sum(lanes);
  }
}

// The op's inputs, in order.
enum Input { QKV, A, B, WEIGHT, A_LOG, DT_BIAS, CONV_POOL, STATE_POOL };

void run(const GatedDeltaLayout& l, const std::vector<mx::array>& in, float* y) {
  const int Hk = l.k_heads, Hv = l.v_heads, Dk = l.k_dim, Dv = l.v_dim, K = l.kernel;
  const int keep = K - 1, nk = Hk * Dk, C = 2 * nk + Hv * Dv;
  const int rows = static_cast<int>(l.row_group.size());
  const int groups = static_cast<int>(l.group_slot.size());
  const float* qkv = in[QKV].data<float>();
  const float* a = in[A].data<float>();
  const float* b = in[B].data<float>();
  const float* w = in[WEIGHT].data<float>();  // (C, K)
  const float* A_log = in[A_LOG].data<float>();
  const float* dt_bias = in[DT_BIAS].data<float>();
  float* conv_pool = const_cast<float*>(in[CONV_POOL].data<float>());
  float* state_pool = const_cast<float*>(in[STATE_POOL].data<float>());
  const size_t conv_slot = static_cast<size_t>(keep) * C;
  const size_t head_state = static_cast<size_t>(Dv) * Dk;

  // The conv's taps by tap (K, C), so a row's channels run contiguously.
  std::vector<float> taps(static_cast<size_t>(K) * C);
  for (int c = 0; c < C; ++c) {
    for (int j = 0; j < K; ++j) taps[static_cast<size_t>(j) * C + c] = w[static_cast<size_t>(c) * K + j];
  }
  // Row t of group g's conv input: its conv state's rows, then its own.
  auto conv_input = [&](int g, int t) -> const float* {
    if (t < keep) return conv_pool + l.group_slot[g] * conv_slot + static_cast<size_t>(t) * C;
    return qkv + static_cast<size_t>(l.group_first[g] + t - keep) * C;
  };

  // Conv, SiLU, q/k normalization and the gates of every row.
  std::vector<float> x(static_cast<size_t>(rows) * C), gates(static_cast<size_t>(rows) * Hv * 2);
  const std::vector<float> ones(Dk, 1.0f);
  const double inv_scale = 1.0 / std::sqrt(static_cast<double>(Dk));  // normalize_qk's
  const float eps = static_cast<float>(1e-6 * inv_scale * inv_scale);
  const float q_scale = static_cast<float>(inv_scale * inv_scale), k_scale = static_cast<float>(inv_scale);
  in_parallel(rows, static_cast<size_t>(C) * K, std::max(1, rows / (parallel_threads() * 4)),
              [&](int begin, int end) {
    for (int r = begin; r < end; ++r) {
      const int g = l.row_group[r], t = r - l.group_first[g];
      float* out = x.data() + static_cast<size_t>(r) * C;
      const float* src = conv_input(g, t);
      for (int c = 0; c < C; ++c) out[c] = taps[c] * src[c];
      for (int j = 1; j < K; ++j) {
        src = conv_input(g, t + j);
        const float* tap = taps.data() + static_cast<size_t>(j) * C;
        for (int c = 0; c < C; ++c) out[c] = out[c] + tap[c] * src[c];
      }
      for (int c = 0; c < C; ++c) out[c] = out[c] * sigmoid_mlx(out[c]);
      rms_norm_rows_into(out, ones.data(), Hk, Dk, eps, out);
      rms_norm_rows_into(out + nk, ones.data(), Hk, Dk, eps, out + nk);
      for (int c = 0; c < nk; ++c) out[c] = q_scale * out[c];
      for (int c = nk; c < 2 * nk; ++c) out[c] = k_scale * out[c];
      float* gb = gates.data() + static_cast<size_t>(r) * Hv * 2;
      for (int h = 0; h < Hv; ++h) {
        const size_t i = static_cast<size_t>(r) * Hv + h;
        gb[2 * h] = exp_mlx(-exp_mlx(A_log[h]) * softplus_mlx(a[i] + dt_bias[h]));
        gb[2 * h + 1] = sigmoid_mlx(b[i]);
      }
    }
  });

  // The conv windows (the last K - 1 conv inputs) after each group's last row and after each
  // snapshot row, all read before any is written: a group's window may hold its old state.
  std::vector<float> windows;
  std::vector<int> window_slots;
  auto take_window = [&](int g, int t, int slot) {  // the window after group g's row t
    for (int i = 0; i < keep; ++i) {
      const float* src = conv_input(g, t + 1 + i);
      windows.insert(windows.end(), src, src + C);
    }
    window_slots.push_back(slot);
  };
  for (int g = 0; g < groups; ++g) {
    const int first = l.group_first[g];
    const int last = g + 1 < groups ? l.group_first[g + 1] : rows;
    for (int r = first; r < last; ++r) {
      if (l.snap_slot[r] >= 0) take_window(g, r - first, l.snap_slot[r]);
    }
    take_window(g, last - 1 - first, l.group_slot[g]);
  }
  for (size_t i = 0; i < window_slots.size(); ++i) {
    std::memcpy(conv_pool + window_slots[i] * conv_slot, windows.data() + i * conv_slot,
                sizeof(float) * conv_slot);
  }

  // The recurrence: each (group, value head) pair on one thread, its rows in order, its state
  // updated in its slot.
  const int per_key = Hv / Hk;
  in_parallel(groups * Hv, static_cast<size_t>(rows / groups + 1) * head_state, 1,
              [&](int begin, int end) {
    for (int p = begin; p < end; ++p) {
      const int g = p / Hv, h = p % Hv, hk = h / per_key;
      const int first = l.group_first[g];
      const int last = g + 1 < groups ? l.group_first[g + 1] : rows;
      float* S = state_pool + (static_cast<size_t>(l.group_slot[g]) * Hv + h) * head_state;
      for (int r = first; r < last; ++r) {
        const float* row = x.data() + static_cast<size_t>(r) * C;
        const float* gb = gates.data() + static_cast<size_t>(r) * Hv * 2;
        delta_row(S, row + hk * Dk, row + nk + hk * Dk, row + 2 * nk + h * Dv, gb[2 * h],
                  gb[2 * h + 1], Dk, Dv, y + (static_cast<size_t>(r) * Hv + h) * Dv);
        if (l.snap_slot[r] >= 0) {
          std::memcpy(state_pool + (static_cast<size_t>(l.snap_slot[r]) * Hv + h) * head_state,
                      S, sizeof(float) * head_state);
        }
      }
    }
  });
}

void check_array(const mx::array& x, const mx::Shape& shape, const std::string& name) {
  std::string want = "(";
  for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
  check(x.dtype() == mx::float32 && x.shape() == shape,
        name + " must be float32 " + want + "), not " + shape_str(x));
}

}  // namespace

mx::array gated_delta_rows(const mx::array& qkv, const mx::array& a, const mx::array& b,
                           const mx::array& conv_weight, const mx::array& A_log,
                           const mx::array& dt_bias, const mx::array& conv_pool,
                           const mx::array& state_pool,
                           const std::vector<std::pair<int, int>>& groups,
                           const std::vector<std::pair<int, int>>& snapshots, int k_heads,
                           int v_heads, int k_dim, int v_dim, mx::StreamOrDevice s) {
  check(k_heads > 0 && v_heads > 0 && v_heads % k_heads == 0,
        "v_heads must be a positive multiple of k_heads");
  check(k_dim > 0 && v_dim > 0, "k_dim and v_dim must be positive");
  const int C = 2 * k_heads * k_dim + v_heads * v_dim;
  check(qkv.ndim() == 2 && qkv.shape(0) >= 1, "qkv must be (rows, conv_dim)");
  const int rows = static_cast<int>(qkv.shape(0));
  check(conv_weight.ndim() == 3 && conv_weight.shape(1) >= 2,
        "conv_weight must be (conv_dim, K, 1) with K >= 2, not " + shape_str(conv_weight));
  const int K = static_cast<int>(conv_weight.shape(1));
  check_array(qkv, {rows, C}, "qkv");
  check_array(a, {rows, v_heads}, "a");
  check_array(b, {rows, v_heads}, "b");
  check_array(conv_weight, {C, K, 1}, "conv_weight");
  check_array(A_log, {v_heads}, "A_log");
  check_array(dt_bias, {v_heads}, "dt_bias");
  check(conv_pool.ndim() == 3, "conv_pool must be (slots, K - 1, conv_dim)");
  const int slots = static_cast<int>(conv_pool.shape(0));
  check_array(conv_pool, {slots, K - 1, C}, "conv_pool");
  check_array(state_pool, {slots, v_heads, v_dim, k_dim}, "state_pool");
  for (const auto* pool : {&conv_pool, &state_pool}) {
    check(pool->is_available() && pool->flags().row_contiguous,
          "the pools must be evaluated, row-contiguous arrays: the op writes them in place");
  }

  GatedDeltaLayout l{k_heads, v_heads, k_dim, v_dim, K, {}, {}, {}, std::vector<int>(rows, -1)};
  std::vector<bool> used(slots, false);
  auto claim = [&](int slot) {
    check(slot >= 0 && slot < slots, "slot " + std::to_string(slot) + " is outside the pool");
    check(!used[slot], "slot " + std::to_string(slot) + " is named twice");
    used[slot] = true;
  };
  for (const auto& [n, slot] : groups) {
    check(n >= 1, "a group has at least one row");
    check(static_cast<int>(l.row_group.size()) + n <= rows, "the groups have more rows than qkv");
    claim(slot);
    l.group_first.push_back(static_cast<int>(l.row_group.size()));
    l.group_slot.push_back(slot);
    l.row_group.insert(l.row_group.end(), n, static_cast<int>(l.group_slot.size()) - 1);
  }
  check(static_cast<int>(l.row_group.size()) == rows, "the groups' rows must sum to qkv's rows");
  for (const auto& [row, slot] : snapshots) {
    check(row >= 0 && row < rows, "snapshot row " + std::to_string(row) + " is outside the step");
    check(l.snap_slot[row] < 0, "snapshot row " + std::to_string(row) + " is named twice");
    claim(slot);
    l.snap_slot[row] = slot;
  }

  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {row_contiguous(qkv, stream),    row_contiguous(a, stream),
                                   row_contiguous(b, stream),      row_contiguous(conv_weight, stream),
                                   row_contiguous(A_log, stream),  row_contiguous(dt_bias, stream),
                                   conv_pool,                      state_pool};
  return mx::array({rows, v_heads, v_dim}, mx::float32,
                   std::make_shared<GatedDeltaRows>(stream, std::move(l)), std::move(inputs));
}

void GatedDeltaRows::eval_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  auto& out = allocate(outputs[0]);
  dispatch(stream(), inputs, out,
           [in = weak_copies(inputs), out = mx::array::unsafe_weak_copy(out),
            layout = layout_]() mutable { run(layout, in, out.data<float>()); });
}

void GatedDeltaRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("gated_delta_rows runs on the CPU only");
}

}  // namespace batchscope
