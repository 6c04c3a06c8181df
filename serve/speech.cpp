#include "serve/speech.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>

#include <fmt/format.h>

#include "models/phi4mm/processor/media_source.h"

namespace areno::serve {

using nlohmann::json;

namespace {

// Phi-4-multimodal's speech languages and Phi-4-mini's text languages (the
// model card), as ISO-639-1 codes.
const std::map<std::string, std::string>& languages() {
  static const std::map<std::string, std::string> m = {
      {"ar", "Arabic"},  {"zh", "Chinese"},  {"cs", "Czech"},      {"da", "Danish"},     {"nl", "Dutch"},
      {"en", "English"}, {"fi", "Finnish"},  {"fr", "French"},     {"de", "German"},     {"he", "Hebrew"},
      {"hu", "Hungarian"}, {"it", "Italian"}, {"ja", "Japanese"},  {"ko", "Korean"},     {"no", "Norwegian"},
      {"pl", "Polish"},  {"pt", "Portuguese"}, {"ru", "Russian"},  {"es", "Spanish"},    {"sv", "Swedish"},
      {"th", "Thai"},    {"tr", "Turkish"},  {"uk", "Ukrainian"}};
  return m;
}
const std::vector<std::string> kSpeechLanguages = {"en", "zh", "de", "fr", "it", "ja", "es", "pt"};

std::string shown(std::string_view v) {
  std::string s(v.substr(0, 64));
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return v.size() > 64 ? s + "..." : s;
}

ApiError bad(const std::string& field, const std::string& why) { return ApiError(400, fmt::format("'{}' {}", field, why), field); }

json parse_int(const std::string& field, std::string_view v) {
  int64_t x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size())
    throw bad(field, fmt::format("must be an integer (got \"{}\")", shown(v)));
  return x;
}

json parse_number(const std::string& field, std::string_view v) {
  const std::string s(v);
  char* end = nullptr;
  const double x = s.empty() ? NAN : std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(x) || std::isspace(static_cast<unsigned char>(s[0])))
    throw bad(field, fmt::format("must be a finite number (got \"{}\")", shown(v)));
  return x;
}

bool parse_bool(const std::string& field, std::string_view v) {
  std::string s(v);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (s == "true" || s == "1") return true;
  if (s == "false" || s == "0") return false;
  throw bad(field, fmt::format("must be true or false (got \"{}\")", shown(v)));
}

std::string join_codes(const std::vector<std::string>& codes) {
  std::string s;
  for (const std::string& c : codes) s += (s.empty() ? "" : ", ") + c;
  return s;
}

}  // namespace

std::string language_name(const std::string& code) {
  auto it = languages().find(code);
  return it == languages().end() ? std::string() : it->second;
}

std::string speech_instruction(SpeechTask task, const std::string& to_language, const std::string& prompt) {
  std::string s = task == SpeechTask::transcribe
                      ? std::string("<|audio_1|>Transcribe the audio clip into text.")
                      : fmt::format("<|audio_1|>Translate the audio to {}.", language_name(to_language));
  if (!prompt.empty()) s += "\n" + prompt;
  return s;
}

