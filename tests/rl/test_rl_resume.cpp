// `areno train --resume` for grpo/gspo, ppo and dpo (issue 15; docs/rl.md,
// "Resuming a run"): on the demo model, an uninterrupted 3-step run and a run
// stopped after step 2 and resumed to step 3 end with the same files, bit for
// bit (weights, optimizer states, value head, DPO reference sums,
// trainer_state.json), and log the same metrics; a resume with another
// rollout-shaping option, another algorithm, or from a folder saved before RL
// runs could resume is refused naming the flag or the field.
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/commands_train.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/demo/demo.h"
#include "nn/io/files.h"
#include "tests/rl/rl_fixtures.h"
#include "tests/test_util.h"

using namespace areno;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

void write_rows(const fs::path& file, const std::vector<json>& rows) {
  std::ofstream out(file);
  for (const json& r : rows) out << r.dump() << "\n";
}

// Four prompts {"prompt": "What is a + 1?", "answer": "a+1"}: with --batch-size 2, step 3 is
// the first of the second epoch (a new shuffle).
std::string sum_prompts(const testing::TempDir& dir) {
  std::vector<json> rows;
  for (int a = 1; a <= 4; ++a)
    rows.push_back({{"prompt", fmt::format("What is {} + 1?", a)}, {"answer", std::to_string(a + 1)}});
  write_rows(dir.path / "prompts.jsonl", rows);
  return dir.str("prompts.jsonl");
}

