#pragma once
// Activation checkpointing: trades compute for memory in training.
#include <functional>
#include <vector>

#include "tensor/tensor.h"

namespace areno {

// Runs fn without recording, and recomputes it with recording during
// backward. Parameters that fn uses get their gradients then.
Tensor checkpoint(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                  const std::vector<Tensor>& inputs);

}  // namespace areno
