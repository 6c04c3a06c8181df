// The PPO loop (issue 15; docs/rl.md, "The PPO loop"): one step end to end on
// the demo model with a built-in reward, the value head's values and gradient
// against a direct computation (row alignment, finite differences), critic
// warm-up (the policy bitwise unchanged, the head moves), micro-batch
// accumulation equal to one batch over two PPO epochs, mini-batches (one
// update each, one learning rate per step), the KL loss against a frozen
// reference, the KL penalty in the reward with verl's adaptive coefficient,
// and `areno train --algo ppo` (metrics, checkpoints, --critic-ckpt, flag errors).
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/commands_train.h"
#include "models/phi4mm/demo/demo.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tests/rl/rl_fixtures.h"
#include "tests/test_util.h"
#include "tests/train/train_fixtures.h"
#include "train/rl/ppo.h"

using namespace areno;
using namespace areno::train::rl;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::shared_ptr<const tok::Tokenizer> tokenizer() { return testing::phi4_tokenizer(); }

// {"prompt": "What is a <op> b?", "response": the answer}: the demo model
// answers sums, mostly not products, so exact-match rewards are mixed.
std::vector<train::PromptRow> arithmetic_prompts(int n) {
  std::vector<json> rows;
  for (int i = 0; i < n; ++i) {
    const int a = 1 + i % 3, b = 1 + (i / 3) % 3;
    const bool times = i % 2 == 1;
    rows.push_back({{"prompt", fmt::format("What is {} {} {}?", a, times ? "times" : "+", b)},
                    {"response", std::to_string(times ? a * b : a + b)}});
  }
  return testing::prompt_rows(rows);
}

// Not constant across samples whatever the model samples: tokens mod 3 plus the prompt index.
struct SpreadReward : RewardFn {
  std::vector<double> score(const std::vector<RewardInput>& in) override {
    std::vector<double> out;
    for (const RewardInput& r : in) out.push_back(double(r.completion_tokens % 3) + 0.5 * double(r.prompt_index));
    return out;
  }
};

PpoTrainOptions options(int64_t mini_bs) {
  PpoTrainOptions o;
  o.loop = testing::small_rl_loop(mini_bs);
  o.rollout = testing::small_rollout(2);
  return o;
}

std::map<std::string, std::vector<float>> snapshot(const Module& m) { return testing::param_snapshot(m); }

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::abs(x)));
  return m;
}

}  // namespace

TEST_CASE("rl/ppo token rewards: the outcome on each row's last trainable token, turn rewards on their turns' ends") {
  // Trajectory 0: one row with two turns. Trajectory 1: split into two rows,
  // the first turn's end masked (moved back to a trainable token), the second
  // row's turns at -1 and on context (moved forward to its first trainable
  // token). Trajectory 2: an engine row (every token trainable), and a row
  // with nothing trainable.
  ScoredRollouts r;
  r.samples.resize(5);
  r.samples[0].tokens = {1, 2, 3, 4, 5};
  r.samples[0].trainable = {1, 1, 0, 0, 1};
  r.samples[0].turn_rewards = {{1, 0.5}, {4, 0.25}};
  r.samples[1].tokens = {1, 2, 3};
  r.samples[1].trainable = {1, 0, 0};
  r.samples[1].turn_rewards = {{2, 1.0}};
  r.samples[2].tokens = {1, 2, 3};
  r.samples[2].trainable = {0, 1, 1};
  r.samples[2].turn_rewards = {{-1, 0.125}, {0, 0.0625}};
  r.samples[3].tokens = {1, 2};
  r.samples[4].tokens = {1, 2};
  r.samples[4].trainable = {0, 0};
  r.samples[4].turn_rewards = {{1, 9.0}};
  r.trajectories.resize(4);
  r.trajectories[0].rows = {0};
  r.trajectories[1].rows = {1, 2};
  r.trajectories[2].rows = {3};
  r.trajectories[3].rows = {4};
  r.outcomes = {2.0, 3.0, 7.0, 5.0};
  const int64_t T = 6;
  const TokenRewards tr = ppo_token_rewards(r, T);
  CHECK(tr.rewards == std::vector<float>{0, 0.5f, 0, 0, 2.25f, 0,   //
                                         4.0f, 0, 0, 0, 0, 0,       //
                                         0, 0.1875f, 3.0f, 0, 0, 0, //
                                         0, 7.0f, 0, 0, 0, 0,       //
                                         0, 0, 0, 0, 0, 0});
  CHECK(tr.mask == std::vector<float>{1, 1, 0, 0, 1, 0,  //
                                      1, 0, 0, 0, 0, 0,  //
                                      0, 1, 1, 0, 0, 0,  //
                                      1, 1, 0, 0, 0, 0,  //
                                      0, 0, 0, 0, 0, 0});
  r.outcomes.pop_back();
  CHECK_THROWS_AS(ppo_token_rewards(r, T), std::logic_error);
}

