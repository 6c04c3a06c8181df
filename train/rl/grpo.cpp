#include "train/rl/grpo.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace areno::train::rl {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

RolloutOptions seeded(RolloutOptions r, uint64_t seed) {
  r.seed = seed;
  return r;
}

}  // namespace

RlAlgo rl_algo_from_name(const std::string& name) {
  if (name == "grpo") return RlAlgo::grpo;
  if (name == "gspo") return RlAlgo::gspo;
  throw std::invalid_argument(fmt::format("--algo: '{}' is not grpo or gspo", name));
}

const char* rl_algo_name(RlAlgo a) { return a == RlAlgo::grpo ? "grpo" : "gspo"; }

void validate(const RlOptions& o) {
  SftOptions loop = o.loop;
  loop.mini_bs = 1;  // counted in samples here, checked below
  train::validate(loop);
  const int64_t samples = o.loop.batch_size * o.rollout.n_samples;
  if (o.loop.mini_bs < 1 || o.loop.mini_bs > samples)
    throw std::invalid_argument(fmt::format("--mini-bs: must be between 1 and --batch-size x --n-samples ({}), got {}",
                                            samples, o.loop.mini_bs));
  if (o.loop.groups.embed_rows == EmbedRows::data)
    throw std::invalid_argument("--embed-rows data: not supported with --algo grpo|gspo (use all or none)");
  if (!(o.grpo.clip_eps > 0 && o.grpo.clip_eps < 1))
    throw std::invalid_argument("--grpo-clip-eps: must be in (0, 1)");
  if (!(o.gspo.clip_eps > 0 && o.gspo.clip_eps < 1))
    throw std::invalid_argument("--gspo-clip-eps: must be in (0, 1)");
}

GrpoTrainer::GrpoTrainer(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model,
                         std::shared_ptr<const tok::Tokenizer> tokenizer, std::vector<PromptRow> rows,
                         RlOptions options, std::unique_ptr<RewardFn> reward)
    : model_(std::move(model)),
      tok_(std::move(tokenizer)),
      rows_(std::move(rows)),
      options_(std::move(options)),
      reward_(std::move(reward)),
      rollout_(model_, tok_, seeded(options_.rollout, options_.loop.seed)) {
  validate(options_);
  if (rows_.empty()) throw std::invalid_argument("the dataset has no prompts to train on");
  if (!reward_ && options_.agent.cmd.empty())
    throw std::invalid_argument("an RL run needs a reward (--reward or --reward-cmd)");
  if (!options_.agent.cmd.empty())
    agent_ = std::make_unique<AgentRollout>(model_, tok_, seeded(options_.rollout, options_.loop.seed), options_.agent);
  optimizer_ = make_training_optimizer(*model_, options_.loop, total_steps());
}

int64_t GrpoTrainer::steps_per_epoch() const { return loop_steps_per_epoch(int64_t(rows_.size()), options_.loop); }

int64_t GrpoTrainer::total_steps() const { return loop_total_steps(int64_t(rows_.size()), options_.loop); }

RolloutBatch GrpoTrainer::roll_out(const std::vector<const PromptRow*>& batch) {
  RolloutBatch b;
  if (agent_) {
    std::vector<AgentTask> tasks;
    for (size_t i = 0; i < batch.size(); ++i) tasks.push_back({batch[i]->row, int64_t(i), 0, batch[i]->line, {}});
    return agent_->run(tasks);
  }
  for (const PromptRow* r : batch) b.prompts.push_back({r->ids, r->media, r->adapter});
  b.samples = rollout_.run(b.prompts);
  for (size_t k = 0; k < b.samples.size(); ++k) {
    const RolloutSample& s = b.samples[k];
    const std::vector<tok::TokenId> ids(s.tokens.begin(), s.tokens.end());
    b.trajectories.push_back({s.prompt, s.index, {int64_t(k)}, std::nullopt,
                              tok_->decode(ids, /*skip_special_tokens=*/true), int64_t(s.tokens.size())});
  }
  return b;
}

