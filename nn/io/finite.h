#pragma once
// Finding NaN and infinite values in weights (load_model's check_weights,
// `areno init`'s check of what it wrote).
#include <cstdint>
#include <optional>
#include <string>

#include "nn/io/safetensors.h"
#include "tensor/tensor.h"

namespace areno {

struct NonFinite {
  int64_t index = 0;  // flat index, row-major
  double value = 0;   // NaN, inf or -inf
};

// The first NaN or infinite element of `t` (any device, any strides); nullopt
// when every element is finite or the dtype is not a floating one. Reads the
// elements as stored: no copy of a contiguous CPU tensor.
std::optional<NonFinite> first_nonfinite(const Tensor& t);

// Throws std::runtime_error "<source>: tensor <name> holds nan at element i
// (of shape [..])" when `t` has a non-finite element.
void check_finite(const Tensor& t, const std::string& source, const std::string& name);
// check_finite on every tensor of a checkpoint as stored, read once from its
// mapping (the pages are dropped after each): what `areno init` wrote, checked
// without building a model.
void check_finite(const SafetensorsCheckpoint& ckpt);

}  // namespace areno
