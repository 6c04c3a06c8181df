#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/prompt_builder.h"
#include "tests/tokenizer/fixtures.h"

using areno::tok::TokenId;
using Ids = std::vector<TokenId>;
using nlohmann::json;
namespace phi4mm = areno::phi4mm;
namespace test = areno::test;

namespace {

// Counts from a table: image k -> images[k], audio k -> audios[k].
phi4mm::MediaTokenCounter table_counter(std::vector<size_t> images, std::vector<size_t> audios) {
  return [images, audios](const phi4mm::MediaPart& m) {
    return m.kind == phi4mm::MediaKind::kImage ? images.at(m.index) : audios.at(m.index);
  };
}

phi4mm::Prompt build(const json& messages, const phi4mm::MediaTokenCounter& counter = table_counter({}, {}),
                     const json& tools = nullptr) {
  phi4mm::PromptOptions opt;
  opt.tools = tools;
  return phi4mm::build_prompt(test::phi4(), messages, counter, opt);
}

json user_parts(json parts) { return json::array({{{"role", "user"}, {"content", parts}}}); }
json image_part() { return {{"type", "image_url"}, {"image_url", {{"url", "data:image/png;base64,AAAA"}}}}; }
json audio_part() { return {{"type", "input_audio"}, {"input_audio", {{"data", "UklGR", }, {"format", "wav"}}}}; }
json text_part(const std::string& s) { return {{"type", "text"}, {"text", s}}; }

}  // namespace

TEST_CASE("prompt/worked examples of the spec render and tokenize exactly (goldens from HF tokenizers)") {
  const json examples = json::parse(test::read_text_file(std::string(test::kDataDir) + "/prompts.json"));
  REQUIRE(examples.size() >= 5);
  for (const json& ex : examples) {
    CAPTURE(ex["name"].get<std::string>());
    const auto images = ex["image_tokens"].get<std::vector<size_t>>();
    const auto audios = ex["audio_tokens"].get<std::vector<size_t>>();
    const phi4mm::Prompt p = build(ex["messages"], table_counter(images, audios), ex.value("tools", json()));
    CHECK(p.text == ex["text"].get<std::string>());
    CHECK(p.ids == ex["ids"].get<Ids>());
    // Spans cover exactly the expanded media ids.
    REQUIRE(p.spans.size() == images.size() + audios.size());
    for (const auto& s : p.spans) {
      const TokenId want = s.kind == phi4mm::MediaKind::kImage ? phi4mm::kImageToken : phi4mm::kAudioToken;
      CHECK(s.length == (s.kind == phi4mm::MediaKind::kImage ? images : audios).at(s.index));
      for (size_t k = 0; k < s.length; ++k) CHECK(p.ids.at(s.start + k) == want);
    }
    const auto mode = images.empty() ? (audios.empty() ? phi4mm::InputMode::kText : phi4mm::InputMode::kSpeech)
                                     : (audios.empty() ? phi4mm::InputMode::kVision : phi4mm::InputMode::kVisionSpeech);
    CHECK(p.mode == mode);
  }
}

TEST_CASE("prompt/spec 2.6: one image and one audio, ids and spans") {
  const phi4mm::Prompt p = build(user_parts({text_part("Describe the image and transcribe the audio."), image_part(), audio_part()}),
                                 table_counter({1841}, {125}));
  CHECK(p.text == "<|user|><|image_1|>\n<|audio_1|>\nDescribe the image and transcribe the audio.<|end|><|assistant|>");
  const Ids t = test::phi4().encode_ordinary("Describe the image and transcribe the audio.");
  CHECK(p.ids.size() == 1 + 1841 + 1 + 125 + 1 + t.size() + 2);
  CHECK(p.ids.front() == phi4mm::kUser);
  REQUIRE(p.spans.size() == 2);
  CHECK(p.spans[0].kind == phi4mm::MediaKind::kImage);
  CHECK(p.spans[0].start == 1);
  CHECK(p.spans[0].length == 1841);
  CHECK(p.ids[1842] == 198);
  CHECK(p.spans[1].kind == phi4mm::MediaKind::kAudio);
  CHECK(p.spans[1].start == 1843);
  CHECK(p.spans[1].length == 125);
  CHECK(p.mode == phi4mm::InputMode::kVisionSpeech);
  CHECK(std::string(phi4mm::input_mode_name(p.mode)) == "vision+speech");
  CHECK(p.ids.back() == phi4mm::kAssistant);
}

