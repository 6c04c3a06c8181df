#pragma once
// One media item of a request, from the request to the tower: an image or an
// audio clip, decoded. The chat processor (chat_processor.h) makes these from
// content parts; the model's towers take them (media_rows in model.h).
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
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

// The prompt is longer than the caller's limit (ProcessorOptions::max_prompt_tokens);
// found before any media is decoded. Servers answer it as they answer any
// prompt over their context (400 context_length_exceeded).
class PromptTooLong : public ProcessorError {
 public:
  PromptTooLong(int64_t tokens, int64_t limit);
  int64_t tokens() const { return tokens_; }
  int64_t limit() const { return limit_; }

 private:
  int64_t tokens_, limit_;
};

// No decode budget became free in time (DecodeBudget): the request may succeed
// later. Servers map it to 503.
class MediaBusy : public ProcessorError {
 public:
  using ProcessorError::ProcessorError;
};

struct MediaLimits {
  int64_t max_image_pixels = 178956970;  // Pillow's decompression-bomb threshold
  double max_audio_seconds = 600;        // longer clips are refused
  size_t max_bytes = size_t(64) << 20;   // per item, before decoding
};

class DecodeHold;

// Decoded media bytes in flight across concurrent requests (the server's
// --max-media-decode-mb). Before decoding, an item reserves its estimated
// peak from its header (decode_bytes_estimate); after decoding it keeps the
// size of its samples or pixels while its Media lives -- the engine frees the
// Media once the towers have run -- so N concurrent huge images cost at most
// the capacity. A reservation waits up to `max_wait` for room (then MediaBusy)
// and one larger than the whole capacity is refused at once (ProcessorError).
class DecodeBudget : public std::enable_shared_from_this<DecodeBudget> {
 public:
  DecodeBudget(size_t capacity_bytes, std::chrono::milliseconds max_wait);
  size_t capacity() const { return capacity_; }
  size_t in_use() const;
  // Holds `bytes` until the hold is destroyed. Throws as above, naming `field`.
  std::shared_ptr<DecodeHold> reserve(size_t bytes, const std::string& field);

 private:
  friend class DecodeHold;
  void take(size_t bytes, const std::string& field);  // waits; throws
  void give(size_t bytes);
  size_t capacity_;
  std::chrono::milliseconds max_wait_;
  mutable std::mutex mu_;
  std::condition_variable freed_;
  size_t used_ = 0;
};

// Bytes held from a DecodeBudget; returned when destroyed.
class DecodeHold {
 public:
  DecodeHold(std::shared_ptr<DecodeBudget> budget, size_t bytes) : budget_(std::move(budget)), bytes_(bytes) {}
  ~DecodeHold();
  DecodeHold(const DecodeHold&) = delete;
  DecodeHold& operator=(const DecodeHold&) = delete;
  size_t bytes() const { return bytes_; }
  // Grows (waiting as DecodeBudget::reserve) or shrinks the hold to `bytes`.
  void resize(size_t bytes, const std::string& field);

 private:
  std::shared_ptr<DecodeBudget> budget_;
  size_t bytes_;
};

struct Media {
  MediaKind kind = MediaKind::kImage;
  RgbImage image;                // kImage
  std::vector<double> samples;   // kAudio: mono, as decoded (float64 like soundfile)
  int64_t sample_rate = 0;       // kAudio
  std::shared_ptr<DecodeHold> decode_hold;  // this item's share of a DecodeBudget, if any
  // kImage: at most this many HD crops (the processor's dynamic_hd, 1..64);
  // 0: the model's (VisionConfig::dynamic_hd). Its placeholder count and its
  // tower rows both follow it.
  int64_t max_crops = 0;

  static Media of_image(RgbImage image, int64_t max_crops = 0) {
    return {MediaKind::kImage, std::move(image), {}, 0, nullptr, max_crops};
  }
  static Media of_audio(std::vector<double> samples, int64_t sample_rate) {
    return {MediaKind::kAudio, {}, std::move(samples), sample_rate, nullptr, 0};
  }
};

// What an item's header declares, read without decoding (probe_media).
struct MediaHeader {
  MediaKind kind = MediaKind::kImage;
  std::string format;            // "PNG", "WAV PCM_16", ...
  int64_t width = 0, height = 0; // kImage
  int64_t frames = -1;           // kAudio: declared frames (-1: not declared)
  bool exact_frames = false;     // kAudio: `frames` is exact (MP3 headers estimate)
  int64_t sample_rate = 0, channels = 0;  // kAudio
};

// Reads the header of image or audio bytes and applies every check that needs
// only the header (format, pixel limit, rate, channels, declared length).
// Throws ProcessorError naming `field`.
MediaHeader probe_media(MediaKind kind, const std::vector<uint8_t>& bytes, const std::string& field,
                        const MediaLimits& limits = {});

// Placeholder tokens the header implies: exact for images and for audio with
// exact frames; for other audio a lower bound (1), so a check against a prompt
// limit never refuses what the decoded clip would fit.
int64_t header_token_count(const MediaHeader& header, const std::string& field = "media", int64_t max_crops = 36);

// Bytes decoding may take at its peak (`peak`) and keeps afterwards (`kept`),
// estimated from the header: an image 3 bytes per pixel kept (RGB) and 10 at the
// peak (the decoder's buffers plus the copy); audio 8 bytes per mono sample kept
// and 8 per sample per channel twice over at the peak (growing interleaved buffer).
struct DecodeBytes {
  size_t peak = 0, kept = 0;
};
DecodeBytes decode_bytes_estimate(const MediaHeader& header);

// Decodes image bytes (PNG/JPEG/BMP/GIF/PNM) or audio bytes (WAV/FLAC/MP3/OGG).
// `field` names the item in errors. With a `budget`, the decoded bytes are
// reserved from it first (see DecodeBudget) and held by the Media. Throws
// ProcessorError (MediaBusy when the budget stays full).
Media decode_media(MediaKind kind, const std::vector<uint8_t>& bytes, const std::string& field,
                   const MediaLimits& limits = {}, const std::shared_ptr<DecodeBudget>& budget = nullptr);

// Placeholder tokens the item expands to, from the processors alone
// (num_image_tokens / audio_token_count). Throws ProcessorError naming `field`.
int64_t media_token_count(const Media& item, const std::string& field = "media", int64_t max_crops = 36);

}  // namespace areno::phi4mm
