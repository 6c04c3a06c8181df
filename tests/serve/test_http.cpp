// Real HTTP against `areno serve`'s server on loopback ports (issue 7, must
// show 3-4): the embedded tiny demo model, an engine stepping in the
// background, httplib clients. Every error case checks the status and the
// OpenAI error body, then that a good request still succeeds.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

#include "models/phi4mm/init.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/cfg.h"
#include "serve/engine.h"
#include "serve/http_server.h"
#include "tests/serve/grammar_tokens.h"
#include "serve/request_context.h"
#include "tests/serve/http_fixture.h"
#include "tests/model/model_fixtures.h"
#include "serve/media_fetch.h"
#include "tensor/autograd.h"
#include "models/phi4mm/processor/chat_processor.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/processor/image_io.h"

using namespace areno;
using namespace areno::serve;
using areno::phi4mm::encode_base64;
using nlohmann::json;

namespace {

struct World {
  std::shared_ptr<phi4mm::Phi4MMForCausalLM> model;
  std::shared_ptr<const tok::Tokenizer> tokenizer;
  std::unique_ptr<Engine> engine;        // text-only model
  std::unique_ptr<Engine> media_engine;  // the same language model with both towers
  std::filesystem::path media_root;
  std::unique_ptr<Served> plain;   // text only, defaults
  std::unique_ptr<Served> strict;  // api key, small body limit, prompt limit, towers + media root

  World() {
    std::signal(SIGPIPE, SIG_IGN);
    model = phi4mm::init_model("tiny", 0);
    tokenizer = tokenizer_for(*model);
    EngineOptions eo;
    eo.max_running = 8;
    eo.kv_blocks = 256;
    eo.max_batch_tokens = 512;
    eo.prefill_chunk_tokens = 64;
    eo.prefix_caching = true;  // as areno serve runs
    eo.media_cache_bytes = size_t(64) << 20;
    engine = std::make_unique<Engine>(model, tokenizer, eo);
    engine->start();
    media_engine = std::make_unique<Engine>(phi4mm::init_phi4mm("tiny", 0), tokenizer, eo);
    media_engine->start();
    media_root = std::filesystem::temp_directory_path() / ("areno_serve_media_" + std::to_string(::getpid()));
    std::filesystem::create_directories(media_root);

    plain = std::make_unique<Served>(*engine, ServerOptions{});
    ServerOptions so;
    so.api_key = "sekret";
    so.max_body_bytes = 8192;
    so.max_prompt_tokens = 24;
    so.media.media_root = media_root.string();
    strict = std::make_unique<Served>(*media_engine, so);
  }
  ~World() {
    strict.reset();
    plain.reset();
    engine->stop(false);
    media_engine->stop(false);
    std::error_code ec;
    std::filesystem::remove_all(media_root, ec);
  }
};

World& world() {
  static World w;
  return w;
}

struct Reply {
  int status = 0;
  json body;
  std::string raw;
  std::string content_type;
};

Reply send(int port, const std::string& method, const std::string& path, const std::string& body,
           const httplib::Headers& headers = {}) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(60, 0);
  httplib::Result r = method == "GET" ? cli.Get(path, headers) : cli.Post(path, headers, body, "application/json");
  REQUIRE_MESSAGE(r, "request failed: " << httplib::to_string(r.error()));
  Reply out;
  out.status = r->status;
  out.raw = r->body;
  out.content_type = r->get_header_value("Content-Type");
  out.body = json::parse(r->body, nullptr, false);
  return out;
}
Reply post(int port, const std::string& path, const json& body, const httplib::Headers& headers = {}) {
  return send(port, "POST", path, body.dump(), headers);
}
Reply get(int port, const std::string& path, const httplib::Headers& headers = {}) {
  return send(port, "GET", path, "", headers);
}

const httplib::Headers kAuth = {{"Authorization", "Bearer sekret"}};

json hello_chat(json extra = json::object()) {
  json body = {{"model", "areno-demo"},
               {"messages", {{{"role", "user"}, {"content", "Hello there"}}}},
               {"max_tokens", 6},
               {"temperature", 0}};
  for (auto it = extra.begin(); it != extra.end(); ++it) body[it.key()] = it.value();
  return body;
}

// The status and OpenAI error body of a refused request.
void check_error(const Reply& r, int status, const std::string& message_part = {}, const std::string& param = {}) {
  CHECK(r.status == status);
  CAPTURE(r.raw);
  REQUIRE(r.body.is_object());
  REQUIRE(r.body.contains("error"));
  const json& e = r.body["error"];
  CHECK(e["message"].is_string());
  CHECK(e["type"].is_string());
  CHECK(e.contains("param"));
  CHECK(e.contains("code"));
  if (!message_part.empty()) CHECK(e["message"].get<std::string>().find(message_part) != std::string::npos);
  if (!param.empty()) CHECK(e["param"] == param);
}

// A good request on `port` still succeeds.
void check_serving(int port, const httplib::Headers& headers = {}) {
  Reply r = post(port, "/v1/chat/completions", hello_chat(), headers);
  CHECK(r.status == 200);
  CHECK(r.body["object"] == "chat.completion");
}

// The `data:` payloads of an SSE body, checking the framing.
std::vector<std::string> sse_payloads(const std::string& raw) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < raw.size()) {
    const size_t end = raw.find("\n\n", pos);
    REQUIRE_MESSAGE(end != std::string::npos, "unterminated event: " << raw.substr(pos));
    const std::string ev = raw.substr(pos, end - pos);
    pos = end + 2;
    if (ev.rfind(":", 0) == 0) continue;  // comment (keep-alive)
    REQUIRE_MESSAGE(ev.rfind("data: ", 0) == 0, "not a data event: " << ev);
    CHECK(ev.find('\n') == std::string::npos);
    out.push_back(ev.substr(6));
  }
  return out;
}

std::vector<uint8_t> tiny_bmp() {
  // 2x2, 24 bits, rows padded to 8 bytes, bottom-up.
  return {'B', 'M', 70, 0, 0, 0, 0, 0, 0, 0, 54, 0, 0, 0,                                   // file header
          40, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 1, 0, 24, 0, 0, 0, 0, 0, 16, 0, 0, 0,           // info header
          0x13, 0x0b, 0, 0, 0x13, 0x0b, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
          0, 0, 255, 0, 255, 0, 0, 0, 255, 0, 0, 255, 255, 255, 0, 0};                         // BGR rows
}

}  // namespace