TEST_CASE("prompt/placeholders: user-written ones stay, missing ones are prepended grouped by modality") {
  std::vector<phi4mm::MediaPart> media;
  // Audio appears first in the message, so all audio placeholders come first.
  const auto msgs = phi4mm::flatten_messages(
      user_parts({audio_part(), text_part("first"), image_part(), text_part("second <|image_2|> here"), image_part(),
                  audio_part()}), nullptr, media);
  REQUIRE(msgs.size() == 1);
  CHECK(msgs[0].content == "<|audio_1|>\n<|audio_2|>\n<|image_1|>\nfirst\nsecond <|image_2|> here");
  REQUIRE(media.size() == 4);
  CHECK(media[0].kind == phi4mm::MediaKind::kAudio);
  CHECK(media[1].index == 0);
  CHECK(media[2].index == 1);
  // Counters run across the whole request.
  json two = json::array({{{"role", "user"}, {"content", json::array({image_part()})}},
                          {{"role", "assistant"}, {"content", "ok"}},
                          {{"role", "user"}, {"content", json::array({image_part(), text_part("and this?")})}}});
  media.clear();
  const auto m2 = phi4mm::flatten_messages(two, nullptr, media);
  CHECK(m2[0].content == "<|image_1|>");
  CHECK(m2[2].content == "<|image_2|>\nand this?");
}

TEST_CASE("prompt/chat template: roles, no generation prompt, tools, tool calls") {
  CHECK(phi4mm::render_chat({{"user", "Hi", std::nullopt}}, false) == "<|user|>Hi<|end|><|endoftext|>");
  // continue_final_message: the text stops after the last content (transformers' truncation).
  CHECK(phi4mm::render_chat({{"user", "Hi", std::nullopt}, {"assistant", "Hello, ", std::nullopt}}, false, true) ==
        "<|user|>Hi<|end|><|assistant|>Hello, ");
  CHECK(phi4mm::render_chat({{"system", "S", std::string("[]")}, {"user", "Hi", std::nullopt}}, true) ==
        "<|system|>S<|tool|>[]<|/tool|><|end|><|user|>Hi<|end|><|assistant|>");
  // developer is OpenAI's name for system; tool renders verbatim as the template does.
  const phi4mm::Prompt p = build(json::array({{{"role", "developer"}, {"content", "Be brief."}},
                                              {{"role", "user"}, {"content", "Weather?"}},
                                              {{"role", "assistant"}, {"content", nullptr},
                                               {"tool_calls", json::array({{{"id", "call_1"}, {"type", "function"},
                                                 {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}}})}},
                                              {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "22C"}}}));
  CHECK(p.text ==
        "<|system|>Be brief.<|end|><|user|>Weather?<|end|><|assistant|><|tool_call|>[{\"name\": \"get_weather\", "
        "\"arguments\": {\"city\": \"Paris\"}}]<|/tool_call|><|end|><|tool|>22C<|end|><|assistant|>");
  CHECK(p.mode == phi4mm::InputMode::kText);
  // Tools go to an existing system message.
  const json tools = json::array({{{"type", "function"}, {"function", {{"name", "f"}, {"description", "d"}}}}});
  const phi4mm::Prompt q = build(json::array({{{"role", "system"}, {"content", "S"}}, {{"role", "user"}, {"content", "x"}}}),
                                 table_counter({}, {}), tools);
  CHECK(q.text == "<|system|>S<|tool|>[{\"name\": \"f\", \"description\": \"d\"}]<|/tool|><|end|><|user|>x<|end|><|assistant|>");
  CHECK(q.ids[0] == phi4mm::kSystem);
}

