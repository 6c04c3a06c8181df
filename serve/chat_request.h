#pragma once
// OpenAI chat messages -> prompt ids + the request's decoded media, shared by
// the server and the CLI commands (generate, logits --messages, preprocess).
//
// Media parts are fetched (media_fetch.h), decoded (decode_media), counted by
// the encoder, and the prompt is built with those counts (prompt_builder.h).
// Every problem is an ApiError(400) naming the part or field.
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/text.h"
#include "models/phi4mm/tokenizer/prompt_builder.h"
#include "serve/media.h"
#include "serve/media_fetch.h"

namespace areno::serve {

struct PreparedChat {
  phi4mm::Prompt prompt;             // ids with the media placeholders expanded
  std::vector<DecodedMedia> media;   // in prompt order
  phi4mm::Adapter adapter = phi4mm::Adapter::none;  // vision when an image is present, else speech for audio
  std::vector<int64_t> ids() const { return {prompt.ids.begin(), prompt.ids.end()}; }
};

// `encoder` null: a text-only model (media parts are refused).
PreparedChat prepare_chat(const tok::Tokenizer& tokenizer, const nlohmann::json& messages,
                          const nlohmann::json& tools, bool add_generation_prompt, const MediaEncoder* encoder,
                          const MediaFetchOptions& fetch, const MediaLimits& limits);

// The adapter a prompt's input mode selects (spec text.md 3.3).
phi4mm::Adapter adapter_for(phi4mm::InputMode mode);

}  // namespace areno::serve
