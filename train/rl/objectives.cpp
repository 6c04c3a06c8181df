#include "train/rl/objectives.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace areno::train::rl {

namespace {

// The response mask of a [N, T] batch, as the ops and the host need it.
struct Mask {
  Tensor f;     // [N, T] 0/1 in logp's dtype
  Tensor keep;  // [N, T] bool
  std::vector<double> lens;  // response tokens per sequence
  double tokens = 0;
  double sequences = 0;      // sequences with at least one response token
  int64_t N = 0, T = 0;
};

std::vector<double> host_f64(const Tensor& t) {
  return t.detach().to(Device::cpu(), DType::f64).contiguous().to_vector<double>();
}

void check_tokens(const Tensor& t, int64_t N, int64_t T, const char* what, const char* name) {
  if (!t.defined() || t.dim() != 2 || t.size(0) != N || t.size(1) != T || !is_floating(t.dtype()))
    throw std::invalid_argument(fmt::format("{}: {} must be a [{}, {}] float tensor, got {}", what, name, N, T,
                                            t.defined() ? t.str() : "none"));
}

void check_sequences(const Tensor& t, int64_t N, const char* what, const char* name) {
  if (!t.defined() || t.dim() != 1 || t.size(0) != N || !is_floating(t.dtype()))
    throw std::invalid_argument(fmt::format("{}: {} must be a [{}] float tensor, got {}", what, name, N,
                                            t.defined() ? t.str() : "none"));
}

Mask read_mask(const Tensor& mask, const Tensor& logp, const char* what) {
  if (!logp.defined() || logp.dim() != 2 || !is_floating(logp.dtype()))
    throw std::invalid_argument(fmt::format("{}: logp must be a [N, T] float tensor, got {}", what,
                                            logp.defined() ? logp.str() : "none"));
  Mask m;
  m.N = logp.size(0);
  m.T = logp.size(1);
  check_tokens(mask, m.N, m.T, what, "mask");
  const std::vector<double> v = host_f64(mask);
  m.lens.assign(size_t(m.N), 0.0);
  for (int64_t i = 0; i < m.N; ++i)
    for (int64_t t = 0; t < m.T; ++t) {
      const double x = v[size_t(i * m.T + t)];
      if (x != 0.0 && x != 1.0)
        throw std::invalid_argument(fmt::format("{}: mask[{}, {}] is {}; a mask holds 0 or 1", what, i, t, x));
      m.lens[size_t(i)] += x;
    }
  for (double l : m.lens) {
    m.tokens += l;
    m.sequences += l > 0;
  }
  m.keep = ne(mask, zeros_like(mask));
  m.f = m.keep.to(logp.dtype());
  return m;
}

// x where the mask is 1, else 0: what a masked position holds (padding
// garbage, inf, NaN) never reaches an op whose value or gradient is kept.
Tensor masked(const Tensor& x, const Mask& m) { return where(m.keep, x, zeros_like(x)); }

Tensor token_mean(const Tensor& x, const Mask& m) {
  return mul(sum(mul(x, m.f)), 1.0 / std::max(m.tokens, 1.0));
}

Tensor seq_mean_token_mean(const Tensor& x, const Mask& m) {
  // Each sequence's token sum weighted by 1 / (|y_i| * sequences); 0 for an
  // empty sequence.
  std::vector<double> w(size_t(m.N), 0.0);
  for (size_t i = 0; i < w.size(); ++i)
    if (m.lens[i] > 0) w[i] = 1.0 / (m.lens[i] * m.sequences);
  Tensor wt = from_vector(w, {m.N}, TensorOptions(x.dtype(), x.device()));
  return sum(mul(sum(mul(x, m.f), {1}), wt));
}

Tensor aggregate(const Tensor& x, const Mask& m, LossAgg agg, int64_t norm_length = 0) {
  switch (agg) {
    case LossAgg::token_mean: return token_mean(x, m);
    case LossAgg::seq_mean_token_mean: return seq_mean_token_mean(x, m);
    default:
      if (norm_length < 1)
        throw std::invalid_argument("seq-mean-token-sum-norm: needs the constant length L (--max-new-tokens)");
      return mul(sum(mul(x, m.f)), 1.0 / (double(std::max<int64_t>(m.N, 1)) * double(norm_length)));
  }
}

double mean_of(const Tensor& x, const Mask& m) {
  NoGradGuard ng;
  return token_mean(x.detach().to(m.f.dtype()), m).item();
}

// clamp(x, lo, hi) whose gradient is 0 on the bounds themselves, as torch's
// clamp (ours passes it there): the objectives are checked against torch,
// and a ratio can sit exactly on a bound.
Tensor clip(const Tensor& x, double lo, double hi) {
  Tensor inside;
  {
    NoGradGuard ng;
    inside = logical_and(gt(x, full_like(x, lo)), lt(x, full_like(x, hi)));
  }
  return where(inside, x, clamp(x.detach(), lo, hi));
}

// The clipped surrogate per token, from the log-ratio (whose gradient is the
// caller's business) and the advantages, [N, T]:
//   l = max(-A r, -A clip(r, 1 - eps, 1 + eps)), and with c > 0, for A < 0,
//   l <- min(l, -A c) (dual clip).
// At r exactly on 1 +- eps the two terms tie: the tie splits the gradient
// evenly, and the clipped term has none there (see clip), so such a token gets
// half its unclipped gradient, the mean of the two one-sided derivatives, as
// torch gives; it does not count as clipped.
struct Surrogate {
  Tensor loss, ratio;
  Tensor clipped;        // bool: the clipped term is the larger
  Tensor clipped_lower;  // bool: held at -A c (dual clip only)
};

Surrogate clipped_surrogate(const Tensor& log_ratio, const Tensor& adv, double eps, double c, double eps_high = -1) {
  Surrogate s;
  s.ratio = exp(log_ratio);
  Tensor l1 = neg(mul(adv, s.ratio));
  Tensor l2 = neg(mul(adv, clip(s.ratio, 1.0 - eps, 1.0 + (eps_high < 0 ? eps : eps_high))));
  s.loss = maximum(l1, l2);
  {
    NoGradGuard ng;
    s.clipped = gt(l2, l1);
  }
  if (c > 0) {
    Tensor l3 = neg(mul(adv, c));
    Tensor negative = lt(adv, zeros_like(adv));
    {
      NoGradGuard ng;
      s.clipped_lower = logical_and(gt(s.loss, l3), negative);
    }
    s.loss = where(negative, minimum(s.loss, l3), s.loss);
  }
  return s;
}

Tensor log_ratio_of(const Tensor& lp, const Tensor& old) { return clip(sub(lp, old), -20.0, 20.0); }

Tensor per_token(const Tensor& seq, const Mask& m) { return seq.unsqueeze(1).expand({m.N, m.T}); }

}  // namespace