TEST_CASE("serve/http chat, greedy, non-streaming: an OpenAI chat.completion, deterministic") {
  World& w = world();
  Reply a = post(w.plain->port, "/v1/chat/completions", hello_chat());
  REQUIRE(a.status == 200);
  CHECK(a.content_type.find("application/json") == 0);
  const json& j = a.body;
  CHECK(j["id"].get<std::string>().rfind("chatcmpl-", 0) == 0);
  CHECK(j["object"] == "chat.completion");
  CHECK(j["model"] == "areno-demo");
  CHECK(j["created"].is_number_integer());
  REQUIRE(j["choices"].size() == 1);
  CHECK(j["choices"][0]["index"] == 0);
  CHECK(j["choices"][0]["message"]["role"] == "assistant");
  CHECK(j["choices"][0]["message"]["content"].is_string());
  const std::string finish = j["choices"][0]["finish_reason"];
  CHECK((finish == "stop" || finish == "length"));
  // <|user|>Hello there<|end|><|assistant|>
  Reply tk = post(w.plain->port, "/tokenize", {{"messages", {{{"role", "user"}, {"content", "Hello there"}}}}});
  REQUIRE(tk.status == 200);
  CHECK(j["usage"]["prompt_tokens"] == tk.body["count"]);
  CHECK(j["usage"]["completion_tokens"].get<int64_t>() >= 1);
  CHECK(j["usage"]["total_tokens"] == j["usage"]["prompt_tokens"].get<int64_t>() + j["usage"]["completion_tokens"].get<int64_t>());

  Reply b = post(w.plain->port, "/v1/chat/completions", hello_chat());
  CHECK(b.body["choices"][0]["message"]["content"] == j["choices"][0]["message"]["content"]);

  // The same prompt ids through /v1/completions give the same greedy text.
  Reply c = post(w.plain->port, "/v1/completions",
                 {{"prompt", tk.body["tokens"]}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", false}});
  REQUIRE(c.status == 200);
  CHECK(c.body["object"] == "text_completion");
  CHECK(c.body["choices"][0]["text"] == j["choices"][0]["message"]["content"]);
  CHECK(c.body["usage"]["completion_tokens"] == j["usage"]["completion_tokens"]);
}

// Constrained decoding through the server (serve/grammar.h): the random tiny
// demo model never calls a tool by itself, yet `tool_choice` "required" or a
// named function makes every reply a call of an offered tool whose arguments
// parse as a JSON object, for greedy and sampled requests and any max_tokens
// from the shortest call up; `response_format` json_object makes the content
// a JSON object, and json_schema an instance of its schema, properties in
// the schema's order. A forced call's arguments follow the tool's
// `parameters` (none: {}). A max_tokens too small for the shortest output is
// a 400 naming max_tokens, an unsupported schema keyword a 400 naming the
// schema's field; "auto" stays free text until the model begins a call,
// which is then constrained as a forced one.
TEST_CASE("serve/http tool_choice required / a named function and response_format json_object / json_schema are enforced") {
  World& w = world();
  const json tools = json::array(
      {{{"type", "function"},
        {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}},
       {{"type", "function"}, {"function", {{"name", "add"}}}}});
  const json messages = {{{"role", "user"}, {"content", "What is 2 + 3?"}}};
  // The shortest call, in tokens as the grammar spells it (fewer than its 37 bytes).
  const int64_t fewest = OutputGrammar::tool_call(serve::testing::bytes(), {"add"})->min_tokens();
  CHECK(fewest < 37);
  int64_t shortest = 0;
  for (const json& choice : {json("required"), json{{"type", "function"}, {"function", {{"name", "add"}}}}}) {
    for (int64_t max_tokens : {fewest - 1, fewest, fewest + 8, int64_t(80)}) {
      for (double temperature : {0.0, 1.0}) {
        CAPTURE(choice.dump());
        CAPTURE(max_tokens);
        CAPTURE(temperature);
        Reply r = post(w.plain->port, "/v1/chat/completions",
                       {{"messages", messages}, {"tools", tools}, {"tool_choice", choice}, {"max_tokens", max_tokens},
                        {"temperature", temperature}, {"seed", 5}});
        if (r.status == 400) {  // below the shortest call: said so, naming max_tokens
          check_error(r, 400, "shortest output", "max_tokens");
          shortest = std::max(shortest, max_tokens + 1);
          continue;
        }
        REQUIRE(r.status == 200);
        const json& c = r.body["choices"][0];
        CAPTURE(c.dump());
        CHECK(c["finish_reason"] == "tool_calls");
        REQUIRE(c["message"]["tool_calls"].is_array());
        REQUIRE(c["message"]["tool_calls"].size() == 1);
        const json& f = c["message"]["tool_calls"][0]["function"];
        if (choice.is_object()) CHECK(f["name"] == "add");
        else CHECK((f["name"] == "add" || f["name"] == "get_weather"));
        const json args = json::parse(f["arguments"].get<std::string>());
        REQUIRE(args.is_object());
        if (f["name"] == "add") CHECK(args.empty());  // no parameters: no arguments
        for (auto it = args.begin(); it != args.end(); ++it) {  // get_weather: at most a string city
          CHECK(it.key() == "city");
          CHECK(it.value().is_string());
        }
        CHECK(r.body["usage"]["completion_tokens"].get<int64_t>() <= max_tokens);
      }
    }
  }
  CHECK(shortest == fewest);  // <|tool_call|>[{"name": "add", "arguments": {}}]<|/tool_call|><|end|> and no shorter
  // A JSON object as the content.
  for (double temperature : {0.0, 1.0}) {
    Reply r = post(w.plain->port, "/v1/chat/completions",
                   {{"messages", messages}, {"response_format", {{"type", "json_object"}}}, {"max_tokens", 24},
                    {"temperature", temperature}, {"seed", 9}});
    REQUIRE(r.status == 200);
    const json& c = r.body["choices"][0];
    CAPTURE(c.dump());
    CHECK(c["finish_reason"] == "stop");
    CHECK(json::parse(c["message"]["content"].get<std::string>()).is_object());
  }
  check_error(post(w.plain->port, "/v1/chat/completions",
                   {{"messages", messages}, {"response_format", {{"type", "json_object"}}}, {"max_tokens", 1}}),
              400, "shortest output", "max_tokens");
  // A JSON schema: properties in the written order (the raw body, not the
  // sorted parse), an enum, a bounded array of integers, a bounded string.
  const std::string schema_text =
      R"({"type": "object", "properties": {"zeta": {"enum": ["up", "down"]}, "alpha": {"type": "array", "items": {"type": "integer"},
          "minItems": 2, "maxItems": 3}, "name": {"type": "string", "maxLength": 5}}, "required": ["zeta", "alpha", "name"],
          "additionalProperties": false})";
  for (double temperature : {0.0, 1.0}) {
    const std::string raw = R"({"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 60, "seed": 4,
        "temperature": )" + fmt::format("{}", temperature) + R"(, "response_format": {"type": "json_schema",
        "json_schema": {"name": "answer", "strict": true, "schema": )" + schema_text + "}}}";
    Reply r = send(w.plain->port, "POST", "/v1/chat/completions", raw);
    REQUIRE(r.status == 200);
    const json& c = r.body["choices"][0];
    CAPTURE(c.dump());
    CHECK(c["finish_reason"] == "stop");
    const std::string content = c["message"]["content"].get<std::string>();
    const nlohmann::ordered_json v = nlohmann::ordered_json::parse(content);
    REQUIRE(v.size() == 3);
    CHECK(v.begin().key() == "zeta");
    CHECK((v["zeta"] == "up" || v["zeta"] == "down"));
    REQUIRE(v["alpha"].is_array());
    CHECK(v["alpha"].size() >= 2);
    CHECK(v["alpha"].size() <= 3);
    for (const auto& x : v["alpha"]) CHECK(x.is_number_integer());
    CHECK(v["name"].is_string());
  }
  // vLLM's fields on both endpoints: guided_choice on /v1/completions (the
  // text is one of the strings, also with max_tokens at the fewest tokens
  // that spell one of them and the end), guided_json as JSON text on chat.
  const int64_t label_tokens = OutputGrammar::choice(serve::testing::bytes(), {"positive", "negative", "neutral"})->min_tokens();
  CHECK(label_tokens < 9);  // the bytes of "negative" and the end
  check_error(post(w.plain->port, "/v1/completions",
                   {{"prompt", "x"}, {"max_tokens", label_tokens - 1}, {"guided_choice", {"positive", "negative", "neutral"}}}),
              400, "shortest output", "max_tokens");
  for (const auto& [max_tokens, temperature] : {std::pair{label_tokens, 0.0}, std::pair{label_tokens, 1.0},
                                                std::pair{int64_t(8), 0.0}, std::pair{int64_t(8), 1.0}}) {
    const auto& max_tokens_ = max_tokens;  // clang 14 cannot capture a structured binding
    CAPTURE(max_tokens_);
    Reply r = post(w.plain->port, "/v1/completions",
                   {{"prompt", "The answer is"}, {"max_tokens", max_tokens}, {"temperature", temperature}, {"seed", 3},
                    {"guided_choice", {"positive", "negative", "neutral"}}});
    REQUIRE(r.status == 200);
    const std::string t = r.body["choices"][0]["text"];
    CAPTURE(t);
    CHECK((t == "positive" || t == "negative" || t == "neutral"));
    CHECK(r.body["choices"][0]["finish_reason"] == "stop");
  }
  {
    Reply r = post(w.plain->port, "/v1/chat/completions",
                   {{"messages", messages}, {"max_tokens", 40}, {"temperature", 1.0}, {"seed", 8},
                    {"guided_json", R"({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})"}});
    REQUIRE(r.status == 200);
    const json v = json::parse(r.body["choices"][0]["message"]["content"].get<std::string>());
    CAPTURE(v.dump());
    CHECK(v.size() == 1);
    CHECK(v["ok"].is_boolean());
  }
  // guided_regex: the text matches whole, at its minimum max_tokens too; a
  // pattern outside the syntax is a 400 naming the field and the construct.
  const auto phone = Regex::compile("\\(\\d{3}\\) \\d{3}-\\d{4}");
  const int64_t phone_tokens = OutputGrammar::regex(serve::testing::bytes(), phone)->min_tokens();
  for (const auto& [max_tokens, temperature] : {std::pair{phone_tokens, 1.0}, std::pair{int64_t(30), 0.0}, std::pair{int64_t(30), 1.0}}) {
    const auto& max_tokens_ = max_tokens;  // clang 14 cannot capture a structured binding
    CAPTURE(max_tokens_);
    Reply r = post(w.plain->port, "/v1/completions",
                   {{"prompt", "Call"}, {"max_tokens", max_tokens}, {"temperature", temperature}, {"seed", 2},
                    {"guided_regex", "\\(\\d{3}\\) \\d{3}-\\d{4}"}});
    REQUIRE(r.status == 200);
    const std::string t = r.body["choices"][0]["text"];
    CAPTURE(t);
    CHECK(phone->matches(t));
    CHECK(r.body["choices"][0]["finish_reason"] == "stop");
  }
  check_error(post(w.plain->port, "/v1/completions", {{"prompt", "x"}, {"max_tokens", phone_tokens - 1}, {"guided_regex", "\\(\\d{3}\\) \\d{3}-\\d{4}"}}),
              400, "shortest output", "max_tokens");
  check_error(post(w.plain->port, "/v1/completions", {{"prompt", "x"}, {"guided_regex", "(?=a)b"}}), 400, "lookahead",
              "guided_regex");
  check_error(post(w.plain->port, "/v1/chat/completions", {{"messages", messages}, {"structured_outputs", {{"regex", "(a"}}}}),
              400, "missing ')'", "structured_outputs");
  // guided_grammar: a sentence of the grammar, at its minimum max_tokens
  // too; a grammar that does not compile is a 400 naming the field and the
  // byte.
  const std::string list = "root ::= \"[\" item (\", \" item){0,3} \"]\"\nitem ::= [a-z]+ | \"(\" item \")\"";
  const auto cfg = Cfg::compile(serve::testing::bytes(), list);
  for (const auto& [max_tokens, temperature] : {std::pair{cfg->min_tokens(), 1.0}, std::pair{int64_t(40), 1.0}}) {
    const auto& max_tokens_ = max_tokens;  // clang 14 cannot capture a structured binding
    CAPTURE(max_tokens_);
    Reply r = post(w.plain->port, "/v1/completions",
                   {{"prompt", "List"}, {"max_tokens", max_tokens}, {"temperature", temperature}, {"seed", 5},
                    {"guided_grammar", list}});
    REQUIRE(r.status == 200);
    const std::string t = r.body["choices"][0]["text"];
    CAPTURE(t);
    CHECK(cfg->matches(t));
    CHECK(r.body["choices"][0]["finish_reason"] == "stop");
  }
  check_error(post(w.plain->port, "/v1/completions", {{"prompt", "x"}, {"max_tokens", cfg->min_tokens() - 1}, {"guided_grammar", list}}),
              400, "shortest output", "max_tokens");
  {
    // llama.cpp's `grammar` and `json_schema` fields constrain the same way.
    Reply r = post(w.plain->port, "/v1/chat/completions",
                   {{"messages", messages}, {"max_tokens", 40}, {"temperature", 1.0}, {"seed", 9}, {"grammar", list}});
    REQUIRE(r.status == 200);
    const std::string t = r.body["choices"][0]["message"]["content"];
    CAPTURE(t);
    CHECK(cfg->matches(t));
    r = post(w.plain->port, "/v1/completions",
             {{"prompt", "x"}, {"max_tokens", 40}, {"temperature", 1.0}, {"seed", 9},
              {"json_schema", {{"type", "object"}, {"properties", {{"ok", {{"type", "boolean"}}}}}, {"required", {"ok"}}}}});
    REQUIRE(r.status == 200);
    const json v = json::parse(r.body["choices"][0]["text"].get<std::string>());
    CHECK(v.size() == 1);
    CHECK(v["ok"].is_boolean());
  }
  check_error(post(w.plain->port, "/v1/completions", {{"prompt", "x"}, {"guided_grammar", "root ::= x"}}), 400,
              "the rule 'x' is used but never defined (at byte 9)", "guided_grammar");
  check_error(post(w.plain->port, "/v1/chat/completions", {{"messages", messages}, {"structured_outputs", {{"grammar", "root: \"a\""}}}}),
              400, "expected '::='", "structured_outputs");
  check_error(post(w.plain->port, "/v1/chat/completions",
                   {{"messages", messages},
                    {"response_format",
                     {{"type", "json_schema"},
                      {"json_schema",
                       {{"name", "x"}, {"schema", {{"type", "object"}, {"properties", {{"p", {{"type", "string"}, {"format", "uri"}}}}}}}}}}}}),
              400, "'format'", "response_format.json_schema.schema");
  check_error(post(w.plain->port, "/v1/chat/completions",
                   {{"messages", messages}, {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "x"}, {"schema", {{"type", "object"}}}}}}},
                    {"max_tokens", 1}}),
              400, "shortest output", "max_tokens");
  check_error(post(w.plain->port, "/v1/chat/completions",
                   {{"messages", messages}, {"tools", tools}, {"tool_choice", "required"},
                    {"response_format", {{"type", "json_object"}}}}),
              400, "both constrain the output", "tool_choice");
  // "auto" leaves the random model to its text.
  Reply a = post(w.plain->port, "/v1/chat/completions",
                 {{"messages", messages}, {"tools", tools}, {"tool_choice", "auto"}, {"max_tokens", 8}, {"temperature", 0}});
  REQUIRE(a.status == 200);
  CHECK(a.body["choices"][0]["finish_reason"] != "tool_calls");
  // "auto" and a call the model begins (logit_bias on <|tool_call|>): the
  // rest is constrained, so the random model's call parses, names an
  // offered tool and has object arguments, greedy and sampled.
  for (double temperature : {0.0, 1.0}) {
    CAPTURE(temperature);
    Reply b = post(w.plain->port, "/v1/chat/completions",
                   {{"messages", messages}, {"tools", tools}, {"tool_choice", "auto"}, {"max_tokens", 80},
                    {"temperature", temperature}, {"seed", 3}, {"logit_bias", {{std::to_string(phi4mm::kToolCall), 100}}}});
    REQUIRE(b.status == 200);
    const json& c = b.body["choices"][0];
    CAPTURE(c.dump());
    CHECK(c["finish_reason"] == "tool_calls");
    REQUIRE(c["message"]["tool_calls"].size() == 1);
    const std::string name = c["message"]["tool_calls"][0]["function"]["name"];
    CHECK((name == "get_weather" || name == "add"));
    CHECK(json::parse(c["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()).is_object());
  }

  // Streamed: the call arrives as one tool_calls delta (never as content
  // text), then finish_reason tool_calls; the same call as the non-streamed
  // greedy reply. With "auto" the text streams as content, as without tools.
  const json forced = {{"messages", messages}, {"tools", tools}, {"max_tokens", 60}, {"temperature", 0},
                       {"tool_choice", {{"type", "function"}, {"function", {{"name", "add"}}}}}};
  Reply whole = post(w.plain->port, "/v1/chat/completions", forced);
  REQUIRE(whole.status == 200);
  json streamed = forced;
  streamed["stream"] = true;
  streamed["logprobs"] = true;
  const json streamed_auto = {{"messages", messages}, {"tools", tools}, {"max_tokens", 8}, {"temperature", 0}, {"stream", true}};
  for (const json& body : {streamed, streamed_auto}) {
    const bool is_forced = body.contains("tool_choice");
    CAPTURE(is_forced);
    Reply r = post(w.plain->port, "/v1/chat/completions", body);
    REQUIRE(r.status == 200);
    const auto events = sse_payloads(r.raw);
    REQUIRE(events.size() >= 3);
    CHECK(events.back() == "[DONE]");
    std::string content, finish;
    json calls = json::array();
    int64_t lp_tokens = 0;
    for (size_t i = 0; i + 1 < events.size(); ++i) {
      const json c = json::parse(events[i]);
      if (c["choices"].empty()) continue;
      const json& ch = c["choices"][0];
      if (ch["delta"].contains("content") && ch["delta"]["content"].is_string())
        content += ch["delta"]["content"].get<std::string>();
      if (ch["delta"].contains("tool_calls"))
        for (const json& t : ch["delta"]["tool_calls"]) calls.push_back(t);
      if (ch["logprobs"].is_object()) lp_tokens += int64_t(ch["logprobs"]["content"].size());
      if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
    }
    if (is_forced) {
      CHECK(content.empty());
      REQUIRE(calls.size() == 1);
      CHECK(calls[0]["index"] == 0);
      CHECK(calls[0]["type"] == "function");
      const json& want = whole.body["choices"][0]["message"]["tool_calls"][0]["function"];
      CHECK(calls[0]["function"]["name"] == "add");
      CHECK(calls[0]["function"]["arguments"] == want["arguments"]);
      CHECK(finish == "tool_calls");
      CHECK(lp_tokens == whole.body["usage"]["completion_tokens"].get<int64_t>());  // held, then sent with the call
    } else {
      CHECK(calls.empty());
      CHECK(content == a.body["choices"][0]["message"]["content"]);
      CHECK(finish == a.body["choices"][0]["finish_reason"]);
    }
  }
  check_serving(w.plain->port);
}

TEST_CASE("serve/http chat streaming: role chunk, deltas, finish chunk, usage chunk, [DONE]") {
  World& w = world();
  Reply ref = post(w.plain->port, "/v1/chat/completions", hello_chat({{"max_tokens", 12}, {"ignore_eos", true}}));
  REQUIRE(ref.status == 200);
  Reply s = post(w.plain->port, "/v1/chat/completions",
                 hello_chat({{"max_tokens", 12}, {"ignore_eos", true}, {"stream", true},
                             {"stream_options", {{"include_usage", true}}}, {"logprobs", true}, {"top_logprobs", 2}}));
  REQUIRE(s.status == 200);
  CHECK(s.content_type.find("text/event-stream") == 0);
  const auto events = sse_payloads(s.raw);
  REQUIRE(events.size() >= 4);
  CHECK(events.back() == "[DONE]");
  std::vector<json> chunks;
  for (size_t i = 0; i + 1 < events.size(); ++i) chunks.push_back(json::parse(events[i]));
  const std::string id = chunks[0]["id"];
  for (const json& c : chunks) {
    CHECK(c["id"] == id);
    CHECK(c["object"] == "chat.completion.chunk");
    CHECK(c["model"] == "areno-demo");
  }
  CHECK(chunks[0]["choices"][0]["delta"]["role"] == "assistant");
  std::string text;
  int64_t lp_tokens = 0;
  size_t finish_at = 0;
  for (size_t i = 1; i < chunks.size(); ++i) {
    if (chunks[i]["choices"].empty()) continue;
    const json& ch = chunks[i]["choices"][0];
    if (ch["delta"].contains("content")) text += ch["delta"]["content"].get<std::string>();
    if (ch["logprobs"].is_object()) {
      for (const json& e : ch["logprobs"]["content"]) {
        CHECK(e["top_logprobs"].size() == 2);
        ++lp_tokens;
      }
    }
    if (!ch["finish_reason"].is_null()) finish_at = i;
  }
  CHECK(text == ref.body["choices"][0]["message"]["content"]);
  REQUIRE(finish_at > 0);
  CHECK(chunks[finish_at]["choices"][0]["finish_reason"] == "length");
  const json& usage_chunk = chunks.back();
  CHECK(usage_chunk["choices"].empty());
  CHECK(usage_chunk["usage"]["completion_tokens"] == 12);
  CHECK(usage_chunk["usage"]["prompt_tokens"] == ref.body["usage"]["prompt_tokens"]);
  CHECK(lp_tokens == 12);
}

TEST_CASE("serve/http continue_final_message: the prompt ends inside the last message; echo puts it before the reply") {
  World& w = world();
  const json messages = {{{"role", "user"}, {"content", "Hello there"}}, {{"role", "assistant"}, {"content", "Well, "}}};
  const json body = {{"messages", messages}, {"add_generation_prompt", false}, {"continue_final_message", true},
                     {"max_tokens", 5}, {"temperature", 0}, {"ignore_eos", true}};
  // The prompt: the template's text cut after "Well, ", token for token.
  std::vector<int64_t> want;
  for (tok::TokenId t : w.tokenizer->encode("<|user|>Hello there<|end|><|assistant|>Well, ")) want.push_back(t);
  Reply tk = post(w.plain->port, "/tokenize", body);
  REQUIRE(tk.status == 200);
  CHECK(tk.body["tokens"].get<std::vector<int64_t>>() == want);
  // The same tokens through /v1/completions give the same continuation.
  Reply ref = post(w.plain->port, "/v1/completions",
                   {{"prompt", want}, {"max_tokens", 5}, {"temperature", 0}, {"ignore_eos", true}});
  REQUIRE(ref.status == 200);
  const std::string cont = ref.body["choices"][0]["text"];
  Reply r = post(w.plain->port, "/v1/chat/completions", body);
  REQUIRE(r.status == 200);
  CHECK(r.body["usage"]["prompt_tokens"] == want.size());
  CHECK(r.body["choices"][0]["message"]["content"] == cont);
  json echo = body;
  echo["echo"] = true;
  Reply e = post(w.plain->port, "/v1/chat/completions", echo);
  CHECK(e.body["choices"][0]["message"]["content"] == "Well, " + cont);
  echo["stream"] = true;
  Reply s = post(w.plain->port, "/v1/chat/completions", echo);
  std::string streamed;
  for (const std::string& ev : sse_payloads(s.raw)) {
    if (ev == "[DONE]") continue;
    const json c = json::parse(ev);
    if (!c["choices"].empty() && c["choices"][0]["delta"].contains("content"))
      streamed += c["choices"][0]["delta"]["content"].get<std::string>();
  }
  CHECK(streamed == "Well, " + cont);
  json both = body;
  both.erase("add_generation_prompt");
  check_error(post(w.plain->port, "/v1/chat/completions", both), 400, "cannot both be true", "continue_final_message");
  check_error(post(w.plain->port, "/tokenize", both), 400, "cannot both be true", "continue_final_message");
}

TEST_CASE("serve/http n > 1: choices share the prompt, usage counts it once, seeds reproduce") {
  World& w = world();
  json body = hello_chat({{"n", 3}, {"temperature", 1.0}, {"seed", 7}, {"max_tokens", 5}, {"ignore_eos", true}});
  Reply a = post(w.plain->port, "/v1/chat/completions", body);
  REQUIRE(a.status == 200);
  REQUIRE(a.body["choices"].size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(a.body["choices"][i]["index"] == i);
  Reply one = post(w.plain->port, "/v1/chat/completions", hello_chat());
  CHECK(a.body["usage"]["prompt_tokens"] == one.body["usage"]["prompt_tokens"]);
  CHECK(a.body["usage"]["completion_tokens"] == 15);
  Reply b = post(w.plain->port, "/v1/chat/completions", body);
  for (int i = 0; i < 3; ++i) CHECK(b.body["choices"][i]["message"]["content"] == a.body["choices"][i]["message"]["content"]);

  // Streaming n = 2: both indices get a role chunk and a finish chunk.
  Reply s = post(w.plain->port, "/v1/chat/completions",
                 hello_chat({{"n", 2}, {"stream", true}, {"max_tokens", 4}, {"ignore_eos", true}}));
  REQUIRE(s.status == 200);
  int roles[2] = {0, 0}, finishes[2] = {0, 0};
  for (const std::string& e : sse_payloads(s.raw)) {
    if (e == "[DONE]") continue;
    const json c = json::parse(e);
    for (const json& ch : c["choices"]) {
      const int idx = ch["index"];
      REQUIRE((idx == 0 || idx == 1));
      if (ch["delta"].contains("role")) ++roles[idx];
      if (!ch["finish_reason"].is_null()) ++finishes[idx];
    }
  }
  CHECK(roles[0] == 1);
  CHECK(roles[1] == 1);
  CHECK(finishes[0] == 1);
  CHECK(finishes[1] == 1);
}

TEST_CASE("serve/http /v1/completions echo + logprobs equal the packed forward's log-probabilities") {
  World& w = world();
  const std::vector<int64_t> ids = {24912, 2375, 13, 1374, 553, 261, 1746};
  Reply r = post(w.plain->port, "/v1/completions",
                 {{"prompt", ids}, {"echo", true}, {"logprobs", 1}, {"max_tokens", 0}});
  REQUIRE(r.status == 200);
  const json& lp = r.body["choices"][0]["logprobs"];
  REQUIRE(lp["token_logprobs"].size() == ids.size());
  CHECK(lp["token_logprobs"][0].is_null());
  CHECK(r.body["choices"][0]["text"] == w.tokenizer->decode(std::vector<tok::TokenId>(ids.begin(), ids.end())));
  CHECK(r.body["usage"]["prompt_tokens"] == ids.size());
  CHECK(r.body["usage"]["completion_tokens"] == 0);
  const std::vector<float> ref =
      score(*w.model, {ids[0]}, std::vector<int64_t>(ids.begin() + 1, ids.end()));
  REQUIRE(ref.size() == ids.size() - 1);
  for (size_t t = 1; t < ids.size(); ++t) {
    CAPTURE(t);
    CHECK(std::fabs(lp["token_logprobs"][t].get<double>() - double(ref[t - 1])) < 1e-5);
    CHECK(lp["top_logprobs"][t].size() >= 1);  // the prompt token, and the top 1 when it differs
    CHECK(lp["top_logprobs"][t].size() <= 2);
  }
  // Echo with generation: text starts with the prompt, logprobs continue after it.
  Reply g = post(w.plain->port, "/v1/completions",
                 {{"prompt", "hello world"}, {"echo", true}, {"logprobs", 0}, {"max_tokens", 3}, {"ignore_eos", true},
                  {"temperature", 0}});
  REQUIRE(g.status == 200);
  CHECK(g.body["choices"][0]["text"].get<std::string>().rfind("hello world", 0) == 0);
  CHECK(g.body["choices"][0]["logprobs"]["tokens"].size() == 5);

  // Several prompts x n: prompt-major choice indices.
  Reply m = post(w.plain->port, "/v1/completions",
                 {{"prompt", {"a", "b"}}, {"n", 2}, {"max_tokens", 2}, {"ignore_eos", true}, {"seed", 1}});
  REQUIRE(m.status == 200);
  CHECK(m.body["choices"].size() == 4);
  CHECK(m.body["usage"]["prompt_tokens"] == 2);
  CHECK(m.body["usage"]["completion_tokens"] == 8);

  // Streaming completions end with [DONE].
  Reply s = post(w.plain->port, "/v1/completions",
                 {{"prompt", {24912}}, {"max_tokens", 3}, {"ignore_eos", true}, {"stream", true}});
  REQUIRE(s.status == 200);
  const auto ev = sse_payloads(s.raw);
  CHECK(ev.back() == "[DONE]");
  CHECK(json::parse(ev.front())["object"] == "text_completion");
}

TEST_CASE("serve/http vLLM's prompt_logprobs and return_token_ids: chat and completions, whole and streamed") {
  World& w = world();
  const json messages = {{{"role", "user"}, {"content", "Hello there"}}};
  Reply tk = post(w.plain->port, "/tokenize", {{"messages", messages}});
  REQUIRE(tk.status == 200);
  const std::vector<int64_t> prompt = tk.body["tokens"].get<std::vector<int64_t>>();
  REQUIRE(prompt.size() >= 4);
  const std::vector<float> ref = score(*w.model, {prompt[0]}, std::vector<int64_t>(prompt.begin() + 1, prompt.end()));

  // Chat: the prompt's log-probabilities with their ranks and the top 20,
  // the prompt's ids and each choice's ids.
  const int64_t k = 20;
  Reply r = post(w.plain->port, "/v1/chat/completions",
                 hello_chat({{"max_tokens", 5}, {"ignore_eos", true}, {"prompt_logprobs", k},
                             {"return_token_ids", true}, {"logprobs", true}}));
  REQUIRE(r.status == 200);
  CHECK(r.body["prompt_token_ids"].get<std::vector<int64_t>>() == prompt);
  const json& plp = r.body["prompt_logprobs"];
  REQUIRE(plp.size() == prompt.size());
  CHECK(plp[0].is_null());
  for (size_t t = 1; t < prompt.size(); ++t) {
    CAPTURE(t);
    const std::string key = std::to_string(prompt[t]);
    REQUIRE(plp[t].contains(key));
    const json& tok = plp[t][key];
    CHECK(std::fabs(tok["logprob"].get<double>() - double(ref[t - 1])) < 1e-5);
    CHECK(tok["decoded_token"] == w.tokenizer->decode(std::vector<tok::TokenId>{tok::TokenId(prompt[t])}, false));
    // The top 20 carry ranks 1..20 in order of log-probability; the prompt
    // token's rank is 1 + the ids above it (counted over the whole vocabulary,
    // so here checked against the top 20 when it is among them).
    std::map<int64_t, double> by_rank;
    for (auto it = plp[t].begin(); it != plp[t].end(); ++it)
      if (it.key() != key || it.value()["rank"].get<int64_t>() <= k) by_rank[it.value()["rank"]] = it.value()["logprob"];
    const int64_t rank = tok["rank"];
    CHECK(rank >= 1);
    CHECK(plp[t].size() == size_t(rank <= k ? k : k + 1));
    REQUIRE(by_rank.size() == size_t(k));
    CHECK(by_rank.begin()->first == 1);
    CHECK(by_rank.rbegin()->first == k);
    for (auto it = std::next(by_rank.begin()); it != by_rank.end(); ++it) CHECK(it->second <= std::prev(it)->second);
    int64_t above = 0;
    for (const auto& [rk, lp] : by_rank) above += lp > tok["logprob"].get<double>() ? 1 : 0;
    if (rank <= k) CHECK(rank == above + 1);
    else CHECK(above == k);
  }
  const json& choice = r.body["choices"][0];
  const std::vector<int64_t> out_ids = choice["token_ids"].get<std::vector<int64_t>>();
  REQUIRE(out_ids.size() == 5);
  for (size_t i = 0; i < out_ids.size(); ++i)
    CHECK(choice["logprobs"]["content"][i]["token"] == w.tokenizer->decode(std::vector<tok::TokenId>{tok::TokenId(out_ids[i])}, false));
  // Exact ranks: the greedy continuation's tokens are each their row's top
  // (rank 1), and the runner-up put in the first one's place has rank 2.
  std::vector<int64_t> cont = prompt;
  cont.insert(cont.end(), out_ids.begin(), out_ids.end());
  Reply g = post(w.plain->port, "/v1/completions", {{"prompt", cont}, {"max_tokens", 1}, {"prompt_logprobs", 3}});
  REQUIRE(g.status == 200);
  std::string runner_up;
  double runner_up_lp = 0;
  for (size_t t = prompt.size(); t < cont.size(); ++t) {
    CAPTURE(t);
    const json& pos = g.body["choices"][0]["prompt_logprobs"][t];
    CHECK(pos[std::to_string(cont[t])]["rank"] == 1);
    CHECK(pos.size() == 3);
    for (auto it = pos.begin(); it != pos.end() && t == prompt.size(); ++it)
      if (it.value()["rank"] == 2) runner_up = it.key(), runner_up_lp = it.value()["logprob"];
  }
  REQUIRE_FALSE(runner_up.empty());
  std::vector<int64_t> second = prompt;
  second.push_back(std::stoll(runner_up));
  Reply g2 = post(w.plain->port, "/v1/completions", {{"prompt", second}, {"max_tokens", 1}, {"prompt_logprobs", 0}});
  REQUIRE(g2.status == 200);
  const json& last_pos = g2.body["choices"][0]["prompt_logprobs"][prompt.size()];
  REQUIRE(last_pos.size() == 1);
  CHECK(last_pos[runner_up]["rank"] == 2);
  CHECK(last_pos[runner_up]["logprob"].get<double>() == runner_up_lp);

  // Without the fields, neither key is in the response.
  Reply plain = post(w.plain->port, "/v1/chat/completions", hello_chat({{"max_tokens", 5}, {"ignore_eos", true}}));
  REQUIRE(plain.status == 200);
  CHECK_FALSE(plain.body.contains("prompt_logprobs"));
  CHECK_FALSE(plain.body.contains("prompt_token_ids"));
  CHECK_FALSE(plain.body["choices"][0].contains("token_ids"));
  CHECK(plain.body["choices"][0]["message"]["content"] == choice["message"]["content"]);

  // Completions: per choice, equal to echo's log-probabilities; a boolean
  // counts as 1 (as vLLM's coercion).
  Reply c = post(w.plain->port, "/v1/completions",
                 {{"prompt", prompt}, {"max_tokens", 5}, {"ignore_eos", true}, {"temperature", 0}, {"n", 2},
                  {"prompt_logprobs", true}, {"return_token_ids", true}});
  REQUIRE(c.status == 200);
  REQUIRE(c.body["choices"].size() == 2);
  for (const json& ch : c.body["choices"]) {
    CHECK(ch["prompt_token_ids"].get<std::vector<int64_t>>() == prompt);
    CHECK(ch["token_ids"].get<std::vector<int64_t>>() == out_ids);  // greedy: the chat's continuation
    REQUIRE(ch["prompt_logprobs"].size() == prompt.size());
    CHECK(ch["prompt_logprobs"][0].is_null());
    for (size_t t = 1; t < prompt.size(); ++t) {
      const json& pos = ch["prompt_logprobs"][t];
      const json& tok = pos[std::to_string(prompt[t])];
      CHECK(pos.size() == (tok["rank"] == 1 ? 1u : 2u));
      CHECK(tok["logprob"].get<double>() == plp[t][std::to_string(prompt[t])]["logprob"].get<double>());
      CHECK(tok["rank"] == plp[t][std::to_string(prompt[t])]["rank"]);
    }
  }

  // With echo: echo's entries keep their own k (the prompt token and the top
  // 1), prompt_logprobs its own.
  Reply e = post(w.plain->port, "/v1/completions",
                 {{"prompt", prompt}, {"max_tokens", 1}, {"echo", true}, {"logprobs", 1}, {"prompt_logprobs", 3}});
  REQUIRE(e.status == 200);
  for (size_t t = 1; t < prompt.size(); ++t) {
    CAPTURE(t);
    const json& pos = e.body["choices"][0]["prompt_logprobs"][t];
    CHECK(pos.size() == (pos[std::to_string(prompt[t])]["rank"].get<int64_t>() <= 3 ? 3u : 4u));
    CHECK(e.body["choices"][0]["logprobs"]["top_logprobs"][t].size() ==
          (pos[std::to_string(prompt[t])]["rank"] == 1 ? 1u : 2u));
  }

  // Streamed: the prompt's ids in the first chunk, the choice's ids spread
  // over the chunks add up to the whole response's.
  for (const char* route : {"/v1/chat/completions", "/v1/completions"}) {
    CAPTURE(route);
    const bool chat = std::string(route) == "/v1/chat/completions";
    json body = chat ? hello_chat({{"max_tokens", 5}, {"ignore_eos", true}})
                     : json{{"prompt", prompt}, {"max_tokens", 5}, {"ignore_eos", true}, {"temperature", 0}};
    body["stream"] = true;
    body["return_token_ids"] = true;
    Reply st = post(w.plain->port, route, body);
    REQUIRE(st.status == 200);
    std::vector<int64_t> streamed;
    int prompt_chunks = 0;
    const auto events = sse_payloads(st.raw);
    for (size_t i = 0; i + 1 < events.size(); ++i) {
      const json ev = json::parse(events[i]);
      const json& ch = ev["choices"][0];
      const json& holder = chat ? ev : ch;
      if (holder.contains("prompt_token_ids")) {
        ++prompt_chunks;
        CHECK(i == 0);
        CHECK(holder["prompt_token_ids"].get<std::vector<int64_t>>() == prompt);
      }
      REQUIRE(ch.contains("token_ids"));
      for (const json& id : ch["token_ids"]) streamed.push_back(id.get<int64_t>());
    }
    CHECK(prompt_chunks == 1);
    CHECK(streamed == out_ids);
  }

  // Refused: with stream, out of range, not a number.
  check_error(post(w.plain->port, "/v1/chat/completions", hello_chat({{"prompt_logprobs", 1}, {"stream", true}})), 400,
              "'prompt_logprobs' is not supported with 'stream'", "prompt_logprobs");
  check_error(post(w.plain->port, "/v1/completions", {{"prompt", "hi"}, {"prompt_logprobs", 21}}), 400, "",
              "prompt_logprobs");
  check_error(post(w.plain->port, "/v1/completions", {{"prompt", "hi"}, {"prompt_logprobs", "1"}}), 400, "",
              "prompt_logprobs");
  check_error(post(w.plain->port, "/v1/completions", {{"prompt", "hi"}, {"return_token_ids", 1}}), 400, "",
              "return_token_ids");
}

TEST_CASE("serve/http vLLM's allowed_token_ids, bad_words and continuous_usage_stats; its fields the server does not run are refused") {
  World& w = world();
  // allowed_token_ids: every sampled id among them (the chat's logprobs show the ids).
  const std::vector<int64_t> allowed = {24912, 2375, 13, 1374};
  Reply a = post(w.plain->port, "/v1/completions",
                 {{"prompt", "Hello"}, {"max_tokens", 8}, {"temperature", 1.0}, {"seed", 3}, {"ignore_eos", true},
                  {"allowed_token_ids", allowed}, {"return_token_ids", true}});
  REQUIRE(a.status == 200);
  const std::vector<int64_t> got = a.body["choices"][0]["token_ids"].get<std::vector<int64_t>>();
  REQUIRE(got.size() == 8);
  for (int64_t id : got) CHECK(std::count(allowed.begin(), allowed.end(), id) == 1);
  // bad_words: the greedy reply's first word banned, the reply changes and does not contain it.
  Reply g = post(w.plain->port, "/v1/chat/completions", hello_chat({{"max_tokens", 6}, {"return_token_ids", true}}));
  REQUIRE(g.status == 200);
  const std::vector<int64_t> gids = g.body["choices"][0]["token_ids"].get<std::vector<int64_t>>();
  REQUIRE_FALSE(gids.empty());
  const std::string word = w.tokenizer->decode(std::vector<tok::TokenId>{tok::TokenId(gids[0])});
  Reply b = post(w.plain->port, "/v1/chat/completions",
                 hello_chat({{"max_tokens", 6}, {"return_token_ids", true}, {"bad_words", {word}}}));
  REQUIRE(b.status == 200);
  const std::vector<int64_t> bids = b.body["choices"][0]["token_ids"].get<std::vector<int64_t>>();
  const auto seqs = encode_bad_words({word}, [&](const std::string& t) {
    const std::vector<tok::TokenId> ids = w.tokenizer->encode(t);
    return std::vector<int64_t>(ids.begin(), ids.end());
  });
  REQUIRE(std::find(seqs.begin(), seqs.end(), std::vector<int64_t>{gids[0]}) != seqs.end());
  CHECK(bids[0] != gids[0]);
  for (const auto& seq : seqs)
    if (seq.size() == 1) CHECK(std::count(bids.begin(), bids.end(), seq[0]) == 0);
  // continuous_usage_stats: every chunk carries the usage so far, its completion tokens rising to the total.
  Reply s = post(w.plain->port, "/v1/chat/completions",
                 hello_chat({{"max_tokens", 5}, {"ignore_eos", true}, {"stream", true},
                             {"stream_options", {{"include_usage", true}, {"continuous_usage_stats", true}}}}));
  REQUIRE(s.status == 200);
  int64_t last = -1, chunks = 0;
  for (const std::string& e : sse_payloads(s.raw)) {
    if (e == "[DONE]") continue;
    const json c = json::parse(e);
    REQUIRE(c.contains("usage"));
    const int64_t done = c["usage"]["completion_tokens"];
    CHECK(done >= last);
    CHECK(c["usage"]["prompt_tokens"].get<int64_t>() > 0);
    last = done;
    ++chunks;
  }
  CHECK(last == 5);
  CHECK(chunks >= 3);  // the role chunk, the deltas (if any text), the finish chunk, the usage chunk
  // The Responses API passes them on too.
  Reply r = post(w.plain->port, "/v1/responses", {{"input", "Hello"}, {"max_output_tokens", 4}, {"temperature", 1.0},
                                                  {"allowed_token_ids", {13}}, {"ignore_eos", true}});
  REQUIRE(r.status == 200);
  CHECK(r.body["output"][0]["content"][0]["text"] == "....");

  // Refused by name.
  const std::vector<std::pair<json, std::string>> refused = {
      {{{"allowed_token_ids", json::array()}}, "allowed_token_ids"},
      {{{"allowed_token_ids", {-1}}}, "allowed_token_ids"},
      {{{"allowed_token_ids", {200064}}}, "allowed_token_ids"},
      {{{"allowed_token_ids", {"a"}}}, "allowed_token_ids"},
      {{{"bad_words", "word"}}, "bad_words"},
      {{{"bad_words", {" "}}}, "bad_words"},
      {{{"bad_words", {std::string(300, 'x')}}}, "bad_words"},
      {{{"use_beam_search", true}}, "use_beam_search"},
      {{{"logits_processors", {"mod.fn"}}}, "logits_processors"},
      {{{"priority", 1}}, "priority"},
      {{{"truncate_prompt_tokens", 10}}, "truncate_prompt_tokens"},
  };
  for (const auto& item : refused) {
    CAPTURE(item.first.dump());
    check_error(post(w.plain->port, "/v1/chat/completions", hello_chat(item.first)), 400, "", item.second);
  }
  CHECK(post(w.plain->port, "/v1/chat/completions", hello_chat({{"priority", 0}, {"use_beam_search", false},
                                                               {"logits_processors", json::array()}})).status == 200);
}

// A greedy stream whose every step has eos (199999) on top (logit_bias): the
// engine stops at the first token unless ignore_eos (vLLM's extension), and
// with it generates max_tokens, streamed one text chunk per token.
TEST_CASE("serve/http ignore_eos: streaming /v1/completions and chat generate past eos to max_tokens") {
  World& w = world();
  struct Streamed {
    int64_t text_chunks = 0, completion_tokens = -1;
    std::string text, finish;
    json stop_reason;
  };
  for (const std::string path : {"/v1/completions", "/v1/chat/completions"}) {
    CAPTURE(path);
    const bool chat = path == "/v1/chat/completions";
    json body = {{"max_tokens", 6}, {"temperature", 0}, {"logit_bias", {{"199999", 100}}},
                 {"skip_special_tokens", false}};
    if (chat) body["messages"] = {{{"role", "user"}, {"content", "Hello there"}}};
    else body["prompt"] = "hello world";
    auto stream = [&](bool ignore_eos) {
      json b = body;
      b["ignore_eos"] = ignore_eos;
      b["stream"] = true;
      b["stream_options"] = {{"include_usage", true}};
      Reply r = post(w.plain->port, path, b);
      REQUIRE(r.status == 200);
      const auto events = sse_payloads(r.raw);
      REQUIRE(!events.empty());
      CHECK(events.back() == "[DONE]");
      Streamed s;
      for (size_t i = 0; i + 1 < events.size(); ++i) {
        const json c = json::parse(events[i]);
        if (c.contains("usage") && c["usage"].is_object()) s.completion_tokens = c["usage"]["completion_tokens"];
        for (const json& ch : c["choices"]) {
          const json piece = chat ? ch["delta"].value("content", json()) : ch.value("text", json());
          if (piece.is_string() && !piece.get<std::string>().empty()) {
            ++s.text_chunks;
            s.text += piece.get<std::string>();
          }
          if (!ch["finish_reason"].is_null()) {
            s.finish = ch["finish_reason"];
            s.stop_reason = ch.value("stop_reason", json());
          }
        }
      }
      return s;
    };
    const Streamed stopped = stream(false);
    CHECK(stopped.completion_tokens == 1);
    CHECK(stopped.finish == "stop");
    CHECK(stopped.stop_reason == 199999);

    const Streamed past = stream(true);
    CHECK(past.completion_tokens == 6);
    CHECK(past.finish == "length");
    CHECK(past.stop_reason.is_null());
    CHECK(past.text_chunks == 6);
    REQUIRE(!past.text.empty());
    REQUIRE(past.text.size() % 6 == 0);
    const std::string one = past.text.substr(0, past.text.size() / 6);
    std::string six;
    for (int i = 0; i < 6; ++i) six += one;
    CHECK(past.text == six);  // the same (eos) token six times
    // The same request without streaming gives the same text.
    json b = body;
    b["ignore_eos"] = true;
    Reply whole = post(w.plain->port, path, b);
    REQUIRE(whole.status == 200);
    const json& choice = whole.body["choices"][0];
    CHECK((chat ? choice["message"]["content"] : choice["text"]) == past.text);
    CHECK(whole.body["usage"]["completion_tokens"] == 6);
  }
}

TEST_CASE("serve/http /v1/models, /health, /metrics, /version, /tokenize, /detokenize") {
  World& w = world();
  Reply m = get(w.plain->port, "/v1/models");
  REQUIRE(m.status == 200);
  CHECK(m.body["object"] == "list");
  CHECK(m.body["data"][0]["id"] == "areno-demo");
  CHECK(m.body["data"][0]["object"] == "model");
  CHECK(m.body["data"][0]["max_model_len"] == w.engine->max_context());

  Reply h = get(w.plain->port, "/health");
  CHECK(h.status == 200);
  CHECK(h.body == json{{"status", "ok"}});

  check_serving(w.plain->port);
  Reply x = get(w.plain->port, "/metrics");
  REQUIRE(x.status == 200);
  CHECK(x.content_type.find("text/plain") == 0);
  for (const char* name : {"areno_requests_total ", "areno_requests_finished_total ", "areno_requests_aborted_total ",
                           "areno_requests_failed_total ", "areno_prompt_tokens_total ", "areno_generation_tokens_total ",
                           "areno_requests_running ", "areno_requests_waiting ", "areno_kv_blocks_used ",
                           "areno_kv_blocks_total ", "areno_engine_steps_total ", "areno_engine_step_seconds_total ",
                           "areno_prefix_cache_queries_total ", "areno_prefix_cache_hits_total ",
                           "areno_kv_blocks_cached ", "areno_kv_touched_bytes ", "areno_media_cache_hits_total ",
                           "# TYPE areno_requests_total counter", "areno_http_requests_total{route=\"/v1/chat/completions\",status=\"200\"}"})
    CHECK_MESSAGE(x.raw.find(name) != std::string::npos, name);

  CHECK(get(w.plain->port, "/version").body.contains("version"));
  Reply t = post(w.plain->port, "/tokenize", {{"prompt", "hello world"}});
  CHECK(t.body["tokens"] == json::array({24912, 2375}));
  Reply d = post(w.plain->port, "/detokenize", {{"tokens", {24912, 2375}}});
  CHECK(d.body["prompt"] == "hello world");
}

// Served LoRAs (--lora-modules): a request's "model" picks one, requests
// for each adapter and the base share batches, /v1/models lists them.
TEST_CASE("serve/http served LoRAs: \"model\" picks the adapter, /v1/models lists them, unknown names are 404") {
  std::signal(SIGPIPE, SIG_IGN);
  auto model = phi4mm::init_model("tiny", 0);
  REQUIRE(areno::testing::add_random_served_lora(*model, "sql", 2, 4.0, phi4mm::kLoraTargets, 3) == 1);
  REQUIRE(areno::testing::add_random_served_lora(*model, "org/chat-v2", 2, 4.0, phi4mm::kLoraTargets, 4) == 2);
  EngineOptions eo;
  eo.max_running = 8;
  eo.kv_blocks = 256;
  eo.prefix_caching = true;
  Engine engine(model, tokenizer_for(*model), eo);
  engine.start();
  {
    Served srv(engine, ServerOptions{});
    Reply m = get(srv.port, "/v1/models");
    REQUIRE(m.status == 200);
    REQUIRE(m.body["data"].size() == 3);
    CHECK(m.body["data"][0]["id"] == "areno-demo");
    CHECK(m.body["data"][1]["id"] == "sql");
    CHECK(m.body["data"][1]["parent"] == "areno-demo");
    CHECK(m.body["data"][1]["root"] == "/adapters/sql");  // the folder
    CHECK(m.body["data"][2]["id"] == "org/chat-v2");
    CHECK(m.body["data"][2]["max_model_len"] == engine.max_context());
    // OpenAI's retrieve, by id (a '/' in it too); an unknown one is model_not_found.
    for (size_t k = 0; k < 3; ++k) {
      Reply one = get(srv.port, "/v1/models/" + m.body["data"][k]["id"].get<std::string>());
      CHECK(one.status == 200);
      CHECK(one.body == m.body["data"][k]);
    }
    Reply none = get(srv.port, "/v1/models/org/nothing");
    CHECK(none.status == 404);
    CHECK(none.body["error"]["code"] == "model_not_found");
    CHECK(get(srv.port, "/metrics").raw.find("route=\"/v1/models/{id}\",status=\"404\"") != std::string::npos);

    // Prompt log-probabilities under each name equal the packed forward with that adapter, all three in flight at once.
    const std::vector<int64_t> ids = {24912, 2375, 13, 1374, 553, 261, 1746};
    const char* names[3] = {"areno-demo", "sql", "org/chat-v2"};
    std::vector<Reply> replies(3);
    {
      std::vector<std::thread> ts;
      for (int j = 0; j < 3; ++j)
        ts.emplace_back([&, j] {
          replies[size_t(j)] = post(srv.port, "/v1/completions",
                                    {{"model", names[j]}, {"prompt", ids}, {"echo", true}, {"logprobs", 0},
                                     {"max_tokens", 4}, {"temperature", 0}, {"ignore_eos", true}});
        });
      for (auto& t : ts) t.join();
    }
    std::vector<double> first(3);
    for (int j = 0; j < 3; ++j) {
      CAPTURE(j);
      const Reply& r = replies[size_t(j)];
      REQUIRE(r.status == 200);
      CHECK(r.body["model"] == names[j]);
      phi4mm::PackedBatch pb = phi4mm::PackedBatch::single(ids);
      pb.served_lora = {j};
      std::vector<int64_t> next(ids.begin() + 1, ids.end());
      next.push_back(-1);
      NoGradGuard ng;
      const std::vector<float> ref = model->token_logprobs(pb, from_vector(next, {int64_t(ids.size())})).to_vector<float>();
      const json& lp = r.body["choices"][0]["logprobs"]["token_logprobs"];
      REQUIRE(lp.size() == ids.size() + 4);
      for (size_t t = 1; t < ids.size(); ++t) CHECK(std::fabs(lp[t].get<double>() - double(ref[t - 1])) < 1e-5);
      first[size_t(j)] = lp[1].get<double>();
    }
    CHECK(first[0] != first[1]);  // the adapters change the model
    CHECK(first[1] != first[2]);
    // Chat and streaming carry the adapter's name.
    Reply chat = post(srv.port, "/v1/chat/completions", hello_chat({{"model", "sql"}}));
    REQUIRE(chat.status == 200);
    CHECK(chat.body["model"] == "sql");
    Reply st = post(srv.port, "/v1/chat/completions", hello_chat({{"model", "org/chat-v2"}, {"stream", true}}));
    REQUIRE(st.status == 200);
    CHECK(json::parse(sse_payloads(st.raw).front())["model"] == "org/chat-v2");
    CHECK(post(srv.port, "/tokenize", {{"model", "sql"}, {"prompt", "hello world"}}).status == 200);
    const std::string metrics = get(srv.port, "/metrics").raw;
    CHECK(metrics.find("\nareno_served_loras 2\n") != std::string::npos);
    CHECK(metrics.find("\nareno_model_requests_total{model=\"sql\"} 2\n") != std::string::npos);  // completion + chat
    CHECK(metrics.find("\nareno_model_requests_total{model=\"org/chat-v2\"} 2\n") != std::string::npos);
    CHECK(metrics.find("\nareno_model_requests_total{model=\"areno-demo\"} 1\n") != std::string::npos);
    CHECK(metrics.find("\nareno_lora_requests{adapter=\"sql\",state=\"running\"} 0\n") != std::string::npos);
    CHECK(metrics.find("\nareno_lora_requests{adapter=\"org/chat-v2\",state=\"waiting\"} 0\n") != std::string::npos);
    {
      // While a long request for "sql" runs, its gauge counts it.
      std::thread long_one([&] {
        post(srv.port, "/v1/completions",
             {{"model", "sql"}, {"prompt", ids}, {"max_tokens", 400}, {"ignore_eos", true}, {"temperature", 0}});
      });
      bool seen = false;
      for (int k = 0; k < 2000 && !seen; ++k) {
        seen = get(srv.port, "/metrics").raw.find("\nareno_lora_requests{adapter=\"sql\",state=\"running\"} 1\n") !=
               std::string::npos;
        if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      long_one.join();
      CHECK(seen);
      bool zero = false;  // published at the end of the step that finished it
      for (int k = 0; k < 1000 && !zero; ++k) {
        zero = get(srv.port, "/metrics").raw.find("\nareno_lora_requests{adapter=\"sql\",state=\"running\"} 0\n") !=
               std::string::npos;
        if (!zero) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      CHECK(zero);
    }
    // Unknown: 404 naming every served name.
    Reply bad = post(srv.port, "/v1/chat/completions", hello_chat({{"model", "sq"}}));
    check_error(bad, 404, "`areno-demo`, `sql`, `org/chat-v2`", "model");
    CHECK(bad.body["error"]["code"] == "model_not_found");
    check_serving(srv.port);
    // Updates are off without a LoRA root.
    check_error(post(srv.port, "/v1/load_lora_adapter", {{"lora_name", "x"}, {"lora_path", "/tmp"}}), 404, "--lora-root");
    check_error(post(srv.port, "/v1/unload_lora_adapter", {{"lora_name", "sql"}}), 404, "--lora-root");
  }
  // With a root: load, serve, unload, refusals.
  areno::testing::TempDir root, outside;
  areno::testing::save_random_peft("tiny", root.str("adapters/math"), 4, 8.0, 9);
  areno::testing::save_random_peft("tiny", outside.str("secret"), 4, 8.0, 9);
  std::filesystem::create_symlink(outside.str("secret"), root.str("adapters/link"));
  {
    ServerOptions so;
    so.lora_root = root.str("adapters");
    so.max_loras = 3;
    Served srv(engine, so);
    auto load = [&](const std::string& name, const std::string& path) {
      return post(srv.port, "/v1/load_lora_adapter", {{"lora_name", name}, {"lora_path", path}});
    };
    auto logprob = [&](const std::string& name) {
      Reply r = post(srv.port, "/v1/completions", {{"model", name}, {"prompt", {24912, 2375, 13}}, {"echo", true},
                                                   {"logprobs", 0}, {"max_tokens", 0}});
      REQUIRE(r.status == 200);
      return r.body["choices"][0]["logprobs"]["token_logprobs"][2].get<double>();
    };
    check_error(post(srv.port, "/v1/chat/completions", hello_chat({{"model", "math"}})), 404, "does not exist");
    Reply ok = load("math", "math");
    CHECK(ok.status == 200);
    CHECK(ok.raw == "Success: LoRA adapter 'math' added successfully.");
    Reply m = get(srv.port, "/v1/models");
    REQUIRE(m.body["data"].size() == 4);
    CHECK(m.body["data"][3]["id"] == "math");
    CHECK(m.body["data"][3]["parent"] == "areno-demo");
    CHECK(m.body["data"][3]["root"] == "math");  // as sent, not the server's folder
    const double with_math = logprob("math");
    CHECK(with_math != logprob("areno-demo"));
    CHECK(with_math != logprob("sql"));
    // Refusals: the name, a taken name, paths outside the root (a symlink out included) or missing, the cap.
    check_error(load("bad name", "math"), 400, "'lora_name' must be", "lora_name");
    check_error(load("areno-demo", "math"), 400, "the served model's own name", "lora_name");
    check_error(load("sql", "math"), 400, "named 'sql' already", "lora_name");
    for (const std::string& p : {std::string("../") + outside.path.filename().string() + "/secret", outside.str("secret"),
                                 std::string("link"), std::string("missing"), std::string("/")})
      check_error(load("x", p), 400, "is not a folder under this server's LoRA root", "lora_path");
    Reply at_cap = load("math2", root.str("adapters/math"));
    check_error(at_cap, 400, "3 served LoRAs are loaded", "lora_name");
    CHECK(post(srv.port, "/v1/load_lora_adapter", {{"lora_name", "x"}}).status == 400);  // no path
    // Unload: gone from the listing and the API; then loaded again, the same model.
    Reply un = post(srv.port, "/v1/unload_lora_adapter", {{"lora_name", "math"}});
    CHECK(un.status == 200);
    CHECK(un.raw == "Success: LoRA adapter 'math' removed successfully.");
    CHECK(get(srv.port, "/v1/models").body["data"].size() == 3);
    check_error(post(srv.port, "/v1/chat/completions", hello_chat({{"model", "math"}})), 404, "does not exist");
    check_error(post(srv.port, "/v1/unload_lora_adapter", {{"lora_name", "math"}}), 404, "no served LoRA is named 'math'");
    std::filesystem::create_directories(root.str("adapters/empty"));  // below the cap now: the folder's fault
    check_error(load("x", "empty"), 400, "the adapter could not be loaded: empty: no adapter_config.json", "lora_path");
    CHECK(load("math", "math").status == 200);
    CHECK(logprob("math") == with_math);
    check_serving(srv.port);
  }
  engine.stop(false);
}

TEST_CASE("serve/http --lora-resolve: a request names an adapter folder under the root and it loads; the least recently used one loaded so is evicted at the cap, never one in use or loaded by the route") {
  std::signal(SIGPIPE, SIG_IGN);
  areno::testing::TempDir root, outside;
  for (const char* n : {"a", "b", "c", "r", "org/d"})
    areno::testing::save_random_peft("tiny", root.str(std::string("adapters/") + n), 2, 4.0, 11);
  areno::testing::save_random_peft("tiny", outside.str("secret"), 2, 4.0, 12);
  std::filesystem::create_symlink(outside.str("secret"), root.str("adapters/link"));
  std::filesystem::create_directories(root.str("adapters/plain"));  // no adapter_config.json
  std::filesystem::create_directories(root.str("adapters/broken"));
  std::ofstream(root.str("adapters/broken/adapter_config.json")) << "{not json";
  auto model = phi4mm::init_model("tiny", 0);
  EngineOptions eo;
  eo.kv_blocks = 128;
  auto loaded = [](const Engine& e) {  // sorted
    std::vector<std::string> names;
    for (const phi4mm::ServedLora& l : e.loras()) names.push_back(l.name);
    std::sort(names.begin(), names.end());
    return names;
  };
  ServerOptions so;
  so.lora_root = root.str("adapters");
  so.lora_resolve = true;
  so.max_loras = 2;
  {
    Engine engine(model, tokenizer_for(*model), eo);
    engine.start();
    Served srv(engine, so);
    auto logprob = [&](const std::string& name) {
      Reply r = post(srv.port, "/v1/completions", {{"model", name}, {"prompt", {24912, 2375, 13}}, {"echo", true},
                                                   {"logprobs", 0}, {"max_tokens", 0}});
      CAPTURE(r.raw);
      REQUIRE(r.status == 200);
      CHECK(r.body["model"] == name);
      return r.body["choices"][0]["logprobs"]["token_logprobs"][2].get<double>();
    };
    const double base = logprob("areno-demo");
    // The route's adapter stays loaded whatever comes on demand.
    REQUIRE(post(srv.port, "/v1/load_lora_adapter", {{"lora_name", "r"}, {"lora_path", "r"}}).status == 200);
    const double a = logprob("a");
    CHECK(a != base);
    CHECK(loaded(engine) == std::vector<std::string>{"a", "r"});
    CHECK(get(srv.port, "/v1/models").body["data"].size() == 3);
    CHECK(logprob("org/d") != base);  // at the cap: "a" makes room
    CHECK(loaded(engine) == std::vector<std::string>{"org/d", "r"});
    CHECK(logprob("a") == a);  // loaded again, the same adapter; "org/d" out
    CHECK(loaded(engine) == std::vector<std::string>{"a", "r"});
    // Unloading the route's adapter frees its slot: no eviction for "b".
    REQUIRE(post(srv.port, "/v1/unload_lora_adapter", {{"lora_name", "r"}}).status == 200);
    logprob("b");
    CHECK(loaded(engine) == std::vector<std::string>{"a", "b"});
    // The least recently used goes: "a" used after "b" loaded, so "c" takes b's place.
    logprob("a");
    logprob("c");
    CHECK(loaded(engine) == std::vector<std::string>{"a", "c"});
    const std::string metrics = get(srv.port, "/metrics").raw;
    CHECK(metrics.find("\nareno_lora_resolved_loads_total 5\n") != std::string::npos);  // a, org/d, a, b, c
    CHECK(metrics.find("\nareno_lora_evictions_total 3\n") != std::string::npos);       // a, org/d, b
    // Not adapters under the root: 404 as any unknown model; a folder that does not load: 400.
    for (const std::string& name : {std::string("zzz"), std::string("link"), std::string("plain"),
                                    std::string("../") + outside.path.filename().string() + "/secret",
                                    outside.str("secret"), std::string("a b")}) {
      CAPTURE(name);
      Reply r = post(srv.port, "/v1/chat/completions", hello_chat({{"model", name}}));
      check_error(r, 404, "does not exist", "model");
      CHECK(r.body["error"]["code"] == "model_not_found");
    }
    check_error(post(srv.port, "/v1/chat/completions", hello_chat({{"model", "broken"}})), 400,
                "the adapter 'broken' could not be loaded", "model");
    CHECK(loaded(engine) == std::vector<std::string>{"a", "c"});  // nothing evicted for the broken folder
    check_serving(srv.port);
    engine.stop(false);
  }
  {
    // Adapters in use are never evicted: with the engine not stepping, submitted
    // requests stay queued (in use); /tokenize resolves names like generation does.
    auto fresh = phi4mm::init_model("tiny", 0);  // the adapters live in the model: a new one
    Engine engine(fresh, tokenizer_for(*fresh), eo);
    Served srv(engine, so);
    auto hold = [&](const std::string& name) {
      REQUIRE(post(srv.port, "/tokenize", {{"model", name}, {"prompt", "hi"}}).status == 200);
      Request q;
      q.prompt = {24912, 2375};
      q.served_lora = engine.find_lora(name)->number;
      q.params.max_tokens = 1;
      engine.submit(std::move(q), [](const RequestOutput&) {});
    };
    hold("a");
    hold("b");
    check_error(post(srv.port, "/tokenize", {{"model", "c"}, {"prompt", "hi"}}), 429, "in use", "model");
    CHECK(loaded(engine) == std::vector<std::string>{"a", "b"});
    engine.stop(false);
  }
}

TEST_CASE("serve/http --lora-resolve under churn: concurrent requests for more adapters than slots each run with their own adapter or get 429") {
  std::signal(SIGPIPE, SIG_IGN);
  areno::testing::TempDir root;
  const std::vector<std::string> names = {"a", "b", "c", "d"};
  for (size_t i = 0; i < names.size(); ++i)
    areno::testing::save_random_peft("tiny", root.str("adapters/" + names[i]), 2, 4.0, 20 + int(i));
  auto model = phi4mm::init_model("tiny", 0);
  EngineOptions eo;
  eo.kv_blocks = 256;
  eo.max_running = 8;
  Engine engine(model, tokenizer_for(*model), eo);
  engine.start();
  ServerOptions so;
  so.lora_root = root.str("adapters");
  so.lora_resolve = true;
  so.max_loras = 2;
  Served srv(engine, so);
  auto logprob = [&](const std::string& name, Reply* out = nullptr) {
    Reply r = post(srv.port, "/v1/completions", {{"model", name}, {"prompt", {24912, 2375, 13}}, {"echo", true},
                                                 {"logprobs", 0}, {"max_tokens", 2}, {"temperature", 0}});
    if (out) *out = r;
    return r.status == 200 ? r.body["choices"][0]["logprobs"]["token_logprobs"][2].get<double>() : NAN;
  };
  // Each adapter's value, one at a time.
  std::map<std::string, double> want;
  for (const std::string& n : names) want[n] = logprob(n);
  want["areno-demo"] = logprob("areno-demo");
  for (const std::string& n : names) CHECK(std::fabs(want[n] - want["areno-demo"]) > 1e-3 * std::fabs(want[n]));
  // 8 clients, 12 requests each, over 5 names with 2 slots.
  std::atomic<int> ok{0}, busy{0}, wrong{0}, other{0};
  std::mutex other_mu;
  std::vector<std::string> others;
  std::vector<std::thread> ts;
  for (int c = 0; c < 8; ++c)
    ts.emplace_back([&, c] {
      for (int k = 0; k < 12; ++k) {
        const std::string name = k % 5 == 4 ? "areno-demo" : names[size_t((c + k) % 4)];
        Reply r;
        const double v = logprob(name, &r);
        if (r.status == 200) {
          ++ok;
          // Its own adapter's value to float rounding: at the AVX2 level a step
          // of 17+ rows takes the packed GEMM, whose sums run in another order
          // than the skinny kernel's (seen: 8e-8 relative); the adapters differ
          // by far more (checked above).
          if (!(std::fabs(v - want[name]) <= 1e-5 * std::fabs(want[name]))) ++wrong;
        } else if (r.status == 429) {
          ++busy;
        } else {
          ++other;
          std::lock_guard<std::mutex> lk(other_mu);
          others.push_back(fmt::format("{} {}", r.status, r.raw));
        }
      }
    });
  for (auto& t : ts) t.join();
  MESSAGE("churn: ", ok.load(), " answered, ", busy.load(), " busy (429)");
  for (const std::string& o : others) MESSAGE("other answer: ", o);
  CHECK(wrong == 0);
  CHECK(other == 0);
  CHECK(ok + busy == 96);
  CHECK(ok >= 40);
  CHECK(engine.loras().size() <= 2);
  check_serving(srv.port);
  engine.stop(true);
  CHECK(engine.stats().kv_blocks_used == 0);
}

TEST_CASE("serve/http request errors: status and OpenAI body, then the server keeps serving") {
  World& w = world();
  const int port = w.plain->port;
  auto chat_raw = [&](const std::string& body) { return send(port, "POST", "/v1/chat/completions", body); };

  check_error(chat_raw("{\"messages\": [}"), 400, "malformed JSON");
  check_serving(port);
  check_error(chat_raw("[1, 2]"), 400, "JSON object");
  check_error(post(port, "/v1/chat/completions", {{"messages", "hello"}}), 400, "array", "messages");
  check_error(post(port, "/v1/chat/completions", {{"messages", json::array()}}), 400, "non-empty", "messages");
  check_error(post(port, "/v1/chat/completions", hello_chat({{"temperature", "warm"}})), 400, "number", "temperature");
  check_error(post(port, "/v1/chat/completions", hello_chat({{"n", 0}})), 400, "", "n");
  check_error(post(port, "/v1/chat/completions", hello_chat({{"top_logprobs", 3}})), 400, "logprobs", "top_logprobs");
  check_error(post(port, "/v1/chat/completions", hello_chat({{"stream_options", {{"include_usage", true}}}})), 400,
              "stream", "stream_options");
  check_error(post(port, "/v1/chat/completions",
                   {{"messages", {{{"role", "user"}, {"content", {{{"type", "video"}, {"video", "x"}}}}}}}}),
              400, "unsupported", "messages");
  check_error(post(port, "/v1/chat/completions", {{"messages", {{{"role", "wizard"}, {"content", "x"}}}}}), 400, "role");
  check_serving(port);

  Reply nm = post(port, "/v1/chat/completions", hello_chat({{"model", "gpt-4o"}}));
  check_error(nm, 404, "gpt-4o", "model");
  CHECK(nm.body["error"]["code"] == "model_not_found");
  check_error(get(port, "/v1/nothing-here"), 404, "/v1/nothing-here");
  check_error(post(port, "/v2/chat", hello_chat()), 404);
  check_serving(port);

  // The context is the tiny model's max_position_embeddings.
  Reply big = post(port, "/v1/chat/completions", hello_chat({{"max_tokens", 100000}}));
  check_error(big, 400, "maximum context length", "messages");
  CHECK(big.body["error"]["code"] == "context_length_exceeded");
  check_error(post(port, "/v1/completions", {{"prompt", {1, 2, 300000}}}), 400, "vocabulary", "prompt");

  // Media on a text-only server.
  check_error(post(port, "/v1/chat/completions",
                   {{"messages", {{{"role", "user"},
                                   {"content", {{{"type", "text"}, {"text", "what is this"}},
                                                {{"type", "image_url"},
                                                 {"image_url", {{"url", "data:image/png;base64,aGk="}}}}}}}}}}),
              400, "no image encoder");
  check_serving(port);
}

TEST_CASE("serve/http deep JSON nesting is refused while parsing, in every field, and the server keeps serving") {
  World& w = world();
  const int port = w.plain->port;
  // 20,000 levels in a 40 KB body: parsed iteratively, but printing or walking
  // it (tool schemas, tool-call arguments, error messages) would recurse per level.
  auto nest = [](int depth, char open, char close, const std::string& inner) {
    return std::string(size_t(depth), open) + inner + std::string(size_t(depth), close);
  };
  const std::string deep_array = nest(20000, '[', ']', "1");
  std::string deep_object;
  for (int i = 0; i < 20000; ++i) deep_object += "{\"a\":";
  deep_object += "1" + std::string(20000, '}');
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}], "max_tokens": 2)";
  const std::vector<std::pair<std::string, std::string>> bodies = {
      {"/v1/chat/completions", deep_array},
      {"/v1/chat/completions", "{" + msgs + R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": )" +
                                   deep_object + "}}]}"},
      {"/v1/chat/completions", R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": )" +
                                   deep_array + R"(}}]}, {"role": "user", "content": "x"}]})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": )" + deep_array + "}]}"},
      {"/v1/chat/completions", "{" + msgs + R"(, "logit_bias": )" + deep_object + "}"},
      {"/v1/completions", R"({"prompt": )" + deep_array + "}"},
      {"/tokenize", R"({"prompt": )" + deep_array + "}"},
  };
  for (const auto& [path, body] : bodies) {
    const auto& path_ = path;  // clang 14 cannot capture a structured binding
    CAPTURE(path_);
    const std::string body_ = body.substr(0, 120);  // clang 14 cannot capture a structured binding
    CAPTURE(body_);
    Reply r = send(port, "POST", path, body);
    check_error(r, 400, "more than 64 levels deep");
    CHECK(r.raw.size() < 1000);  // the error does not echo the element
  }
  // 64 levels are accepted by the parser (the field's own checks then answer).
  Reply ok = send(port, "POST", "/v1/chat/completions",
                  "{" + msgs + R"(, "metadata": )" + nest(63, '[', ']', "1") + "}");
  CHECK(ok.raw.find("levels deep") == std::string::npos);
  check_serving(port);
}

