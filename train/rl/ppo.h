#pragma once
// The PPO loop (issue 15, "Objectives"; docs/rl.md, "The PPO loop"): rollouts
// and rewards as GRPO (rl_step.h), a critic, GAE over each response, and
// --ppo-epochs passes of the clipped policy and value losses (ppo_loss), with
// the SFT trainer's groups, schedules and checkpoints for the policy (train/sft.h)
// and a second AdamW for the critic.
//
// The critic is a ValueHead (value_head.h) on the final hidden states of
//   - the policy itself (default): the head reads the policy's training
//     forward, detached, so one forward gives both the log-probabilities and
//     the values, and the policy's gradient is the actor's alone (as with
//     verl's separate critic); the critic is the head's 1 + hidden_size numbers;
//   - or a separate model (--critic-ckpt): its own forward over the same
//     packed sequences, its trainable groups (the policy's --lm-trainable and
//     --unfreeze-mm-* choices) and the head training at --critic-lr.
//
// Rollouts come from the engine, or with options.agent.cmd from agent runs
// (AgentRollout, train/rl/agent.h, as GRPO's): an agent row's context tokens
// (tool results, later prompts) are masked out of the values, GAE and both
// losses (gae skips mask-0 positions, as verl's observation tokens), and the
// trajectory's outcome sits on the last trainable token of each of its rows
// (a trajectory split into rows by the row rule gives each row, an episode,
// the same outcome) and each turn reward the agent printed on the last token
// of its turn, in the row that holds the turn. With --train-tool-results the context trains too.
//
// One step:
//   1. the next loop.batch_size prompts, rollout.n_samples completions each,
//      rewards (roll_and_score);
//   2. without autograd, micro-batches of loop.mini_bs completions: the old
//      values (the critic before the update), the training forward's
//      log-probabilities (parity statistics) and, with --use-kl-loss, the
//      reference's log-probabilities;
//   3. token rewards (ppo_token_rewards): the outcome on the last trainable
//      token, an agent's turn rewards on their turns' last tokens, 0 elsewhere; with --use-kl-in-reward minus beta times the per-token KL
//      penalty of the training forward's log-probabilities to the reference's
//      (verl's apply_kl_penalty; beta from the fixed or adaptive controller,
//      updated after); gae(gamma, lam) over each response, advantages whitened
//      over the batch's response tokens (verl's masked_whiten);
//   4. ppo_epochs passes, each over mini-batches of ppo_mini_batch_size
//      prompts (their completions in order; 0: the whole batch): micro-batches
//      of ppo_loss (old_logp = the rollout's log-probabilities, as GRPO), each
//      weighted by its share of the mini-batch's response tokens, backward;
//      then per optimizer the gradient norm clipped (--grad-clip-norm) and one
//      AdamW step. The learning rates are those of the training step
//      (Optimizer::set_schedule_step: one scheduler step per update, as verl),
//      however many optimizer steps it takes. During the first
//      critic_warmup_steps steps the policy is not stepped (its forward runs
//      without autograd) and only the critic learns.
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
#include "train/rl/value_head.h"
#include "train/sft.h"