RlStepStats GrpoTrainer::step() {
  if (done()) throw std::logic_error(fmt::format("the run is done ({} steps)", total_steps()));
  const auto t0 = Clock::now();
  const SftOptions& lo = options_.loop;
  const int64_t G = options_.rollout.n_samples;
  RlStepStats st;
  st.step = state_.step + 1;
  st.lrs = group_lrs(*optimizer_);

  // 1. The step's prompts, in the epoch's order.
  std::vector<const PromptRow*> batch;
  for (int64_t i : next_step_rows(state_, int64_t(rows_.size()), lo)) batch.push_back(&rows_[size_t(i)]);
  st.prompts = int64_t(batch.size());

  // 2. Rollouts (the engine's KV blocks are free when they return).
  const RolloutBatch rb = roll_out(batch);
  const std::vector<RolloutSample>& samples = rb.samples;
  st.rollout_s = seconds_since(t0);
  const int64_t N = int64_t(samples.size()), NT = int64_t(rb.trajectories.size());
  if (NT != st.prompts * G)
    throw std::logic_error(fmt::format("the rollout gave {} trajectories for {} prompts x {} samples", NT, st.prompts, G));
  st.samples = N;
  st.trajectories = NT;
  st.split_rows = N - NT;

  // 3. Rewards: the source's, else the RewardFn's on the decoded final answer.
  const auto t_reward = Clock::now();
  st.rewards.assign(size_t(NT), 0.0);
  std::vector<RewardInput> inputs;
  std::vector<int64_t> scored;
  for (int64_t k = 0; k < NT; ++k) {
    const RolloutBatch::Trajectory& t = rb.trajectories[size_t(k)];
    if (t.reward) {
      st.rewards[size_t(k)] = *t.reward;
      continue;
    }
    if (!reward_)
      throw std::invalid_argument(fmt::format("--agent-cmd: the agent of task {} (sample {}) printed no reward and "
                                              "neither --reward nor --reward-cmd is given",
                                              t.task, t.index));
    const PromptRow& r = *batch[size_t(t.task)];
    inputs.push_back({r.row, r.messages, t.text, t.tokens, t.index, t.task});
    scored.push_back(k);
  }
  if (!inputs.empty()) {
    const std::vector<double> got = reward_->score(inputs);
    if (got.size() != inputs.size())
      throw std::logic_error(fmt::format("the reward gave {} scores for {} completions", got.size(), inputs.size()));
    for (size_t i = 0; i < scored.size(); ++i) st.rewards[size_t(scored[i])] = got[i];
  }
  st.reward_s = seconds_since(t_reward);

  // 4. Group advantages (f64), one per trajectory, then per row.
  const std::vector<double> tadv = group_advantages(from_vector(st.rewards, {NT}), G).to_vector<double>();
  std::vector<double> adv(size_t(N), 0.0);
  for (int64_t k = 0; k < NT; ++k)
    for (int64_t row : rb.trajectories[size_t(k)].rows) adv[size_t(row)] = tadv[size_t(k)];

  // 5. Micro-batches. Each loss is weighted by its share of the batch's
  // trainable tokens (token_mean) or rows, so the accumulated gradient is the
  // whole batch's (see grpo.h).
  const auto t_train = Clock::now();
  auto trainable = [](const RolloutSample& s, size_t t) { return s.trainable.empty() || s.trainable[t] != 0; };
  auto count_trainable = [&](const RolloutSample& s) {
    int64_t n = 0;
    for (size_t t = 0; t < s.tokens.size(); ++t) n += trainable(s, t) ? 1 : 0;
    return n;
  };
  int64_t tokens = 0;
  for (const RolloutSample& s : samples) tokens += count_trainable(s);
  st.response_tokens = tokens;
  const bool per_token = options_.algo == RlAlgo::grpo && options_.grpo.agg == LossAgg::token_mean;
  double reward_sum = 0, rollout_sum = 0, train_sum = 0, diff_sum = 0, abs_sum = 0, adv_sum = 0;
  int64_t compared = 0;  // trainable tokens with a rollout log-probability
  for (double r : st.rewards) reward_sum += r;
  for (int64_t b = 0, micro = 0; b < N; b += lo.mini_bs, ++micro) {
    const int64_t e = std::min(N, b + lo.mini_bs);
    const int64_t n = e - b;
    // Only the prompts this micro-batch uses (policy_logp runs each prompt's towers).
    std::map<int64_t, int64_t> local;
    std::vector<Prompt> mprompts;
    std::vector<Sequence> seqs;
    int64_t mtokens = 0;
    for (int64_t i = b; i < e; ++i) {
      const RolloutSample& s = samples[size_t(i)];
      auto [it, fresh] = local.emplace(s.prompt, int64_t(mprompts.size()));
      if (fresh) mprompts.push_back(rb.prompts[size_t(s.prompt)]);
      seqs.push_back({it->second, s.tokens, s.trainable});
      mtokens += count_trainable(s);
    }
    PolicyLogpOptions po;
    po.chunk_rows = lo.loss_chunk_rows;
    po.recompute_layers = lo.activation_checkpointing;
    po.dropout_seed = splitmix64(lo.seed ^ splitmix64(uint64_t(state_.step) * 0x10000ull + uint64_t(micro)));
    TokenLogp tl = policy_logp(*model_, mprompts, seqs, po);
    const int64_t T = tl.logp.size(1);
    const Device dev = tl.logp.device();
    const std::vector<float> lp = tl.logp.to_vector<float>();
    // old_logp: the rollout's; the training forward's own where a trainable token has none (ratio 1).
    std::vector<float> old(static_cast<size_t>(n * T), 0.0f), a(static_cast<size_t>(n), 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      const RolloutSample& s = samples[size_t(b + i)];
      for (size_t t = 0; t < s.tokens.size(); ++t) {
        const size_t cell = size_t(i * T) + t;
        old[cell] = std::isnan(s.logp[t]) ? lp[cell] : s.logp[t];
      }
      a[size_t(i)] = float(adv[size_t(b + i)]);
    }
    const Tensor old_logp = from_vector(old, {n, T}).to(dev);
    const Tensor advantages = from_vector(a, {n}).to(dev);
    PolicyLoss pl = options_.algo == RlAlgo::grpo
                        ? grpo_loss(tl.logp, old_logp, advantages, tl.mask, options_.grpo)
                        : gspo_loss(tl.logp, old_logp, advantages, tl.mask, options_.gspo);
    const double wt = double(mtokens) / double(std::max<int64_t>(1, tokens)), ws = double(n) / double(N);
    const double w = per_token ? wt : ws;
    Tensor loss = mul(pl.loss, w);
    st.loss += loss.item();
    if (loss.requires_grad()) loss.backward();
    st.pg_loss += w * pl.stats.pg_loss;
    // GSPO's ratio and clip fraction are over sequences, GRPO's over tokens.
    const double wr = options_.algo == RlAlgo::grpo ? wt : ws;
    st.ratio_mean += wr * pl.stats.ratio_mean;
    st.clip_frac += wr * pl.stats.clip_frac;
    st.kl += wt * pl.stats.kl;
    // Host statistics: the rollout's and the training forward's log-probabilities of the same tokens.
    for (int64_t i = 0; i < n; ++i) {
      const RolloutSample& s = samples[size_t(b + i)];
      for (size_t t = 0; t < s.tokens.size(); ++t) {
        if (!trainable(s, t)) continue;
        adv_sum += adv[size_t(b + i)];
        if (std::isnan(s.logp[t])) continue;
        const double tr = lp[size_t(i * T) + t], ro = s.logp[t];
        ++compared;
        rollout_sum += ro;
        train_sum += tr;
        diff_sum += tr - ro;
        abs_sum += std::abs(tr - ro);
        st.logp_abs_diff_max = std::max(st.logp_abs_diff_max, std::abs(tr - ro));
      }
    }
  }
  const double tok_d = std::max<double>(1, double(tokens)), cmp_d = std::max<double>(1, double(compared));
  st.reward_mean = reward_sum / double(NT);
  st.advantage_mean = adv_sum / tok_d;
  st.response_len = double(tokens) / double(std::max<int64_t>(1, N));
  st.rollout_logprobs_mean = rollout_sum / cmp_d;
  st.train_logprobs_mean = train_sum / cmp_d;
  st.logp_diff_mean = diff_sum / cmp_d;
  st.logp_abs_diff_mean = abs_sum / cmp_d;

  // 6. Clip and step.
  st.grad_norm = clip_and_step(*optimizer_, lo.grad_clip_norm);
  advance(state_, int64_t(batch.size()), int64_t(rows_.size()));
  st.train_s = seconds_since(t_train);
  st.total_s = seconds_since(t0);
  return st;
}

