#include "kernel_timing.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "decode_quantized.h"
#include "inputs.h"
#include "simd.h"
#include "workers.h"

namespace batchscope {

namespace {

constexpr Check check{"kernel timing"};
constexpr size_t PAGE = 4096;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The sum of [p, p + bytes) as 32-bit integers (bytes whole pages): something the compiler
// cannot drop, from one load per 64 bytes.
uint32_t sum_words(const uint8_t* p, size_t bytes) {
#if BATCHSCOPE_HAS_AVX512
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
  for (size_t i = 0; i < bytes; i += 128) {
    a = _mm512_add_epi32(a, _mm512_load_si512(p + i));
    b = _mm512_add_epi32(b, _mm512_load_si512(p + i + 64));
  }
  return static_cast<uint32_t>(_mm512_reduce_add_epi32(_mm512_add_epi32(a, b)));
#else
  uint32_t s = 0;
  for (size_t i = 0; i < bytes; i += 4) s += *reinterpret_cast<const uint32_t*>(p + i);
  return s;
#endif
}

}  // namespace

double read_bandwidth(size_t bytes, int rounds) {
  check(bytes >= PAGE && bytes % PAGE == 0, "bytes must be a positive multiple of 4096");
  check(rounds >= 1, "rounds must be at least 1");
  std::unique_ptr<uint8_t, decltype(&std::free)> buffer(
      static_cast<uint8_t*>(std::aligned_alloc(PAGE, bytes)), &std::free);
  check(buffer != nullptr, "cannot allocate " + std::to_string(bytes) + " bytes");
  uint8_t* data = buffer.get();
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(i);
  const int pages = static_cast<int>(bytes / PAGE);
  volatile uint32_t sink = 0;
  double best = 0;
  for (int r = 0; r < rounds; ++r) {
    std::vector<uint32_t> sums(pages);
    const auto t0 = Clock::now();
    auto body = [&](int begin, int end) {
      sums[begin] = sum_words(data + begin * PAGE, static_cast<size_t>(end - begin) * PAGE);
    };
    // One share per thread, in chunks of 1024 pages (4 MB): each thread streams its own.
    if (!parallel_for(pages, 1024, body)) body(0, pages);
    const double t = seconds_since(t0);
    for (uint32_t s : sums) sink = sink + s;
    best = std::max(best, static_cast<double>(bytes) / t / 1e9);
  }
  return best;
}

std::vector<std::vector<double>> time_quantized_linears(const std::vector<mx::array>& ws,
                                                        const std::vector<mx::array>& scales,
                                                        const std::vector<mx::array>& biases,
                                                        const std::vector<int>& bits,
                                                        const std::vector<int>& group_sizes,
                                                        int rows, int rounds,
                                                        bool int8_activations) {
  const size_t n = ws.size();
  check(n > 0, "no layers");
  check(scales.size() == n && biases.size() == n && bits.size() == n && group_sizes.size() == n,
        "ws, scales, biases, bits and group_sizes must have one entry per layer");
  check(rows >= 1 && rounds >= 1, "rows and rounds must be at least 1");
  std::vector<int> ins(n), outs(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string layer = "layer " + std::to_string(i) + ": ";
    check(ws[i].is_available() && scales[i].is_available() && biases[i].is_available(),
          layer + "evaluate the arrays first (mx.eval)");
    check(bits[i] == 4 || bits[i] == 8, layer + "bits must be 4 or 8");
    check(group_sizes[i] == 32 || group_sizes[i] == 64 || group_sizes[i] == 128,
          layer + "group_size must be 32, 64 or 128");
    check(ws[i].dtype() == mx::uint32 && ws[i].ndim() == 2 && ws[i].flags().row_contiguous,
          layer + "w must be a row-contiguous 2-d uint32 array");
    const int in = ins[i] = static_cast<int>(ws[i].shape(1)) * 32 / bits[i];
    const int out = outs[i] = static_cast<int>(ws[i].shape(0));
    for (const mx::array* a : {&scales[i], &biases[i]}) {
      check(a->ndim() == 2 && a->shape(0) == out && a->shape(1) == in / group_sizes[i] &&
                a->flags().row_contiguous,
            layer + "scales and biases must be row-contiguous (out, in / group_size), not " +
                shape_str(*a));
      check(a->dtype() == mx::float16 || a->dtype() == mx::bfloat16 || a->dtype() == mx::float32,
            layer + "scales and biases must be float16, bfloat16 or float32");
    }
    check(biases[i].dtype() == scales[i].dtype(), layer + "biases must have the scales' dtype");
  }
  const size_t max_in = *std::max_element(ins.begin(), ins.end());
  const size_t max_out = *std::max_element(outs.begin(), outs.end());
  const std::vector<float> x(rows * max_in, 1.0f);
  std::vector<float> y(rows * max_out);
  std::vector<std::vector<double>> times(rounds, std::vector<double>(n));
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < n; ++i) {
      const auto t0 = Clock::now();
      quantized_linear_rows(x.data(), rows, ins[i], ws[i].data<uint32_t>(),
                            scales[i].data<void>(), biases[i].data<void>(), scales[i].dtype(),
                            outs[i], group_sizes[i], bits[i], y.data(), int8_activations);
      times[r][i] = seconds_since(t0);
    }
  }
  return times;
}

}  // namespace batchscope
