#pragma once
// The Phi-4-multimodal processor as a library: OpenAI chat messages -> prompt
// ids + the request's decoded media, for the server, the CLI commands and the
// trainer alike.
//
// The messages are flattened once (prompt_builder.h); each media part is read
// (media_source.h: data URL, base64, file under the media root, or the
// injected remote fetcher) and its header probed and counted (media.h); the
// prompt is built with those counts and checked against max_prompt_tokens
// BEFORE any part is decoded, so an over-long request never costs the memory
// of its decoded media; then the parts are decoded (within the decode budget,
// if any). Every problem is a ProcessorError {field, message}.
// The towers do not run here: the caller hands the media to media_rows
// (model.h) -- the engine does that at submit, off its stepping thread.
#include <cstdint>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/processor/media.h"
#include "models/phi4mm/processor/media_source.h"
#include "models/phi4mm/text.h"
#include "models/phi4mm/tokenizer/prompt_builder.h"

namespace areno::phi4mm {

struct ProcessorOptions {
  bool image = true;           // the model has a vision tower (else image parts are refused)
  // At most this many HD crops per image (1..64): an image's placeholder
  // count follows it, and its Media carries it to the tower. The model's
  // dynamic_hd unless a request asks for another (mm_processor_kwargs).
  int64_t image_max_crops = 36;
  bool audio = true;           // the model has an audio encoder
  MediaSource source;
  MediaLimits limits;
  bool add_generation_prompt = true;
  bool continue_final_message = false;  // the last message left open for the model to continue (chat_template.h)
  // Prompts longer than this are refused (PromptTooLong) before any media is
  // decoded; 0: no limit. A server sets what its context leaves for the prompt.
  int64_t max_prompt_tokens = 0;
  // Decoded bytes in flight across the callers sharing it; null: no budget.
  std::shared_ptr<DecodeBudget> decode_budget;
};

// What a model can take: the modalities of `model`'s towers.
ProcessorOptions processor_options_for(const Phi4MMForCausalLM& model);

struct ProcessedChat {
  Prompt prompt;              // ids with the media placeholders expanded
  std::vector<Media> media;   // in prompt order (as media_rows wants them)
  Adapter adapter = Adapter::none;  // vision when an image is present, else speech for audio
  std::vector<int64_t> ids() const { return {prompt.ids.begin(), prompt.ids.end()}; }
};

ProcessedChat process_chat(const tok::Tokenizer& tokenizer, const nlohmann::json& messages,
                           const nlohmann::json& tools, const ProcessorOptions& options);

// The adapter a prompt's input mode selects (spec text.md 3.3).
Adapter adapter_for(InputMode mode);

}  // namespace areno::phi4mm
