#include "train/rl/ppo.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "models/phi4mm/checkpoint.h"
#include "nn/io/atomic_file.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace areno::train::rl {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// rows[b .. b + n) padded with 0 to [n, T].
Tensor padded(const std::vector<std::vector<float>>& rows, int64_t b, int64_t n, int64_t T, Device device) {
  std::vector<float> out(static_cast<size_t>(n * T), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<float>& r = rows[size_t(b + i)];
    std::copy(r.begin(), r.end(), out.begin() + i * T);
  }
  return from_vector(out, {n, T}).to(device);
}

// Row i of an [n, T] tensor's host copy, its first len[i] entries, into rows[b + i].
void unpad(const Tensor& t, const std::vector<RolloutSample>& samples, int64_t b,
           std::vector<std::vector<float>>& rows) {
  const int64_t n = t.size(0), T = t.size(1);
  const std::vector<float> v = t.to_vector<float>();
  for (int64_t i = 0; i < n; ++i) {
    const size_t len = samples[size_t(b + i)].tokens.size();
    rows[size_t(b + i)].assign(v.begin() + i * T, v.begin() + i * T + int64_t(len));
  }
}

std::vector<std::pair<std::string, double>> critic_lrs(const AdamW& critic) {
  // The head's group is last; every critic group shares its schedule.
  return {{"critic", critic.current_lr(critic.param_groups().size() - 1)}};
}

}  // namespace

void validate(const PpoTrainOptions& o) {
  validate_rl_loop(o.loop, o.rollout.n_samples, "ppo");
  const PpoOptions& p = o.ppo;
  if (!(p.clip_eps > 0 && p.clip_eps < 1)) throw std::invalid_argument("--clip-eps: must be in (0, 1)");
  if (!(p.clip_ratio_c == 0 || p.clip_ratio_c > 1))
    throw std::invalid_argument("--clip-ratio-c: must be above 1 (0 turns the dual clip off)");
  if (!(p.value_clip_eps > 0)) throw std::invalid_argument("--value-clip-eps: must be positive");
  if (!(p.value_loss_coef > 0)) throw std::invalid_argument("--value-loss-coef: must be positive");
  if (!(p.kl_loss_coef >= 0)) throw std::invalid_argument("--kl-loss-coef: must be 0 or more");
  if (!(o.gamma >= 0 && o.gamma <= 1)) throw std::invalid_argument("--gamma: must be in [0, 1]");
  if (!(o.lam >= 0 && o.lam <= 1)) throw std::invalid_argument("--lam: must be in [0, 1]");
  if (o.ppo_epochs < 1) throw std::invalid_argument("--ppo-epochs: must be at least 1");
  if (o.ppo_mini_batch_size < 0 || o.ppo_mini_batch_size > o.loop.batch_size)
    throw std::invalid_argument(fmt::format("--ppo-mini-batch-size: must be between 1 and --batch-size ({})",
                                            o.loop.batch_size));
  const KlController& k = o.kl_ctrl;
  if (!(k.value >= 0) || !std::isfinite(k.value)) throw std::invalid_argument("--kl-coef: must be 0 or more");
  if (!(k.target > 0) || !std::isfinite(k.target)) throw std::invalid_argument("--kl-target: must be positive");
  if (k.horizon < 1) throw std::invalid_argument("--kl-horizon: must be at least 1");
  if (!(o.critic_lr >= 0)) throw std::invalid_argument("--critic-lr: must be positive (0: --lr)");
  if (o.critic_warmup_steps < 0) throw std::invalid_argument("--critic-warmup-steps: must be 0 or more");
}