TEST_CASE("serve/http auth, body size, prompt limit and media errors on a strict server") {
  World& w = world();
  const int port = w.strict->port;
  Reply none = post(port, "/v1/chat/completions", hello_chat());
  check_error(none, 401, "API key");
  CHECK(none.body["error"]["type"] == "authentication_error");
  check_error(post(port, "/v1/chat/completions", hello_chat(), {{"Authorization", "Bearer wrong"}}), 401, "invalid");
  check_error(get(port, "/v1/models"), 401);
  CHECK(get(port, "/health").status == 200);  // liveness needs no key
  check_serving(port, kAuth);

  // Body over --max-body-mb (8 KiB here): 413 with an OpenAI body.
  json huge = hello_chat();
  huge["messages"][0]["content"] = std::string(20000, 'x');
  check_error(post(port, "/v1/chat/completions", huge, kAuth), 413, "limit");
  check_serving(port, kAuth);

  // Prompt over --max-prompt-tokens (24).
  json longp = hello_chat();
  std::string words;
  for (int i = 0; i < 40; ++i) words += " word";
  longp["messages"][0]["content"] = words;
  Reply lp = post(port, "/v1/chat/completions", longp, kAuth);
  check_error(lp, 400, "max-prompt-tokens", "messages");
  CHECK(lp.body["error"]["code"] == "context_length_exceeded");
  check_serving(port, kAuth);

  auto with_part = [](const json& part) {
    return hello_chat({{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "see"}}, part}}}}}});
  };
  auto image_url = [](const std::string& url) { return json{{"type", "image_url"}, {"image_url", {{"url", url}}}}; };
  const std::vector<uint8_t> bmp = tiny_bmp();
  const std::string bmp64 = encode_base64(bmp.data(), bmp.size());

  check_error(post(port, "/v1/chat/completions", with_part(image_url("data:image/png;base64,%%%%")), kAuth), 400,
              "base64");
  check_error(post(port, "/v1/chat/completions", with_part(image_url("data:image/png;base64,aGVsbG8gd29ybGQ=")), kAuth),
              400);  // decodes to "hello world": not an image
  check_error(post(port, "/v1/chat/completions", with_part(image_url("file:///etc/passwd")), kAuth), 400,
              "is not a readable file under the media root");
  check_error(post(port, "/v1/chat/completions", with_part(image_url("../../etc/passwd")), kAuth), 400);
  check_error(post(port, "/v1/chat/completions", with_part(image_url("https://example.com/cat.png")), kAuth), 400,
              "allow-remote-media");
  check_error(post(port, "/v1/chat/completions",
                   with_part({{"type", "input_audio"}, {"input_audio", {{"data", "aGk="}, {"format", "aiff"}}}}), kAuth),
              400, "aiff");
  check_error(post(port, "/v1/chat/completions",
                   with_part({{"type", "input_audio"}, {"input_audio", {{"data", "not base64!"}, {"format", "wav"}}}}),
                   kAuth),
              400, "base64");
  check_serving(port, kAuth);

  // A decodable image (data URL, then a file under the media root) is read,
  // decoded and counted by the processor: its placeholder tokens then exceed
  // this server's 24-token prompt limit, and the error tells the count.
  Reply plain_usage = post(port, "/v1/chat/completions",
                           hello_chat({{"messages", {{{"role", "user"}, {"content", "see"}}}}}), kAuth);
  REQUIRE(plain_usage.status == 200);
  // <|image_1|>\n prepended: the image's tokens + "\n".
  const int64_t want = plain_usage.body["usage"]["prompt_tokens"].get<int64_t>() + phi4mm::num_image_tokens(2, 2) + 1;
  const std::string counted = fmt::format("The prompt has {} tokens", want);
  check_error(post(port, "/v1/chat/completions", with_part(image_url("data:image/bmp;base64," + bmp64)), kAuth), 400,
              counted, "messages");
  {
    std::ofstream f(w.media_root / "dot.bmp", std::ios::binary);
    f.write(reinterpret_cast<const char*>(bmp.data()), std::streamsize(bmp.size()));
  }
  check_error(post(port, "/v1/chat/completions", with_part(image_url("dot.bmp")), kAuth), 400, counted);
  check_error(post(port, "/v1/chat/completions", with_part(image_url("file://" + (w.media_root / "dot.bmp").string())),
                   kAuth),
              400, counted);
}

