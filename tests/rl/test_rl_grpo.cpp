// The GRPO / GSPO loop (issue 15; docs/rl.md, "The GRPO/GSPO loop"): one step
// end to end on init_phi4mm("tiny", 5, f32) (random weights: diverse samples,
// a gradient well away from 0) (rollout, reward, advantages, policy_logp,
// objective, AdamW), rollout/training log-prob parity inside the step,
// accumulation over micro-batches equal to one batch, equal rewards -> no
// update, and `areno train --algo grpo|gspo` writing the metrics.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/commands_train.h"
#include "models/phi4mm/demo/demo.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "tests/rl/rl_fixtures.h"
#include "tests/test_util.h"
#include "tests/train/train_fixtures.h"
#include "train/param_groups.h"
#include "train/rl/grpo.h"
#include "train/rl/rl_step.h"

using namespace areno;
using namespace areno::train::rl;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::shared_ptr<const tok::Tokenizer> tokenizer() { return testing::phi4_tokenizer(); }

// Prompt rows {"prompt": "What is a + b?", "answer": "a+b"} through the dataset's prompt path.
std::vector<train::PromptRow> sum_prompts(int n) {
  std::vector<json> rows;
  for (int i = 0; i < n; ++i) {
    const int a = 1 + i % 3, b = 1 + (i / 3) % 3;
    rows.push_back({{"prompt", fmt::format("What is {} + {}?", a, b)}, {"answer", a + b}});
  }
  return testing::prompt_rows(rows);
}

// A reward that is not constant within a group: the completion's length in
// tokens modulo 3, plus its sample index (a test needs some signal whatever
// the model samples).
struct SpreadReward : RewardFn {
  std::vector<RewardInput> seen;
  std::vector<double> score(const std::vector<RewardInput>& in) override {
    seen = in;
    std::vector<double> out;
    for (const RewardInput& r : in) out.push_back(double(r.completion_tokens % 3) + 0.5 * double(r.sample_index));
    return out;
  }
};

struct ConstantReward : RewardFn {
  std::vector<double> score(const std::vector<RewardInput>& in) override { return std::vector<double>(in.size(), 1.0); }
};

RlOptions options(int64_t mini_bs) {
  RlOptions o;
  o.loop = testing::small_rl_loop(mini_bs);
  o.rollout = testing::small_rollout(4);
  return o;
}

std::map<std::string, std::vector<float>> snapshot(const Module& m) { return testing::param_snapshot(m); }

}  // namespace

TEST_CASE("rl/grpo one step: rewards, parity inside the step, only trainable groups change") {
  auto model = testing::tiny_phi4mm();
  const auto before = snapshot(*model);
  auto reward = std::make_unique<SpreadReward>();
  SpreadReward* seen = reward.get();
  GrpoTrainer tr(model, tokenizer(), sum_prompts(4), options(3), std::move(reward));
  CHECK(tr.total_steps() == 3);
  const RlStepStats st = tr.step();
  MESSAGE(fmt::format("reward_mean {} loss {} grad_norm {} logp_abs_diff_mean {:.2e} max {:.2e} ratio_mean {} "
                      "response_len {}", st.reward_mean, st.loss, st.grad_norm, st.logp_abs_diff_mean,
                      st.logp_abs_diff_max, st.ratio_mean, st.response_len));
  CHECK(st.prompts == 2);
  CHECK(st.samples == 8);
  REQUIRE(seen->seen.size() == 8);
  for (size_t i = 0; i < 8; ++i) {
    const RewardInput& r = seen->seen[i];
    CHECK(r.prompt_index == int64_t(i / 4));
    CHECK(r.sample_index == int64_t(i % 4));
    CHECK(r.row.contains("answer"));
    CHECK(r.prompt[0]["role"] == "user");
    CHECK(r.completion.find("<|end|>") == std::string::npos);  // special tokens are skipped
    CHECK(st.rewards[i] == double(r.completion_tokens % 3) + 0.5 * double(r.sample_index));
  }
  double mean = 0;
  for (double r : st.rewards) mean += r / 8;
  CHECK(st.reward_mean == doctest::Approx(mean));
  // Before any update the training forward sees what the engine saw.
  CHECK(st.logp_abs_diff_mean < 1e-5);
  CHECK(st.logp_abs_diff_max < 1e-4);
  CHECK(std::abs(st.logp_diff_mean) <= st.logp_abs_diff_mean);
  CHECK(st.ratio_mean == doctest::Approx(1.0).epsilon(1e-4));
  CHECK(st.clip_frac == 0.0);
  CHECK(std::isfinite(st.loss));
  CHECK(std::abs(st.kl) < 1e-5);
  CHECK(st.grad_norm > 0);
  CHECK(st.rollout_logprobs_mean == doctest::Approx(st.train_logprobs_mean).epsilon(1e-4));
  CHECK(st.rollout_logprobs_mean < 0);
  CHECK(st.response_len >= 1);
  CHECK(st.response_len <= 5);
  CHECK(st.total_s >= st.rollout_s + st.train_s);
  // lm trains; the projectors and towers are frozen (the defaults).
  const auto after = snapshot(*model);
  int64_t lm_changed = 0, frozen_changed = 0;
  for (const auto& [name, v] : after) {
    const bool changed = v != before.at(name);
    if (train::group_of(name) == train::Group::lm) lm_changed += changed;
    else frozen_changed += changed;
  }
  MESSAGE("lm tensors changed: " << lm_changed);
  CHECK(lm_changed > 0);
  CHECK(frozen_changed == 0);
  CHECK(tr.state().step == 1);
  CHECK(tr.state().position == 2);
  CHECK_FALSE(tr.rollout().has_engine() == false);  // kept without drop_rollout_state
  CHECK(tr.rollout().last_stats().kv_blocks_used == 0);
}

