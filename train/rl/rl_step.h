#pragma once
// The pieces of an RL step that the rollout trainers share (GRPO/GSPO in
// grpo.h, PPO in ppo.h): the step's prompts, their rollouts (a RolloutBatch
// from the engine or, for GRPO/GSPO with --agent-cmd, from agents) and
// rewards, the micro-batches of the training forward, the rollout/training
// log-prob parity statistics, and the step's metrics.
//
// Rows and trajectories: a trajectory (one completion, or one agent run) has
// one reward and gives one training row, or several when an agent's turns
// split (agent.h's row rule); each row takes its trajectory's reward and
// advantage. A row's tokens may be context (RolloutSample::trainable 0): fed
// to the training forward, not scored, not counted. A trainable token without
// a rollout log-probability (NaN: an agent's context under
// --train-tool-results) takes the training forward's own as its old one.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/tokenizer.h"
#include "train/dataset.h"
#include "train/metrics.h"
#include "train/rl/policy_logp.h"
#include "train/rl/rewards.h"
#include "train/rl/rollout.h"
#include "train/sft.h"

namespace areno::train::rl {

class AgentRollout;  // agent.h
struct AgentOptions;

struct RlStepStats {
  int64_t step = 0;
  int64_t prompts = 0, samples = 0, response_tokens = 0;  // samples: training rows; tokens: trainable ones
  int64_t trajectories = 0;          // batch x n_samples (fewer when failed agent runs were skipped)
  int64_t split_rows = 0;            // agent rows beyond one per trajectory (agent.h's row rule)
  std::vector<std::string> agent_failures;  // agent runs skipped (--skip-failed-agents): why, one each
  double reward_mean = 0;
  double advantage_mean = 0;         // token mean
  double response_len = 0;           // mean trainable tokens per row (stop token included)
  double rollout_logprobs_mean = 0;  // token mean of the engine's log-probabilities (trainable tokens that have one)
  double train_logprobs_mean = 0;    // token mean of policy_logp, before the update
  double logp_diff_mean = 0;         // token mean of train - rollout
  double logp_abs_diff_mean = 0;     // token mean of |train - rollout|
  double logp_abs_diff_max = 0;
  double ratio_mean = 0, clip_frac = 0, kl = 0;
  double loss = 0, pg_loss = 0;
  double grad_norm = 0;              // before clipping
  std::vector<std::pair<std::string, double>> lrs;
  double rollout_s = 0, reward_s = 0, train_s = 0, total_s = 0;
  std::vector<double> rewards;       // per trajectory, prompt-major
  // --filter-groups (DAPO's dynamic sampling): the batches of prompts rolled
  // out for the step (0: off), the groups dropped for equal rewards, and the
  // prompts read (prompts counts those trained on).
  int64_t gen_batches = 0, filtered_groups = 0, prompts_read = 0;
};

// The step's scalars for MetricsWriter, named as issue 15 names them
// (reward_mean, ..., loss, grad_norm, lr/<group>, time/rollout_s, ...).
Scalars rl_scalars(const RlStepStats& st);

// "step 3/10  reward 0.750  loss -0.0123  ...  grad_norm 0.41  time rollout=1.2s train=0.8s total=2.1s";
// `extra` (e.g. PPO's value statistics) goes before the learning rates.
std::string format_rl_progress(const RlStepStats& st, int64_t total_steps, const std::string& extra = {});

// The checks every rollout trainer makes of its loop options: SFT's, with
// --mini-bs counted in completions (1 .. batch_size x n_samples) and
// --embed-rows data refused for `algo`. Throws std::invalid_argument naming the flag.
void validate_rl_loop(const SftOptions& loop, int64_t n_samples, const std::string& algo);

// `r` with its seed set to the loop's (the rollout's sampling follows --seed).
RolloutOptions seeded_rollout(RolloutOptions r, uint64_t seed);

// What GRPO/GSPO and PPO share about agent runs (--agent-cmd):
//   - the AgentRollout over `model` (null when agent.cmd is empty), seeded as
//     the trainer's engine rollouts;
//   - the run keys a resumed run must repeat (--agent-cmd, --train-tool-results);
//   - the rollout count saved as trainer_state.json's "rollout_runs" (the
//     agent's when one runs, else the engine rollout's), and its restore.
std::unique_ptr<AgentRollout> make_agent_rollout(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model,
                                                 std::shared_ptr<const tok::Tokenizer> tokenizer,
                                                 const RolloutOptions& rollout, uint64_t seed,
                                                 const AgentOptions& agent);
nlohmann::json agent_run_keys(const AgentOptions& agent);
int64_t rollout_runs(const Rollout& rollout, const AgentRollout* agent);
void set_rollout_runs(Rollout& rollout, AgentRollout* agent, int64_t runs);

// The policy_logp options of micro-batch `micro` in the step after `step`
// optimizer steps: the loop's chunking and checkpointing, a dropout seed
// from (seed, step, micro).
PolicyLogpOptions step_logp_options(const SftOptions& loop, int64_t step, int64_t micro);

// The options a resumed grpo/gspo/ppo run must repeat (trainer_state.json's
// "run"): loop_run_keys with the prompts' fingerprint (each row's ids,
// adapter and fields as read, which the reward sees) and the rollout's
// sampling: --n-samples, --temperature, --top-k, --top-p, --greedy,
// --max-new-tokens, --max-context-len.
nlohmann::json rollout_run_keys(const std::vector<PromptRow>& rows, const SftOptions& loop, const RolloutOptions& r,
                                const std::string& algo);

// load_step_state for a grpo/gspo/ppo run resuming from `step_dir`: refuses
// a folder whose "run" differs from `keys` (check_run_keys) or has no
// "rollout_runs" (the rollouts done: their count seeds the next one's
// sampling), which it stores in `rollout_runs`.
SavedState load_rollout_state(const std::filesystem::path& step_dir, const nlohmann::json& keys, int64_t rows,
                              AdamW& optimizer, int64_t& rollout_runs);

// Whether token t of `s` is trained on (its `trainable` mask; empty: all).
inline bool is_trainable(const RolloutSample& s, size_t t) { return s.trainable.empty() || s.trainable[t] != 0; }
// The trainable tokens of `s`.
int64_t trainable_tokens(const RolloutSample& s);

// A step's prompts rolled out and scored: the RolloutBatch (samples are the
// training rows, trajectories task-major, n_samples per task) and per
// trajectory its reward.
struct ScoredRollouts : RolloutBatch {
  std::vector<const PromptRow*> rows;   // the step's prompt rows (Trajectory::task indexes them)
  std::vector<double> rewards;          // one per trajectory: its outcome plus its turn rewards
  std::vector<double> outcomes;         // one per trajectory: the printed or scored reward alone
  std::vector<int64_t> group_sizes;     // trajectories per task that has any, in order (n_samples each
                                        // unless failed agent runs were skipped)
  std::vector<std::string> agent_failures;  // agent runs skipped (--skip-failed-agents): why, one each
  int64_t tokens = 0;                   // trainable tokens of all samples
  double rollout_s = 0, reward_s = 0;
};

// 1. the next loop.batch_size rows of the epoch's order (state does not
// advance); 2. rollout.options().n_samples trajectories each, from `agent`
// when given (its rows carry trainable masks), else from the engine
// (`rollout`; one row per completion; its KV blocks are free afterwards);
// 3. each trajectory's outcome: the agent's printed reward, else its final
// text (special tokens skipped) scored by `reward`, else 0 when the agent
// printed turn rewards; its reward: the outcome plus its turn rewards (the
// return with gamma 1, which GRPO/GSPO normalise per group; PPO places the
// parts on their tokens, ppo_token_rewards). Throws std::invalid_argument
// when a trajectory has neither and `reward` is null, std::logic_error when
// the source or the reward gives a wrong number of trajectories or scores.
ScoredRollouts roll_and_score(const std::vector<PromptRow>& rows, const TrainerState& state, const SftOptions& loop,
                              Rollout& rollout, AgentRollout* agent, RewardFn* reward,
                              const tok::Tokenizer& tokenizer);

// The groups of `r` (in order, as group_sizes counts them) whose rewards
// are not all equal, and groups of one trajectory: DAPO's dynamic sampling
// (verl's filter_groups) keeps these; a group whose samples all scored alike
// has zero advantages and teaches nothing.
std::vector<int64_t> varied_groups(const ScoredRollouts& r);

// Appends the groups `groups` of `from` (indices as varied_groups gives
// them, ascending) to `into`, at most until `into` holds `limit` groups: their
// prompt rows, prompts, samples, trajectories (re-indexed), rewards, outcomes and group
// sizes; the trainable tokens, timings and skipped agent runs add up.
void append_groups(ScoredRollouts& into, const ScoredRollouts& from, const std::vector<int64_t>& groups,
                   int64_t limit);

// Per-trajectory values (rewards, advantages) copied to each trajectory's rows.
std::vector<double> per_row(const ScoredRollouts& r, const std::vector<double>& per_trajectory);

// Samples [b, e) as one training forward: only the prompts they use
// (policy_logp runs each prompt's towers), their sequences with their
// trainable masks, their trainable tokens.
struct MicroBatch {
  std::vector<Prompt> prompts;
  std::vector<Sequence> seqs;
  int64_t tokens = 0;
};
MicroBatch micro_batch(const ScoredRollouts& r, int64_t b, int64_t e);

// The old log-probabilities of samples [b, b + n) in the [n, T] layout of
// `train_logp` (the training forward's, [n, T]): the rollout's, and
// train_logp's own (as data, ratio 1) where a token has none (NaN); 0 after each end.
Tensor rollout_logp(const ScoredRollouts& r, int64_t b, const Tensor& train_logp);

// Host sums of the rollout's and the training forward's log-probabilities of
// the same tokens: the trainable tokens that have a rollout log-probability.
struct LogpParity {
  double rollout_sum = 0, train_sum = 0, diff_sum = 0, abs_sum = 0, abs_max = 0, tokens = 0;
  // logp: [n, T], the training forward's log-probabilities of samples [b, b + n).
  void add(const Tensor& logp, const ScoredRollouts& r, int64_t b, int64_t n);
  // Sets rollout_logprobs_mean, train_logprobs_mean, logp_diff_mean, logp_abs_diff_mean/max.
  void finish(RlStepStats& st) const;
};

// Fills prompts, samples, trajectories, split_rows, response_tokens, rewards,
// reward_mean (over trajectories), response_len (over rows), rollout_s and
// reward_s of `st` from `r`.
void record_rollouts(const ScoredRollouts& r, RlStepStats& st);

}  // namespace areno::train::rl
