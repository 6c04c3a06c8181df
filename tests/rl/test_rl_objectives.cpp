// The RL objectives against PyTorch (issue 15, must-show 1): GRPO, GSPO, DPO
// and PPO losses, statistics and gradients equal a direct float64 PyTorch
// implementation of the published formulas (tests/reference/rl/make_rl_golden.py,
// tests/data/rl/rl_golden.safetensors) on fixed inputs with ratios exactly on
// and beyond the clip bounds, a group of equal rewards, masked positions
// holding NaN and inf, and sequences of different lengths; plus invariants
// that hold whatever the golden says.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "nn/io/safetensors.h"
#include "tensor/ops.h"
#include "tests/test_util.h"
#include "train/rl/objectives.h"

using namespace areno;
using namespace areno::train::rl;

namespace {

constexpr double kRel = 1e-6;

const SafetensorsFile& golden() {
  static const SafetensorsFile g("tests/data/rl/rl_golden.safetensors");
  return g;
}
Tensor G(const std::string& name) { return golden().load_copy(name); }
double S(const std::string& name) { return G(name).item(); }
Tensor leaf(const std::string& name) { return G(name).set_requires_grad(); }

// max |a - b| / max |b| over the tensor: the error on the tensor's own scale.
double rel(const Tensor& a, const Tensor& b) {
  const double scale = max(abs(b.to(DType::f64))).item();
  return max_abs_diff(a.to(DType::f64), b.to(DType::f64)) / std::max(scale, 1e-300);
}
// A statistic may be 0 (a mean advantage); then the error is absolute.
double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

// The worst relative error of each kind over the whole file, printed once.
struct Worst {
  double loss = 0, grad = 0, stat = 0;
  ~Worst() {
    std::printf("rl-objectives: worst relative error vs torch: loss %.2e, gradient %.2e, statistics %.2e\n", loss,
                grad, stat);
  }
} worst;

void check_loss(const Tensor& loss, const std::string& name) {
  CAPTURE(name);
  REQUIRE(loss.numel() == 1);
  const double e = rel(loss.item(), S(name));
  worst.loss = std::max(worst.loss, e);
  CHECK(e < kRel);
}
void check_grad(const Tensor& leaf, const std::string& name) {
  CAPTURE(name);
  REQUIRE(leaf.grad().defined());
  const double e = rel(leaf.grad(), G(name));
  worst.grad = std::max(worst.grad, e);
  CHECK(e < kRel);
}
void check_stat(double value, const std::string& name) {
  CAPTURE(name);
  const double e = rel(value, S(name));
  worst.stat = std::max(worst.stat, e);
  CHECK(e < kRel);
}

// All of x's elements at mask-0 positions are exactly 0 (and none is NaN).
bool zero_where_masked(const Tensor& x, const Tensor& mask) {
  const auto v = x.to(DType::f64).contiguous().to_vector<double>();
  const auto m = mask.to(DType::f64).contiguous().to_vector<double>();
  for (size_t k = 0; k < v.size(); ++k)
    if (m[k] == 0 && v[k] != 0) return false;
  return true;
}

// x with its mask-0 positions replaced by `value`.
Tensor refill(const Tensor& x, const Tensor& mask, double value) {
  return where(eq(mask, zeros_like(mask)), full_like(x, value), x);
}

GrpoOptions grpo_options(LossAgg agg) {
  GrpoOptions o;
  o.clip_eps = S("grpo.clip_eps");
  o.agg = agg;
  o.kl_coef = agg == LossAgg::token_mean ? S("grpo.kl_coef") : 0.0;
  return o;
}

}  // namespace

// ---------------------------------------------------------------- GRPO

