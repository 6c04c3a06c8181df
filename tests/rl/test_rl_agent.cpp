// Agentic rollouts (issue 15, "Agentic rollouts", must-shows 5 and 6; docs/rl.md,
// "Agentic rollouts") on the demo model: a two-turn sh + curl agent against
// the trainer's server gives one row whose sampled tokens are trainable and
// whose tool result is masked, the recorded log-probabilities equal
// policy_logp's (f32, 1e-5), the KV blocks are free after the phase; agents
// that crash, time out, print a malformed line or an unknown id fail with a
// clear message and leave the rollout usable; the row rule splits a
// re-templated turn and keeps an image sent in a later turn in its row (a
// replaced one splits); `areno train --agent-cmd` runs GRPO steps.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/commands_train.h"
#include "app/served_model.h"
#include <httplib.h>
#include <stb_image_write.h>

#include "models/phi4mm/demo/demo.h"
#include "models/phi4mm/processor/chat_processor.h"
#include "models/phi4mm/processor/media_source.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "tensor/autograd.h"
#include "tests/rl/rl_fixtures.h"
#include "tests/test_util.h"
#include "serve/openai.h"
#include "tests/train/train_fixtures.h"
#include "train/rl/agent.h"
#include "train/rl/policy_logp.h"
#include "train/rl/process.h"

using namespace areno;
using namespace areno::train::rl;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::shared_ptr<const tok::Tokenizer> tokenizer() { return testing::phi4_tokenizer(); }

std::shared_ptr<phi4mm::Phi4MMForCausalLM> model() {
  static auto m = phi4mm::demo_model();
  return m;
}

RolloutOptions rollout_options(int64_t n) {
  RolloutOptions o;
  o.n_samples = n;
  o.max_new_tokens = 6;
  o.seed = 11;
  o.engine.kv_blocks = 64;
  o.engine.max_running = 8;
  return o;
}

AgentOptions agent(const std::string& script, double timeout_s = 60, const std::string& env = "") {
  AgentOptions a;
  a.cmd = env + "sh tests/rl/scripts/" + script;
  a.timeout_s = timeout_s;
  return a;
}

std::vector<AgentTask> tasks(int n) {
  std::vector<AgentTask> ts;
  for (int i = 0; i < n; ++i)
    ts.push_back({json{{"prompt", fmt::format("What is {} + 3?", i + 2)}, {"answer", i + 5}}, i, 0, i + 1, {}});
  return ts;
}

// `tools` with one function, add(a, b) (tests/rl/scripts/agent_tool_add.sh sends the same).
json add_tool() {
  return json::array({{{"type", "function"},
                       {"function",
                        {{"name", "add"},
                         {"description", "Adds two integers."},
                         {"parameters",
                          {{"type", "object"},
                           {"properties", {{"a", {{"type", "integer"}}}, {"b", {{"type", "integer"}}}}}}}}}}});
}

// A 64 x 64 PNG, a square of (r, g, b) on white, as a data URL.
std::string square_png_url(uint8_t r, uint8_t g, uint8_t b) {
  constexpr int kSize = 64;
  std::vector<uint8_t> px(size_t(kSize * kSize * 3), 255);
  for (int y = 16; y < 48; ++y)
    for (int x = 16; x < 48; ++x) {
      uint8_t* p = &px[size_t((y * kSize + x) * 3)];
      p[0] = r, p[1] = g, p[2] = b;
    }
  std::vector<uint8_t> png;
  auto append = [](void* ctx, void* data, int size) {
    auto* out = static_cast<std::vector<uint8_t>*>(ctx);
    out->insert(out->end(), static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + size);
  };
  REQUIRE(stbi_write_png_to_func(append, &png, kSize, kSize, 3, px.data(), kSize * 3) != 0);
  return "data:image/png;base64," + phi4mm::encode_base64(png.data(), png.size());
}

// The training forward's log-probabilities of every row of b (policy_logp,
// the mask checked against the rows' flags) against the recorded ones over
// the trainable tokens: the worst difference and how many were compared.
struct Parity {
  double worst = 0;
  int64_t compared = 0;
};
Parity parity(const RolloutBatch& b) {
  std::vector<Sequence> seqs;
  for (const RolloutSample& s : b.samples) seqs.push_back({s.prompt, s.tokens, s.trainable});
  NoGradGuard ng;
  const TokenLogp tl = policy_logp(*model(), b.prompts, seqs);
  const std::vector<float> lp = tl.logp.to_vector<float>(), mask = tl.mask.to_vector<float>();
  const int64_t T = tl.logp.size(1);
  Parity p;
  for (size_t n = 0; n < b.samples.size(); ++n) {
    const RolloutSample& s = b.samples[n];
    for (size_t t = 0; t < s.tokens.size(); ++t) {
      CHECK(mask[n * size_t(T) + t] == float(s.trainable[t]));
      if (!s.trainable[t]) continue;
      p.worst = std::max(p.worst, std::abs(double(lp[n * size_t(T) + t]) - double(s.logp[t])));
      ++p.compared;
    }
  }
  return p;
}

std::string decode(const std::vector<int64_t>& ids) {
  return tokenizer()->decode(std::vector<tok::TokenId>(ids.begin(), ids.end()), /*skip_special_tokens=*/false);
}

}  // namespace

TEST_CASE("rl/agent two turns with a tool result: one row, its mask, log-prob parity, free KV blocks") {
  AgentRollout ar(model(), tokenizer(), rollout_options(2), agent("agent_two_turns.sh", 60, "AGENT_REWARD=0.5 "));
  const RolloutBatch b = ar.run(tasks(2));
  REQUIRE(b.trajectories.size() == 4);
  REQUIRE(b.samples.size() == 4);  // one row per trajectory: every turn continued the row
  CHECK(ar.split_rows() == 0);
  CHECK(ar.port() > 0);
  // The phase is over: the engine is stopped with every block free.
  CHECK(ar.last_stats().kv_blocks_used == 0);
  CHECK(ar.last_stats().kv_blocks_total == 64);
  CHECK(ar.last_stats().requests_finished == 8);  // 2 tasks x 2 samples x 2 turns

  for (size_t k = 0; k < b.trajectories.size(); ++k) {
    const RolloutBatch::Trajectory& t = b.trajectories[k];
    CAPTURE(k);
    CHECK(t.task == int64_t(k / 2));
    CHECK(t.index == int64_t(k % 2));
    REQUIRE(t.rows.size() == 1);
    REQUIRE(t.reward.has_value());
    CHECK(*t.reward == 0.5);
    const RolloutSample& s = b.samples[size_t(t.rows[0])];
    // The row's prompt is the first turn's templated prompt.
    CHECK(decode(b.prompts[size_t(s.prompt)].ids) == fmt::format("<|user|>What is {} + 3?<|end|><|assistant|>", t.task + 2));
    // Layout: [sampled answer 1][context: the tool turn][sampled answer 2].
    REQUIRE(s.trainable.size() == s.tokens.size());
    REQUIRE(s.logp.size() == s.tokens.size());
    size_t a = 0;
    while (a < s.tokens.size() && s.trainable[a]) ++a;
    size_t c = a;
    while (c < s.tokens.size() && !s.trainable[c]) ++c;
    CHECK(a >= 1);
    CHECK(c > a);
    for (size_t i = c; i < s.tokens.size(); ++i) CHECK(s.trainable[i] == 1);
    std::string context = decode(std::vector<int64_t>(s.tokens.begin() + int64_t(a), s.tokens.begin() + int64_t(c)));
    // The first answer ends with the sampled <|end|> unless it hit max_tokens,
    // then the template writes it as context.
    if (context.rfind("<|end|>", 0) == 0) context = context.substr(7);
    CHECK(context == "<|tool|>42<|end|><|assistant|>");
    for (size_t i = 0; i < s.tokens.size(); ++i) CHECK(std::isnan(s.logp[i]) == !s.trainable[i]);
    // The final answer is the second turn's (what --reward would score).
    CHECK(t.tokens == int64_t(s.tokens.size() - c));
  }
  // The engine's log-probabilities of the sampled tokens equal the training
  // forward's over the whole row (f32, CPU).
  const Parity p = parity(b);
  CHECK(p.compared >= 8);
  CHECK(p.worst < 1e-5);
  MESSAGE("agent rows: ", p.compared, " sampled tokens, worst |rollout - policy| logp ", p.worst);
}

