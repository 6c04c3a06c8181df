// Inference engine (issue 7): batch invariance under chunked prefill, small
// running limits and preemption; the LongRoPE re-prefill; scoring against the
// packed training forward; seeded sampling; stops; aborts; limits.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <memory>

#include "models/phi4mm/init.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/constraint.h"
#include "serve/engine.h"
#include "tensor/autograd.h"
#include "tests/model/model_fixtures.h"
#include "tensor/ops.h"

using namespace areno;
using namespace areno::serve;
using phi4mm::Adapter;

namespace {

std::shared_ptr<phi4mm::Phi4MMForCausalLM> tiny_model() {
  static auto m = phi4mm::init_model("tiny", 11);
  return m;
}
std::shared_ptr<const tok::Tokenizer> tokenizer() {
  static auto t = std::make_shared<const tok::Tokenizer>(phi4mm::make_tokenizer());
  return t;
}

bool banned(int64_t id) {
  return phi4mm::is_unused_id(tok::TokenId(id)) || id == phi4mm::kImageToken || id == phi4mm::kAudioToken;
}

// Media rows for a prompt's placeholders: a fixed function of the request.
Tensor media_rows_for(int64_t n, uint64_t seed) {
  Generator g(seed);
  return rand_normal({n, tiny_model()->config().text.hidden_size}, g, 0.0, 0.5);
}

struct Case {
  std::vector<int64_t> prompt;
  Adapter adapter = Adapter::none;
  uint64_t media_seed = 0;  // rows for the placeholders
  int32_t served = 0;        // Request::served_lora
  int64_t n_media() const {
    int64_t n = 0;
    for (int64_t id : prompt) n += id == phi4mm::kImageToken || id == phi4mm::kAudioToken;
    return n;
  }
};

std::vector<int64_t> ids_of(const std::string& text) {
  auto v = tokenizer()->encode(text);
  return std::vector<int64_t>(v.begin(), v.end());
}

// Text, "image", "audio" and "image+audio" prompts (placeholders with random rows).
std::vector<Case> mixed_cases() {
  std::vector<Case> cs;
  cs.push_back({ids_of("<|user|>Tell me a story about a cat.<|end|><|assistant|>"), Adapter::none, 0});
  {
    Case c{ids_of("<|user|>"), Adapter::vision, 101};
    c.prompt.insert(c.prompt.end(), 21, phi4mm::kImageToken);
    auto tail = ids_of("Describe the picture.<|end|><|assistant|>");
    c.prompt.insert(c.prompt.end(), tail.begin(), tail.end());
    cs.push_back(c);
  }
  {
    Case c{ids_of("<|user|>"), Adapter::speech, 202};
    c.prompt.insert(c.prompt.end(), 13, phi4mm::kAudioToken);
    auto tail = ids_of("Transcribe.<|end|><|assistant|>");
    c.prompt.insert(c.prompt.end(), tail.begin(), tail.end());
    cs.push_back(c);
  }
  {
    Case c{ids_of("<|user|>"), Adapter::vision, 303};
    c.prompt.insert(c.prompt.end(), 9, phi4mm::kImageToken);
    c.prompt.push_back(ids_of(" and ")[0]);
    c.prompt.insert(c.prompt.end(), 7, phi4mm::kAudioToken);
    auto tail = ids_of("What do you see and hear?<|end|><|assistant|>");
    c.prompt.insert(c.prompt.end(), tail.begin(), tail.end());
    cs.push_back(c);
  }
  cs.push_back({ids_of("hello"), Adapter::none, 0});
  return cs;
}

Request make_request(const Case& c, int64_t max_tokens, double temperature = 0) {
  Request r;
  r.prompt = c.prompt;
  r.adapter = c.adapter;
  r.served_lora = c.served;
  const int64_t n = c.n_media();
  const uint64_t seed = c.media_seed;
  if (n > 0) r.media_rows = media_rows_for(n, seed);
  r.params.max_tokens = max_tokens;
  r.params.temperature = temperature;
  r.params.ignore_eos = true;  // random weights: run to max_tokens
  return r;
}

// Greedy continuation with the packed forward, recomputing everything each step.
std::vector<int64_t> reference_greedy(const Case& c, int64_t steps, const phi4mm::Phi4MMForCausalLM* model = nullptr) {
  const auto& m = model ? *model : *tiny_model();
  NoGradGuard ng;
  std::vector<int64_t> ids = c.prompt;
  Tensor media = c.n_media() ? media_rows_for(c.n_media(), c.media_seed) : Tensor();
  std::vector<int64_t> out;
  for (int64_t k = 0; k < steps; ++k) {
    phi4mm::PackedBatch b = phi4mm::PackedBatch::single(ids, c.adapter);
    b.media_rows = media;
    b.served_lora = {c.served};
    std::vector<float> row = m.logits_at(b, {int64_t(ids.size()) - 1}).to(DType::f32).to_vector<float>();
    int64_t best = -1;
    for (int64_t id = 0; id < int64_t(row.size()); ++id)
      if (!banned(id) && (best < 0 || row[size_t(id)] > row[size_t(best)])) best = id;
    out.push_back(best);
    ids.push_back(best);
  }
  return out;
}

std::vector<std::vector<int64_t>> run_engine(const std::vector<Case>& cases, int64_t max_tokens, EngineOptions o,
                                             EngineStats* stats = nullptr, double temperature = 0,
                                             std::optional<uint64_t> seed = std::nullopt, int64_t n = 1) {
  Engine e(tiny_model(), tokenizer(), o);
  std::vector<Request> reqs;
  for (auto& c : cases) {
    reqs.push_back(make_request(c, max_tokens, temperature));
    reqs.back().params.seed = seed;
    reqs.back().params.n = n;
    if (temperature > 0) {
      reqs.back().params.top_p = 0.9;
      reqs.back().params.top_k = 50;
    }
  }
  auto res = generate(e, reqs);
  if (stats) *stats = e.stats();
  std::vector<std::vector<int64_t>> out;
  for (auto& r : res)
    for (auto& c : r) out.push_back(c.tokens);
  CHECK(e.stats().kv_blocks_used == 0);
  CHECK(e.stats().running == 0);
  return out;
}

EngineOptions opts(int64_t max_running, int64_t chunk, int64_t blocks = 256, int64_t batch_tokens = 2048) {
  EngineOptions o;
  o.max_running = max_running;
  o.prefill_chunk_tokens = chunk;
  o.kv_blocks = blocks;
  o.block_size = 4;
  o.max_batch_tokens = batch_tokens;
  return o;
}

}  // namespace

TEST_CASE("engine: greedy equals the packed-forward reference and is batch invariant") {
  const auto cases = mixed_cases();
  const int64_t steps = 12;
  std::vector<std::vector<int64_t>> ref;
  for (auto& c : cases) ref.push_back(reference_greedy(c, steps));

  // Each request alone.
  for (size_t i = 0; i < cases.size(); ++i) {
    auto solo = run_engine({cases[i]}, steps, opts(8, 512));
    CHECK(solo[0] == ref[i]);
  }
  // All together, small running limit, chunked prefill of 1, 16 and 512 tokens.
  for (int64_t chunk : {1, 16, 512}) {
    CAPTURE(chunk);
    EngineStats st;
    auto all = run_engine(cases, steps, opts(2, chunk, 256, 24), &st);
    REQUIRE(all.size() == cases.size());
    for (size_t i = 0; i < cases.size(); ++i) CHECK(all[i] == ref[i]);
    CHECK(st.requests_finished == int64_t(cases.size()));
  }
  // A cache too small for all of them at once: preemption and re-prefill.
  {
    EngineStats st;
    auto all = run_engine(cases, steps, opts(8, 16, 20), &st);
    for (size_t i = 0; i < cases.size(); ++i) CHECK(all[i] == ref[i]);
    CHECK(st.preemptions > 0);
  }
}

