#include "tensor/autograd.h"

#include <fmt/format.h>

#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "tensor/ops.h"

namespace areno {

static thread_local bool g_grad_enabled = true;
bool grad_enabled() { return g_grad_enabled; }
void set_grad_enabled(bool e) { g_grad_enabled = e; }

static thread_local bool g_inference_kernels = true;
bool inference_kernels_enabled() { return g_inference_kernels; }
InferenceKernelsGuard::InferenceKernelsGuard(bool enabled) : prev_(g_inference_kernels) {
  g_inference_kernels = enabled;
}
InferenceKernelsGuard::~InferenceKernelsGuard() { g_inference_kernels = prev_; }

bool needs_grad(const std::vector<Tensor>& inputs) {
  if (!g_grad_enabled) return false;
  for (auto& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

void record(Tensor& out, const char* name, std::vector<Tensor> inputs, BackwardFn fn) {
  auto node = std::make_shared<Node>();
  node->name = name;
  node->inputs = std::move(inputs);
  node->backward = std::move(fn);
  out.impl()->grad_fn = std::move(node);
  out.impl()->requires_grad = true;
}

// Brings a gradient to the input's shape and dtype.
static Tensor fit_grad(const Tensor& g, const Tensor& input, const Node& node) {
  Tensor r = g;
  if (r.shape() != input.shape()) {
    try {
      r = sum_to(r, input.shape());
    } catch (const std::exception& e) {
      throw std::logic_error(fmt::format("backward of '{}' returned a gradient of shape {} for an "
                                         "input of shape {}",
                                         node.name, shape_str(g.shape()), shape_str(input.shape())));
    }
  }
  if (r.dtype() != input.dtype()) r = r.to(input.dtype());
  return r;
}

void run_backward(const Tensor& root, const Tensor& grad_in) {
  if (!root.requires_grad())
    throw std::invalid_argument("backward() on a tensor that does not require grad");
  Tensor grad = grad_in;
  if (!grad.defined()) {
    if (root.numel() != 1)
      throw std::invalid_argument("backward() without a gradient needs a single-element tensor, got " +
                                  root.str());
    grad = ones(root.shape(), TensorOptions(root.dtype(), root.device()));
  }
  NoGradGuard no_grad;

  // Reverse topological order of the impls reachable through grad_fn.
  std::vector<TensorImpl*> order;
  std::unordered_set<TensorImpl*> seen;
  std::vector<std::pair<TensorImpl*, size_t>> stack{{root.impl().get(), 0}};
  seen.insert(root.impl().get());
  while (!stack.empty()) {
    auto& [impl, next] = stack.back();
    if (impl->grad_fn && next < impl->grad_fn->inputs.size()) {
      const Tensor& in = impl->grad_fn->inputs[next++];
      if (in.defined() && in.requires_grad() && seen.insert(in.impl().get()).second)
        stack.push_back({in.impl().get(), 0});
    } else {
      order.push_back(impl);
      stack.pop_back();
    }
  }

  std::unordered_map<TensorImpl*, Tensor> grads;
  grads[root.impl().get()] = grad;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    TensorImpl* impl = *it;
    auto found = grads.find(impl);
    if (found == grads.end()) continue;
    Tensor g = found->second;
    grads.erase(found);
    if (!impl->grad_fn) {  // leaf: accumulate
      if (impl->grad) {
        impl->grad = add(Tensor(impl->grad), g).impl();
      } else {
        impl->grad = g.clone().impl();  // own copy: g may alias another tensor's gradient
      }
      continue;
    }
    Node& node = *impl->grad_fn;
    std::vector<Tensor> in_grads = node.backward(g);
    if (in_grads.size() != node.inputs.size())
      throw std::logic_error(fmt::format("backward of '{}' returned {} gradients for {} inputs",
                                         node.name, in_grads.size(), node.inputs.size()));
    for (size_t i = 0; i < in_grads.size(); ++i) {
      const Tensor& in = node.inputs[i];
      if (!in.defined() || !in.requires_grad() || !in_grads[i].defined()) continue;
      Tensor gi = fit_grad(in_grads[i], in, node);
      auto& slot = grads[in.impl().get()];
      slot = slot.defined() ? add(slot, gi) : gi;
    }
  }
}

}  // namespace areno