TEST_CASE("rl/ppo one step on the demo model with --reward exact") {
  auto model = phi4mm::demo_model();
  const auto before = snapshot(*model);
  PpoTrainOptions o = options(3);
  o.loop.batch_size = 4;
  o.rollout.n_samples = 2;
  o.loop.grad_clip_norm = 1.0;
  PpoTrainer tr(model, tokenizer(), arithmetic_prompts(4), o, make_reward("exact"));
  const PpoStepStats st = tr.step();
  const RlStepStats& r = st.rl;
  MESSAGE(format_ppo_progress(st, tr.total_steps()));
  CHECK(r.samples == 8);
  CHECK(r.reward_mean >= 0.0);
  CHECK(r.reward_mean <= 1.0);
  // Before any update the training forward sees what the engine saw.
  CHECK(r.logp_abs_diff_mean < 1e-5);
  CHECK(r.ratio_mean == doctest::Approx(1.0).epsilon(1e-4));
  CHECK(r.clip_frac == 0.0);
  // A zero-initialised head: values 0, so (gamma = lam = 1) every token's
  // return is its sequence's reward and the token mean of the returns is the
  // token-weighted reward mean; the whitened advantages have mean 0.
  CHECK(st.value_mean == 0.0);
  double weighted = 0;
  for (size_t i = 0; i < r.rewards.size(); ++i) weighted += r.rewards[i];
  CHECK(st.returns_mean >= 0.0);
  CHECK(st.returns_mean <= 1.0);
  if (r.response_len == 2.0) CHECK(st.returns_mean == doctest::Approx(r.reward_mean));  // equal lengths
  CHECK(std::abs(r.advantage_mean) < 1e-6);
  CHECK(st.vf_clip_frac == 0.0);  // the first pass's values are the old values
  CHECK(st.vf_loss >= 0.0);
  CHECK(st.policy_stepped);
  CHECK(std::isfinite(r.loss));
  CHECK(r.lrs.back().first == "critic");
  CHECK(r.lrs.back().second == doctest::Approx(1e-3));
  const bool mixed = r.reward_mean > 0 && r.reward_mean < 1;
  MESSAGE("rewards mixed: " << mixed << " (sum " << weighted << ")");
  REQUIRE(mixed);  // seed 7: sums right, products mostly wrong
  // The policy moved (lm group), the head learned from (v - R) h.
  CHECK(r.grad_norm > 0);
  CHECK(st.critic_grad_norm > 0);
  CHECK(max_abs(tr.value_head().weight.to_vector<float>()) > 0);
  CHECK(snapshot(*model) != before);
  CHECK(tr.rollout().last_stats().kv_blocks_used == 0);
}

