#pragma once
// The GRPO / GSPO loop (issue 15, "Objectives"; docs/rl.md, "The GRPO/GSPO
// loop"): rollouts through the engine over the trainer's own model, rewards,
// group advantages, the clipped objective on the training forward's
// log-probabilities, and one AdamW step per batch of prompts, with the SFT
// trainer's groups, schedules and checkpoints (train/sft.h).
//
// One step:
//   1. the next `loop.batch_size` prompt rows of the epoch's order (as SFT);
//   2. `rollout.n_samples` trajectories each, from the step's rollout source
//      (a RolloutBatch): engine completions (Rollout; the engine's KV blocks
//      are free afterwards, the engine itself dropped with
//      drop_rollout_state), or with `agent.cmd` agent runs (AgentRollout,
//      train/rl/agent.h: rows with a per-token trainable mask);
//   3. each trajectory's reward: the agent's printed one, else its final text
//      (special tokens skipped) scored by the RewardFn (1-3: roll_and_score,
//      rl_step.h, which PPO shares). With filter_groups (DAPO's dynamic
//      sampling), 1-3 repeat over the next batches of prompts until
//      batch_size groups whose rewards differ are in hand (varied_groups,
//      append_groups: rl_step.h);
//   4. group_advantages over each task's trajectories (scaled by
//      scale_rewards), each row taking its trajectory's advantage;
//   5. micro-batches of `loop.mini_bs` rows: policy_logp + grpo_loss (or
//      gspo_loss) over the trainable tokens, old_logp = the rollout's
//      log-probabilities (the training forward's own where a trainable token
//      has none: an agent's context under --train-tool-results), backward;
//   6. the global gradient norm clipped, AdamW steps, gradients dropped.
//
// Accumulation: a micro-batch's loss is an average over its own tokens
// (GRPO token_mean) or sequences (GSPO, GRPO seq_mean_token_mean and
// seq_mean_token_sum_norm, whose L is --max-new-tokens). It is
// multiplied by its share of the step's tokens (or sequences) before
// backward, so the summed gradient is that of the same average over the
// whole batch: splitting into micro-batches does not change the step.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/text.h"
#include "models/phi4mm/tokenizer/tokenizer.h"
#include "nn/optim/adamw.h"
#include "train/dataset.h"
#include "train/metrics.h"
#include "train/rl/agent.h"
#include "train/rl/objectives.h"
#include "train/rl/rewards.h"
#include "train/rl/rl_step.h"
#include "train/rl/rollout.h"
#include "train/sft.h"

namespace areno::train::rl {

enum class RlAlgo { grpo, gspo };
RlAlgo rl_algo_from_name(const std::string& name);  // "grpo" | "gspo"
const char* rl_algo_name(RlAlgo a);

struct RlOptions {
  RlAlgo algo = RlAlgo::grpo;
  // The SFT loop's options: batch_size = prompts per step, mini_bs = samples
  // per micro-batch (1 .. batch_size * n_samples), lr, schedules, groups,
  // clipping, seed (data order and rollout sampling), epochs, max_steps.
  // embed_rows must be all or none.
  SftOptions loop;
  RolloutOptions rollout;  // n_samples is the group size; seed is set from loop.seed
  GrpoOptions grpo;  // clip_eps, clip_eps_high, agg (norm_length: set from rollout.max_new_tokens)
  GspoOptions gspo;
  RewardScale scale_rewards = RewardScale::group;  // --scale-rewards (GRPO and GSPO; with adv_estimator grpo)
  AdvEstimator adv_estimator = AdvEstimator::grpo;  // --adv-estimator (outcome_advantages, objectives.h)
  // --filter-groups (DAPO's dynamic sampling, verl's algorithm.filter_groups):
  // a step rolls out batches of prompts until loop.batch_size groups with
  // unequal rewards are in hand (the extra ones of the last batch dropped),
  // at most max_num_gen_batches batches; it then trains on the groups it has
  // and throws std::runtime_error when it has none.
  bool filter_groups = false;
  int64_t max_num_gen_batches = 10;  // --max-num-gen-batches (>= 1)
  AgentOptions agent;      // cmd non-empty: agentic rollouts (--agent-cmd)
  // The command's own options a resumed run must repeat ({"--reward": "exact"}),
  // saved with the trainer's (run_keys).
  nlohmann::json run_keys = nlohmann::json::object();
};

// Throws std::invalid_argument naming the flag.
void validate(const RlOptions& o);

class GrpoTrainer {
 public:
  // Applies the trainable groups to `model` and builds the optimizer (as
  // SftTrainer) and the Rollout (or, with options.agent.cmd, the
  // AgentRollout) over the same model. `reward` may be null only with agents
  // (then every agent must print its reward).
  GrpoTrainer(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::shared_ptr<const tok::Tokenizer> tokenizer,
              std::vector<PromptRow> rows, RlOptions options, std::unique_ptr<RewardFn> reward);

  int64_t steps_per_epoch() const;
  int64_t total_steps() const;
  bool done() const { return state_.step >= total_steps(); }
  const TrainerState& state() const { return state_; }
  const RlOptions& options() const { return options_; }
  AdamW& optimizer() { return *optimizer_; }
  Rollout& rollout() { return rollout_; }
  AgentRollout* agent_rollout() { return agent_.get(); }

  // One optimizer step (see the top).
  RlStepStats step();

  // save_path/step-N as SftTrainer::save_checkpoint writes it (weights,
  // optimizer, trainer_state.json with "algo", "run": run_keys() and
  // "rollout_runs": the rollouts done, whose count seeds the next one).
  std::filesystem::path save_checkpoint(const std::filesystem::path& save_path, const std::filesystem::path& source,
                                        const std::function<void(const std::filesystem::path&)>& add_files = {}) const;
  // Restores the optimizer, the data position and the rollout count from a
  // step folder save_checkpoint wrote (the caller loads the model's weights
  // from it), so the run continues as the uninterrupted one: the same prompts,
  // the same sampled completions (engine rollouts; agents are external
  // programs, see docs/rl.md). Refuses (std::runtime_error naming the flag) a
  // folder whose run_keys differ.
  void load_state(const std::filesystem::path& step_dir);
  // The options a resumed run must repeat: rollout_run_keys, --agent-cmd and
  // --train-tool-results, --filter-groups with --max-num-gen-batches, and
  // options.run_keys.
  nlohmann::json run_keys() const;

 private:
  // --filter-groups: batches of prompts from `pos` (advanced past each) rolled
  // out and scored until loop.batch_size varied groups are kept (see RlOptions);
  // fills st's gen_batches, filtered_groups and prompts_read.
  ScoredRollouts roll_varied(TrainerState& pos, RlStepStats& st);

  std::shared_ptr<phi4mm::Phi4MMForCausalLM> model_;
  std::shared_ptr<const tok::Tokenizer> tok_;
  std::vector<PromptRow> rows_;
  RlOptions options_;
  std::unique_ptr<RewardFn> reward_;
  std::unique_ptr<AdamW> optimizer_;
  Rollout rollout_;
  std::unique_ptr<AgentRollout> agent_;
  TrainerState state_;
};

}  // namespace areno::train::rl