fs::path GrpoTrainer::save_checkpoint(const fs::path& save_path, const fs::path& source,
                                      const std::function<void(const fs::path&)>& add_files) const {
  json st = trainer_state_json(state_, total_steps(), options_.loop.seed);
  st["algo"] = rl_algo_name(options_.algo);
  st["resumable"] = false;
  return save_step_folder(*model_, *optimizer_, state_.step, save_path, source, st, add_files);
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
                     {"trajectories", double(st.trajectories)},
                     {"split_rows", double(st.split_rows)},
                     {"response_tokens", double(st.response_tokens)},
                     {"time/rollout_s", st.rollout_s},
                     {"time/reward_s", st.reward_s},
                     {"time/train_s", st.train_s},
                     {"time/total_s", st.total_s},
                     {"memory/peak_rss_bytes", double(peak_rss_bytes())}});
  return s;
}

std::string format_rl_progress(const RlStepStats& st, int64_t total_steps) {
  return fmt::format("step {}/{}  reward {:.3f}  loss {:.4f}  len {:.1f}  logp_abs_diff {:.1e}  ratio {:.4f}  "
                     "clip_frac {:.3f}  {}  grad_norm {:.3f}  time rollout={:.2f}s train={:.2f}s total={:.2f}s",
                     st.step, total_steps, st.reward_mean, st.loss, st.response_len, st.logp_abs_diff_mean,
                     st.ratio_mean, st.clip_frac, format_group_lrs(st.lrs), st.grad_norm, st.rollout_s + st.reward_s, st.train_s,
                     st.total_s);
}

}  // namespace areno::train::rl
