#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>

#include "decode_linear.h"
#include "paged_attention.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_kernels, m) {
  m.doc() = "batchscope's decode kernels for MLX's CPU backend";
  m.def("paged_decode_attention", &batchscope::paged_decode_attention, "q"_a, "k_pool"_a,
        "v_pool"_a, "block_tables"_a, "context_lens"_a, "scale"_a, "block_size"_a,
        "window"_a = 0, nb::kw_only(), "stream"_a = nb::none(),
        "Decode attention for rows of q over their blocks of the paged pool.");
  m.def("decode_linear", &batchscope::decode_linear, "x"_a, "weight"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "x @ weight.T in float32 for a few rows, each row computed alone (batch-invariant).");
}