TEST_CASE("serve/http 429 when the engine queue is full, 503 while draining") {
  World& w = world();
  EngineOptions eo;
  eo.max_queue = 1;
  eo.kv_blocks = 32;
  Engine idle(w.model, w.tokenizer, eo);  // not started: requests wait
  Request r;
  r.prompt = {24912};
  r.params.max_tokens = 1;
  int submitted = 0;
  for (int i = 0; i < 8; ++i) {
    try {
      idle.submit(r, [](const RequestOutput&) {});
      ++submitted;
    } catch (const QueueFull&) {
      break;
    }
  }
  REQUIRE(submitted >= 1);
  REQUIRE(submitted < 8);
  {
    Served s(idle, ServerOptions{});
    Reply q = post(s.port, "/v1/chat/completions", hello_chat());
    check_error(q, 429, "overloaded");
    CHECK(q.body["error"]["type"] == "rate_limit_error");
    idle.start();
    CHECK(wait_for([&] { return idle.stats().waiting == 0; }, 20));
    check_serving(s.port);

    s.server->begin_drain();
    Reply h = get(s.port, "/health");
    CHECK(h.status == 503);
    check_error(post(s.port, "/v1/chat/completions", hello_chat()), 503, "shutting down");
    CHECK(s.server->wait_idle(5));
  }
  idle.stop(true);
  check_serving(w.plain->port);
}

