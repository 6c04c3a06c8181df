#pragma once
// One media item of a request, from the request to the tower: an image or an
// audio clip, decoded. The chat processor (chat_processor.h) makes these from
// content parts; the model's towers take them (media_rows in model.h).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/phi4mm/processor/image_processor.h"

namespace areno::phi4mm {

enum class MediaKind { kImage, kAudio };
const char* media_kind_name(MediaKind k);  // "image" / "audio"

// The model's input mode (spec tokens-api.md 2.3): 0 text, 1 vision, 2 speech, 3 both.
enum class InputMode { kText = 0, kVision = 1, kSpeech = 2, kVisionSpeech = 3 };
const char* input_mode_name(InputMode m);

// A problem with a request's input, as {field, message}: `field` names the
// part ("messages[1].content[2].image_url.url"), `what()` is the whole
// message for a client (it starts with the field). Servers map it to 400.
class ProcessorError : public std::runtime_error {
 public:
  ProcessorError(std::string field, const std::string& message)
      : std::runtime_error(message), field_(std::move(field)) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

struct MediaLimits {
  int64_t max_image_pixels = 178956970;  // Pillow's decompression-bomb threshold
  double max_audio_seconds = 600;        // longer clips are refused
  size_t max_bytes = size_t(64) << 20;   // per item, before decoding
};

struct Media {
  MediaKind kind = MediaKind::kImage;
  RgbImage image;                // kImage
  std::vector<double> samples;   // kAudio: mono, as decoded (float64 like soundfile)
  int64_t sample_rate = 0;       // kAudio

  static Media of_image(RgbImage image) { return {MediaKind::kImage, std::move(image), {}, 0}; }
  static Media of_audio(std::vector<double> samples, int64_t sample_rate) {
    return {MediaKind::kAudio, {}, std::move(samples), sample_rate};
  }
};

// Decodes image bytes (PNG/JPEG/BMP/GIF/PNM) or audio bytes (WAV/FLAC/MP3/OGG).
// `field` names the item in errors. Throws ProcessorError.
Media decode_media(MediaKind kind, const std::vector<uint8_t>& bytes, const std::string& field,
                   const MediaLimits& limits = {});

// Placeholder tokens the item expands to, from the processors alone
// (num_image_tokens / audio_token_count). Throws ProcessorError naming `field`.
int64_t media_token_count(const Media& item, const std::string& field = "media");

}  // namespace areno::phi4mm