TEST_CASE("rl/objectives: GRPO group advantages are torch's; a group of equal rewards gets exactly 0") {
  const int64_t G_ = int64_t(S("grpo.group_size"));
  Tensor adv = group_advantages(G("grpo.rewards"), G_);
  CHECK(rel(adv, G("grpo.advantages")) < 1e-12);
  const auto a = adv.to_vector<double>();
  for (int i = 4; i < 8; ++i) CHECK(a[size_t(i)] == 0.0);  // rewards 0.7 x 4
  CHECK(a[0] > 0);
  CHECK(a[1] < 0);
  // Unbiased std: rewards {0, 1} have mean 0.5 and std sqrt(0.5).
  const auto two = group_advantages(tensor<double>({0.0, 1.0}), 2).to_vector<double>();
  CHECK(two[1] == doctest::Approx(0.5 / (std::sqrt(0.5) + 1e-6)).epsilon(1e-15));
  CHECK(two[0] == -two[1]);
  // A group of one has nothing to compare with.
  CHECK(group_advantages(tensor<double>({0.3, 5.0}), 1).to_vector<double>() == std::vector<double>{0.0, 0.0});
  CHECK(testing::error_of([] { group_advantages(tensor<double>({1, 2, 3}), 2); }).find("multiple") !=
        std::string::npos);
  // Groups of given sizes (--skip-failed-agents leaves some groups short):
  // each normalised over its own members; the same as the fixed size where
  // the sizes are equal; a group of one gets 0.
  const std::vector<double> r = G("grpo.rewards").to_vector<double>();
  std::vector<int64_t> equal(r.size() / size_t(G_), G_);
  CHECK(group_advantages(G("grpo.rewards"), equal).to_vector<double>() == adv.to_vector<double>());
  const auto ragged = group_advantages(tensor<double>({1.0, 2.0, 4.0, 9.0, 3.0, 5.0}), {3, 1, 2}).to_vector<double>();
  const double m = 7.0 / 3.0, sd = std::sqrt(((1 - m) * (1 - m) + (2 - m) * (2 - m) + (4 - m) * (4 - m)) / 2.0);
  CHECK(ragged[0] == doctest::Approx((1 - m) / (sd + 1e-6)).epsilon(1e-14));
  CHECK(ragged[2] == doctest::Approx((4 - m) / (sd + 1e-6)).epsilon(1e-14));
  CHECK(ragged[3] == 0.0);
  CHECK(ragged[4] == doctest::Approx(-1.0 / (std::sqrt(2.0) + 1e-6)).epsilon(1e-14));
  CHECK(ragged[5] == -ragged[4]);
  CHECK(testing::error_of([] { group_advantages(tensor<double>({1, 2, 3}), std::vector<int64_t>{2, 2}); })
            .find("groups of 4 rewards in all for 3") != std::string::npos);
  CHECK(testing::error_of([] { group_advantages(tensor<double>({1, 2}), std::vector<int64_t>{2, 0}); })
            .find("a group of 0") != std::string::npos);
}

// verl's outcome estimators (algorithm.adv_estimator), implemented in torch
// after verl's code (make_rl_golden.py): RLOO, REINFORCE++ (gamma 1: the
// score whitened over the batch's response tokens) and REINFORCE++ with the
// group mean subtracted; groups of 4 with one all-equal group, and ragged
// groups of 3, 1 and 2 (a lone sample keeps its score).
TEST_CASE("rl/objectives: RLOO and REINFORCE++ advantages are verl's formulas in torch") {
  for (const char* c : {"even", "ragged"}) {
    CAPTURE(c);
    const std::string p = std::string("adv.") + c + ".";
    std::vector<int64_t> sizes, tokens;
    for (double x : G(p + "group_sizes").to_vector<double>()) sizes.push_back(int64_t(x));
    for (double x : G(p + "tokens").to_vector<double>()) tokens.push_back(int64_t(x));
    const Tensor r = G(p + "rewards");
    for (AdvEstimator e : {AdvEstimator::rloo, AdvEstimator::reinforce_plus_plus,
                           AdvEstimator::reinforce_plus_plus_baseline}) {
      const std::string name = adv_estimator_name(e);
      CAPTURE(name);
      CHECK(parse_adv_estimator(name, "--adv-estimator") == e);
      const std::vector<double> got = outcome_advantages(e, r, sizes, tokens).to_vector<double>();
      const std::vector<double> want = G(p + name).to_vector<double>();
      REQUIRE(got.size() == want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        if (tokens[i] == 0 && e != AdvEstimator::rloo) continue;  // no token: torch's whitening never sees it
        CAPTURE(i);
        CHECK(std::abs(got[i] - want[i]) <= 1e-12 * std::max(1.0, std::abs(want[i])));
      }
      if (std::string(c) == "even" && e != AdvEstimator::reinforce_plus_plus) {
        // The all-equal group: exactly 0 before whitening (RLOO: exactly 0).
        if (e == AdvEstimator::rloo)
          for (size_t i = 4; i < 8; ++i) CHECK(got[i] == 0.0);
        else
          CHECK(got[4] == got[7]);
      }
    }
  }
  // grpo is group_advantages; errors name the flag and the mismatch.
  const Tensor r = G("grpo.rewards");
  CHECK(outcome_advantages(AdvEstimator::grpo, r, {4, 4, 4}, std::vector<int64_t>(12, 1)).to_vector<double>() ==
        group_advantages(r, 4).to_vector<double>());
  CHECK(testing::error_of([] { parse_adv_estimator("gae", "--adv-estimator"); }).find("--adv-estimator: 'gae'") !=
        std::string::npos);
  CHECK(testing::error_of([&] { outcome_advantages(AdvEstimator::rloo, r, {4, 4, 4}, {1, 2}); })
            .find("2 token counts for 12 rewards") != std::string::npos);
  // Fewer than 2 tokens in all: nothing to whiten over.
  CHECK(outcome_advantages(AdvEstimator::reinforce_plus_plus, tensor<double>({1.0, 3.0}), {2}, {1, 0})
            .to_vector<double>() == std::vector<double>{0.0, 0.0});
}