TEST_CASE("engine: prefix caching reuses a prompt's cached blocks; every output equals the reference") {
  const auto cases = mixed_cases();
  const int64_t steps = 8;
  std::vector<std::vector<int64_t>> ref;
  for (auto& c : cases) ref.push_back(reference_greedy(c, steps));
  auto run = [&](Engine& e, const std::vector<Case>& cs) {
    std::vector<Request> reqs;
    for (auto& c : cs) reqs.push_back(make_request(c, steps));
    std::vector<std::vector<int64_t>> out;
    for (auto& r : generate(e, reqs)) out.push_back(r[0].tokens);
    CHECK(e.stats().kv_blocks_used == 0);
    return out;
  };
  int64_t prompt_blocks = 0, seq_blocks = 0;  // full blocks (of 4) before each prompt's last token; of all computed tokens
  for (auto& c : cases) {
    prompt_blocks += (int64_t(c.prompt.size()) - 1) / 4;
    seq_blocks += (int64_t(c.prompt.size()) + steps - 1) / 4;  // the last token is sampled, never computed
  }
  EngineOptions o = opts(8, 16, 256);
  o.prefix_caching = true;
  Engine e(tiny_model(), tokenizer(), o);
  CHECK(run(e, cases) == ref);
  EngineStats st = e.stats();
  CHECK(st.prefix_cache_hits == 0);  // nothing was cached before
  CHECK(st.kv_blocks_cached == seq_blocks);
  // The same prompts again: every full block comes from the cache.
  CHECK(run(e, cases) == ref);
  st = e.stats();
  CHECK(st.prefix_cache_hits == prompt_blocks * 4);
  MESSAGE(fmt::format("second pass: {} of {} prompt tokens from the cache", st.prefix_cache_hits,
                      st.prefix_cache_queries));
  // Same tokens, other media rows: only the blocks before the first placeholder
  // match, and the log-probabilities are those of an engine without a cache
  // (the rows change them: a block reused across media would show).
  Case other = cases[1];
  other.media_seed = 999;
  auto logprobs = [&](Engine& en, const Case& c) {
    Request r = make_request(c, steps);
    r.params.logprobs = 0;
    return generate(en, {r})[0][0].logprobs;
  };
  const int64_t before_media = int64_t(std::find(other.prompt.begin(), other.prompt.end(), phi4mm::kImageToken) -
                                       other.prompt.begin()) / 4;
  const int64_t hits0 = e.stats().prefix_cache_hits;
  const std::vector<float> cached = logprobs(e, other);
  CHECK(e.stats().prefix_cache_hits - hits0 == before_media * 4);
  Engine plain(tiny_model(), tokenizer(), opts(8, 16, 256));
  const std::vector<float> fresh = logprobs(plain, other), first = logprobs(plain, cases[1]);
  REQUIRE(cached.size() == size_t(steps));
  REQUIRE(fresh.size() == cached.size());
  double diff = 0, media_effect = 0;
  for (size_t k = 0; k < fresh.size(); ++k) {
    diff = std::max(diff, double(std::abs(cached[k] - fresh[k])));
    media_effect = std::max(media_effect, double(std::abs(first[k] - fresh[k])));
  }
  MESSAGE(fmt::format("other media rows: logprob diff to an uncached engine {:.2g}; the rows' effect {:.2g}", diff,
                      media_effect));
  CHECK(diff < 1e-5);
  CHECK(media_effect > 1e-3);
  // Same tokens, another adapter: no block matches.
  Case speech = cases[0];
  speech.adapter = Adapter::speech;
  const int64_t hits1 = e.stats().prefix_cache_hits;
  CHECK(run(e, {speech}) == std::vector<std::vector<int64_t>>{reference_greedy(speech, steps)});
  CHECK(e.stats().prefix_cache_hits == hits1);
  // A cache too small for everything: evictions and preemption, the same outputs, nothing held after.
  EngineOptions small = opts(8, 16, 20);
  small.prefix_caching = true;
  Engine es(tiny_model(), tokenizer(), small);
  for (int pass = 0; pass < 3; ++pass) {
    CAPTURE(pass);
    CHECK(run(es, cases) == ref);
  }
  CHECK(es.stats().preemptions > 0);
  CHECK(es.stats().kv_blocks_cached <= 20);
  // A long shared start (a system prompt) and different questions: the shared full blocks hit.
  const std::vector<int64_t> system = ids_of("<|system|>You are a careful assistant who answers in one short sentence.<|end|>");
  std::vector<Case> chats;
  for (const char* q : {"What is a cat?", "Why is the sky blue?", "Name a prime number."}) {
    Case c{system, Adapter::none, 0};
    const auto t = ids_of(fmt::format("<|user|>{}<|end|><|assistant|>", q));
    c.prompt.insert(c.prompt.end(), t.begin(), t.end());
    chats.push_back(c);
  }
  Engine ec(tiny_model(), tokenizer(), o);
  for (auto& c : chats) CHECK(run(ec, {c}) == std::vector<std::vector<int64_t>>{reference_greedy(c, steps)});
  size_t common = 0;  // the prompts' common start: the system prompt and what follows it alike
  while (chats[0].prompt[common] == chats[1].prompt[common] && chats[0].prompt[common] == chats[2].prompt[common]) ++common;
  CHECK(common >= system.size());
  CHECK(ec.stats().prefix_cache_hits == 2 * (int64_t(common) / 4) * 4);
  // cache_salt: blocks are shared only within a salt (vLLM's multi-tenant isolation).
  {
    auto salted = [&](const Case& c, const std::string& salt) {
      Request r = make_request(c, steps);
      r.cache_salt = salt;
      return generate(ec, {r})[0][0].tokens;
    };
    int64_t hits = ec.stats().prefix_cache_hits;
    CHECK(salted(chats[1], "tenant-a") == reference_greedy(chats[1], steps));
    CHECK(ec.stats().prefix_cache_hits == hits);  // the unsalted blocks are not tenant-a's
    CHECK(salted(chats[1], "tenant-b") == reference_greedy(chats[1], steps));
    CHECK(ec.stats().prefix_cache_hits == hits);
    CHECK(salted(chats[1], "tenant-a") == reference_greedy(chats[1], steps));
    CHECK(ec.stats().prefix_cache_hits > hits);  // tenant-a's own blocks
  }
  // A second chat turn: the first turn's prompt and answer come back with a
  // new question; their blocks, the generated ones included, are cached.
  {
    Case turn2 = chats[0];
    const std::vector<int64_t> answer = reference_greedy(chats[0], steps);
    turn2.prompt.insert(turn2.prompt.end(), answer.begin(), answer.end() - 1);  // the last was never computed
    const int64_t computed = int64_t(turn2.prompt.size());  // the first turn's tokens with K/V
    turn2.prompt.push_back(answer.back());
    const auto more = ids_of("<|end|><|user|>And a dog?<|end|><|assistant|>");
    turn2.prompt.insert(turn2.prompt.end(), more.begin(), more.end());
    const int64_t hits = ec.stats().prefix_cache_hits;
    CHECK(run(ec, {turn2}) == std::vector<std::vector<int64_t>>{reference_greedy(turn2, steps)});
    CHECK(ec.stats().prefix_cache_hits - hits == computed / 4 * 4);
    CHECK(computed / 4 > int64_t(chats[0].prompt.size() - 1) / 4);  // more than the first prompt's blocks
  }
}

TEST_CASE("engine: served LoRAs mix in one batch, each request its own; cached blocks are never shared across them") {
  // A model of its own with two served adapters (random, so they change the outputs).
  auto m = phi4mm::init_model("tiny", 11);
  REQUIRE(testing::add_random_served_lora(*m, "a", 2, 4.0, phi4mm::kLoraTargets, 5) == 1);  // scaling 2: the fused path
  REQUIRE(testing::add_random_served_lora(*m, "b", 3, 4.5, {"qkv_proj", "down_proj"}, 6) == 2);
  const int64_t steps = 6;
  const auto base = mixed_cases();
  std::vector<Case> cases;
  for (int32_t j : {1, 2, 0})
    for (const Case& c : base) {
      cases.push_back(c);
      cases.back().served = j;
    }
  std::vector<std::vector<int64_t>> ref;
  for (const Case& c : cases) ref.push_back(reference_greedy(c, steps, m.get()));
  // The adapters change the outputs (the test could fail).
  int differ = 0;
  for (size_t i = 0; i < base.size(); ++i) differ += (ref[i] != ref[i + 2 * base.size()]) + (ref[i + base.size()] != ref[i + 2 * base.size()]);
  CHECK(differ >= int(base.size()));
  EngineOptions o = opts(16, 16, 256);
  o.prefix_caching = true;
  Engine e(m, tokenizer(), o);
  auto run = [&](const std::vector<Case>& cs) {
    std::vector<Request> reqs;
    for (const Case& c : cs) reqs.push_back(make_request(c, steps));
    std::vector<std::vector<int64_t>> out;
    for (auto& r : generate(e, reqs)) out.push_back(r[0].tokens);
    CHECK(e.stats().kv_blocks_used == 0);
    return out;
  };
  CHECK(run(cases) == ref);  // all three adapters' requests in the same steps
  // The same prompt under each adapter in turn: a hit only under the same adapter.
  const Case text = base[0];
  const int64_t blocks = (int64_t(text.prompt.size()) - 1) / 4;
  for (int32_t j : {0, 1, 2}) {
    Case c = text;
    c.served = j;
    const int64_t hits = e.stats().prefix_cache_hits;
    CHECK(run({c}) == std::vector<std::vector<int64_t>>{ref[size_t(j == 0 ? 2 : j - 1) * base.size()]});
    CHECK(e.stats().prefix_cache_hits - hits == blocks * 4);  // its own blocks from the first run
  }
  CHECK(e.audit() == "");
  // Refused at submit: a number the model does not have.
  for (int32_t j : {-1, 3}) {
    Case c = text;
    c.served = j;
    CHECK_THROWS_WITH_AS(e.submit(make_request(c, steps), [](const RequestOutput&) {}),
                         doctest::Contains("is not a loaded served LoRA (2 loaded)"), std::invalid_argument);
  }
}