PpoTrainer::PpoTrainer(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::shared_ptr<const tok::Tokenizer> tokenizer,
                       std::vector<PromptRow> rows, PpoTrainOptions options, std::unique_ptr<RewardFn> reward,
                       std::shared_ptr<phi4mm::Phi4MMForCausalLM> critic,
                       std::shared_ptr<const phi4mm::Phi4MMForCausalLM> reference)
    : model_(std::move(model)),
      critic_(std::move(critic)),
      reference_(std::move(reference)),
      tok_(std::move(tokenizer)),
      rows_(std::move(rows)),
      options_(std::move(options)),
      reward_(std::move(reward)),
      rollout_(model_, tok_, seeded_rollout(options_.rollout, options_.loop.seed)) {
  validate(options_);
  if (rows_.empty()) throw std::invalid_argument("the dataset has no prompts to train on");
  if (!reward_ && options_.agent.cmd.empty())
    throw std::invalid_argument("an RL run needs a reward (--reward or --reward-cmd)");
  agent_ = make_agent_rollout(model_, tok_, options_.rollout, options_.loop.seed, options_.agent);
  if (options_.ppo.use_kl_loss && !reference_)
    throw std::invalid_argument("--use-kl-loss: needs a reference model (the starting policy)");
  if (options_.use_kl_in_reward && !reference_)
    throw std::invalid_argument("--use-kl-in-reward: needs a reference model (the starting policy)");
  if (!options_.ppo.use_kl_loss && !options_.use_kl_in_reward) reference_.reset();
  kl_ctrl_ = options_.kl_ctrl;
  const SftOptions& lo = options_.loop;
  optimizer_ = make_training_optimizer(*model_, lo, total_steps());
  disable_dropout(*model_);

  // The critic's optimizer: the separate critic's trainable groups (as the
  // policy's, at --critic-lr) and the value head, one schedule.
  const phi4mm::Phi4MMForCausalLM& body = critic_ ? *critic_ : *model_;
  head_ = std::make_shared<ValueHead>(body.config().text.hidden_size, body.device());
  SftOptions co = lo;
  co.lr = options_.critic_lr > 0 ? options_.critic_lr : lo.lr;
  co.min_lr = lo.min_lr * co.lr / lo.lr;
  std::vector<ParamGroup> groups;
  if (critic_) {
    groups = make_training_optimizer(*critic_, co, total_steps())->param_groups();
    disable_dropout(*critic_);
    for (ParamGroup& g : groups) g.name = "critic." + g.name;
  }
  ParamGroup hg;
  hg.name = "critic";
  hg.params = {head_->weight, head_->bias};
  hg.names = {"value_head.weight", "value_head.bias"};
  hg.lr = co.lr;
  hg.schedule = make_schedule(co.decay, co.warmup_steps, co.lr_decay_steps > 0 ? co.lr_decay_steps : total_steps(),
                              co.min_lr / co.lr);
  groups.push_back(std::move(hg));
  AdamWOptions ao;
  ao.beta1 = lo.adam_beta1;
  ao.beta2 = lo.adam_beta2;
  ao.eps = lo.adam_eps;
  critic_optimizer_ = std::make_unique<AdamW>(std::move(groups), ao);
}

int64_t PpoTrainer::steps_per_epoch() const { return loop_steps_per_epoch(int64_t(rows_.size()), options_.loop); }

int64_t PpoTrainer::total_steps() const { return loop_total_steps(int64_t(rows_.size()), options_.loop); }

TokenRewards ppo_token_rewards(const ScoredRollouts& r, int64_t T) {
  const int64_t N = int64_t(r.samples.size());
  if (r.outcomes.size() != r.trajectories.size())
    throw std::logic_error(fmt::format("ppo_token_rewards: {} outcomes for {} trajectories", r.outcomes.size(),
                                       r.trajectories.size()));
  const std::vector<double> outcome = per_row(r, r.outcomes);
  TokenRewards out;
  out.rewards.assign(size_t(N * T), 0.0f);
  out.mask.assign(size_t(N * T), 0.0f);
  for (int64_t i = 0; i < N; ++i) {
    const RolloutSample& s = r.samples[size_t(i)];
    const int64_t L = int64_t(s.tokens.size());
    if (L > T) throw std::logic_error(fmt::format("ppo_token_rewards: a row of {} tokens in T = {}", L, T));
    int64_t first = -1, last = -1;
    for (int64_t t = 0; t < L; ++t)
      if (is_trainable(s, size_t(t))) {
        out.mask[size_t(i * T + t)] = 1.0f;
        if (first < 0) first = t;
        last = t;
      }
    if (last < 0) continue;
    out.rewards[size_t(i * T + last)] += float(outcome[size_t(i)]);
    for (const auto& [end, reward] : s.turn_rewards) {
      int64_t at = std::min(end, L - 1);
      while (at >= 0 && !is_trainable(s, size_t(at))) --at;
      if (at < 0) at = first;
      out.rewards[size_t(i * T + at)] += float(reward);
    }
  }
  return out;
}