TEST_CASE("rl/ppo value head: values at the row before each token, gradient against a direct computation and "
          "finite differences") {
  auto model = testing::tiny_phi4mm();
  const int64_t H = model->config().text.hidden_size;
  ValueHead head(H, Device::cpu());
  {
    NoGradGuard ng;
    std::vector<float> w(static_cast<size_t>(H));
    for (int64_t j = 0; j < H; ++j) w[size_t(j)] = float(std::sin(0.37 * double(j + 1))) * 0.5f;
    head.weight.copy_(from_vector(w, {1, H}));
    head.bias.copy_(from_vector(std::vector<float>{0.25f}, {1}));
  }
  const std::vector<Prompt> prompts = {{{200021, 10, 11, 12, 200020, 200019}, {}, phi4mm::Adapter::none},
                                       {{200021, 20, 21, 200020, 200019}, {}, phi4mm::Adapter::none}};
  const std::vector<Sequence> seqs = {{0, {30, 31, 32}, {}}, {1, {40}, {}}, {0, {50, 51}, {}}};
  const ResponseHidden rh = response_hidden(*model, prompts, seqs);
  const Tensor values = rh.to_cells(head.forward(rh.response_rows().detach()));
  REQUIRE(values.shape() == Shape{3, 3});
  CHECK(values.requires_grad());

  // Each value against head(hidden of the unpacked sequence at the row before the token).
  const std::vector<float> v = values.to_vector<float>();
  const std::vector<float> w = head.weight.to_vector<float>();
  for (size_t n = 0; n < seqs.size(); ++n) {
    std::vector<int64_t> ids = prompts[size_t(seqs[n].prompt)].ids;
    ids.insert(ids.end(), seqs[n].completion.begin(), seqs[n].completion.end());
    NoGradGuard ng;
    const std::vector<float> hs = model->hidden_states(phi4mm::PackedBatch::single(ids)).to_vector<float>();
    const size_t P = prompts[size_t(seqs[n].prompt)].ids.size();
    for (size_t t = 0; t < 3; ++t) {
      CAPTURE(n);
      CAPTURE(t);
      if (t >= seqs[n].completion.size()) {
        CHECK(v[n * 3 + t] == 0.0f);
        continue;
      }
      double direct = 0.25;
      for (int64_t j = 0; j < H; ++j) direct += double(w[size_t(j)]) * hs[(P - 1 + t) * size_t(H) + size_t(j)];
      CHECK(v[n * 3 + t] == doctest::Approx(direct).epsilon(1e-5));
    }
  }

  // A trainable mask (an agent row's context): the same packed forward, the
  // masked tokens fed but not listed, so the values and log-probabilities of
  // the trainable tokens are the unmasked ones and the masked cells are 0.
  {
    NoGradGuard ng;
    std::vector<Sequence> masked = seqs;
    masked[0].trainable = {1, 0, 1};
    masked[2].trainable = {0, 1};
    const ResponseHidden mh = response_hidden(*model, prompts, masked);
    CHECK(mh.cells == std::vector<int64_t>{0, 2, 3, 7});
    CHECK(mh.targets == std::vector<int64_t>{30, 32, 40, 51});
    CHECK(mh.mask.to_vector<float>() == std::vector<float>{1, 0, 1, 1, 0, 0, 0, 1, 0});
    const std::vector<float> mv = mh.to_cells(head.forward(mh.response_rows())).to_vector<float>();
    const std::vector<float> lp = token_logp(rh, *model).logp.to_vector<float>();
    const std::vector<float> mlp = token_logp(mh, *model).logp.to_vector<float>();
    for (size_t c = 0; c < 9; ++c) {
      CAPTURE(c);
      const bool on = mh.mask.to_vector<float>()[c] != 0;
      CHECK(mv[c] == (on ? doctest::Approx(v[c]).epsilon(1e-6) : doctest::Approx(0.0)));
      CHECK(mlp[c] == (on ? doctest::Approx(lp[c]).epsilon(1e-6) : doctest::Approx(0.0)));
    }
  }

  // The value loss alone (A = 0, a wide value clip): grad_w = sum_k (v_k - R_k) h_k / tokens.
  const Tensor mask = rh.mask;
  const Tensor zero = zeros({3, 3});
  const std::vector<float> R = {1.0f, -0.5f, 2.0f, 0.3f, 0, 0, -1.0f, 0.7f, 0};
  const Tensor returns = from_vector(R, {3, 3});
  PpoOptions po;
  po.value_clip_eps = 100;
  auto loss_at = [&](const ValueHead& h) {
    const Tensor vals = rh.to_cells(h.forward(rh.response_rows().detach()));
    return ppo_loss(zero, zero, zero, mask, vals, vals.detach(), returns, po);
  };
  PpoLoss pl = loss_at(head);
  pl.loss.backward();
  const std::vector<float> g = head.weight.grad().to_vector<float>();
  // No gradient reaches the policy through the detached hidden states.
  CHECK_FALSE(model->model->embed_tokens->weight.grad().defined());
  std::vector<double> direct(static_cast<size_t>(H), 0.0);
  double gb = 0;
  {
    NoGradGuard ng;
    const std::vector<float> hr = rh.response_rows().to_vector<float>();
    const int64_t K = int64_t(rh.cells.size());
    for (int64_t k = 0; k < K; ++k) {
      const size_t c = size_t(rh.cells[size_t(k)]);
      const double e = double(v[c]) - double(R[c]);
      gb += e / double(K);
      for (int64_t j = 0; j < H; ++j) direct[size_t(j)] += e * hr[size_t(k * H + j)] / double(K);
    }
  }
  double worst = 0, scale = 0;
  for (int64_t j = 0; j < H; ++j) {
    worst = std::max(worst, std::abs(double(g[size_t(j)]) - direct[size_t(j)]));
    scale = std::max(scale, std::abs(direct[size_t(j)]));
  }
  MESSAGE("value head grad vs direct: max abs err " << worst << " (scale " << scale << ")");
  CHECK(worst <= 1e-5 * scale);
  CHECK(head.bias.grad().item() == doctest::Approx(gb).epsilon(1e-5));
  // Central differences of the loss (the value loss is quadratic in w: exact up to rounding).
  for (int64_t j : {int64_t(0), H / 2, H - 1}) {
    const double eps = 1e-2;
    double f[2];
    for (int s = 0; s < 2; ++s) {
      ValueHead hp(H, Device::cpu());
      NoGradGuard ng;
      hp.weight.copy_(head.weight.detach());
      hp.bias.copy_(head.bias.detach());
      std::vector<float> wv = hp.weight.to_vector<float>();
      wv[size_t(j)] += float(s == 0 ? eps : -eps);
      hp.weight.copy_(from_vector(wv, {1, H}));
      f[s] = loss_at(hp).loss.item();
    }
    const double fd = (f[0] - f[1]) / (2 * eps);
    CAPTURE(j);
    CHECK(fd == doctest::Approx(double(g[size_t(j)])).epsilon(2e-3).scale(1e-4));
  }
}

