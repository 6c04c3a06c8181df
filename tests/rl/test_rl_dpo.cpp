// The DPO loop (issue 15; docs/rl.md, "The DPO loop"): rows through the SFT
// processor path, sequence log-probabilities against a direct log_softmax of
// the full logits, the first step at the reference (loss log 2, margin 0),
// micro-batch accumulation equal to one batch, a rising margin, and
// `areno train --algo dpo` (metrics, checkpoints, --ref-ckpt).
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/commands_train.h"
#include "models/phi4mm/demo/demo.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tests/rl/rl_fixtures.h"
#include "tests/test_util.h"
#include "tests/train/train_fixtures.h"
#include "train/rl/dpo.h"

using namespace areno;
using namespace areno::train::rl;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const tok::Tokenizer& tokenizer() {
  static const tok::Tokenizer t = phi4mm::make_tokenizer();
  return t;
}

// "What is a times b?": chosen the product, rejected the sum (what the demo model answers).
json times_row(int a, int b) {
  return {{"prompt", fmt::format("What is {} times {}?", a, b)},
          {"chosen", std::to_string(a * b)},
          {"rejected", std::to_string(a + b)}};
}

std::vector<DpoRow> times_rows() {
  std::vector<DpoRow> rows;
  int line = 0;
  for (auto [a, b] : std::vector<std::pair<int, int>>{{1, 3}, {2, 3}, {3, 3}, {3, 1}})
    rows.push_back(make_dpo_row(tokenizer(), {++line, times_row(a, b), {}}, "pairs.jsonl", {}));
  return rows;
}

DpoTrainOptions options(int64_t batch, int64_t mini_bs) {
  DpoTrainOptions o;
  o.loop.batch_size = batch;
  o.loop.mini_bs = mini_bs;
  o.loop.lr = 1e-3;
  o.loop.max_steps = 5;
  o.loop.seed = 7;
  o.loop.decay = train::DecayStyle::constant;
  o.loop.grad_clip_norm = 0;  // grad_norm stays the raw norm
  return o;
}

// log_softmax of one unpacked forward's full [L, V] logits, gathered at the
// completion's tokens and summed: the definition, without the packing or the
// chunked head.
double direct_sequence_logp(const phi4mm::Phi4MMForCausalLM& model, const Prompt& p,
                            const std::vector<int64_t>& completion) {
  std::vector<int64_t> ids = p.ids;
  ids.insert(ids.end(), completion.begin(), completion.end() - 1);
  phi4mm::PackedBatch pb = phi4mm::PackedBatch::single(ids, p.adapter);
  if (!p.media.empty()) pb.media_rows = phi4mm::media_rows(model, p.media);
  const Tensor logits = linear(model.hidden_states(pb), model.model->embed_tokens->weight).to(DType::f32);
  const std::vector<float> lsm = log_softmax(logits, -1).to_vector<float>();
  const int64_t V = logits.size(1);
  double sum = 0;
  for (size_t t = 0; t < completion.size(); ++t)
    sum += lsm[size_t(int64_t(p.ids.size() - 1 + t) * V + completion[t])];
  return sum;
}

}  // namespace