TEST_CASE("engine: served LoRAs load and unload between steps; an adapter in use is not unloaded; a stale request is refused") {
  auto m = phi4mm::init_model("tiny", 11);
  testing::TempDir tmp;
  testing::save_random_peft("tiny", tmp.str("sql"), 4, 8.0, 21);
  Engine e(m, tokenizer(), opts(8, 16, 256));
  CHECK(e.loras().empty());
  CHECK(e.load_lora("sql", tmp.str("sql")) == 1);  // not started: at once, on this thread
  REQUIRE(e.find_lora("sql"));
  CHECK(e.find_lora("sql")->number == 1);
  CHECK_FALSE(e.find_lora("nope"));
  const uint64_t first_uid = e.find_lora("sql")->uid;
  REQUIRE(e.loras().size() == 1);
  CHECK(e.loras()[0].source == tmp.str("sql"));
  CHECK_THROWS_WITH_AS(e.load_lora("sql", tmp.str("sql")), doctest::Contains("named 'sql' already"), std::invalid_argument);
  CHECK_THROWS_AS(e.load_lora("x", tmp.str("nowhere")), std::runtime_error);
  CHECK_THROWS_WITH_AS(e.load_lora("x", tmp.str("sql"), 1), doctest::Contains("1 served LoRAs are loaded"),
                       std::length_error);
  CHECK(e.loras().size() == 1);
  Case c = mixed_cases()[0];
  c.served = 1;
  const std::vector<int64_t> want = reference_greedy(c, 4, m.get());
  // Waiting in the inbox: in use.
  std::vector<int64_t> got;
  bool done = false;
  e.submit(make_request(c, 4), [&](const RequestOutput& o) {
    got.insert(got.end(), o.tokens.begin(), o.tokens.end());
    done |= o.done;
  });
  CHECK_THROWS_WITH_AS(e.unload_lora("sql"), doctest::Contains("in use by 1 request(s)"), LoraInUse);
  e.step();  // admitted and running: still in use
  CHECK_THROWS_AS(e.unload_lora("sql"), LoraInUse);
  e.run_until_idle();
  CHECK(done);
  CHECK(got == want);
  e.unload_lora("sql");
  CHECK(e.loras().empty());
  CHECK(m->served_loras()[0].removed);
  CHECK_THROWS_AS(e.unload_lora("sql"), std::out_of_range);
  CHECK_THROWS_WITH_AS(e.submit(make_request(c, 4), [](const RequestOutput&) {}),
                       doctest::Contains("is not a loaded served LoRA"), std::invalid_argument);
  // Through the stepping thread: loaded again, it takes the freed number, with
  // a new uid; a request resolved before the unload (the old uid) is refused.
  e.start();
  CHECK(e.load_lora("sql", tmp.str("sql")) == 1);
  CHECK(e.find_lora("sql")->uid != first_uid);
  Request stale = make_request(c, 4);
  stale.served_lora_uid = first_uid;
  CHECK_THROWS_WITH_AS(e.submit(stale, [](const RequestOutput&) {}), doctest::Contains("the adapter it named was unloaded"),
                       std::invalid_argument);
  CHECK(e.load_lora("other", tmp.str("sql")) == 2);  // a new number past the loaded ones
  std::mutex mu;
  std::condition_variable cv;
  got.clear();
  done = false;
  e.submit(make_request(c, 4), [&](const RequestOutput& o) {
    std::lock_guard<std::mutex> lk(mu);
    got.insert(got.end(), o.tokens.begin(), o.tokens.end());
    done |= o.done;
    cv.notify_all();
  });
  {
    std::unique_lock<std::mutex> lk(mu);
    REQUIRE(cv.wait_for(lk, std::chrono::seconds(60), [&] { return done; }));
  }
  CHECK(got == want);
  e.unload_lora("sql");
  CHECK(e.loras().size() == 1);
  e.stop();
  CHECK_THROWS_WITH_AS(e.load_lora("sql", tmp.str("sql")), doctest::Contains("shutting down"), std::runtime_error);
}

TEST_CASE("engine: n samples share the prompt's full blocks; each copies only the partial last one") {
  Case c = mixed_cases()[1];  // the image prompt
  if (c.prompt.size() % 4 == 0) c.prompt.insert(c.prompt.begin(), ids_of("Hi")[0]);  // a partial last block
  const int64_t P = int64_t(c.prompt.size()), BS = 4;
  Engine e(tiny_model(), tokenizer(), opts(8, 512, 64));
  Request r = make_request(c, 3, 0.8);
  r.params.n = 4;
  r.params.seed = 5;
  std::vector<std::vector<int64_t>> got(4);
  e.submit(r, [&](const RequestOutput& o) {
    if (o.sample >= 0) got[size_t(o.sample)].insert(got[size_t(o.sample)].end(), o.tokens.begin(), o.tokens.end());
  });
  e.step();  // the prompt in one chunk, then the forks
  CHECK(e.stats().running == 4);
  CHECK(e.stats().kv_blocks_used == (P + BS - 1) / BS + 3);  // was 4 x that with a copy per sample
  CHECK(e.audit().empty());
  e.run_until_idle();
  CHECK(e.stats().kv_blocks_used == 0);
  // The samples equal a run with max_running 1 (each sample prefilled on its own, nothing shared).
  Engine solo(tiny_model(), tokenizer(), opts(1, 512, 64));
  const auto ref = generate(solo, {r})[0];
  for (size_t k = 0; k < 4; ++k) CHECK(got[k] == ref[k].tokens);
  CHECK(std::set<std::vector<int64_t>>(got.begin(), got.end()).size() > 1);  // sampled apart
}

TEST_CASE("engine: a request whose prefix is cached is admitted when its new tokens' blocks are free") {
  // 16 blocks of 4 tokens, prefill chunks of 16 tokens (4 blocks). D holds a
  // 40-token prefix and decodes until 13 blocks are in use; C shares the
  // prefix: it needs 1 new block, not a whole chunk's 4, and 3 are free.
  EngineOptions o = opts(8, 16, 16);
  o.prefix_caching = true;
  Engine e(tiny_model(), tokenizer(), o);
  std::vector<int64_t> prefix;
  while (prefix.size() < 40) {
    const std::vector<int64_t> w = ids_of(" the quick brown fox jumps");
    prefix.insert(prefix.end(), w.begin(), w.end());
  }
  prefix.resize(40);
  Case d{prefix}, c{prefix};
  d.prompt.push_back(ids_of("A")[0]);
  c.prompt.push_back(ids_of("B")[0]);
  std::vector<int64_t> got_d, got_c;
  e.submit(make_request(d, 12), [&](const RequestOutput& out) {
    got_d.insert(got_d.end(), out.tokens.begin(), out.tokens.end());
  });
  for (int i = 0; i < 40 && e.stats().kv_blocks_used < 13; ++i) e.step();
  REQUIRE(e.stats().kv_blocks_used == 13);
  REQUIRE(e.stats().running == 1);
  e.submit(make_request(c, 2), [&](const RequestOutput& out) {
    got_c.insert(got_c.end(), out.tokens.begin(), out.tokens.end());
  });
  e.step();
  CHECK(e.stats().running == 2);  // admitted beside D (was: waiting for D to end)
  CHECK(e.stats().prefix_cache_hits == 40);
  CHECK(e.audit().empty());
  e.run_until_idle();
  CHECK(got_d == reference_greedy(d, 12));
  CHECK(got_c == reference_greedy(c, 2));
  CHECK(e.stats().kv_blocks_used == 0);
  CHECK(e.audit().empty());
}

