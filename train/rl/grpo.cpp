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

RlAlgo rl_algo_from_name(const std::string& name) {
  if (name == "grpo") return RlAlgo::grpo;
  if (name == "gspo") return RlAlgo::gspo;
  throw std::invalid_argument(fmt::format("--algo: '{}' is not grpo or gspo", name));
}

const char* rl_algo_name(RlAlgo a) { return a == RlAlgo::grpo ? "grpo" : "gspo"; }

void validate(const RlOptions& o) {
  validate_rl_loop(o.loop, o.rollout.n_samples, rl_algo_name(o.algo));
  if (!(o.grpo.clip_eps > 0 && o.grpo.clip_eps < 1))
    throw std::invalid_argument("--grpo-clip-eps: must be in (0, 1)");
  if (o.grpo.clip_eps_high >= 0 && !(o.grpo.clip_eps_high > 0 && std::isfinite(o.grpo.clip_eps_high)))
    throw std::invalid_argument("--grpo-clip-eps-high: must be positive");
  if (o.algo != RlAlgo::grpo && (o.grpo.clip_eps_high >= 0 || o.grpo.agg != LossAgg::token_mean))
    throw std::invalid_argument("--grpo-clip-eps-high, --loss-agg-mode: only with --algo grpo");
  if (o.adv_estimator != AdvEstimator::grpo && o.scale_rewards != RewardScale::group)
    throw std::invalid_argument("--scale-rewards: only with --adv-estimator grpo");
  if (o.filter_groups && o.max_num_gen_batches < 1)
    throw std::invalid_argument("--max-num-gen-batches: must be at least 1");
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
      rollout_(model_, tok_, seeded_rollout(options_.rollout, options_.loop.seed)) {
  validate(options_);
  options_.grpo.norm_length = options_.rollout.max_new_tokens;  // Dr. GRPO's constant L
  if (rows_.empty()) throw std::invalid_argument("the dataset has no prompts to train on");
  if (!reward_ && options_.agent.cmd.empty())
    throw std::invalid_argument("an RL run needs a reward (--reward or --reward-cmd)");
  agent_ = make_agent_rollout(model_, tok_, options_.rollout, options_.loop.seed, options_.agent);
  optimizer_ = make_training_optimizer(*model_, options_.loop, total_steps());
  disable_dropout(*model_);
}

int64_t GrpoTrainer::steps_per_epoch() const { return loop_steps_per_epoch(int64_t(rows_.size()), options_.loop); }

int64_t GrpoTrainer::total_steps() const { return loop_total_steps(int64_t(rows_.size()), options_.loop); }

RlStepStats GrpoTrainer::step() {
  if (done()) throw std::logic_error(fmt::format("the run is done ({} steps)", total_steps()));
  const auto t0 = Clock::now();
  const SftOptions& lo = options_.loop;
  RlStepStats st;
  st.step = state_.step + 1;
  st.lrs = group_lrs(*optimizer_);

  // 1-3. The step's prompts, rollouts (KV blocks free afterwards; the engine's
  // or the agents') and rewards per trajectory; with --filter-groups as many
  // batches of prompts as it takes. `next`: the data position after them.
  TrainerState next = state_;
  ScoredRollouts r;
  if (options_.filter_groups) {
    r = roll_varied(next, st);
  } else {
    r = roll_and_score(rows_, state_, lo, rollout_, agent_.get(), reward_.get(), *tok_);
    advance_position(next, int64_t(r.rows.size()), int64_t(rows_.size()));
  }
  record_rollouts(r, st);
  const int64_t N = st.samples;

  // 4. Advantages (f64), one per trajectory, then per row: the group
  // advantages, or another --adv-estimator (whose whitening weighs each
  // trajectory by its trainable tokens). (Groups of n_samples, fewer where
  // --skip-failed-agents dropped runs.)
  std::vector<int64_t> traj_tokens;
  for (const RolloutBatch::Trajectory& t : r.trajectories) {
    traj_tokens.push_back(0);
    for (int64_t row : t.rows) traj_tokens.back() += trainable_tokens(r.samples[size_t(row)]);
  }
  const std::vector<double> adv =
      per_row(r, outcome_advantages(options_.adv_estimator, from_vector(r.rewards, {st.trajectories}), r.group_sizes,
                                    traj_tokens, 1e-6, options_.scale_rewards)
                     .to_vector<double>());

  // 5. Micro-batches. Each loss is weighted by its share of the batch's
  // trainable tokens (token_mean) or rows, so the accumulated gradient is the
  // whole batch's (see grpo.h).
  const auto t_train = Clock::now();
  const int64_t tokens = r.tokens;
  const bool per_token = options_.algo == RlAlgo::grpo && options_.grpo.agg == LossAgg::token_mean;
  LogpParity parity;
  double adv_sum = 0;
  for (int64_t b = 0, micro = 0; b < N; b += lo.mini_bs, ++micro) {
    const int64_t e = std::min(N, b + lo.mini_bs);
    const int64_t n = e - b;
    const MicroBatch mb = micro_batch(r, b, e);
    TokenLogp tl = policy_logp(*model_, mb.prompts, mb.seqs, step_logp_options(lo, state_.step, micro));
    const Device dev = tl.logp.device();
    std::vector<float> a(static_cast<size_t>(n), 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      a[size_t(i)] = float(adv[size_t(b + i)]);
      adv_sum += adv[size_t(b + i)] * double(trainable_tokens(r.samples[size_t(b + i)]));
    }
    // old_logp: the rollout's; the training forward's own where a trainable token has none (ratio 1).
    const Tensor old_logp = rollout_logp(r, b, tl.logp);
    const Tensor advantages = from_vector(a, {n}).to(dev);
    PolicyLoss pl = options_.algo == RlAlgo::grpo
                        ? grpo_loss(tl.logp, old_logp, advantages, tl.mask, options_.grpo)
                        : gspo_loss(tl.logp, old_logp, advantages, tl.mask, options_.gspo);
    const double wt = double(mb.tokens) / double(std::max<int64_t>(1, tokens)), ws = double(n) / double(N);
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
    parity.add(tl.logp, r, b, n);
  }
  st.advantage_mean = adv_sum / std::max<double>(1, double(tokens));
  parity.finish(st);

  // 6. Clip and step.
  st.grad_norm = clip_and_step(*optimizer_, lo.grad_clip_norm);
  state_ = next;
  state_.step += 1;
  st.train_s = seconds_since(t_train);
  st.total_s = seconds_since(t0);
  return st;
}

ScoredRollouts GrpoTrainer::roll_varied(TrainerState& pos, RlStepStats& st) {
  const SftOptions& lo = options_.loop;
  ScoredRollouts kept;
  do {
    const ScoredRollouts r = roll_and_score(rows_, pos, lo, rollout_, agent_.get(), reward_.get(), *tok_);
    ++st.gen_batches;
    st.prompts_read += int64_t(r.rows.size());
    advance_position(pos, int64_t(r.rows.size()), int64_t(rows_.size()));
    const std::vector<int64_t> varied = varied_groups(r);
    st.filtered_groups += int64_t(r.group_sizes.size() - varied.size());
    append_groups(kept, r, varied, lo.batch_size);
  } while (int64_t(kept.group_sizes.size()) < lo.batch_size && st.gen_batches < options_.max_num_gen_batches);
  if (kept.group_sizes.empty())
    throw std::runtime_error(fmt::format(
        "--filter-groups: in each of the {} prompts read ({} batches, --max-num-gen-batches {}) every sample of a "
        "prompt scored the same: nothing to learn from; check the reward, or raise --max-num-gen-batches",
        st.prompts_read, st.gen_batches, options_.max_num_gen_batches));
  return kept;
}

json GrpoTrainer::run_keys() const {
  json k = rollout_run_keys(rows_, options_.loop, options_.rollout, rl_algo_name(options_.algo));
  k.update(agent_run_keys(options_.agent));
  if (options_.filter_groups) k["--filter-groups"] = fmt::format("--max-num-gen-batches {}", options_.max_num_gen_batches);
  k.update(options_.run_keys);
  return k;
}

fs::path GrpoTrainer::save_checkpoint(const fs::path& save_path, const fs::path& source,
                                      const std::function<void(const fs::path&)>& add_files) const {
  json st = trainer_state_json(state_, total_steps(), options_.loop.seed);
  st["algo"] = rl_algo_name(options_.algo);
  st["run"] = run_keys();
  st["rollout_runs"] = rollout_runs(rollout_, agent_.get());
  return save_step_folder(*model_, *optimizer_, state_.step, save_path, source, st, add_files);
}

void GrpoTrainer::load_state(const fs::path& step_dir) {
  int64_t runs = 0;
  state_ = load_rollout_state(step_dir, run_keys(), int64_t(rows_.size()), *optimizer_, runs).state;
  set_rollout_runs(rollout_, agent_.get(), runs);
}

}  // namespace areno::train::rl