SpeechRequest parse_speech_request(SpeechTask task, const std::vector<FormField>& form) {
  SpeechRequest r;
  r.task = task;
  r.to_language = "en";
  std::map<std::string, const FormField*> fields;
  std::vector<std::string> granularities;
  static const std::set<std::string> kKnown = {
      "file", "model", "language", "to_language", "prompt", "response_format", "temperature", "top_p", "top_k", "min_p",
      "seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "max_completion_tokens", "stream",
      "stream_include_usage"};
  for (const FormField& f : form) {
    if (f.name == "timestamp_granularities[]" || f.name == "timestamp_granularities") {
      granularities.emplace_back(f.value);
      continue;
    }
    if (!kKnown.count(f.name)) continue;
    if (!fields.emplace(f.name, &f).second) throw bad(f.name, "is sent more than once");
    if (f.name != "file" && !f.filename.empty()) throw bad(f.name, "must be a text field, not a file");
  }
  auto text = [&](const char* name) -> std::string {
    auto it = fields.find(name);
    return it == fields.end() ? std::string() : std::string(it->second->value);
  };
  auto has = [&](const char* name) { return fields.count(name) > 0; };

  auto file = fields.find("file");
  if (file == fields.end())
    throw ApiError(400, "'file' is required: send the audio as a multipart/form-data part named file", "file");
  if (file->second->value.empty()) throw bad("file", "is empty");

  if (has("response_format")) {
    r.response_format = text("response_format");
    static const std::set<std::string> kFormats = {"json", "text", "verbose_json", "srt", "vtt"};
    if (!kFormats.count(r.response_format))
      throw bad("response_format",
                fmt::format("must be json, text, verbose_json, srt or vtt (got \"{}\")", shown(r.response_format)));
  }
  for (const std::string& g : granularities) {
    if (g == "word")
      throw ApiError(400, "'timestamp_granularities[]': word timestamps are not available (the model gives no word "
                          "timings); use segment", "timestamp_granularities[]");
    if (g != "segment")
      throw ApiError(400, fmt::format("'timestamp_granularities[]' must be segment (got \"{}\")", shown(g)),
                     "timestamp_granularities[]");
  }
  if (has("language")) {
    r.language = text("language");
    if (std::find(kSpeechLanguages.begin(), kSpeechLanguages.end(), r.language) == kSpeechLanguages.end())
      throw bad("language", fmt::format("must be an ISO-639-1 code of a language the model understands in speech: {} "
                                        "(got \"{}\")", join_codes(kSpeechLanguages), shown(r.language)));
  }
  if (has("to_language")) {
    if (task == SpeechTask::transcribe)
      throw bad("to_language", "is for /v1/audio/translations (a transcription keeps the speech's language)");
    r.to_language = text("to_language");
    if (language_name(r.to_language).empty()) {
      std::vector<std::string> codes;
      for (const auto& [code, name] : languages()) codes.push_back(code);
      throw bad("to_language", fmt::format("must be an ISO-639-1 code of a language the model writes: {} (got \"{}\")",
                                           join_codes(codes), shown(r.to_language)));
    }
  }
  const std::string prompt = text("prompt");
  for (const char* ph : {"<|audio_", "<|image_"})
    if (prompt.find(ph) != std::string::npos)
      throw bad("prompt", fmt::format("must not contain a media placeholder ({}N|>): the audio is the file", ph));
  if (has("stream")) r.stream = parse_bool("stream", fields["stream"]->value);
  if (r.stream && r.response_format != "json" && r.response_format != "text")
    throw bad("stream", fmt::format("is only available with response_format json or text (got {})", r.response_format));

  // The chat request it amounts to.
  const std::string_view audio = file->second->value;
  json content = json::array(
      {{{"type", "input_audio"},
        {"input_audio", {{"data", phi4mm::encode_base64(reinterpret_cast<const uint8_t*>(audio.data()), audio.size())}}}},
       {{"type", "text"}, {"text", speech_instruction(task, r.to_language, prompt)}}});
  json& c = r.chat;
  c["messages"] = json::array({{{"role", "user"}, {"content", std::move(content)}}});
  if (has("model")) c["model"] = text("model");
  c["temperature"] = has("temperature") ? parse_number("temperature", fields["temperature"]->value) : json(0.0);
  for (const char* f : {"top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"})
    if (has(f)) c[f] = parse_number(f, fields[f]->value);
  for (const char* f : {"top_k", "seed", "max_completion_tokens"})
    if (has(f)) c[f] = parse_int(f, fields[f]->value);
  if (r.stream) {
    c["stream"] = true;
    if (has("stream_include_usage"))
      c["stream_options"] = {{"include_usage", parse_bool("stream_include_usage", fields["stream_include_usage"]->value)}};
  }
  return r;
}

