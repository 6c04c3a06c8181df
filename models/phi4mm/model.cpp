#include "models/phi4mm/model.h"

#include <stdexcept>

#include <fmt/format.h>

#include "models/phi4mm/init.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"

namespace areno::phi4mm {


namespace {

bool has_prefix(const SafetensorsCheckpoint& ckpt, const std::string& prefix) {
  for (const auto& n : ckpt.names())
    if (n.rfind(prefix, 0) == 0) return true;
  return false;
}

int64_t count_prefix(const SafetensorsCheckpoint& ckpt, const std::string& prefix) {
  int64_t n = 0;
  for (const auto& name : ckpt.names()) n += name.rfind(prefix, 0) == 0;
  return n;
}

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

std::shared_ptr<Phi4MM> load_phi4mm(const std::string& dir, const ModelLoadOptions& opts, LoadReport* report) {
  // Configs of every component first: a bad tower config fails before any weight.
  Config cfg = load_config(dir);
  std::optional<VisionConfig> vcfg;
  std::optional<AudioConfig> acfg;
  if (opts.vision) vcfg = vision_config_from(cfg.raw, dir + "/config.json");
  if (opts.audio) {
    try {
      acfg = audio_config_from(cfg.raw);
    } catch (const std::exception& e) {
      throw std::runtime_error(fmt::format("{}/config.json: {}", dir, e.what()));
    }
  }
  // Then the shard headers: a tower is loaded when its tensors are there.
  SafetensorsCheckpoint ckpt(dir);
  if (vcfg && !has_prefix(ckpt, kImageEmbedPrefix)) vcfg.reset();
  if (acfg && !has_prefix(ckpt, kAudioEmbedPrefix)) acfg.reset();
  auto m = std::make_shared<Phi4MM>();
  LoadReport text_report;
  m->lm = load_model(dir, opts, &text_report);
  int64_t consumed = text_report.consumed, skipped = text_report.skipped;
  const DType dtype = m->lm->dtype();
  if (vcfg) {
    m->vision = load_image_embed(ckpt, *vcfg, dir, dtype, opts.device);
    const int64_t n = count_prefix(ckpt, kImageEmbedPrefix);
    consumed += n, skipped -= n;
  }
  if (acfg) {
    auto a = std::make_shared<AudioEmbed>(*acfg, TensorOptions(dtype));
    load_prefixed(*a, ckpt, kAudioEmbedPrefix, dir);
    a->eval();
    if (opts.device != Device::cpu()) a->to(opts.device);
    m->audio = a;
    const int64_t n = count_prefix(ckpt, kAudioEmbedPrefix);
    consumed += n, skipped -= n;
  }
  if (report) {
    report->expected = consumed;
    report->consumed = consumed;
    report->skipped = skipped;
  }
  return m;
}

void save_phi4mm(const Phi4MM& model, const std::string& dir, const SaveOptions& opts) {
  const DType dtype = opts.dtype.value_or(model.lm->dtype());
  std::vector<std::pair<std::string, Tensor>> towers;
  if (model.vision) towers = image_embed_tensors(*model.vision, dtype);
  if (model.audio) {
    auto a = prefixed_tensors(*model.audio, kAudioEmbedPrefix, dtype);
    towers.insert(towers.end(), a.begin(), a.end());
  }
  save_model(*model.lm, dir, opts, towers);
}

std::shared_ptr<Phi4MM> init_phi4mm(const std::string& preset, uint64_t seed, DType dtype) {
  auto m = std::make_shared<Phi4MM>();
  m->lm = init_model(preset, seed, dtype);  // the same language model as init_model alone
  const Config& c = m->lm->config();
  {
    auto v = std::make_shared<ImageEmbed>(vision_config_from(c.raw, "preset " + preset), TensorOptions(dtype));
    Generator g(seed + 1);
    init_weights(*v, g);
    v->eval();
    m->vision = v;
  }
  {
    auto a = std::make_shared<AudioEmbed>(audio_config_from(c.raw), TensorOptions(dtype));
    Generator g(seed + 2);
    init_audio_weights(*a, g);
    a->eval();
    m->audio = a;
  }
  return m;
}

Tensor media_rows(const Phi4MM& model, const MediaInputs& in) {
  const bool has_image = !in.images.empty();
  std::vector<Tensor> image_rows, audio_rows;
  if (has_image) {
    if (!model.vision) throw std::invalid_argument("this model has no vision tower; images cannot be used");
    ImageBatch b = process_images(in.images);
    image_rows = split_rows(model.vision->forward(b), b.num_img_tokens, "vision tower");
  }
  if (!in.audio.empty()) {
    if (!model.audio) throw std::invalid_argument("this model has no audio encoder; audio cannot be used");
    if (in.audio_rates.size() != in.audio.size()) throw std::invalid_argument("media_rows: one rate per clip");
    std::vector<AudioClip> clips;
    for (size_t i = 0; i < in.audio.size(); ++i) clips.push_back({in.audio[i], in.audio_rates[i]});
    AudioBatch ab = audio_features_batch(clips);
    audio_rows = split_rows(
        model.audio->forward(ab.features, ab.frames, has_image ? AudioProjection::vision : AudioProjection::speech),
        ab.tokens, "audio encoder");
  }
  if (in.order_is_image.size() != image_rows.size() + audio_rows.size())
    throw std::invalid_argument("media_rows: order_is_image must name every item");
  std::vector<Tensor> parts;
  size_t ii = 0, ai = 0;
  for (bool is_image : in.order_is_image) {
    if (is_image) {
      if (ii >= image_rows.size()) throw std::invalid_argument("media_rows: more image items than images");
      parts.push_back(image_rows[ii++]);
    } else {
      if (ai >= audio_rows.size()) throw std::invalid_argument("media_rows: more audio items than clips");
      parts.push_back(audio_rows[ai++]);
    }
  }
  if (parts.empty()) return Tensor();
  const DType dt = model.lm->dtype();
  for (auto& p : parts) p = p.to(model.lm->device(), dt);
  return parts.size() == 1 ? parts[0] : cat(parts, 0);
}

}  // namespace areno::phi4mm