LossAgg parse_loss_agg(const std::string& name, const char* flag) {
  for (LossAgg a : {LossAgg::token_mean, LossAgg::seq_mean_token_mean, LossAgg::seq_mean_token_sum_norm})
    if (name == loss_agg_name(a)) return a;
  throw std::invalid_argument(fmt::format(
      "{}: '{}' is not a loss aggregation (token-mean, seq-mean-token-mean, seq-mean-token-sum-norm)", flag, name));
}

const char* loss_agg_name(LossAgg a) {
  switch (a) {
    case LossAgg::token_mean: return "token-mean";
    case LossAgg::seq_mean_token_mean: return "seq-mean-token-mean";
    default: return "seq-mean-token-sum-norm";
  }
}

RewardScale parse_reward_scale(const std::string& name, const char* flag) {
  if (name == "group") return RewardScale::group;
  if (name == "batch") return RewardScale::batch;
  if (name == "none") return RewardScale::none;
  throw std::invalid_argument(fmt::format("{}: '{}' is not a reward scaling (group, batch, none)", flag, name));
}

Tensor sequence_logp(const Tensor& logp, const Tensor& mask) {
  const Mask m = read_mask(mask, logp, "sequence_logp");
  return sum(mul(masked(logp, m), m.f), {1});
}