TEST_CASE("serve/http a client that disconnects mid-stream frees its sequence and KV blocks") {
  World& w = world();
  const EngineStats before = w.engine->stats();
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(w.plain->port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  const std::string body =
      hello_chat({{"max_tokens", 200}, {"ignore_eos", true}, {"stream", true}, {"temperature", 1}}).dump();
  const std::string req = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  REQUIRE(::send(fd, req.data(), req.size(), 0) == ssize_t(req.size()));
  // Read until a few content events arrived, then hang up.
  std::string got;
  char buf[4096];
  while (got.find("\"content\"") == std::string::npos || std::count(got.begin(), got.end(), '\n') < 12) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    REQUIRE(n > 0);
    got.append(buf, size_t(n));
  }
  CHECK(got.find("200 OK") != std::string::npos);
  // Stats are published per step: wait until they show the sequence.
  CHECK(wait_for([&] {
    const EngineStats s = w.engine->stats();
    return s.running == 1 && s.kv_blocks_used > 0;
  }, 20));
  ::close(fd);

  CHECK(wait_for([&] {
    const EngineStats s = w.engine->stats();
    return s.requests_aborted == before.requests_aborted + 1 && s.running == 0 && s.waiting == 0 &&
           s.kv_blocks_used == 0;
  }, 20));
  const EngineStats after = w.engine->stats();
  CHECK(after.requests_aborted == before.requests_aborted + 1);
  CHECK(after.generated_tokens - before.generated_tokens < 200);
  Reply x = get(w.plain->port, "/metrics");
  CHECK(x.raw.find("areno_kv_blocks_used 0\n") != std::string::npos);
  CHECK(x.raw.find("areno_requests_running 0\n") != std::string::npos);
  check_serving(w.plain->port);
}

