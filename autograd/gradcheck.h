#pragma once
// The finite-difference checker every differentiable op must pass.
#include <functional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace areno {

// Central-difference check of d f / d inputs in f64 against backward().
// f must return a tensor; the check uses the scalar sum(f(x) * w) for a fixed
// random w. Inputs must be f64 CPU tensors; those with requires_grad are checked.
struct GradcheckResult {
  bool ok = true;
  double max_abs_err = 0, max_rel_err = 0;
  std::string message;  // the first failing input and element
};
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, double eps = 1e-6,
                          double atol = 1e-6, double rtol = 1e-4);

}  // namespace areno