TEST_CASE("rl/agent per-turn rewards: each on its turn's last sampled token in its row; a wrong count fails the run") {
  AgentRollout ar(model(), tokenizer(), rollout_options(1),
                  agent("agent_two_turns.sh", 60, "AGENT_REWARD=0.5 AGENT_TURN_REWARDS='[0.25, -1]' "));
  const RolloutBatch b = ar.run(tasks(2));
  REQUIRE(b.trajectories.size() == 2);
  REQUIRE(b.samples.size() == 2);
  for (const RolloutBatch::Trajectory& t : b.trajectories) {
    CAPTURE(t.task);
    CHECK(t.turn_rewards == std::vector<double>{0.25, -1});
    REQUIRE(t.reward.has_value());
    CHECK(*t.reward == 0.5);
    REQUIRE(t.rows.size() == 1);
    const RolloutSample& s = b.samples[size_t(t.rows[0])];
    // [sampled answer 1][context][sampled answer 2]: the first turn ends at
    // the last token before the context, the second at the row's last.
    size_t a = 0;
    while (a < s.tokens.size() && s.trainable[a]) ++a;
    REQUIRE(a >= 1);
    REQUIRE(s.turn_rewards.size() == 2);
    CHECK(s.turn_rewards[0] == std::pair<int64_t, double>{int64_t(a) - 1, 0.25});
    CHECK(s.turn_rewards[1] == std::pair<int64_t, double>{int64_t(s.tokens.size()) - 1, -1.0});
  }
  // One reward per recorded turn: the count is checked against the server's record.
  AgentRollout wrong(model(), tokenizer(), rollout_options(1),
                     agent("agent_two_turns.sh", 60, "AGENT_TURN_REWARDS='[1]' "));
  CHECK_THROWS_WITH_AS(wrong.run(tasks(1)),
                       doctest::Contains("the agent of task 0 (sample 0, dataset line 1) printed 1 turn_rewards, but "
                                         "the server recorded 2 turns under trajectory_id \"areno-r0-t0-s0\""),
                       AgentError);
  CHECK(wrong.last_stats().kv_blocks_used == 0);
}

TEST_CASE("rl/agent failures name the task: crash, timeout, malformed output, unknown id; the rollout stays usable") {
  SUBCASE("run_agents alone") {
    // A crash: the exit status and the tail of its stderr.
    CHECK_THROWS_WITH_AS(run_agents(tasks(1), "http://127.0.0.1:9/v1", agent("agent_crash.sh")),
                         "--agent-cmd: the agent of task 0 (sample 0, dataset line 1) exited with status 3; its stderr "
                         "ended with \"agent: cannot reach the tool server\\x0a\"",
                         AgentError);
    // A timeout: killed after the limit, without waiting for its `sleep 60`.
    const double t0 = now_s();
    CHECK_THROWS_WITH_AS(run_agents(tasks(2), "http://127.0.0.1:9/v1", agent("agent_sleep.sh", 0.5)),
                         doctest::Contains("did not finish within 0.5 s (--agent-timeout-s); it was killed"),
                         AgentError);
    CHECK(now_s() - t0 < 5.0);
    // Malformed: the last line quoted and the expected format.
    CHECK_THROWS_WITH_AS(run_agents(tasks(1), "http://127.0.0.1:9/v1", agent("agent_malformed.sh")),
                         "--agent-cmd: the agent of task 0 (sample 0, dataset line 1) printed \"done: reward 1\" as its "
                         "last line: not JSON; expected {\"trajectory_id\": \"ID\", \"reward\": <number, optional>, "
                         "\"turn_rewards\": [<number per turn>, optional]}",
                         AgentError);
    // A command the shell does not find.
    CHECK_THROWS_WITH_AS(run_agents(tasks(1), "http://127.0.0.1:9/v1", AgentOptions{.cmd = "no-such-agent-xyz"}),
                         doctest::Contains("exited with status 127 (127: the shell did not find the command)"),
                         AgentError);
  }
  SUBCASE("parse_agent_output") {
    const AgentOutput o = parse_agent_output("log\n{\"trajectory_id\": \"t-1\", \"reward\": -2.5}\n\n", "agent");
    CHECK(o.trajectory_id == "t-1");
    REQUIRE(o.reward.has_value());
    CHECK(*o.reward == -2.5);
    CHECK_FALSE(parse_agent_output("{\"trajectory_id\": \"t\"}", "agent").reward.has_value());
    CHECK_THROWS_WITH_AS(parse_agent_output("", "agent"), doctest::Contains("agent printed nothing on stdout"), AgentError);
    CHECK_THROWS_WITH_AS(parse_agent_output("[1]", "agent"), doctest::Contains("a JSON array, not an object"), AgentError);
    CHECK_THROWS_WITH_AS(parse_agent_output("{\"reward\": 1}", "agent"),
                         doctest::Contains("\"trajectory_id\" must be a non-empty string"), AgentError);
    CHECK_THROWS_WITH_AS(parse_agent_output("{\"trajectory_id\": \"t\", \"reward\": \"1\"}", "agent"),
                         doctest::Contains("\"reward\" must be a finite number"), AgentError);
    // Per-turn rewards: an array of finite numbers (AgentRollout checks their count).
    const AgentOutput tr = parse_agent_output("{\"trajectory_id\": \"t\", \"turn_rewards\": [0.5, -1, 2e-3]}", "agent");
    REQUIRE(tr.turn_rewards.has_value());
    CHECK(*tr.turn_rewards == std::vector<double>{0.5, -1, 2e-3});
    CHECK_FALSE(tr.reward.has_value());
    CHECK_FALSE(parse_agent_output("{\"trajectory_id\": \"t\", \"turn_rewards\": null}", "agent").turn_rewards);
    for (const char* bad : {"{\"trajectory_id\": \"t\", \"turn_rewards\": 1}",
                            "{\"trajectory_id\": \"t\", \"turn_rewards\": []}",
                            "{\"trajectory_id\": \"t\", \"turn_rewards\": {\"0\": 1}}"}) {
      CAPTURE(bad);
      CHECK_THROWS_WITH_AS(parse_agent_output(bad, "agent"),
                           doctest::Contains("\"turn_rewards\" must be an array of finite numbers, one per turn"),
                           AgentError);
    }
    CHECK_THROWS_WITH_AS(parse_agent_output("{\"trajectory_id\": \"t\", \"turn_rewards\": [1, \"2\"]}", "agent"),
                         doctest::Contains("\"turn_rewards\"[1] must be a finite number"), AgentError);
    CHECK_THROWS_WITH_AS(parse_agent_output("{\"trajectory_id\": \"t\", \"turn_rewards\": [1, null]}", "agent"),
                         doctest::Contains("\"turn_rewards\"[1] must be a finite number"), AgentError);
  }
  SUBCASE("through AgentRollout") {
    AgentRollout ar(model(), tokenizer(), rollout_options(1), agent("agent_unrecorded.sh"));
    CHECK_THROWS_WITH_AS(ar.run(tasks(1)),
                         "--agent-cmd: the agent of task 0 (sample 0, dataset line 1) printed trajectory_id "
                         "\"never-sent\", but the server recorded no request under that id (send the header "
                         "X-Areno-Trajectory: never-sent with each request)",
                         AgentError);
    AgentRollout crash(model(), tokenizer(), rollout_options(2), agent("agent_crash.sh"));
    CHECK_THROWS_WITH_AS(crash.run(tasks(1)), doctest::Contains("exited with status 3"), AgentError);
    // A failed phase leaves nothing behind: the same rollout serves the next.
    AgentRollout ok(model(), tokenizer(), rollout_options(1), agent("agent_two_turns.sh"));
    std::vector<AgentTask> bad = tasks(2);
    bad[1].row["crash"] = true;
    CHECK_THROWS_WITH_AS(ok.run(bad), doctest::Contains("the agent of task 1 (sample 0, dataset line 2) exited with "
                                                        "status 5; its stderr ended with \"asked to crash"),
                         AgentError);
    const int port = ok.port();
    const RolloutBatch b = ok.run(tasks(2));
    CHECK(b.samples.size() == 2);
    CHECK(ok.port() == port);
    CHECK(ok.last_stats().kv_blocks_used == 0);
  }
}