TEST_CASE("serve/http dynamic_hd (--mm-processor-kwargs): an image's tokens follow the model's setting, or the request's") {
  auto mm = phi4mm::init_phi4mm("tiny", 0);
  mm->set_dynamic_hd(1);
  auto tokenizer = tokenizer_for(*mm);
  EngineOptions eo;
  eo.kv_blocks = 512;
  eo.prefill_chunk_tokens = 256;
  Engine engine(mm, tokenizer, eo);
  engine.start();
  Served served(engine, ServerOptions{});
  phi4mm::RgbImage im;
  im.width = 900, im.height = 500;  // 36 crops allowed: a 2x2 grid; 1: the global view and one crop
  for (int64_t i = 0; i < im.width * im.height * 3; ++i) im.rgb.push_back(uint8_t((i * 37) % 256));
  const std::vector<uint8_t> ppm = phi4mm::encode_ppm(im);
  const json messages = json::array(
      {{{"role", "user"},
        {"content", {{{"type", "image_url"},
                      {"image_url", {{"url", "data:image/x-portable-pixmap;base64," + encode_base64(ppm.data(), ppm.size())}}}},
                     {{"type", "text"}, {"text", "Describe it."}}}}}});
  const phi4mm::ProcessedChat pc = phi4mm::process_chat(*tokenizer, messages, nullptr, phi4mm::processor_options_for(*mm));
  const int64_t one = std::count(pc.prompt.ids.begin(), pc.prompt.ids.end(), phi4mm::kImageTokenId);
  CHECK(one == phi4mm::num_image_tokens(900, 500, phi4mm::image_options(1)));
  CHECK(one < phi4mm::num_image_tokens(900, 500));
  Reply r = post(served.port, "/v1/chat/completions", {{"messages", messages}, {"max_tokens", 2}});
  CAPTURE(r.raw);
  REQUIRE(r.status == 200);  // the tower gave as many rows as the placeholders
  CHECK(r.body["usage"]["prompt_tokens"] == int64_t(pc.prompt.ids.size()));
  CHECK(post(served.port, "/v1/chat/completions", {{"messages", messages}, {"max_tokens", 1},
                                                   {"mm_processor_kwargs", json::object()}}).status == 200);

  // Per request (vLLM's mm_processor_kwargs): the request's limit, through
  // the processor and the tower, greedy answers equal to a model set to it,
  // the same image cached apart under each limit.
  phi4mm::ProcessorOptions po4 = phi4mm::processor_options_for(*mm);
  po4.image_max_crops = 4;
  const int64_t four_len = int64_t(phi4mm::process_chat(*tokenizer, messages, nullptr, po4).prompt.ids.size());
  CHECK(four_len > int64_t(pc.prompt.ids.size()));
  const json ask4 = {{"messages", messages}, {"max_tokens", 4}, {"temperature", 0}, {"mm_processor_kwargs", {{"dynamic_hd", 4}}}};
  const json ask1 = {{"messages", messages}, {"max_tokens", 4}, {"temperature", 0}};
  Reply r4 = post(served.port, "/v1/chat/completions", ask4);
  CAPTURE(r4.raw);
  REQUIRE(r4.status == 200);
  CHECK(r4.body["usage"]["prompt_tokens"] == four_len);
  Reply r1 = post(served.port, "/v1/chat/completions", ask1);
  REQUIRE(r1.status == 200);
  CHECK(r1.body["usage"]["prompt_tokens"] == int64_t(pc.prompt.ids.size()));
  Reply r4again = post(served.port, "/v1/chat/completions", ask4);  // from the media cache
  REQUIRE(r4again.status == 200);
  CHECK(r4again.body["choices"][0]["message"] == r4.body["choices"][0]["message"]);
  // /tokenize and the Responses API take it too.
  Reply t4 = post(served.port, "/tokenize", {{"messages", messages}, {"mm_processor_kwargs", {{"dynamic_hd", 4}}}});
  REQUIRE(t4.status == 200);
  CHECK(t4.body["count"] == four_len);
  const json& url = messages[0]["content"][0]["image_url"]["url"];
  Reply resp4 = post(served.port, "/v1/responses",
                     {{"input", {{{"role", "user"}, {"content", {{{"type", "input_image"}, {"image_url", url}},
                                                                 {{"type", "input_text"}, {"text", "Describe it."}}}}}}},
                      {"max_output_tokens", 4}, {"temperature", 0}, {"mm_processor_kwargs", {{"dynamic_hd", 4}}}});
  REQUIRE(resp4.status == 200);
  CHECK(resp4.body["usage"]["input_tokens"] == four_len);
  CHECK(resp4.body["output"][0]["content"][0]["text"] == r4.body["choices"][0]["message"]["content"]);
  {
    // The same answer from a model whose own setting is 4 (no media cache: the tower runs).
    auto mm4 = phi4mm::init_phi4mm("tiny", 0);
    mm4->set_dynamic_hd(4);
    EngineOptions eo4 = eo;
    eo4.media_cache_bytes = 0;
    Engine engine4(mm4, tokenizer, eo4);
    engine4.start();
    Served served4(engine4, ServerOptions{});
    Reply m4 = post(served4.port, "/v1/chat/completions", ask1);
    REQUIRE(m4.status == 200);
    CHECK(m4.body["usage"]["prompt_tokens"] == four_len);
    CHECK(m4.body["choices"][0]["message"] == r4.body["choices"][0]["message"]);
  }
  for (const json& bad : {json{{"dynamic_hd", 0}}, json{{"dynamic_hd", 65}}, json{{"dynamic_hd", "4"}},
                          json{{"num_crops", 2}}, json::array({4})}) {
    CAPTURE(bad);
    Reply e = post(served.port, "/v1/chat/completions", {{"messages", messages}, {"mm_processor_kwargs", bad}});
    CHECK(e.status == 400);
    CHECK(e.body["error"]["param"].get<std::string>().rfind("mm_processor_kwargs", 0) == 0);
  }
}

