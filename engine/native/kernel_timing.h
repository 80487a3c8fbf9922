// Measurements for the benchmarks (benchmarks/step_profile.py): what the quantized linear
// kernel takes on its own, called as the fused decoder layer calls it (no MLX dispatch), and
// what the machine's memory gives the same worker threads to read with. Nothing in a step
// calls these.
#pragma once

#include <vector>

#include "mlx/array.h"

namespace batchscope {

namespace mx = mlx::core;

// GB/s of reading a buffer of `bytes` (a multiple of 4096, touched first) with every native
// thread (parallel_for's caller and workers, each streaming its own contiguous share), the
// best of `rounds`.
double read_bandwidth(size_t bytes, int rounds);

// `rows` float32 rows (ones) through every layer in turn, `rounds` times, as
// quantized_linear_rows (the fused layer's call) computes them, with its int8-activation
// option where asked: per round, each layer's seconds. Layer i:
// ws[i] (out, in * bits[i] / 32) uint32, scales[i] and biases[i] (out, in / group_sizes[i]).
std::vector<std::vector<double>> time_quantized_linears(const std::vector<mx::array>& ws,
                                                        const std::vector<mx::array>& scales,
                                                        const std::vector<mx::array>& biases,
                                                        const std::vector<int>& bits,
                                                        const std::vector<int>& group_sizes,
                                                        int rows, int rounds,
                                                        bool int8_activations);

}  // namespace batchscope