json speech_usage(const SpeechOutput& out) {
  const int64_t completion = int64_t(out.tokens.size());
  return {{"type", "tokens"},
          {"input_tokens", out.prompt_tokens},
          {"input_token_details", {{"text_tokens", out.prompt_tokens - out.audio_tokens}, {"audio_tokens", out.audio_tokens}}},
          {"output_tokens", completion},
          {"total_tokens", out.prompt_tokens + completion}};
}

std::string subtitle_time(double seconds, char decimal) {
  const int64_t ms = std::max<int64_t>(0, std::llround(seconds * 1000.0));
  return fmt::format("{:02}:{:02}:{:02}{}{:03}", ms / 3600000, ms / 60000 % 60, ms / 1000 % 60, decimal, ms % 1000);
}

SpeechBody speech_response(const SpeechRequest& r, const SpeechOutput& out) {
  const std::string& f = r.response_format;
  if (f == "text") return {out.text, "text/plain; charset=utf-8"};
  if (f == "srt")
    return {fmt::format("1\n{} --> {}\n{}\n\n", subtitle_time(0, ','), subtitle_time(out.duration_s, ','), out.text),
            "text/plain; charset=utf-8"};
  if (f == "vtt")
    return {fmt::format("WEBVTT\n\n{} --> {}\n{}\n\n", subtitle_time(0, '.'), subtitle_time(out.duration_s, '.'), out.text),
            "text/vtt; charset=utf-8"};
  if (f == "json") return {dump_json({{"text", out.text}, {"usage", speech_usage(out)}}), "application/json"};
  // verbose_json: one segment over the whole clip (the model gives no timings).
  double sum = 0;
  for (const TokenLogprob& lp : out.logprobs) sum += lp.logprob;
  const std::string lang = r.task == SpeechTask::translate ? r.to_language : r.language;
  std::string name = language_name(lang);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char ch) { return char(std::tolower(ch)); });
  const json segment = {{"id", 0},
                        {"seek", 0},
                        {"start", 0.0},
                        {"end", out.duration_s},
                        {"text", out.text},
                        {"tokens", out.tokens},
                        {"temperature", out.temperature},
                        {"avg_logprob", out.logprobs.empty() ? 0.0 : sum / double(out.logprobs.size())}};
  const json body = {{"task", r.task == SpeechTask::transcribe ? "transcribe" : "translate"},
                     {"language", name.empty() ? json(nullptr) : json(name)},
                     {"duration", out.duration_s},
                     {"text", out.text},
                     {"segments", json::array({segment})},
                     {"usage", {{"type", "duration"}, {"seconds", int64_t(std::ceil(out.duration_s))}}}};
  return {dump_json(body), "application/json"};
}

namespace {

json chunk_base(const ResponseHeader& h) {
  return {{"id", h.id}, {"object", "transcription.chunk"}, {"created", h.created}, {"model", h.model}};
}

}  // namespace

json speech_delta_event(const ResponseHeader& h, const std::string& delta) {
  json j = chunk_base(h);
  j["type"] = "transcript.text.delta";
  j["delta"] = delta;
  j["choices"] = json::array({{{"index", 0}, {"delta", {{"content", delta}}}, {"finish_reason", nullptr}}});
  return j;
}

json speech_done_event(const ResponseHeader& h, const SpeechOutput& out) {
  json j = chunk_base(h);
  j["type"] = "transcript.text.done";
  j["text"] = out.text;
  j["usage"] = speech_usage(out);
  const char* finish = finish_reason_name(out.finish);
  j["choices"] = json::array(
      {{{"index", 0}, {"delta", json::object()}, {"finish_reason", finish ? json(finish) : json(nullptr)}}});
  return j;
}

json speech_usage_chunk(const ResponseHeader& h, const SpeechOutput& out) {
  json j = chunk_base(h);
  j["choices"] = json::array();
  const int64_t completion = int64_t(out.tokens.size());
  j["usage"] = {{"prompt_tokens", out.prompt_tokens},
                {"completion_tokens", completion},
                {"total_tokens", out.prompt_tokens + completion}};
  return j;
}

}  // namespace areno::serve
