// OpenAI request validation, response objects, tool-call parsing and media
// reading rules (serve/openai.h, models/phi4mm/processor/media_source.h), without HTTP.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "models/phi4mm/processor/media_source.h"
#include "serve/openai.h"

using namespace areno;
using namespace areno::serve;
using areno::phi4mm::MediaKind;
using areno::phi4mm::decode_base64;
using areno::phi4mm::encode_base64;
using nlohmann::json;

namespace {

const tok::Tokenizer& tokenizer() {
  static tok::Tokenizer t = phi4mm::make_tokenizer();
  return t;
}

json chat(json extra = json::object()) {
  json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  for (auto it = extra.begin(); it != extra.end(); ++it) body[it.key()] = it.value();
  return body;
}

// The ApiError a parse throws (status 0 when none).
ApiError chat_error(const json& body) {
  try {
    parse_chat_request(body, ApiLimits{});
  } catch (const ApiError& e) {
    return e;
  }
  return ApiError(0, "no error");
}
ApiError completion_error(const json& body) {
  try {
    parse_completion_request(body, ApiLimits{});
  } catch (const ApiError& e) {
    return e;
  }
  return ApiError(0, "no error");
}

}  // namespace

TEST_CASE("serve/openai chat defaults: OpenAI values and the server's max tokens") {
  ApiLimits lim;
  lim.default_max_tokens = 77;
  ApiRequest r = parse_chat_request(chat({{"model", "m"}, {"unknown_field", {1, 2}}}), lim);
  CHECK(r.kind == ApiKind::chat);
  CHECK(r.model == "m");
  CHECK(r.params.max_tokens == 77);
  CHECK_FALSE(r.max_tokens_given);
  CHECK(r.params.temperature == 1.0);
  CHECK(r.params.top_p == 1.0);
  CHECK(r.params.n == 1);
  CHECK(r.params.logprobs == -1);
  CHECK(r.params.skip_special_tokens);
  CHECK_FALSE(r.stream);
  CHECK(r.tools.is_null());
}

TEST_CASE("serve/openai continue_final_message and chat echo (vLLM's)") {
  const json conv = json::array({{{"role", "user"}, {"content", "Hi"}},
                                 {{"role", "assistant"}, {"content", json::array({{{"type", "text"}, {"text", "A"}},
                                                                                  {{"type", "text"}, {"text", "B"}}})}}});
  ApiRequest r = parse_chat_request({{"messages", conv}, {"add_generation_prompt", false},
                                     {"continue_final_message", true}, {"echo", true}}, {});
  CHECK(r.continue_final_message);
  CHECK_FALSE(r.add_generation_prompt);
  CHECK(r.chat_echo);
  CHECK(r.echo_prefix == "A\nB");
  // Both true: refused, naming the field.
  try {
    parse_chat_request({{"messages", conv}, {"continue_final_message", true}}, {});
    FAIL("accepted");
  } catch (const ApiError& e) {
    CHECK(e.status == 400);
    CHECK(e.param == "continue_final_message");
  }
  // echo only repeats an assistant's last message.
  CHECK_FALSE(parse_chat_request({{"messages", json::array({{{"role", "user"}, {"content", "Hi"}}})}, {"echo", true}}, {})
                  .chat_echo);
  // The response: the prefix before the generated text.
  ChoiceOutput c;
  c.text = "C";
  c.finish = FinishReason::stop;
  const json resp = chat_response({"id", 1, "m"}, r, tokenizer(), {c}, Usage{});
  CHECK(resp["choices"][0]["message"]["content"] == "A\nBC");
}