TEST_CASE("areno train --algo ppo --agent-cmd: values and GAE over the agent rows' trainable tokens") {
  testing::TempDir dir;
  {
    std::ofstream out(dir.path / "tasks.jsonl");
    for (int a = 1; a <= 2; ++a)
      out << json{{"prompt", fmt::format("What is {} + 1?", a)}, {"answer", std::to_string(a + 1)}}.dump() << "\n";
  }
  std::map<bool, json> last;
  for (bool context : {false, true}) {
    CAPTURE(context);
    const std::string mdir = dir.str(context ? "ppo-context" : "ppo-masked");
    std::vector<std::string> args = {"--algo", "ppo", "--dataset-path", dir.str("tasks.jsonl"), "--agent-cmd",
                                     "AGENT_REWARD=sample sh tests/rl/scripts/agent_two_turns.sh", "--batch-size", "2",
                                     "--n-samples", "2", "--max-steps", "2", "--lr", "1e-4", "--critic-lr", "1e-2",
                                     "--grad-clip-norm", "0", "--metrics-log-dir", mdir, "--save-path",
                                     dir.str(context ? "save-context" : "save-masked"), "--save-interval", "2"};
    if (context) args.push_back("--train-tool-results");
    CHECK(app::cmd_train(args) == 0);
    const std::vector<json> lines = testing::metrics_lines(mdir);
    REQUIRE(lines.size() == 2);
    for (const json& j : lines) {
      CHECK(j["trajectories"].get<double>() == 4.0);
      CHECK(j["reward_mean"].get<double>() == 0.5);  // rewards 0 and 1 in every group
      CHECK(j["logp_abs_diff_mean"].get<double>() < 1e-5);
      CHECK(j["critic_grad_norm"].get<double>() > 0.0);
      CHECK(std::isfinite(j["vf_loss"].get<double>()));
    }
    // Greedy twins (same tokens) with rewards 0 and 1: at step 1 the zero
    // value head makes their whitened advantages opposite, which cancel; at
    // step 2 the trained values shift both, and the policy gets a gradient.
    CHECK(lines[0]["grad_norm"].get<double>() < 1e-4);  // (up to rounding)
    CHECK(lines[1]["grad_norm"].get<double>() > 1e-2);
    CHECK(lines[1]["value_mean"].get<double>() != 0.0);
    last[context] = lines[0];
    // The step folder records the agent options a resume must repeat.
    const json st = json::parse(std::ifstream(dir.path / (context ? "save-context" : "save-masked") / "step-2" /
                                              "trainer_state.json"));
    CHECK(st["run"]["--agent-cmd"] == "AGENT_REWARD=sample sh tests/rl/scripts/agent_two_turns.sh");
    CHECK(st["run"]["--train-tool-results"] == context);
  }
  // The context <|tool|> 42 <|end|> <|assistant|> of each of the 4 rows trains only with --train-tool-results.
  CHECK(last[true]["response_tokens"].get<double>() == last[false]["response_tokens"].get<double>() + 4 * 4);
  // Turn rewards without an outcome (no --reward): with gamma = lam = 1 a
  // token's return is the rewards from its turn on, so [0, 1] gives every
  // trainable token 1 and [1, 0] only the first answer's tokens.
  std::map<std::string, json> turns;
  for (const char* tr : {"[0, 1]", "[1, 0]"}) {
    const std::string mdir = dir.str(std::string("ppo-turns-") + tr[1]);
    CHECK(app::cmd_train({"--algo", "ppo", "--dataset-path", dir.str("tasks.jsonl"), "--agent-cmd",
                          fmt::format("AGENT_TURN_REWARDS='{}' sh tests/rl/scripts/agent_two_turns.sh", tr),
                          "--batch-size", "2", "--n-samples", "1", "--max-steps", "1", "--metrics-log-dir",
                          mdir}) == 0);
    const std::vector<json> lines = testing::metrics_lines(mdir);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0]["reward_mean"].get<double>() == 1.0);
    turns[tr] = lines[0];
  }
  CHECK(turns["[0, 1]"]["returns_mean"].get<double>() == doctest::Approx(1.0).epsilon(1e-6));
  const double first_share = turns["[1, 0]"]["returns_mean"].get<double>();
  CHECK(first_share > 0.0);
  CHECK(first_share < 1.0);
  // The greedy answers are the same in both runs: the share is answer 1's tokens over both answers'.
  CHECK(turns["[1, 0]"]["response_tokens"].get<double>() == turns["[0, 1]"]["response_tokens"].get<double>());
}

