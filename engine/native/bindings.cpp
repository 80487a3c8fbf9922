#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <utility>

#include "decode_linear.h"
#include "decode_quantized.h"
#include "decoder_layer.h"
#include "gated_delta.h"
#include "kernel_timing.h"
#include "paged_attention.h"
#include "pool_copy.h"
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
  m.def("pack_linear_weight", &batchscope::pack_linear_weight, "weight"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "A float32 (out, in) weight in the layout decode_linear reads: (ceil(out / 64), in, "
        "64), each panel of 64 outputs k-major.");
  m.def("decode_linear", &batchscope::decode_linear, "x"_a, "packed"_a, "out_features"_a,
        nb::kw_only(), "isa"_a = "auto", "stream"_a = nb::none(),
        "x @ weight.T in float32 from pack_linear_weight(weight), each row computed alone "
        "(batch-invariant), the same bits on every instruction-set path (isa: auto, avx512, "
        "avx2, portable).");
  m.def("decode_quantized_linear", &batchscope::decode_quantized_linear, "x"_a, "w"_a,
        "scales"_a, "biases"_a, "group_size"_a, "bits"_a, nb::kw_only(),
        "int8_activations"_a = false, "stream"_a = nb::none(),
        "An affine-quantized (4 or 8 bit) linear layer for a few float32 rows, each row computed "
        "alone (batch-invariant), the same bits on every instruction-set path; "
        "int8_activations: x quantized to 8 bits per row in blocks of 32 first (not float32's "
        "result).");
  m.def("quantized_int8_vnni_built", &batchscope::quantized_int8_vnni_built,
        "Whether decode_quantized_linear's int8-activation path has its AVX-512 VNNI code.");
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
  m.def("greedy_rows", &batchscope::greedy_rows, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Per float32 row of (rows, V) logits: (the argmax of its logprobs as uint32, that "
        "logprob), with the bits of MLX's ops.");
  m.def("pool_copy_rows", &batchscope::pool_copy_rows, "pools"_a, "pairs"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "Copy rows of the (kv_heads, slots, dim) pools, (source slot, destination slot) "
        "pairs, in place when the returned scalar is evaluated.");
  m.def("quantized_embedding_rows", &batchscope::quantized_embedding_rows, "w"_a, "scales"_a,
        "biases"_a, "ids"_a, nb::kw_only(), "group_size"_a, "bits"_a, "stream"_a = nb::none(),
        "MLX's affine-quantized embedding of int32 or uint32 ids (rows,), with "
        "mlx.core.dequantize's bits: (rows, D) in the scales' dtype.");
  // The fused layer's spec, made once per layer: every field named, checked when it is made;
  // Linear and Rope are its nested classes (LayerSpec.Linear, LayerSpec.Rope).
  using batchscope::LayerSpec;
  using batchscope::Linear;
  using batchscope::Rope;
  using Array = std::optional<mx::array>;
  auto spec = nb::class_<LayerSpec>(
      m, "LayerSpec",
      "A llama-style decoder layer's weights and shape as decoder_layers takes them, checked "
      "when made (ValueError naming the field).");
  nb::class_<Linear>(spec, "Linear",
                     "A linear layer: weight float32 packed by pack_linear_weight with bits "
                     "0, or MLX's affine "
                     "quantization (weight, scales, biases, bits 4 or 8, group_size).")
      .def(nb::init<mx::array, Array, Array, int, int, bool>(), "weight"_a, nb::kw_only(),
           "scales"_a = nb::none(), "biases"_a = nb::none(), "bits"_a = 0, "group_size"_a = 0,
           "int8_activations"_a = false)
      .def_ro("weight", &Linear::weight)
      .def_ro("scales", &Linear::scales)
      .def_ro("biases", &Linear::biases)
      .def_ro("bits", &Linear::bits)
      .def_ro("group_size", &Linear::group_size)
      .def_ro("int8_activations", &Linear::int8_activations);
  nb::class_<Rope>(spec, "Rope", "RoPE at each row's position, as rope_rows takes it.")
      .def(nb::init<mx::array, int, bool, float>(), nb::kw_only(), "inv_freqs"_a, "dims"_a,
           "traditional"_a, "scale"_a)
      .def_ro("inv_freqs", &Rope::inv_freqs)
      .def_ro("dims", &Rope::dims)
      .def_ro("traditional", &Rope::traditional)
      .def_ro("scale", &Rope::scale);
  spec.def(
          "__init__",
          [](LayerSpec* self, mx::array attn_norm, mx::array mlp_norm, float norm_eps,
             Linear qkv, Linear o, Linear gate_up, Linear down, Array q_bias, Array k_bias,
             Array v_bias, Array q_norm, Array k_norm, float qk_norm_eps, int heads,
             int kv_heads, int head_dim, std::optional<Rope> rope, float attn_scale,
             int block_size, int window) {
            new (self) LayerSpec(batchscope::LayerFields{
                .attn_norm = std::move(attn_norm),
                .mlp_norm = std::move(mlp_norm),
                .norm_eps = norm_eps,
                .qkv = std::move(qkv),
                .o = std::move(o),
                .gate_up = std::move(gate_up),
                .down = std::move(down),
                .q_bias = std::move(q_bias),
                .k_bias = std::move(k_bias),
                .v_bias = std::move(v_bias),
                .q_norm = std::move(q_norm),
                .k_norm = std::move(k_norm),
                .qk_norm_eps = qk_norm_eps,
                .heads = heads,
                .kv_heads = kv_heads,
                .head_dim = head_dim,
                .rope = std::move(rope),
                .attn_scale = attn_scale,
                .block_size = block_size,
                .window = window});
          },
          nb::kw_only(), "attn_norm"_a, "mlp_norm"_a, "norm_eps"_a, "qkv"_a, "o"_a, "gate_up"_a,
          "down"_a, "q_bias"_a = nb::none(), "k_bias"_a = nb::none(), "v_bias"_a = nb::none(),
          "q_norm"_a = nb::none(), "k_norm"_a = nb::none(), "qk_norm_eps"_a = 0.0f, "heads"_a,
          "kv_heads"_a, "head_dim"_a, "rope"_a = nb::none(), "attn_scale"_a, "block_size"_a,
          "window"_a = 0)
      .def_ro("attn_norm", &LayerSpec::attn_norm)
      .def_ro("mlp_norm", &LayerSpec::mlp_norm)
      .def_ro("norm_eps", &LayerSpec::norm_eps)
      .def_ro("qkv", &LayerSpec::qkv)
      .def_ro("o", &LayerSpec::o)
      .def_ro("gate_up", &LayerSpec::gate_up)
      .def_ro("down", &LayerSpec::down)
      .def_ro("q_bias", &LayerSpec::q_bias)
      .def_ro("k_bias", &LayerSpec::k_bias)
      .def_ro("v_bias", &LayerSpec::v_bias)
      .def_ro("q_norm", &LayerSpec::q_norm)
      .def_ro("k_norm", &LayerSpec::k_norm)
      .def_ro("qk_norm_eps", &LayerSpec::qk_norm_eps)
      .def_ro("heads", &LayerSpec::heads)
      .def_ro("kv_heads", &LayerSpec::kv_heads)
      .def_ro("head_dim", &LayerSpec::head_dim)
      .def_ro("rope", &LayerSpec::rope)
      .def_ro("attn_scale", &LayerSpec::attn_scale)
      .def_ro("block_size", &LayerSpec::block_size)
      .def_ro("window", &LayerSpec::window);
  m.def(
      "decoder_layers",
      [](const mx::array& x, const nb::list& specs, const std::vector<mx::array>& k_pools,
         const std::vector<mx::array>& v_pools, const mx::array& slots,
         const mx::array& positions, const mx::array& block_tables,
         const mx::array& context_lens, const mx::array& query_lens, mx::StreamOrDevice s) {
        std::vector<const LayerSpec*> layers;  // the specs as they are: no copy of their arrays
        for (nb::handle spec : specs) layers.push_back(&nb::cast<const LayerSpec&>(spec));
        return batchscope::decoder_layers(x, layers, k_pools, v_pools, slots, positions,
                                          block_tables, context_lens, query_lens, s);
      },
      "x"_a, "specs"_a, "k_pools"_a, "v_pools"_a, "slots"_a, "positions"_a, "block_tables"_a,
      "context_lens"_a, "query_lens"_a, nb::kw_only(), "stream"_a = nb::none(),
      "Consecutive llama-style decoder layers (norms, q/k/v, RoPE, paged KV write and "
      "attention, o, SwiGLU MLP, residuals; one pool per layer, one window for all) as one op on "
      "a step's rows; returns the last one's output and writes the rows' keys and values into "
      "the pool arrays when evaluated.");
  m.def("gated_delta_rows", &batchscope::gated_delta_rows, "qkv"_a, "a"_a, "b"_a,
        "conv_weight"_a, "A_log"_a, "dt_bias"_a, "conv_pool"_a, "state_pool"_a, "groups"_a,
        "snapshots"_a, nb::kw_only(), "k_heads"_a, "v_heads"_a, "k_dim"_a, "v_dim"_a,
        "stream"_a = nb::none(),
        "A Gated DeltaNet layer's conv and delta-rule recurrence on a step's float32 rows, "
        "each group (num_rows, slot) one sequence; returns y (rows, Hv, Dv) and writes the "
        "groups' and snapshots' (row, slot) states into the pool arrays when evaluated.");
  m.def("read_bandwidth", &batchscope::read_bandwidth, "bytes"_a, "rounds"_a = 3,
        "GB/s of reading a buffer of `bytes` with every native thread, the best of `rounds` "
        "(benchmarks/step_profile.py's memory ceiling).");
  m.def("time_quantized_linears", &batchscope::time_quantized_linears, "ws"_a, "scales"_a,
        "biases"_a, "bits"_a, "group_sizes"_a, nb::kw_only(), "rows"_a = 1, "rounds"_a = 5,
        "int8_activations"_a = false,
        "`rows` rows through every quantized layer in turn, `rounds` times, as the fused "
        "decoder layer calls the kernel (no MLX dispatch; int8_activations: its option): per "
        "round, each layer's seconds.");
  m.def("set_attention_parallel_cost", &batchscope::set_attention_parallel_cost, "cost"_a,
        "The cost (keys x query heads / 16, summed over a call) from which paged attention is "
        "shared with the worker threads; returns the one it replaces (benchmarks).");
  m.def("attention_parallel_cost", &batchscope::attention_parallel_cost,
        "The cost from which paged attention is shared with the worker threads now.");
  m.def("native_threads", &batchscope::parallel_threads,
        "Threads the native ops' worker pool uses (the caller included).");
}