TEST_CASE("engine: random traffic over a small prefix-cached pool; the books balance after every step") {
  // Requests arrive and are aborted at random steps: shared starts (two
  // system prompts), repeated media rows (so media digests match), n = 1..3
  // (forks share the prompt's full blocks), greedy and seeded sampling, two
  // salts, all in 20 blocks of 4 slots with at most 4 sequences running, so
  // sequences are preempted and cached blocks evicted. After every step each
  // block is held exactly as often as the live tables name it; every request
  // not aborted equals its run in a fresh engine without a cache; at the end
  // nothing is held.
  const auto base = mixed_cases();
  const std::vector<std::vector<int64_t>> starts = {
      {}, ids_of("<|system|>You are a careful assistant.<|end|>"), ids_of("<|system|>Answer in French.<|end|>")};
  std::mt19937_64 rng(20261205);
  auto pick = [&](size_t n) { return size_t(rng() % n); };
  int64_t preemptions = 0, hits = 0, aborted_mid = 0, drafted = 0, kept = 0;
  for (int round = 0; round < 5; ++round) {
    CAPTURE(round);
    EngineOptions o = opts(4, 8, 20);
    o.prefix_caching = true;
    // Odd rounds speculate (prompt lookup from 1-token matches): drafts take
    // blocks, are cut back and must leave the same answers and books.
    o.speculative_tokens = round % 2 ? 3 : 0;
    o.prompt_lookup_min = 1;
    Engine e(tiny_model(), tokenizer(), o);
    struct Live {
      Request r;
      int64_t id = -1;
      bool abort_sent = false, aborted = false, done = false;
      std::vector<std::vector<int64_t>> tokens;
    };
    std::vector<std::unique_ptr<Live>> live;
    const int total = 18;
    for (int step = 0; step < 5000; ++step) {
      if (int(live.size()) < total && pick(3) == 0) {
        auto L = std::make_unique<Live>();
        Case c = base[pick(base.size())];
        const auto& st = starts[pick(starts.size())];
        c.prompt.insert(c.prompt.begin(), st.begin(), st.end());
        if (c.media_seed) c.media_seed += pick(2);  // one of two row sets per case
        L->r = make_request(c, 1 + int64_t(pick(10)), pick(2) ? 0.0 : 0.8);
        L->r.params.n = 1 + int64_t(pick(3));
        L->r.params.seed = uint64_t(pick(4));
        if (L->r.params.temperature > 0) L->r.params.top_k = 20;
        if (pick(4) == 0) L->r.cache_salt = "tenant";
        L->tokens.resize(size_t(L->r.params.n));
        Live* p = L.get();
        L->id = e.submit(L->r, [p](const RequestOutput& out) {
          REQUIRE(out.error.empty());
          if (out.sample >= 0) {
            auto& t = p->tokens[size_t(out.sample)];
            t.insert(t.end(), out.tokens.begin(), out.tokens.end());
          }
          p->aborted |= out.finish == FinishReason::abort;
          p->done |= out.done;
        });
        live.push_back(std::move(L));
      }
      if (!live.empty() && pick(12) == 0) {
        Live& v = *live[pick(live.size())];
        if (!v.done && !v.abort_sent) {
          e.abort(v.id);
          v.abort_sent = true;
        }
      }
      const bool worked = e.step();
      const std::string books = e.audit();
      REQUIRE_MESSAGE(books.empty(), books);
      if (!worked && int(live.size()) == total) break;
    }
    const EngineStats st = e.stats();
    CHECK(st.kv_blocks_used == 0);
    CHECK(st.running == 0);
    CHECK(st.kv_blocks_cached <= 20);
    preemptions += st.preemptions;
    hits += st.prefix_cache_hits;
    drafted += st.spec_draft_tokens;
    kept += st.spec_accepted_tokens;
    Engine plain(tiny_model(), tokenizer(), opts(8, 16, 256));
    for (auto& L : live) {
      REQUIRE(L->done);
      if (L->aborted) {
        aborted_mid += std::any_of(L->tokens.begin(), L->tokens.end(), [](auto& t) { return !t.empty(); });
        continue;
      }
      const auto ref = generate(plain, {L->r})[0];
      for (size_t k = 0; k < ref.size(); ++k) CHECK(L->tokens[k] == ref[k].tokens);
    }
  }
  MESSAGE(fmt::format("5 rounds: {} preemptions, {} prompt tokens from the cache, {} aborted mid-answer; {} of {} "
                      "draft tokens kept", preemptions, hits, aborted_mid, kept, drafted));
  CHECK(preemptions > 0);
  CHECK(kept > 0);
  CHECK(kept < drafted);
  CHECK(hits > 0);
  CHECK(aborted_mid > 0);
}

// Prompt lookup speculation (EngineOptions::speculative_tokens): each row
// of a speculative chunk is picked as plain decoding picks it, so greedy and
// seeded sampled answers (top_k 3, with logprobs and a presence penalty)
// equal a plain engine's, token for token, in fewer steps when the text
// repeats.
TEST_CASE("engine: speculative (prompt lookup) decoding gives plain decoding's tokens in fewer steps") {
  std::vector<Case> cases = mixed_cases();
  cases.push_back({ids_of("one two three four five six seven eight nine ten one two three four five six seven eight "
                          "nine ten one two three four")});
  for (double temperature : {0.0, 0.5}) {
    CAPTURE(temperature);
    std::vector<Request> reqs;
    for (const Case& c : cases) {
      Request r = make_request(c, 24, temperature);
      r.params.seed = 11;
      r.params.logprobs = 2;
      if (temperature > 0) {  // few candidates, so the sampled text repeats too
        r.params.top_k = 3;
        r.params.presence_penalty = 0.1;
      }
      reqs.push_back(r);
    }
    auto run = [&](int64_t spec, EngineStats& st) {
      EngineOptions o = opts(8, 16, 256);
      o.speculative_tokens = spec;
      o.prompt_lookup_min = 1;
      Engine e(tiny_model(), tokenizer(), o);
      std::vector<std::vector<int64_t>> tokens(reqs.size());
      std::vector<std::vector<float>> lps(reqs.size());
      for (size_t i = 0; i < reqs.size(); ++i)
        e.submit(reqs[i], [&, i](const RequestOutput& out) {
          tokens[i].insert(tokens[i].end(), out.tokens.begin(), out.tokens.end());
          for (const TokenLogprob& lp : out.logprobs) lps[i].push_back(lp.logprob);
        });
      for (int guard = 0; e.step(); ++guard) {
        REQUIRE(guard < 1000);  // a sequence left with nothing to compute would spin
        REQUIRE(e.audit().empty());
      }
      st = e.stats();
      CHECK(st.kv_blocks_used == 0);
      return std::make_pair(tokens, lps);
    };
    EngineStats plain_st, spec_st;
    const auto plain = run(0, plain_st), spec = run(4, spec_st);
    CHECK(spec.first == plain.first);
    for (size_t i = 0; i < reqs.size(); ++i) {
      REQUIRE(spec.second[i].size() == plain.second[i].size());
      for (size_t k = 0; k < spec.second[i].size(); ++k)
        CHECK(spec.second[i][k] == doctest::Approx(plain.second[i][k]).epsilon(1e-4));
    }
    MESSAGE(fmt::format("temperature {}: {} of {} draft tokens kept, {} steps instead of {}", temperature,
                        spec_st.spec_accepted_tokens, spec_st.spec_draft_tokens, spec_st.steps, plain_st.steps));
    CHECK(spec_st.spec_accepted_tokens > 0);
    CHECK(spec_st.steps < plain_st.steps);
    CHECK(spec_st.generated_tokens == plain_st.generated_tokens);
  }
}

TEST_CASE("engine: crossing original_max_position_embeddings re-prefills and continues as the reference") {
  const int64_t orig = tiny_model()->config().text.original_max_position_embeddings;  // 64
  Case c;
  for (int64_t i = 0; i < orig - 4; ++i) c.prompt.push_back(1000 + 37 * i);
  const int64_t steps = 10;  // crosses the boundary during decode
  auto ref = reference_greedy(c, steps);
  for (int64_t chunk : {7, 512}) {
    EngineStats st;
    auto out = run_engine({c, mixed_cases()[0]}, steps, opts(4, chunk), &st);
    CHECK(out[0] == ref);
    CHECK(st.reprefills == 1);
  }
  // A prompt already over the boundary starts with the long table.
  Case longp;
  for (int64_t i = 0; i < orig + 5; ++i) longp.prompt.push_back(2000 + 11 * i);
  EngineStats st;
  CHECK(run_engine({longp}, 4, opts(4, 16), &st)[0] == reference_greedy(longp, 4));
  CHECK(st.reprefills == 0);
}

TEST_CASE("engine: prompt logprobs (echo) and the scoring API equal the packed training forward") {
  auto& m = *tiny_model();
  const auto cases = mixed_cases();
  for (const Case& c : {cases[0], cases[1]}) {
    // Packed forward: log p(prompt[t+1] | prompt[<= t]).
    NoGradGuard ng;
    phi4mm::PackedBatch b = phi4mm::PackedBatch::single(c.prompt, c.adapter);
    Tensor media = c.n_media() ? media_rows_for(c.n_media(), c.media_seed) : Tensor();
    b.media_rows = media;
    std::vector<int64_t> targets(c.prompt.begin() + 1, c.prompt.end());
    targets.push_back(-1);
    auto ref = m.token_logprobs(b, from_vector(targets, {int64_t(targets.size())})).to_vector<float>();

    for (int64_t chunk : {5, 512}) {
      Engine e(tiny_model(), tokenizer(), opts(4, chunk));
      Request r = make_request(c, 0);
      r.params.prompt_logprobs = 3;
      std::vector<std::optional<TokenLogprob>> got;
      bool done = false;
      e.submit(r, [&](const RequestOutput& o) {
        if (!o.prompt_logprobs.empty()) got = o.prompt_logprobs;
        done |= o.done;
        CHECK(o.error.empty());
      });
      e.run_until_idle();
      CHECK(done);
      REQUIRE(got.size() == c.prompt.size());
      CHECK(!got[0].has_value());
      double worst = 0;
      for (size_t t = 1; t < got.size(); ++t) {
        REQUIRE(got[t].has_value());
        CHECK(got[t]->token == c.prompt[t]);
        worst = std::max(worst, std::abs(double(got[t]->logprob) - ref[t - 1]));
        REQUIRE(got[t]->top.size() == 3);
        CHECK(got[t]->top[0].second >= got[t]->top[1].second);
        CHECK(got[t]->top[0].second >= got[t]->logprob - 1e-6);
      }
      CHECK(worst < 1e-5);
      CHECK(e.stats().kv_blocks_used == 0);
    }
    // score(): the completion part of the same forward.
    const size_t split = c.prompt.size() - 4;
    std::vector<int64_t> prompt(c.prompt.begin(), c.prompt.begin() + int64_t(split));
    std::vector<int64_t> completion(c.prompt.begin() + int64_t(split), c.prompt.end());
    auto sc = score(m, prompt, completion, c.adapter, media);
    REQUIRE(sc.size() == 4);
    for (size_t t = 0; t < 4; ++t) CHECK(std::abs(sc[t] - ref[split - 1 + t]) < 1e-6);
  }
}