Tensor low_var_kl(const Tensor& logp, const Tensor& ref_logp, const Tensor& mask) {
  const Mask m = read_mask(mask, logp, "low_var_kl");
  check_tokens(ref_logp, m.N, m.T, "low_var_kl", "ref_logp");
  Tensor d = clip(sub(masked(ref_logp, m), masked(logp, m)), -20.0, 20.0);
  Tensor k = clip(add(sub(exp(d), d), -1.0), -10.0, 10.0);
  return mul(k, m.f);
}

// ---------------------------------------------------------------- GRPO

Tensor group_advantages(const Tensor& rewards, int64_t group_size, double eps, RewardScale scale) {
  if (!rewards.defined() || rewards.dim() != 1 || !is_floating(rewards.dtype()))
    throw std::invalid_argument("group_advantages: rewards must be a [N] float tensor");
  const int64_t N = rewards.size(0);
  if (group_size < 1 || N % group_size != 0)
    throw std::invalid_argument(fmt::format(
        "group_advantages: {} rewards do not make groups of {} (--n-samples); N must be a multiple", N, group_size));
  return group_advantages(rewards, std::vector<int64_t>(size_t(N / group_size), group_size), eps, scale);
}

namespace {

// rewards [N] on the host in f64, after checking that `group_sizes` (each at
// least 1) add up to N; errors name `op`.
std::vector<double> grouped_rewards(const Tensor& rewards, const std::vector<int64_t>& group_sizes, const char* op) {
  if (!rewards.defined() || rewards.dim() != 1 || !is_floating(rewards.dtype()))
    throw std::invalid_argument(fmt::format("{}: rewards must be a [N] float tensor", op));
  const int64_t N = rewards.size(0);
  int64_t total = 0;
  for (int64_t g : group_sizes) {
    if (g < 1) throw std::invalid_argument(fmt::format("{}: a group of {} rewards", op, g));
    total += g;
  }
  if (total != N)
    throw std::invalid_argument(fmt::format("{}: groups of {} rewards in all for {} rewards", op, total, N));
  return host_f64(rewards);
}

}  // namespace

Tensor group_advantages(const Tensor& rewards, const std::vector<int64_t>& group_sizes, double eps,
                        RewardScale scale) {
  const std::vector<double> r = grouped_rewards(rewards, group_sizes, "group_advantages");
  const int64_t N = int64_t(r.size());
  std::vector<double> a(r.size(), 0.0);
  double batch_std = 0;  // unbiased, over every reward (TRL's "batch")
  if (scale == RewardScale::batch && N > 1) {
    double mean = 0, ss = 0;
    for (double x : r) mean += x;
    mean /= double(N);
    for (double x : r) ss += (x - mean) * (x - mean);
    batch_std = std::sqrt(ss / double(N - 1));
  }
  int64_t g0 = 0;
  for (int64_t group_size : group_sizes) {
    const auto first = r.begin() + g0, last = first + group_size;
    const auto [lo, hi] = std::minmax_element(first, last);
    if (*lo != *hi) {  // all equal (or a group of one): no signal
      double mean = 0;
      for (auto it = first; it != last; ++it) mean += *it;
      mean /= double(group_size);
      double ss = 0;
      for (auto it = first; it != last; ++it) ss += (*it - mean) * (*it - mean);
      const double std = std::sqrt(ss / double(group_size - 1));
      const double div = scale == RewardScale::group ? std + eps : scale == RewardScale::batch ? batch_std + eps : 1.0;
      for (int64_t j = g0; j < g0 + group_size; ++j) a[size_t(j)] = (r[size_t(j)] - mean) / div;
    }
    g0 += group_size;
  }
  return from_vector(a, {N}, TensorOptions(rewards.dtype(), rewards.device()));
}