TEST_CASE("rl/objectives: GRPO loss, statistics and gradient are torch's, token mean with KL and sequence mean") {
  // The golden's edge tokens really sit on the bound: exp(logp - old) == 1 +- eps.
  {
    const double eps = S("grpo.clip_eps");
    const auto r = exp(sub(G("grpo.logp"), G("grpo.old_logp"))).to_vector<double>();
    const auto edge = G("grpo.at_edge").to_vector<double>();
    int on_bound = 0;
    for (size_t k = 0; k < r.size(); ++k)
      if (edge[k] == 1) on_bound += r[k] == 1.0 + eps || r[k] == 1.0 - eps;
    CHECK(on_bound == 3);
  }
  for (auto [agg, name] : {std::pair{LossAgg::token_mean, "token_mean"},
                           std::pair{LossAgg::seq_mean_token_mean, "seq_mean_token_mean"}}) {
    const std::string p = std::string("grpo.") + name;
    CAPTURE(p);
    Tensor logp = leaf("grpo.logp");
    PolicyLoss l = grpo_loss(logp, G("grpo.old_logp"), G("grpo.advantages"), G("grpo.mask"), grpo_options(agg),
                             G("grpo.ref_logp"));
    l.loss.backward();
    check_loss(l.loss, p + ".loss");
    check_grad(logp, p + ".grad_logp");
    check_stat(l.stats.pg_loss, p + ".pg_loss");
    check_stat(l.stats.ratio_mean, p + ".ratio_mean");
    check_stat(l.stats.clip_frac, p + ".clip_frac");
    check_stat(l.stats.kl, p + ".kl");
    check_stat(l.stats.advantage_mean, p + ".advantage_mean");
    if (agg == LossAgg::token_mean) check_stat(l.stats.kl_loss, p + ".kl_loss");
    CHECK(l.stats.clip_frac == doctest::Approx(5.0 / 44.0).epsilon(1e-15));  // 44 response tokens; 5 on the losing side of a bound
    if (agg == LossAgg::seq_mean_token_mean) {
      // (0, 0): A > 0, ratio exactly 1 + eps: half the unclipped gradient
      // -A r / (|y_0| N), |y_0| = 5 tokens, N = 11 sequences with tokens.
      const double A0 = G("grpo.advantages").to_vector<double>()[0];
      CHECK(logp.grad().to_vector<double>()[0] == doctest::Approx(-A0 * 1.2 / (2 * 5 * 11)).epsilon(1e-14));
    }
  }
}