std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The files of a step folder that hold state (weights, optimizers, value
// head, reference sums, trainer_state.json), relative to it.
std::vector<std::string> state_files(const fs::path& step) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(step)) {
    const fs::path rel = fs::relative(e.path(), step);
    if (e.is_regular_file() && (e.path().extension() == ".safetensors" || rel == "trainer_state.json"))
      out.push_back(rel.string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// `args` (common to every run, with --lr-decay-steps 3 so the schedule does
// not depend on --max-steps) run for 3 steps at once into a/, and for 2 steps
// into b/ then resumed from b/ to step 3. Checks that b/step-3 holds the same
// state files as a/step-3, byte for byte, and that the two metrics.jsonl are
// equal but for times and memory. Returns b/step-3.
fs::path check_resume_equals_uninterrupted(const testing::TempDir& dir, const std::vector<std::string>& args) {
  REQUIRE(app::cmd_train(concat(args, {"--max-steps", "3", "--save-path", dir.str("a"), "--metrics-log-dir",
                                       dir.str("ma")})) == 0);
  REQUIRE(app::cmd_train(concat(args, {"--max-steps", "2", "--save-path", dir.str("b"), "--metrics-log-dir",
                                       dir.str("mb")})) == 0);
  CHECK(read_file(dir.str("b/latest")) == "step-2\n");
  REQUIRE(app::cmd_train(concat(args, {"--max-steps", "3", "--resume", dir.str("b"), "--save-path", dir.str("b"),
                                       "--metrics-log-dir", dir.str("mb")})) == 0);
  CHECK(read_file(dir.str("b/latest")) == "step-3\n");

  const fs::path a = dir.path / "a" / "step-3", b = dir.path / "b" / "step-3";
  const std::vector<std::string> files = state_files(a);
  CHECK(state_files(b) == files);
  for (const std::string& f : files) {
    CAPTURE(f);
    CHECK(read_file((a / f).string()) == read_file((b / f).string()));
  }

  const std::vector<json> ma = testing::metrics_lines(dir.str("ma")), mb = testing::metrics_lines(dir.str("mb"));
  REQUIRE(ma.size() == 3);
  REQUIRE(mb.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(mb[i]["step"] == int64_t(i + 1));
    for (const auto& [key, value] : ma[i].items()) {
      if (key == "time" || key.rfind("time/", 0) == 0 || key.rfind("memory/", 0) == 0) continue;
      CAPTURE(i);
      CAPTURE(key);
      REQUIRE(mb[i].contains(key));
      CHECK(mb[i][key] == value);
    }
  }
  return b;
}

// `args` with the value after `flag` replaced by `value`.
std::vector<std::string> with(std::vector<std::string> args, const std::string& flag, const std::string& value) {
  for (size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == flag) args[i + 1] = value;
  return args;
}

// cmd_train(args) throws std::runtime_error containing `what`.
void check_refused(const std::vector<std::string>& args, const std::string& what) {
  CAPTURE(what);
  CHECK_THROWS_WITH_AS(app::cmd_train(args), doctest::Contains(what.c_str()), std::runtime_error);
}

}  // namespace

TEST_CASE("areno train --resume, grpo: stopped after step 2 and resumed, step 3 equals the uninterrupted run's") {
  testing::TempDir dir;
  // Temperature 1.5: the confident demo model samples diverse completions, so
  // a resumed rollout with another seed would differ.
  const std::vector<std::string> args = {
      "--algo", "grpo", "--dataset-path", sum_prompts(dir), "--reward", "exact", "--batch-size", "2",
      "--n-samples", "3", "--mini-bs", "3", "--max-new-tokens", "4", "--temperature", "1.5", "--lr", "1e-3",
      "--lr-decay-steps", "3", "--seed", "11"};
  const fs::path step3 = check_resume_equals_uninterrupted(dir, args);
  const json ts = json::parse(read_file((step3 / "trainer_state.json").string()));
  CHECK(ts["rollout_runs"] == 3);
  CHECK(ts["epoch"] == 1);
  CHECK(ts["position"] == 2);
  CHECK(ts["run"]["--n-samples"] == 3);
  CHECK(ts["run"]["--reward"] == "exact");
  // The step-3 rollouts differ from step 1's (the count of rollouts seeds them).
  const std::vector<json> m = testing::metrics_lines(dir.str("ma"));
  MESSAGE("reward_mean per step: " << m[0]["reward_mean"] << " " << m[1]["reward_mean"] << " " << m[2]["reward_mean"]);

  // A resume that changes what the rollouts are is refused, naming the flag.
  const std::vector<std::string> resume = {"--max-steps", "3", "--resume", dir.str("b")};
  check_refused(concat(with(args, "--n-samples", "2"), resume), "--n-samples differs");
  check_refused(concat(with(args, "--seed", "12"), resume), "--seed differs");
  check_refused(concat(with(args, "--reward", "math"), resume), "--reward differs");
  check_refused(concat(with(args, "--temperature", "1"), resume), "--temperature differs");
  check_refused(concat(with(args, "--batch-size", "1"), resume), "--batch-size differs");
  check_refused(concat(with(args, "--algo", "gspo"), resume), "--algo differs");
  check_refused(concat(args, {"--max-context-len", "512", "--max-steps", "3", "--resume", dir.str("b")}),
                "--max-context-len differs");
  write_rows(dir.path / "other.jsonl", {{{"prompt", "What is 9 + 1?"}, {"answer", "10"}}});
  check_refused(concat(with(args, "--dataset-path", dir.str("other.jsonl")), resume), "dataset differs");
  // The SFT command on an RL folder.
  write_rows(dir.path / "sft.jsonl", {{{"prompt", "What is 9 + 1?"}, {"response", "10"}}});
  check_refused({"--dataset-path", dir.str("sft.jsonl"), "--resume", dir.str("b")}, "--algo differs");

  // A step folder saved before RL runs could resume (no "run") is refused by name.
  json old = ts;
  old.erase("run");
  old.erase("rollout_runs");
  old["resumable"] = false;
  std::ofstream((step3 / "trainer_state.json").string()) << old.dump(2);
  check_refused(concat(args, {"--max-steps", "4", "--resume", dir.str("b")}), "no \"run\" field");
}

TEST_CASE("areno train --resume, gspo: shares grpo's path; step 3 equals the uninterrupted run's") {
  testing::TempDir dir;
  check_resume_equals_uninterrupted(
      dir, {"--algo", "gspo", "--dataset-path", sum_prompts(dir), "--reward", "exact", "--batch-size", "2",
            "--n-samples", "2", "--mini-bs", "4", "--max-new-tokens", "3", "--temperature", "1.5", "--lr", "1e-3",
            "--lr-decay-steps", "3", "--gspo-clip-eps", "0.2"});
}

TEST_CASE("areno train --resume, ppo: value head, critic optimizer, warm-up, the KL reference and the adaptive KL "
          "coefficient carry over") {
  testing::TempDir dir;
  // Warm-up 1: step 1 trains only the critic; --use-kl-loss: the reference
  // stays the starting policy after the resume (not the step folder's
  // weights); --use-kl-in-reward with the adaptive controller: step 3 uses
  // the coefficient steps 1 and 2 left; two mini-batches per pass.
  const std::vector<std::string> args = {
      "--algo", "ppo", "--dataset-path", sum_prompts(dir), "--reward", "exact", "--batch-size", "2",
      "--n-samples", "2", "--mini-bs", "2", "--max-new-tokens", "4", "--temperature", "1.5", "--lr", "1e-3",
      "--critic-lr", "1e-2", "--lr-decay-steps", "3", "--critic-warmup-steps", "1", "--use-kl-loss",
      "--kl-loss-coef", "0.5", "--ppo-epochs", "2", "--ppo-mini-batch-size", "1", "--use-kl-in-reward",
      "--kl-ctrl", "adaptive", "--kl-coef", "0.05", "--kl-horizon", "10", "--kl-penalty", "abs"};
  const fs::path step3 = check_resume_equals_uninterrupted(dir, args);
  CHECK(fs::exists(step3 / "value_head.safetensors"));
  CHECK(fs::exists(step3 / "optimizer" / "critic_optimizer.safetensors"));
  const std::vector<json> m = testing::metrics_lines(dir.str("mb"));
  CHECK(m[0]["policy_stepped"] == 0.0);
  CHECK(m[2]["policy_stepped"] == 1.0);
  CHECK(m[2]["value_mean"].get<double>() != 0.0);  // the resumed head, not a zero one
  CHECK(m[2]["kl_loss"].get<double>() > 0.0);      // the policy moved away from its start
  CHECK(m[0]["reward_kl_penalty_coeff"].get<double>() == 0.05);
  CHECK(m[2]["reward_kl_penalty_coeff"].get<double>() != 0.05);  // adapted, and carried over
  CHECK(m[2]["updates"].get<double>() == 4.0);
  check_refused(concat(with(args, "--critic-warmup-steps", "2"), {"--max-steps", "3", "--resume", dir.str("b")}),
                "--critic-warmup-steps differs");
  std::vector<std::string> no_kl;
  for (const std::string& a : args)
    if (a != "--use-kl-loss") no_kl.push_back(a);
  check_refused(concat(no_kl, {"--max-steps", "3", "--resume", dir.str("b")}), "--use-kl-loss differs");
  std::vector<std::string> no_klr;
  for (const std::string& a : args)
    if (a != "--use-kl-in-reward") no_klr.push_back(a);
  check_refused(concat(no_klr, {"--max-steps", "3", "--resume", dir.str("b")}), "--use-kl-in-reward differs");
  check_refused(concat(with(args, "--ppo-mini-batch-size", "2"), {"--max-steps", "3", "--resume", dir.str("b")}),
                "--ppo-mini-batch-size differs");
}

TEST_CASE("areno train --resume, ppo --critic-ckpt: the separate critic resumes from the step folder's critic/") {
  testing::TempDir dir;
  phi4mm::save_model(*phi4mm::demo_model(), dir.str("critic"));
  const fs::path step3 = check_resume_equals_uninterrupted(
      dir, {"--algo", "ppo", "--dataset-path", sum_prompts(dir), "--reward", "exact", "--batch-size", "2",
            "--n-samples", "2", "--mini-bs", "4", "--max-new-tokens", "3", "--temperature", "1.5", "--lr", "1e-3",
            "--critic-lr", "1e-3", "--lr-decay-steps", "3", "--critic-ckpt", dir.str("critic")});
  CHECK(fs::exists(step3 / "critic" / "value_head.safetensors"));
  // The critic model (compared above with the rest of critic/) trained.
  REQUIRE(fs::exists(step3 / "critic" / "model.safetensors"));
  CHECK(read_file((step3 / "critic" / "model.safetensors").string()) != read_file(dir.str("critic/model.safetensors")));
}

TEST_CASE("areno train --resume, dpo: the saved reference sums of the starting policy carry over") {
  testing::TempDir dir;
  std::vector<json> rows;
  for (auto [a, b] : std::vector<std::pair<int, int>>{{1, 3}, {2, 3}, {3, 3}, {3, 1}, {2, 2}})
    rows.push_back({{"prompt", fmt::format("What is {} times {}?", a, b)},
                    {"chosen", std::to_string(a * b)},
                    {"rejected", std::to_string(a + b)}});
  write_rows(dir.path / "pairs.jsonl", rows);
  // 5 pairs, 2 a step: step 3 is the short last step of the first epoch.
  const std::vector<std::string> args = {"--algo", "dpo", "--dataset-path", dir.str("pairs.jsonl"), "--batch-size",
                                         "2", "--mini-bs", "1", "--lr", "1e-3", "--lr-decay-steps", "3"};
  const fs::path step3 = check_resume_equals_uninterrupted(dir, args);
  CHECK(fs::exists(step3 / "reference" / "dpo_reference.safetensors"));
  CHECK(testing::metrics_lines(dir.str("mb"))[2]["pairs"] == 1.0);
  check_refused(concat(args, {"--ref-ckpt", (dir.path / "a" / "step-3").string(), "--max-steps", "3", "--resume",
                              dir.str("b")}),
                "--ref-ckpt differs");
  fs::remove(dir.path / "b" / "step-3" / "reference" / "dpo_reference.safetensors");
  check_refused(concat(args, {"--max-steps", "4", "--resume", dir.str("b")}), "dpo_reference.safetensors");
}

TEST_CASE("areno train --resume, grpo --agent-cmd: with a deterministic agent, step 3 equals the uninterrupted run's") {
  // Greedy requests (the script's default) one agent at a time: the agents'
  // trajectories do not depend on the process, so the resumed run repeats the
  // uninterrupted one exactly. (Agents that sample without a seed do not
  // repeat; docs/rl.md, "Resuming a run".)
  testing::TempDir dir;
  const fs::path step3 = check_resume_equals_uninterrupted(
      dir, {"--algo", "grpo", "--dataset-path", sum_prompts(dir), "--agent-cmd",
            "AGENT_REWARD=sample sh tests/rl/scripts/agent_two_turns.sh", "--agent-concurrency", "1",
            "--batch-size", "2", "--n-samples", "2", "--mini-bs", "4", "--lr", "1e-3", "--lr-decay-steps", "3"});
  const json ts = json::parse(read_file((step3 / "trainer_state.json").string()));
  CHECK(testing::metrics_lines(dir.str("mb"))[2]["grad_norm"].get<double>() > 0.0);  // rewards 0, 1 per group
  CHECK(ts["rollout_runs"] == 3);  // the agent rollouts' count (their trajectory ids areno-r<count>-...)
  CHECK(ts["run"]["--agent-cmd"] == "AGENT_REWARD=sample sh tests/rl/scripts/agent_two_turns.sh");
}