TEST_CASE("serve/openai chat fields map onto SamplingParams (OpenAI and vLLM extensions)") {
  ApiRequest r = parse_chat_request(
      chat({{"max_completion_tokens", 5}, {"max_tokens", 9}, {"temperature", 0}, {"top_p", 0.5}, {"n", 3},
            {"stop", {"a", "bc"}}, {"seed", 42}, {"logprobs", true}, {"top_logprobs", 4},
            {"presence_penalty", 0.5}, {"frequency_penalty", -1}, {"logit_bias", {{"100", 5}, {"7", -100}}},
            {"top_k", 20}, {"min_p", 0.1}, {"repetition_penalty", 1.2}, {"min_tokens", 2}, {"ignore_eos", true},
            {"stop_token_ids", {13}}, {"skip_special_tokens", false}, {"include_stop_str_in_output", true},
            {"stream", true}, {"stream_options", {{"include_usage", true}}}, {"cache_salt", "tenant-7"}}),
      ApiLimits{});
  CHECK(r.cache_salt == "tenant-7");
  const SamplingParams& p = r.params;
  CHECK(p.max_tokens == 5);  // max_completion_tokens wins
  CHECK(r.max_tokens_given);
  CHECK(p.temperature == 0);
  CHECK(p.top_p == 0.5);
  CHECK(p.n == 3);
  CHECK(p.stop == std::vector<std::string>{"a", "bc"});
  CHECK(p.seed == 42u);
  CHECK(p.logprobs == 4);
  CHECK(p.presence_penalty == 0.5);
  CHECK(p.frequency_penalty == -1);
  CHECK(p.logit_bias.size() == 2);
  CHECK(p.top_k == 20);
  CHECK(p.min_p == doctest::Approx(0.1));
  CHECK(p.repetition_penalty == doctest::Approx(1.2));
  CHECK(p.min_tokens == 2);
  CHECK(p.ignore_eos);
  CHECK(p.stop_token_ids == std::vector<int64_t>{13});
  CHECK_FALSE(p.skip_special_tokens);
  CHECK(p.include_stop_str_in_output);
  CHECK(r.stream);
  CHECK(r.include_usage);
  CHECK_NOTHROW(validate(p, 200064));
}