TEST_CASE("rl/step helpers on rows and trajectories: masks, NaN log-probabilities, split rows") {
  // Two trajectories of one task: the first gave one row, the second split
  // into two (agent.h's row rule). Context tokens: trainable 0 with NaN
  // log-probability; one trainable token without a rollout log-probability
  // (--train-tool-results).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  ScoredRollouts r;
  r.prompts = {{{1, 2}, {}, phi4mm::Adapter::none}, {{3}, {}, phi4mm::Adapter::none}};
  r.samples = {{0, 0, {10, 11, 12}, {-0.5f, nan, -0.25f}, serve::FinishReason::none, {1, 0, 1}, {}},
               {1, 1, {13, 14}, {-1.0f, -2.0f}, serve::FinishReason::none, {}, {}},
               {0, 1, {15, 16, 17}, {-0.125f, nan, nan}, serve::FinishReason::none, {1, 1, 0}, {}}};
  r.trajectories = {{0, 0, {0}, 1.0, "a", 1, {}}, {0, 1, {1, 2}, std::nullopt, "b", 1, {}}};
  r.rewards = {1.0, 3.0};
  for (const RolloutSample& s : r.samples) r.tokens += trainable_tokens(s);
  CHECK(r.tokens == 6);
  CHECK(per_row(r, {0.5, -0.5}) == std::vector<double>{0.5, -0.5, -0.5});

  RlStepStats st;
  record_rollouts(r, st);
  CHECK(st.samples == 3);
  CHECK(st.trajectories == 2);
  CHECK(st.split_rows == 1);
  CHECK(st.response_tokens == 6);
  CHECK(st.reward_mean == 2.0);             // over trajectories, not rows
  CHECK(st.response_len == 2.0);            // trainable tokens per row
  const train::Scalars sc = rl_scalars(st);
  auto scalar = [&](const std::string& k) {
    for (const auto& [name, x] : sc)
      if (name == k) return x;
    FAIL("no scalar " << k);
    return 0.0;
  };
  CHECK(scalar("trajectories") == 2.0);
  CHECK(scalar("split_rows") == 1.0);

  const MicroBatch mb = micro_batch(r, 1, 3);
  CHECK(mb.tokens == 4);
  REQUIRE(mb.prompts.size() == 2);
  CHECK(mb.prompts[0].ids == std::vector<int64_t>{3});  // only the prompts used, in first-use order
  CHECK(mb.seqs[0].prompt == 0);
  CHECK(mb.seqs[1].prompt == 1);
  CHECK(mb.seqs[1].trainable == std::vector<uint8_t>{1, 1, 0});

  // The training forward's log-probabilities of rows 0..2 ([3, 3]): the old
  // ones are the rollout's, the forward's own where the rollout has none.
  const Tensor train = from_vector(std::vector<float>{-0.4f, 0, -0.3f, -1.5f, -2.5f, 0, -0.1f, -0.7f, 0}, {3, 3});
  CHECK(rollout_logp(r, 0, train).to_vector<float>() ==
        std::vector<float>{-0.5f, 0, -0.25f, -1.0f, -2.0f, 0, -0.125f, -0.7f, 0});
  // Parity over trainable tokens with a rollout log-probability only: 5 of them.
  LogpParity parity;
  parity.add(train, r, 0, 3);
  CHECK(parity.tokens == 5.0);
  parity.finish(st);
  CHECK(st.rollout_logprobs_mean == doctest::Approx((-0.5 - 0.25 - 1.0 - 2.0 - 0.125) / 5));
  CHECK(st.logp_abs_diff_max == doctest::Approx(0.5));
  CHECK(st.logp_abs_diff_mean == doctest::Approx((0.1 + 0.05 + 0.5 + 0.5 + 0.025) / 5));
}