TEST_CASE("rl/dpo a row is the SFT row's prompt with the chosen and rejected responses as completions") {
  const DpoRow r = make_dpo_row(tokenizer(), {3, times_row(2, 3), {}}, "pairs.jsonl", {});
  // The prompt is the RL prompt row (generation prompt, ends with <|assistant|>).
  const train::PromptRow pr = train::make_prompt_row(tokenizer(), {3, times_row(2, 3), {}}, "pairs.jsonl", {});
  CHECK(r.prompt.ids == pr.ids);
  CHECK(r.prompt.ids.back() == phi4mm::kAssistant);
  CHECK(r.line == 3);
  // Each completion is the response's tokens and <|end|>, as make_sft_row's targets.
  REQUIRE(r.chosen.size() >= 2);
  CHECK(r.chosen.back() == phi4mm::kEnd);
  CHECK(r.rejected.back() == phi4mm::kEnd);
  const std::vector<tok::TokenId> c(r.chosen.begin(), r.chosen.end()), j(r.rejected.begin(), r.rejected.end());
  CHECK(tokenizer().decode(c, true) == "6");
  CHECK(tokenizer().decode(j, true) == "5");
  const train::SftRow sft = train::make_sft_row(
      tokenizer(), {3, json{{"prompt", "What is 2 times 3?"}, {"response", "6"}}, {}}, "pairs.jsonl", {});
  CHECK(std::vector<int64_t>(sft.ids.begin() + sft.prompt_tokens, sft.ids.begin() + sft.prompt_tokens +
                             sft.target_tokens) == r.chosen);
  // Bad rows name the field.
  CHECK_THROWS_WITH_AS(make_dpo_row(tokenizer(), {4, json{{"prompt", "x"}, {"chosen", "1"}}, {}}, "pairs.jsonl", {}),
                       doctest::Contains("pairs.jsonl:4: rejected"), train::DatasetError);
  CHECK_THROWS_WITH_AS(
      make_dpo_row(tokenizer(), {5, json{{"prompt", "x"}, {"chosen", 1}, {"rejected", "2"}}, {}}, "pairs.jsonl", {}),
      doctest::Contains("pairs.jsonl:5: chosen"), train::DatasetError);
  CHECK_THROWS_WITH_AS(make_dpo_row(tokenizer(), {6, json{{"chosen", "1"}, {"rejected", "2"}}, {}}, "pairs.jsonl", {}),
                       doctest::Contains("pairs.jsonl:6: prompt"), train::DatasetError);
}

TEST_CASE("rl/dpo sequence log-probabilities equal log_softmax of the full logits, text, image and audio") {
  auto model = testing::tiny_phi4mm();
  // The four trainer fixture prompts (text, image, audio, audio + image),
  // each with two completions of different lengths.
  std::vector<DpoRow> rows;
  int64_t k = 0;
  for (const train::SftRow& s : testing::golden_rows()) {
    DpoRow r;
    r.prompt.ids.assign(s.ids.begin(), s.ids.begin() + s.prompt_tokens);
    r.prompt.media = s.media;
    r.prompt.adapter = s.adapter;
    r.chosen = {4821 + k, 13, testing::kEnd};
    r.rejected = {777 + 3 * k, testing::kEnd};
    rows.push_back(std::move(r));
    ++k;
  }
  std::vector<const DpoRow*> ptrs;
  for (const DpoRow& r : rows) ptrs.push_back(&r);
  PolicyLogpOptions po;
  po.chunk_rows = 3;  // several chunks of the head
  const PairLogp p = pair_logp(*model, ptrs, po);
  REQUIRE(p.chosen.numel() == 4);
  CHECK(p.chosen.requires_grad());
  const std::vector<float> pc = p.chosen.to_vector<float>(), pr = p.rejected.to_vector<float>();
  double worst = 0;
  NoGradGuard ng;
  for (size_t i = 0; i < rows.size(); ++i) {
    const double dc = direct_sequence_logp(*model, rows[i].prompt, rows[i].chosen);
    const double dr = direct_sequence_logp(*model, rows[i].prompt, rows[i].rejected);
    CAPTURE(i);
    CHECK(dc < 0);
    CHECK(std::abs(pc[i] - dc) <= 1e-5 * std::max(1.0, std::abs(dc)));
    CHECK(std::abs(pr[i] - dr) <= 1e-5 * std::max(1.0, std::abs(dr)));
    worst = std::max({worst, std::abs(pc[i] - dc) / std::max(1.0, std::abs(dc)),
                      std::abs(pr[i] - dr) / std::max(1.0, std::abs(dr))});
  }
  MESSAGE(fmt::format("pair_logp vs direct log_softmax: worst relative error {:.2e}", worst));
}