TEST_CASE("serve/http image, audio and image+audio requests through the real towers") {
  // The demo model with every component: SigLIP + Conformer towers and projectors.
  auto mm = phi4mm::init_phi4mm("tiny", 0);
  auto tokenizer = tokenizer_for(*mm);
  EngineOptions eo;
  eo.kv_blocks = 512;
  eo.prefill_chunk_tokens = 128;
  EngineOptions cached = eo;  // areno serve's defaults: the prefix and media caches on
  cached.prefix_caching = true;
  cached.media_cache_bytes = size_t(64) << 20;
  Engine engine(mm, tokenizer, cached);
  engine.start();
  Served served(engine, ServerOptions{});

  phi4mm::RgbImage im;
  im.width = 70, im.height = 40;
  for (int64_t i = 0; i < im.width * im.height * 3; ++i) im.rgb.push_back(uint8_t((i * 37) % 256));
  const std::vector<uint8_t> ppm = phi4mm::encode_ppm(im);
  std::ifstream f("tests/data/audio/speech_16k_mono.wav", std::ios::binary);
  const std::vector<uint8_t> wav((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  REQUIRE(wav.size() > 1000);
  const json image_part = {{"type", "image_url"},
                           {"image_url", {{"url", "data:image/x-portable-pixmap;base64," + encode_base64(ppm.data(), ppm.size())}}}};
  const json audio_part = {{"type", "input_audio"},
                           {"input_audio", {{"data", encode_base64(wav.data(), wav.size())}, {"format", "wav"}}}};
  const json text_part = {{"type", "text"}, {"text", "Describe it."}};
  for (const json& parts : {json::array({image_part, text_part}), json::array({audio_part, text_part}),
                            json::array({image_part, audio_part, text_part})}) {
    const json messages = json::array({{{"role", "user"}, {"content", parts}}});
    // Expected: the same request straight through the engine API.
    phi4mm::ProcessedChat pc = phi4mm::process_chat(*tokenizer, messages, nullptr, phi4mm::processor_options_for(*mm));
    const int64_t n_prompt = int64_t(pc.prompt.ids.size());
    Request r;
    r.prompt = pc.ids();
    r.adapter = pc.adapter;
    r.media = std::move(pc.media);
    r.params.temperature = 1.0;
    r.params.seed = 42;
    r.params.max_tokens = 6;
    r.params.ignore_eos = true;
    Engine solo(mm, tokenizer, eo);
    const auto want = generate(solo, {r})[0][0];

    const json body = {{"messages", messages}, {"max_tokens", 6}, {"temperature", 1.0}, {"seed", 42},
                       {"ignore_eos", true}};
    for (int twice = 0; twice < 2; ++twice) {  // the second from the media and prefix caches
      CAPTURE(twice);
      Reply rep = send(served.port, "POST", "/v1/chat/completions", body.dump());
      CAPTURE(rep.raw);
      REQUIRE(rep.status == 200);
      CHECK(rep.body["usage"]["prompt_tokens"] == n_prompt);
      CHECK(rep.body["usage"]["completion_tokens"] == 6);
      CHECK(rep.body["choices"][0]["message"]["content"] == want.text);
    }
  }
  const std::string metrics = get(served.port, "/metrics").raw;
  // Per item: the image (then the second time), the clip (then again), and
  // beside the image the kept image and a clip in the vision projector's mode
  // (encoded), then both again: 1 + 1 + 1 + 2 hits, 3 items encoded.
  CHECK(metrics.find("areno_media_cache_hits_total 5") != std::string::npos);
  CHECK(engine.stats().media_items_total == 3);
  CHECK(engine.stats().prefix_cache_hits > 0);
  engine.stop(true);
  CHECK(engine.stats().kv_blocks_used == 0);
}

TEST_CASE("serve/http X-Request-Id on every response (the client's when valid) and the access log") {
  std::signal(SIGPIPE, SIG_IGN);
  auto model = phi4mm::init_model("tiny", 0);
  Engine engine(model, tokenizer_for(*model), EngineOptions{});
  engine.start();
  std::mutex mu;
  std::vector<std::string> lines;
  ServerOptions so;
  so.access_log = [&](const std::string& line) {
    std::lock_guard<std::mutex> lk(mu);
    lines.push_back(line);
  };
  Served served(engine, so);
  httplib::Client cli("127.0.0.1", served.port);
  // Generated: req- and 32 hex digits, a new one each time.
  auto a = cli.Get("/health");
  auto b = cli.Get("/health");
  REQUIRE(a);
  REQUIRE(b);
  const std::string ida = a->get_header_value("X-Request-Id"), idb = b->get_header_value("X-Request-Id");
  CHECK(ida.size() == 4 + 32);
  CHECK(ida.rfind("req-", 0) == 0);
  CHECK(ida != idb);
  // The client's, when valid; replaced when not.
  auto own = cli.Post("/v1/chat/completions", {{"X-Request-Id", "job-7.step:3"}},
                      R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})", "application/json");
  REQUIRE(own);
  CHECK(own->status == 200);
  CHECK(own->get_header_value("X-Request-Id") == "job-7.step:3");
  auto bad = cli.Get("/nowhere", {{"X-Request-Id", "has space"}});
  REQUIRE(bad);
  CHECK(bad->status == 404);
  CHECK(bad->get_header_value("X-Request-Id").rfind("req-", 0) == 0);
  auto longer = cli.Get("/health", {{"X-Request-Id", std::string(129, 'a')}});
  REQUIRE(longer);
  CHECK(longer->get_header_value("X-Request-Id").rfind("req-", 0) == 0);
  // A stream is logged at its end: the time to it, and to its headers.
  auto streamed = cli.Post("/v1/chat/completions", {{"X-Request-Id", "streamed"}},
                           R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": true})",
                           "application/json");
  REQUIRE(streamed);
  CHECK(streamed->body.find("[DONE]") != std::string::npos);
  CHECK(wait_for([&] {
    std::lock_guard<std::mutex> lk(mu);
    return lines.size() == 6;
  }, 20));
  // One cut short by its client.
  {
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/chat/completions";
    req.set_header("X-Request-Id", "gone");
    req.set_header("Content-Type", "application/json");
    req.body = R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": true,
                   "stream": true})";
    req.content_receiver = [](const char*, size_t, uint64_t, uint64_t) { return false; };  // hang up at once
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    cli.send(req, res, err);
  }
  CHECK(wait_for([&] {
    std::lock_guard<std::mutex> lk(mu);
    return lines.size() == 7;
  }, 30));
  // One line per request, in order, naming the id, the route and the status.
  std::lock_guard<std::mutex> lk(mu);
  REQUIRE(lines.size() == 7);
  CHECK(lines[6].find("gone 127.0.0.1 \"POST /v1/chat/completions\" 200 ") != std::string::npos);
  CHECK(lines[6].find("(stream cut short: the client went away") != std::string::npos);
  CHECK(lines[5].find("streamed 127.0.0.1 \"POST /v1/chat/completions\" 200 ") != std::string::npos);
  CHECK(lines[5].find(" ms (stream; headers at ") != std::string::npos);
  {
    const size_t at = lines[5].find("\" 200 ") + 6;
    const double total = std::stod(lines[5].substr(at));
    const double headers = std::stod(lines[5].substr(lines[5].find("headers at ") + 11));
    CHECK(total >= headers);
  }
  CHECK(lines[0].find(ida + " 127.0.0.1 \"GET /health\" 200 ") != std::string::npos);
  CHECK(lines[2].find("job-7.step:3 127.0.0.1 \"POST /v1/chat/completions\" 200 ") != std::string::npos);
  CHECK(lines[3].find("\"GET /nowhere\" 404 ") != std::string::npos);
  CHECK(lines[0].size() > 20);
  CHECK(lines[0][4] == '-');  // 2026-...
  CHECK(lines[0].back() == 's');  // "... ms"
  // Client text cannot forge a line; outside a request nothing is tagged.
  CHECK(log_printable("GET /a\r\nforged 200") == "GET /a\\x0d\\x0aforged 200");
  CHECK(log_printable(std::string(600, 'p'), 512) == std::string(512, 'p') + "...");
  CHECK(request_tag().empty());
  current_request().id = "job-1";
  CHECK(request_tag() == " [request job-1]");
  current_request().id.clear();
}
