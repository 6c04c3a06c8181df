#pragma once
// Rollouts through the inference engine (issue 15, "Rollout"): the trainer's
// own Phi4MMForCausalLM (the same shared_ptr, no copy) samples `n_samples`
// completions per prompt on a serve::Engine, each prompt prefilled once and
// its KV blocks copied to the other samples, and every token comes back with
// its log-probability under the raw model distribution (see policy_logp.h:
// policy_logp of the same tokens gives the same numbers, to 1e-5 in f32 on CPU).
//
// Memory: after run() every KV block of the engine is free (checked through
// EngineStats::kv_blocks_used; a leak is a std::logic_error). The cache
// itself stays allocated for the next rollout unless drop_rollout_state,
// which destroys the engine after each run (and release() does on demand):
// the next run builds a fresh one.
//
// Weights: the engine keeps nothing derived from the weights between
// requests (only KV blocks, freed above), so the rollout after an optimizer
// step, which updates the shared parameters in place, samples from the new
// policy.
//
// Dropout: the engine runs the model as it is. Parts a trainer switched to
// training mode with a dropout > 0 would drop out during rollouts too (and
// differently from policy_logp); the RL trainers turn the adapters' dropout
// off (train::disable_dropout), as verl and TRL do.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/phi4mm/text.h"
#include "models/phi4mm/tokenizer/tokenizer.h"
#include "serve/engine.h"
#include "train/rl/policy_logp.h"

namespace areno::train::rl {

struct RolloutOptions {
  int64_t n_samples = 1;            // completions per prompt (--n-samples)
  double temperature = 1.0;         // --temperature (sampling only; the log-probabilities are raw)
  int64_t top_k = -1;               // --top-k, <= 0: off
  double top_p = 1.0;               // --top-p
  bool greedy = false;              // --greedy: temperature 0
  int64_t max_new_tokens = 256;     // --max-new-tokens
  int64_t max_context_len = 0;      // --max-context-len, 0: the model's
  uint64_t seed = 0;                // sample j of prompt i in run r draws from (seed, r, i, j)
  bool drop_rollout_state = false;  // --drop-rollout-state: free the engine after each run
  serve::EngineOptions engine;      // max_running (--max-running-prompts x n), KV cache size
};

struct RolloutSample {
  int64_t prompt = 0;               // index into run()'s prompts
  int64_t index = 0;                // sample within the prompt's group
  std::vector<int64_t> tokens;      // completion ids (a stop token included)
  // Rollout log-probability of each token (raw distribution); NaN on tokens
  // the engine did not sample (an agent row's context, train/rl/agent.h).
  std::vector<float> logp;
  serve::FinishReason finish = serve::FinishReason::none;
  std::vector<uint8_t> trainable;   // empty: every token; else 0/1 per token (Sequence::trainable)
  // An agent's per-turn rewards of the turns in this row (AgentOutput::
  // turn_rewards): (index in `tokens` of the turn's last token, -1 for none
  // yet; the reward). Empty for engine rollouts and agents that print none.
  std::vector<std::pair<int64_t, double>> turn_rewards;
};

// What one GRPO/GSPO step trains on, whichever source rolled it out (the
// engine, Rollout::run; or agents, AgentRollout::run): the rows and the
// trajectories they came from. A trajectory is one run of one task; the
// group of task i is trajectories [i * n_samples, (i + 1) * n_samples).
struct RolloutBatch {
  std::vector<Prompt> prompts;         // what samples[k].prompt indexes
  std::vector<RolloutSample> samples;  // the training rows
  struct Trajectory {
    int64_t task = 0, index = 0;       // the task within the step, the run within its group
    std::vector<int64_t> rows;         // indices into samples (one, or more when split)
    std::optional<double> reward;      // given by the source (an agent's printed reward)
    std::string text;                  // the final answer, for the configured reward
    int64_t tokens = 0;                // its token count
    std::vector<double> turn_rewards;  // an agent's printed per-turn rewards (empty: none)
  };
  std::vector<Trajectory> trajectories;  // task-major
};

class Rollout {
 public:
  // Throws std::invalid_argument for n_samples < 1, max_new_tokens < 1 or
  // sampling parameters outside serve/sampler.h's bounds.
  Rollout(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::shared_ptr<const tok::Tokenizer> tokenizer,
          RolloutOptions options);

  // n_samples completions of every prompt: result[i * n_samples + j] is
  // sample j of prompts[i]. Runs on the calling thread; no autograd is
  // recorded. Throws what the engine throws for a bad prompt, and
  // std::runtime_error when a request fails.
  std::vector<RolloutSample> run(const std::vector<Prompt>& prompts);

  // Destroys the engine and its KV cache; the next run builds a new one.
  void release() { engine_.reset(); }
  bool has_engine() const { return engine_ != nullptr; }
  // The engine's counters after the last run (kv_blocks_total / kv_blocks_used,
  // tokens); zeros before the first run.
  const serve::EngineStats& last_stats() const { return last_stats_; }
  const RolloutOptions& options() const { return options_; }
  // Runs so far: run r samples from (seed, r, prompt, sample). A resumed
  // trainer sets the saved count, so it samples what the uninterrupted run would.
  uint64_t runs() const { return runs_; }
  void set_runs(uint64_t runs) { runs_ = runs; }

 private:
  std::shared_ptr<phi4mm::Phi4MMForCausalLM> model_;
  std::shared_ptr<const tok::Tokenizer> tok_;
  RolloutOptions options_;
  std::unique_ptr<serve::Engine> engine_;
  serve::EngineStats last_stats_;
  uint64_t runs_ = 0;
};

// The sequences of `samples` for policy_logp (prompt index, completion).
std::vector<Sequence> sequences_of(const std::vector<RolloutSample>& samples);

}  // namespace areno::train::rl