const char* adv_estimator_name(AdvEstimator e) {
  switch (e) {
    case AdvEstimator::grpo: return "grpo";
    case AdvEstimator::rloo: return "rloo";
    case AdvEstimator::reinforce_plus_plus: return "reinforce_plus_plus";
    case AdvEstimator::reinforce_plus_plus_baseline: return "reinforce_plus_plus_baseline";
  }
  return "?";
}

AdvEstimator parse_adv_estimator(const std::string& name, const char* flag) {
  for (AdvEstimator e : {AdvEstimator::grpo, AdvEstimator::rloo, AdvEstimator::reinforce_plus_plus,
                         AdvEstimator::reinforce_plus_plus_baseline})
    if (name == adv_estimator_name(e)) return e;
  throw std::invalid_argument(fmt::format(
      "{}: '{}' is not an advantage estimator (grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline)", flag,
      name));
}

Tensor outcome_advantages(AdvEstimator e, const Tensor& rewards, const std::vector<int64_t>& group_sizes,
                          const std::vector<int64_t>& tokens, double eps, RewardScale scale) {
  if (e == AdvEstimator::grpo) return group_advantages(rewards, group_sizes, eps, scale);
  const std::vector<double> r = grouped_rewards(rewards, group_sizes, "outcome_advantages");
  const size_t N = r.size();
  if (tokens.size() != N)
    throw std::invalid_argument(
        fmt::format("outcome_advantages: {} token counts for {} rewards", tokens.size(), N));
  std::vector<double> a(N, 0.0);
  size_t g0 = 0;
  for (int64_t gs : group_sizes) {
    const auto first = r.begin() + int64_t(g0), last = first + gs;
    const auto [lo, hi] = std::minmax_element(first, last);
    if (e == AdvEstimator::reinforce_plus_plus || gs == 1) {  // no baseline (verl: a lone sample's mean is 0)
      std::copy(first, last, a.begin() + int64_t(g0));
    } else if (*lo != *hi) {
      double mean = 0;
      for (auto it = first; it != last; ++it) mean += *it;
      mean /= double(gs);
      const double f = e == AdvEstimator::rloo ? double(gs) / double(gs - 1) : 1.0;
      for (size_t j = g0; j < g0 + size_t(gs); ++j) a[j] = f * (r[j] - mean);
    }
    g0 += size_t(gs);
  }
  if (e == AdvEstimator::reinforce_plus_plus || e == AdvEstimator::reinforce_plus_plus_baseline) {
    double n = 0, mean = 0;
    for (size_t i = 0; i < N; ++i) {
      if (tokens[i] < 0) throw std::invalid_argument("outcome_advantages: a negative token count");
      n += double(tokens[i]);
      mean += double(tokens[i]) * a[i];
    }
    if (n < 2) {
      std::fill(a.begin(), a.end(), 0.0);
    } else {
      mean /= n;
      double ss = 0;
      for (size_t i = 0; i < N; ++i) ss += double(tokens[i]) * (a[i] - mean) * (a[i] - mean);
      const double sd = std::sqrt(ss / (n - 1) + 1e-8);
      for (double& x : a) x = (x - mean) / sd;
    }
  }
  return from_vector(a, {int64_t(N)}, TensorOptions(rewards.dtype(), rewards.device()));
}

