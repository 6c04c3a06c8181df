#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace areno {

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& s);
// Broadcasts two shapes as NumPy/PyTorch do; throws with both shapes on mismatch.
Shape broadcast_shapes(const Shape& a, const Shape& b);
std::string shape_str(const Shape& s);  // "[2, 3]"
// Wraps a possibly negative dim into [0, ndim); throws when out of range.
int64_t wrap_dim(int64_t dim, int64_t ndim);

}  // namespace areno