TEST_CASE("rl/ppo critic warm-up: the policy is bitwise unchanged, the value head moves") {
  auto model = testing::tiny_phi4mm();
  const auto before = snapshot(*model);
  PpoTrainOptions o = options(4);
  o.critic_warmup_steps = 1;
  o.critic_lr = 1e-2;
  PpoTrainer tr(model, tokenizer(), arithmetic_prompts(4), o, std::make_unique<SpreadReward>());
  const PpoStepStats st = tr.step();
  CHECK_FALSE(st.policy_stepped);
  CHECK(st.rl.grad_norm == 0.0);
  CHECK(st.critic_grad_norm > 0);
  CHECK(snapshot(*model) == before);
  const std::vector<float> w1 = tr.value_head().weight.to_vector<float>();
  CHECK(max_abs(w1) > 0);
  CHECK(tr.value_head().bias.item() != 0.0);
  CHECK(tr.optimizer().step_count() == 0);
  CHECK(tr.critic_optimizer().step_count() == 1);
  // The next step is past the warm-up: both move.
  const PpoStepStats st2 = tr.step();
  CHECK(st2.policy_stepped);
  CHECK(st2.rl.grad_norm > 0);
  CHECK(st2.value_mean != 0.0);
  CHECK(snapshot(*model) != before);
  CHECK(tr.value_head().weight.to_vector<float>() != w1);
}