TEST_CASE("rl/grpo micro-batches accumulate to the one-batch gradient (GRPO, GSPO, and GRPO with DAPO's clip-higher "
          "and Dr. GRPO's normaliser and unscaled advantages)") {
  for (int variant : {0, 1, 2}) {
    const RlAlgo algo = variant == 1 ? RlAlgo::gspo : RlAlgo::grpo;
    CAPTURE(variant);
    std::vector<RlStepStats> st;
    for (int64_t mini : {8, 3, 1}) {
      RlOptions o = options(mini);
      o.algo = algo;
      o.rollout.drop_rollout_state = true;
      if (variant == 2) {
        o.grpo.clip_eps_high = 0.28;
        o.grpo.agg = LossAgg::seq_mean_token_sum_norm;
        o.scale_rewards = RewardScale::none;
      }
      GrpoTrainer tr(testing::tiny_phi4mm(), tokenizer(), sum_prompts(4), o, std::make_unique<SpreadReward>());
      st.push_back(tr.step());
      CHECK_FALSE(tr.rollout().has_engine());
    }
    for (size_t i = 1; i < st.size(); ++i) {
      CAPTURE(rl_algo_name(algo));
      CAPTURE(i);
      CHECK(st[i].rewards == st[0].rewards);  // the same rollouts (same seed, same weights)
      CHECK(st[i].loss == doctest::Approx(st[0].loss).epsilon(1e-5));
      CHECK(st[i].grad_norm == doctest::Approx(st[0].grad_norm).epsilon(1e-5));
      CHECK(st[i].ratio_mean == doctest::Approx(st[0].ratio_mean).epsilon(1e-6));
    }
    CHECK(st[0].grad_norm > 0);
    MESSAGE(fmt::format("{}{}: grad_norm {} / {} / {} (mini-bs 8 / 3 / 1)", rl_algo_name(algo),
                        variant == 2 ? " (dapo/dr)" : "", st[0].grad_norm, st[1].grad_norm, st[2].grad_norm));
  }
  RlOptions bad = options(3);
  bad.algo = RlAlgo::gspo;
  bad.grpo.clip_eps_high = 0.3;
  CHECK_THROWS_WITH_AS(GrpoTrainer(testing::tiny_phi4mm(), tokenizer(), sum_prompts(4), bad,
                                   std::make_unique<SpreadReward>()),
                       doctest::Contains("only with --algo grpo"), std::invalid_argument);
}

