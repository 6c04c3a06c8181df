// Rollouts through the engine and the training forward's log-probabilities
// (issue 15, "Rollout", must-shows 3 and 6): text, image, audio and
// image+audio prompts sampled n times on the tiny model; the engine's
// log-probabilities equal policy_logp's for the same tokens (f32, CPU, 1e-5);
// the KV blocks are free after a rollout; a weight changed in place shows in
// the next rollout; the gradient reaches the LoRA and decoder parameters.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tests/train/train_fixtures.h"
#include "train/rl/policy_logp.h"
#include "train/rl/rollout.h"

using namespace areno;
using namespace areno::train::rl;
using areno::testing::golden_rows;
using areno::testing::tiny_phi4mm;

namespace {

std::shared_ptr<const tok::Tokenizer> tokenizer() { return testing::phi4_tokenizer(); }

// The prompt parts of the trainer's golden rows: text, image, audio, audio+image.
std::vector<Prompt> golden_prompts() {
  std::vector<Prompt> ps;
  for (auto& r : golden_rows())
    ps.push_back({std::vector<int64_t>(r.ids.begin(), r.ids.begin() + r.prompt_tokens), r.media, r.adapter});
  return ps;
}
const char* kModality[] = {"text", "image", "audio", "image+audio"};

RolloutOptions sampled(int64_t n, bool greedy) {
  RolloutOptions o;
  o.n_samples = n;
  o.greedy = greedy;
  o.temperature = 1.0;
  o.max_new_tokens = 6;
  o.seed = 1234;
  o.engine.kv_blocks = 64;
  o.engine.max_running = 8;
  return o;
}

// Worst |rollout logp - policy_logp| over every token, after checking the layout.
double worst_logp_diff(const phi4mm::Phi4MMForCausalLM& model, const std::vector<Prompt>& prompts,
                       const std::vector<RolloutSample>& samples) {
  TokenLogp tl = policy_logp(model, prompts, sequences_of(samples), {.chunk_rows = 5});
  const int64_t N = int64_t(samples.size());
  REQUIRE(tl.logp.dim() == 2);
  REQUIRE(tl.logp.size(0) == N);
  const int64_t T = tl.logp.size(1);
  const auto lp = tl.logp.contiguous().to_vector<float>();
  const auto mk = tl.mask.contiguous().to_vector<float>();
  double worst = 0;
  for (int64_t n = 0; n < N; ++n) {
    const auto& s = samples[size_t(n)];
    for (int64_t t = 0; t < T; ++t) {
      const bool in = t < int64_t(s.tokens.size());
      CHECK(mk[size_t(n * T + t)] == (in ? 1.0f : 0.0f));
      if (!in) {
        CHECK(lp[size_t(n * T + t)] == 0.0f);
        continue;
      }
      const double d = std::abs(double(lp[size_t(n * T + t)]) - double(s.logp[size_t(t)]));
      worst = std::max(worst, d);
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("rl/rollout chunked_target_logp equals log_softmax + gather, values and gradients") {
  Generator g(7);
  Tensor h = rand_normal({7, 8}, g, 0.0, 1.0).set_requires_grad();
  Tensor w = rand_normal({50, 8}, g, 0.0, 0.5).set_requires_grad();
  // Rows 1 and 4 have no target.
  const std::vector<int64_t> rows{0, 2, 3, 5, 6}, tg{3, 49, 0, 17, 17};
  const std::vector<float> weights{0.5f, -2.0f, 1.0f, 3.0f, 0.25f};  // one per target row
  Tensor out = chunked_target_logp(h, w, rows, tg, /*chunk_rows=*/2);
  REQUIRE(out.shape() == Shape{5});
  sum(mul(out, from_vector(weights, {5}))).backward();
  const auto gh = h.grad().to_vector<float>(), gw = w.grad().to_vector<float>();
  const auto got = out.to_vector<float>();

  Tensor h2 = h.detach().clone().set_requires_grad(), w2 = w.detach().clone().set_requires_grad();
  Tensor ref = gather(log_softmax(linear(h2, w2), -1), 1, from_vector(std::vector<int64_t>{3, 0, 49, 0, 0, 17, 17}, {7, 1}));
  Tensor rw = from_vector(std::vector<float>{0.5f, 0, -2.0f, 1.0f, 0, 3.0f, 0.25f}, {7, 1});
  sum(mul(ref, rw)).backward();
  const auto want = ref.to_vector<float>();
  const std::vector<size_t> kept{0, 2, 3, 5, 6};
  for (size_t k = 0; k < kept.size(); ++k) CHECK(got[k] == doctest::Approx(want[kept[k]]).epsilon(1e-6));
  const auto rh = h2.grad().to_vector<float>(), rwg = w2.grad().to_vector<float>();
  for (size_t i = 0; i < gh.size(); ++i) CHECK(gh[i] == doctest::Approx(rh[i]).epsilon(1e-5));
  for (size_t i = 0; i < gw.size(); ++i) CHECK(gw[i] == doctest::Approx(rwg[i]).epsilon(1e-5));
  // Rows 1 and 4 have no target: no gradient.
  for (int64_t c = 0; c < 8; ++c) CHECK(gh[size_t(8 + c)] == 0.0f);
  CHECK_THROWS_AS(chunked_target_logp(h, w, {7}, {0}), std::invalid_argument);
  CHECK_THROWS_AS(chunked_target_logp(h, w, {0}, {50}), std::invalid_argument);

  // bf16 (the row kernel in place on the bf16 logits, f32 math): the values
  // of log_softmax on the widened logits, the rows' gradient within bf16
  // rounding, and a frozen head takes no gradient product.
  const Tensor hb = h.detach().to(DType::bf16).set_requires_grad(), wb = w.detach().to(DType::bf16);
  const Tensor ob = chunked_target_logp(hb, wb, rows, tg, /*chunk_rows=*/2);
  REQUIRE(ob.dtype() == DType::f32);
  sum(mul(ob, from_vector(weights, {5}))).backward();
  const Tensor hr = hb.detach().clone().set_requires_grad();
  const Tensor lr = gather(log_softmax(linear(hr, wb).to(DType::f32), -1), 1,
                           from_vector(std::vector<int64_t>{3, 0, 49, 0, 0, 17, 17}, {7, 1}));
  sum(mul(lr, rw)).backward();
  const auto gotb = ob.to_vector<float>(), wantb = lr.to_vector<float>();
  for (size_t k = 0; k < kept.size(); ++k) CHECK(gotb[k] == doctest::Approx(wantb[kept[k]]).epsilon(1e-6));
  const Tensor ghb = hb.grad().to(DType::f64), rhb = hr.grad().to(DType::f64);
  CHECK(max_abs_diff(ghb, rhb) <= 0x1p-7 * max(abs(rhb)).item());
  CHECK(max(abs(ghb)).item() > 0.0);
  CHECK_FALSE(wb.grad().defined());
  // A trainable bf16 head: its gradient (train::add_head_weight_grad, the
  // rows scaled by -g then rounded) within bf16 rounding of the reference's.
  const Tensor wt = w.detach().to(DType::bf16).set_requires_grad(), wr2 = wt.detach().clone().set_requires_grad();
  sum(mul(chunked_target_logp(hb.detach(), wt, rows, tg, /*chunk_rows=*/2), from_vector(weights, {5}))).backward();
  const Tensor lw = gather(log_softmax(linear(hb.detach(), wr2).to(DType::f32), -1), 1,
                           from_vector(std::vector<int64_t>{3, 0, 49, 0, 0, 17, 17}, {7, 1}));
  sum(mul(lw, rw)).backward();
  REQUIRE(wt.grad().defined());
  const Tensor gwb = wt.grad().to(DType::f64), rwb = wr2.grad().to(DType::f64);
  CHECK(max_abs_diff(gwb, rwb) <= 0x1p-7 * max(abs(rwb)).item());
  CHECK(max(abs(gwb)).item() > 0.0);
}

TEST_CASE("rl/rollout log-probabilities equal policy_logp for text, image, audio and image+audio prompts") {
  auto model = tiny_phi4mm();
  const std::vector<Prompt> prompts = golden_prompts();
  double worst_all = 0;
  for (bool greedy : {false, true}) {
    const int64_t n = greedy ? 2 : 3;
    Rollout ro(model, tokenizer(), sampled(n, greedy));
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::string modality = kModality[i];
      CAPTURE(modality);
      CAPTURE(greedy);
      const std::vector<Prompt> one{prompts[i]};
      const auto samples = ro.run(one);
      REQUIRE(samples.size() == size_t(n));
      for (int64_t j = 0; j < n; ++j) {
        const auto& s = samples[size_t(j)];
        CHECK(s.prompt == 0);
        CHECK(s.index == j);
        REQUIRE(!s.tokens.empty());
        CHECK(s.tokens.size() <= 6);
        CHECK(s.logp.size() == s.tokens.size());
        CHECK((s.finish == serve::FinishReason::stop || s.finish == serve::FinishReason::length));
        if (s.finish == serve::FinishReason::length) CHECK(s.tokens.size() == 6);
        for (float lp : s.logp) CHECK((std::isfinite(lp) && lp <= 0.0f));
      }
      if (greedy) {
        CHECK(samples[0].tokens == samples[1].tokens);
        CHECK(samples[0].logp == samples[1].logp);
      }
      const double worst = worst_logp_diff(*model, one, samples);
      MESSAGE(fmt::format("{} {} n={}: logp_abs_diff max {:.3g}", kModality[i], greedy ? "greedy" : "T=1", n, worst));
      CHECK(worst < 1e-5);
      worst_all = std::max(worst_all, worst);
    }
  }
  // Every modality at once, in one engine run and one packed forward.
  Rollout ro(model, tokenizer(), sampled(3, false));
  const auto samples = ro.run(prompts);
  REQUIRE(samples.size() == 12);
  for (size_t k = 0; k < samples.size(); ++k) CHECK(samples[k].prompt == int64_t(k / 3));
  const double worst = worst_logp_diff(*model, prompts, samples);
  CHECK(worst < 1e-5);
  worst_all = std::max(worst_all, worst);
  MESSAGE(fmt::format("all modalities, one batch of 12 samples: logp_abs_diff max {:.3g}; overall worst {:.3g}", worst,
                      worst_all));
}

TEST_CASE("rl/rollout frees every KV block after a run; drop_rollout_state releases the engine") {
  auto model = tiny_phi4mm();
  const std::vector<Prompt> prompts = golden_prompts();
  Rollout keep(model, tokenizer(), sampled(3, false));
  CHECK(keep.last_stats().kv_blocks_total == 0);
  keep.run(prompts);
  CHECK(keep.has_engine());
  CHECK(keep.last_stats().kv_blocks_total == 64);
  CHECK(keep.last_stats().kv_blocks_used == 0);
  CHECK(keep.last_stats().generated_tokens > 12);
  CHECK(keep.last_stats().requests_finished == 4);
  keep.release();
  CHECK(!keep.has_engine());

  RolloutOptions o = sampled(2, false);
  o.drop_rollout_state = true;
  Rollout drop(model, tokenizer(), o);
  const auto a = drop.run(prompts);
  CHECK(!drop.has_engine());
  CHECK(drop.last_stats().kv_blocks_used == 0);
  CHECK(drop.last_stats().generated_tokens > 8);
  const auto b = drop.run(prompts);  // a fresh engine
  CHECK(!drop.has_engine());
  CHECK(b.size() == a.size());
}

TEST_CASE("rl/rollout after a weight changes in place, the next rollout samples from the new weights") {
  auto model = tiny_phi4mm();
  const std::vector<Prompt> prompts{golden_prompts()[0]};
  Rollout ro(model, tokenizer(), sampled(1, true));
  const auto before = ro.run(prompts);
  REQUIRE(!before[0].tokens.empty());
  const int64_t first = before[0].tokens[0];
  // Negate the final norm's weight in place: every logit changes sign, so the
  // greedy first token becomes the old distribution's least likely one.
  Tensor& w = model->model->norm->weight;
  float* data = static_cast<float*>(w.data_ptr());
  for (int64_t c = 0; c < w.numel(); ++c) data[c] = -data[c];
  const auto after = ro.run(prompts);  // the same engine as before
  REQUIRE(!after[0].tokens.empty());
  CHECK(after[0].tokens[0] != first);
  Rollout fresh(model, tokenizer(), sampled(1, true));
  const auto want = fresh.run(prompts);
  CHECK(after[0].tokens == want[0].tokens);
  CHECK(after[0].logp == want[0].logp);
  CHECK(worst_logp_diff(*model, prompts, after) < 1e-5);
}

TEST_CASE("rl/rollout the gradient of sum(policy_logp * mask) reaches the LoRA and decoder parameters") {
  auto model = tiny_phi4mm();
  std::vector<std::pair<std::string, Tensor>> watched;
  auto pick = [&](const char* must, const char* also) {
    for (auto& [name, p] : model->named_parameters())
      if (name.find(must) != std::string::npos && name.find(also) != std::string::npos) {
        p.set_requires_grad(true);
        watched.emplace_back(name, p);
        return;
      }
    FAIL("no parameter named like ", must, " ", also);
  };
  pick("lora_B.vision", "layers.0.");
  pick("lora_B.speech", "layers.1.");
  pick("layers.0.mlp.", "base_layer");
  const std::vector<Prompt> prompts = golden_prompts();
  Rollout ro(model, tokenizer(), sampled(2, false));
  const auto samples = ro.run(prompts);
  TokenLogp tl = policy_logp(*model, prompts, sequences_of(samples), {.chunk_rows = 7});
  REQUIRE(tl.logp.requires_grad());
  sum(mul(tl.logp, tl.mask)).backward();
  for (const auto& entry : watched) {  // (not a structured binding: clang 14 cannot CAPTURE one)
    const std::string& name = entry.first;
    const Tensor& p = entry.second;
    CAPTURE(name);
    REQUIRE(p.grad().defined());
    const auto gv = p.grad().to(DType::f32).contiguous().to_vector<float>();
    double norm = 0;
    bool finite = true;
    for (float x : gv) {
      finite &= std::isfinite(x);
      norm += double(x) * x;
    }
    CHECK(finite);
    CHECK(norm > 0);
    MESSAGE(fmt::format("grad norm of {}: {:.3g}", name, std::sqrt(norm)));
  }
}
