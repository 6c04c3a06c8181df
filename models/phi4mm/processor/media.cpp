#include "models/phi4mm/processor/media.h"

#include <algorithm>
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

PromptTooLong::PromptTooLong(int64_t tokens, int64_t limit)
    : ProcessorError("messages", fmt::format("The prompt has {} tokens, more than the limit of {}", tokens, limit)),
      tokens_(tokens),
      limit_(limit) {}

namespace {

constexpr double kMiB = double(size_t(1) << 20);

MediaHeader probe_or_throw(MediaKind kind, const std::vector<uint8_t>& bytes, const std::string& field,
                           const MediaLimits& limits) {
  if (bytes.empty()) throw ProcessorError(field, fmt::format("{}: the {} is empty", field, media_kind_name(kind)));
  if (bytes.size() > limits.max_bytes)
    throw ProcessorError(field,
                         fmt::format("{}: {} bytes exceed the limit of {} bytes", field, bytes.size(), limits.max_bytes));
  MediaHeader h;
  h.kind = kind;
  if (kind == MediaKind::kImage) {
    const ImageInfo info = probe_image(bytes, field, limits.max_image_pixels);
    h.format = info.format;
    h.width = info.width;
    h.height = info.height;
  } else {
    AudioDecodeOptions o;
    o.max_seconds = limits.max_audio_seconds;
    const AudioInfo info = probe_audio(std::span<const uint8_t>(bytes), o, field);
    h.format = info.format;
    h.frames = info.frames;
    h.exact_frames = info.exact;
    h.sample_rate = info.sample_rate;
    h.channels = info.channels;
  }
  return h;
}

}  // namespace

DecodeBudget::DecodeBudget(size_t capacity_bytes, std::chrono::milliseconds max_wait)
    : capacity_(capacity_bytes), max_wait_(max_wait) {}

size_t DecodeBudget::in_use() const {
  std::lock_guard<std::mutex> lk(mu_);
  return used_;
}

void DecodeBudget::take(size_t bytes, const std::string& field) {
  if (bytes > capacity_)
    throw ProcessorError(field, fmt::format("{}: decoding this item needs about {:.0f} MiB, more than this server's "
                                            "media decode budget of {:.0f} MiB (--max-media-decode-mb)",
                                            field, double(bytes) / kMiB, double(capacity_) / kMiB));
  std::unique_lock<std::mutex> lk(mu_);
  if (!freed_.wait_for(lk, max_wait_, [&] { return used_ + bytes <= capacity_; }))
    throw MediaBusy(field, fmt::format("{}: the server is decoding too much media ({:.0f} of {:.0f} MiB in use, "
                                       "{:.0f} MiB needed); retry later",
                                       field, double(used_) / kMiB, double(capacity_) / kMiB, double(bytes) / kMiB));
  used_ += bytes;
}

void DecodeBudget::give(size_t bytes) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    used_ -= bytes;
  }
  freed_.notify_all();
}

std::shared_ptr<DecodeHold> DecodeBudget::reserve(size_t bytes, const std::string& field) {
  take(bytes, field);
  return std::make_shared<DecodeHold>(shared_from_this(), bytes);
}

DecodeHold::~DecodeHold() { budget_->give(bytes_); }

void DecodeHold::resize(size_t bytes, const std::string& field) {
  if (bytes > bytes_) budget_->take(bytes - bytes_, field);
  else if (bytes < bytes_) budget_->give(bytes_ - bytes);
  bytes_ = bytes;
}

MediaHeader probe_media(MediaKind kind, const std::vector<uint8_t>& bytes, const std::string& field,
                        const MediaLimits& limits) {
  try {
    return probe_or_throw(kind, bytes, field, limits);
  } catch (const ProcessorError&) {
    throw;
  } catch (const std::exception& e) {
    throw ProcessorError(field, e.what());
  }
}

int64_t header_token_count(const MediaHeader& h, const std::string& field, int64_t max_crops) {
  try {
    if (h.kind == MediaKind::kImage) return num_image_tokens(h.width, h.height, image_options(max_crops));
    return h.exact_frames ? audio_token_count(h.frames, h.sample_rate) : 1;
  } catch (const std::exception& e) {
    throw ProcessorError(field, fmt::format("{}: {}", field, e.what()));
  }
}

DecodeBytes decode_bytes_estimate(const MediaHeader& h) {
  if (h.kind == MediaKind::kImage) {
    const size_t pixels = size_t(h.width) * size_t(h.height);
    return {10 * pixels, 3 * pixels};
  }
  const size_t frames = size_t(std::max<int64_t>(h.frames, 0));
  const size_t channels = size_t(std::max<int64_t>(h.channels, 1));
  return {8 * frames * (2 * channels + 1), 8 * frames};
}

Media decode_media(MediaKind kind, const std::vector<uint8_t>& bytes, const std::string& field,
                   const MediaLimits& limits, const std::shared_ptr<DecodeBudget>& budget) {
  const MediaHeader header = probe_media(kind, bytes, field, limits);
  const DecodeBytes need = decode_bytes_estimate(header);
  Media m;
  m.kind = kind;
  if (budget) m.decode_hold = budget->reserve(need.peak, field);
  try {
    if (kind == MediaKind::kImage) {
      m.image = decode_image(bytes, field, limits.max_image_pixels);
    } else {
      AudioDecodeOptions o;
      o.max_seconds = limits.max_audio_seconds;
      // MP3 headers estimate their length: a longer clip grows its hold as it decodes.
      if (m.decode_hold)
        o.reserve_frames = [&](int64_t frames) {
          const size_t want = 8 * size_t(frames) * (2 * size_t(header.channels) + 1);
          const size_t held = m.decode_hold->bytes();
          if (want > held) m.decode_hold->resize(std::max(want, std::min(2 * held, budget->capacity())), field);
        };
      DecodedAudio a = decode_audio(std::span<const uint8_t>(bytes), o, field);
      m.samples = std::move(a.samples);
      m.sample_rate = a.sample_rate;
    }
  } catch (const ProcessorError&) {
    throw;
  } catch (const std::exception& e) {
    throw ProcessorError(field, e.what());
  }
  // What the Media keeps until it is freed.
  if (m.decode_hold)
    m.decode_hold->resize(kind == MediaKind::kImage ? need.kept : 8 * m.samples.size(), field);
  return m;
}

int64_t media_token_count(const Media& item, const std::string& field, int64_t max_crops) {
  try {
    if (item.kind == MediaKind::kImage) return num_image_tokens(item.image.width, item.image.height, image_options(max_crops));
    return audio_token_count(int64_t(item.samples.size()), item.sample_rate);
  } catch (const std::exception& e) {
    throw ProcessorError(field, fmt::format("{}: {}", field, e.what()));
  }
}

}  // namespace areno::phi4mm