TEST_CASE("rl/agent --skip-failed-agents: failed runs are reported and left out, the others train") {
  SUBCASE("run_agents alone: an exit status, a timeout and a malformed line fail their runs only") {
    AgentOptions o = agent("agent_fail_some.sh", 0.5);
    o.skip_failed = true;
    std::vector<AgentTask> ts = tasks(5);
    for (size_t i = 0; i < ts.size(); ++i) ts[i].trajectory = fmt::format("id-{}", i);
    const double t0 = now_s();
    const std::vector<AgentOutput> out = run_agents(ts, "http://127.0.0.1:9/v1", o);
    CHECK(now_s() - t0 < 5.0);  // the sleeping one was killed at its deadline
    REQUIRE(out.size() == 5);
    CHECK(out[0].error.empty());
    CHECK(out[0].trajectory_id == "id-0");
    CHECK(out[1].error == "--agent-cmd: the agent of task 1 (sample 0, dataset line 2) exited with status 4; its "
                          "stderr ended with \"task 1 fails\\x0a\"");
    CHECK(out[2].error.find("the agent of task 2 (sample 0, dataset line 3) did not finish within 0.5 s") !=
          std::string::npos);
    CHECK(out[3].error.find("the agent of task 3 (sample 0, dataset line 4) printed \"done\" as its last line: "
                            "not JSON") != std::string::npos);
    CHECK(out[4].error.empty());
    CHECK(out[4].trajectory_id == "id-4");
    // Without the flag the first failure stops the call.
    CHECK_THROWS_AS(run_agents(ts, "http://127.0.0.1:9/v1", agent("agent_fail_some.sh", 0.5)), AgentError);
  }
  SUBCASE("through AgentRollout: groups lose their failed runs; all failed still stops") {
    AgentOptions o = agent("agent_two_turns.sh", 60, "AGENT_FAIL_SAMPLE=1 ");
    o.skip_failed = true;
    AgentRollout ar(model(), tokenizer(), rollout_options(3), o);
    const RolloutBatch b = ar.run(tasks(2));
    REQUIRE(b.trajectories.size() == 4);  // samples 0 and 2 of both tasks
    for (size_t k = 0; k < 4; ++k) {
      CHECK(b.trajectories[k].task == int64_t(k / 2));
      CHECK(b.trajectories[k].index == (k % 2 == 0 ? 0 : 2));
    }
    REQUIRE(ar.last_failures().size() == 2);
    CHECK(ar.last_failures()[0].find("the agent of task 0 (sample 1, dataset line 1) exited with status 5") !=
          std::string::npos);
    CHECK(ar.failed_runs() == 2);
    CHECK(ar.last_stats().kv_blocks_used == 0);  // the failed runs' first turns released theirs too
    AgentOptions crash = agent("agent_crash.sh");
    crash.skip_failed = true;
    AgentRollout all(model(), tokenizer(), rollout_options(2), crash);
    CHECK_THROWS_WITH_AS(all.run(tasks(1)),
                         doctest::Contains("--skip-failed-agents: all 2 agent runs of the step failed; the first: "
                                           "--agent-cmd: the agent of task 0 (sample 0, dataset line 1) exited with "
                                           "status 3"),
                         AgentError);
  }
  SUBCASE("areno train: the step trains on the runs that finished") {
    testing::TempDir dir;
    {
      std::ofstream out(dir.path / "tasks.jsonl");
      for (int a = 1; a <= 2; ++a)
        out << json{{"prompt", fmt::format("What is {} + 1?", a)}, {"answer", std::to_string(a + 1)}}.dump() << "\n";
    }
    // (Greedy: the runs are deterministic. The ragged groups' normalisation is
    // checked in rl/objectives; here the step's bookkeeping.)
    const std::string cmd = "AGENT_REWARD=sample AGENT_FAIL_SAMPLE=1 sh tests/rl/scripts/agent_two_turns.sh";
    const std::string mdir = dir.str("metrics");
    CHECK(app::cmd_train({"--algo", "grpo", "--dataset-path", dir.str("tasks.jsonl"), "--agent-cmd", cmd,
                          "--skip-failed-agents", "--batch-size", "2", "--n-samples", "3", "--max-steps", "1",
                          "--lr", "1e-4", "--grad-clip-norm", "0", "--metrics-log-dir", mdir}) == 0);
    const std::vector<json> lines = testing::metrics_lines(mdir);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0]["trajectories"].get<double>() == 4.0);
    CHECK(lines[0]["agent_failed"].get<double>() == 2.0);
    CHECK(lines[0]["reward_mean"].get<double>() == 1.0);  // rewards 0 and 2 in each group of two
    CHECK(lines[0]["samples"].get<double>() == 4.0 + lines[0]["split_rows"].get<double>());
    CHECK(std::isfinite(lines[0]["loss"].get<double>()));
    CHECK(lines[0]["logp_abs_diff_mean"].get<double>() < 1e-5);
    CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "grpo", "--dataset-path", dir.str("tasks.jsonl"), "--agent-cmd",
                                         cmd, "--batch-size", "2", "--n-samples", "3", "--max-steps", "1"}),
                         doctest::Contains("(sample 1, dataset line"), AgentError);
    CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "grpo", "--dataset-path", dir.str("tasks.jsonl"), "--reward",
                                         "exact", "--skip-failed-agents"}),
                         "--skip-failed-agents: only with --agent-cmd", std::invalid_argument);
  }
}

namespace {

serve::TrajectoryTurn turn(std::vector<int64_t> prompt, std::vector<int64_t> completion, std::string text = "") {
  serve::TrajectoryTurn t;
  t.prompt = std::move(prompt);
  t.completion = std::move(completion);
  for (size_t i = 0; i < t.completion.size(); ++i) t.logprobs.push_back(-0.25f * float(i + 1));
  t.text = std::move(text);
  return t;
}

}  // namespace

