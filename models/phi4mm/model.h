#pragma once
// The whole Phi-4-multimodal model is one Module, Phi4MMForCausalLM (text.h):
// the language model with its LoRAs and the image and audio embeddings under
// model.embed_tokens_extend, loaded and saved by load_model / save_model
// (checkpoint.h). This header adds the presets with every component and the
// media rows the towers compute for a prompt.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "models/phi4mm/audio/audio_features.h"
#include "models/phi4mm/audio/encoder.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/processor/image_processor.h"
#include "models/phi4mm/processor/media.h"
#include "models/phi4mm/text.h"
#include "models/phi4mm/vision/vision.h"

namespace areno::phi4mm {

// A preset (tiny|small|full) with every component, random weights from `seed`
// (the language model as init_model, the towers from seed + 1 and seed + 2).
std::shared_ptr<Phi4MMForCausalLM> init_phi4mm(const std::string& preset, uint64_t seed, DType dtype = DType::f32);
// The same from a config (a preset's config with changes, e.g. a LoRA dropout).
std::shared_ptr<Phi4MMForCausalLM> init_phi4mm(const Config& config, uint64_t seed, DType dtype = DType::f32);

// ---- media rows (spec text.md 5.4) ----

// Embedding rows for every placeholder of a prompt holding `media` (in prompt
// order, as ProcessedChat::media): each image's rows (image processor, vision
// tower + projector), each clip's rows (features, audio encoder + the speech
// projector, or the vision projector when the request has an image).
// [sum of token counts, hidden]; undefined when `media` is empty.
Tensor media_rows(const Phi4MMForCausalLM& model, std::span<const Media> media);
// The same, one tensor per item ([its token count, hidden]). `with_image`:
// whether the request holds an image (its clips then take the vision
// projector), when `media` is only part of the request's items (the serving
// engine's per-item cache); nullopt: whether `media` holds one.
std::vector<Tensor> media_rows_each(const Phi4MMForCausalLM& model, std::span<const Media> media,
                                    std::optional<bool> with_image = std::nullopt);

// Token counts of each item: num_image_tokens(w, h) (image_processor.h) and
// audio_token_count(samples, rate) (audio_features.h).

}  // namespace areno::phi4mm