TEST_CASE("rl/objectives: GRPO variants: DAPO's clip-higher, Dr. GRPO's constant normaliser and unscaled "
          "advantages, TRL's batch scaling are torch's") {
  const int64_t G_ = int64_t(S("grpo.group_size"));
  for (const char* scale : {"batch", "none"}) {
    CAPTURE(scale);
    const Tensor adv = group_advantages(G("grpo.rewards"), G_, 1e-6, parse_reward_scale(scale, "--scale-rewards"));
    CHECK(rel(adv, G(std::string("grpo.advantages_") + scale)) < 1e-12);
    const auto a = adv.to_vector<double>();
    for (int i = 4; i < 8; ++i) CHECK(a[size_t(i)] == 0.0);  // equal rewards: still no signal
  }
  CHECK(group_advantages(tensor<double>({0.0, 1.0}), 2, 1e-6, RewardScale::none).to_vector<double>() ==
        std::vector<double>{-0.5, 0.5});
  CHECK_THROWS_WITH_AS(parse_reward_scale("std", "--scale-rewards"), doctest::Contains("--scale-rewards: 'std'"),
                       std::invalid_argument);

  Tensor logp = leaf("grpo.logp");
  GrpoOptions o;
  o.clip_eps = S("grpo.clip_eps");
  o.clip_eps_high = S("grpo.dapo.eps_high");
  o.agg = parse_loss_agg("seq-mean-token-sum-norm", "--loss-agg-mode");
  o.norm_length = int64_t(S("grpo.dapo.norm_length"));
  PolicyLoss l = grpo_loss(logp, G("grpo.old_logp"), G("grpo.advantages"), G("grpo.mask"), o);
  l.loss.backward();
  check_loss(l.loss, "grpo.dapo.loss");
  check_grad(logp, "grpo.dapo.grad_logp");
  check_stat(l.stats.ratio_mean, "grpo.dapo.ratio_mean");
  check_stat(l.stats.clip_frac, "grpo.dapo.clip_frac");
  check_stat(l.stats.advantage_mean, "grpo.dapo.advantage_mean");
  // Clip-higher: the token exactly on 1 + 0.2 with A > 0 is inside 1 + 0.28, so it has its full gradient
  // -A r / (N L) (N = 12 rows, L = 8), not half of it.
  const double A0 = G("grpo.advantages").to_vector<double>()[0];
  CHECK(logp.grad().to_vector<double>()[0] == doctest::Approx(-A0 * 1.2 / (12 * 8)).epsilon(1e-14));
  o.norm_length = 0;
  CHECK_THROWS_WITH_AS(grpo_loss(logp, G("grpo.old_logp"), G("grpo.advantages"), G("grpo.mask"), o),
                       doctest::Contains("seq-mean-token-sum-norm"), std::invalid_argument);
  CHECK(std::string(loss_agg_name(LossAgg::token_mean)) == "token-mean");
  CHECK_THROWS_WITH_AS(parse_loss_agg("seq-mean", "--loss-agg-mode"), doctest::Contains("--loss-agg-mode: 'seq-mean'"),
                       std::invalid_argument);
}

TEST_CASE("rl/objectives: GRPO gives equal-reward groups and masked positions no gradient") {
  Tensor mask = G("grpo.mask");
  GrpoOptions o = grpo_options(LossAgg::token_mean);
  o.kl_coef = 0;  // the KL term has a gradient whatever the rewards
  Tensor adv = group_advantages(G("grpo.rewards"), 4);
  Tensor logp = leaf("grpo.logp");
  PolicyLoss l = grpo_loss(logp, G("grpo.old_logp"), adv, mask, o);
  l.loss.backward();
  REQUIRE(std::isfinite(l.loss.item()));
  Tensor g = logp.grad();
  CHECK(max(abs(g.narrow(0, 4, 4))).item() == 0.0);  // rows 4-7: rewards all 0.7
  CHECK(max(abs(g.narrow(0, 0, 4))).item() > 1e-3);  // the others learn
  CHECK(zero_where_masked(g, mask));                  // padding holds NaN, inf, 30, -1e4
  // What the masked positions hold changes nothing, bit for bit.
  PolicyLoss clean = grpo_loss(refill(G("grpo.logp"), mask, -1.0), refill(G("grpo.old_logp"), mask, 0.0), adv, mask, o);
  CHECK(clean.loss.item() == l.loss.item());
  CHECK(clean.stats.ratio_mean == l.stats.ratio_mean);
  CHECK(clean.stats.clip_frac == l.stats.clip_frac);
}

TEST_CASE("rl/objectives: GRPO clips on the losing side of the bound only, and counts it") {
  // One sequence, A = +1 on the first, -1 on the second; log-ratios chosen by hand.
  const std::vector<double> d = {0.3, 0.1, -0.4, 0.0,     // A > 0: 1.35 clipped, 1.105 in, 0.67 in (no floor for A > 0)
                                 -0.4, 0.3, 0.1, 0.0};    // A < 0: 0.67 clipped, 1.35 in (no cap for A < 0), 1.105 in
  const std::vector<double> mk = {1, 1, 1, 0, 1, 1, 1, 0};
  Tensor old = zeros({2, 4}, DType::f64);
  Tensor logp = from_vector(d, {2, 4}).set_requires_grad();
  Tensor mask = from_vector(mk, {2, 4});
  PolicyLoss l = grpo_loss(logp, old, tensor<double>({1.0, -1.0}), mask);
  l.loss.backward();
  CHECK(l.stats.clip_frac == doctest::Approx(2.0 / 6.0).epsilon(1e-15));
  // loss = mean(-min(rA, clip(r)A)) over 6 tokens.
  const double want = (-1.2 - std::exp(0.1) - std::exp(-0.4) + 0.8 + std::exp(0.3) + std::exp(0.1)) / 6.0;
  CHECK(l.loss.item() == doctest::Approx(want).epsilon(1e-14));
  const auto g = logp.grad().to_vector<double>();
  const std::vector<double> want_g = {0, -std::exp(0.1) / 6, -std::exp(-0.4) / 6, 0,
                                      0, std::exp(0.3) / 6, std::exp(0.1) / 6, 0};
  for (size_t k = 0; k < g.size(); ++k) CHECK(g[k] == doctest::Approx(want_g[k]).epsilon(1e-14));
}