TEST_CASE("engine: generated logprobs are the raw distribution's") {
  const auto c = mixed_cases()[0];
  Engine e(tiny_model(), tokenizer(), opts(4, 512));
  auto res = generate(e, {[&] {
                        Request r = make_request(c, 5);
                        r.params.logprobs = 2;
                        return r;
                      }()});
  const auto& comp = res[0][0];
  REQUIRE(comp.tokens.size() == 5);
  std::vector<int64_t> ids = c.prompt;
  ids.insert(ids.end(), comp.tokens.begin(), comp.tokens.end());
  auto sc = score(*tiny_model(), c.prompt, comp.tokens);
  for (size_t t = 0; t < 5; ++t) CHECK(std::abs(comp.logprobs[t] - sc[t]) < 1e-5);
}

TEST_CASE("engine: seeded sampling is reproducible across batch compositions and preemption") {
  const auto cases = mixed_cases();
  const int64_t steps = 10;
  auto solo = run_engine({cases[2]}, steps, opts(8, 512), nullptr, 0.9, 1234, 3);
  REQUIRE(solo.size() == 3);
  CHECK(solo[0] != solo[1]);  // different samples of one request differ
  // In a batch (every request seeded the same), with chunking and preemption.
  auto batch = run_engine(cases, steps, opts(3, 16, 256, 40), nullptr, 0.9, 1234, 3);
  REQUIRE(batch.size() == 3 * cases.size());
  for (int j = 0; j < 3; ++j) CHECK(batch[6 + size_t(j)] == solo[size_t(j)]);
  EngineStats st;
  auto tight = run_engine(cases, steps, opts(8, 16, 24), &st, 0.9, 1234, 3);
  for (int j = 0; j < 3; ++j) CHECK(tight[6 + size_t(j)] == solo[size_t(j)]);
  CHECK(st.preemptions > 0);
  // Another seed, another output.
  auto other = run_engine({cases[2]}, steps, opts(8, 512), nullptr, 0.9, 99, 1);
  CHECK(other[0] != solo[0]);
}

TEST_CASE("engine: stop strings, stop token ids and max_tokens") {
  const auto c = mixed_cases()[0];
  Engine e(tiny_model(), tokenizer(), opts(4, 512));
  // Seeded sampling without special tokens (greedy on random weights repeats <|assistant|>).
  auto make_request = [](const Case& c, int64_t max_tokens) {
    Request r = ::make_request(c, max_tokens, 1.0);
    r.params.seed = 5;
    for (int64_t id = 199999; id < 200029; ++id) r.params.logit_bias.emplace_back(id, -100.0);
    return r;
  };
  auto base = generate(e, {make_request(c, 16)})[0][0];
  REQUIRE(base.tokens.size() == 16);
  INFO(fmt::format("{}", fmt::join(base.tokens, ",")));
  CHECK(base.finish == FinishReason::length);

  // Stop token: the 6th generated token (first occurrence).
  {
    const int64_t stop_id = base.tokens[5];
    size_t first = size_t(std::find(base.tokens.begin(), base.tokens.end(), stop_id) - base.tokens.begin());
    Request r = make_request(c, 16);
    r.params.stop_token_ids = {stop_id};
    std::string reason;
    auto res = generate(e, {r})[0][0];
    CHECK(res.finish == FinishReason::stop);
    CHECK(res.tokens.size() == first + 1);  // the stop token is part of the output tokens
    CHECK(res.tokens.back() == stop_id);
  }
  // Stop string taken from the decoded text: the output ends right before it.
  {
    const std::string full = base.text;
    REQUIRE(full.size() > 8);
    // A stop string of 3 bytes starting at a character boundary in the middle.
    size_t at = full.size() / 2;
    while (at < full.size() && (uint8_t(full[at]) & 0xC0) == 0x80) ++at;
    size_t end = at + 1;
    while (end < full.size() && (end - at < 3 || (uint8_t(full[end]) & 0xC0) == 0x80)) ++end;
    const std::string stop = full.substr(at, end - at);
    const size_t first = full.find(stop);
    Request r = make_request(c, 16);
    r.params.stop = {stop};
    auto res = generate(e, {r})[0][0];
    CHECK(res.finish == FinishReason::stop);
    CHECK(res.text == full.substr(0, first));
    r.params.include_stop_str_in_output = true;
    auto inc = generate(e, {r})[0][0];
    CHECK(inc.text == full.substr(0, first + stop.size()));
  }
  CHECK(e.stats().kv_blocks_used == 0);
}

TEST_CASE("engine: allowed_token_ids and bad_words (vLLM's) mask what they name, nothing else") {
  const auto c = mixed_cases()[0];
  Engine e(tiny_model(), tokenizer(), opts(4, 512));
  auto make = [&](int64_t max_tokens) {
    Request r = make_request(c, max_tokens, 1.0);
    r.params.seed = 9;
    for (int64_t id = 199999; id < 200029; ++id) r.params.logit_bias.emplace_back(id, -100.0);
    return r;
  };
  const auto base = generate(e, {make(12)})[0][0];
  REQUIRE(base.tokens.size() == 12);
  INFO(fmt::format("{}", fmt::join(base.tokens, ",")));
  auto has_pair = [](const std::vector<int64_t>& t, int64_t a, int64_t b) {
    for (size_t i = 1; i < t.size(); ++i)
      if (t[i - 1] == a && t[i] == b) return true;
    return false;
  };

  // allowed_token_ids: every token drawn among them.
  {
    Request r = make(12);
    r.params.allowed_token_ids = {base.tokens[1], base.tokens[4], 17, 4000};
    const auto res = generate(e, {r})[0][0];
    REQUIRE(res.tokens.size() == 12);
    for (int64_t t : res.tokens) CHECK(std::count(r.params.allowed_token_ids.begin(), r.params.allowed_token_ids.end(), t) == 1);
  }
  // A one-id bad word: never drawn.
  {
    const int64_t id = base.tokens[3];
    Request r = make(12);
    r.params.bad_words_ids = {{id}};
    const auto res = generate(e, {r})[0][0];
    REQUIRE(res.tokens.size() == 12);
    CHECK(std::count(res.tokens.begin(), res.tokens.end(), id) == 0);
  }
  // A two-id bad word: its second id masked only right after its first, so
  // the steps before (the same distributions) draw base's tokens.
  {
    const int64_t a = base.tokens[2], b = base.tokens[3];
    REQUIRE(has_pair(base.tokens, a, b));
    Request r = make(12);
    r.params.bad_words_ids = {{a, b}};
    const auto res = generate(e, {r})[0][0];
    CHECK_FALSE(has_pair(res.tokens, a, b));
    CHECK(std::vector<int64_t>(res.tokens.begin(), res.tokens.begin() + 3) ==
          std::vector<int64_t>(base.tokens.begin(), base.tokens.begin() + 3));
  }
  // Where they would leave nothing to draw, the bad words give way.
  {
    Request r = make(4);
    r.params.allowed_token_ids = {4000};
    r.params.bad_words_ids = {{4000}};
    const auto res = generate(e, {r})[0][0];
    CHECK(res.tokens == std::vector<int64_t>(4, 4000));
  }
  // Strings are encoded at submit, as vLLM encodes them.
  {
    const std::string word = tokenizer()->decode(std::vector<tok::TokenId>{tok::TokenId(base.tokens[3])});
    Request r = make(12);
    r.params.bad_words = {word};
    const auto seqs = encode_bad_words(r.params.bad_words, [](const std::string& t) {
      const std::vector<tok::TokenId> ids = tokenizer()->encode(t);
      return std::vector<int64_t>(ids.begin(), ids.end());
    });
    REQUIRE_FALSE(seqs.empty());
    const auto res = generate(e, {r})[0][0];
    for (const auto& seq : seqs) {
      if (seq.size() == 1) CHECK(std::count(res.tokens.begin(), res.tokens.end(), seq[0]) == 0);
      if (seq.size() == 2) CHECK_FALSE(has_pair(res.tokens, seq[0], seq[1]));
    }
  }
  // Checked at submit.
  Request bad = make(4);
  bad.params.allowed_token_ids = {phi4mm::kImageTokenId};
  CHECK_THROWS_WITH_AS(e.submit(bad, [](const RequestOutput&) {}), doctest::Contains("allowed_token_ids: holds only ids"),
                       std::invalid_argument);
  bad = make(4);
  bad.params.bad_words = {"  "};
  CHECK_THROWS_WITH_AS(e.submit(bad, [](const RequestOutput&) {}), doctest::Contains("bad_words:"), std::invalid_argument);
  CHECK(e.stats().kv_blocks_used == 0);
}

TEST_CASE("engine: bad_words are encoded as vLLM encodes them") {
  // A made-up tokenizer: "foo" -> 1 2, " foo" -> 3 2 (a new first id, as
  // long: kept), "bar" -> 4, " bar" -> 4 (the same first id: dropped),
  // "baz" -> 5, " baz" -> 6 7 (longer: dropped); leading blanks are stripped.
  const std::map<std::string, std::vector<int64_t>> vocab = {
      {"foo", {1, 2}}, {" foo", {3, 2}}, {"bar", {4}}, {" bar", {4}}, {"baz", {5}}, {" baz", {6, 7}}};
  auto enc = [&](const std::string& t) {
    auto it = vocab.find(t);
    return it == vocab.end() ? std::vector<int64_t>{} : it->second;
  };
  CHECK(encode_bad_words({"foo", " bar", "\tbaz"}, enc) ==
        std::vector<std::vector<int64_t>>{{1, 2}, {3, 2}, {4}, {5}});
  CHECK(encode_bad_words({"unknown"}, enc).empty());
}

