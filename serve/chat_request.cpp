#include "serve/chat_request.h"

#include <fmt/format.h>

#include "serve/openai.h"

namespace areno::serve {

phi4mm::Adapter adapter_for(phi4mm::InputMode mode) {
  switch (mode) {
    case phi4mm::InputMode::kVision:
    case phi4mm::InputMode::kVisionSpeech: return phi4mm::Adapter::vision;
    case phi4mm::InputMode::kSpeech: return phi4mm::Adapter::speech;
    case phi4mm::InputMode::kText: break;
  }
  return phi4mm::Adapter::none;
}

PreparedChat prepare_chat(const tok::Tokenizer& tokenizer, const nlohmann::json& messages,
                          const nlohmann::json& tools, bool add_generation_prompt, const MediaEncoder* encoder,
                          const MediaFetchOptions& fetch, const MediaLimits& limits) {
  std::vector<phi4mm::MediaItem> items;
  try {
    phi4mm::flatten_messages(messages, tools, items);
  } catch (const std::exception& e) {
    throw ApiError(400, e.what(), "messages");
  }
  std::vector<DecodedMedia> decoded;
  std::vector<int64_t> counts;
  for (const phi4mm::MediaItem& it : items) {
    const std::string where = fmt::format("messages[{}].content", it.message);
    if (!encoder || !encoder->supports(it.kind))
      throw ApiError(400,
                     fmt::format("{}: this model has no {} encoder loaded; remove the {} part", where,
                                 phi4mm::media_kind_name(it.kind), phi4mm::media_kind_name(it.kind)),
                     where);
    std::vector<uint8_t> bytes = fetch_media(it.part, it.kind, where, fetch);
    try {
      decoded.push_back(decode_media(it.kind, bytes, where, limits));
      counts.push_back(encoder->num_tokens(decoded.back()));
    } catch (const MediaError& e) {
      throw ApiError(400, e.what(), where);
    }
  }
  auto position = [&](phi4mm::MediaKind kind, size_t index) -> size_t {
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i].kind == kind && items[i].index == index) return i;
    throw ApiError(500, "media item not found");
  };
  phi4mm::PromptOptions po;
  po.add_generation_prompt = add_generation_prompt;
  po.tools = tools;
  PreparedChat out;
  try {
    out.prompt = phi4mm::build_prompt(
        tokenizer, messages, [&](const phi4mm::MediaItem& m) { return size_t(counts[position(m.kind, m.index)]); },
        po);
  } catch (const ApiError&) {
    throw;
  } catch (const std::exception& e) {
    throw ApiError(400, e.what(), "messages");
  }
  out.adapter = adapter_for(out.prompt.mode);
  for (const phi4mm::MediaSpan& s : out.prompt.spans) out.media.push_back(std::move(decoded[position(s.kind, s.index)]));
  return out;
}

}  // namespace areno::serve