TEST_CASE("rl/agent row rule: continuing turns append, a re-templated turn starts a new row, --train-tool-results") {
  // Turn 2 re-sends turn 1 token for token (then context 7 8); turn 3 does not
  // (its history differs at the answer: a re-tokenized reply) and turn 4 adds
  // an image placeholder without its item after continuing turn 3 (no turn
  // the server records, but the rule does not trust the pairing).
  const std::vector<serve::TrajectoryTurn> turns = {
      turn({1, 2}, {3, 4}),
      turn({1, 2, 3, 4, 7, 8}, {5}),
      turn({1, 2, 34, 7, 8, 9}, {6, 6}),
      turn({1, 2, 34, 7, 8, 9, 6, 6, phi4mm::kImageTokenId, 9}, {4}, "final")};
  const AssembledTrajectory a = assemble_trajectory(turns, /*train_context=*/false);
  REQUIRE(a.rows.size() == 3);
  CHECK(a.final_text == "final");
  CHECK(a.final_tokens == 1);
  CHECK(a.rows[0].prompt.ids == std::vector<int64_t>{1, 2});
  CHECK(a.rows[0].tokens == std::vector<int64_t>{3, 4, 7, 8, 5});
  CHECK(a.rows[0].trainable == std::vector<uint8_t>{1, 1, 0, 0, 1});
  CHECK(a.rows[0].turns == 2);
  CHECK(a.rows[0].logp[0] == -0.25f);
  CHECK(a.rows[0].logp[1] == -0.5f);
  CHECK(std::isnan(a.rows[0].logp[2]));
  CHECK(std::isnan(a.rows[0].logp[3]));
  CHECK(a.rows[0].logp[4] == -0.25f);
  CHECK(a.rows[1].prompt.ids == std::vector<int64_t>{1, 2, 34, 7, 8, 9});
  CHECK(a.rows[1].tokens == std::vector<int64_t>{6, 6});
  CHECK(a.rows[2].prompt.ids.size() == 10);
  CHECK(a.rows[2].tokens == std::vector<int64_t>{4});
  // Where each turn's reward goes: its completion's last token in its row.
  CHECK(a.rows[0].turn_ends == std::vector<int64_t>{1, 4});
  CHECK(a.rows[1].turn_ends == std::vector<int64_t>{1});
  CHECK(a.rows[2].turn_ends == std::vector<int64_t>{0});
  // An empty completion ends at the row's last token so far (-1: none yet).
  const AssembledTrajectory e =
      assemble_trajectory({turn({1, 2}, {}), turn({1, 2, 7}, {5}), turn({1, 2, 7, 5, 8}, {})}, false);
  REQUIRE(e.rows.size() == 1);
  CHECK(e.rows[0].tokens == std::vector<int64_t>{7, 5, 8});
  CHECK(e.rows[0].turn_ends == std::vector<int64_t>{-1, 1, 2});
  // --train-tool-results: the context is trainable too (still without a rollout log-probability).
  const AssembledTrajectory b = assemble_trajectory(turns, /*train_context=*/true);
  CHECK(b.rows[0].trainable == std::vector<uint8_t>{1, 1, 1, 1, 1});
  CHECK(std::isnan(b.rows[0].logp[2]));
  CHECK_THROWS_AS(assemble_trajectory({}, false), std::invalid_argument);
}

TEST_CASE("rl/agent row rule with media: a later turn's image or clip joins the row; a replaced item or a new adapter splits") {
  using phi4mm::Adapter;
  using phi4mm::Media;
  const int64_t I = phi4mm::kImageTokenId, A = phi4mm::kAudioTokenId;
  auto image = [](uint8_t v) { return Media::of_image({2, 1, std::vector<uint8_t>(6, v)}); };
  auto clip = [](double v) { return Media::of_audio(std::vector<double>(8, v), 16000); };
  auto with = [](serve::TrajectoryTurn t, std::vector<Media> media, Adapter a) {
    t.media = std::move(media);
    t.adapter = a;
    return t;
  };
  SUBCASE("a second image, then the first one replaced by another of the same size") {
    const std::vector<serve::TrajectoryTurn> turns = {
        with(turn({1, I, I, 2}, {3}), {image(10)}, Adapter::vision),
        with(turn({1, I, I, 2, 3, 7, I, I, 8}, {5, 6}), {image(10), image(20)}, Adapter::vision),
        // The same tokens, but the history's first image is another one.
        with(turn({1, I, I, 2, 3, 7, I, I, 8, 5, 6, 9}, {4}, "last"), {image(11), image(20)}, Adapter::vision)};
    const AssembledTrajectory a = assemble_trajectory(turns, false);
    REQUIRE(a.rows.size() == 2);
    const AgentRow& r = a.rows[0];
    CHECK(r.prompt.ids == std::vector<int64_t>{1, I, I, 2});
    CHECK(r.prompt.adapter == Adapter::vision);
    REQUIRE(r.prompt.media.size() == 2);
    CHECK(r.prompt.media[0].image.rgb[0] == 10);
    CHECK(r.prompt.media[1].image.rgb[0] == 20);
    CHECK(r.tokens == std::vector<int64_t>{3, 7, I, I, 8, 5, 6});
    CHECK(r.trainable == std::vector<uint8_t>{1, 0, 0, 0, 0, 1, 1});
    CHECK(r.turns == 2);
    CHECK(std::isnan(r.logp[2]));
    CHECK(r.logp[5] == -0.25f);
    CHECK(r.logp[6] == -0.5f);
    CHECK(a.rows[1].prompt.ids.size() == 12);
    REQUIRE(a.rows[1].prompt.media.size() == 2);
    CHECK(a.rows[1].prompt.media[0].image.rgb[0] == 11);
    CHECK(a.rows[1].tokens == std::vector<int64_t>{4});
    // --train-tool-results trains the context but not the placeholders.
    CHECK(assemble_trajectory(turns, true).rows[0].trainable == std::vector<uint8_t>{1, 1, 0, 0, 1, 1, 1});
  }
  SUBCASE("clips: a second clip joins; a clip of other samples or rate splits") {
    const std::vector<serve::TrajectoryTurn> turns = {
        with(turn({1, A, 2}, {3}), {clip(0.5)}, Adapter::speech),
        with(turn({1, A, 2, 3, A, A, 8}, {5}), {clip(0.5), clip(-0.5)}, Adapter::speech),
        with(turn({1, A, 2, 3, A, A, 8, 5, 9}, {6}), {clip(0.25), clip(-0.5)}, Adapter::speech)};
    const AssembledTrajectory a = assemble_trajectory(turns, false);
    REQUIRE(a.rows.size() == 2);
    CHECK(a.rows[0].prompt.media.size() == 2);
    CHECK(a.rows[0].tokens == std::vector<int64_t>{3, A, A, 8, 5});
    CHECK(a.rows[0].trainable == std::vector<uint8_t>{1, 0, 0, 0, 1});
    CHECK(a.rows[1].prompt.media.size() == 2);
    CHECK(a.rows[1].prompt.media[0].samples[0] == 0.25);
    Media other_rate = clip(0.5);
    other_rate.sample_rate = 8000;
    CHECK(assemble_trajectory({turns[0], with(turns[1], {other_rate, clip(-0.5)}, Adapter::speech)}, false)
              .rows.size() == 2);
  }
  SUBCASE("an image added to a text row changes the adapter: a new row") {
    const std::vector<serve::TrajectoryTurn> turns = {
        turn({1, 2}, {3}), with(turn({1, 2, 3, 7, I, 8}, {5}), {image(1)}, Adapter::vision)};
    const AssembledTrajectory a = assemble_trajectory(turns, false);
    REQUIRE(a.rows.size() == 2);
    CHECK(a.rows[0].prompt.media.empty());
    CHECK(a.rows[1].prompt.media.size() == 1);
    CHECK(a.rows[1].prompt.adapter == Adapter::vision);
  }
  SUBCASE("an item without a placeholder in the new part: a new row") {
    const std::vector<serve::TrajectoryTurn> turns = {
        with(turn({1, I, 2}, {3}), {image(1)}, Adapter::vision),
        with(turn({1, I, 2, 3, 8}, {5}), {image(1), image(2)}, Adapter::vision)};
    CHECK(assemble_trajectory(turns, false).rows.size() == 2);
  }
}