TEST_CASE("rl/ppo micro-batches accumulate to the one-batch update (two PPO epochs)") {
  std::vector<PpoStepStats> st;
  std::vector<std::vector<float>> heads, embeds;
  for (int64_t mini : {4, 1}) {
    PpoTrainOptions o = options(mini);
    o.ppo_epochs = 2;
    o.rollout.drop_rollout_state = true;
    auto model = testing::tiny_phi4mm();
    PpoTrainer tr(model, tokenizer(), arithmetic_prompts(4), o, std::make_unique<SpreadReward>());
    st.push_back(tr.step());
    heads.push_back(tr.value_head().weight.to_vector<float>());
    embeds.push_back(model->model->embed_tokens->weight.to_vector<float>());
  }
  MESSAGE(fmt::format("mini-bs 4 / 1: loss {} / {}, grad_norm {} / {}, critic_grad_norm {} / {}, vf_loss {} / {}",
                      st[0].rl.loss, st[1].rl.loss, st[0].rl.grad_norm, st[1].rl.grad_norm, st[0].critic_grad_norm,
                      st[1].critic_grad_norm, st[0].vf_loss, st[1].vf_loss));
  CHECK(st[1].rl.rewards == st[0].rl.rewards);
  CHECK(st[1].rl.loss == doctest::Approx(st[0].rl.loss).epsilon(1e-5));
  CHECK(st[1].rl.grad_norm == doctest::Approx(st[0].rl.grad_norm).epsilon(1e-5));
  CHECK(st[1].critic_grad_norm == doctest::Approx(st[0].critic_grad_norm).epsilon(1e-5));
  CHECK(st[1].vf_loss == doctest::Approx(st[0].vf_loss).epsilon(1e-5));
  CHECK(st[1].returns_mean == doctest::Approx(st[0].returns_mean).epsilon(1e-6));
  CHECK(st[0].rl.grad_norm > 0);
  // The second pass sees the first pass's update: ratios away from 1.
  CHECK(st[0].rl.ratio_mean != 1.0);
  double worst = 0;
  for (size_t j = 0; j < heads[0].size(); ++j) worst = std::max(worst, double(std::abs(heads[0][j] - heads[1][j])));
  MESSAGE("value head max |diff| " << worst);
  CHECK(worst < 1e-6);
  double worst_e = 0;
  for (size_t j = 0; j < embeds[0].size(); ++j)
    worst_e = std::max(worst_e, double(std::abs(embeds[0][j] - embeds[1][j])));
  MESSAGE("embedding max |diff| " << worst_e);
  CHECK(worst_e < 1e-6);
}

TEST_CASE("rl/ppo mini-batches: one update per mini-batch, accumulation inside it, one learning rate per step") {
  // 2 prompts x 2 samples, 2 passes of 2 mini-batches (one prompt each): 4 updates per optimizer.
  auto run = [](int64_t mini_bs, int64_t ppo_mini, int64_t epochs) {
    PpoTrainOptions o = options(mini_bs);
    o.ppo_epochs = epochs;
    o.ppo_mini_batch_size = ppo_mini;
    o.loop.decay = train::DecayStyle::cosine;
    o.loop.lr_decay_steps = 3;
    auto model = testing::tiny_phi4mm();
    PpoTrainer tr(model, tokenizer(), arithmetic_prompts(4), o, std::make_unique<SpreadReward>());
    std::vector<PpoStepStats> st{tr.step(), tr.step()};
    CHECK(tr.optimizer().step_count() == 2 * st[0].updates);
    CHECK(tr.critic_optimizer().step_count() == 2 * st[0].updates);
    return std::make_pair(st, model->model->embed_tokens->weight.to_vector<float>());
  };
  const auto [a, ea] = run(2, 1, 2);  // micro-batch = mini-batch
  const auto [b, eb] = run(1, 1, 2);  // two micro-batches per mini-batch
  const auto [c, ec] = run(4, 0, 2);  // the whole batch per update
  const auto [d, ed] = run(4, 0, 1);  // one update per step
  CHECK(a[0].updates == 4);
  CHECK(c[0].updates == 2);
  CHECK(d[0].updates == 1);
  CHECK(b[0].rl.loss == doctest::Approx(a[0].rl.loss).epsilon(1e-5));
  CHECK(b[1].rl.grad_norm == doctest::Approx(a[1].rl.grad_norm).epsilon(1e-5));
  CHECK(b[1].critic_grad_norm == doctest::Approx(a[1].critic_grad_norm).epsilon(1e-5));
  double same = 0, apart = 0;
  for (size_t j = 0; j < ea.size(); ++j) {
    same = std::max(same, double(std::abs(ea[j] - eb[j])));
    apart = std::max(apart, double(std::abs(ea[j] - ec[j])));
  }
  MESSAGE("embeddings: mini-bs 2 vs 1 within mini-batches " << same << "; mini-batches vs whole batches " << apart);
  CHECK(same < 1e-5);   // 8 AdamW updates of 1e-3: reassociation, amplified by the first steps' normalisation
  CHECK(apart > 1e-3);  // four updates a step are not two
  // The learning rates are the training step's, however many updates it takes (cosine over 3 steps).
  for (const auto* st : {&a, &c}) {
    REQUIRE((*st)[1].rl.lrs.size() == d[1].rl.lrs.size());
    for (size_t g = 0; g < d[1].rl.lrs.size(); ++g) {
      CAPTURE(d[1].rl.lrs[g].first);
      CHECK((*st)[1].rl.lrs[g].second == d[1].rl.lrs[g].second);
    }
  }
  CHECK(d[1].rl.lrs[0].second < d[0].rl.lrs[0].second);  // it does move, once per step
}

