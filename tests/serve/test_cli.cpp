// `areno serve`, `areno generate` and `areno score` argument handling, and
// remote media fetching against a local HTTP server.
#include <doctest/doctest.h>
#include <httplib.h>

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <unordered_map>
#include <omp.h>
#include <unistd.h>
#include <thread>

#include "app/commands_model.h"
#include "app/commands_serve.h"
#include "app/flags.h"
#include "models/phi4mm/demo/demo.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/cfg.h"
#include "serve/media_fetch.h"
#include "serve/openai.h"
#include "serve/sampler.h"
#include "tests/serve/grammar_tokens.h"
#include "tests/test_util.h"

using namespace areno;
using areno::testing::error_of;

TEST_CASE("serve/cli bad flags and values name the flag") {
  CHECK(app::cmd_serve({"--bogus"}) == 2);
  CHECK(error_of([] { app::cmd_serve({"--port", "eighty"}); }).find("--port") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--port", "70000"}); }).find("--port") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--tp-size", "2"}); }).find("tensor parallelism") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--world-size", "4"}); }).find("--world-size") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--kv-cache-gb", "-1"}); }).find("--kv-cache-gb") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--max-running-prompts", "0"}); }).find("--max-running-prompts") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--media-root", "/no/such/dir"}); }).find("--media-root") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--api-key"}); }).find("--api-key needs a value") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--dtype", "f16"}); }).find("--dtype") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--device", "tpu"}); }).find("--device") != std::string::npos);
  for (const char* bad : {"sql", "sql=", "=dir", "a b=dir", "x*=dir", "{\"name\": \"a\"}", "{\"name\": \"a b\", \"path\": \"x\"}", "{bad"})
    CHECK_MESSAGE(error_of([&] { app::cmd_serve({"--lora-modules", bad}); }).find("--lora-modules") != std::string::npos, bad);
  CHECK(error_of([] { app::cmd_serve({"--lora-modules", "a=x", "--lora-modules", "a=y"}); }).find("'a' is given twice") !=
        std::string::npos);
  // Checked at load (the demo model), naming the folder or the clash.
  CHECK(error_of([] { app::cmd_serve({"--lora-modules", "a=/no/such/adapter"}); }).find("/no/such/adapter") !=
        std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--lora-modules", R"({"name": "a", "path": "/no/such/adapter"})"}); })
            .find("/no/such/adapter") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--lora-modules", "areno-demo=/no/such/adapter"}); })
            .find("'areno-demo' is the served model's own name") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--lora-root", "/no/such/dir"}); }).find("--lora-root") != std::string::npos);
  for (const char* bad : {"{}", "[4]", "{bad", R"({"dynamic_hd": 0})", R"({"dynamic_hd": 65})", R"({"dynamic_hd": "4"})",
                          R"({"dynamic_hd": 4, "num_crops": 2})"}) {
    const std::string e = error_of([&] { app::cmd_serve({"--mm-processor-kwargs", bad}); });
    CHECK_MESSAGE(e.find("--mm-processor-kwargs") != std::string::npos, bad, ": ", e);
  }
  for (const char* bad : {"-1", "1e8", "lots"}) {
    const std::string e = error_of([&] { app::cmd_serve({"--responses-store-mb", bad}); });
    CHECK_MESSAGE(e.find("--responses-store-mb") != std::string::npos, bad, ": ", e);
  }
  CHECK(error_of([] { app::cmd_serve({"--responses-store-dir", "/proc/version"}); })
            .find("--responses-store-dir: '/proc/version' is not a folder") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--responses-store-dir", "/no/such/parent/store"}); })
            .find("its parent is no folder") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--responses-store-mb", "0", "--responses-store-dir", "/tmp"}); })
            .find("--responses-store-dir: needs a store") != std::string::npos);
  CHECK(app::cmd_batch({"-i", "x", "-o", "y", "--access-log"}) == 2);  // a listener flag: serve only
  CHECK(error_of([] { app::cmd_serve({"--lora-resolve"}); }).find("--lora-resolve: needs --lora-root") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--max-loras", "-1"}); }).find("--max-loras") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--max-loras", "1", "--lora-modules", "a=x", "--lora-modules", "b=y"}); })
            .find("2 adapters, above --max-loras 1") != std::string::npos);
  // Several after one flag (vLLM's nargs='+'), up to the next flag: three here.
  CHECK(error_of([] { app::cmd_serve({"--lora-modules", "a=x", "b=y", R"({"name": "c", "path": "z"})", "--max-loras", "2"}); })
            .find("3 adapters, above --max-loras 2") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--lora-modules", "a=x", "a=y"}); }).find("'a' is given twice") != std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--lora-modules", "a=x", "oops"}); }).find("expected NAME=DIR, got 'oops'") !=
        std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--lora-modules"}); }).find("--lora-modules needs a value") != std::string::npos);
  CHECK(app::cmd_serve({"--help"}) == 0);

  CHECK(app::cmd_generate({"--max-tokens", "3"}) == 2);  // no --prompt
  CHECK(app::cmd_generate({"--prompt", "x", "--nope"}) == 2);
  CHECK(error_of([] { app::cmd_generate({"--prompt", "x", "--temperature", "hot"}); }).find("--temperature") !=
        std::string::npos);
  CHECK(error_of([] { app::cmd_generate({"--prompt", "x", "--image", "/no/such.png"}); }).find("--image") !=
        std::string::npos);
  CHECK(app::cmd_score({"--prompt", "x"}) == 2);  // no --completion
}