TEST_CASE("prompt/errors: unknown role, unknown part type, bad content") {
  CHECK_THROWS_WITH_AS(build(json::array({{{"role", "robot"}, {"content", "x"}}})),
                       doctest::Contains("unknown role 'robot'"), std::runtime_error);
  CHECK_THROWS_WITH_AS(build(user_parts({{{"type", "video_url"}, {"video_url", {{"url", "x"}}}}})),
                       doctest::Contains("unsupported chat content part type 'video_url'"), std::runtime_error);
  CHECK_THROWS_WITH_AS(build(user_parts({{{"type", "image_url"}}})), doctest::Contains("messages[0].content[0].image_url"),
                       std::runtime_error);
  CHECK_THROWS_WITH_AS(build(json::array()), doctest::Contains("non-empty array"), std::runtime_error);
  CHECK_THROWS_WITH_AS(build(json::array({{{"role", "user"}, {"content", 5}}})), doctest::Contains("messages[0].content must be"),
                       std::runtime_error);
  CHECK_THROWS_WITH_AS(build(json::array({{{"role", "user"}, {"content", std::string("bad \xFF byte")}}})),
                       doctest::Contains("messages[0].content is not valid UTF-8"), std::runtime_error);
  CHECK_THROWS_WITH_AS(build(json::array({{{"role", "assistant"}, {"content", json::array({image_part()})}}})),
                       doctest::Contains("only allowed in user messages"), std::runtime_error);
}

TEST_CASE("prompt/errors: media numbering that skips, repeats, or exceeds the media items") {
  const auto counter = table_counter({10, 10}, {5});
  // More placeholders than items.
  CHECK_THROWS_WITH_AS(build(json::array({{{"role", "user"}, {"content", "<|image_1|> what?"}}}), counter),
                       doctest::Contains("only 0 image item(s)"), std::runtime_error);
  CHECK_THROWS_WITH_AS(build(user_parts({text_part("<|image_3|>"), image_part(), image_part()}), counter),
                       doctest::Contains("<|image_3|> but the request has only 2 image item(s)"), std::runtime_error);
  // Skip: <|image_2|> before <|image_1|>.
  CHECK_THROWS_WITH_AS(build(user_parts({text_part("<|image_2|> then <|image_1|>"), image_part(), image_part()}), counter),
                       doctest::Contains("found <|image_2|> where <|image_1|> was expected"), std::runtime_error);
  // Repeat: the same placeholder twice.
  CHECK_THROWS_WITH_AS(build(user_parts({text_part("<|audio_1|> and <|audio_1|>"), audio_part()}), counter),
                       doctest::Contains("<|audio_1|> appears more than once"), std::runtime_error);
  // A literal media token in the text breaks the count (spec 2.3).
  CHECK_THROWS_WITH_AS(build(user_parts({text_part("look: <|endoftext10|>"), image_part()}), counter),
                       doctest::Contains("does not match the number of image items (1)"), std::runtime_error);
  // A counter that reports 0 tokens.
  CHECK_THROWS_WITH_AS(build(user_parts({image_part()}), table_counter({0}, {})), doctest::Contains("token count of 0"),
                       std::runtime_error);
  // Direct rewrite checks.
  CHECK(phi4mm::rewrite_placeholders("<|image_1|>a<|audio_1|><|image_2|>", 2, 1) ==
        "<|endoftext10|>a<|endoftext11|><|endoftext10|>");
  CHECK(phi4mm::rewrite_placeholders("<|image_x|><|image_|>", 0, 0) == "<|image_x|><|image_|>");
  CHECK_THROWS_WITH_AS(phi4mm::rewrite_placeholders("<|image_1|>", 2, 0), doctest::Contains("references only 1"),
                       std::runtime_error);
}