TEST_CASE("rl/ppo KL in the reward: none at the reference, then shaped; verl's adaptive coefficient") {
  PpoTrainOptions o = options(4);
  o.use_kl_in_reward = true;
  o.kl_penalty = KlPenalty::kl;
  o.kl_ctrl.adaptive = true;
  o.kl_ctrl.value = 0.1;
  o.kl_ctrl.target = 0.01;
  o.kl_ctrl.horizon = 10;
  CHECK_THROWS_WITH_AS(PpoTrainer(testing::tiny_phi4mm(), tokenizer(), arithmetic_prompts(4), o,
                                  std::make_unique<SpreadReward>()),
                       doctest::Contains("--use-kl-in-reward"), std::invalid_argument);
  auto reference = testing::tiny_phi4mm();
  const auto ref_before = snapshot(*reference);
  PpoTrainer tr(testing::tiny_phi4mm(), tokenizer(), arithmetic_prompts(4), o, std::make_unique<SpreadReward>(),
                nullptr, reference);
  const PpoStepStats s1 = tr.step();
  CHECK(s1.kl_in_reward);
  CHECK(s1.reward_kl_penalty == 0.0);  // the policy is the reference: the same forward, bit for bit
  CHECK(s1.reward_kl_penalty_coeff == 0.1);
  const int64_t N = s1.rl.samples;
  CHECK(tr.kl_controller().value == doctest::Approx(0.1 * (1 - 0.2 * double(N) / 10)).epsilon(1e-15));
  const PpoStepStats s2 = tr.step();
  MESSAGE("reward_kl_penalty step 2 " << s2.reward_kl_penalty << ", coefficient " << s2.reward_kl_penalty_coeff
                                      << " -> " << tr.kl_controller().value);
  CHECK(s2.reward_kl_penalty != 0.0);
  CHECK(s2.reward_kl_penalty_coeff == doctest::Approx(0.1 * (1 - 0.2 * double(N) / 10)).epsilon(1e-15));
  const double err = std::clamp(s2.reward_kl_penalty / 0.01 - 1, -0.2, 0.2);
  CHECK(tr.kl_controller().value ==
        doctest::Approx(s2.reward_kl_penalty_coeff * (1 + err * double(N) / 10)).epsilon(1e-12));
  CHECK(snapshot(*reference) == ref_before);
  // The penalty reaches the returns: the same step without it gives other returns.
  PpoTrainOptions plain = options(4);
  PpoTrainer tp(testing::tiny_phi4mm(), tokenizer(), arithmetic_prompts(4), plain, std::make_unique<SpreadReward>());
  const PpoStepStats p1 = tp.step();
  CHECK(p1.returns_mean == s1.returns_mean);  // no penalty at the reference
  const train::Scalars sc = ppo_scalars(s2);
  CHECK(std::any_of(sc.begin(), sc.end(), [](const auto& kv) { return kv.first == "reward_kl_penalty_coeff"; }));
  const train::Scalars sp = ppo_scalars(p1);
  CHECK(std::none_of(sp.begin(), sp.end(), [](const auto& kv) { return kv.first == "reward_kl_penalty"; }));
}