TEST_CASE("cli --threads: the compute threads of the command, default the physical cores or OMP_NUM_THREADS") {
  const int saved = omp_get_max_threads();
  const int cores = app::physical_cores();
  CHECK(cores >= 1);
  CHECK(cores <= omp_get_num_procs());
  CHECK(app::cmd_score({"--prompt", "Hello", "--completion", "hi", "--threads", "1"}) == 0);
  CHECK(omp_get_max_threads() == 1);
  app::apply_threads(3);
  CHECK(omp_get_max_threads() == 3);
  const char* env = std::getenv("OMP_NUM_THREADS");
  app::apply_threads(0);  // the default: the environment's when set (OpenMP read it at start), else the cores
  if (env == nullptr || *env == '\0') CHECK(omp_get_max_threads() == cores);
  CHECK(error_of([] { app::cmd_score({"--prompt", "x", "--completion", "y", "--threads", "0"}); }).find("--threads") !=
        std::string::npos);
  CHECK(error_of([] { app::cmd_serve({"--http-threads", "0"}); }).find("--http-threads") != std::string::npos);
  omp_set_num_threads(saved);
}

TEST_CASE("serve/cli generate and score run on the embedded demo model") {
  CHECK(app::cmd_generate({"--prompt", "Hello", "--max-tokens", "3", "--temperature", "1", "--seed", "5"}) == 0);
  // Speculative decoding leaves the answer as it is (ids and logprobs), on a
  // random tiny checkpoint (the demo model answers in two tokens; greedy
  // random weights run on and repeat themselves).
  testing::TempDir dir;
  REQUIRE(app::cmd_init({"--preset", "tiny", "--out", dir.str("tiny"), "--seed", "3", "--dtype", "f32"}) == 0);
  const std::vector<std::string> args = {"--model-path", dir.str("tiny"), "--prompt", "one two one two one two",
                                         "--no-chat-template", "--max-tokens", "24", "--print-ids"};
  std::vector<std::string> spec = args;
  spec.insert(spec.end(), {"--speculative-tokens", "4"});
  const std::string plain_out = testing::captured_stdout([&] { CHECK(app::cmd_generate(args) == 0); });
  const std::string spec_out = testing::captured_stdout([&] { CHECK(app::cmd_generate(spec) == 0); });
  const auto a = nlohmann::json::parse(plain_out), b = nlohmann::json::parse(spec_out);
  CHECK(a["ids"].size() == 24);
  CHECK(a["ids"] == b["ids"]);
  REQUIRE(a["logprobs"].size() == b["logprobs"].size());
  for (size_t i = 0; i < a["logprobs"].size(); ++i)
    CHECK(a["logprobs"][i].get<double>() == doctest::Approx(b["logprobs"][i].get<double>()).epsilon(1e-4));
  CHECK(app::cmd_score({"--prompt", "Hello", "--completion", "hello world"}) == 0);
}

