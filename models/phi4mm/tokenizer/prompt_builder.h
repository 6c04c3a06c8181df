// OpenAI chat messages -> Phi-4 prompt token ids (spec tokens-api.md 2.3-2.6).
//
//   messages (OpenAI JSON) --flatten--> ChatMessage list with <|image_k|> /
//   <|audio_k|> placeholders --render--> prompt text --rewrite--> text with
//   <|endoftext10|> / <|endoftext11|> --encode--> ids --expand--> each media
//   id repeated by the count its processor reports.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/processor/media.h"
#include "models/phi4mm/tokenizer/chat_template.h"
#include "models/phi4mm/tokenizer/tokenizer.h"

namespace areno::phi4mm {

// Where one image or audio content part sits in the request, numbered per
// modality across the request (the chat processor reads and decodes it into
// a Media, processor/media.h).
struct MediaPart {
  MediaKind kind;
  size_t index = 0;    // 0-based within its modality; placeholder number is index + 1
  size_t message = 0;  // index into messages
  nlohmann::json part; // the OpenAI content part, for the processor to fetch/decode
};

// Where the expanded ids of one media item sit in Prompt::ids.
struct MediaSpan {
  MediaKind kind;
  size_t index = 0;
  size_t start = 0;
  size_t length = 0;
};

struct Prompt {
  std::string text;  // rendered prompt with <|image_k|> / <|audio_k|> placeholders
  std::vector<tok::TokenId> ids;
  std::vector<MediaSpan> spans;  // in order of appearance
  std::vector<MediaPart> media;  // in the order the parts appear in the request
  InputMode mode = InputMode::kText;
};

// Number of ids an item expands to (N_img / N_aud, from the vision and audio
// processors). Must be >= 1.
using MediaTokenCounter = std::function<size_t(const MediaPart&)>;

struct PromptOptions {
  bool add_generation_prompt = true;
  bool continue_final_message = false;  // render_chat's (chat_template.h)
  // OpenAI request `tools` ([{type: "function", function: {...}}]); rendered
  // into the system turn (spec 5.1). Null = none.
  nlohmann::json tools = nullptr;
};

// Default system prompt when tools are given without a system message (spec
// 5.1, as ollama does).
inline constexpr const char* kToolsDefaultSystem = "You are a helpful assistant with some tools.";

// Steps, exposed for tests and for the chat processor.
std::vector<ChatMessage> flatten_messages(const nlohmann::json& messages, const nlohmann::json& tools,
                                          std::vector<MediaPart>& media);

// Messages flattened once: the chat turns (placeholders in the text) and the
// media parts in request order.
struct FlatChat {
  std::vector<ChatMessage> chat;
  std::vector<MediaPart> media;
};
FlatChat flatten_chat(const nlohmann::json& messages, const nlohmann::json& tools);
// Serialises OpenAI tools as the list of inner function objects, Python
// json.dumps style (", " and ": " separators, UTF-8 kept).
std::string tools_to_string(const nlohmann::json& tools);
// Checks placeholder numbering against the media counts and rewrites
// <|image_k|> -> <|endoftext10|>, <|audio_k|> -> <|endoftext11|>.
std::string rewrite_placeholders(const std::string& text, size_t n_images, size_t n_audios);
// json.dumps(value, ensure_ascii=False) with Python's default separators.
std::string python_json_dumps(const nlohmann::json& value);

Prompt build_prompt(const tok::Tokenizer& tokenizer, const nlohmann::json& messages,
                    const MediaTokenCounter& count_tokens, const PromptOptions& options = {});
// The same from messages already flattened (flatten_chat with options.tools).
Prompt build_prompt(const tok::Tokenizer& tokenizer, FlatChat flat, const MediaTokenCounter& count_tokens,
                    bool add_generation_prompt = true, bool continue_final_message = false);

}  // namespace areno::phi4mm