PolicyLoss grpo_loss(const Tensor& logp, const Tensor& old_logp, const Tensor& advantages, const Tensor& mask,
                     const GrpoOptions& o, const Tensor& ref_logp) {
  const Mask m = read_mask(mask, logp, "grpo");
  check_tokens(old_logp, m.N, m.T, "grpo", "old_logp");
  check_sequences(advantages, m.N, "grpo", "advantages");
  if (o.kl_coef > 0 && !ref_logp.defined())
    throw std::invalid_argument("grpo: kl_coef > 0 needs the reference log-probabilities");
  Tensor lp = masked(logp, m), old = masked(old_logp, m);
  Tensor adv = masked(per_token(advantages.to(logp.dtype()), m), m);
  Surrogate s = clipped_surrogate(log_ratio_of(lp, old), adv, o.clip_eps, 0.0, o.eps_high());

  PolicyLoss out;
  Tensor pg = aggregate(s.loss, m, o.agg, o.norm_length);
  out.loss = pg;
  if (o.kl_coef > 0) {
    Tensor kl = aggregate(low_var_kl(logp, ref_logp, mask), m, o.agg, o.norm_length);
    out.stats.kl_loss = kl.item();
    out.loss = add_scaled(pg, kl, o.kl_coef);
  }
  out.stats.pg_loss = pg.item();
  out.stats.ratio_mean = mean_of(s.ratio, m);
  out.stats.clip_frac = mean_of(s.clipped, m);
  out.stats.kl = mean_of(sub(old, lp), m);
  out.stats.advantage_mean = mean_of(adv, m);
  return out;
}

// ---------------------------------------------------------------- GSPO

PolicyLoss gspo_loss(const Tensor& logp, const Tensor& old_logp, const Tensor& advantages, const Tensor& mask,
                     const GspoOptions& o) {
  const Mask m = read_mask(mask, logp, "gspo");
  check_tokens(old_logp, m.N, m.T, "gspo", "old_logp");
  check_sequences(advantages, m.N, "gspo", "advantages");
  Tensor lp = masked(logp, m), old = masked(old_logp, m);
  // log s_i: the mean log-ratio over i's response tokens (0 for an empty
  // sequence), clamped only against overflow.
  std::vector<double> inv_len(size_t(m.N), 0.0);
  for (size_t i = 0; i < inv_len.size(); ++i) inv_len[i] = m.lens[i] > 0 ? 1.0 / m.lens[i] : 0.0;
  Tensor log_s;
  {
    NoGradGuard ng;
    Tensor per_seq = sum(mul(sub(lp, old), m.f), {1});
    log_s = clamp(mul(per_seq, from_vector(inv_len, {m.N}, TensorOptions(logp.dtype(), logp.device()))), -20.0, 20.0);
  }
  // GSPO-token: value log s_i at every token, gradient 1 w.r.t. that token's logp.
  Tensor log_ratio = add(sub(lp, lp.detach()), per_token(log_s, m));
  Tensor adv_seq = advantages.to(logp.dtype());
  Tensor adv = masked(per_token(adv_seq, m), m);
  Surrogate s = clipped_surrogate(log_ratio, adv, o.clip_eps, 0.0);

  PolicyLoss out;
  out.loss = seq_mean_token_mean(s.loss, m);
  out.stats.pg_loss = out.loss.item();
  // Sequence statistics: the ratio and the clipping decision are per sequence.
  {
    NoGradGuard ng;
    Tensor s_seq = exp(log_s);
    Tensor l1 = neg(mul(adv_seq, s_seq)), l2 = neg(mul(adv_seq, clamp(s_seq, 1.0 - o.clip_eps, 1.0 + o.clip_eps)));
    const std::vector<double> sv = host_f64(s_seq), cv = host_f64(gt(l2, l1));
    for (int64_t i = 0; i < m.N; ++i)
      if (m.lens[size_t(i)] > 0) {
        out.stats.ratio_mean += sv[size_t(i)];
        out.stats.clip_frac += cv[size_t(i)];
      }
    out.stats.ratio_mean /= std::max(m.sequences, 1.0);
    out.stats.clip_frac /= std::max(m.sequences, 1.0);
  }
  out.stats.kl = mean_of(sub(old, lp), m);
  out.stats.advantage_mean = mean_of(adv, m);
  return out;
}