PpoStepStats PpoTrainer::step() {
  if (done()) throw std::logic_error(fmt::format("the run is done ({} steps)", total_steps()));
  const auto t0 = Clock::now();
  const SftOptions& lo = options_.loop;
  const PpoOptions& po = options_.ppo;
  PpoStepStats st;
  RlStepStats& rs = st.rl;
  rs.step = state_.step + 1;
  st.policy_stepped = state_.step >= options_.critic_warmup_steps;
  // One learning rate per training step, whatever the passes and mini-batches
  // (the policy's schedule counts the steps it took, as its optimizer did
  // with one update per step).
  optimizer_->set_schedule_step(std::max<int64_t>(0, state_.step - options_.critic_warmup_steps));
  critic_optimizer_->set_schedule_step(state_.step);
  rs.lrs = group_lrs(*optimizer_);
  for (const auto& l : critic_lrs(*critic_optimizer_)) rs.lrs.push_back(l);

  // 1. Prompts, rollouts, rewards.
  const ScoredRollouts r = roll_and_score(rows_, state_, lo, rollout_, agent_.get(), reward_.get(), *tok_);
  record_rollouts(r, rs);
  const int64_t N = rs.samples;
  const int64_t tokens = r.tokens;
  const auto t_train = Clock::now();

  // The critic's values of a micro-batch, [n, T] f32: the head on the policy's
  // detached hidden states (rh), or on the separate critic's own forward.
  auto values_of = [&](const ResponseHidden& rh, const MicroBatch& mb, const PolicyLogpOptions& opts) {
    if (!critic_) return rh.to_cells(head_->forward(rh.response_rows().detach()));
    const ResponseHidden ch = response_hidden(*critic_, mb.prompts, mb.seqs, opts);
    return ch.to_cells(head_->forward(ch.response_rows()));
  };

  // 2. Old values, parity statistics and reference log-probabilities, without autograd.
  const size_t n_samples = static_cast<size_t>(N);
  std::vector<std::vector<float>> old_values(n_samples), ref_logp(n_samples), adv(n_samples), ret(n_samples);
  std::vector<std::vector<float>> train_logp(options_.use_kl_in_reward ? n_samples : 0);
  LogpParity parity;
  {
    NoGradGuard ng;
    for (int64_t b = 0, micro = 0; b < N; b += lo.mini_bs, ++micro) {
      const int64_t e = std::min(N, b + lo.mini_bs);
      const MicroBatch mb = micro_batch(r, b, e);
      const PolicyLogpOptions opts = step_logp_options(lo, state_.step, micro);
      const ResponseHidden rh = response_hidden(*model_, mb.prompts, mb.seqs, opts);
      const TokenLogp tl = token_logp(rh, *model_, lo.loss_chunk_rows);
      parity.add(tl.logp, r, b, e - b);
      if (options_.use_kl_in_reward) unpad(tl.logp, r.samples, b, train_logp);
      unpad(values_of(rh, mb, opts), r.samples, b, old_values);
      if (reference_) unpad(policy_logp(*reference_, mb.prompts, mb.seqs, opts).logp, r.samples, b, ref_logp);
    }
  }
  parity.finish(rs);

  // 3. Token rewards (the sequence's reward on its last trainable token), GAE
  // over the trainable tokens (an agent row's context is skipped), whitening.
  {
    int64_t T = 0;
    for (const RolloutSample& s : r.samples) T = std::max(T, int64_t(s.tokens.size()));
    const TokenRewards tr = ppo_token_rewards(r, T);
    Tensor token_rewards = from_vector(tr.rewards, {N, T});
    const Tensor token_mask = from_vector(tr.mask, {N, T});
    if (options_.use_kl_in_reward) {
      // verl's apply_kl_penalty: the pre-update policy (the training forward
      // of step 2) against the reference, beta from the controller.
      st.kl_in_reward = true;
      st.reward_kl_penalty_coeff = kl_ctrl_.value;
      const KlShaped k = apply_kl_penalty(token_rewards, padded(train_logp, 0, N, T, Device::cpu()),
                                          padded(ref_logp, 0, N, T, Device::cpu()), token_mask,
                                          options_.kl_penalty, kl_ctrl_.value);
      token_rewards = k.rewards;
      st.reward_kl_penalty = k.kl;
      kl_ctrl_.update(k.kl, N);
    }
    const Gae g = gae(token_rewards, padded(old_values, 0, N, T, Device::cpu()), token_mask, options_.gamma,
                      options_.lam, /*whiten=*/true);
    unpad(g.advantages, r.samples, 0, adv);
    unpad(g.returns, r.samples, 0, ret);
    double adv_sum = 0, ret_sum = 0;
    for (int64_t i = 0; i < N; ++i)
      for (size_t t = 0; t < adv[size_t(i)].size(); ++t) {
        adv_sum += adv[size_t(i)][t];
        ret_sum += ret[size_t(i)][t];
      }
    rs.advantage_mean = adv_sum / std::max<double>(1, double(tokens));
    st.returns_mean = ret_sum / std::max<double>(1, double(tokens));
  }

  // 4. The passes, each over mini-batches of ppo_mini_batch_size prompts
  // (their completions), one optimizer step each. Each micro-batch's
  // token-mean loss is weighted by its share of its mini-batch's tokens, so
  // the accumulated gradient is the mini-batch's.
  const int64_t per_prompt = std::max<int64_t>(1, options_.rollout.n_samples);
  const int64_t mini = options_.ppo_mini_batch_size > 0 ? options_.ppo_mini_batch_size * per_prompt : N;
  std::vector<std::pair<int64_t, int64_t>> minis;  // sample ranges [b, e)
  for (int64_t b = 0; b < N; b += mini) minis.emplace_back(b, std::min(N, b + mini));
  const double U = double(options_.ppo_epochs) * double(minis.size());  // updates per optimizer
  st.updates = int64_t(U);
  int64_t micro = 0;  // dropout stream
  for (int64_t epoch = 0; epoch < options_.ppo_epochs; ++epoch) {
    for (const auto& [mb_begin, mb_end] : minis) {
      int64_t mini_tokens = 0;
      for (int64_t i = mb_begin; i < mb_end; ++i) mini_tokens += trainable_tokens(r.samples[size_t(i)]);
      // The statistics: token-weighted over the batch, averaged over the passes.
      const double share = double(mini_tokens) / double(std::max<int64_t>(1, tokens)) / double(options_.ppo_epochs);
      for (int64_t b = mb_begin; b < mb_end; b += lo.mini_bs, ++micro) {
        const int64_t e = std::min(mb_end, b + lo.mini_bs);
        const int64_t n = e - b;
        const MicroBatch mb = micro_batch(r, b, e);
        const PolicyLogpOptions opts = step_logp_options(lo, state_.step, micro);
        ResponseHidden rh;
        TokenLogp tl;
        {
          // Critic warm-up: the policy's forward is data only.
          std::optional<NoGradGuard> ng;
          if (!st.policy_stepped) ng.emplace();
          rh = response_hidden(*model_, mb.prompts, mb.seqs, opts);
          tl = token_logp(rh, *model_, lo.loss_chunk_rows);
        }
        const Tensor values = values_of(rh, mb, opts);
        const int64_t T = tl.logp.size(1);
        const Device dev = tl.logp.device();
        const PpoLoss pl =
            ppo_loss(tl.logp, rollout_logp(r, b, tl.logp), padded(adv, b, n, T, dev), tl.mask, values,
                     padded(old_values, b, n, T, dev), padded(ret, b, n, T, dev), po,
                     reference_ && po.use_kl_loss ? padded(ref_logp, b, n, T, dev) : Tensor());
        const double w = double(mb.tokens) / double(std::max<int64_t>(1, mini_tokens));
        Tensor loss = mul(pl.loss, w);
        const double ws = w * share;
        rs.loss += loss.item() * share;
        if (loss.requires_grad()) loss.backward();
        rs.pg_loss += ws * pl.stats.policy.pg_loss;
        rs.ratio_mean += ws * pl.stats.policy.ratio_mean;
        rs.clip_frac += ws * pl.stats.policy.clip_frac;
        rs.kl += ws * pl.stats.policy.kl;
        st.kl_loss += ws * pl.stats.policy.kl_loss;
        st.clip_frac_lower += ws * pl.stats.policy.clip_frac_lower;
        st.vf_loss += ws * pl.stats.vf_loss;
        st.vf_clip_frac += ws * pl.stats.vf_clip_frac;
        st.value_mean += ws * pl.stats.value_mean;
      }
      // One step per mini-batch for each optimizer (each clipped on its own, as verl's actor and critic).
      if (st.policy_stepped) rs.grad_norm += clip_and_step(*optimizer_, lo.grad_clip_norm) / U;
      else optimizer_->zero_grad();
      st.critic_grad_norm += clip_and_step(*critic_optimizer_, lo.grad_clip_norm) / U;
    }
  }

  advance(state_, rs.prompts, int64_t(rows_.size()));
  rs.train_s = seconds_since(t_train);
  rs.total_s = seconds_since(t0);
  return st;
}

