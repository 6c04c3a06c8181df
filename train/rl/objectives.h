#pragma once
// The RL objectives (issue 15, "Objectives"): GRPO, GSPO, DPO and PPO losses on
// the log-probabilities of sampled tokens, with the statistics a step logs.
// docs/rl.md writes out every formula as implemented here; the tests compare
// them with a direct PyTorch implementation (tests/reference/rl).
//
// Layout: per-token tensors are [N, T], N sequences (responses) padded to T
// tokens, with a [N, T] 0/1 `mask` (same float dtype) that is 1 on the tokens
// that train and 0 on padding and on masked context (tool results). Values at
// mask-0 positions never reach the loss or the gradient, whatever they are
// (inf and NaN included). Per-sequence tensors are [N].
//
// `logp` (and PPO's `values`) carry the autograd history; everything else
// (rollout log-probabilities `old_logp`, reference `ref_logp`, advantages,
// returns, rollout values) is data and gets no gradient. The loss is a scalar
// of logp's dtype; the statistics are host doubles, named as the issue names
// the step's metrics.
#include <cstdint>
#include <string>

#include "tensor/tensor.h"

namespace areno::train::rl {

// How per-token losses become one number.
//   token_mean:          sum over every response token in the batch / their count
//                        (each token weighs the same, whatever its sequence's
//                        length: verl's default, DAPO's argument)
//   seq_mean_token_mean: mean over sequences of each sequence's token mean (the
//                        GRPO and GSPO papers' 1/G sum_i 1/|o_i| sum_t)
//   seq_mean_token_sum_norm: sum over every response token / (N * L), L a
//                        constant (the generation budget): Dr. GRPO's
//                        unbiased normaliser (TRL's "dr_grpo", verl's
//                        seq-mean-token-sum-norm), no length bias either way
// Sequences without a response token are left out of the sequence mean.
enum class LossAgg { token_mean, seq_mean_token_mean, seq_mean_token_sum_norm };
// verl's names: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm";
// throws std::invalid_argument naming `flag` otherwise.
LossAgg parse_loss_agg(const std::string& name, const char* flag);
const char* loss_agg_name(LossAgg a);

// Per-token statistics of a policy objective, means over response tokens
// unless said otherwise.
struct PolicyStats {
  double pg_loss = 0;          // the clipped surrogate alone
  double ratio_mean = 0;       // mean ratio (GSPO: mean sequence ratio s_i over sequences)
  double clip_frac = 0;        // fraction of tokens (GSPO: sequences) whose term is clipped
  double clip_frac_lower = 0;  // PPO dual clip: fraction of tokens held at -A * clip_ratio_c
  double kl = 0;               // mean of old_logp - logp: how far the policy moved since the rollout
  double kl_loss = 0;          // low_var_kl to the reference (0 without one)
  double advantage_mean = 0;
};

struct PolicyLoss {
  Tensor loss;  // scalar, differentiable w.r.t. logp
  PolicyStats stats;
};

// ---- shared pieces ----

// [N, T] -> [N]: the summed log-probability of each sequence's response tokens.
Tensor sequence_logp(const Tensor& logp, const Tensor& mask);

// The k3 ("low_var_kl") estimate of KL(policy || reference) per token, clamped
// as verl does: d = clamp(ref_logp - logp, -20, 20); clamp(exp(d) - d - 1, -10, 10).
// [N, T]; differentiable w.r.t. logp; mask-0 positions are 0.
Tensor low_var_kl(const Tensor& logp, const Tensor& ref_logp, const Tensor& mask);

// ---- GRPO ----

// How group advantages are scaled (TRL's scale_rewards):
//   group: divided by the group's std (GRPO);
//   batch: divided by the std of the whole batch's rewards (TRL "batch");
//   none:  not divided (Dr. GRPO: the std's difficulty bias removed).
enum class RewardScale { group, batch, none };
// "group", "batch", "none"; throws std::invalid_argument naming `flag` otherwise.
RewardScale parse_reward_scale(const std::string& name, const char* flag);

// rewards [N] (N a multiple of group_size; the samples of one prompt are
// consecutive) -> advantages [N]: (r - mean_group) / (std_group + eps) with the
// unbiased std (divide by G - 1, torch.std's default, as verl and TRL), or the
// batch's std, or 1 (`scale`). A group whose rewards are all equal (a group
// of one included) gets advantages exactly 0: no signal, no NaN. Computed in
// f64, returned in rewards' dtype. Throws std::invalid_argument when N is not
// a multiple of group_size.
Tensor group_advantages(const Tensor& rewards, int64_t group_size, double eps = 1e-6,
                        RewardScale scale = RewardScale::group);
// The same over groups of the given sizes (consecutive, summing to N, each at
// least 1): the groups of a step whose failed agent runs were skipped
// (--skip-failed-agents). Throws std::invalid_argument otherwise.
Tensor group_advantages(const Tensor& rewards, const std::vector<int64_t>& group_sizes, double eps = 1e-6,
                        RewardScale scale = RewardScale::group);

// The outcome-advantage estimators of verl's algorithm.adv_estimator for
// --algo grpo|gspo (--adv-estimator): one value per sequence, which every
// response token of the sequence takes.
//   grpo: group_advantages with `scale`;
//   rloo: REINFORCE leave-one-out, r_i minus the mean of the group's other
//         rewards, = n / (n - 1) (r_i - mean); a group of one keeps r_i
//         (verl's rule);
//   reinforce_plus_plus: r whitened over the batch's response tokens (verl
//         with gamma 1: every token's return is its sequence's reward), each
//         sequence weighted by its token count: (r - mean) / sqrt(var +
//         1e-8), var unbiased over the tokens;
//   reinforce_plus_plus_baseline: r minus its group's mean (a group of one:
//         0 subtracted), then whitened over the tokens as above.
// A group whose rewards are all equal gets exactly 0 before whitening (rloo
// and the baseline), as in group_advantages. `tokens[i]`: sequence i's
// response tokens (its trainable tokens; at least 2 in all for the
// whitening, else the whitened advantages are 0). Computed in f64, returned
// in rewards' dtype; throws std::invalid_argument for groups that do not add
// up to N or a tokens vector of another length.
enum class AdvEstimator { grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline };
// Its verl name; parse_adv_estimator throws std::invalid_argument naming `flag` for another.
const char* adv_estimator_name(AdvEstimator e);
AdvEstimator parse_adv_estimator(const std::string& name, const char* flag);
Tensor outcome_advantages(AdvEstimator e, const Tensor& rewards, const std::vector<int64_t>& group_sizes,
                          const std::vector<int64_t>& tokens, double eps = 1e-6,
                          RewardScale scale = RewardScale::group);

struct GrpoOptions {
  double clip_eps = 0.2;        // --grpo-clip-eps (the lower bound's, and the upper's unless set)
  double clip_eps_high = -1;    // --grpo-clip-eps-high: DAPO's clip-higher; negative: clip_eps
  LossAgg agg = LossAgg::token_mean;  // --loss-agg-mode
  int64_t norm_length = 0;      // L of seq_mean_token_sum_norm (--max-new-tokens), required then
  double kl_coef = 0.0;         // weight of low_var_kl to ref_logp (needs ref_logp when > 0)
  double eps_high() const { return clip_eps_high < 0 ? clip_eps : clip_eps_high; }
};

// Token-level clipped surrogate with ratio = exp(clamp(logp - old_logp, -20, 20)):
//   loss_t = max(-A r_t, -A clip(r_t, 1 - eps, 1 + eps_high))   ( = -min(r A, clip(r) A) )
// aggregated by o.agg, plus kl_coef * low_var_kl aggregated alike when kl_coef > 0.
// advantages: [N] (one per sequence, from group_advantages).
PolicyLoss grpo_loss(const Tensor& logp, const Tensor& old_logp, const Tensor& advantages,
                     const Tensor& mask, const GrpoOptions& o = {}, const Tensor& ref_logp = Tensor());

// ---- GSPO ----

struct GspoOptions {
  double clip_eps = 3e-4;  // --gspo-clip-eps (the paper uses 3e-4 below and 4e-4 above)
};

// Sequence-level ratio of length-normalized log-probabilities,
//   s_i = exp(mean over i's response tokens of (logp - old_logp)),
//   J = mean_i max(-A_i s_i, -A_i clip(s_i, 1 - eps, 1 + eps)).
// Built in the paper's GSPO-token form: per token, s_it = sg[s_i] * exp(logp_t - sg[logp_t])
// has the value s_i and d s_it / d logp_t = s_i, and the token losses are
// averaged seq-mean-token-mean, so d J / d logp_t = -A_i s_i / (N |y_i|) when
// unclipped: exactly the gradient of the sequence formula. advantages: [N].
PolicyLoss gspo_loss(const Tensor& logp, const Tensor& old_logp, const Tensor& advantages,
                     const Tensor& mask, const GspoOptions& o = {});

// ---- DPO ----

// TRL's DPO loss types (loss_type), on z = (pc - rc) - (pr - rr) and x = beta z:
//   sigmoid: (1 - ls) nls(x) + ls nls(-x)           (ls > 0: cDPO, conservative labels)
//   robust:  ((1 - ls) nls(x) - ls nls(-x)) / (1 - 2 ls)   (Chowdhury et al. 2024)
//   hinge:   relu(1 - x)                              (SLiC)
//   ipo:     (z - 1 / (2 beta))^2                      (Azar et al. 2023; the caller
//            passes log-probabilities averaged over each response, as TRL)
// with nls(x) = -log sigmoid(x) and ls = label_smoothing.
enum class DpoLossType { sigmoid, robust, hinge, ipo };
// "sigmoid", "robust", "hinge", "ipo"; throws std::invalid_argument naming `flag` otherwise.
DpoLossType parse_dpo_loss_type(const std::string& name, const char* flag);
const char* dpo_loss_type_name(DpoLossType t);

struct DpoOptions {
  double beta = 0.1;  // --dpo-beta
  DpoLossType loss_type = DpoLossType::sigmoid;  // --dpo-loss-type
  double label_smoothing = 0;  // --dpo-label-smoothing: [0, 0.5), sigmoid and robust only
};

struct DpoStats {
  double loss = 0;
  double chosen_reward = 0;    // mean beta * (pc - rc)
  double rejected_reward = 0;  // mean beta * (pr - rr)
  double reward_margin = 0;    // mean of chosen minus rejected reward
  double reward_accuracy = 0;  // fraction of pairs with a positive margin
};

struct DpoLoss {
  Tensor loss;  // scalar, differentiable w.r.t. the policy's log-probabilities
  DpoStats stats;
};

// Summed (ipo: averaged) sequence log-probabilities [B] of the chosen and
// rejected responses under the policy (pc, pr) and the reference (rc, rr):
//   loss = mean_b of the loss type's term (sigmoid, ls = 0: -log sigmoid(beta z))
// with -log sigmoid(x) = max(-x, 0) + log(1 + exp(-|x|)) (no overflow) and its
// gradient sigmoid(x) - 1 written out. Rewards are beta (pc - rc) and beta (pr - rr).
DpoLoss dpo_loss(const Tensor& policy_chosen, const Tensor& policy_rejected, const Tensor& ref_chosen,
                 const Tensor& ref_rejected, const DpoOptions& o = {});

// ---- PPO ----

struct Gae {
  Tensor advantages;  // [N, T], whitened when asked; 0 at mask-0 positions
  Tensor returns;     // [N, T], advantages before whitening + values; 0 at mask-0 positions
};

// Generalized advantage estimation over each sequence's response tokens in
// order, skipping mask-0 positions (their reward and value are ignored, as
// verl does for observation tokens), with V = 0 after the last one:
//   delta_t = r_t + gamma V_next - V_t,  A_t = delta_t + gamma lam A_next,  R_t = A_t + V_t.
// whiten: A <- (A - mean) / sqrt(var + 1e-8) over the batch's response tokens
// (unbiased var; the mean is not added back), as verl's masked_whiten.
// Computed in f64 on the host (no gradient); returned in values' dtype.
Gae gae(const Tensor& token_rewards, const Tensor& values, const Tensor& mask, double gamma = 1.0,
        double lam = 1.0, bool whiten = true);

struct PpoOptions {
  double clip_eps = 0.2;         // --clip-eps
  double clip_ratio_c = 3.0;     // --clip-ratio-c (dual clip, verl's default); 0 turns it off
  double value_clip_eps = 0.5;   // --value-clip-eps (verl's cliprange_value)
  double value_loss_coef = 1.0;  // --value-loss-coef
  bool use_kl_loss = false;      // --use-kl-loss
  double kl_loss_coef = 0.001;   // --kl-loss-coef (kl loss type: low_var_kl)
};

struct PpoStats {
  PolicyStats policy;
  double vf_loss = 0;       // the value loss before value_loss_coef
  double vf_clip_frac = 0;  // fraction of tokens whose clipped value error is the larger
  double value_mean = 0;
  double return_mean = 0;
};

struct PpoLoss {
  Tensor loss;  // scalar: pg + kl_loss_coef * kl (when used) + value_loss_coef * vf
  PpoStats stats;
};

// All [N, T]; token_mean everywhere (verl's default).
//   policy: ratio as GRPO; l = max(-A r, -A clip(r, 1 - eps, 1 + eps)); for A < 0
//           the dual clip l <- min(l, -A c) bounds the loss of a far-too-likely token.
//   value:  vf = 0.5 * token_mean(max((v - R)^2, (clip(v, v_old - ve, v_old + ve) - R)^2))
//   kl:     token_mean(low_var_kl(logp, ref_logp)), when o.use_kl_loss (needs ref_logp)
// Differentiable w.r.t. logp and values.
PpoLoss ppo_loss(const Tensor& logp, const Tensor& old_logp, const Tensor& advantages,
                 const Tensor& mask, const Tensor& values, const Tensor& old_values,
                 const Tensor& returns, const PpoOptions& o = {}, const Tensor& ref_logp = Tensor());

// ---- KL penalty in the reward (verl's algorithm.use_kl_in_reward) ----

// verl's kl_penalty estimators of KL(policy || reference), per token, d = logp - ref_logp:
//   kl (k1): d;  abs: |d|;  mse (k2): d^2 / 2;  low_var_kl (k3): as low_var_kl above.
enum class KlPenalty { kl, abs, mse, low_var_kl };
// "kl" or "k1", "abs", "mse" or "k2", "low_var_kl" or "k3"; throws
// std::invalid_argument naming `flag` otherwise.
KlPenalty parse_kl_penalty(const std::string& name, const char* flag);
// [N, T]; mask-0 positions are 0.
Tensor kl_penalty(const Tensor& logp, const Tensor& ref_logp, const Tensor& mask, KlPenalty type);

// verl's KL coefficient controller: fixed, or adaptive (Ziegler et al. 2019)
// towards `target`: after a step over n sequences whose penalty averaged kl,
//   value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon.
struct KlController {
  double value = 0.001;  // --kl-coef at the start
  bool adaptive = false;  // --kl-ctrl adaptive
  double target = 0.1;    // --kl-target
  int64_t horizon = 10000;  // --kl-horizon
  void update(double kl, int64_t n);
};

struct KlShaped {
  Tensor rewards;  // [N, T]: token_rewards - beta * kl_penalty (0 penalty at mask-0 positions)
  double kl = 0;   // the penalty's mean: each sequence's token mean (0 without tokens), averaged over sequences
};
// verl's apply_kl_penalty (no gradient: logp is the pre-update policy's). All [N, T].
KlShaped apply_kl_penalty(const Tensor& token_rewards, const Tensor& logp, const Tensor& ref_logp,
                          const Tensor& mask, KlPenalty type, double beta);

}  // namespace areno::train::rl
