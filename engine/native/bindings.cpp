#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "decode_linear.h"
#include "decode_quantized.h"
#include "paged_attention.h"
#include "row_ops.h"
#include "workers.h"

namespace nb = nanobind;
using namespace nb::literals;

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
  m.def("native_threads", &batchscope::parallel_threads,
        "Threads the native ops' worker pool uses (the caller included).");
}