// ---------------------------------------------------------------- GSPO

TEST_CASE("rl/objectives: GSPO loss, statistics and gradient are torch's sequence-level formula") {
  const double eps = S("gspo.clip_eps");
  // Row 0 (one token) sits exactly on 1 + eps.
  CHECK(std::exp(G("gspo.logp").to_vector<double>()[0] - G("gspo.old_logp").to_vector<double>()[0]) == 1.0 + eps);
  Tensor logp = leaf("gspo.logp"), mask = G("gspo.mask");
  GspoOptions o;
  o.clip_eps = eps;
  PolicyLoss l = gspo_loss(logp, G("gspo.old_logp"), G("gspo.advantages"), mask, o);
  l.loss.backward();
  check_loss(l.loss, "gspo.loss");
  check_grad(logp, "gspo.grad_logp");
  check_stat(l.stats.ratio_mean, "gspo.ratio_mean");
  check_stat(l.stats.clip_frac, "gspo.clip_frac");
  check_stat(l.stats.kl, "gspo.kl");
  check_stat(l.stats.advantage_mean, "gspo.advantage_mean");
  CHECK(l.stats.clip_frac == doctest::Approx(2.0 / 6.0).epsilon(1e-15));  // rows 1 and 5: whole sequences
  Tensor g = logp.grad();
  CHECK(max(abs(g.select(0, 1))).item() == 0.0);
  CHECK(max(abs(g.select(0, 5))).item() == 0.0);
  CHECK(zero_where_masked(g, mask));
  // Row 0: s exactly 1 + eps, A = 1, one token: half of -A s / (N |y|) = -s / 12.
  CHECK(g.to_vector<double>()[0] == doctest::Approx(-(1.0 + eps) / 12.0).epsilon(1e-14));
  // An unclipped sequence: every response token gets -A s / (N |y|), the same for all.
  const auto row2 = g.select(0, 2).to_vector<double>();  // 3 tokens, A = 0.5
  CHECK(row2[0] < 0);
  CHECK(row2[1] == doctest::Approx(row2[0]).epsilon(1e-15));
  CHECK(row2[2] == doctest::Approx(row2[0]).epsilon(1e-15));
  CHECK(row2[3] == 0.0);
}

// ---------------------------------------------------------------- DPO

TEST_CASE("rl/objectives: DPO loss, rewards and gradients are torch's") {
  Tensor lc = leaf("dpo.chosen_logp"), lr = leaf("dpo.rejected_logp");
  Tensor mc = G("dpo.chosen_mask"), mr = G("dpo.rejected_mask");
  DpoOptions o;
  o.beta = S("dpo.beta");
  CHECK(o.beta == DpoOptions{}.beta);  // the golden runs the default
  DpoLoss l = dpo_loss(sequence_logp(lc, mc), sequence_logp(lr, mr), G("dpo.ref_chosen"), G("dpo.ref_rejected"), o);
  l.loss.backward();
  check_loss(l.loss, "dpo.loss");
  check_grad(lc, "dpo.grad_chosen_logp");
  check_grad(lr, "dpo.grad_rejected_logp");
  check_stat(l.stats.loss, "dpo.loss");
  check_stat(l.stats.chosen_reward, "dpo.chosen_reward");
  check_stat(l.stats.rejected_reward, "dpo.rejected_reward");
  check_stat(l.stats.reward_margin, "dpo.reward_margin");
  check_stat(l.stats.reward_accuracy, "dpo.reward_accuracy");
  CHECK(zero_where_masked(lc.grad(), mc));
  CHECK(zero_where_masked(lr.grad(), mr));
}

TEST_CASE("rl/objectives: DPO at the reference policy is log 2 with gradient -+beta/2 per pair") {
  // The first DPO step: policy == reference, z = 0 exactly.
  Tensor lc = leaf("dpo.chosen_logp"), lr = leaf("dpo.rejected_logp");
  Tensor mc = G("dpo.chosen_mask"), mr = G("dpo.rejected_mask");
  Tensor rc = sequence_logp(G("dpo.chosen_logp"), mc), rr = sequence_logp(G("dpo.rejected_logp"), mr);
  DpoLoss l = dpo_loss(sequence_logp(lc, mc), sequence_logp(lr, mr), rc, rr);
  l.loss.backward();
  CHECK(l.loss.item() == doctest::Approx(std::log(2.0)).epsilon(1e-15));
  CHECK(l.stats.reward_margin == 0.0);
  CHECK(l.stats.reward_accuracy == 0.0);
  const double B = 5, beta = 0.1;
  CHECK(max_abs_diff(lc.grad(), mul(mc, -beta / 2 / B)) < 1e-16);
  CHECK(max_abs_diff(lr.grad(), mul(mr, beta / 2 / B)) < 1e-16);
}