TEST_CASE("engine: streaming text concatenates to the full decode") {
  const auto c = mixed_cases()[0];
  Engine e(tiny_model(), tokenizer(), opts(4, 512));
  Request r = make_request(c, 20);
  r.params.skip_special_tokens = false;
  std::string text;
  std::vector<int64_t> toks;
  e.submit(r, [&](const RequestOutput& o) {
    text += o.text;
    toks.insert(toks.end(), o.tokens.begin(), o.tokens.end());
  });
  e.run_until_idle();
  std::vector<tok::TokenId> t(toks.begin(), toks.end());
  CHECK(text == tokenizer()->decode(t));
}

TEST_CASE("engine: abort frees the blocks; limits are checked at submit") {
  const auto c = mixed_cases()[0];
  Engine e(tiny_model(), tokenizer(), opts(4, 512, 32));
  FinishReason fin = FinishReason::none;
  bool done = false;
  const int64_t id = e.submit(make_request(c, 100), [&](const RequestOutput& o) {
    if (o.finish != FinishReason::none) fin = o.finish;
    done |= o.done;
  });
  e.step();
  e.step();
  CHECK(e.stats().kv_blocks_used > 0);
  e.abort(id);
  e.step();
  CHECK(done);
  CHECK(fin == FinishReason::abort);
  CHECK(e.stats().kv_blocks_used == 0);
  CHECK(e.stats().requests_aborted == 1);

  // Over the context, over the cache, bad ids, media without rows, bad params.
  Request big;
  big.prompt.assign(4100, 5);  // over the context (4096)
  CHECK_THROWS_AS(e.submit(big, [](const RequestOutput&) {}), std::invalid_argument);
  Request cache_big;
  cache_big.prompt.assign(200, 5);  // under the context but over 32 blocks * 4 slots
  CHECK_THROWS_AS(e.submit(cache_big, [](const RequestOutput&) {}), std::invalid_argument);
  Request bad_id;
  bad_id.prompt = {1, 300000};
  CHECK_THROWS_AS(e.submit(bad_id, [](const RequestOutput&) {}), std::invalid_argument);
  Request no_media;
  no_media.prompt = {1, phi4mm::kImageToken, 2};
  CHECK_THROWS_AS(e.submit(no_media, [](const RequestOutput&) {}), std::invalid_argument);
  Request bad_p = make_request(c, 4);
  bad_p.params.top_p = 0;
  CHECK_THROWS_WITH_AS(e.submit(bad_p, [](const RequestOutput&) {}), doctest::Contains("top_p"),
                       std::invalid_argument);

  // A full queue answers QueueFull.
  EngineOptions small = opts(1, 512);
  small.max_queue = 2;
  Engine q(tiny_model(), tokenizer(), small);
  q.submit(make_request(c, 1), [](const RequestOutput&) {});
  q.submit(make_request(c, 1), [](const RequestOutput&) {});
  CHECK_THROWS_AS(q.submit(make_request(c, 1), [](const RequestOutput&) {}), QueueFull);
  q.run_until_idle();
  CHECK(q.stats().requests_finished == 2);
}

TEST_CASE("engine: a sequence that outgrows the whole cache ends with length") {
  const auto c = mixed_cases()[4];  // "hello": a short prompt
  Engine e(tiny_model(), tokenizer(), opts(4, 512, 3));  // 3 blocks of 4 tokens
  auto res = generate(e, {make_request(c, 50)})[0][0];
  CHECK(res.finish == FinishReason::length);
  CHECK(int64_t(c.prompt.size() + res.tokens.size()) <= 13);
  CHECK(e.stats().kv_blocks_used == 0);
}

TEST_CASE("engine: the background thread serves concurrent submitters and drains on stop") {
  const auto cases = mixed_cases();
  Engine e(tiny_model(), tokenizer(), opts(3, 16));
  e.start();
  std::mutex mu;
  std::map<int64_t, std::vector<int64_t>> got;
  int finished = 0;
  std::vector<std::thread> ths;
  for (size_t i = 0; i < cases.size(); ++i)
    ths.emplace_back([&, i] {
      e.submit(make_request(cases[i], 6), [&, i](const RequestOutput& o) {
        std::lock_guard<std::mutex> lk(mu);
        auto& v = got[int64_t(i)];
        v.insert(v.end(), o.tokens.begin(), o.tokens.end());
        finished += o.done;
      });
    });
  for (auto& t : ths) t.join();
  e.stop(true);
  CHECK(finished == int(cases.size()));
  for (size_t i = 0; i < cases.size(); ++i) CHECK(got[int64_t(i)] == reference_greedy(cases[i], 6));
  CHECK(e.stats().kv_blocks_used == 0);
}

// ---- the real towers (tiny preset): must-show 1 with image and audio rows ----

#include "models/phi4mm/model.h"

namespace {

phi4mm::RgbImage pattern_image(int64_t w, int64_t h, int seed) {
  phi4mm::RgbImage im;
  im.width = w, im.height = h;
  im.rgb.resize(size_t(w * h * 3));
  for (size_t i = 0; i < im.rgb.size(); ++i) im.rgb[i] = uint8_t((i * 13 + size_t(seed) * 71) % 253);
  return im;
}

std::vector<double> chirp(int64_t n, int64_t rate) {
  std::vector<double> s(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double t = double(i) / double(rate);
    s[size_t(i)] = 0.4 * std::sin(2 * M_PI * (200 + 300 * t) * t);
  }
  return s;
}

struct MediaCase {
  std::vector<int64_t> prompt;
  Adapter adapter = Adapter::none;
  std::vector<phi4mm::Media> media;
};

}  // namespace

