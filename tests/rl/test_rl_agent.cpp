// Agentic rollouts (issue 15, "Agentic rollouts", must-shows 5 and 6; docs/rl.md,
// "Agentic rollouts") on the demo model: a two-turn sh + curl agent against
// the trainer's server gives one row whose sampled tokens are trainable and
// whose tool result is masked, the recorded log-probabilities equal
// policy_logp's (f32, 1e-5), the KV blocks are free after the phase; agents
// that crash, time out, print a malformed line or an unknown id fail with a
// clear message and leave the rollout usable; the row rule splits a
// re-templated turn; `areno train --agent-cmd` runs GRPO steps.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/commands_train.h"
#include "models/phi4mm/demo/demo.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "tensor/autograd.h"
#include "tests/test_util.h"
#include "train/rl/agent.h"
#include "train/rl/policy_logp.h"

using namespace areno;
using namespace areno::train::rl;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::shared_ptr<const tok::Tokenizer> tokenizer() {
  static auto t = std::make_shared<const tok::Tokenizer>(phi4mm::make_tokenizer());
  return t;
}

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

AgentOptions agent(const std::string& script, double timeout_s = 60) {
  AgentOptions a;
  a.cmd = "sh tests/rl/scripts/" + script;
  a.timeout_s = timeout_s;
  return a;
}

std::vector<AgentTask> tasks(int n) {
  std::vector<AgentTask> ts;
  for (int i = 0; i < n; ++i)
    ts.push_back({json{{"prompt", fmt::format("What is {} + 3?", i + 2)}, {"answer", i + 5}}, i, 0, i + 1, {}});
  return ts;
}

std::string decode(const std::vector<int64_t>& ids) {
  return tokenizer()->decode(std::vector<tok::TokenId>(ids.begin(), ids.end()), /*skip_special_tokens=*/false);
}

}  // namespace

TEST_CASE("rl/agent two turns with a tool result: one row, its mask, log-prob parity, free KV blocks") {
  AgentRollout ar(model(), tokenizer(), rollout_options(2), agent("agent_two_turns.sh"));
  const RolloutBatch b = ar.run(tasks(2));
  REQUIRE(b.trajectories.size() == 4);
  REQUIRE(b.samples.size() == 4);  // one row per trajectory: every turn continued the row
  CHECK(ar.split_rows() == 0);
  CHECK(ar.port() > 0);
  // The phase is over: the engine is stopped with every block free.
  CHECK(ar.last_stats().kv_blocks_used == 0);
  CHECK(ar.last_stats().kv_blocks_total == 64);
  CHECK(ar.last_stats().requests_finished == 8);  // 2 tasks x 2 samples x 2 turns

  std::vector<Sequence> seqs;
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
    seqs.push_back({s.prompt, s.tokens, s.trainable});
  }
  // The engine's log-probabilities of the sampled tokens equal the training
  // forward's over the whole row (f32, CPU).
  NoGradGuard ng;
  const TokenLogp tl = policy_logp(*model(), b.prompts, seqs);
  const std::vector<float> lp = tl.logp.to_vector<float>(), mask = tl.mask.to_vector<float>();
  const int64_t T = tl.logp.size(1);
  double worst = 0;
  int64_t compared = 0;
  for (size_t n = 0; n < b.samples.size(); ++n) {
    const RolloutSample& s = b.samples[n];
    for (size_t t = 0; t < s.tokens.size(); ++t) {
      CHECK(mask[n * size_t(T) + t] == float(s.trainable[t]));
      if (!s.trainable[t]) continue;
      worst = std::max(worst, std::abs(double(lp[n * size_t(T) + t]) - double(s.logp[t])));
      ++compared;
    }
  }
  CHECK(compared >= 8);
  CHECK(worst < 1e-5);
  MESSAGE("agent rows: ", compared, " sampled tokens, worst |rollout - policy| logp ", worst);
}