// ---------------------------------------------------------------- DPO

namespace {

// -log sigmoid(z) = max(-z, 0) + log(1 + exp(-|z|)), finite for any z; its
// gradient -sigmoid(-z) is written out (the composition's abs and relu have
// no useful derivative at z = 0, where a first DPO step sits).
Tensor neg_log_sigmoid(const Tensor& z) {
  Tensor out;
  {
    NoGradGuard ng;
    out = add(relu(neg(z)), log(add(exp(neg(abs(z))), 1.0)));
  }
  if (needs_grad({z})) {
    Tensor zd = z.detach();
    record(out, "neg_log_sigmoid", {z},
           [zd](const Tensor& g) { return std::vector<Tensor>{neg(mul(g, sigmoid(neg(zd))))}; });
  }
  return out;
}

}  // namespace

DpoLossType parse_dpo_loss_type(const std::string& name, const char* flag) {
  for (DpoLossType t : {DpoLossType::sigmoid, DpoLossType::robust, DpoLossType::hinge, DpoLossType::ipo})
    if (name == dpo_loss_type_name(t)) return t;
  throw std::invalid_argument(fmt::format("{}: '{}' is not a DPO loss (sigmoid, robust, hinge, ipo)", flag, name));
}

const char* dpo_loss_type_name(DpoLossType t) {
  switch (t) {
    case DpoLossType::sigmoid: return "sigmoid";
    case DpoLossType::robust: return "robust";
    case DpoLossType::hinge: return "hinge";
    default: return "ipo";
  }
}

DpoLoss dpo_loss(const Tensor& policy_chosen, const Tensor& policy_rejected, const Tensor& ref_chosen,
                 const Tensor& ref_rejected, const DpoOptions& o) {
  if (!policy_chosen.defined() || policy_chosen.dim() != 1)
    throw std::invalid_argument("dpo: policy_chosen must be a [B] float tensor of summed log-probabilities");
  const double ls = o.label_smoothing;
  if (!(ls >= 0 && ls < 0.5))
    throw std::invalid_argument(fmt::format("dpo: label_smoothing must be in [0, 0.5), got {}", ls));
  if (ls > 0 && (o.loss_type == DpoLossType::hinge || o.loss_type == DpoLossType::ipo))
    throw std::invalid_argument("dpo: label smoothing applies to the sigmoid and robust losses only");
  const int64_t B = policy_chosen.size(0);
  check_sequences(policy_chosen, B, "dpo", "policy_chosen");
  check_sequences(policy_rejected, B, "dpo", "policy_rejected");
  check_sequences(ref_chosen, B, "dpo", "ref_chosen");
  check_sequences(ref_rejected, B, "dpo", "ref_rejected");
  Tensor chosen = sub(policy_chosen, ref_chosen), rejected = sub(policy_rejected, ref_rejected);
  const Tensor z = sub(chosen, rejected);
  const Tensor x = mul(z, o.beta);

  DpoLoss out;
  Tensor terms;
  switch (o.loss_type) {
    case DpoLossType::sigmoid:
      terms = ls > 0 ? add(mul(neg_log_sigmoid(x), 1 - ls), mul(neg_log_sigmoid(neg(x)), ls)) : neg_log_sigmoid(x);
      break;
    case DpoLossType::robust:
      terms = mul(sub(mul(neg_log_sigmoid(x), 1 - ls), mul(neg_log_sigmoid(neg(x)), ls)), 1.0 / (1 - 2 * ls));
      break;
    case DpoLossType::hinge: terms = relu(add(neg(x), 1.0)); break;
    case DpoLossType::ipo: {
      const Tensor d = add(z, -1.0 / (2 * o.beta));
      terms = mul(d, d);
      break;
    }
  }
  out.loss = mean(terms);
  out.stats.loss = out.loss.item();
  NoGradGuard ng;
  out.stats.chosen_reward = mean(mul(chosen, o.beta)).item();
  out.stats.rejected_reward = mean(mul(rejected, o.beta)).item();
  out.stats.reward_margin = mean(x).item();
  out.stats.reward_accuracy = mean(gt(x, zeros_like(x)).to(DType::f64)).item();
  return out;
}

