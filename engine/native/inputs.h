// How the native ops take their inputs: row-contiguous, as their kernels read them; and how
// they refuse bad ones (check) and name a shape in the message.
#pragma once

#include <stdexcept>
#include <string>

#include "mlx/ops.h"

namespace batchscope {

namespace mx = mlx::core;

// `a` as it is when it is already evaluated and row-contiguous (weights, pools, arrays made
// from host data), else through mx::contiguous. That node copies nothing for a contiguous
// input, but it is still an op to schedule, and a step has hundreds of inputs.
inline mx::array row_contiguous(const mx::array& a, mx::Stream s) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

// An op's argument check: check(ok, message) throws std::invalid_argument("op: message") (a
// ValueError in Python) when ok is false. Each op's file holds one: Check check{"op"}.
struct Check {
  const char* op;
  void operator()(bool ok, const std::string& message) const {
    if (!ok) throw std::invalid_argument(std::string(op) + ": " + message);
  }
};

// "(2, 3)": an array's shape in an error message.
inline std::string shape_str(const mx::array& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + ")";
}

}  // namespace batchscope
