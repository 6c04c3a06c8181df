#include "train/rl/value_head.h"

#include <stdexcept>

#include <fmt/format.h>

#include "nn/io/safetensors.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace areno::train::rl {

ValueHead::ValueHead(int64_t hidden_size, Device device) : Module("ValueHead") {
  const TensorOptions f32(DType::f32, device);
  weight = register_parameter("weight", zeros({1, hidden_size}, f32));
  bias = register_parameter("bias", zeros({1}, f32));
}

Tensor ValueHead::forward(const Tensor& hidden) const {
  const int64_t K = hidden.size(0);
  return linear(hidden.to(DType::f32), weight, bias).reshape({K});
}

void ValueHead::save(const std::filesystem::path& dir) const {
  save_safetensors((dir / kValueHeadFile).string(),
                   {{"value_head.weight", weight.to(Device::cpu())}, {"value_head.bias", bias.to(Device::cpu())}});
}

void ValueHead::load(const std::filesystem::path& file) {
  std::vector<std::pair<std::string, Tensor>> tensors = load_safetensors(file.string());
  for (auto [name, dst] : {std::pair<const char*, Tensor*>{"value_head.weight", &weight}, {"value_head.bias", &bias}}) {
    const Tensor* src = nullptr;
    for (const auto& [n, t] : tensors)
      if (n == name) src = &t;
    if (!src) throw std::runtime_error(fmt::format("{}: no tensor {}", file.string(), name));
    if (src->shape() != dst->shape())
      throw std::runtime_error(fmt::format("{}: {} has shape {}, the model's hidden size needs {}", file.string(), name,
                                           shape_str(src->shape()), shape_str(dst->shape())));
    NoGradGuard ng;
    dst->copy_(src->to(DType::f32).to(dst->device()));
  }
}

}  // namespace areno::train::rl