fs::path PpoTrainer::save_checkpoint(const fs::path& save_path, const fs::path& source,
                                     const std::function<void(const fs::path&)>& add_files) const {
  json st = trainer_state_json(state_, total_steps(), options_.loop.seed);
  st["algo"] = "ppo";
  st["critic"] = critic_ ? "separate" : "value_head";
  st["critic_warmup_steps"] = options_.critic_warmup_steps;
  if (options_.use_kl_in_reward) st["kl_ctrl_value"] = kl_ctrl_.value;  // the adaptive coefficient after this step
  st["run"] = run_keys();
  st["rollout_runs"] = rollout_runs(rollout_, agent_.get());
  return save_step_folder(*model_, *optimizer_, state_.step, save_path, source, st, [&](const fs::path& tmp) {
    if (add_files) add_files(tmp);
    const fs::path dir = critic_ ? tmp / "critic" : tmp;
    if (critic_) {
      phi4mm::save_model(*critic_, dir.string());
      if (add_files) add_files(dir);
    }
    head_->save(dir);
    fs::create_directories(tmp / "optimizer");
    critic_optimizer_->save_state((tmp / "optimizer" / "critic_optimizer.safetensors").string());
    sync_dir(dir.string());
  });
}

json PpoTrainer::run_keys() const {
  json k = rollout_run_keys(rows_, options_.loop, options_.rollout, "ppo");
  k["--critic-ckpt"] = critic_ != nullptr;
  k["--critic-warmup-steps"] = options_.critic_warmup_steps;
  k["--use-kl-loss"] = options_.ppo.use_kl_loss;
  if (options_.use_kl_in_reward) k["--use-kl-in-reward"] = true;  // (only then: earlier checkpoints keep their keys)
  if (options_.ppo_mini_batch_size > 0) k["--ppo-mini-batch-size"] = options_.ppo_mini_batch_size;
  if (agent_) k.update(agent_run_keys(options_.agent));  // (only then: engine runs' checkpoints keep their keys)
  k.update(options_.run_keys);
  return k;
}

