#pragma once
// What the rollout trainers' tests share (test_rl_grpo.cpp, test_rl_ppo.cpp):
// the built-in tokenizer, once, and a copy of every parameter to compare
// before and after a step.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "nn/module.h"

namespace areno::testing {

inline std::shared_ptr<const tok::Tokenizer> rl_tokenizer() {
  static auto t = std::make_shared<const tok::Tokenizer>(phi4mm::make_tokenizer());
  return t;
}

// Every parameter's values by checkpoint name.
inline std::map<std::string, std::vector<float>> param_snapshot(const Module& m) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, p] : m.named_parameters()) out[name] = p.to_vector<float>();
  return out;
}

}  // namespace areno::testing