namespace areno::train::rl {

struct PpoTrainOptions {
  // The SFT loop's options: batch_size = prompts per step, mini_bs =
  // completions per micro-batch, lr (the policy's), schedules, groups,
  // clipping (each optimizer on its own), seed, epochs, max_steps.
  SftOptions loop;
  RolloutOptions rollout;  // n_samples: default 1 (PPO needs no group)
  AgentOptions agent;      // cmd non-empty: agentic rollouts (--agent-cmd)
  PpoOptions ppo;          // clip_eps, clip_ratio_c, value_clip_eps, value_loss_coef, use_kl_loss, kl_loss_coef
  double gamma = 1.0;      // --gamma
  double lam = 1.0;        // --lam
  int64_t ppo_epochs = 1;  // --ppo-epochs: passes over the batch per step
  int64_t ppo_mini_batch_size = 0;  // --ppo-mini-batch-size: prompts per optimizer step in a pass (0: the batch)
  bool use_kl_in_reward = false;    // --use-kl-in-reward (needs the reference model)
  KlPenalty kl_penalty = KlPenalty::kl;  // --kl-penalty
  KlController kl_ctrl;             // --kl-coef, --kl-ctrl, --kl-target, --kl-horizon
  double critic_lr = 0;    // --critic-lr, 0: loop.lr
  int64_t critic_warmup_steps = 0;  // --critic-warmup-steps
  // The command's own options a resumed run must repeat ({"--reward": "exact"}),
  // saved with the trainer's (run_keys).
  nlohmann::json run_keys = nlohmann::json::object();
  PpoTrainOptions() { rollout.n_samples = 1; }
};

// Throws std::invalid_argument naming the flag.
void validate(const PpoTrainOptions& o);

struct PpoStepStats {
  RlStepStats rl;  // as GRPO's; lrs has "critic" last; loss/pg_loss/ratio/clip/kl averaged over the passes
  double vf_loss = 0;       // value loss before --value-loss-coef
  double vf_clip_frac = 0;
  double value_mean = 0;    // token mean of the critic's values in the passes
  double returns_mean = 0;  // token mean of the GAE returns
  double kl_loss = 0;       // low_var_kl to the reference (--use-kl-loss), else 0
  double clip_frac_lower = 0;  // tokens held by the dual clip
  double critic_grad_norm = 0;  // before clipping, mean over the passes
  bool policy_stepped = true;   // false during critic warm-up
  int64_t updates = 0;          // optimizer steps per optimizer: passes x mini-batches
  bool kl_in_reward = false;           // --use-kl-in-reward
  double reward_kl_penalty = 0;        // its penalty's mean (verl's actor/reward_kl_penalty)
  double reward_kl_penalty_coeff = 0;  // the beta it was applied with
};

// Step 3's token rewards of r's rows before any KL penalty, [N, T] row-major
// (T at least every row's length), and the mask of their trainable tokens:
// each row's trajectory outcome (ScoredRollouts::outcomes) on its last
// trainable token, and each turn reward an agent printed on its turn's last
// token (RolloutSample::turn_rewards), moved to the nearest trainable token at
// or before it, else the row's first trainable token after it; rewards on
// one token add. A row with no trainable token gets none.
struct TokenRewards {
  std::vector<float> rewards, mask;
};
TokenRewards ppo_token_rewards(const ScoredRollouts& r, int64_t T);

// rl_scalars plus vf_loss, vf_clip_frac, value_mean, returns_mean, kl_loss,
// clip_frac_lower, critic_grad_norm, policy_stepped, updates, and with
// --use-kl-in-reward reward_kl_penalty and reward_kl_penalty_coeff.
Scalars ppo_scalars(const PpoStepStats& st);
// format_rl_progress with "vf_loss … vf_clip … value … returns …" (and "critic warm-up").
std::string format_ppo_progress(const PpoStepStats& st, int64_t total_steps);

class PpoTrainer {
 public:
  // Applies the trainable groups to `model` (and `critic`) and builds the two
  // optimizers and the Rollout over `model`. `critic`: a separate critic
  // model (nullptr: the value head reads the policy). `reference`: the frozen
  // model of the KL loss, required when options.ppo.use_kl_loss (and used only then).
  PpoTrainer(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::shared_ptr<const tok::Tokenizer> tokenizer,
             std::vector<PromptRow> rows, PpoTrainOptions options, std::unique_ptr<RewardFn> reward,
             std::shared_ptr<phi4mm::Phi4MMForCausalLM> critic = nullptr,
             std::shared_ptr<const phi4mm::Phi4MMForCausalLM> reference = nullptr);

  int64_t steps_per_epoch() const;
  int64_t total_steps() const;
  bool done() const { return state_.step >= total_steps(); }
  const TrainerState& state() const { return state_; }
  const PpoTrainOptions& options() const { return options_; }
  const KlController& kl_controller() const { return kl_ctrl_; }
  AdamW& optimizer() { return *optimizer_; }
  AdamW& critic_optimizer() { return *critic_optimizer_; }
  ValueHead& value_head() { return *head_; }
  Rollout& rollout() { return rollout_; }
  // The agent rollout (options.agent.cmd), else null.
  AgentRollout* agent_rollout() { return agent_.get(); }

  // One step (see the top).
  PpoStepStats step();

  // save_path/step-N as SftTrainer::save_checkpoint writes it for the policy
  // (trainer_state.json with "algo": "ppo"), plus value_head.safetensors in
  // the step folder (value head on the policy) or a critic/ folder with the
  // critic model and its value_head.safetensors (--critic-ckpt), and the
  // critic's optimizer state in optimizer/critic_optimizer.safetensors;
  // trainer_state.json has "run": run_keys() and "rollout_runs" (as GRPO's).
  std::filesystem::path save_checkpoint(const std::filesystem::path& save_path, const std::filesystem::path& source,
                                        const std::function<void(const std::filesystem::path&)>& add_files = {}) const;
  // Restores both optimizers, the value head, the data position (and with it
  // the critic warm-up, which counts steps), the adaptive KL coefficient and the rollout count from a step
  // folder save_checkpoint wrote. The caller loads the policy's weights from
  // the folder and a separate critic's from its critic/ (then passes it to
  // the constructor), and the --use-kl-loss reference from the run's starting
  // checkpoint. Refuses (std::runtime_error naming the flag) a folder whose
  // run_keys differ.
  void load_state(const std::filesystem::path& step_dir);
  // The options a resumed run must repeat: rollout_run_keys, --critic-ckpt
  // (whether there is a separate critic), --critic-warmup-steps, --use-kl-loss,
  // --use-kl-in-reward, --ppo-mini-batch-size,
  // --agent-cmd and --train-tool-results (when agents run), and options.run_keys.
  nlohmann::json run_keys() const;

 private:
  std::shared_ptr<phi4mm::Phi4MMForCausalLM> model_, critic_;
  std::shared_ptr<const phi4mm::Phi4MMForCausalLM> reference_;
  std::shared_ptr<const tok::Tokenizer> tok_;
  std::vector<PromptRow> rows_;
  PpoTrainOptions options_;
  std::unique_ptr<RewardFn> reward_;
  std::unique_ptr<AdamW> optimizer_, critic_optimizer_;
  std::shared_ptr<ValueHead> head_;
  Rollout rollout_;
  std::unique_ptr<AgentRollout> agent_;
  TrainerState state_;
  KlController kl_ctrl_;  // options_.kl_ctrl, its value adapted step by step
};

}  // namespace areno::train::rl