// The step's advantages come from --adv-estimator: REINFORCE++ whitens the
// rewards over the batch's trainable tokens, so their token mean (the
// step's advantage_mean) is 0; RLOO's leave-one-out baseline moves the
// policy as GRPO's does, by other amounts.
TEST_CASE("rl/grpo --adv-estimator: REINFORCE++ advantages have token mean 0; RLOO trains") {
  std::vector<RlStepStats> st;
  for (AdvEstimator e : {AdvEstimator::grpo, AdvEstimator::rloo, AdvEstimator::reinforce_plus_plus}) {
    RlOptions o = options(8);
    o.adv_estimator = e;
    GrpoTrainer tr(testing::tiny_phi4mm(), tokenizer(), sum_prompts(4), o, std::make_unique<SpreadReward>());
    st.push_back(tr.step());
  }
  CHECK(st[1].rewards == st[0].rewards);  // the same rollouts
  CHECK(st[2].rewards == st[0].rewards);
  CHECK(std::abs(st[2].advantage_mean) < 1e-12);
  for (const RlStepStats& s : st) CHECK(s.grad_norm > 0);
  CHECK(st[1].grad_norm != doctest::Approx(st[0].grad_norm));
  CHECK(st[2].grad_norm != doctest::Approx(st[0].grad_norm));
  RlOptions bad = options(8);
  bad.adv_estimator = AdvEstimator::rloo;
  bad.scale_rewards = RewardScale::none;
  CHECK_THROWS_WITH_AS(GrpoTrainer(testing::tiny_phi4mm(), tokenizer(), sum_prompts(4), bad,
                                   std::make_unique<SpreadReward>()),
                       doctest::Contains("--scale-rewards: only with --adv-estimator grpo"), std::invalid_argument);
}

TEST_CASE("rl/grpo equal rewards in every group give zero gradient and no update") {
  auto model = testing::tiny_phi4mm();
  const auto before = snapshot(*model);
  RlOptions o = options(3);
  o.loop.lr = 1e-2;
  o.loop.weight_decay = 0;
  GrpoTrainer tr(model, tokenizer(), sum_prompts(4), o, std::make_unique<ConstantReward>());
  const RlStepStats st = tr.step();
  CHECK(st.reward_mean == 1.0);
  CHECK(st.advantage_mean == 0.0);
  CHECK(st.loss == 0.0);
  CHECK(st.grad_norm == 0.0);
  CHECK(snapshot(*model) == before);
}

// DAPO's dynamic sampling (--filter-groups): rows {"id": i, "flat": i % 4 == 0},
// in order (no shuffle), 2 prompts per batch, 4 samples each; a flat row's
// samples all score 1, another's id * 10 + sample / 2.
TEST_CASE("rl/grpo --filter-groups: groups whose samples scored alike are dropped and refilled from the next prompts") {
  struct RowReward : RewardFn {
    std::vector<double> score(const std::vector<RewardInput>& in) override {
      std::vector<double> out;
      for (const RewardInput& r : in)
        out.push_back(r.row["flat"].get<bool>() ? 1.0 : r.row["id"].get<double>() * 10 + 0.5 * double(r.sample_index));
      return out;
    }
  };
  std::vector<json> rows;
  for (int i = 0; i < 8; ++i) rows.push_back({{"prompt", fmt::format("What is {} + 1?", i)}, {"id", i}, {"flat", i % 4 == 0}});
  auto make = [&](int64_t max_gen, int64_t mini_bs, std::unique_ptr<RewardFn> reward) {
    RlOptions o = options(mini_bs);
    o.loop.shuffle = false;
    o.filter_groups = true;
    o.max_num_gen_batches = max_gen;
    return GrpoTrainer(testing::tiny_phi4mm(), tokenizer(), testing::prompt_rows(rows), o, std::move(reward));
  };
  auto group_rewards = [](int id) {
    std::vector<double> r;
    for (int j = 0; j < 4; ++j) r.push_back(id * 10 + 0.5 * j);
    return r;
  };
  {
    GrpoTrainer tr = make(10, 3, std::make_unique<RowReward>());
    // Batch 1 (rows 0, 1) keeps row 1; batch 2 (rows 2, 3) both, of which row 2 fills the step.
    RlStepStats st = tr.step();
    std::vector<double> want = group_rewards(1), more = group_rewards(2);
    want.insert(want.end(), more.begin(), more.end());
    CHECK(st.rewards == want);
    CHECK(st.gen_batches == 2);
    CHECK(st.filtered_groups == 1);
    CHECK(st.prompts_read == 4);
    CHECK(st.prompts == 2);
    CHECK(st.samples == 8);
    CHECK(st.grad_norm > 0);
    // The kept rows train on their own prompts: the training forward sees what the engine saw.
    CHECK(st.logp_abs_diff_mean < 1e-5);
    CHECK(tr.state().step == 1);
    CHECK(tr.state().position == 4);
    const train::Scalars sc = rl_scalars(st);
    CHECK(std::find(sc.begin(), sc.end(), std::pair<std::string, double>{"filter_groups/filtered", 1.0}) != sc.end());
    CHECK(format_rl_progress(st, 3).find("groups 2 of 4 prompts in 2 batches") != std::string::npos);
    // Step 2: rows 4 (flat) and 5, then 6 and 7: the epoch's end.
    st = tr.step();
    want = group_rewards(5), more = group_rewards(6);
    want.insert(want.end(), more.begin(), more.end());
    CHECK(st.rewards == want);
    CHECK(tr.state().epoch == 1);
    CHECK(tr.state().position == 0);
    CHECK(tr.run_keys()["--filter-groups"] == "--max-num-gen-batches 10");
  }
  {
    // One batch allowed: the step trains on the one varied group it found.
    GrpoTrainer tr = make(1, 8, std::make_unique<RowReward>());
    const RlStepStats st = tr.step();
    CHECK(st.rewards == group_rewards(1));
    CHECK(st.gen_batches == 1);
    CHECK(st.prompts == 1);
    CHECK(st.samples == 4);
    CHECK(st.grad_norm > 0);
    CHECK(tr.state().position == 2);
  }
  {
    // Nothing varies: the step stops with the flags to look at, and counts no step.
    GrpoTrainer tr = make(3, 8, std::make_unique<ConstantReward>());
    CHECK_THROWS_WITH_AS(tr.step(), doctest::Contains("--max-num-gen-batches 3"), std::runtime_error);
    CHECK(tr.state().step == 0);
  }
}