TEST_CASE("serve/cli generate --grammar-file / --json-schema: the answer follows them; errors name the flag and file") {
  testing::TempDir dir;
  const std::string grammar = "root ::= \"(\" word (\",\" word){0,2} \")\"\nword ::= [a-z]+\n";
  {
    std::ofstream(dir.str("list.gbnf")) << grammar;
  }
  const auto cfg = serve::Cfg::compile(serve::testing::bytes(), grammar);
  for (const char* temperature : {"0", "1"}) {
    CAPTURE(temperature);
    const std::string out = testing::captured_stdout([&] {
      CHECK(app::cmd_generate({"--prompt", "List", "--max-tokens", "12", "--temperature", temperature, "--seed", "4",
                               "--grammar-file", dir.str("list.gbnf"), "--print-ids"}) == 0);
    });
    const auto j = nlohmann::json::parse(out);
    const std::string text = j["text"];
    CAPTURE(text);
    CHECK(cfg->matches(text));
    CHECK(j["finish_reason"] == "stop");
  }
  const std::string out = testing::captured_stdout([&] {
    CHECK(app::cmd_generate({"--prompt", "Hi", "--max-tokens", "30", "--temperature", "1", "--print-ids", "--json-schema",
                             R"({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}, "required": ["n"]})"}) == 0);
  });
  const auto v = nlohmann::json::parse(nlohmann::json::parse(out)["text"].get<std::string>());
  CHECK(v["n"].get<int64_t>() % 5 == 0);
  {
    std::ofstream(dir.str("bad.gbnf")) << "root ::= x";
  }
  CHECK(error_of([&] { app::cmd_generate({"--prompt", "x", "--grammar-file", dir.str("bad.gbnf")}); }) ==
        "--grammar-file " + dir.str("bad.gbnf") + ": the rule 'x' is used but never defined (at byte 9)");
  CHECK(error_of([&] { app::cmd_generate({"--prompt", "x", "--grammar-file", dir.str("none.gbnf")}); }).find("cannot read") !=
        std::string::npos);
  CHECK(error_of([] { app::cmd_generate({"--prompt", "x", "--json-schema", "{\"type\": \"array\"}"}); }).find("--json-schema: ") == 0);
  CHECK(error_of([&] { app::cmd_generate({"--prompt", "x", "--max-tokens", "2", "--grammar-file", dir.str("list.gbnf")}); })
            .find("--max-tokens is 2, but the shortest answer --grammar-file") == 0);
  CHECK(error_of([&] {
          app::cmd_generate({"--prompt", "x", "--grammar-file", dir.str("list.gbnf"), "--json-schema", "{}"});
        }).find("both constrain") != std::string::npos);
}

TEST_CASE("serve/media_fetch remote URLs with --allow-remote-media: bytes, size limit, HTTP errors") {
  // A loopback test server: reachable only with --allow-private-media too
  // (test_media_hardening.cpp checks the refusals).
  httplib::Server srv;
  srv.Get("/a.bin", [](const httplib::Request&, httplib::Response& r) { r.set_content("abcdef", "image/png"); });
  const int port = srv.bind_to_any_port("127.0.0.1");
  std::thread th([&] { srv.listen_after_bind(); });
  const std::string base = "http://127.0.0.1:" + std::to_string(port);
  auto part = [](const std::string& url) { return nlohmann::json{{"type", "image_url"}, {"image_url", {{"url", url}}}}; };

  serve::MediaFetchOptions o;
  o.timeout_seconds = 5;
  auto fetch = [&](const std::string& path) {
    return phi4mm::read_media_part(part(base + path), phi4mm::MediaKind::kImage, "m", serve::media_source(o));
  };
  CHECK_THROWS_AS(fetch("/a.bin"), phi4mm::ProcessorError);
  o.allow_remote = true;
  o.allow_private = true;
  auto bytes = fetch("/a.bin");
  CHECK(std::string(bytes.begin(), bytes.end()) == "abcdef");
  // Every failure gives the client one text; the reason is in the server log.
  CHECK(error_of([&] { fetch("/missing"); }) == std::string("m.image_url.url: ") + serve::kMediaFetchFailed);
  o.max_bytes = 3;
  CHECK(error_of([&] { fetch("/a.bin"); }) == std::string("m.image_url.url: ") + serve::kMediaFetchFailed);
  srv.stop();
  th.join();
}