TEST_CASE("rl/dpo the first step is at the reference: loss log 2, margin 0") {
  auto model = phi4mm::demo_model();
  DpoTrainer tr(model, times_rows(), options(4, 3));
  REQUIRE(tr.ref_chosen().size() == 4);
  double rc = 0, rr = 0;
  for (size_t i = 0; i < 4; ++i) {
    CHECK(tr.ref_chosen()[i] < 0);
    rc += tr.ref_chosen()[i] / 4;
    rr += tr.ref_rejected()[i] / 4;
  }
  // The demo model answers the sum: the rejected response is the likelier one.
  CHECK(rr > rc);
  const DpoStepStats st = tr.step();
  MESSAGE(fmt::format("step 1: loss {:.9f} (log 2 = {:.9f}) margin {:.2e} chosen_logp {:.4f} rejected_logp {:.4f} "
                      "grad_norm {:.4f}", st.dpo.loss, std::log(2.0), st.dpo.reward_margin, st.chosen_logp,
                      st.rejected_logp, st.grad_norm));
  CHECK(st.pairs == 4);
  CHECK(std::abs(st.dpo.loss - std::log(2.0)) < 1e-6);
  CHECK(std::abs(st.dpo.reward_margin) < 1e-6);
  CHECK(std::abs(st.dpo.chosen_reward) < 1e-6);
  CHECK(std::abs(st.dpo.rejected_reward) < 1e-6);
  CHECK(st.chosen_logp == doctest::Approx(rc).epsilon(1e-6));
  CHECK(st.rejected_logp == doctest::Approx(rr).epsilon(1e-6));
  CHECK(st.grad_norm > 0);
  CHECK(tr.state().step == 1);
  CHECK(tr.state().epoch == 1);  // 4 rows, batch 4: one epoch per step
}

TEST_CASE("rl/dpo loss types at the reference: their closed forms; IPO's averaged log-probabilities move the margin") {
  // At step 1 the policy is the reference: z = 0 for every pair.
  struct Case {
    DpoLossType type;
    double ls, loss;
  };
  const double beta = DpoOptions{}.beta;
  for (const Case& c : {Case{DpoLossType::sigmoid, 0.2, std::log(2.0)}, Case{DpoLossType::robust, 0.2, std::log(2.0)},
                        Case{DpoLossType::hinge, 0.0, 1.0}, Case{DpoLossType::ipo, 0.0, 1 / (4 * beta * beta)}}) {
    CAPTURE(dpo_loss_type_name(c.type));
    DpoTrainOptions o = options(4, 2);
    o.dpo.loss_type = c.type;
    o.dpo.label_smoothing = c.ls;
    o.loop.lr = 3e-4;
    DpoTrainer tr(phi4mm::demo_model(), times_rows(), o);
    const DpoStepStats s1 = tr.step();
    CHECK(s1.dpo.loss == doctest::Approx(c.loss).epsilon(1e-6));
    CHECK(std::abs(s1.dpo.reward_margin) < 1e-6);
    CHECK(s1.grad_norm > 0);
    const DpoStepStats s2 = tr.step();
    MESSAGE(fmt::format("{}: loss {:.6f} -> {:.6f}, margin -> {:.5f}", dpo_loss_type_name(c.type), s1.dpo.loss,
                        s2.dpo.loss, s2.dpo.reward_margin));
    CHECK(s2.dpo.reward_margin > 0);  // every loss pushes the chosen answer up
    CHECK(s2.dpo.loss < s1.dpo.loss);
  }
  DpoTrainOptions bad = options(4, 2);
  bad.dpo.loss_type = DpoLossType::ipo;
  bad.dpo.label_smoothing = 0.1;
  CHECK_THROWS_WITH_AS(DpoTrainer(phi4mm::demo_model(), times_rows(), bad),
                       doctest::Contains("--dpo-label-smoothing: only with --dpo-loss-type sigmoid or robust"),
                       std::invalid_argument);
}

