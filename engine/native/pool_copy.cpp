#include "pool_copy.h"

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include "cpu_dispatch.h"
#include "inputs.h"

namespace batchscope {

namespace {

const Check check{"pool_copy_rows"};

void copy(const mx::array& pool, const std::vector<std::pair<int, int>>& pairs) {
  const size_t heads = pool.shape(0), slots = pool.shape(1);
  const size_t row_bytes = pool.shape(2) * pool.itemsize();
  // The op's own input, written in place (see pool_copy.h).
  auto* base = static_cast<uint8_t*>(const_cast<void*>(pool.data<void>()));
  for (size_t h = 0; h < heads; ++h) {
    uint8_t* head = base + h * slots * row_bytes;
    for (const auto& [src, dst] : pairs) {
      std::memcpy(head + dst * row_bytes, head + src * row_bytes, row_bytes);
    }
  }
}

}  // namespace

mx::array pool_copy_rows(const std::vector<mx::array>& pools,
                         const std::vector<std::pair<int, int>>& pairs, mx::StreamOrDevice s) {
  check(!pools.empty(), "no pools given");
  for (const auto& pool : pools) {
    check(pool.ndim() == 3, "a pool must be (kv_heads, slots, dim), not " + shape_str(pool));
    check(pool.is_available() && pool.flags().row_contiguous,
          "the pools must be evaluated, row-contiguous arrays: the op writes them in place");
    check(pool.shape(1) == pools[0].shape(1), "the pools must have the same number of slots");
  }
  const int slots = static_cast<int>(pools[0].shape(1));
  // A row copied before another reads it would make the result depend on the order.
  std::unordered_set<int> sources, destinations;
  for (const auto& [src, dst] : pairs) {
    for (int slot : {src, dst}) {
      check(slot >= 0 && slot < slots, "slot " + std::to_string(slot) + " is outside the pool");
    }
    check(destinations.insert(dst).second,
          "destination slot " + std::to_string(dst) + " is named twice");
    sources.insert(src);
  }
  for (int dst : destinations) {
    check(!sources.count(dst), "slot " + std::to_string(dst) + " is both a source and a "
                               "destination");
  }
  auto stream = mx::to_stream(s);
  return mx::array({}, mx::int32, std::make_shared<PoolCopyRows>(stream, pairs), pools);
}

void PoolCopyRows::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  auto& out = allocate(outputs[0]);
  dispatch(stream(), inputs, out,
           [in = weak_copies(inputs), out = mx::array::unsafe_weak_copy(out),
            pairs = pairs_]() mutable {
             for (const auto& pool : in) copy(pool, pairs);
             *out.data<int32_t>() = static_cast<int32_t>(pairs.size());
           });
}

void PoolCopyRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("pool_copy_rows runs on the CPU only");
}

}  // namespace batchscope