// pick_token's passes over the 200064 logits (8 lanes at a time,
// serve/sampler.cpp): greedy takes the first of tied maxima; a draw never lands on a -inf or banned id whatever u is; the
// draw's frequencies follow softmax(l / T) over a few finite logits; its
// log-probability is log_softmax of the raw row (f64 reference).
TEST_CASE("sampler: greedy ties to the lowest id, draws only finite ids at the softmax's frequencies") {
  using namespace serve;
  const int64_t V = 200064;
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> row(static_cast<size_t>(V), ninf);
  std::vector<int64_t> toks = {1};
  std::unordered_map<int64_t, int64_t> counts;
  const int64_t stop[] = {phi4mm::kEnd};
  SamplingParams greedy;
  greedy.temperature = 0;
  for (int64_t first : {int64_t(3), int64_t(13), int64_t(170001)}) {
    std::fill(row.begin(), row.end(), 0.5f);
    row[size_t(first)] = 2.0f;
    row[size_t(180000)] = 2.0f;
    CHECK(pick_token(greedy, {toks, &counts, 0, 0, 1}, row.data(), V, stop).token == first);
  }
  // Finite logits at 4 ids; a banned id (a media placeholder) with the
  // largest logit is never drawn.
  std::fill(row.begin(), row.end(), ninf);
  const std::vector<int64_t> ids = {7, 1000, 150000, V - 40};
  const std::vector<float> logit = {0.0f, 1.0f, 2.0f, 0.5f};
  for (size_t k = 0; k < ids.size(); ++k) row[size_t(ids[k])] = logit[k];
  row[size_t(phi4mm::kImageTokenId)] = 50.0f;
  SamplingParams p;
  p.temperature = 0.7;
  p.logprobs = 0;
  std::map<int64_t, int> seen;
  const int draws = 4000;
  for (int i = 0; i < draws; ++i) {
    p.seed = uint64_t(i);
    const Picked got = pick_token(p, {toks, &counts, 0, 0, uint64_t(i)}, row.data(), V, stop);
    ++seen[got.token];
    REQUIRE(got.logprob.has_value());
    // The raw row's log-softmax (the banned id's 50 included, as the model gave it).
    double z = 0;
    for (size_t k = 0; k < ids.size(); ++k) z += std::exp(double(logit[k]) - 50.0);
    z = 50.0 + std::log(z + 1.0);
    CHECK(std::fabs(double(got.logprob->logprob) - (double(row[size_t(got.token)]) - z)) < 1e-5);
  }
  double norm = 0;
  for (float l : logit) norm += std::exp(double(l) / 0.7);
  int total = 0;
  for (size_t k = 0; k < ids.size(); ++k) {
    CAPTURE(ids[k]);
    const double want = std::exp(double(logit[k]) / 0.7) / norm;
    CHECK(std::fabs(double(seen[ids[k]]) / draws - want) < 4 * std::sqrt(want * (1 - want) / draws) + 1e-3);
    total += seen[ids[k]];
  }
  CHECK(total == draws);  // nothing else, the banned id neither
}

TEST_CASE("sampler: one bounds table read by the HTTP parser, the CLI flags and the engine") {
  using serve::SamplingParams;
  struct Row {
    const serve::Bound& bound;
    double SamplingParams::*field;
    const char* flag;  // the CLI flag, when generate has one
  };
  const std::vector<Row> table = {
      {serve::bounds::temperature, &SamplingParams::temperature, "--temperature"},
      {serve::bounds::top_p, &SamplingParams::top_p, "--top-p"},
      {serve::bounds::min_p, &SamplingParams::min_p, nullptr},
      {serve::bounds::presence_penalty, &SamplingParams::presence_penalty, nullptr},
      {serve::bounds::frequency_penalty, &SamplingParams::frequency_penalty, nullptr},
      {serve::bounds::repetition_penalty, &SamplingParams::repetition_penalty, nullptr},
  };
  const nlohmann::json messages = nlohmann::json::array({{{"role", "user"}, {"content", "hi"}}});
  for (const Row& r : table) {
    const serve::Bound& b = r.bound;
    CAPTURE(b.name);
    for (double x : {b.lo - 0.25, b.lo, b.lo + 1e-3, (b.lo + b.hi) / 2, b.hi, b.hi + 1e-3, b.hi + 3}) {
      CAPTURE(x);
      const bool want = b.lo_open ? x > b.lo && x <= b.hi : x >= b.lo && x <= b.hi;
      CHECK(b.contains(x) == want);
      // HTTP: the request parser.
      bool http_ok = true;
      try {
        serve::parse_chat_request({{"messages", messages}, {b.name, x}}, {});
      } catch (const serve::ApiError& e) {
        http_ok = false;
        CHECK(e.status == 400);
        CHECK(e.param == b.name);
        CHECK(std::string(e.what()).find(b.range()) != std::string::npos);
      }
      CHECK(http_ok == want);
      // The engine's validation (what Engine::submit runs).
      SamplingParams p;
      p.*r.field = x;
      bool engine_ok = true;
      try {
        serve::validate(p, 1000);
      } catch (const std::invalid_argument& e) {
        engine_ok = false;
        CHECK(std::string(e.what()).find(b.name) == 0);
      }
      CHECK(engine_ok == want);
      // The CLI flag.
      if (r.flag) {
        bool cli_ok = true;
        try {
          app::parse_bounded_flag(r.flag, fmt::format("{}", x), b);
        } catch (const std::invalid_argument& e) {
          cli_ok = false;
          CHECK(std::string(e.what()).find(b.range()) != std::string::npos);
        }
        CHECK(cli_ok == want);
      }
    }
  }
  // NaN is outside every range.
  for (const Row& r : table) CHECK_FALSE(r.bound.contains(std::numeric_limits<double>::quiet_NaN()));
  CHECK(error_of([] { app::cmd_generate({"--prompt", "x", "--temperature", "2.5"}); }).find("[0, 2]") !=
        std::string::npos);
}

