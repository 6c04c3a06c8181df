#pragma once
// What the RL trainers' tests share (test_rl_grpo.cpp, test_rl_ppo.cpp,
// test_rl_dpo.cpp, test_rl_agent.cpp) beyond tests/train/train_fixtures.h
// (phi4_tokenizer): prompt rows, the small loop and rollout the step tests
// run, a copy of every parameter to compare before and after a step, and a
// run's metrics.jsonl.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "nn/module.h"
#include "tests/train/train_fixtures.h"
#include "train/dataset.h"
#include "train/rl/rollout.h"
#include "train/sft.h"

namespace areno::testing {

// Dataset rows ({"prompt": ..., fields for the reward}) through the
// dataset's prompt path, as lines 1.. of "prompts.jsonl".
inline std::vector<train::PromptRow> prompt_rows(const std::vector<nlohmann::json>& rows) {
  std::vector<train::PromptRow> out;
  for (size_t i = 0; i < rows.size(); ++i)
    out.push_back(train::make_prompt_row(*phi4_tokenizer(), {int64_t(i) + 1, rows[i], {}}, "prompts.jsonl", {}));
  return out;
}

// The step tests' loop: 2 prompts a step, `mini_bs` rows per micro-batch,
// lr 1e-3 constant, 3 steps, seed 7, gradient norms unclipped (raw).
inline train::SftOptions small_rl_loop(int64_t mini_bs) {
  train::SftOptions o;
  o.batch_size = 2;
  o.mini_bs = mini_bs;
  o.lr = 1e-3;
  o.max_steps = 3;
  o.seed = 7;
  o.decay = train::DecayStyle::constant;
  o.grad_clip_norm = 0;
  return o;
}

// `n_samples` completions of at most 5 tokens per prompt on a small engine.
inline train::rl::RolloutOptions small_rollout(int64_t n_samples) {
  train::rl::RolloutOptions o;
  o.n_samples = n_samples;
  o.max_new_tokens = 5;
  o.engine.kv_blocks = 64;
  o.engine.max_running = 8;
  return o;
}

// Every parameter's values by checkpoint name.
inline std::map<std::string, std::vector<float>> param_snapshot(const Module& m) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& [name, p] : m.named_parameters()) out[name] = p.to_vector<float>();
  return out;
}

// The lines of dir/metrics.jsonl (--metrics-log-dir), one JSON object per step.
inline std::vector<nlohmann::json> metrics_lines(const std::filesystem::path& dir) {
  std::ifstream in(dir / "metrics.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

}  // namespace areno::testing
