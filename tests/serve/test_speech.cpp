// OpenAI's speech-to-text routes (serve/speech.h): the form's checks, the
// prompt (the model card's ASR prompt, spec tokens-api.md 2.7, id for id),
// every response format, and real HTTP on a tiny model with both towers: a
// transcription equals the chat request it amounts to, streamed deltas add
// up to it, errors name the form's fields.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <httplib.h>

#include <csignal>
#include <deque>
#include <fstream>
#include <string>

#include "models/phi4mm/demo/demo.h"
#include "models/phi4mm/init.h"
#include "models/phi4mm/processor/chat_processor.h"
#include "serve/engine.h"
#include "serve/http_server.h"
#include "serve/speech.h"
#include "tests/serve/http_fixture.h"

using namespace areno;
using namespace areno::serve;
using nlohmann::json;

namespace {

std::string wav_bytes() {
  std::ifstream f("tests/data/audio/speech_16k_mono.wav", std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  REQUIRE(s.size() > 1000);
  return s;
}

// The form with `file` and the text fields.
std::vector<FormField> form(const std::string& file, std::vector<std::pair<std::string, std::string>> text) {
  static std::deque<std::string> keep;  // the views' storage (a deque keeps its elements in place)
  std::vector<FormField> f;
  if (!file.empty()) f.push_back({"file", file, "clip.wav"});
  for (auto& [k, v] : text) {
    keep.push_back(v);
    f.push_back({k, keep.back(), ""});
  }
  return f;
}

// The 400 parse_speech_request throws for `f`, as {param, message}.
std::pair<std::string, std::string> refusal(SpeechTask task, const std::vector<FormField>& f) {
  try {
    parse_speech_request(task, f);
  } catch (const ApiError& e) {
    CHECK(e.status == 400);
    return {e.param, e.what()};
  }
  FAIL("not refused");
  return {};
}

}  // namespace

TEST_CASE("serve/speech the form: defaults, the chat body, the model card's prompt id for id") {
  const std::string wav = wav_bytes();
  const SpeechRequest r = parse_speech_request(SpeechTask::transcribe, form(wav, {}));
  CHECK(r.response_format == "json");
  CHECK_FALSE(r.stream);
  CHECK(r.chat["temperature"] == 0.0);
  CHECK_FALSE(r.chat.contains("max_completion_tokens"));
  const json& content = r.chat["messages"][0]["content"];
  CHECK(r.chat["messages"][0]["role"] == "user");
  CHECK(content[1]["text"] == "<|audio_1|>Transcribe the audio clip into text.");
  CHECK(phi4mm::decode_base64(content[0]["input_audio"]["data"].get<std::string>()) ==
        std::vector<uint8_t>(wav.begin(), wav.end()));

  // Through the processor: <|user|>, the audio's placeholders, the
  // instruction's tokens, <|end|>, <|assistant|> (spec tokens-api.md 2.7).
  auto model = phi4mm::init_phi4mm("tiny", 0);
  auto tokenizer = tokenizer_for(*model);
  const phi4mm::ProcessedChat pc =
      phi4mm::process_chat(*tokenizer, r.chat["messages"], nullptr, phi4mm::processor_options_for(*model));
  std::vector<int64_t> want = {200021};
  int64_t n_audio = 0;
  for (int64_t id : pc.ids()) n_audio += id == phi4mm::kAudioTokenId;
  CHECK(n_audio > 10);
  want.insert(want.end(), size_t(n_audio), phi4mm::kAudioTokenId);
  for (tok::TokenId t : tokenizer->encode("Transcribe the audio clip into text.")) want.push_back(t);
  want.push_back(200020);
  want.push_back(200019);
  CHECK(pc.ids() == want);
  CHECK(pc.adapter == phi4mm::Adapter::speech);

  // Translations: the target's name; a prompt goes on a new line; numbers and booleans typed.
  const SpeechRequest t = parse_speech_request(
      SpeechTask::translate, form(wav, {{"to_language", "fr"}, {"prompt", "Keep the names."}, {"temperature", "0.5"},
                                        {"top_k", "7"}, {"seed", "-3"}, {"max_completion_tokens", "12"},
                                        {"stream", "True"}, {"stream_include_usage", "1"}, {"language", "de"},
                                        {"unknown_field", "ignored"}}));
  CHECK(t.chat["messages"][0]["content"][1]["text"] == "<|audio_1|>Translate the audio to French.\nKeep the names.");
  CHECK(t.chat["temperature"] == 0.5);
  CHECK(t.chat["top_k"] == 7);
  CHECK(t.chat["seed"] == -3);
  CHECK(t.chat["max_completion_tokens"] == 12);
  CHECK(t.chat["stream"] == true);
  CHECK(t.chat["stream_options"]["include_usage"] == true);
  CHECK(t.language == "de");
  CHECK(t.to_language == "fr");
  CHECK(parse_speech_request(SpeechTask::translate, form(wav, {})).chat["messages"][0]["content"][1]["text"] ==
        "<|audio_1|>Translate the audio to English.");
  // The chat parser takes the body as a chat request.
  const ApiRequest ar = parse_chat_request(t.chat, ApiLimits{});
  CHECK(ar.params.max_tokens == 12);
  CHECK(ar.params.top_k == 7);
  CHECK(ar.stream);
  CHECK(ar.include_usage);
}

TEST_CASE("serve/speech the form's refusals name the field") {
  const std::string wav = wav_bytes();
  using P = std::vector<std::pair<std::string, std::string>>;
  struct Case {
    SpeechTask task;
    std::vector<FormField> f;
    const char* param;
    const char* says;
  };
  std::vector<FormField> twice = form(wav, {{"language", "en"}, {"language", "fr"}});
  std::vector<FormField> model_file = form(wav, {});
  model_file.push_back({"model", "x", "model.txt"});
  const std::vector<Case> cases = {
      {SpeechTask::transcribe, form("", {{"model", "m"}}), "file", "is required"},
      {SpeechTask::transcribe, {{"file", "", "a.wav"}}, "file", "is empty"},
      {SpeechTask::transcribe, twice, "language", "more than once"},
      {SpeechTask::transcribe, model_file, "model", "must be a text field"},
      {SpeechTask::transcribe, form(wav, P{{"response_format", "xml"}}), "response_format", "json, text, verbose_json"},
      {SpeechTask::transcribe, form(wav, P{{"timestamp_granularities[]", "word"}}), "timestamp_granularities[]", "word timestamps"},
      {SpeechTask::transcribe, form(wav, P{{"timestamp_granularities[]", "char"}}), "timestamp_granularities[]", "must be segment"},
      {SpeechTask::transcribe, form(wav, P{{"language", "english"}}), "language", "en, zh, de, fr, it, ja, es, pt"},
      {SpeechTask::transcribe, form(wav, P{{"to_language", "fr"}}), "to_language", "/v1/audio/translations"},
      {SpeechTask::translate, form(wav, P{{"to_language", "xx"}}), "to_language", "a language the model writes"},
      {SpeechTask::transcribe, form(wav, P{{"temperature", "hot"}}), "temperature", "finite number"},
      {SpeechTask::transcribe, form(wav, P{{"temperature", "nan"}}), "temperature", "finite number"},
      {SpeechTask::transcribe, form(wav, P{{"temperature", "1e999"}}), "temperature", "finite number"},
      {SpeechTask::transcribe, form(wav, P{{"temperature", " 1"}}), "temperature", "finite number"},
      {SpeechTask::transcribe, form(wav, P{{"top_k", "2.5"}}), "top_k", "an integer"},
      {SpeechTask::transcribe, form(wav, P{{"seed", ""}}), "seed", "an integer"},
      {SpeechTask::transcribe, form(wav, P{{"stream", "yes"}}), "stream", "true or false"},
      {SpeechTask::transcribe, form(wav, P{{"stream", "true"}, {"response_format", "srt"}}), "stream", "json or text"},
      {SpeechTask::transcribe, form(wav, P{{"prompt", "Also <|audio_2|>"}}), "prompt", "media placeholder"},
      {SpeechTask::translate, form(wav, P{{"prompt", "<|image_1|>"}}), "prompt", "media placeholder"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    CAPTURE(i);
    const std::pair<std::string, std::string> got = refusal(cases[i].task, cases[i].f);
    const std::string& param = got.first;
    const std::string& message = got.second;
    CHECK(param == cases[i].param);
    CHECK_MESSAGE(message.find(cases[i].says) != std::string::npos, message);
  }
}

TEST_CASE("serve/speech response formats") {
  SpeechRequest r;
  SpeechOutput o;
  o.text = "hello there";
  o.tokens = {15339, 1354, 200020};
  o.logprobs = {{15339, -0.5f, {}}, {1354, -0.25f, {}}, {200020, -0.75f, {}}};
  o.finish = FinishReason::stop;
  o.duration_s = 3723.0456;  // 1 h 2 min 3.0456 s
  o.temperature = 0.2;
  o.prompt_tokens = 40;
  o.audio_tokens = 30;
  CHECK(subtitle_time(3723.0456, ',') == "01:02:03,046");
  CHECK(subtitle_time(0.0004, '.') == "00:00:00.000");

  r.response_format = "json";
  SpeechBody b = speech_response(r, o);
  CHECK(b.content_type == "application/json");
  CHECK(json::parse(b.body) ==
        json{{"text", "hello there"},
             {"usage", {{"type", "tokens"}, {"input_tokens", 40}, {"input_token_details", {{"text_tokens", 10}, {"audio_tokens", 30}}},
                        {"output_tokens", 3}, {"total_tokens", 43}}}});
  r.response_format = "text";
  b = speech_response(r, o);
  CHECK(b.body == "hello there");
  CHECK(b.content_type.rfind("text/plain", 0) == 0);
  r.response_format = "srt";
  CHECK(speech_response(r, o).body == "1\n00:00:00,000 --> 01:02:03,046\nhello there\n\n");
  r.response_format = "vtt";
  CHECK(speech_response(r, o).body == "WEBVTT\n\n00:00:00.000 --> 01:02:03.046\nhello there\n\n");
  r.response_format = "verbose_json";
  r.language = "en";
  const json v = json::parse(speech_response(r, o).body);
  CHECK(v["task"] == "transcribe");
  CHECK(v["language"] == "english");
  CHECK(v["duration"] == doctest::Approx(3723.0456));
  CHECK(v["text"] == "hello there");
  CHECK(v["usage"] == json{{"type", "duration"}, {"seconds", 3724}});
  REQUIRE(v["segments"].size() == 1);
  const json& s = v["segments"][0];
  CHECK(s["start"] == 0.0);
  CHECK(s["end"] == doctest::Approx(3723.0456));
  CHECK(s["tokens"] == json{15339, 1354, 200020});
  CHECK(s["avg_logprob"] == doctest::Approx(-0.5));
  CHECK(s["temperature"] == doctest::Approx(0.2));
  r.task = SpeechTask::translate;
  r.to_language = "ja";
  r.language.clear();
  CHECK(json::parse(speech_response(r, o).body)["language"] == "japanese");
  r.task = SpeechTask::transcribe;
  CHECK(json::parse(speech_response(r, o).body)["language"].is_null());

  const ResponseHeader h{"trsc-1", 7, "m"};
  const json d = speech_delta_event(h, "he");
  CHECK(d["type"] == "transcript.text.delta");
  CHECK(d["delta"] == "he");
  CHECK(d["choices"][0]["delta"]["content"] == "he");
  const json done = speech_done_event(h, o);
  CHECK(done["type"] == "transcript.text.done");
  CHECK(done["text"] == "hello there");
  CHECK(done["choices"][0]["finish_reason"] == "stop");
  CHECK(speech_usage_chunk(h, o)["usage"] == json{{"prompt_tokens", 40}, {"completion_tokens", 3}, {"total_tokens", 43}});
}

namespace {

struct Reply {
  int status = 0;
  std::string body, content_type;
  json j;
};

Reply post_form(int port, const std::string& path, const httplib::MultipartFormDataItems& items) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(120, 0);
  httplib::Result r = cli.Post(path.c_str(), items);
  REQUIRE_MESSAGE(r, "request failed: " << httplib::to_string(r.error()));
  return {r->status, r->body, r->get_header_value("Content-Type"), json::parse(r->body, nullptr, false)};
}

}  // namespace

TEST_CASE("serve/speech over HTTP: a transcription is its chat request; streamed deltas add up; errors name the field") {
  std::signal(SIGPIPE, SIG_IGN);
  // The demo model (docs/demo.md): random weights would answer in special tokens, so no text.
  auto model = phi4mm::demo_model();
  auto tokenizer = tokenizer_for(*model);
  EngineOptions eo;
  eo.kv_blocks = 256;
  eo.prefill_chunk_tokens = 128;
  Engine engine(model, tokenizer, eo);
  engine.start();
  Served served(engine, ServerOptions{});
  const std::string wav = wav_bytes();
  const httplib::MultipartFormDataItems base = {{"file", wav, "clip.wav", "audio/wav"},
                                                {"max_completion_tokens", "8", "", ""}};

  // What the chat route answers for the same turn, greedy.
  const json chat = {{"messages", json::array({{{"role", "user"},
                                                {"content", json::array({{{"type", "input_audio"},
                                                                          {"input_audio",
                                                                           {{"data", phi4mm::encode_base64(
                                                                                         reinterpret_cast<const uint8_t*>(wav.data()),
                                                                                         wav.size())}}}},
                                                                         {{"type", "text"},
                                                                          {"text", "<|audio_1|>Transcribe the audio clip into text."}}})}}})},
                     {"max_completion_tokens", 8},
                     {"temperature", 0}};
  httplib::Client cli("127.0.0.1", served.port);
  cli.set_read_timeout(120, 0);
  httplib::Result cr = cli.Post("/v1/chat/completions", chat.dump(), "application/json");
  REQUIRE(cr);
  REQUIRE(cr->status == 200);
  const json want = json::parse(cr->body);
  const std::string text = want["choices"][0]["message"]["content"];
  const int64_t prompt_tokens = want["usage"]["prompt_tokens"], completion_tokens = want["usage"]["completion_tokens"];

  Reply j = post_form(served.port, "/v1/audio/transcriptions", base);
  CAPTURE(j.body);
  REQUIRE(j.status == 200);
  CHECK(j.content_type == "application/json");
  CHECK(j.j["text"] == text);
  CHECK(j.j["usage"]["input_tokens"] == prompt_tokens);
  CHECK(j.j["usage"]["output_tokens"] == completion_tokens);
  CHECK(j.j["usage"]["input_token_details"]["audio_tokens"].get<int64_t>() > 10);

  auto with = [&](std::vector<std::pair<std::string, std::string>> extra) {
    httplib::MultipartFormDataItems items = base;
    for (auto& [k, v] : extra) items.push_back({k, v, "", ""});
    return items;
  };
  Reply t = post_form(served.port, "/v1/audio/transcriptions", with({{"response_format", "text"}}));
  CHECK(t.status == 200);
  CHECK(t.body == text);
  Reply v = post_form(served.port, "/v1/audio/transcriptions", with({{"response_format", "verbose_json"}, {"language", "en"}}));
  REQUIRE(v.status == 200);
  CHECK(v.j["duration"] == doctest::Approx(1.898625));  // 30378 samples at 16 kHz
  CHECK(v.j["language"] == "english");
  CHECK(v.j["segments"][0]["tokens"].size() == size_t(completion_tokens));
  CHECK(v.j["segments"][0]["avg_logprob"].get<double>() <= 0.0);
  Reply s = post_form(served.port, "/v1/audio/transcriptions", with({{"response_format", "srt"}}));
  CHECK(s.body == "1\n00:00:00,000 --> 00:00:01,899\n" + text + "\n\n");

  // Streamed: the deltas add up to the text, then done, vLLM's usage chunk, [DONE].
  Reply st = post_form(served.port, "/v1/audio/transcriptions", with({{"stream", "true"}, {"stream_include_usage", "true"}}));
  REQUIRE(st.status == 200);
  CHECK(st.content_type.rfind("text/event-stream", 0) == 0);
  std::string deltas;
  std::vector<json> events;
  size_t at = 0;
  bool done_marker = false;
  while ((at = st.body.find("data: ", at)) != std::string::npos) {
    const size_t end = st.body.find("\n\n", at);
    const std::string data = st.body.substr(at + 6, end - at - 6);
    at = end;
    if (data == "[DONE]") {
      done_marker = true;
      continue;
    }
    events.push_back(json::parse(data));
    if (events.back().value("type", "") == "transcript.text.delta") deltas += events.back()["delta"].get<std::string>();
  }
  CHECK(done_marker);
  REQUIRE(events.size() >= 2);
  CHECK(deltas == text);
  const json& done = events[events.size() - 2];
  CHECK(done["type"] == "transcript.text.done");
  CHECK(done["text"] == text);
  CHECK(done["usage"]["output_tokens"] == completion_tokens);
  CHECK(events.back()["choices"].empty());
  CHECK(events.back()["usage"]["prompt_tokens"] == prompt_tokens);

  // Translations: the instruction differs, so the prompt does too.
  Reply tr = post_form(served.port, "/v1/audio/translations", base);
  REQUIRE(tr.status == 200);
  CHECK(tr.j["usage"]["input_tokens"].get<int64_t>() != prompt_tokens);

  // Errors: the field named, the server still answering.
  Reply e1 = post_form(served.port, "/v1/audio/transcriptions", {{"file", "#!not audio", "clip.wav", "audio/wav"}});
  CHECK(e1.status == 400);
  CHECK(e1.j["error"]["param"] == "file");
  CHECK(e1.j["error"]["message"].get<std::string>().find("messages") == std::string::npos);
  std::string long_prompt;
  for (int i = 0; i < 5000; ++i) long_prompt += " hi";  // 5,000 tokens, past the demo's 4,096
  Reply e2 = post_form(served.port, "/v1/audio/transcriptions", with({{"prompt", long_prompt}}));
  CAPTURE(e2.body);
  CHECK(e2.status == 400);
  CHECK(e2.j["error"]["code"] == "context_length_exceeded");
  CHECK(e2.j["error"]["param"] == "file");
  CHECK(e2.j["error"]["message"].get<std::string>().find("messages") == std::string::npos);
  Reply e3 = post_form(served.port, "/v1/audio/transcriptions", with({{"model", "other"}}));
  CHECK(e3.status == 404);
  Reply e4 = post_form(served.port, "/v1/audio/transcriptions",
                       {{"file", wav, "clip.wav", "audio/wav"}, {"max_completion_tokens", "100000000", "", ""}});
  CAPTURE(e4.body);
  CHECK(e4.status == 400);
  CHECK(e4.j["error"]["code"] == "context_length_exceeded");
  httplib::Result e5 = cli.Post("/v1/audio/transcriptions", R"({"file": "x"})", "application/json");
  REQUIRE(e5);
  CHECK(e5->status == 400);
  CHECK(json::parse(e5->body)["error"]["param"] == "file");
  CHECK(post_form(served.port, "/v1/audio/transcriptions", base).j["text"] == text);
  engine.stop(true);
  CHECK(engine.stats().kv_blocks_used == 0);
}