TEST_CASE("rl/objectives: DPO variants (cDPO label smoothing, robust, hinge, IPO) are TRL's formulas in torch") {
  const Tensor mc = G("dpo.chosen_mask"), mr = G("dpo.rejected_mask");
  for (const char* kind : {"sigmoid", "robust", "hinge", "ipo"}) {
    CAPTURE(kind);
    const std::string k = std::string("dpo.") + kind;
    Tensor lc = leaf("dpo.chosen_logp"), lr = leaf("dpo.rejected_logp");
    DpoOptions o;
    o.beta = S(k + ".beta");
    o.loss_type = parse_dpo_loss_type(kind, "--dpo-loss-type");
    o.label_smoothing = S(k + ".label_smoothing");
    Tensor pc = sequence_logp(lc, mc), pr = sequence_logp(lr, mr), rc = G("dpo.ref_chosen"), rr = G("dpo.ref_rejected");
    if (o.loss_type == DpoLossType::ipo) {  // averaged over each response, as the trainer passes them
      const Tensor nc = sum(mc, {1}), nr = sum(mr, {1});
      pc = div(pc, nc), pr = div(pr, nr), rc = div(rc, nc), rr = div(rr, nr);
    }
    DpoLoss l = dpo_loss(pc, pr, rc, rr, o);
    l.loss.backward();
    check_loss(l.loss, k + ".loss");
    check_grad(lc, k + ".grad_chosen_logp");
    check_grad(lr, k + ".grad_rejected_logp");
    check_stat(l.stats.chosen_reward, k + ".chosen_reward");
    check_stat(l.stats.rejected_reward, k + ".rejected_reward");
    check_stat(l.stats.reward_margin, k + ".reward_margin");
    check_stat(l.stats.reward_accuracy, k + ".reward_accuracy");
  }
  // Label smoothing 0 is the plain loss, bit for bit; bad settings are refused naming the field.
  Tensor lc = G("dpo.chosen_logp"), lr = G("dpo.rejected_logp");
  const Tensor pc = sequence_logp(lc, mc), pr = sequence_logp(lr, mr);
  DpoOptions plain, zero;
  zero.label_smoothing = 0;
  CHECK(dpo_loss(pc, pr, G("dpo.ref_chosen"), G("dpo.ref_rejected"), zero).loss.item() ==
        dpo_loss(pc, pr, G("dpo.ref_chosen"), G("dpo.ref_rejected"), plain).loss.item());
  DpoOptions bad;
  bad.label_smoothing = 0.5;
  CHECK_THROWS_WITH_AS(dpo_loss(pc, pr, pc, pr, bad), doctest::Contains("label_smoothing"), std::invalid_argument);
  bad.label_smoothing = 0.1;
  bad.loss_type = DpoLossType::hinge;
  CHECK_THROWS_WITH_AS(dpo_loss(pc, pr, pc, pr, bad), doctest::Contains("label smoothing"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(parse_dpo_loss_type("kto", "--dpo-loss-type"), doctest::Contains("--dpo-loss-type: 'kto'"),
                       std::invalid_argument);
}

// ---------------------------------------------------------------- KL in the reward

TEST_CASE("rl/objectives: verl's KL penalty in the reward and its adaptive controller are torch's") {
  const Tensor logp = G("klr.logp"), ref = G("klr.ref_logp"), mask = G("klr.mask"), scores = G("klr.scores");
  const double beta = S("klr.beta");
  for (const char* kind : {"kl", "abs", "mse", "low_var_kl"}) {
    CAPTURE(kind);
    const std::string k = std::string("klr.") + kind;
    const KlPenalty type = parse_kl_penalty(kind, "--kl-penalty");
    const Tensor pen = kl_penalty(logp, ref, mask, type);
    CHECK(rel(pen, G(k + ".penalty")) < kRel);
    CHECK(zero_where_masked(pen, mask));
    const KlShaped shaped = apply_kl_penalty(scores, logp, ref, mask, type, beta);
    CHECK(rel(shaped.rewards, G(k + ".rewards")) < kRel);
    check_stat(shaped.kl, k + ".kl");
  }
  CHECK(parse_kl_penalty("k2", "--kl-penalty") == KlPenalty::mse);
  CHECK(parse_kl_penalty("k3", "--kl-penalty") == KlPenalty::low_var_kl);
  CHECK_THROWS_WITH_AS(parse_kl_penalty("full", "--kl-penalty"), doctest::Contains("--kl-penalty: 'full'"),
                       std::invalid_argument);
  KlController c;
  c.adaptive = true;
  c.value = S("klr.adaptive.start");
  c.target = S("klr.adaptive.target");
  c.horizon = int64_t(S("klr.adaptive.horizon"));
  const auto kls = G("klr.adaptive.kls").to_vector<double>(), values = G("klr.adaptive.values").to_vector<double>();
  for (size_t i = 0; i < kls.size(); ++i) {
    c.update(kls[i], int64_t(S("klr.adaptive.n")));
    CHECK(rel(c.value, values[i]) < 1e-14);
  }
  KlController fixed;
  fixed.update(5.0, 100);
  CHECK(fixed.value == KlController{}.value);
}

// ---------------------------------------------------------------- PPO

TEST_CASE("rl/objectives: PPO GAE returns and (whitened) advantages are torch's closed form") {
  Tensor mask = G("ppo.mask");
  const double gamma = S("ppo.gamma"), lam = S("ppo.lam");
  Gae raw = gae(G("ppo.token_rewards"), G("ppo.old_values"), mask, gamma, lam, /*whiten=*/false);
  Gae w = gae(G("ppo.token_rewards"), G("ppo.old_values"), mask, gamma, lam);
  CHECK(rel(raw.advantages, G("ppo.gae.advantages_raw")) < 1e-12);
  CHECK(rel(raw.returns, G("ppo.gae.returns")) < 1e-12);
  CHECK(rel(w.advantages, G("ppo.gae.advantages")) < 1e-12);
  CHECK(rel(w.returns, G("ppo.gae.returns")) < 1e-12);
  CHECK(zero_where_masked(w.advantages, mask));
  CHECK(zero_where_masked(w.returns, mask));
  // Whitened over the 19 response tokens: mean 0, unbiased variance ~1.
  const double n = sum(mask).item();
  CHECK(n == 19);
  CHECK(std::abs(sum(w.advantages).item()) < 1e-12);
  CHECK(sum(square(w.advantages)).item() / (n - 1) == doctest::Approx(1.0).epsilon(1e-7));
  // gamma = lam = 1 without whitening: A_t = (sum of rewards from t on) - V_t.
  Tensor r = tensor<double>({0.5, 0.0, 2.0}).reshape({1, 3}), v = tensor<double>({0.1, 0.2, 0.4}).reshape({1, 3});
  Gae mc = gae(r, v, ones({1, 3}, DType::f64), 1.0, 1.0, false);
  CHECK(mc.advantages.to_vector<double>() == std::vector<double>{2.5 - 0.1, 2.0 - 0.2, 2.0 - 0.4});
  CHECK(mc.returns.to_vector<double>() == std::vector<double>{2.5, 2.0, 2.0});
}

TEST_CASE("rl/objectives: PPO loss (dual clip, clipped value, low_var_kl) and gradients are torch's") {
  Tensor logp = leaf("ppo.logp"), values = leaf("ppo.values"), mask = G("ppo.mask");
  PpoOptions o;
  o.clip_eps = S("ppo.clip_eps");
  o.clip_ratio_c = S("ppo.clip_ratio_c");
  o.value_clip_eps = S("ppo.value_clip_eps");
  o.value_loss_coef = S("ppo.value_loss_coef");
  o.use_kl_loss = true;
  o.kl_loss_coef = S("ppo.kl_loss_coef");
  PpoLoss l = ppo_loss(logp, G("ppo.old_logp"), G("ppo.advantages"), mask, values, G("ppo.old_values"),
                       G("ppo.gae.returns"), o, G("ppo.ref_logp"));
  l.loss.backward();
  check_loss(l.loss, "ppo.loss");
  check_grad(logp, "ppo.grad_logp");
  check_grad(values, "ppo.grad_values");
  const PolicyStats& p = l.stats.policy;
  check_stat(p.pg_loss, "ppo.pg_loss");
  check_stat(p.kl_loss, "ppo.kl_loss");
  check_stat(p.ratio_mean, "ppo.ratio_mean");
  check_stat(p.clip_frac, "ppo.clip_frac");
  check_stat(p.clip_frac_lower, "ppo.clip_frac_lower");
  check_stat(p.kl, "ppo.kl");
  check_stat(p.advantage_mean, "ppo.advantage_mean");
  check_stat(l.stats.vf_loss, "ppo.vf_loss");
  check_stat(l.stats.vf_clip_frac, "ppo.vf_clip_frac");
  check_stat(l.stats.value_mean, "ppo.value_mean");
  check_stat(l.stats.return_mean, "ppo.return_mean");
  CHECK(p.clip_frac_lower == doctest::Approx(1.0 / 19.0).epsilon(1e-15));  // the one token with A < 0 and ratio 3.5 > c
  CHECK(zero_where_masked(logp.grad(), mask));
  CHECK(zero_where_masked(values.grad(), mask));
  // (0, 0): A = -1, ratio 3.5 > c: the loss is held at 3 |A|, no policy gradient;
  // there the gradient is the KL term's alone.
  Tensor kl_only = leaf("ppo.logp");
  Tensor kl = mul(sum(low_var_kl(kl_only, G("ppo.ref_logp"), mask)), o.kl_loss_coef / 19.0);
  kl.backward();
  CHECK(logp.grad().to_vector<double>()[0] == doctest::Approx(kl_only.grad().to_vector<double>()[0]).epsilon(1e-14));
  // (2, 0): ref - logp = 3, k3 = e^3 - 4 > 10 is clamped: no KL gradient.
  CHECK(kl_only.grad().to_vector<double>()[2 * 7] == 0.0);
}

TEST_CASE("rl/objectives: PPO without KL and with the defaults; errors name the input") {
  Tensor logp = leaf("ppo.logp"), values = leaf("ppo.values"), mask = G("ppo.mask");
  PpoLoss l = ppo_loss(logp, G("ppo.old_logp"), G("ppo.advantages"), mask, values, G("ppo.old_values"),
                       G("ppo.gae.returns"));
  CHECK(l.stats.policy.kl_loss == 0.0);
  CHECK(std::isfinite(l.loss.item()));
  const std::string e = testing::error_of([&] {
    ppo_loss(logp, G("ppo.old_logp"), G("ppo.advantages"), mask, values.narrow(1, 0, 3), G("ppo.old_values"),
             G("ppo.gae.returns"));
  });
  CHECK(e.find("values must be a [4, 7]") != std::string::npos);
  PpoOptions kl;
  kl.use_kl_loss = true;
  CHECK(testing::error_of([&] {
          ppo_loss(logp, G("ppo.old_logp"), G("ppo.advantages"), mask, values, G("ppo.old_values"),
                   G("ppo.gae.returns"), kl);
        }).find("reference") != std::string::npos);
  Tensor bad_mask = G("ppo.mask").clone();
  bad_mask.data<double>()[3] = 0.5;
  CHECK(testing::error_of([&] { sequence_logp(logp, bad_mask); }).find("mask[0, 3] is 0.5") != std::string::npos);
}

TEST_CASE("rl/objectives: in f32 (the trainer's dtype) PPO and DPO give the f64 golden to f32 precision") {
  auto f32 = [](const std::string& name) { return G(name).to(DType::f32); };
  Tensor logp = f32("ppo.logp").set_requires_grad(), values = f32("ppo.values").set_requires_grad();
  PpoOptions o;
  o.value_clip_eps = S("ppo.value_clip_eps");
  o.value_loss_coef = S("ppo.value_loss_coef");
  o.use_kl_loss = true;
  o.kl_loss_coef = S("ppo.kl_loss_coef");
  PpoLoss l = ppo_loss(logp, f32("ppo.old_logp"), f32("ppo.advantages"), f32("ppo.mask"), values,
                       f32("ppo.old_values"), f32("ppo.gae.returns"), o, f32("ppo.ref_logp"));
  l.loss.backward();
  CHECK(l.loss.dtype() == DType::f32);
  CHECK(rel(l.loss.item(), S("ppo.loss")) < 1e-5);
  CHECK(rel(logp.grad(), G("ppo.grad_logp")) < 1e-5);
  CHECK(rel(values.grad(), G("ppo.grad_values")) < 1e-5);

  Tensor lc = f32("dpo.chosen_logp").set_requires_grad(), lr = f32("dpo.rejected_logp").set_requires_grad();
  DpoLoss d = dpo_loss(sequence_logp(lc, f32("dpo.chosen_mask")), sequence_logp(lr, f32("dpo.rejected_mask")),
                       f32("dpo.ref_chosen"), f32("dpo.ref_rejected"));
  d.loss.backward();
  CHECK(rel(d.loss.item(), S("dpo.loss")) < 1e-5);
  CHECK(rel(lc.grad(), G("dpo.grad_chosen_logp")) < 1e-5);
  CHECK(rel(lr.grad(), G("dpo.grad_rejected_logp")) < 1e-5);
}