void PpoTrainer::load_state(const fs::path& step_dir) {
  int64_t runs = 0;
  const SavedState saved = load_rollout_state(step_dir, run_keys(), int64_t(rows_.size()), *optimizer_, runs);
  const TrainerState& s = saved.state;
  if (options_.use_kl_in_reward) {
    if (!saved.json.contains("kl_ctrl_value") || !saved.json["kl_ctrl_value"].is_number())
      throw std::runtime_error(fmt::format("{}: trainer_state.json: no kl_ctrl_value (--use-kl-in-reward)",
                                           step_dir.string()));
    kl_ctrl_.value = saved.json["kl_ctrl_value"].get<double>();
  }
  head_->load((critic_ ? step_dir / "critic" : step_dir) / kValueHeadFile);
  critic_optimizer_->load_state((step_dir / "optimizer" / "critic_optimizer.safetensors").string());
  set_rollout_runs(rollout_, agent_.get(), runs);
  state_ = s;
}

Scalars ppo_scalars(const PpoStepStats& st) {
  Scalars s = rl_scalars(st.rl);
  s.insert(s.end(), {{"vf_loss", st.vf_loss},
                     {"vf_clip_frac", st.vf_clip_frac},
                     {"value_mean", st.value_mean},
                     {"returns_mean", st.returns_mean},
                     {"kl_loss", st.kl_loss},
                     {"clip_frac_lower", st.clip_frac_lower},
                     {"critic_grad_norm", st.critic_grad_norm},
                     {"policy_stepped", st.policy_stepped ? 1.0 : 0.0},
                     {"updates", double(st.updates)}});
  if (st.kl_in_reward)
    s.insert(s.end(), {{"reward_kl_penalty", st.reward_kl_penalty},
                       {"reward_kl_penalty_coeff", st.reward_kl_penalty_coeff}});
  return s;
}

std::string format_ppo_progress(const PpoStepStats& st, int64_t total_steps) {
  return format_rl_progress(st.rl, total_steps,
                            fmt::format("vf_loss {:.4f}  vf_clip {:.3f}  value {:.3f}  returns {:.3f}{}", st.vf_loss,
                                        st.vf_clip_frac, st.value_mean, st.returns_mean,
                                        st.policy_stepped ? "" : "  (critic warm-up)"));
}

}  // namespace areno::train::rl
