#pragma once
// Loading and saving Phi-4-multimodal checkpoints (spec text.md sections 3.4, 4, 7).
//
// Load accepts a directory with config.json (original or native layout),
// generation_config.json and model.safetensors[.index.json] shards. The four
// adapted projections may be stored as `<m>.base_layer.weight` (original) or
// `<m>.weight` (native). LoRA tensors come from the checkpoint
// (`<m>.lora_A.vision.weight`) or from PEFT folders `vision-lora/` and
// `speech-lora/` (`base_model.model.<m>.lora_A.weight`, adapter_config.json).
// Tower tensors (`model.embed_tokens_extend.*`) are skipped without being read
// when only the text model is requested. Every expected tensor must be present
// with its shape, and every stored tensor must be consumed or skipped.
//
// Save writes the original layout: shards + index, config.json and
// generation_config.json; a saved model reloads bit-identically.
#include <cstdint>
#include <memory>
#include <string>

#include "models/phi4mm/text.h"
#include "nn/io/safetensors.h"

namespace areno::phi4mm {

struct LoadOptions {
  bool with_lora = true;     // load the vision/speech adapters the config declares
  std::optional<DType> dtype;  // default: the checkpoint's dtype of model.embed_tokens.weight
  Device device = Device::cpu();
};

struct LoadReport {
  int64_t expected = 0;    // tensors the model needs
  int64_t consumed = 0;    // of those, found with the right shape
  int64_t skipped = 0;     // stored tensors not needed (towers, tied lm_head), not read
  std::string summary() const;  // "N of N tensors consumed, 0 missing, 0 unexpected (K skipped)"
};

// Copies every parameter of `m` from `ckpt`, the stored name being `prefix` +
// the parameter's dotted name, converting to the parameter's dtype. Checks all
// names and shapes before copying anything; throws naming `source`, the
// missing and the wrongly shaped tensors. Returns the stored names consumed.
// Used for the towers (prefix "model.embed_tokens_extend.image_embed." etc.).
std::vector<std::string> load_prefixed(Module& m, const SafetensorsCheckpoint& ckpt, const std::string& prefix,
                                       const std::string& source);
// The parameters of `m` as (prefix + name, tensor in `dtype`) pairs, for saving.
std::vector<std::pair<std::string, Tensor>> prefixed_tensors(const Module& m, const std::string& prefix,
                                                             DType dtype);

std::shared_ptr<Phi4MMForCausalLM> load_model(const std::string& dir, const LoadOptions& opts = {},
                                              LoadReport* report = nullptr);

struct SaveOptions {
  std::optional<DType> dtype;               // default: the model's dtype
  uint64_t max_shard_bytes = 5000000000ull;  // as the released checkpoint (about 5 GB)
};

// Writes the model into `dir` (created when missing) in the original layout.
// `extra` tensors (the towers, already under their checkpoint names and in the
// save dtype) go into the same shards.
void save_model(const Phi4MMForCausalLM& model, const std::string& dir, const SaveOptions& opts = {},
                const std::vector<std::pair<std::string, Tensor>>& extra = {});

}  // namespace areno::phi4mm