TEST_CASE("rl/agent an image sent in a later turn: one row with both images, log-prob parity; a replaced first image splits") {
  const std::string env = fmt::format("AGENT_IMAGE_1='{}' AGENT_IMAGE_2='{}' ", square_png_url(220, 30, 30),
                                      square_png_url(30, 30, 220));
  const std::string again = fmt::format("AGENT_IMAGE_1_AGAIN='{}' ", square_png_url(30, 200, 30));
  for (bool replaced : {false, true}) {
    CAPTURE(replaced);
    RolloutOptions o = rollout_options(2);
    o.engine.kv_blocks = 160;  // two runs' second turns, about 1,100 tokens each
    AgentRollout ar(model(), tokenizer(), o, agent("agent_images.sh", 60, (replaced ? again : std::string()) + env));
    const RolloutBatch b = ar.run(tasks(1));
    REQUIRE(b.trajectories.size() == 2);
    CHECK(ar.last_stats().requests_finished == 4);
    CHECK(ar.last_stats().kv_blocks_used == 0);
    // Kept: one row holding both images. Replaced: the second turn's history
    // differs from what the first turn was sampled on, so it starts a row.
    REQUIRE(b.samples.size() == (replaced ? 4u : 2u));
    CHECK(ar.split_rows() == (replaced ? 2 : 0));
    for (size_t n = 0; n < b.samples.size(); ++n) {
      CAPTURE(n);
      const RolloutSample& s = b.samples[n];
      const Prompt& p = b.prompts[size_t(s.prompt)];
      CHECK(p.adapter == phi4mm::Adapter::vision);
      const bool second_turn_row = replaced && n % 2 == 1;
      const bool both = !replaced || second_turn_row;
      REQUIRE(p.media.size() == (both ? 2u : 1u));
      const int64_t in_prompt = std::count_if(p.ids.begin(), p.ids.end(), phi4mm::is_media_token);
      const int64_t in_tokens = std::count_if(s.tokens.begin(), s.tokens.end(), phi4mm::is_media_token);
      CHECK(in_prompt > 0);
      // The second image's placeholders are context of the first turn's row.
      CHECK((in_tokens > 0) == !replaced);
      for (size_t t = 0; t < s.tokens.size(); ++t)
        if (phi4mm::is_media_token(s.tokens[t])) CHECK(s.trainable[t] == 0);
      if (replaced && !second_turn_row) CHECK(p.media[0].image.rgb != b.prompts[size_t(b.samples[n + 1].prompt)].media[0].image.rgb);
    }
    const Parity p = parity(b);
    CHECK(p.compared >= 4);
    CHECK(p.worst < 1e-5);
    MESSAGE("image agent rows (replaced ", replaced, "): ", p.compared, " sampled tokens, worst |rollout - policy| logp ",
            p.worst);
  }
}

TEST_CASE("rl/agent tool calls: a sampled <|tool_call|> reply is recorded as tool_calls, and the agent's next turn (the assistant's tool_calls, the tool's result) continues its row") {
  // What a tool-using agent does: turn 1 sends `tools`; the model answers in
  // Phi's native form; the server parses it into tool_calls (as record_turn
  // does for the recorder); the agent sends those tool_calls back in an
  // assistant message with the tool's result, and the prompt builder's
  // re-templated history must give the sampled tokens back token for token,
  // or the trajectory would split into two rows.
  const json tools = add_tool();
  const json m1 = json::array({{{"role", "user"}, {"content", "What is 2 + 3? Use the tool."}}});
  phi4mm::ProcessorOptions po;
  po.add_generation_prompt = true;
  const std::vector<int64_t> p1 = phi4mm::process_chat(*tokenizer(), m1, tools, po).ids();
  CHECK(decode(p1).find("<|tool|>") != std::string::npos);  // the tools went into the system turn
  const std::string reply = R"(<|tool_call|>[{"name": "add", "arguments": {"a": 2, "b": 3}}]<|/tool_call|>)";
  std::vector<int64_t> c1;
  for (tok::TokenId t : tokenizer()->encode(reply)) c1.push_back(t);
  c1.push_back(phi4mm::kEnd);  // the stop token the model sampled
  const serve::ToolCallParse tc = serve::parse_tool_calls(reply, tools);
  REQUIRE(tc.found);
  REQUIRE(tc.tool_calls.size() == 1);
  CHECK(tc.tool_calls[0]["type"] == "function");
  CHECK(tc.tool_calls[0]["function"]["name"] == "add");
  CHECK(json::parse(tc.tool_calls[0]["function"]["arguments"].get<std::string>()) == json{{"a", 2}, {"b", 3}});
  CHECK(tc.content.is_null());
  json m2 = m1;
  m2.push_back({{"role", "assistant"}, {"content", nullptr}, {"tool_calls", tc.tool_calls}});
  m2.push_back({{"role", "tool"}, {"tool_call_id", tc.tool_calls[0]["id"]}, {"content", "5"}});
  const std::vector<int64_t> p2 = phi4mm::process_chat(*tokenizer(), m2, tools, po).ids();
  REQUIRE(p2.size() > p1.size() + c1.size());
  CHECK(std::vector<int64_t>(p2.begin(), p2.begin() + int64_t(p1.size() + c1.size())) ==
        [&] {
          std::vector<int64_t> v = p1;
          v.insert(v.end(), c1.begin(), c1.end());
          return v;
        }());
  const std::vector<int64_t> tail(p2.begin() + int64_t(p1.size() + c1.size()), p2.end());
  CHECK(decode(tail) == "<|tool|>5<|end|><|assistant|>");
  serve::TrajectoryTurn t1 = turn(p1, c1), t2 = turn(p2, {tokenizer()->encode("5")[0], phi4mm::kEnd}, "5");
  t1.tool_calls = tc.tool_calls;
  const AssembledTrajectory a = assemble_trajectory({t1, t2}, /*train_context=*/false);
  REQUIRE(a.rows.size() == 1);
  const AgentRow& row = a.rows[0];
  CHECK(row.prompt.ids == p1);
  REQUIRE(row.tokens.size() == c1.size() + tail.size() + 2);
  for (size_t i = 0; i < row.tokens.size(); ++i) {
    CAPTURE(i);
    const bool sampled = i < c1.size() || i >= c1.size() + tail.size();
    CHECK(row.trainable[i] == uint8_t(sampled));  // the call trainable, the tool's result masked
    CHECK(std::isnan(row.logp[i]) == !sampled);
  }
  CHECK(decode(std::vector<int64_t>(row.tokens.begin(), row.tokens.begin() + int64_t(c1.size()))) == reply + "<|end|>");
}

