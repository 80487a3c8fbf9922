#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>

#include "paged_attention.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_paged_attention, m) {
  m.doc() = "batchscope's paged decode attention for MLX's CPU backend";
  m.def("paged_decode_attention", &batchscope::paged_decode_attention, "q"_a, "k_pool"_a,
        "v_pool"_a, "block_tables"_a, "context_lens"_a, "scale"_a, "block_size"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "Decode attention for rows of q over their blocks of the paged pool.");
}
