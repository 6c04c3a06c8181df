#include "serve/media.h"

#include <span>

#include <fmt/format.h>

#include "models/phi4mm/audio/audio_io.h"
#include "models/phi4mm/processor/image_io.h"

namespace areno::serve {

DecodedMedia decode_media(MediaKind kind, const std::vector<uint8_t>& bytes, const std::string& what,
                          const MediaLimits& limits) {
  if (bytes.empty()) throw MediaError(fmt::format("{}: the {} is empty", what, phi4mm::media_kind_name(kind)));
  if (bytes.size() > limits.max_bytes)
    throw MediaError(fmt::format("{}: {} bytes exceed the limit of {} bytes", what, bytes.size(), limits.max_bytes));
  DecodedMedia m;
  m.kind = kind;
  try {
    if (kind == MediaKind::kImage) {
      m.image = phi4mm::decode_image(bytes, what, limits.max_image_pixels);
    } else {
      phi4mm::AudioDecodeOptions o;
      o.max_seconds = limits.max_audio_seconds;
      phi4mm::DecodedAudio a = phi4mm::decode_audio(std::span<const uint8_t>(bytes), o, what);
      m.samples = std::move(a.samples);
      m.sample_rate = a.sample_rate;
    }
  } catch (const MediaError&) {
    throw;
  } catch (const std::exception& e) {
    throw MediaError(e.what());
  }
  return m;
}

int64_t count_media_tokens(const DecodedMedia& item) {
  try {
    if (item.kind == MediaKind::kImage) return phi4mm::num_image_tokens(item.image.width, item.image.height);
    return phi4mm::audio_token_count(int64_t(item.samples.size()), item.sample_rate);
  } catch (const std::exception& e) {
    throw MediaError(e.what());
  }
}

namespace {

class CountingEncoder : public MediaEncoder {
 public:
  bool supports(MediaKind) const override { return true; }
  int64_t num_tokens(const DecodedMedia& item) const override { return count_media_tokens(item); }
  std::function<Tensor()> encode(std::vector<DecodedMedia>, InputMode) const override {
    throw std::logic_error("the counting encoder has no towers");
  }
};

class TowerEncoder : public MediaEncoder {
 public:
  explicit TowerEncoder(std::shared_ptr<const phi4mm::Phi4MMForCausalLM> m) : model_(std::move(m)) {}

  bool supports(MediaKind kind) const override {
    return kind == MediaKind::kImage ? model_->image_embed() != nullptr : model_->audio_embed() != nullptr;
  }

  int64_t num_tokens(const DecodedMedia& item) const override {
    if (!supports(item.kind))
      throw MediaError(fmt::format("this model has no {} tower", item.kind == MediaKind::kImage ? "vision" : "audio"));
    return count_media_tokens(item);
  }

  std::function<Tensor()> encode(std::vector<DecodedMedia> items, InputMode) const override {
    auto in = std::make_shared<phi4mm::MediaInputs>();
    for (auto& it : items) {
      in->order_is_image.push_back(it.kind == MediaKind::kImage);
      if (it.kind == MediaKind::kImage) {
        in->images.push_back(std::move(it.image));
      } else {
        in->audio.push_back(std::move(it.samples));
        in->audio_rates.push_back(it.sample_rate);
      }
    }
    // The audio projector follows from the items (vision when an image is
    // present), which is what the request's mode says.
    auto model = model_;
    return [model, in] { return phi4mm::media_rows(*model, *in); };
  }

 private:
  std::shared_ptr<const phi4mm::Phi4MMForCausalLM> model_;
};

}  // namespace

std::unique_ptr<MediaEncoder> make_counting_encoder() { return std::make_unique<CountingEncoder>(); }

std::unique_ptr<MediaEncoder> make_media_encoder(std::shared_ptr<const phi4mm::Phi4MMForCausalLM> model) {
  return std::make_unique<TowerEncoder>(std::move(model));
}

}  // namespace areno::serve