TEST_CASE("engine: text, image, audio and image+audio requests through the towers are batch invariant") {
  auto mm = phi4mm::init_phi4mm("tiny", 11, DType::f32);
  auto lm = mm;
  auto text = [](const std::string& t) { return ids_of(t); };
  auto build = [&](std::vector<phi4mm::RgbImage> imgs, std::vector<std::vector<double>> clips,
                   std::vector<int64_t> rates) {
    MediaCase c;
    c.prompt = text("<|user|>");
    for (auto& im : imgs) {
      c.prompt.insert(c.prompt.end(), size_t(phi4mm::num_image_tokens(im.width, im.height)), phi4mm::kImageToken);
      c.media.push_back(phi4mm::Media::of_image(im));
    }
    for (size_t i = 0; i < clips.size(); ++i) {
      c.prompt.insert(c.prompt.end(), size_t(phi4mm::audio_token_count(int64_t(clips[i].size()), rates[i])),
                      phi4mm::kAudioToken);
      c.media.push_back(phi4mm::Media::of_audio(clips[i], rates[i]));
    }
    auto tail = text("What is this?<|end|><|assistant|>");
    c.prompt.insert(c.prompt.end(), tail.begin(), tail.end());
    c.adapter = imgs.empty() ? (clips.empty() ? Adapter::none : Adapter::speech) : Adapter::vision;
    return c;
  };
  std::vector<MediaCase> cases = {
      build({}, {}, {}),
      build({pattern_image(60, 40, 1)}, {}, {}),
      build({}, {chirp(16000, 16000)}, {16000}),
      build({pattern_image(30, 50, 2)}, {chirp(12000, 8000)}, {8000}),
  };
  const int64_t steps = 6;
  NoGradGuard ng;
  // Reference: the packed forward over the whole sequence, media rows merged.
  std::vector<std::vector<int64_t>> ref;
  for (auto& c : cases) {
    Tensor rows = phi4mm::media_rows(*mm, c.media);
    std::vector<int64_t> ids = c.prompt, out;
    for (int64_t k = 0; k < steps; ++k) {
      phi4mm::PackedBatch b = phi4mm::PackedBatch::single(ids, c.adapter);
      b.media_rows = rows;
      auto row = lm->logits_at(b, {int64_t(ids.size()) - 1}).to_vector<float>();
      int64_t best = -1;
      for (int64_t id = 0; id < int64_t(row.size()); ++id)
        if (!banned(id) && (best < 0 || row[size_t(id)] > row[size_t(best)])) best = id;
      out.push_back(best);
      ids.push_back(best);
    }
    ref.push_back(out);
  }
  auto request = [&](size_t i) {
    Request r;
    r.prompt = cases[i].prompt;
    r.adapter = cases[i].adapter;
    r.media = cases[i].media;
    r.params.max_tokens = steps;
    r.params.temperature = 0;
    r.params.ignore_eos = true;
    return r;
  };
  auto run = [&](std::vector<size_t> which, EngineOptions o, EngineStats* st = nullptr) {
    Engine e(lm, tokenizer(), o);
    std::vector<Request> reqs;
    for (size_t i : which) reqs.push_back(request(i));
    auto res = generate(e, reqs);
    if (st) *st = e.stats();
    CHECK(e.stats().kv_blocks_used == 0);
    std::vector<std::vector<int64_t>> out;
    for (auto& r : res) out.push_back(r[0].tokens);
    return out;
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    CAPTURE(i);
    CHECK(run({i}, opts(4, 512, 1024))[0] == ref[i]);
  }
  for (int64_t chunk : {1, 16, 512}) {
    CAPTURE(chunk);
    auto all = run({0, 1, 2, 3}, opts(2, chunk, 1024, chunk == 1 ? 8 : 600));
    for (size_t i = 0; i < cases.size(); ++i) CHECK(all[i] == ref[i]);
  }
  // A cache that cannot hold every request at once: preemption, re-prefill, same outputs.
  EngineStats st;
  int64_t longest = 0;
  for (auto& c : cases) longest = std::max<int64_t>(longest, int64_t(c.prompt.size()));
  auto tight = run({0, 1, 2, 3}, opts(4, 64, (longest + steps) / 4 + 40), &st);
  for (size_t i = 0; i < cases.size(); ++i) CHECK(tight[i] == ref[i]);
  CHECK(st.preemptions > 0);

  // The media cache (and the prefix cache beside it): a request whose media
  // were seen before takes their rows without running the towers; the
  // outputs are the reference's. Least recently used out past the bytes.
  SUBCASE("media cache") {
    EngineOptions o = opts(4, 512, 1024);
    o.media_cache_bytes = size_t(64) << 20;
    o.prefix_caching = true;
    Engine e(lm, tokenizer(), o);
    auto one = [&](size_t i) { return generate(e, {request(i)})[0][0].tokens; };
    for (int pass = 0; pass < 2; ++pass)
      for (size_t i : {1, 2, 3}) {
        CAPTURE(pass);
        CAPTURE(i);
        CHECK(one(i) == ref[i]);
      }
    EngineStats ms = e.stats();
    CHECK(ms.media_items_total == 4);  // encoded once each: 1 + 1 + 2 items
    CHECK(ms.media_cache_hits == 4);   // per item: 1 + 1 + 2 on the second pass
    CHECK(ms.prefix_cache_hits > 0);
    CHECK(one(1) == ref[1]);
    CHECK(e.stats().media_cache_hits == 5);
    // Another cache_salt: the media are encoded again, not taken from the unsalted rows.
    Request salted = request(1);
    salted.cache_salt = "tenant-a";
    CHECK(generate(e, {salted})[0][0].tokens == ref[1]);
    CHECK(e.stats().media_cache_hits == 5);
    CHECK(e.stats().media_items_total == 5);
    // Per item: case 1's image beside case 2's clip takes the kept image rows
    // and encodes only the clip, which beside an image takes the vision
    // projector, so it is not case 2's kept (speech) rows. The outputs are
    // those of the whole list encoded at once. Then the same two items with a
    // new image: only the new image is encoded.
    MediaCase pair = build({pattern_image(60, 40, 1)}, {chirp(16000, 16000)}, {16000});
    MediaCase three = build({pattern_image(60, 40, 1), pattern_image(44, 36, 3)}, {chirp(16000, 16000)}, {16000});
    auto reference = [&](const MediaCase& c) {
      Engine plain(lm, tokenizer(), opts(4, 512, 1024));
      Request r;
      r.prompt = c.prompt;
      r.adapter = c.adapter;
      r.media_rows = phi4mm::media_rows(*mm, c.media);
      r.params.max_tokens = steps;
      r.params.temperature = 0;
      r.params.ignore_eos = true;
      return generate(plain, {r})[0][0].tokens;
    };
    for (const MediaCase* c : {&pair, &three}) {
      Request r;
      r.prompt = c->prompt;
      r.adapter = c->adapter;
      r.media = c->media;
      r.params.max_tokens = steps;
      r.params.temperature = 0;
      r.params.ignore_eos = true;
      const int64_t items0 = e.stats().media_items_total, hits0 = e.stats().media_cache_hits;
      CHECK(generate(e, {r})[0][0].tokens == reference(*c));
      CHECK(e.stats().media_items_total - items0 == 1);  // the clip, then the new image
      CHECK(e.stats().media_cache_hits - hits0 == (c == &pair ? 1 : 2));
    }
    // Room for one request's rows: each new one pushes the last out.
    const int64_t H = lm->config().text.hidden_size;
    auto row_bytes = [&](size_t i) {
      size_t n = 0;
      for (int64_t id : cases[i].prompt) n += phi4mm::is_media_token(id) ? size_t(H) * sizeof(float) : 0;
      return n;
    };
    EngineOptions small = o;
    small.media_cache_bytes = std::max(row_bytes(1), row_bytes(2));
    REQUIRE(small.media_cache_bytes < row_bytes(1) + row_bytes(2));
    Engine e2(lm, tokenizer(), small);
    auto two = [&](size_t i) { return generate(e2, {request(i)})[0][0].tokens; };
    for (size_t i : {1, 2, 1, 2}) CHECK(two(i) == ref[i]);
    CHECK(e2.stats().media_cache_hits == 0);
    CHECK(two(2) == ref[2]);
    CHECK(e2.stats().media_cache_hits == 1);
    CHECK(e2.stats().media_items_total == 4);
  }
}

TEST_CASE("engine: sampled frequencies follow the softmax; top_k and top_p cut the tail") {
  // Three tokens lifted far above the rest by logit_bias: their probabilities
  // are softmax(logit + bias) over those three (the rest is ~e^-90).
  const auto c = mixed_cases()[4];
  const std::vector<int64_t> ids3 = {1000, 2000, 3000};
  const std::vector<double> bias = {100.0, 100.0 - std::log(2.0), 100.0 - std::log(4.0)};
  NoGradGuard ng;
  auto row = tiny_model()->logits_at(phi4mm::PackedBatch::single(c.prompt), {int64_t(c.prompt.size()) - 1})
                 .to_vector<float>();
  std::vector<double> p(3);
  double z = 0;
  for (int i = 0; i < 3; ++i) z += p[size_t(i)] = std::exp(double(row[size_t(ids3[size_t(i)])]) + bias[size_t(i)] - 100);
  for (auto& x : p) x /= z;
  auto run = [&](double top_p, int64_t top_k) {
    Engine e(tiny_model(), tokenizer(), opts(64, 512, 512));
    std::vector<Request> reqs;
    for (int k = 0; k < 600; ++k) {
      Request r = make_request(c, 1, 1.0);
      r.params.seed = uint64_t(k);
      r.params.top_p = top_p;
      r.params.top_k = top_k;
      for (int i = 0; i < 3; ++i) r.params.logit_bias.emplace_back(ids3[size_t(i)], bias[size_t(i)]);
      reqs.push_back(r);
    }
    std::map<int64_t, int> counts;
    for (auto& res : generate(e, reqs)) counts[res[0].tokens.at(0)]++;
    return counts;
  };
  auto within = [](int count, int n, double prob) {
    const double sd = std::sqrt(n * prob * (1 - prob));
    return std::abs(count - n * prob) <= 4 * sd + 1;
  };
  auto all = run(1.0, -1);
  CHECK(all.size() <= 3);
  for (int i = 0; i < 3; ++i) CHECK_MESSAGE(within(all[ids3[size_t(i)]], 600, p[size_t(i)]), "token " << i);
  auto k2 = run(1.0, 2);  // renormalised over the two best
  CHECK(k2.count(ids3[2]) == 0);
  CHECK(within(k2[ids3[0]], 600, p[0] / (p[0] + p[1])));
  auto p_small = run(0.3, -1);  // the best token alone reaches 0.3
  CHECK(p_small.size() == 1);
  CHECK(p_small[ids3[0]] == 600);
}