TEST_CASE("areno train --algo grpo|gspo: 2 steps on a prompt file write the issue's metrics") {
  testing::TempDir dir;
  {
    std::ofstream out(dir.path / "prompts.jsonl");
    for (int a = 1; a <= 4; ++a)
      out << json{{"prompt", fmt::format("What is {} + 1?", a)}, {"answer", std::to_string(a + 1)}}.dump() << "\n";
  }
  for (const char* algo : {"grpo", "gspo"}) {
    const std::string mdir = dir.str(std::string("metrics-") + algo);
    CHECK(app::cmd_train({"--algo", algo, "--dataset-path", dir.str("prompts.jsonl"), "--reward", "exact",
                          "--batch-size", "2", "--n-samples", "3", "--mini-bs", "4", "--max-new-tokens", "4",
                          "--max-steps", "2", "--lr", "1e-4", "--metrics-log-dir", mdir, "--save-path",
                          dir.str(std::string("save-") + algo), "--drop-rollout-state",
                          // one completion decoded at a time, a context far above the prompts: same results
                          "--max-running-prompts", "1", "--max-context-len", "4096"}) == 0);
    const std::vector<json> lines = testing::metrics_lines(mdir);
    REQUIRE(lines.size() == 2);
    for (size_t i = 0; i < lines.size(); ++i) {
      const json& j = lines[i];
      CHECK(j["step"] == int64_t(i + 1));
      for (const char* key : {"reward_mean", "advantage_mean", "response_len", "rollout_logprobs_mean",
                              "train_logprobs_mean", "logp_diff_mean", "logp_abs_diff_mean", "ratio_mean",
                              "clip_frac", "kl", "loss", "grad_norm", "time/rollout_s", "time/train_s",
                              "time/total_s"}) {
        CAPTURE(key);
        REQUIRE(j.contains(key));
        CHECK(j[key].is_number());
      }
      CHECK(j["reward_mean"].get<double>() >= 0.0);
      CHECK(j["reward_mean"].get<double>() <= 1.0);
      // The demo model is trained and confident: its rows have a tail that an
      // f32 sum of exponentials used to drop (kernels/cpu/rows.cpp).
      CHECK(j["logp_abs_diff_mean"].get<double>() < 1e-5);
      CHECK(j["samples"].get<double>() == 6.0);
    }
    CHECK(fs::exists(dir.path / (std::string("save-") + algo) / "step-2" / "optimizer" / "optimizer.safetensors"));
    const json ts = json::parse(std::ifstream(dir.path / (std::string("save-") + algo) / "step-2" / "trainer_state.json"));
    CHECK(ts["algo"] == algo);
  }
  // A resume repeats the run's options (test_rl_resume.cpp).
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "grpo", "--dataset-path", dir.str("prompts.jsonl"), "--reward",
                                       "exact", "--resume", dir.str("save-grpo")}),
                       doctest::Contains("--batch-size differs"), std::runtime_error);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "grpo", "--dataset-path", dir.str("prompts.jsonl")}),
                       doctest::Contains("--reward"), std::invalid_argument);
  const std::string prompts = dir.str("prompts.jsonl");
  for (const auto& [extra, what] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--loss-agg-mode", "seq-sum"}, "--loss-agg-mode: 'seq-sum'"},
           {{"--scale-rewards", "max"}, "--scale-rewards: 'max'"},
           {{"--grpo-clip-eps-high", "0"}, "--grpo-clip-eps-high"},
           {{"--algo", "ppo", "--scale-rewards", "none"}, "only with --algo grpo|gspo"},
           {{"--algo", "gspo", "--loss-agg-mode", "token-mean", "--grpo-clip-eps-high", "0.3"}, "only with --algo grpo"},
           {{"--overlong-buffer-len", "256", "--max-new-tokens", "256"}, "--overlong-buffer-len: must be between"},
           {{"--algo", "sft", "--overlong-buffer-len", "4"}, "--overlong-buffer-len: only with"},
           {{"--overlong-buffer-len", "4", "--overlong-penalty-factor", "-1"}, "--overlong-penalty-factor"},
           {{"--algo", "ppo", "--filter-groups"}, "--filter-groups, --max-num-gen-batches: only with --algo grpo|gspo"},
           {{"--algo", "ppo", "--adv-estimator", "rloo"}, "only with --algo grpo|gspo"},
           {{"--adv-estimator", "gae"}, "--adv-estimator: 'gae'"},
           {{"--adv-estimator", "rloo", "--scale-rewards", "batch"}, "--scale-rewards: only with --adv-estimator grpo"},
           {{"--max-num-gen-batches", "3"}, "--max-num-gen-batches: only with --filter-groups"},
           {{"--filter-groups", "--max-num-gen-batches", "0"}, "--max-num-gen-batches"}}) {
    std::vector<std::string> args = {"--algo", "grpo", "--dataset-path", prompts, "--reward", "exact"};
    args.insert(args.end(), extra.begin(), extra.end());
    CAPTURE(what);
    CHECK_THROWS_WITH_AS(app::cmd_train(args), doctest::Contains(what.c_str()), std::invalid_argument);
  }
}