// The whole loop of a tool-using agent, end to end: the demo model is taught
// by `areno train --algo sft` (rows with `tools`, the assistant's tool_calls
// and the tool's result) to call add(a, b) and then to answer with the
// result; an agent (tests/rl/scripts/agent_tool_add.sh, sh + curl) then runs
// against the rollout's server: it gets the call as tool_calls (the server
// parsed the sampled <|tool_call|> reply), runs the tool, sends the call and
// the result back, and scores the final answer. The recorded trajectory is one
// row: the sampled call trainable, the tool's result masked, the answer
// trainable; its log-probabilities are the training forward's.
TEST_CASE("rl/agent tool calls end to end: a model taught to call add(a, b) by SFT, an sh agent that runs the tool, one row per trajectory") {
  testing::TempDir dir;
  const json tools = add_tool();
  const int pairs[4][2] = {{2, 3}, {4, 1}, {5, 2}, {3, 6}};
  auto question = [](const int* ab) { return fmt::format("What is {} + {}? Use the tool.", ab[0], ab[1]); };
  {
    std::ofstream sft(dir.path / "sft.jsonl"), rl(dir.path / "tasks.jsonl");
    for (const auto& ab : pairs) {
      const std::string sum = std::to_string(ab[0] + ab[1]);
      const json call = {{"id", "call_1"},
                         {"type", "function"},
                         {"function", {{"name", "add"}, {"arguments", json{{"a", ab[0]}, {"b", ab[1]}}.dump()}}}};
      sft << json{{"tools", tools},
                  {"messages",
                   {{{"role", "user"}, {"content", question(ab)}},
                    {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {call}}},
                    {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", sum}},
                    {{"role", "assistant"}, {"content", sum}}}}}
                 .dump()
          << "\n";
      rl << json{{"prompt", question(ab)}, {"answer", sum}}.dump() << "\n";
    }
  }
  REQUIRE(app::cmd_train({"--dataset-path", dir.str("sft.jsonl"), "--batch-size", "4", "--mini-bs", "4",
                          "--max-steps", "120", "--lr", "1e-2", "--min-lr", "1e-3", "--save-path", dir.str("save"),
                          "--metrics-log-dir", dir.str("m")}) == 0);
  {
    const std::vector<json> l = testing::metrics_lines(dir.path / "m");
    REQUIRE(l.size() == 120);
    MESSAGE("SFT loss ", l.front()["train/loss"].get<double>(), " -> ", l.back()["train/loss"].get<double>());
    CHECK(l.back()["train/loss"].get<double>() < 0.01 * l.front()["train/loss"].get<double>());
  }
  const app::ServedModel served = app::load_served_model(dir.str("save/step-120"), "cpu", "f32");

  const std::string log = dir.str("agent.log");
  AgentRollout ar(served.model, served.tokenizer, rollout_options(2),
                  agent("agent_tool_add.sh", 120, "AGENT_LOG=" + log + " "));
  std::vector<AgentTask> ts;
  for (int i = 0; i < 4; ++i)
    ts.push_back({json{{"prompt", question(pairs[i])}, {"answer", pairs[i][0] + pairs[i][1]}}, i, 0, i + 1, {}});
  const RolloutBatch b = ar.run(ts);
  {
    std::ifstream in(log);
    std::string line, all;
    while (std::getline(in, line)) all += line + "\n";
    MESSAGE("agent log (a b sum answer):\n", all);
  }
  REQUIRE(b.trajectories.size() == 8);
  REQUIRE(b.samples.size() == 8);  // one row each: the second turn continued the first
  CHECK(ar.last_stats().kv_blocks_used == 0);
  CHECK(ar.last_stats().requests_finished == 16);  // every run made the call, so two turns each
  std::vector<Sequence> seqs;
  for (size_t k = 0; k < b.trajectories.size(); ++k) {
    const RolloutBatch::Trajectory& t = b.trajectories[k];
    const int* ab = pairs[k / 2];
    CAPTURE(k);
    REQUIRE(t.reward.has_value());
    CHECK(*t.reward == 1.0);  // the call carried a and b, and the answer was their sum
    REQUIRE(t.rows.size() == 1);
    const RolloutSample& s = b.samples[size_t(t.rows[0])];
    size_t a = 0;
    while (a < s.tokens.size() && s.trainable[a]) ++a;
    size_t c = a;
    while (c < s.tokens.size() && !s.trainable[c]) ++c;
    const std::string call = decode(std::vector<int64_t>(s.tokens.begin(), s.tokens.begin() + int64_t(a)));
    CHECK(call == fmt::format(R"(<|tool_call|>[{{"name": "add", "arguments": {{"a": {}, "b": {}}}}}]<|/tool_call|><|end|>)",
                              ab[0], ab[1]));
    CHECK(decode(std::vector<int64_t>(s.tokens.begin() + int64_t(a), s.tokens.begin() + int64_t(c))) ==
          fmt::format("<|tool|>{}<|end|><|assistant|>", ab[0] + ab[1]));
    CHECK(decode(std::vector<int64_t>(s.tokens.begin() + int64_t(c), s.tokens.end())) ==
          fmt::format("{}<|end|>", ab[0] + ab[1]));
    for (size_t i = 0; i < s.tokens.size(); ++i) CHECK(std::isnan(s.logp[i]) == !s.trainable[i]);
    seqs.push_back({s.prompt, s.tokens, s.trainable});
  }
  NoGradGuard ng;
  const TokenLogp tl = policy_logp(*served.model, b.prompts, seqs);
  const std::vector<float> lp = tl.logp.to_vector<float>();
  const int64_t T = tl.logp.size(1);
  double worst = 0;
  for (size_t n = 0; n < b.samples.size(); ++n)
    for (size_t t = 0; t < b.samples[n].tokens.size(); ++t)
      if (b.samples[n].trainable[t])
        worst = std::max(worst, std::abs(double(lp[n * size_t(T) + t]) - double(b.samples[n].logp[t])));
  CHECK(worst < 1e-5);
}

TEST_CASE("rl/agent recorder: streamed turns are recorded; n > 1 and bad ids are refused") {
  // The second turn streamed (AGENT_STREAM): still one row with both answers.
  AgentRollout ar(model(), tokenizer(), rollout_options(1), agent("agent_two_turns.sh", 60, "AGENT_STREAM=1 "));
  const RolloutBatch b = ar.run(tasks(1));
  REQUIRE(b.samples.size() == 1);
  int64_t runs = 0;
  for (size_t t = 0; t < b.samples[0].tokens.size(); ++t)
    runs += b.samples[0].trainable[t] && (t == 0 || !b.samples[0].trainable[t - 1]) ? 1 : 0;
  CHECK(runs == 2);
  CHECK(ar.last_stats().requests_finished == 2);
  // The server stays up between phases (its engine stopped): requests are checked before the engine.
  httplib::Client cli("127.0.0.1", ar.port());
  const std::string body = R"({"messages":[{"role":"user","content":"hi"}],"n":2})";
  auto r = cli.Post("/v1/chat/completions", {{"X-Areno-Trajectory", "abc"}}, body, "application/json");
  REQUIRE(r);
  CHECK(r->status == 400);
  CHECK(r->body.find("'n' must be 1 in a request recorded under X-Areno-Trajectory (got 2)") != std::string::npos);
  r = cli.Post("/v1/chat/completions", {{"X-Areno-Trajectory", "a b"}}, body, "application/json");
  REQUIRE(r);
  CHECK(r->status == 400);
  CHECK(r->body.find("X-Areno-Trajectory: 'a b' is not a trajectory id") != std::string::npos);
  r = cli.Post("/v1/responses", {{"X-Areno-Trajectory", "a b"}}, R"({"input":"hi"})", "application/json");
  REQUIRE(r);
  CHECK(r->status == 400);
  CHECK(r->body.find("X-Areno-Trajectory: 'a b' is not a trajectory id") != std::string::npos);
}