TEST_CASE("serve/openai chat validation: every bad field is a 400 naming it") {
  struct Case {
    json extra;
    const char* param;
  };
  const Case cases[] = {
      {{{"temperature", 2.5}}, "temperature"},
      {{{"temperature", "hot"}}, "temperature"},
      {{{"top_p", 0}}, "top_p"},
      {{{"n", 0}}, "n"},
      {{{"n", 1000}}, "n"},
      {{{"n", 1.5}}, "n"},
      {{{"max_tokens", 0}}, "max_tokens"},
      {{{"max_tokens", "ten"}}, "max_tokens"},
      {{{"stop", {"a", "b", "c", "d", "e"}}}, "stop"},
      {{{"stop", 3}}, "stop"},
      {{{"top_logprobs", 2}}, "top_logprobs"},
      {{{"logprobs", true}, {"top_logprobs", 21}}, "top_logprobs"},
      {{{"logprobs", 1}}, "logprobs"},
      {{{"stream_options", {{"include_usage", true}}}}, "stream_options"},
      {{{"presence_penalty", 3}}, "presence_penalty"},
      {{{"logit_bias", {{"abc", 1}}}}, "logit_bias"},
      {{{"logit_bias", {{"5", 101}}}}, "logit_bias"},
      {{{"logit_bias", {{"300000", 1}}}}, "logit_bias"},
      {{{"stop_token_ids", {-1}}}, "stop_token_ids"},
      {{{"repetition_penalty", 0}}, "repetition_penalty"},
      {{{"min_tokens", 9}, {"max_tokens", 3}}, "min_tokens"},
      {{{"tools", json::array()}}, "tools"},
      {{{"tool_choice", "auto"}}, "tool_choice"},
      {{{"response_format", {{"type", "json_schema"}}}}, "response_format.json_schema"},
      {{{"response_format", {{"type", "yaml"}}}}, "response_format"},
      {{{"model", 3}}, "model"},
      {{{"cache_salt", ""}}, "cache_salt"},
      {{{"cache_salt", 7}}, "cache_salt"},
      {{{"cache_salt", std::string(1025, 'x')}}, "cache_salt"},
      {{{"stream", "yes"}}, "stream"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.extra.dump());
    ApiError e = chat_error(chat(c.extra));
    CHECK(e.status == 400);
    CHECK(e.param == c.param);
  }
  CHECK(chat_error(json{{"messages", json::array()}}).param == "messages");
  CHECK(chat_error(json{{"messages", "hi"}}).param == "messages");
  // Integers past int64 are refused as sent, never wrapped into negative numbers.
  for (const char* key : {"max_tokens", "seed", "n", "min_tokens", "top_k"}) {
    for (const std::string big : {"9223372036854775808", "18446744073709551615"}) {
      CAPTURE(key);
      const json body = json::parse(std::string("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"") + key +
                                    "\": " + big + "}");
      ApiError e = chat_error(body);
      CHECK(e.status == 400);
      CHECK(e.param == key);
      CHECK(std::string(e.what()).find(big) != std::string::npos);
      CHECK(std::string(e.what()).find("-9") == std::string::npos);
      CHECK(std::string(e.what()).find("-1") == std::string::npos);
    }
  }
  CHECK(chat_error(json::object()).param == "messages");
  CHECK(chat_error(json::array()).status == 400);
}

TEST_CASE("serve/openai error bodies have OpenAI's shape") {
  json b = error_body(ApiError(404, "The model `x` does not exist.", "model", "model_not_found"));
  CHECK(b["error"]["message"] == "The model `x` does not exist.");
  CHECK(b["error"]["type"] == "invalid_request_error");
  CHECK(b["error"]["param"] == "model");
  CHECK(b["error"]["code"] == "model_not_found");
  json c = error_body(ApiError(429, "busy"));
  CHECK(c["error"]["type"] == "rate_limit_error");
  CHECK(c["error"]["param"].is_null());
  CHECK(c["error"]["code"].is_null());
  CHECK(std::string(error_type(401)) == "authentication_error");
  CHECK(std::string(error_type(503)) == "service_unavailable_error");
}

TEST_CASE("serve/openai completions: prompt forms, default 16 tokens, echo + logprobs scores the prompt") {
  ApiRequest r = parse_completion_request({{"prompt", "hello"}}, ApiLimits{});
  CHECK(r.params.max_tokens == 16);
  CHECK(r.prompts.size() == 1);
  r = parse_completion_request({{"prompt", {1, 2, 3}}, {"echo", true}, {"logprobs", 2}, {"max_tokens", 0}}, ApiLimits{});
  CHECK(r.prompts.size() == 1);
  CHECK(r.params.max_tokens == 0);
  CHECK(r.params.prompt_logprobs == 2);
  CHECK(r.params.logprobs == 2);
  r = parse_completion_request({{"prompt", {{1, 2}, {3}}}}, ApiLimits{});
  CHECK(r.prompts.size() == 2);
  r = parse_completion_request({{"prompt", {"a", "b", "c"}}, {"n", 2}}, ApiLimits{});
  CHECK(r.prompts.size() == 3);
  const auto ids = completion_prompt_ids(r, tokenizer(), 200064);
  CHECK(ids.size() == 3);
  CHECK(ids[0] == std::vector<int64_t>{64});  // "a"

  CHECK(completion_error({{"prompt", "x"}, {"max_tokens", 0}}).param == "max_tokens");  // 0 only with echo
  CHECK(completion_error({{"prompt", "x"}, {"logprobs", true}}).param == "logprobs");
  CHECK(completion_error({{"prompt", "x"}, {"logprobs", 21}}).param == "logprobs");
  CHECK(completion_error({{"prompt", 5}}).param == "prompt");
  CHECK(completion_error({{"prompt", json::array()}}).param == "prompt");
  CHECK(completion_error({{"prompt", {"a", 1}}}).param == "prompt");
  CHECK(completion_error(json::object()).param == "prompt");
  CHECK(completion_error({{"prompt", "x"}, {"suffix", "y"}}).param == "suffix");

  ApiRequest bad = parse_completion_request({{"prompt", {1, 300000}}}, ApiLimits{});
  CHECK_THROWS_AS(completion_prompt_ids(bad, tokenizer(), 200064), ApiError);
  ApiRequest empty = parse_completion_request({{"prompt", ""}}, ApiLimits{});
  CHECK_THROWS_AS(completion_prompt_ids(empty, tokenizer(), 200064), ApiError);
}

TEST_CASE("serve/openai chat response: message, finish and stop reasons, usage, logprobs") {
  ApiRequest r = parse_chat_request(chat({{"logprobs", true}, {"top_logprobs", 1}, {"stop", "xy"}}), ApiLimits{});
  std::vector<ChoiceOutput> choices(2);
  RequestOutput o;
  o.tokens = {24912};
  o.text = "hello";
  o.logprobs = {TokenLogprob{24912, -0.5f, {{24912, -0.5f}, {2375, -1.5f}}}};
  o.finish = FinishReason::stop;
  o.stop_reason = "200020";
  choices[0].add(o);
  o.stop_reason = "xy";
  choices[1].add(o);
  Usage u{10, 2};
  json j = chat_response({"chatcmpl-1", 5, "m"}, r, tokenizer(), choices, u);
  CHECK(j["object"] == "chat.completion");
  CHECK(j["choices"].size() == 2);
  CHECK(j["choices"][0]["message"]["role"] == "assistant");
  CHECK(j["choices"][0]["message"]["content"] == "hello");
  CHECK(j["choices"][0]["finish_reason"] == "stop");
  CHECK(j["choices"][0]["stop_reason"] == 200020);
  CHECK(j["choices"][1]["stop_reason"] == "xy");
  CHECK(j["usage"]["total_tokens"] == 12);
  const json& lp = j["choices"][0]["logprobs"]["content"];
  REQUIRE(lp.size() == 1);
  CHECK(lp[0]["token"] == "hello");
  CHECK(lp[0]["logprob"].get<double>() == doctest::Approx(-0.5));
  CHECK(lp[0]["bytes"] == json::array({104, 101, 108, 108, 111}));
  CHECK(lp[0]["top_logprobs"].size() == 1);
}

TEST_CASE("serve/openai legacy completion logprobs: echo entries first, the first one null") {
  std::vector<std::optional<TokenLogprob>> plp = {std::nullopt, TokenLogprob{2375, -2.0f, {{2375, -2.0f}}}};
  std::vector<TokenLogprob> gen = {TokenLogprob{13, -0.25f, {{13, -0.25f}}}};
  json j = completion_logprobs_json(tokenizer(), {24912, 2375}, plp, gen, false);
  CHECK(j["tokens"] == json::array({"hello", " world", "."}));
  CHECK(j["token_logprobs"][0].is_null());
  CHECK(j["token_logprobs"][1].get<double>() == -2.0);
  CHECK(j["top_logprobs"][0].is_null());
  CHECK(j["top_logprobs"][2]["."].get<double>() == -0.25);
  CHECK(j["text_offset"] == json::array({0, 5, 11}));
}

TEST_CASE("serve/openai SSE framing and chunk objects") {
  ResponseHeader h{"chatcmpl-x", 1, "m"};
  CHECK(sse_event(json{{"a", 1}}) == "data: {\"a\":1}\n\n");
  json c = chat_chunk(h, 2, {{"content", "hi"}});
  CHECK(c["object"] == "chat.completion.chunk");
  CHECK(c["choices"][0]["index"] == 2);
  CHECK(c["choices"][0]["finish_reason"].is_null());
  json u = usage_chunk(h, ApiKind::chat, Usage{3, 4});
  CHECK(u["choices"].empty());
  CHECK(u["usage"]["total_tokens"] == 7);
  CHECK(std::string(kSseDone) == "data: [DONE]\n\n");
  // Invalid UTF-8 never throws.
  CHECK(dump_json(json(std::string("\xff"))) == "\"\xEF\xBF\xBD\"");
}

TEST_CASE("serve/openai tool calls: <|tool_call|> and functools[...] become tool_calls (spec 5.2)") {
  const json tools = {{{"type", "function"}, {"function", {{"name", "get_weather"}}}}};
  ToolCallParse a = parse_tool_calls(
      "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]<|/tool_call|>", tools);
  REQUIRE(a.found);
  CHECK(a.content.is_null());
  CHECK(a.tool_calls[0]["type"] == "function");
  CHECK(a.tool_calls[0]["function"]["name"] == "get_weather");
  CHECK(a.tool_calls[0]["function"]["arguments"] == "{\"city\":\"Paris\"}");
  CHECK(a.tool_calls[0]["id"].get<std::string>().rfind("call_", 0) == 0);

  ToolCallParse b = parse_tool_calls("Sure. functools[{\"name\": \"get_weather\", \"parameters\": {\"d\": [1, 2]}}]", tools);
  REQUIRE(b.found);
  CHECK(b.content == "Sure.");
  CHECK(b.tool_calls[0]["function"]["arguments"] == "{\"d\":[1,2]}");

  CHECK_FALSE(parse_tool_calls("<|tool_call|>[{\"name\": \"other\", \"arguments\": {}}]<|/tool_call|>", tools).found);
  CHECK_FALSE(parse_tool_calls("<|tool_call|>[{\"name\": \"get_weather\"<|/tool_call|>", tools).found);
  CHECK_FALSE(parse_tool_calls("just text", tools).found);
  CHECK(parse_tool_calls("just text", tools).content == "just text");

  // Streaming (ToolCallStreamer): content is released as soon as it cannot
  // begin a call, a call anywhere in the reply is held and parsed at the end,
  // and text without a call comes out whole under any chunking.
  {
    ToolCallStreamer ts;
    std::string content;
    for (const char* piece : {"Let me ", "check. <|tool", "_call|>[{\"name\": \"get_weather\", \"arguments\": {}}]",
                              "<|/tool_call|>"})
      content += ts.push(piece);
    CHECK(content == "Let me check.");
    const ToolCallParse end = ts.finish(tools);
    REQUIRE(end.found);
    CHECK(end.tool_calls[0]["function"]["name"] == "get_weather");
    CHECK(end.content.is_null());
    ToolCallStreamer f;
    CHECK(f.push("functools") == "");  // could still be the marker
    CHECK(f.push("[{\"name\": \"get_weather\", \"arguments\": {}}] done") == "");
    const ToolCallParse fe = f.finish(tools);
    REQUIRE(fe.found);
    CHECK(fe.content == "done");
  }
  for (const std::string& text : {std::string("a < b and <|x|> then functools"), std::string("  spaced \n out  "),
                                 std::string("<|tool_call|>[{\"name\": \"nope\"}]<|/tool_call|> tail"),
                                 std::string("hi \n<|tool_call|>[{bad")}) {
    for (size_t step : {size_t(1), size_t(2), size_t(5), size_t(64)}) {
      CAPTURE(text);
      CAPTURE(step);
      ToolCallStreamer ts;
      std::string out;
      for (size_t i = 0; i < text.size(); i += step) out += ts.push(std::string_view(text).substr(i, step));
      const ToolCallParse end = ts.finish(tools);
      CHECK_FALSE(end.found);
      if (end.content.is_string()) out += end.content.get<std::string>();
      CHECK(out == text);  // no call: the text comes out as it went in
    }
  }

  ApiRequest r = parse_chat_request(chat({{"tools", tools}}), ApiLimits{});
  CHECK(r.tool_choice == "auto");
  CHECK(r.forced_tools.empty());
  // The forced tools the grammar gets: every tool for "required", the named one.
  std::vector<std::string> all;
  for (const json& t : tools) all.push_back(t["function"]["name"]);
  CHECK(parse_chat_request(chat({{"tools", tools}, {"tool_choice", "required"}}), ApiLimits{}).forced_tools == all);
  CHECK(parse_chat_request(chat({{"tools", tools}, {"tool_choice", {{"type", "function"}, {"function", {{"name", all.back()}}}}}}),
                           ApiLimits{})
            .forced_tools == std::vector<std::string>{all.back()});
  CHECK(parse_chat_request(chat({{"tools", tools}, {"tool_choice", "none"}}), ApiLimits{}).forced_tools.empty());
  CHECK(parse_chat_request(chat({{"response_format", {{"type", "json_object"}}}}), ApiLimits{}).json_object);
  std::vector<ChoiceOutput> choices(1);
  choices[0].text = "functools[{\"name\": \"get_weather\", \"arguments\": {}}]";
  choices[0].finish = FinishReason::stop;
  json j = chat_response({"c", 0, "m"}, r, tokenizer(), choices, Usage{});
  CHECK(j["choices"][0]["finish_reason"] == "tool_calls");
  CHECK(j["choices"][0]["message"]["content"].is_null());
  CHECK(j["choices"][0]["message"]["tool_calls"].size() == 1);
}

TEST_CASE("processor/media_source base64: strict decoding, round trip") {
  const std::string s = "hello, world!";
  const std::string b = encode_base64(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  CHECK(b == "aGVsbG8sIHdvcmxkIQ==");
  auto d = decode_base64(b);
  CHECK(std::string(d.begin(), d.end()) == s);
  d = decode_base64("aGVs\nbG8");  // whitespace ignored, padding optional
  CHECK(std::string(d.begin(), d.end()) == "hello");
  CHECK_THROWS_AS(decode_base64("aGV*bG8="), std::invalid_argument);
  CHECK_THROWS_AS(decode_base64("a"), std::invalid_argument);
  CHECK_THROWS_AS(decode_base64("aG==VsbG8"), std::invalid_argument);
}

TEST_CASE("processor/media_source local files only under the media root, symlinks resolved") {
  namespace fs = std::filesystem;
  const fs::path base = fs::temp_directory_path() / ("areno_media_test_" + std::to_string(::getpid()));
  fs::remove_all(base);
  fs::create_directories(base / "root" / "sub");
  std::ofstream(base / "root" / "sub" / "a.bin") << "abc";
  std::ofstream(base / "secret.bin") << "secret";
  fs::create_symlink(base / "secret.bin", base / "root" / "link.bin");
  const std::string root = (base / "root").string();

  CHECK(phi4mm::resolve_under_root(root, "sub/a.bin", "p") == fs::canonical(base / "root" / "sub" / "a.bin").string());
  CHECK_THROWS_AS(phi4mm::resolve_under_root(root, "../secret.bin", "p"), phi4mm::ProcessorError);
  CHECK_THROWS_AS(phi4mm::resolve_under_root(root, "sub/../../secret.bin", "p"), phi4mm::ProcessorError);
  CHECK_THROWS_AS(phi4mm::resolve_under_root(root, "link.bin", "p"), phi4mm::ProcessorError);
  CHECK_THROWS_AS(phi4mm::resolve_under_root(root, (base / "secret.bin").string(), "p"), phi4mm::ProcessorError);
  CHECK_THROWS_AS(phi4mm::resolve_under_root("", "sub/a.bin", "p"), phi4mm::ProcessorError);

  phi4mm::MediaSource o;
  o.media_root = root;
  const json part = {{"type", "image_url"}, {"image_url", {{"url", "file://" + root + "/sub/a.bin"}}}};
  auto bytes = phi4mm::read_media_part(part, MediaKind::kImage, "m", o);
  CHECK(std::string(bytes.begin(), bytes.end()) == "abc");
  const json outside = {{"type", "image_url"}, {"image_url", {{"url", "file://" + root + "/../secret.bin"}}}};
  CHECK_THROWS_AS(phi4mm::read_media_part(outside, MediaKind::kImage, "m", o), phi4mm::ProcessorError);
  o.max_bytes = 2;
  CHECK_THROWS_AS(phi4mm::read_media_part(part, MediaKind::kImage, "m", o), phi4mm::ProcessorError);
  fs::remove_all(base);
}

TEST_CASE("processor/media_source data URLs, input_audio and remote URLs") {
  phi4mm::MediaSource o;
  auto get = [&](const json& part, MediaKind k) { return phi4mm::read_media_part(part, k, "messages[0].content", o); };
  auto b = get({{"type", "image_url"}, {"image_url", {{"url", "data:image/png;base64,aGk="}}}}, MediaKind::kImage);
  CHECK(std::string(b.begin(), b.end()) == "hi");
  b = get({{"type", "input_audio"}, {"input_audio", {{"data", "aGk="}, {"format", "wav"}}}}, MediaKind::kAudio);
  CHECK(std::string(b.begin(), b.end()) == "hi");
  CHECK_THROWS_AS(get({{"type", "image_url"}, {"image_url", {{"url", "data:image/png,hi"}}}}, MediaKind::kImage), phi4mm::ProcessorError);
  CHECK_THROWS_AS(get({{"type", "image_url"}, {"image_url", {{"url", "data:image/png;base64,@@"}}}}, MediaKind::kImage),
                  phi4mm::ProcessorError);
  CHECK_THROWS_AS(get({{"type", "input_audio"}, {"input_audio", {{"data", "aGk="}, {"format", "aiff"}}}}, MediaKind::kAudio),
                  phi4mm::ProcessorError);
  CHECK_THROWS_AS(get({{"type", "input_audio"}, {"input_audio", {{"data", "!!"}, {"format", "wav"}}}}, MediaKind::kAudio),
                  phi4mm::ProcessorError);
  CHECK_THROWS_AS(get({{"type", "audio_url"}, {"audio_url", {{"url", "http://127.0.0.1:1/a.wav"}}}}, MediaKind::kAudio),
                  phi4mm::ProcessorError);  // remote media off
  CHECK_THROWS_AS(get({{"type", "image_url"}, {"image_url", {{"url", "ftp://x/y.png"}}}}, MediaKind::kImage), phi4mm::ProcessorError);
  CHECK_THROWS_AS(get({{"type", "image_url"}, {"image_url", {{"url", "/etc/passwd"}}}}, MediaKind::kImage),
                  phi4mm::ProcessorError);  // no media root
  try {
    get({{"type", "image_url"}, {"image_url", {{"url", "data:image/png;base64,@@"}}}}, MediaKind::kImage);
  } catch (const phi4mm::ProcessorError& e) {
    CHECK(std::string(e.what()).find("base64") != std::string::npos);
    CHECK(e.field() == "messages[0].content.image_url.url");
  }
}