TEST_CASE("rl/grpo audio prompts with the speech LoRA's dropout (0.01): turned off, so rollout and training agree") {
  // Before: the trainer put the LoRA branches in training mode and both the
  // engine and the training forward drew their own dropout masks.
  auto model = testing::tiny_phi4mm();
  {
    auto probe = testing::tiny_phi4mm();
    train::apply_trainable(*probe, train::GroupOptions{});
    CHECK(train::disable_dropout(*probe) > 0);  // the speech adapters had one
    CHECK(train::disable_dropout(*probe) == 0);
  }
  std::vector<train::PromptRow> prompts;
  const std::vector<train::SftRow> golden = testing::golden_rows();
  for (int k : {2, 3}) {  // audio, image+audio
    const train::SftRow& r = golden[size_t(k)];
    train::PromptRow p;
    p.ids.assign(r.ids.begin(), r.ids.begin() + r.prompt_tokens);
    p.media = r.media;
    p.adapter = r.adapter;
    p.line = k;
    p.messages = json::array();
    p.row = json::object();
    prompts.push_back(std::move(p));
  }
  GrpoTrainer tr(model, tokenizer(), prompts, options(4), std::make_unique<SpreadReward>());
  CHECK(model->model->layers->at<phi4mm::DecoderLayer>(0)->self_attn->qkv_proj->is_training());
  const RlStepStats st = tr.step();
  MESSAGE(fmt::format("audio prompts in training mode: logp_abs_diff_mean {:.2e} max {:.2e}", st.logp_abs_diff_mean,
                      st.logp_abs_diff_max));
  CHECK(st.samples == 8);
  CHECK(st.logp_abs_diff_mean < 1e-5);
  CHECK(st.logp_abs_diff_max < 1e-4);
  CHECK(st.ratio_mean == doctest::Approx(1.0).epsilon(1e-4));
}
