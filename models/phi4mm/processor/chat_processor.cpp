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
  // Media parts in request order, decoded once; [kind][index within the kind].
  std::vector<Media> decoded[2];
  std::vector<size_t> counts[2];
  for (const MediaPart& it : flat.media) {
    const std::string where = fmt::format("messages[{}].content", it.message);
    const int k = it.kind == MediaKind::kImage ? 0 : 1;
    const bool supported = k == 0 ? options.image : options.audio;
    if (!supported)
      throw ProcessorError(where, fmt::format("{}: this model has no {} encoder loaded; remove the {} part", where,
                                              media_kind_name(it.kind), media_kind_name(it.kind)));
    if (it.index != decoded[k].size()) throw std::logic_error("process_chat: media parts out of order");
    const std::vector<uint8_t> bytes = read_media_part(it.part, it.kind, where, options.source);
    decoded[k].push_back(decode_media(it.kind, bytes, where, options.limits));
    counts[k].push_back(size_t(media_token_count(decoded[k].back(), where)));
  }
  ProcessedChat out;
  try {
    out.prompt = build_prompt(
        tokenizer, std::move(flat),
        [&](const MediaPart& m) { return counts[m.kind == MediaKind::kImage ? 0 : 1].at(m.index); },
        options.add_generation_prompt);
  } catch (const std::exception& e) {
    throw ProcessorError("messages", e.what());
  }
  out.adapter = adapter_for(out.prompt.mode);
  for (const MediaSpan& s : out.prompt.spans)
    out.media.push_back(std::move(decoded[s.kind == MediaKind::kImage ? 0 : 1].at(s.index)));
  return out;
}

}  // namespace areno::phi4mm
