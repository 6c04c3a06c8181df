#pragma once
// Helpers shared by the op files (not part of the public API).
#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "tensor/autograd.h"
#include "tensor/backend.h"
#include "tensor/ops.h"

namespace areno::detail {

inline void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  if (a.device() != b.device())
    throw std::invalid_argument(fmt::format("{}: tensors on different devices ({} and {})", op,
                                            a.device().str(), b.device().str()));
}

inline void check_defined(const Tensor& t, const char* op, const char* what) {
  if (!t.defined()) throw std::invalid_argument(fmt::format("{}: {} is undefined", op, what));
}

inline void check_floating(const Tensor& t, const char* op) {
  if (!is_floating(t.dtype()))
    throw std::invalid_argument(fmt::format("{} needs a floating-point tensor, got {}", op, t.str()));
}

inline Tensor empty_on(const Shape& s, DType t, Device d) { return empty(s, TensorOptions(t, d)); }

// The binary kernel with broadcasting and promotion, without autograd.
Tensor binary_kernel(BinaryOp op, const Tensor& a, const Tensor& b, double alpha);

// Moves `dim` to the end and returns a contiguous [m, n] view plus the permuted shape.
struct RowsView {
  Tensor rows;   // [m, n] contiguous
  Shape moved;   // shape with dim moved last
  int64_t dim;
};
RowsView to_rows(const Tensor& x, int64_t dim);
// Inverse of to_rows for a result with the same row layout.
Tensor from_rows(const Tensor& rows, const RowsView& rv);

}  // namespace areno::detail
