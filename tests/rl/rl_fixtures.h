#pragma once
// What the rollout trainers' tests share (test_rl_grpo.cpp, test_rl_ppo.cpp)
// beyond tests/train/train_fixtures.h (phi4_tokenizer): a copy of every
// parameter to compare before and after a step.
#include <map>
#include <string>
#include <vector>

#include "nn/module.h"

namespace areno::testing {

// Every parameter's values by checkpoint name.
inline std::map<std::string, std::vector<float>> param_snapshot(const Module& m) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, p] : m.named_parameters()) out[name] = p.to_vector<float>();
  return out;
}

}  // namespace areno::testing
