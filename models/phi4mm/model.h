#pragma once
// The whole Phi-4-multimodal model: the language model with its LoRAs, the
// image embedding (SigLIP tower, separators, projector) and the audio
// embedding (Conformer encoder, speech and vision projectors), loaded from and
// saved to one checkpoint directory in the released layout.
//
// Towers are optional: a checkpoint without tensors under
// model.embed_tokens_extend.image_embed. / audio_embed. (or a load that asks
// for the text model only) leaves them null, and requests with that modality
// are refused. Tower sizes come from config.json (vision_config_from,
// audio_config_from); absent keys mean the released sizes.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/phi4mm/audio/audio_features.h"
#include "models/phi4mm/audio/encoder.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/processor/image_processor.h"
#include "models/phi4mm/text.h"
#include "models/phi4mm/vision/vision.h"

namespace areno::phi4mm {

struct Phi4MM {
  std::shared_ptr<Phi4MMForCausalLM> lm;
  std::shared_ptr<ImageEmbed> vision;  // null: no image input
  std::shared_ptr<AudioEmbed> audio;   // null: no audio input
  const Config& config() const { return lm->config(); }
};

struct ModelLoadOptions : LoadOptions {
  bool vision = true;  // load the image embedding when the checkpoint has it
  bool audio = true;   // load the audio embedding when the checkpoint has it
};

// Loads every component present (config validated first, then shapes, then
// weights). `report` counts the tower tensors too.
std::shared_ptr<Phi4MM> load_phi4mm(const std::string& dir, const ModelLoadOptions& opts = {},
                                    LoadReport* report = nullptr);

// Writes all components in the original layout (shards + index + configs).
void save_phi4mm(const Phi4MM& model, const std::string& dir, const SaveOptions& opts = {});

// A preset (tiny|small|full) with every component, random weights from `seed`.
std::shared_ptr<Phi4MM> init_phi4mm(const std::string& preset, uint64_t seed, DType dtype = DType::f32);

// ---- media rows (spec text.md 5.4) ----

// Processor outputs of one request's media, ready for the towers.
struct MediaInputs {
  std::vector<RgbImage> images;                         // in order of appearance
  std::vector<std::vector<double>> audio;               // mono samples per clip
  std::vector<int64_t> audio_rates;                     // sample rate per clip
  // Item order in the prompt: true = image, false = audio (images and audio
  // in their own order within each kind).
  std::vector<bool> order_is_image;
};

// Embedding rows for every placeholder of a prompt holding `in`'s media, in
// prompt order: each image's rows (vision tower + projector), each clip's rows
// (audio encoder + the speech projector, or the vision projector when the
// request has an image). [sum of token counts, hidden].
Tensor media_rows(const Phi4MM& model, const MediaInputs& in);

// Token counts of each item: num_image_tokens(w, h) (image_processor.h) and
// audio_token_count(samples, rate) (audio_features.h).

}  // namespace areno::phi4mm
