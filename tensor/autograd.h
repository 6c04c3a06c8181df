#pragma once
// Eager tape. An op whose inputs require grad gives its output a Node holding
// the inputs and a backward function that maps the output's gradient to one
// gradient per input. backward() walks the nodes in reverse topological order.
// The ops record here, so the tape sits beside them in tensor/; what is built
// on top of the ops (checkpoint, gradcheck) lives in autograd/.
#include <functional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace areno {

using BackwardFn = std::function<std::vector<Tensor>(const Tensor& grad_output)>;

struct Node {
  std::string name;
  std::vector<Tensor> inputs;  // gradients flow to those that require grad
  BackwardFn backward;         // returns inputs.size() tensors (undefined = no gradient)
};

bool grad_enabled();
void set_grad_enabled(bool enabled);

// Sets grad mode for a scope and restores the previous mode on exit.
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled) : prev_(grad_enabled()) { set_grad_enabled(enabled); }
  ~GradModeGuard() { set_grad_enabled(prev_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool prev_;
};

// Whether an op that records nothing may use an inference-only kernel whose
// rounding differs from the path that records (the fused attention kernel).
// On by default; checkpoint() turns it off for its first forward, so that the
// recomputation in backward, which records, gives the same values bit for bit.
bool inference_kernels_enabled();
class InferenceKernelsGuard {
 public:
  explicit InferenceKernelsGuard(bool enabled);
  ~InferenceKernelsGuard();
  InferenceKernelsGuard(const InferenceKernelsGuard&) = delete;
  InferenceKernelsGuard& operator=(const InferenceKernelsGuard&) = delete;

 private:
  bool prev_;
};

struct NoGradGuard : GradModeGuard {
  NoGradGuard() : GradModeGuard(false) {}
};

struct EnableGradGuard : GradModeGuard {
  EnableGradGuard() : GradModeGuard(true) {}
};

// True when grad mode is on and any defined input requires grad.
bool needs_grad(const std::vector<Tensor>& inputs);
// Marks `out` as produced by `name` from `inputs`. Gradients returned by `fn`
// are summed to each input's shape (undoing broadcasting) and cast to its dtype.
void record(Tensor& out, const char* name, std::vector<Tensor> inputs, BackwardFn fn);
// Accumulates d(root)/d(leaf) * grad into every reachable leaf's .grad().
void run_backward(const Tensor& root, const Tensor& grad);

}  // namespace areno