TEST_CASE("rl/ppo KL loss to a frozen reference") {
  PpoTrainOptions o = options(4);
  o.ppo.use_kl_loss = true;
  o.ppo.kl_loss_coef = 0.1;
  CHECK_THROWS_WITH_AS(PpoTrainer(testing::tiny_phi4mm(), tokenizer(), arithmetic_prompts(4), o,
                                  std::make_unique<SpreadReward>()),
                       doctest::Contains("--use-kl-loss"), std::invalid_argument);
  auto reference = testing::tiny_phi4mm();
  const auto ref_before = snapshot(*reference);
  PpoTrainer tr(testing::tiny_phi4mm(), tokenizer(), arithmetic_prompts(4), o, std::make_unique<SpreadReward>(),
                nullptr, reference);
  const PpoStepStats s1 = tr.step();
  CHECK(s1.kl_loss == doctest::Approx(0.0).scale(1e-6));  // the policy is the reference
  const PpoStepStats s2 = tr.step();
  MESSAGE("kl_loss step 1 " << s1.kl_loss << ", step 2 " << s2.kl_loss);
  CHECK(s2.kl_loss > 1e-9);
  CHECK(snapshot(*reference) == ref_before);
}

TEST_CASE("areno train --algo ppo: metrics, value head checkpoints, --critic-ckpt and flag errors") {
  testing::TempDir dir;
  {
    std::ofstream out(dir.path / "prompts.jsonl");
    for (int a = 1; a <= 4; ++a)
      out << json{{"prompt", fmt::format("What is {} times 2?", a)}, {"response", std::to_string(a * 2)}}.dump()
          << "\n";
  }
  const std::string prompts = dir.str("prompts.jsonl");
  const std::string mdir = dir.str("metrics");
  CHECK(app::cmd_train({"--algo", "ppo", "--dataset-path", prompts, "--reward", "exact", "--batch-size", "2",
                        "--n-samples", "2", "--mini-bs", "2", "--max-new-tokens", "4", "--max-steps", "2", "--lr",
                        "1e-4", "--critic-lr", "1e-2", "--temperature", "1.2", "--metrics-log-dir", mdir,
                        "--save-path", dir.str("save"), "--drop-rollout-state"}) == 0);
  const std::vector<json> lines = testing::metrics_lines(mdir);
  REQUIRE(lines.size() == 2);
  for (size_t i = 0; i < lines.size(); ++i) {
    const json& j = lines[i];
    CHECK(j["step"] == int64_t(i + 1));
    for (const char* key : {"reward_mean", "advantage_mean", "response_len", "rollout_logprobs_mean",
                            "train_logprobs_mean", "logp_diff_mean", "logp_abs_diff_mean", "ratio_mean", "clip_frac",
                            "kl", "loss", "pg_loss", "grad_norm", "vf_loss", "vf_clip_frac", "value_mean",
                            "returns_mean", "critic_grad_norm", "lr/critic", "lr/lm", "time/rollout_s",
                            "time/train_s", "time/total_s"}) {
      CAPTURE(key);
      REQUIRE(j.contains(key));
      CHECK(j[key].is_number());
    }
    CHECK(j["logp_abs_diff_mean"].get<double>() < 1e-5);
    CHECK(j["samples"].get<double>() == 4.0);
  }
  CHECK(lines[0]["lr/critic"].get<double>() == doctest::Approx(1e-2));  // cosine: 5e-3 at step 2 of 2
  CHECK(lines[1]["lr/critic"].get<double>() == doctest::Approx(5e-3));
  CHECK(lines[0]["value_mean"].get<double>() == 0.0);  // the zero-initialised head
  const fs::path step2 = dir.path / "save" / "step-2";
  REQUIRE(fs::exists(step2 / "value_head.safetensors"));
  CHECK(fs::exists(step2 / "optimizer" / "critic_optimizer.safetensors"));
  const json ts = json::parse(std::ifstream(step2 / "trainer_state.json"));
  CHECK(ts["algo"] == "ppo");
  CHECK(ts["critic"] == "value_head");

  // A run from the step folder starts from its value head (nonzero values at
  // once); with --critic-ckpt the same folder is a separate critic, saved under critic/.
  ValueHead saved(phi4mm::demo_model()->config().text.hidden_size, Device::cpu());
  saved.load(step2 / "value_head.safetensors");
  const bool head_moved = max_abs(saved.weight.to_vector<float>()) > 0 || saved.bias.item() != 0.0;
  MESSAGE("saved head moved: " << head_moved);
  for (const bool separate : {false, true}) {
    const std::string m2 = dir.str(separate ? "metrics-critic" : "metrics-resumed");
    std::vector<std::string> args = {"--algo", "ppo", "--dataset-path", prompts, "--reward", "exact",
                                     "--batch-size", "2", "--n-samples", "1", "--max-new-tokens", "4",
                                     "--max-steps", "1", "--metrics-log-dir", m2, "--save-path",
                                     dir.str(separate ? "save-critic" : "save-resumed")};
    if (separate) args.insert(args.end(), {"--critic-ckpt", step2.string()});
    else args.insert(args.end(), {"--ckpt", step2.string()});
    CHECK(app::cmd_train(args) == 0);
    const std::vector<json> lines2 = testing::metrics_lines(m2);
    REQUIRE(lines2.size() == 1);
    const json& j = lines2[0];
    if (head_moved) CHECK(j["value_mean"].get<double>() != 0.0);
  }
  CHECK(fs::exists(dir.path / "save-critic" / "step-1" / "critic" / "value_head.safetensors"));
  CHECK(fs::exists(dir.path / "save-critic" / "step-1" / "critic" / "config.json"));
  CHECK(json::parse(std::ifstream(dir.path / "save-critic" / "step-1" / "trainer_state.json"))["critic"] == "separate");

  auto refused = [&](std::vector<std::string> extra, const char* flag) {
    std::vector<std::string> args = {"--algo", "ppo", "--dataset-path", prompts, "--reward", "exact"};
    args.insert(args.end(), extra.begin(), extra.end());
    CAPTURE(flag);
    CHECK_THROWS_WITH_AS(app::cmd_train(args), doctest::Contains(flag), std::invalid_argument);
  };
  refused({"--clip-eps", "1.5"}, "--clip-eps");
  refused({"--gamma", "1.5"}, "--gamma");
  refused({"--lam", "2"}, "--lam");
  refused({"--clip-ratio-c", "0.5"}, "--clip-ratio-c");
  refused({"--value-clip-eps", "0"}, "--value-clip-eps");
  refused({"--kl-loss-type", "k1"}, "--kl-loss-type");
  refused({"--critic-ckpt", dir.str("nowhere")}, "--critic-ckpt");
  refused({"--train-tool-results"}, "--train-tool-results: only with --agent-cmd");
  refused({"--max-running-prompts", "0"}, "--max-running-prompts");
  refused({"--max-context-len", "0"}, "--max-context-len");
  refused({"--ppo-mini-batch-size", "3", "--batch-size", "2"}, "--ppo-mini-batch-size");
  refused({"--kl-penalty", "full"}, "--kl-penalty: 'full'");
  refused({"--kl-ctrl", "pid"}, "--kl-ctrl: 'pid'");
  refused({"--use-kl-in-reward", "--kl-target", "0"}, "--kl-target");
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "grpo", "--dataset-path", prompts, "--reward", "exact",
                                       "--use-kl-in-reward"}),
                       doctest::Contains("--use-kl-in-reward: only with --algo ppo"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "sft", "--dataset-path", prompts, "--max-running-prompts", "2"}),
                       doctest::Contains("--max-running-prompts"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "grpo", "--dataset-path", prompts, "--reward", "exact",
                                       "--critic-ckpt", step2.string()}),
                       doctest::Contains("--critic-ckpt"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "ppo", "--dataset-path", prompts}), doctest::Contains("--reward"),
                       std::invalid_argument);
}