TEST_CASE("engine: media rows are computed by submit on the submitting thread, never on the engine thread") {
  // The processors and towers run before the request is queued, so an image
  // never stalls the decode steps of the sequences already running. Proof:
  // the engine thread is held inside a callback of a decoding text stream
  // while another thread submits an image request; submit returns with the
  // media encoded (stats) although the engine thread has not moved.
  auto mm = phi4mm::init_phi4mm("tiny", 11, DType::f32);
  Engine e(mm, tokenizer(), opts(3, 16));
  e.start();
  std::mutex mu;
  std::condition_variable cv;
  bool held = false, release = false;
  std::vector<int64_t> text_tokens;
  bool text_done = false;
  const std::vector<int64_t> text_prompt = ids_of("<|user|>Tell me a story.<|end|><|assistant|>");
  Request tr;
  tr.prompt = text_prompt;
  tr.params.max_tokens = 12;
  tr.params.temperature = 0;
  tr.params.ignore_eos = true;
  e.submit(tr, [&](const RequestOutput& o) {
    std::unique_lock<std::mutex> lk(mu);
    text_tokens.insert(text_tokens.end(), o.tokens.begin(), o.tokens.end());
    text_done |= o.done;
    if (!o.tokens.empty() && !held) {  // hold the engine thread here once
      held = true;
      cv.notify_all();
      cv.wait(lk, [&] { return release; });
    }
  });
  {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return held; });
  }
  const int64_t steps_before = e.stats().steps;
  const phi4mm::RgbImage im = pattern_image(60, 40, 3);
  Request ir;
  ir.prompt = ids_of("<|user|>");
  ir.prompt.insert(ir.prompt.end(), size_t(phi4mm::num_image_tokens(im.width, im.height)), phi4mm::kImageToken);
  for (int64_t id : ids_of("What is this?<|end|><|assistant|>")) ir.prompt.push_back(id);
  ir.adapter = Adapter::vision;
  ir.media = {phi4mm::Media::of_image(im)};
  ir.params.max_tokens = 5;
  ir.params.temperature = 0;
  ir.params.ignore_eos = true;
  std::vector<int64_t> media_tokens;
  bool media_done = false;
  std::thread client([&] {
    e.submit(ir, [&](const RequestOutput& o) {
      std::lock_guard<std::mutex> lk(mu);
      media_tokens.insert(media_tokens.end(), o.tokens.begin(), o.tokens.end());
      media_done |= o.done;
    });
  });
  client.join();  // returns while the engine thread is still held
  const EngineStats mid = e.stats();
  CHECK(mid.media_items_total == 1);
  CHECK(mid.media_seconds_total > 0);
  CHECK(mid.steps == steps_before);  // the engine has not stepped since
  {
    std::lock_guard<std::mutex> lk(mu);
    release = true;
  }
  cv.notify_all();
  e.stop(true);
  CHECK(text_done);
  CHECK(media_done);
  // Same tokens as each request alone.
  Engine solo(mm, tokenizer(), opts(3, 16));
  CHECK(text_tokens == generate(solo, {tr})[0][0].tokens);
  CHECK(media_tokens == generate(solo, {ir})[0][0].tokens);

  // Refusals at submit, before anything is queued.
  Engine f(tiny_model(), tokenizer(), opts(3, 16));  // no towers
  CHECK_THROWS_WITH_AS(f.submit(ir, [](const RequestOutput&) {}),
                       doctest::Contains("media encoding failed: this model has no vision tower"), std::runtime_error);
  Request wrong = ir;
  wrong.media.clear();
  wrong.media_rows = zeros({1, 32});
  CHECK_THROWS_WITH_AS(f.submit(wrong, [](const RequestOutput&) {}), doctest::Contains("do not match the prompt's"),
                       std::invalid_argument);
  Request both = ir;
  both.media_rows = zeros({1, 32});
  CHECK_THROWS_WITH_AS(f.submit(both, [](const RequestOutput&) {}), doctest::Contains("not both"),
                       std::invalid_argument);
  Request none = ir;
  none.media.clear();
  CHECK_THROWS_WITH_AS(f.submit(none, [](const RequestOutput&) {}), doctest::Contains("no media were given"),
                       std::invalid_argument);
  CHECK(f.stats().kv_blocks_used == 0);
  CHECK(f.stats().media_items_total == 0);
}

TEST_CASE("engine: a non-finite logit fails only its request, with a numerical-fault error and no token") {
  const auto cases = mixed_cases();
  const Case* with_media = nullptr;
  for (const auto& c : cases)
    if (c.n_media() > 0) with_media = &c;
  REQUIRE(with_media != nullptr);
  const Case& text = cases[0];
  REQUIRE(text.n_media() == 0);
  for (bool prompt_logprobs : {false, true}) {
    CAPTURE(prompt_logprobs);
    Engine e(tiny_model(), tokenizer(), opts(3, 16));
    // The media rows of one request hold a NaN: its logits are NaN from there on.
    Request bad = make_request(*with_media, 5);
    bad.media_rows = bad.media_rows.clone();
    static_cast<float*>(bad.media_rows.data_ptr())[3] = std::numeric_limits<float>::quiet_NaN();
    bad.params.logprobs = 2;
    if (prompt_logprobs) bad.params.prompt_logprobs = 1;
    std::vector<int64_t> good_tokens, bad_tokens;
    std::string bad_error, good_error;
    bool bad_done = false, good_done = false, bad_prompt_lps = false;
    e.submit(make_request(text, 8), [&](const RequestOutput& o) {
      good_tokens.insert(good_tokens.end(), o.tokens.begin(), o.tokens.end());
      good_error += o.error;
      good_done |= o.done;
    });
    e.submit(bad, [&](const RequestOutput& o) {
      bad_tokens.insert(bad_tokens.end(), o.tokens.begin(), o.tokens.end());
      bad_prompt_lps |= !o.prompt_logprobs.empty();
      bad_error += o.error;
      bad_done |= o.done;
    });
    e.run_until_idle();
    CHECK(good_done);
    CHECK(good_error.empty());
    CHECK(good_tokens == reference_greedy(text, 8));  // the batch went on
    CHECK(bad_done);
    CHECK(bad_tokens.empty());
    CHECK_FALSE(bad_prompt_lps);
    CHECK(bad_error.find("numerical fault") != std::string::npos);
    CHECK(bad_error.find("non-finite logit") != std::string::npos);
    const EngineStats st = e.stats();
    CHECK(st.numerical_faults == 1);
    CHECK(st.requests_failed == 1);
    CHECK(st.kv_blocks_used == 0);
  }
}

// A constraint that gives up after `after` tokens (what a grammar's
// consistency error would do mid-output).
struct FailingConstraint final : OutputConstraint {
  int64_t after;
  explicit FailingConstraint(int64_t a) : after(a) {}
  void mask(std::span<const int64_t> generated, int64_t, float*, int64_t) const override {
    if (int64_t(generated.size()) >= after) throw std::logic_error("grammar: the output is not a prefix of the language");
  }
  int64_t min_tokens() const override { return 1; }
  int64_t completion_length(std::span<const int64_t>) const override { return 1; }
};

TEST_CASE("engine: an output callback that throws stops only its request; the engine frees its blocks and goes on") {
  const auto cases = mixed_cases();
  const Case& text = cases[0];
  Engine e(tiny_model(), tokenizer(), opts(3, 16));
  int64_t thrown = 0;
  std::vector<int64_t> other_tokens;
  std::string other_error;
  bool other_done = false;
  Request bad = make_request(text, 8);
  bad.params.n = 2;
  // Throws at every output with a token and again when told it stopped.
  e.submit(bad, [&](const RequestOutput& r) {
    if (r.tokens.empty() && r.error.empty()) return;
    ++thrown;
    throw std::runtime_error("client gone");
  });
  e.submit(make_request(text, 8), [&](const RequestOutput& r) {
    other_tokens.insert(other_tokens.end(), r.tokens.begin(), r.tokens.end());
    other_error += r.error;
    other_done |= r.done;
  });
  for (int guard = 0; e.step(); ++guard) {
    REQUIRE(guard < 100);
    REQUIRE(e.audit().empty());
  }
  CHECK(thrown >= 2);
  CHECK(other_done);  // decoded in the same steps, untouched
  CHECK(other_error.empty());
  CHECK(other_tokens == reference_greedy(text, 8));
  EngineStats st = e.stats();
  CHECK(st.requests_failed == 1);
  CHECK(st.requests_finished == 1);
  CHECK(st.kv_blocks_used == 0);
  CHECK(st.running == 0);
  // The engine goes on.
  std::vector<int64_t> tokens;
  e.submit(make_request(text, 8), [&](const RequestOutput& r) { tokens.insert(tokens.end(), r.tokens.begin(), r.tokens.end()); });
  e.run_until_idle();
  CHECK(tokens == reference_greedy(text, 8));
}

TEST_CASE("engine: a sampling error fails only its request (no exception leaves the engine), speculative or not") {
  const auto cases = mixed_cases();
  const Case& text = cases[0];
  for (int64_t speculative : {int64_t(0), int64_t(3)}) {
    CAPTURE(speculative);
    EngineOptions o = opts(3, 16);
    o.speculative_tokens = speculative;
    Engine e(tiny_model(), tokenizer(), o);
    Request bad = make_request(text, 8);
    bad.params.grammar = std::make_shared<FailingConstraint>(3);
    bad.params.n = 2;
    std::vector<int64_t> good_tokens, bad_tokens;
    std::string bad_error, good_error;
    bool bad_done = false, good_done = false;
    e.submit(make_request(text, 8), [&](const RequestOutput& r) {
      good_tokens.insert(good_tokens.end(), r.tokens.begin(), r.tokens.end());
      good_error += r.error;
      good_done |= r.done;
    });
    e.submit(bad, [&](const RequestOutput& r) {
      bad_tokens.insert(bad_tokens.end(), r.tokens.begin(), r.tokens.end());
      bad_error += r.error;
      bad_done |= r.done;
    });
    e.run_until_idle();
    CHECK(good_done);
    CHECK(good_error.empty());
    CHECK(good_tokens == reference_greedy(text, 8));
    CHECK(bad_done);
    // At most 3 tokens from each of the 2 samples (the fourth pick throws and
    // ends the request); in lockstep without speculation, exactly those.
    if (speculative == 0) CHECK(bad_tokens.size() == 6);
    else CHECK((bad_tokens.size() >= 3 && bad_tokens.size() <= 6));
    CHECK(bad_error.find("engine error: sampling failed: grammar: the output is not a prefix") != std::string::npos);
    const EngineStats st = e.stats();
    CHECK(st.requests_failed == 1);
    CHECK(st.kv_blocks_used == 0);
  }
}
