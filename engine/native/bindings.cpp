#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <tuple>

#include "decode_linear.h"
#include "decode_quantized.h"
#include "decoder_layer.h"
#include "paged_attention.h"
#include "row_ops.h"
#include "workers.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

NB_MODULE(_kernels, m) {
  m.doc() = "batchscope's decode kernels for MLX's CPU backend";
  m.def("paged_attention", &batchscope::paged_attention, "q"_a, "k_pool"_a, "v_pool"_a,
        "block_tables"_a, "context_lens"_a, "query_lens"_a, "scale"_a, "block_size"_a,
        "window"_a = 0, nb::kw_only(), "stream"_a = nb::none(),
        "Attention of each sequence's rows (its last query_lens positions) over its blocks of "
        "the paged pool; a row's bits depend on its own query, position and context only.");
  m.def("decode_linear", &batchscope::decode_linear, "x"_a, "weight"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "x @ weight.T in float32 for a few rows, each row computed alone (batch-invariant).");
  m.def("decode_quantized_linear", &batchscope::decode_quantized_linear, "x"_a, "w"_a,
        "scales"_a, "biases"_a, "group_size"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "An affine-quantized (4 or 8 bit) linear layer for a few float32 rows, each row computed "
        "alone (batch-invariant), the same bits on every instruction-set path.");
  m.def("decode_quantized_isa", &batchscope::decode_quantized_isa,
        "The instruction set decode_quantized_linear uses: avx512, avx2 or portable.");
  m.def("set_decode_quantized_isa", &batchscope::set_decode_quantized_isa, "name"_a,
        "Force decode_quantized_linear's path (auto, avx512, avx2, portable); returns it.");
  m.def("rms_norm_rows", &batchscope::rms_norm_rows, "x"_a, "weight"_a, "eps"_a, nb::kw_only(),
        "stream"_a = nb::none(), "RMS norm of float32 rows, each row alone (batch-invariant).");
  m.def("rope_rows", &batchscope::rope_rows, "x"_a, "positions"_a, "inv_freqs"_a, "dims"_a,
        "traditional"_a, "scale"_a, nb::kw_only(), "stream"_a = nb::none(),
        "RoPE of (rows, heads, head_dim) float32 rows, each at its own position.");
  m.def("logsumexp_rows", &batchscope::logsumexp_rows, "x"_a, nb::kw_only(),
        "stream"_a = nb::none(), "log(sum(exp(x))) of each float32 row of (rows, V).");
  // A linear layer as (arrays, bits, group_size): ([weight], 0, 0) for float32.
  using Linear = std::tuple<std::vector<mx::array>, int, int>;
  auto weights = [](const Linear& l) {
    return batchscope::LinearWeights{std::get<0>(l), std::get<1>(l), std::get<2>(l)};
  };
  m.def(
      "decoder_layer",
      [weights](const mx::array& x, const mx::array& attn_norm, const mx::array& mlp_norm,
                float norm_eps, const Linear& qkv, const Linear& o, const Linear& gate_up,
                const Linear& down, const std::vector<mx::array>& qkv_bias,
                const std::vector<mx::array>& qk_norm, float qk_norm_eps, int heads,
                int kv_heads, int head_dim, const mx::array& k_pool, const mx::array& v_pool,
                const mx::array& slots, const mx::array& positions,
                const std::optional<mx::array>& inv_freqs, int rope_dims, bool rope_traditional,
                float rope_scale, const mx::array& block_tables, const mx::array& context_lens,
                const mx::array& query_lens, float attn_scale, int block_size, int window) {
        return batchscope::decoder_layer(
            x, attn_norm, mlp_norm, norm_eps, weights(qkv), weights(o), weights(gate_up),
            weights(down), qkv_bias, qk_norm, qk_norm_eps, heads, kv_heads, head_dim, k_pool,
            v_pool, slots, positions, inv_freqs, rope_dims, rope_traditional, rope_scale,
            block_tables, context_lens, query_lens, attn_scale, block_size, window);
      },
      "x"_a, "attn_norm"_a, "mlp_norm"_a, "norm_eps"_a, "qkv"_a, "o"_a, "gate_up"_a, "down"_a,
      "qkv_bias"_a, "qk_norm"_a, "qk_norm_eps"_a, "heads"_a, "kv_heads"_a, "head_dim"_a,
      "k_pool"_a, "v_pool"_a, "slots"_a, "positions"_a, "inv_freqs"_a.none(), "rope_dims"_a,
      "rope_traditional"_a, "rope_scale"_a, "block_tables"_a, "context_lens"_a, "query_lens"_a,
      "attn_scale"_a, "block_size"_a, "window"_a,
      "A llama-style decoder layer (norms, q/k/v, RoPE, paged KV write and attention, o, "
      "SwiGLU MLP, residuals) as one op; returns its output and writes the rows' keys and "
      "values into the pool arrays when evaluated.");
  m.def("native_threads", &batchscope::parallel_threads,
        "Threads the native ops' worker pool uses (the caller included).");
}