TEST_CASE("rl/dpo micro-batches accumulate to the one-batch gradient") {
  std::vector<DpoStepStats> st;
  for (int64_t mini : {4, 3, 1}) {
    // Two steps: the second is away from the reference (a non-zero margin).
    DpoTrainer tr(phi4mm::demo_model(), times_rows(), options(4, mini));
    st.push_back(tr.step());
    st.push_back(tr.step());
  }
  for (size_t i = 2; i < st.size(); ++i) {
    CAPTURE(i);
    CHECK(st[i].dpo.loss == doctest::Approx(st[i % 2].dpo.loss).epsilon(1e-5));
    CHECK(st[i].dpo.reward_margin == doctest::Approx(st[i % 2].dpo.reward_margin).epsilon(1e-4));
    CHECK(st[i].grad_norm == doctest::Approx(st[i % 2].grad_norm).epsilon(1e-5));
  }
  CHECK(std::abs(st[1].dpo.reward_margin) > 1e-3);
  MESSAGE(fmt::format("grad_norm step 1: {:.9f} / {:.9f} / {:.9f}, step 2: {:.9f} / {:.9f} / {:.9f} (mini-bs 4 / 3 / 1)",
                      st[0].grad_norm, st[2].grad_norm, st[4].grad_norm, st[1].grad_norm, st[3].grad_norm,
                      st[5].grad_norm));
}

TEST_CASE("rl/dpo a few steps raise the chosen-minus-rejected margin") {
  DpoTrainOptions o = options(4, 4);
  o.loop.lr = 3e-4;
  DpoTrainer tr(phi4mm::demo_model(), times_rows(), o);
  std::vector<DpoStepStats> st;
  while (!tr.done()) st.push_back(tr.step());
  REQUIRE(st.size() == 5);
  std::string line;
  for (const DpoStepStats& s : st) line += fmt::format(" {:.4f}/{:.2f}/{:.4f}", s.dpo.reward_margin, s.dpo.reward_accuracy, s.dpo.loss);
  MESSAGE("margin/accuracy/loss per step:" << line);
  for (size_t i = 1; i < st.size(); ++i) {
    CAPTURE(i);
    CHECK(st[i].dpo.reward_margin > st[i - 1].dpo.reward_margin);
    CHECK(st[i].dpo.loss < st[i - 1].dpo.loss);
  }
  CHECK(st.back().dpo.reward_accuracy == 1.0);
  CHECK(st.back().dpo.chosen_reward > 0);
  CHECK(st.back().dpo.rejected_reward < 0);
}

