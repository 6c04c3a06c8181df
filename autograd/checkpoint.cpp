#include "autograd/checkpoint.h"

#include <stdexcept>

#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace areno {

Tensor checkpoint(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                  const std::vector<Tensor>& inputs) {
  if (!grad_enabled()) return fn(inputs);
  Tensor out;
  {
    NoGradGuard ng;
    InferenceKernelsGuard same_kernels(false);  // as the recomputation below
    out = fn(inputs);
  }
  // The block's parameters are not inputs of the node: the recomputation's
  // own backward accumulates into them, so the node only needs the inputs.
  record(out, "checkpoint", inputs, [fn, inputs](const Tensor& g) {
    std::vector<Tensor> detached;
    for (auto& t : inputs) {
      Tensor d = t.defined() ? t.detach() : t;
      if (t.defined() && t.requires_grad()) d.set_requires_grad(true);
      detached.push_back(d);
    }
    Tensor recomputed;
    {
      EnableGradGuard eg;
      recomputed = fn(detached);
      if (recomputed.requires_grad()) run_backward(recomputed, g);
    }
    std::vector<Tensor> grads;
    for (auto& d : detached) grads.push_back(d.defined() && d.requires_grad() ? d.grad() : Tensor());
    return grads;
  });
  return out;
}

}  // namespace areno
