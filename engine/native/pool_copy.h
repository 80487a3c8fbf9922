// Rows of the paged KV pool copied to other slots, in place, as one MLX op on the CPU: a
// prompt that matches part of a cached block gets those rows copied into a block of its own
// (engine/block_manager.py, KVCopy). MLX's ops take a gather and a scatter per pool array
// (60 ops for a 30-layer model); this is a memcpy per row and head, about a tenth of their
// time whatever the rows (benchmarks/prefix_copy.py times both).
//
// The pools are written in place when the op is evaluated, for the reason decoder_layer.h
// gives for the step's keys and values: callers evaluate the op's output before a step reads
// the pools.
#pragma once

#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace batchscope {

namespace mx = mlx::core;

// pools: arrays of (kv_heads, slots, dim) in any dtype, each evaluated and row-contiguous;
// pairs: (source slot, destination slot), each slot inside every pool, no destination named
// twice nor also a source. Returns a scalar int32 (the rows copied) whose evaluation copies,
// in every pool and head, each source row to its destination.
mx::array pool_copy_rows(const std::vector<mx::array>& pools,
                         const std::vector<std::pair<int, int>>& pairs,
                         mx::StreamOrDevice s = {});

class PoolCopyRows : public mx::Primitive {
 public:
  PoolCopyRows(mx::Stream stream, std::vector<std::pair<int, int>> pairs)
      : mx::Primitive(stream), pairs_(std::move(pairs)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "PoolCopyRows";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return false;  // it writes its pools: never merged with another
  }

 private:
  std::vector<std::pair<int, int>> pairs_;
};

}  // namespace batchscope
