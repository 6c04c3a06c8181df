#include "models/phi4mm/processor/chat_processor.h"

#include <fmt/format.h>

namespace areno::phi4mm {

Adapter adapter_for(InputMode mode) {
  switch (mode) {
    case InputMode::kVision:
    case InputMode::kVisionSpeech: return Adapter::vision;
    case InputMode::kSpeech: return Adapter::speech;
    case InputMode::kText: break;
  }
  return Adapter::none;
}

ProcessorOptions processor_options_for(const Phi4MMForCausalLM& model) {
  ProcessorOptions o;
  o.image = model.image_embed() != nullptr;
  o.image_max_crops = model.config().vision.dynamic_hd;
  o.audio = model.audio_embed() != nullptr;
  return o;
}

ProcessedChat process_chat(const tok::Tokenizer& tokenizer, const nlohmann::json& messages,
                           const nlohmann::json& tools, const ProcessorOptions& options) {
  FlatChat flat;
  try {
    flat = flatten_chat(messages, tools);
  } catch (const std::exception& e) {
    throw ProcessorError("messages", e.what());
  }
  // Media parts in request order: bytes and headers first; [kind][index within the kind].
  struct Part {
    std::string where;
    std::vector<uint8_t> bytes;
    MediaHeader header;
  };
  std::vector<Part> parts[2];
  std::vector<size_t> counts[2];
  for (MediaPart& it : flat.media) {
    const std::string where = fmt::format("messages[{}].content", it.message);
    const int k = it.kind == MediaKind::kImage ? 0 : 1;
    const bool supported = k == 0 ? options.image : options.audio;
    if (!supported)
      throw ProcessorError(where, fmt::format("{}: this model has no {} encoder loaded; remove the {} part", where,
                                              media_kind_name(it.kind), media_kind_name(it.kind)));
    if (it.index != parts[k].size()) throw std::logic_error("process_chat: media parts out of order");
    Part p{where, read_media_part(it.part, it.kind, where, options.source), {}};
    it.part = nullptr;  // the bytes are read: the prompt keeps no copy of a base64 payload
    p.header = probe_media(it.kind, p.bytes, where, options.limits);
    counts[k].push_back(size_t(header_token_count(p.header, where, options.image_max_crops)));
    parts[k].push_back(std::move(p));
  }
  auto build = [&](FlatChat chat) {
    Prompt prompt;
    try {
      prompt = build_prompt(
          tokenizer, std::move(chat),
          [&](const MediaPart& m) { return counts[m.kind == MediaKind::kImage ? 0 : 1].at(m.index); },
          options.add_generation_prompt, options.continue_final_message);
    } catch (const std::exception& e) {
      throw ProcessorError("messages", e.what());
    }
    const int64_t len = int64_t(prompt.ids.size());
    if (options.max_prompt_tokens > 0 && len > options.max_prompt_tokens)
      throw PromptTooLong(len, options.max_prompt_tokens);
    return prompt;
  };
  ProcessedChat out;
  // The length from the headers, before decoding anything.
  out.prompt = build(flat);
  // Decode; audio whose header only estimates its length is counted again.
  std::vector<Media> decoded[2];
  bool recount = false;
  for (const MediaPart& it : flat.media) {
    const int k = it.kind == MediaKind::kImage ? 0 : 1;
    Part& p = parts[k].at(it.index);
    decoded[k].push_back(decode_media(it.kind, p.bytes, p.where, options.limits, options.decode_budget));
    if (it.kind == MediaKind::kImage) decoded[k].back().max_crops = options.image_max_crops;
    std::vector<uint8_t>().swap(p.bytes);  // the encoded bytes are no longer needed
    const size_t n = size_t(media_token_count(decoded[k].back(), p.where, options.image_max_crops));
    recount |= n != counts[k][it.index];
    counts[k][it.index] = n;
  }
  if (recount) out.prompt = build(std::move(flat));
  out.adapter = adapter_for(out.prompt.mode);
  for (const MediaSpan& s : out.prompt.spans)
    out.media.push_back(std::move(decoded[s.kind == MediaKind::kImage ? 0 : 1].at(s.index)));
  return out;
}

}  // namespace areno::phi4mm