TEST_CASE("serve/cli generate --print-ids: ids and raw logprobs as JSON, equal to scoring the same tokens") {
  const std::string out = testing::captured_stdout([] {
    REQUIRE(app::cmd_generate({"--prompt", "Hello there", "--max-tokens", "5", "--print-ids"}) == 0);
  });
  const nlohmann::json j = nlohmann::json::parse(out);
  const std::vector<int64_t> prompt_ids = j["prompt_ids"].get<std::vector<int64_t>>();
  const std::vector<int64_t> ids = j["ids"].get<std::vector<int64_t>>();
  const std::vector<float> lps = j["logprobs"].get<std::vector<float>>();
  REQUIRE(!ids.empty());
  CHECK(ids.size() <= 5);
  CHECK(lps.size() == ids.size());
  CHECK(j["finish_reason"].is_string());
  // The demo model and tokenizer, as the command loads them.
  auto m = phi4mm::demo_model();
  auto t = phi4mm::make_tokenizer();
  t.set_padded_vocab_size(size_t(m->config().text.vocab_size));
  CHECK(prompt_ids.back() == phi4mm::kAssistant);
  std::vector<tok::TokenId> tid(ids.begin(), ids.end());
  CHECK(j["text"] == t.decode(tid, true));
  const std::vector<float> scored = phi4mm::score(*m, prompt_ids, ids);
  REQUIRE(scored.size() == lps.size());
  for (size_t i = 0; i < lps.size(); ++i) CHECK(std::abs(scored[i] - lps[i]) < 1e-5);
  // Greedy: a second run prints the same object.
  CHECK(testing::captured_stdout([] { app::cmd_generate({"--prompt", "Hello there", "--max-tokens", "5", "--print-ids"}); }) == out);
}

