#pragma once
// PPO's value head (issue 15, "Objectives"; docs/rl.md, "The PPO loop"): a
// Linear(hidden_size -> 1) in f32 on a decoder's final hidden state (after the
// final norm), one value per response position, the row that predicts the
// token (as verl reads values[:, -response_length - 1 : -1]).
//
// Zero-initialised: every value is 0 before the first update, so the first
// step's advantages are the (whitened) rewards themselves, not a random
// baseline, and a run does not depend on an init seed. The weight still gets a
// gradient at once ((v - R) h), so the head moves from the first step.
//
// Saved as value_head.safetensors (tensors "value_head.weight" [1, H] and
// "value_head.bias" [1], f32) in a step folder or a --critic-ckpt folder.
#include <cstdint>
#include <filesystem>
#include <string>

#include "nn/module.h"
#include "tensor/tensor.h"

namespace areno::train::rl {

inline constexpr const char* kValueHeadFile = "value_head.safetensors";

class ValueHead : public Module {
 public:
  // Zero weight and bias on `device`, requiring grad.
  ValueHead(int64_t hidden_size, Device device);

  // hidden: [K, H] (any float dtype) -> [K] f32.
  Tensor forward(const Tensor& hidden) const;

  // Writes dir/value_head.safetensors (atomically).
  void save(const std::filesystem::path& dir) const;
  // Reads what save wrote; throws std::runtime_error naming the file and the
  // tensor when a tensor is missing or has another shape.
  void load(const std::filesystem::path& file);

  Tensor weight;  // [1, H] f32
  Tensor bias;    // [1] f32
};

}  // namespace areno::train::rl