// ---------------------------------------------------------------- PPO

Gae gae(const Tensor& token_rewards, const Tensor& values, const Tensor& mask, double gamma, double lam,
        bool whiten) {
  const Mask m = read_mask(mask, values, "gae");
  check_tokens(token_rewards, m.N, m.T, "gae", "token_rewards");
  const std::vector<double> r = host_f64(token_rewards), v = host_f64(values), keep = host_f64(m.keep);
  std::vector<double> adv(r.size(), 0.0), ret(r.size(), 0.0);
  for (int64_t i = 0; i < m.N; ++i) {
    double next_value = 0, next_adv = 0;
    for (int64_t t = m.T - 1; t >= 0; --t) {
      const size_t k = size_t(i * m.T + t);
      if (keep[k] == 0) continue;
      const double delta = r[k] + gamma * next_value - v[k];
      adv[k] = delta + gamma * lam * next_adv;
      ret[k] = adv[k] + v[k];
      next_value = v[k];
      next_adv = adv[k];
    }
  }
  if (whiten && m.tokens > 0) {
    double mean = 0, ss = 0;
    for (size_t k = 0; k < adv.size(); ++k) mean += keep[k] * adv[k];
    mean /= m.tokens;
    for (size_t k = 0; k < adv.size(); ++k) ss += keep[k] * (adv[k] - mean) * (adv[k] - mean);
    const double var = m.tokens > 1 ? ss / (m.tokens - 1) : 0.0;
    const double inv = 1.0 / std::sqrt(var + 1e-8);
    for (size_t k = 0; k < adv.size(); ++k)
      if (keep[k] != 0) adv[k] = (adv[k] - mean) * inv;
  }
  const TensorOptions opts(values.dtype(), values.device());
  return Gae{from_vector(adv, {m.N, m.T}, opts), from_vector(ret, {m.N, m.T}, opts)};
}

PpoLoss ppo_loss(const Tensor& logp, const Tensor& old_logp, const Tensor& advantages, const Tensor& mask,
                 const Tensor& values, const Tensor& old_values, const Tensor& returns, const PpoOptions& o,
                 const Tensor& ref_logp) {
  const Mask m = read_mask(mask, logp, "ppo");
  check_tokens(old_logp, m.N, m.T, "ppo", "old_logp");
  check_tokens(advantages, m.N, m.T, "ppo", "advantages");
  check_tokens(values, m.N, m.T, "ppo", "values");
  check_tokens(old_values, m.N, m.T, "ppo", "old_values");
  check_tokens(returns, m.N, m.T, "ppo", "returns");
  if (o.use_kl_loss && !ref_logp.defined())
    throw std::invalid_argument("ppo: --use-kl-loss needs the reference log-probabilities");
  Tensor lp = masked(logp, m), old = masked(old_logp, m), adv = masked(advantages.to(logp.dtype()), m);
  Surrogate s = clipped_surrogate(log_ratio_of(lp, old), adv, o.clip_eps, o.clip_ratio_c);

  PpoLoss out;
  Tensor pg = token_mean(s.loss, m);
  Tensor loss = pg;
  if (o.use_kl_loss) {
    Tensor kl = token_mean(low_var_kl(logp, ref_logp, mask), m);
    out.stats.policy.kl_loss = kl.item();
    loss = add_scaled(loss, kl, o.kl_loss_coef);
  }
  // Value: the prediction may move at most value_clip_eps from the rollout's
  // value; the larger of the two squared errors counts (verl's clip_by_value
  // as max(min(v, hi), lo)).
  Tensor v = masked(values, m), v_old = masked(old_values.to(values.dtype()), m);
  Tensor ret = masked(returns.to(values.dtype()), m);
  Tensor v_clipped = maximum(minimum(v, add(v_old, o.value_clip_eps)), add(v_old, -o.value_clip_eps));
  Tensor e1 = square(sub(v, ret)), e2 = square(sub(v_clipped, ret));
  Tensor vf = mul(token_mean(maximum(e1, e2), m), 0.5);
  out.loss = add_scaled(loss, vf.to(loss.dtype()), o.value_loss_coef);

  PolicyStats& p = out.stats.policy;
  p.pg_loss = pg.item();
  p.ratio_mean = mean_of(s.ratio, m);
  p.clip_frac = mean_of(s.clipped, m);
  p.clip_frac_lower = s.clipped_lower.defined() ? mean_of(s.clipped_lower, m) : 0.0;
  p.kl = mean_of(sub(old, lp), m);
  p.advantage_mean = mean_of(adv, m);
  out.stats.vf_loss = vf.item();
  out.stats.vf_clip_frac = mean_of(gt(e2, e1), m);
  out.stats.value_mean = mean_of(v, m);
  out.stats.return_mean = mean_of(ret, m);
  return out;
}