TEST_CASE("areno train --algo dpo: 2 steps on a 4-row file write the metrics; --ref-ckpt sets the reference") {
  testing::TempDir dir;
  {
    std::ofstream out(dir.path / "pairs.jsonl");
    for (auto [a, b] : std::vector<std::pair<int, int>>{{1, 3}, {2, 3}, {3, 3}, {3, 1}})
      out << times_row(a, b).dump() << "\n";
  }
  const std::string pairs = dir.str("pairs.jsonl"), save = dir.str("save");
  CHECK(app::cmd_train({"--algo", "dpo", "--dataset-path", pairs, "--batch-size", "2", "--mini-bs", "1",
                        "--max-steps", "2", "--lr", "1e-3", "--dpo-beta", "0.1", "--metrics-log-dir",
                        dir.str("m1"), "--save-path", save}) == 0);
  const std::vector<json> lines = testing::metrics_lines(dir.str("m1"));
  REQUIRE(lines.size() == 2);
  for (size_t i = 0; i < lines.size(); ++i) {
    const json& j = lines[i];
    CHECK(j["step"] == int64_t(i + 1));
    for (const char* key : {"loss", "chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy",
                            "chosen_logp", "rejected_logp", "grad_norm", "lr/lm", "pairs", "time/step_s"}) {
      CAPTURE(key);
      REQUIRE(j.contains(key));
      CHECK(j[key].is_number());
    }
    CHECK(j["pairs"].get<double>() == 2.0);
    CHECK(j["lr/lm"].get<double>() > 0);
  }
  CHECK(std::abs(lines[0]["loss"].get<double>() - std::log(2.0)) < 1e-6);
  CHECK(std::abs(lines[0]["reward_margin"].get<double>()) < 1e-6);
  CHECK(std::abs(lines[1]["reward_margin"].get<double>()) > 1e-4);
  const fs::path step2 = fs::path(save) / "step-2";
  CHECK(fs::exists(step2 / "optimizer" / "optimizer.safetensors"));
  const json ts = json::parse(std::ifstream(step2 / "trainer_state.json"));
  CHECK(ts["algo"] == "dpo");
  CHECK(ts["dpo_beta"] == 0.1);

  // The trained step as the reference of the demo model: at the first step the
  // policy gives the chosen answers less and the rejected more than the
  // reference, so the margin is negative.
  CHECK(app::cmd_train({"--algo", "dpo", "--dataset-path", pairs, "--batch-size", "4", "--max-steps", "1",
                        "--ref-ckpt", step2.string(), "--metrics-log-dir", dir.str("m2")}) == 0);
  const std::vector<json> ref_lines = testing::metrics_lines(dir.str("m2"));
  REQUIRE(ref_lines.size() == 1);
  MESSAGE("demo policy, step-2 reference: margin " << ref_lines[0]["reward_margin"].get<double>());
  CHECK(ref_lines[0]["reward_margin"].get<double>() < -1e-3);
  CHECK(ref_lines[0]["loss"].get<double>() > std::log(2.0));
  // The same checkpoint as policy and reference: back at log 2.
  CHECK(app::cmd_train({"--algo", "dpo", "--dataset-path", pairs, "--ckpt", step2.string(), "--batch-size", "4",
                        "--max-steps", "1", "--ref-ckpt", step2.string(), "--metrics-log-dir", dir.str("m3")}) == 0);
  const std::vector<json> same = testing::metrics_lines(dir.str("m3"));
  REQUIRE(same.size() == 1);
  CHECK(std::abs(same[0]["loss"].get<double>() - std::log(2.0)) < 1e-6);

  // A resume repeats the run's options (test_rl_resume.cpp).
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "dpo", "--dataset-path", pairs, "--resume", save}),
                       doctest::Contains("--batch-size differs"), std::runtime_error);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "sft", "--dataset-path", pairs, "--ref-ckpt", step2.string()}),
                       doctest::Contains("--ref-ckpt"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "dpo", "--dataset-path", pairs, "--dpo-beta", "0"}),
                       doctest::Contains("--dpo-beta"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "dpo", "--dataset-path", pairs, "--dpo-loss-type", "kto"}),
                       doctest::Contains("--dpo-loss-type: 'kto'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "dpo", "--dataset-path", pairs, "--dpo-loss-type", "hinge",
                                       "--dpo-label-smoothing", "0.1"}),
                       doctest::Contains("--dpo-label-smoothing"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "dpo", "--dataset-path", pairs, "--dpo-label-smoothing", "0.5"}),
                       doctest::Contains("--dpo-label-smoothing"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "sft", "--dataset-path", pairs, "--dpo-loss-type", "ipo"}),
                       doctest::Contains("only with --algo dpo"), std::invalid_argument);
  // A resume with another loss type is refused by name.
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "dpo", "--dataset-path", pairs, "--batch-size", "2", "--mini-bs",
                                       "1", "--max-steps", "3", "--dpo-loss-type", "ipo", "--resume", save}),
                       doctest::Contains("--dpo-loss-type differs"), std::runtime_error);
}