TEST_CASE("serve/cli batch: an OpenAI batch file through the server's routes, in order; bad lines stop before any request") {
  testing::TempDir dir;
  const std::string in = (dir.path / "in.jsonl").string(), out = (dir.path / "out.jsonl").string();
  auto write = [](const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; };
  auto line = [](const std::string& id, const std::string& url, const nlohmann::json& body) {
    return nlohmann::json{{"custom_id", id}, {"method", "POST"}, {"url", url}, {"body", body}}.dump() + "\n";
  };
  const nlohmann::json sum = {{"messages", {{{"role", "user"}, {"content", "What is 2 + 3?"}}}}, {"max_tokens", 8},
                              {"temperature", 0}};
  std::string text;
  // The demo model answers this sum (docs/demo.md); 12 copies keep several
  // requests in flight, and greedy answers do not depend on the batch.
  for (int i = 0; i < 12; ++i) text += line(fmt::format("sum-{}", i), "/v1/chat/completions", sum);
  text += "\n   \n";  // blank lines are skipped
  text += line("empty", "/v1/chat/completions", {{"messages", nlohmann::json::array()}});
  text += line("other-model", "/v1/chat/completions", {{"model", "nope"}, {"messages", sum["messages"]}});
  text += line("completion", "/v1/completions", {{"prompt", "What is 1 + 1?"}, {"max_tokens", 2}, {"temperature", 0}});
  text += line("response", "/v1/responses", {{"input", "What is 2 + 3?"}, {"max_output_tokens", 8}, {"temperature", 0}});
  write(in, text);
  REQUIRE(app::cmd_batch({"-i", in, "-o", out, "--max-concurrency", "4"}) == 0);
  std::ifstream f(out);
  std::vector<nlohmann::json> rows;
  for (std::string l; std::getline(f, l);) rows.push_back(nlohmann::json::parse(l));
  REQUIRE(rows.size() == 16);
  for (int i = 0; i < 12; ++i) {
    CAPTURE(i);
    const nlohmann::json& r = rows[size_t(i)];
    CHECK(r["custom_id"] == fmt::format("sum-{}", i));
    CHECK(r["id"].get<std::string>().rfind("batch_req_", 0) == 0);
    CHECK(r["error"].is_null());
    CHECK(r["response"]["status_code"] == 200);
    CHECK(r["response"]["request_id"] == r["response"]["body"]["id"]);
    CHECK(r["response"]["body"]["choices"][0]["message"]["content"] == "5");
  }
  CHECK(rows[12]["custom_id"] == "empty");
  CHECK(rows[12]["response"]["status_code"] == 400);
  CHECK(rows[12]["response"]["body"]["error"]["param"] == "messages");
  CHECK(rows[13]["response"]["status_code"] == 404);
  CHECK(rows[13]["response"]["body"]["error"]["code"] == "model_not_found");
  CHECK(rows[14]["response"]["status_code"] == 200);
  CHECK(rows[14]["response"]["body"]["object"] == "text_completion");
  CHECK(rows[15]["response"]["status_code"] == 200);
  CHECK(rows[15]["response"]["body"]["object"] == "response");
  CHECK(rows[15]["response"]["body"]["output"][0]["content"][0]["text"] == "5");

  // Bad files name the file, the line and the field; nothing is written.
  const std::string good = line("x", "/v1/completions", {{"prompt", "hi"}});
  const std::vector<std::pair<std::string, std::string>> bad = {
      {good + "{not json\n", "in.jsonl:2: "},
      {"[1, 2]\n", "in.jsonl:1: a line must be a JSON object"},
      {line("", "/v1/completions", {{"prompt", "hi"}}), "'custom_id' must be a non-empty string"},
      {good + good, "in.jsonl:2: 'custom_id' \"x\" is used by an earlier line"},
      {R"({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}})" "\n", "'method' must be \"POST\""},
      {line("a", "/v1/embeddings", {{"input", "hi"}}), "'url' must be"},
      {R"({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "hi"})" "\n", "'body' must be a JSON object"},
      {line("a", "/v1/completions", {{"prompt", "hi"}, {"stream", true}}), "'body.stream': a batch request cannot stream"},
      {"\n\n" + std::string(3 << 20, 'x') + "\n", "in.jsonl:3: the line is longer than"},
  };
  for (const auto& item : bad) {  // no structured binding: clang 14 cannot capture one
    const std::string& content = item.first;
    const std::string& says = item.second;
    CAPTURE(says);
    write(in, content);
    std::filesystem::remove(out);
    const std::string e = error_of([&] { app::cmd_batch({"-i", in, "-o", out, "--max-body-mb", "1"}); });
    CHECK_MESSAGE(e.find(says) != std::string::npos, e);
    CHECK_FALSE(std::filesystem::exists(out));
  }
  CHECK(error_of([&] { app::cmd_batch({"-o", out}); }).find("--input-file") != std::string::npos);
  CHECK(error_of([&] { app::cmd_batch({"-i", in}); }).find("--output-file") != std::string::npos);
  CHECK(error_of([&] { app::cmd_batch({"-i", (dir.path / "none.jsonl").string(), "-o", out}); }).find("cannot open") !=
        std::string::npos);
  write(in, good);
  CHECK(error_of([&] { app::cmd_batch({"-i", in, "-o", (dir.path / "no" / "out.jsonl").string()}); })
            .find("no/out.jsonl") != std::string::npos);
  CHECK(app::cmd_batch({"-i", in, "-o", out, "--port", "1"}) == 2);  // the listener's flags are serve's alone
}
