#include "train/rl/rl_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <stdexcept>

#include <fmt/format.h>

namespace areno::train::rl {

using Clock = std::chrono::steady_clock;

void validate_rl_loop(const SftOptions& loop, int64_t n_samples, const std::string& algo) {
  SftOptions l = loop;
  l.mini_bs = 1;  // counted in samples here, checked below
  train::validate(l);
  const int64_t samples = loop.batch_size * n_samples;
  if (loop.mini_bs < 1 || loop.mini_bs > samples)
    throw std::invalid_argument(fmt::format("--mini-bs: must be between 1 and --batch-size x --n-samples ({}), got {}",
                                            samples, loop.mini_bs));
  if (loop.groups.embed_rows == EmbedRows::data)
    throw std::invalid_argument(fmt::format("--embed-rows data: not supported with --algo {} (use all or none)", algo));
}

RolloutOptions seeded_rollout(RolloutOptions r, uint64_t seed) {
  r.seed = seed;
  return r;
}

PolicyLogpOptions step_logp_options(const SftOptions& loop, int64_t step, int64_t micro) {
  PolicyLogpOptions po;
  po.chunk_rows = loop.loss_chunk_rows;
  po.recompute_layers = loop.activation_checkpointing;
  po.dropout_seed = splitmix64(loop.seed ^ splitmix64(uint64_t(step) * 0x10000ull + uint64_t(micro)));
  return po;
}

ScoredRollouts roll_and_score(const std::vector<PromptRow>& rows, const TrainerState& state, const SftOptions& loop,
                              Rollout& rollout, RewardFn& reward, const tok::Tokenizer& tokenizer) {
  const auto t0 = Clock::now();
  ScoredRollouts r;
  for (int64_t i : next_step_rows(state, int64_t(rows.size()), loop)) r.rows.push_back(&rows[size_t(i)]);
  for (const PromptRow* p : r.rows) r.prompts.push_back({p->ids, p->media, p->adapter});
  r.samples = rollout.run(r.prompts);
  r.rollout_s = seconds_since(t0);

  const auto t_reward = Clock::now();
  const int64_t N = int64_t(r.samples.size());
  std::vector<RewardInput> inputs;
  inputs.reserve(size_t(N));
  for (const RolloutSample& s : r.samples) {
    const PromptRow& p = *r.rows[size_t(s.prompt)];
    const std::vector<tok::TokenId> ids(s.tokens.begin(), s.tokens.end());
    inputs.push_back({p.row, p.messages, tokenizer.decode(ids, /*skip_special_tokens=*/true),
                      int64_t(s.tokens.size()), s.index, s.prompt});
    r.tokens += int64_t(s.tokens.size());
  }
  r.rewards = reward.score(inputs);
  if (int64_t(r.rewards.size()) != N)
    throw std::logic_error(fmt::format("the reward gave {} scores for {} completions", r.rewards.size(), N));
  r.reward_s = seconds_since(t_reward);
  return r;
}

MicroBatch micro_batch(const ScoredRollouts& r, int64_t b, int64_t e) {
  MicroBatch mb;
  std::map<int64_t, int64_t> local;
  for (int64_t i = b; i < e; ++i) {
    const RolloutSample& s = r.samples[size_t(i)];
    auto [it, fresh] = local.emplace(s.prompt, int64_t(mb.prompts.size()));
    if (fresh) mb.prompts.push_back(r.prompts[size_t(s.prompt)]);
    mb.seqs.push_back({it->second, s.tokens});
    mb.tokens += int64_t(s.tokens.size());
  }
  return mb;
}

Tensor rollout_logp(const ScoredRollouts& r, int64_t b, int64_t n, int64_t T, Device device) {
  std::vector<float> old(static_cast<size_t>(n * T), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const RolloutSample& s = r.samples[size_t(b + i)];
    std::copy(s.logp.begin(), s.logp.end(), old.begin() + i * T);
  }
  return from_vector(old, {n, T}).to(device);
}

void LogpParity::add(const Tensor& logp, const ScoredRollouts& r, int64_t b, int64_t n) {
  const int64_t T = logp.size(1);
  const std::vector<float> lp = logp.to_vector<float>();
  for (int64_t i = 0; i < n; ++i) {
    const RolloutSample& s = r.samples[size_t(b + i)];
    for (size_t t = 0; t < s.tokens.size(); ++t) {
      const double tr = lp[size_t(i * T) + t], ro = s.logp[t];
      rollout_sum += ro;
      train_sum += tr;
      diff_sum += tr - ro;
      abs_sum += std::abs(tr - ro);
      abs_max = std::max(abs_max, std::abs(tr - ro));
      tokens += 1;
    }
  }
}

void LogpParity::finish(RlStepStats& st) const {
  const double d = std::max(1.0, tokens);
  st.rollout_logprobs_mean = rollout_sum / d;
  st.train_logprobs_mean = train_sum / d;
  st.logp_diff_mean = diff_sum / d;
  st.logp_abs_diff_mean = abs_sum / d;
  st.logp_abs_diff_max = abs_max;
}

void record_rollouts(const ScoredRollouts& r, RlStepStats& st) {
  const int64_t N = int64_t(r.samples.size());
  st.prompts = int64_t(r.rows.size());
  st.samples = N;
  st.response_tokens = r.tokens;
  st.rewards = r.rewards;
  double sum = 0;
  for (double x : r.rewards) sum += x;
  st.reward_mean = N > 0 ? sum / double(N) : 0.0;
  st.response_len = N > 0 ? double(r.tokens) / double(N) : 0.0;
  st.rollout_s = r.rollout_s;
  st.reward_s = r.reward_s;
}

Scalars rl_scalars(const RlStepStats& st) {
  Scalars s = {{"reward_mean", st.reward_mean},
               {"advantage_mean", st.advantage_mean},
               {"response_len", st.response_len},
               {"rollout_logprobs_mean", st.rollout_logprobs_mean},
               {"train_logprobs_mean", st.train_logprobs_mean},
               {"logp_diff_mean", st.logp_diff_mean},
               {"logp_abs_diff_mean", st.logp_abs_diff_mean},
               {"ratio_mean", st.ratio_mean},
               {"clip_frac", st.clip_frac},
               {"kl", st.kl},
               {"loss", st.loss},
               {"pg_loss", st.pg_loss},
               {"grad_norm", st.grad_norm}};
  for (const auto& [g, lr] : st.lrs) s.emplace_back("lr/" + g, lr);
  s.insert(s.end(), {{"samples", double(st.samples)},
                     {"response_tokens", double(st.response_tokens)},
                     {"time/rollout_s", st.rollout_s},
                     {"time/reward_s", st.reward_s},
                     {"time/train_s", st.train_s},
                     {"time/total_s", st.total_s},
                     {"memory/peak_rss_bytes", double(peak_rss_bytes())}});
  return s;
}

std::string format_rl_progress(const RlStepStats& st, int64_t total_steps, const std::string& extra) {
  return fmt::format("step {}/{}  reward {:.3f}  loss {:.4f}  len {:.1f}  logp_abs_diff {:.1e}  ratio {:.4f}  "
                     "clip_frac {:.3f}  {}{}  grad_norm {:.3f}  time rollout={:.2f}s train={:.2f}s total={:.2f}s",
                     st.step, total_steps, st.reward_mean, st.loss, st.response_len, st.logp_abs_diff_mean,
                     st.ratio_mean, st.clip_frac, extra.empty() ? "" : extra + "  ", format_group_lrs(st.lrs),
                     st.grad_norm, st.rollout_s + st.reward_s, st.train_s, st.total_s);
}

}  // namespace areno::train::rl
