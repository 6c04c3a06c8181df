#include "models/phi4mm/processor/media.h"

#include <span>

#include <fmt/format.h>

#include "models/phi4mm/audio/audio_features.h"
#include "models/phi4mm/audio/audio_io.h"
#include "models/phi4mm/processor/image_io.h"

namespace areno::phi4mm {

const char* media_kind_name(MediaKind k) { return k == MediaKind::kImage ? "image" : "audio"; }

const char* input_mode_name(InputMode m) {
  switch (m) {
    case InputMode::kText: return "text";
    case InputMode::kVision: return "vision";
    case InputMode::kSpeech: return "speech";
    case InputMode::kVisionSpeech: return "vision+speech";
  }
  return "?";
}

Media decode_media(MediaKind kind, const std::vector<uint8_t>& bytes, const std::string& field,
                   const MediaLimits& limits) {
  if (bytes.empty()) throw ProcessorError(field, fmt::format("{}: the {} is empty", field, media_kind_name(kind)));
  if (bytes.size() > limits.max_bytes)
    throw ProcessorError(field,
                         fmt::format("{}: {} bytes exceed the limit of {} bytes", field, bytes.size(), limits.max_bytes));
  Media m;
  m.kind = kind;
  try {
    if (kind == MediaKind::kImage) {
      m.image = decode_image(bytes, field, limits.max_image_pixels);
    } else {
      AudioDecodeOptions o;
      o.max_seconds = limits.max_audio_seconds;
      DecodedAudio a = decode_audio(std::span<const uint8_t>(bytes), o, field);
      m.samples = std::move(a.samples);
      m.sample_rate = a.sample_rate;
    }
  } catch (const std::exception& e) {
    throw ProcessorError(field, e.what());
  }
  return m;
}

int64_t media_token_count(const Media& item, const std::string& field) {
  try {
    if (item.kind == MediaKind::kImage) return num_image_tokens(item.image.width, item.image.height);
    return audio_token_count(int64_t(item.samples.size()), item.sample_rate);
  } catch (const std::exception& e) {
    throw ProcessorError(field, fmt::format("{}: {}", field, e.what()));
  }
}

}  // namespace areno::phi4mm