// ---------------------------------------------------------------- KL in the reward

KlPenalty parse_kl_penalty(const std::string& name, const char* flag) {
  if (name == "kl" || name == "k1") return KlPenalty::kl;
  if (name == "abs") return KlPenalty::abs;
  if (name == "mse" || name == "k2") return KlPenalty::mse;
  if (name == "low_var_kl" || name == "k3") return KlPenalty::low_var_kl;
  throw std::invalid_argument(
      fmt::format("{}: '{}' is not a KL penalty (kl/k1, abs, mse/k2, low_var_kl/k3)", flag, name));
}

Tensor kl_penalty(const Tensor& logp, const Tensor& ref_logp, const Tensor& mask, KlPenalty type) {
  if (type == KlPenalty::low_var_kl) return low_var_kl(logp, ref_logp, mask);
  const Mask m = read_mask(mask, logp, "kl_penalty");
  check_tokens(ref_logp, m.N, m.T, "kl_penalty", "ref_logp");
  const Tensor d = sub(masked(logp, m), masked(ref_logp, m));
  switch (type) {
    case KlPenalty::kl: return mul(d, m.f);
    case KlPenalty::abs: return mul(abs(d), m.f);
    default: return mul(mul(mul(d, d), 0.5), m.f);
  }
}

void KlController::update(double kl, int64_t n) {
  if (!adaptive) return;
  const double err = std::clamp(kl / target - 1.0, -0.2, 0.2);
  value *= 1.0 + err * double(n) / double(horizon);
}

KlShaped apply_kl_penalty(const Tensor& token_rewards, const Tensor& logp, const Tensor& ref_logp,
                          const Tensor& mask, KlPenalty type, double beta) {
  const Mask m = read_mask(mask, logp, "apply_kl_penalty");
  check_tokens(token_rewards, m.N, m.T, "apply_kl_penalty", "token_rewards");
  NoGradGuard ng;
  const Tensor kld = kl_penalty(logp.detach(), ref_logp, mask, type);
  KlShaped out;
  out.rewards = sub(token_rewards, mul(kld, beta));
  const std::vector<double> k = kld.to(Device::cpu(), DType::f64).to_vector<double>();
  double total = 0;
  for (int64_t i = 0; i < m.N; ++i) {
    double s = 0;
    for (int64_t t = 0; t < m.T; ++t) s += k[size_t(i * m.T + t)];
    total += s / (m.lens[size_t(i)] + 1e-8);  // verl's masked_mean
  }
  out.kl = m.N ? total / double(m.N) : 0.0;
  return out;
}

}  // namespace areno::train::rl
