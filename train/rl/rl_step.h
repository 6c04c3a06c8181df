#pragma once
// The pieces of an RL step that the rollout trainers share (GRPO/GSPO in
// grpo.h, PPO in ppo.h): the step's prompts, their rollouts and rewards, the
// micro-batches of the training forward, the rollout/training log-prob
// parity statistics, and the step's metrics.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "models/phi4mm/tokenizer/tokenizer.h"
#include "train/dataset.h"
#include "train/metrics.h"
#include "train/rl/policy_logp.h"
#include "train/rl/rewards.h"
#include "train/rl/rollout.h"
#include "train/sft.h"

namespace areno::train::rl {

struct RlStepStats {
  int64_t step = 0;
  int64_t prompts = 0, samples = 0, response_tokens = 0;
  double reward_mean = 0;
  double advantage_mean = 0;         // token mean
  double response_len = 0;           // mean tokens per completion (stop token included)
  double rollout_logprobs_mean = 0;  // token mean of the engine's log-probabilities
  double train_logprobs_mean = 0;    // token mean of policy_logp, before the update
  double logp_diff_mean = 0;         // token mean of train - rollout
  double logp_abs_diff_mean = 0;     // token mean of |train - rollout|
  double logp_abs_diff_max = 0;
  double ratio_mean = 0, clip_frac = 0, kl = 0;
  double loss = 0, pg_loss = 0;
  double grad_norm = 0;              // before clipping
  std::vector<std::pair<std::string, double>> lrs;
  double rollout_s = 0, reward_s = 0, train_s = 0, total_s = 0;
  std::vector<double> rewards;       // per sample, prompt-major
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

// The policy_logp options of micro-batch `micro` in the step after `step`
// optimizer steps: the loop's chunking and checkpointing, a dropout seed
// from (seed, step, micro).
PolicyLogpOptions step_logp_options(const SftOptions& loop, int64_t step, int64_t micro);

// A step's prompts rolled out and scored.
struct ScoredRollouts {
  std::vector<const PromptRow*> rows;   // the step's prompt rows
  std::vector<Prompt> prompts;          // rows as the model sees them
  std::vector<RolloutSample> samples;   // prompt-major, n_samples each
  std::vector<double> rewards;          // one per sample
  int64_t tokens = 0;                   // response tokens of all samples
  double rollout_s = 0, reward_s = 0;
};

// 1. the next loop.batch_size rows of the epoch's order (state does not
// advance); 2. rollouts (the engine's KV blocks are free afterwards); 3. each
// completion decoded (special tokens skipped) and scored by `reward`. Throws
// std::logic_error when the reward gives a wrong number of scores.
ScoredRollouts roll_and_score(const std::vector<PromptRow>& rows, const TrainerState& state, const SftOptions& loop,
                              Rollout& rollout, RewardFn& reward, const tok::Tokenizer& tokenizer);

// Samples [b, e) as one training forward: only the prompts they use
// (policy_logp runs each prompt's towers), their sequences, their tokens.
struct MicroBatch {
  std::vector<Prompt> prompts;
  std::vector<Sequence> seqs;
  int64_t tokens = 0;
};
MicroBatch micro_batch(const ScoredRollouts& r, int64_t b, int64_t e);

// Samples [b, b + n)'s rollout log-probabilities padded to [n, T] (0 after each end).
Tensor rollout_logp(const ScoredRollouts& r, int64_t b, int64_t n, int64_t T, Device device);

// Host sums of the rollout's and the training forward's log-probabilities of the same tokens.
struct LogpParity {
  double rollout_sum = 0, train_sum = 0, diff_sum = 0, abs_sum = 0, abs_max = 0, tokens = 0;
  // logp: [n, T], the training forward's log-probabilities of samples [b, b + n).
  void add(const Tensor& logp, const ScoredRollouts& r, int64_t b, int64_t n);
  // Sets rollout_logprobs_mean, train_logprobs_mean, logp_diff_mean, logp_abs_diff_mean/max.
  void finish(RlStepStats& st) const;
};

// Fills prompts, samples, response_tokens, rewards, reward_mean, response_len,
// rollout_s and reward_s of `st` from `r`.
void record_rollouts(const ScoredRollouts& r, RlStepStats& st);

}  // namespace areno::train::rl
