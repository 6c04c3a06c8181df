#pragma once
// Weights as a difference from a base model of the same structure: the
// parameters training changed, bitwise. A parameter equal to the base's is
// left out; one whose changed rows (first dimension) are at most half of its
// rows is stored row-sparse as NAME:rows (i64 [k], ascending) and
// NAME:values ([k, ...]); any other changed parameter is stored whole under
// NAME. Applying the delta to a fresh copy of the base gives the trained
// weights bit for bit.
//
// The embedded demo model (models/phi4mm/demo.h) is the tiny preset from its
// seed plus such a delta: training with `--embed-rows data` changes only a
// few hundred of the tied embedding's 200064 rows, so the delta of a model
// whose weights are 51 MB is well under 1 MB.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "nn/io/safetensors.h"
#include "nn/module.h"

namespace areno {

struct WeightDeltaStats {
  int64_t unchanged = 0;   // parameters equal to the base's
  int64_t whole = 0;       // parameters stored whole
  int64_t sparse = 0;      // parameters stored row-sparse
  int64_t sparse_rows = 0; // rows stored for them
};

// The tensors of the delta (CPU, contiguous), in named_parameters order.
// Both modules must have the same parameter names, shapes and dtypes (throws
// std::invalid_argument naming the first difference).
std::vector<std::pair<std::string, Tensor>> weight_delta(const Module& base, const Module& trained,
                                                         WeightDeltaStats* stats = nullptr);

// Writes the delta's tensors into `model`'s parameters (CPU, the delta's
// dtypes). Throws std::runtime_error naming `delta`'s path and the tensor for
// an unknown parameter, a shape or dtype that differs, a row index out of
// range or not ascending, or a :rows without its :values; nothing is written
// then.
void apply_weight_delta(Module& model, const SafetensorsFile& delta);

}  // namespace areno
