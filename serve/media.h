#pragma once
// Media of a request: decoding bytes into images / audio clips, counting their
// placeholder tokens, and computing their embedding rows with the towers.
//
// The HTTP layer fetches bytes (data URLs, base64 input_audio, files under the
// media root), calls decode_media(), builds the prompt with the counts from
// MediaEncoder::num_tokens(), and hands MediaEncoder::encode()'s closure to
// the engine, which runs it once at admission.
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/phi4mm/model.h"
#include "models/phi4mm/processor/image_processor.h"
#include "models/phi4mm/tokenizer/prompt_builder.h"
#include "tensor/tensor.h"

namespace areno::serve {

using phi4mm::InputMode;
using phi4mm::MediaKind;

// Bad media from a client (undecodable, too large, too short...): HTTP 400.
struct MediaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct MediaLimits {
  int64_t max_image_pixels = 178956970;  // Pillow's decompression-bomb threshold
  double max_audio_seconds = 600;        // longer clips are refused
  size_t max_bytes = size_t(64) << 20;   // per item, before decoding
};

struct DecodedMedia {
  MediaKind kind = MediaKind::kImage;
  phi4mm::RgbImage image;        // kImage
  std::vector<double> samples;   // kAudio: mono, as decoded (float64 like soundfile)
  int64_t sample_rate = 0;       // kAudio
};

// Decodes image bytes (PNG/JPEG/BMP/GIF/PNM) or audio bytes (WAV/FLAC/MP3/OGG).
// `what` names the item in errors ("messages[1].content[2]"). Throws MediaError.
DecodedMedia decode_media(MediaKind kind, const std::vector<uint8_t>& bytes, const std::string& what,
                          const MediaLimits& limits = {});

// Turns decoded media into embedding rows for the language model.
class MediaEncoder {
 public:
  virtual ~MediaEncoder() = default;
  virtual bool supports(MediaKind kind) const = 0;
  // Placeholder tokens the item expands to (N_img / N_aud); throws MediaError.
  virtual int64_t num_tokens(const DecodedMedia& item) const = 0;
  // A closure returning the rows [sum of num_tokens, hidden] of all items in
  // prompt order (images and audio interleaved as they appear), for the
  // request's input mode (the audio projector depends on it). Runs the
  // processors eagerly (here) and the towers lazily (in the closure).
  virtual std::function<Tensor()> encode(std::vector<DecodedMedia> items, InputMode mode) const = 0;
};

// Placeholder tokens of an item from the processors alone (no weights needed):
// num_image_tokens / audio_token_count. Throws MediaError.
int64_t count_media_tokens(const DecodedMedia& item);

// An encoder that only counts (for preprocessing without a model); encode() throws.
std::unique_ptr<MediaEncoder> make_counting_encoder();

// The towers of a loaded Phi-4-multimodal model (vision and/or audio; a
// modality whose tower is absent is not supported).
std::unique_ptr<MediaEncoder> make_media_encoder(std::shared_ptr<const phi4mm::Phi4MMForCausalLM> model);

}  // namespace areno::serve
