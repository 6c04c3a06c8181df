#include "models/phi4mm/model.h"

#include <map>
#include <stdexcept>

#include <fmt/format.h>

#include "models/phi4mm/init.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"

namespace areno::phi4mm {

namespace {

// A tower's rows [sum counts, D] as one block per item; the sum must match.
std::vector<Tensor> split_rows(const Tensor& rows, const std::vector<int64_t>& counts, const char* tower) {
  std::vector<Tensor> out;
  int64_t at = 0;
  for (int64_t n : counts) {
    out.push_back(rows.narrow(0, at, n));
    at += n;
  }
  if (at != rows.size(0)) throw std::runtime_error(fmt::format("{}: {} rows for {} tokens", tower, rows.size(0), at));
  return out;
}

}  // namespace

std::shared_ptr<Phi4MMForCausalLM> init_phi4mm(const std::string& preset, uint64_t seed, DType dtype) {
  return init_phi4mm(preset_config(preset), seed, dtype);
}

std::shared_ptr<Phi4MMForCausalLM> init_phi4mm(const Config& config, uint64_t seed, DType dtype) {
  ModelParts parts;
  parts.vision = parts.audio = true;
  auto m = std::make_shared<Phi4MMForCausalLM>(config, TensorOptions(dtype), parts);
  {
    Generator g(seed);  // the same language model as init_model alone
    init_weights(*m, g);
  }
  {
    Generator g(seed + 1);
    init_weights(*m->image_embed(), g);
  }
  {
    Generator g(seed + 2);
    init_audio_weights(*m->audio_embed(), g);
  }
  m->eval();
  return m;
}

std::vector<Tensor> media_rows_each(const Phi4MMForCausalLM& model, std::span<const Media> media,
                                    std::optional<bool> with_image) {
  // Images by their crop limit (each group one tower batch), clips together.
  std::map<int64_t, std::vector<size_t>> image_groups;  // max crops -> indices into media
  std::vector<AudioClip> clips;
  for (size_t i = 0; i < media.size(); ++i) {
    const Media& m = media[i];
    if (m.kind == MediaKind::kImage)
      image_groups[m.max_crops > 0 ? m.max_crops : model.config().vision.dynamic_hd].push_back(i);
    else
      clips.push_back({m.samples, m.sample_rate});
  }
  const bool has_image = with_image.value_or(!image_groups.empty());
  std::vector<Tensor> image_rows(media.size()), audio_rows;
  if (!image_groups.empty()) {
    if (!model.image_embed()) throw std::invalid_argument("this model has no vision tower; images cannot be used");
    for (const auto& [crops, index] : image_groups) {
      std::vector<RgbImage> images;
      for (size_t i : index) images.push_back(media[i].image);
      ImageBatch b = process_images(images, image_options(crops));
      std::vector<Tensor> rows = split_rows(model.image_embed()->forward(b), b.num_img_tokens, "vision tower");
      for (size_t k = 0; k < index.size(); ++k) image_rows[index[k]] = std::move(rows[k]);
    }
  }
  if (!clips.empty()) {
    if (!model.audio_embed()) throw std::invalid_argument("this model has no audio encoder; audio cannot be used");
    AudioBatch ab = audio_features_batch(clips);
    audio_rows = split_rows(
        model.audio_embed()->forward(ab.features, ab.frames, has_image ? AudioProjection::vision : AudioProjection::speech),
        ab.tokens, "audio encoder");
  }
  std::vector<Tensor> parts;
  size_t ai = 0;
  const DType dt = model.dtype();
  for (size_t i = 0; i < media.size(); ++i)
    parts.push_back((media[i].kind == MediaKind::kImage ? image_rows[i] : audio_rows[ai++]).to(model.device(), dt));
  return parts;
}

Tensor media_rows(const Phi4MMForCausalLM& model, std::span<const Media> media) {
  std::vector<Tensor> parts = media_rows_each(model, media);
  if (parts.empty()) return Tensor();
  return parts.size() == 1 ? parts[0] : cat(parts, 0);
}

}  // namespace areno::phi4mm