TEST_CASE("rl/agent over the Responses API: turns recorded as chat turns, one row each, log-prob parity") {
  for (const char* env : {"", "AGENT_STREAM=1 "}) {
    CAPTURE(env);
    AgentRollout ar(model(), tokenizer(), rollout_options(1), agent("agent_responses.sh", 60, env));
    const RolloutBatch b = ar.run(tasks(2));
    REQUIRE(b.trajectories.size() == 2);
    REQUIRE(b.samples.size() == 2);  // the second turn continued the first's row
    CHECK(ar.split_rows() == 0);
    CHECK(ar.last_stats().requests_finished == 4);
    CHECK(ar.last_stats().kv_blocks_used == 0);
    for (const RolloutSample& s : b.samples) {
      // [sampled answer 1][context: <|user|>Again?<|end|><|assistant|>][sampled answer 2]
      size_t a = 0;
      while (a < s.tokens.size() && s.trainable[a]) ++a;
      size_t c = a;
      while (c < s.tokens.size() && !s.trainable[c]) ++c;
      REQUIRE(a >= 1);
      REQUIRE(c < s.tokens.size());
      std::string context = decode(std::vector<int64_t>(s.tokens.begin() + int64_t(a), s.tokens.begin() + int64_t(c)));
      if (context.rfind("<|end|>", 0) == 0) context = context.substr(7);
      CHECK(context == "<|user|>Again?<|end|><|assistant|>");
    }
    const Parity p = parity(b);
    CHECK(p.compared >= 4);
    CHECK(p.worst < 1e-5);
  }
}

TEST_CASE("areno train --algo grpo|gspo --agent-cmd: steps on agent rows write the metrics") {
  testing::TempDir dir;
  {
    std::ofstream out(dir.path / "tasks.jsonl");
    for (int a = 1; a <= 4; ++a)
      out << json{{"prompt", fmt::format("What is {} + 1?", a)}, {"answer", std::to_string(a + 1)}}.dump() << "\n";
  }
  for (const char* algo : {"grpo", "gspo"}) {
    CAPTURE(algo);
    const std::string mdir = dir.str(std::string("metrics-") + algo);
    CHECK(app::cmd_train({"--algo", algo, "--dataset-path", dir.str("tasks.jsonl"), "--agent-cmd",
                          "AGENT_TEMPERATURE=1 AGENT_REWARD=sample sh tests/rl/scripts/agent_two_turns.sh",
                          "--agent-timeout-s", "60", "--agent-concurrency", "3", "--batch-size", "2", "--n-samples",
                          "3", "--mini-bs", "4", "--max-new-tokens", "6", "--max-steps", "2", "--lr", "1e-4",
                          "--grad-clip-norm", "0", "--metrics-log-dir", mdir}) == 0);
    const std::vector<json> lines = testing::metrics_lines(mdir);
    REQUIRE(lines.size() == 2);
    for (const json& j : lines) {
      CHECK(j["trajectories"].get<double>() == 6.0);
      CHECK(j["samples"].get<double>() == 6.0 + j["split_rows"].get<double>());
      CHECK(j["reward_mean"].get<double>() == 1.0);  // rewards 0, 1, 2 in every group
      CHECK(j["grad_norm"].get<double>() > 0.0);
      CHECK(j["response_tokens"].get<double>() >= 12.0);  // two answers of at least one token per run
      CHECK(j["logp_abs_diff_mean"].get<double>() < 1e-5);
      CHECK(std::isfinite(j["loss"].get<double>()));
    }
  }
  // --train-tool-results: the same greedy runs train on the context too
  // (more tokens; their old log-probability is the forward's own, ratio 1).
  std::map<bool, json> last;
  for (bool context : {false, true}) {
    const std::string mdir = dir.str(context ? "metrics-context" : "metrics-masked");
    std::vector<std::string> args = {"--algo", "grpo", "--dataset-path", dir.str("tasks.jsonl"), "--agent-cmd",
                                     "AGENT_REWARD=sample sh tests/rl/scripts/agent_two_turns.sh", "--batch-size", "2",
                                     "--n-samples", "2", "--max-steps", "1", "--metrics-log-dir", mdir};
    if (context) args.push_back("--train-tool-results");
    CHECK(app::cmd_train(args) == 0);
    const std::vector<json> lines = testing::metrics_lines(mdir);
    REQUIRE(lines.size() == 1);
    last[context] = lines[0];
  }
  // 4 rows, each with the context <|tool|> 42 <|end|> <|assistant|> (the first answer sampled its <|end|>).
  CHECK(last[true]["response_tokens"].get<double>() == last[false]["response_tokens"].get<double>() + 4 * 4);
  CHECK(last[true]["rollout_logprobs_mean"].get<double>() == doctest::Approx(last[false]["rollout_logprobs_mean"].get<double>()));
  CHECK(last[true]["logp_abs_diff_mean"].get<double>() < 1e-5);
  CHECK(last[true]["ratio_mean"].get<double>() == doctest::Approx(1.0).epsilon(1e-5));
  // The reward comes from --reward when the agent prints none.
  CHECK(app::cmd_train({"--algo", "grpo", "--dataset-path", dir.str("tasks.jsonl"), "--agent-cmd",
                        "sh tests/rl/scripts/agent_two_turns.sh", "--reward", "regex:[0-9]", "--batch-size", "2",
                        "--n-samples", "2", "--max-steps", "1", "--metrics-log-dir", dir.str("metrics-reward")}) == 0);
  // Turn rewards add to the outcome (here the sample index: 0 and 1).
  CHECK(app::cmd_train({"--algo", "grpo", "--dataset-path", dir.str("tasks.jsonl"), "--agent-cmd",
                        "AGENT_REWARD=sample AGENT_TURN_REWARDS='[0.25, 1]' sh tests/rl/scripts/agent_two_turns.sh",
                        "--batch-size", "2", "--n-samples", "2", "--max-steps", "1", "--metrics-log-dir",
                        dir.str("metrics-turns")}) == 0);
  {
    const std::vector<json> lines = testing::metrics_lines(dir.str("metrics-turns"));
    REQUIRE(lines.size() == 1);
    CHECK(lines[0]["reward_mean"].get<double>() == 1.75);  // (greedy twins: their advantages cancel)
    CHECK(std::isfinite(lines[0]["loss"].get<double>()));
  }
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "grpo", "--dataset-path", dir.str("tasks.jsonl"), "--agent-cmd",
                                       "sh tests/rl/scripts/agent_two_turns.sh", "--batch-size", "2", "--n-samples",
                                       "2", "--max-steps", "1"}),
                       "--agent-cmd: the agent of task 0 (sample 0) printed no reward (nor turn_rewards) and neither "
                       "--reward nor --reward-cmd is given",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "grpo", "--dataset-path", dir.str("tasks.jsonl"), "--agent-cmd",
                                       "sh tests/rl/scripts/agent_crash.sh", "--reward", "exact", "--batch-size", "2",
                                       "--max-steps", "1"}),
                       doctest::Contains("exited with status 3"), AgentError);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--algo", "sft", "--dataset-path", dir.str("tasks.jsonl"), "--agent-cmd", "x"}),
                       doctest::Contains("only with --algo grpo|gspo"), std::invalid_argument);
}
