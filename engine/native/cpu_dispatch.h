// How a native op's eval_cpu queues its work on MLX's CPU stream: the output allocated, the
// op's arrays registered with the stream's encoder (which keeps them alive until the work has
// run), and the work given weak copies of them.
#pragma once

#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace batchscope {

namespace mx = mlx::core;

// `out` must have its data before a body takes its weak copy of it.
inline mx::array& allocate(mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return out;
}

// Weak copies of arrays, for a body that reads them all.
inline std::vector<mx::array> weak_copies(const std::vector<mx::array>& arrays) {
  std::vector<mx::array> weak;
  weak.reserve(arrays.size());
  for (const auto& a : arrays) weak.push_back(mx::array::unsafe_weak_copy(a));
  return weak;
}

// Registers the inputs and `out` with the stream's encoder and queues body on the stream.
template <class Body>
void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out,
              Body body) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch(std::move(body));
}

}  // namespace batchscope
