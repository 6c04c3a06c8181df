#pragma once
// Loading and saving Phi-4-multimodal checkpoints (spec text.md sections 3.4, 4, 7).
//
// One loader, load_model, for every command and the library: config.json
// (original or native layout) and generation_config.json are read once, the
// shards (model.safetensors[.index.json]) are opened once, and the whole model
// (language model, LoRAs, towers) is filled by one name walk. One resolver maps
// each parameter name to its stored tensor: the name as is (original layout,
// towers under model.embed_tokens_extend.*), `<m>.weight` for
// `<m>.base_layer.weight` (native layout), or a PEFT folder's
// `base_model.model.<m>.lora_A.weight` (`vision-lora/`, `speech-lora/`, with
// their adapter_config.json, and LoadOptions::lora_dir as the user adapter);
// tensor-parallel slices will be resolved there
// too. A tower is built when asked for and its tensors are stored; tensors of
// parts not built (towers, LoRAs) are skipped without being read. Every
// expected tensor must be present with its shape, and every stored tensor must
// be consumed or skipped; all of that is checked before a weight is copied.
//
// Save writes the original layout: shards + index, config.json and
// generation_config.json; a saved model reloads bit-identically. Every file is
// written through one FileSet (nn/io/atomic_file.h): all are written and
// fsynced before any is renamed into place, so a failed save (disk full) leaves
// the folder's previous checkpoint loadable and says which file failed and why.
// Then the files of an older layout are removed: stale shards, a stale index or
// single model.safetensors, and vision-lora/ / speech-lora/ adapter files.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "models/phi4mm/text.h"
#include "nn/io/safetensors.h"

namespace areno::phi4mm {

struct LoadOptions {
  bool with_lora = true;     // load the vision/speech adapters the config declares (a user adapter always loads)
  std::optional<DType> dtype;  // default: the checkpoint's dtype of model.embed_tokens.weight
  Device device = Device::cpu();
  bool vision = true;  // the image embedding, when the checkpoint stores it
  bool audio = true;   // the audio embedding, when the checkpoint stores it
  // Refuse NaN and infinite weights (after the conversion to `dtype`), naming
  // the file and the tensor: `--check-weights` of the commands. One more pass
  // over the weights.
  bool check_weights = false;
  // Weight-only int8 of the decoder and the tied head (`--quantize int8`, CPU
  // only, f32 or bf16 compute): each of Phi4MMForCausalLM::quantizable_weights()
  // is quantized from its stored values as it is read, so the model never
  // holds them in full precision. A stored NaN or inf there fails naming it.
  Quantize quantize = Quantize::none;
  // A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors, as
  // peft's save_pretrained writes it for transformers' port) loaded as the
  // user adapter (`--lora DIR`): on every row, beside the modality adapter.
  // Its targets are the decoder linears its tensors wrap, the same in every
  // layer; DoRA, rsLoRA, biases, per-module ranks and saved modules are
  // refused by key, and so is a checkpoint that holds a user adapter already.
  std::string lora_dir;
};

struct LoadReport {
  int64_t expected = 0;    // tensors the model needs
  int64_t consumed = 0;    // of those, found with the right shape
  int64_t skipped = 0;     // stored tensors not needed (towers, tied lm_head), not read
  int64_t quantized = 0;   // of the consumed, held in int8 (LoadOptions::quantize)
  // "N of N tensors consumed, 0 missing, 0 unexpected (K skipped)", then
  // ", Q quantized to int8" when Q > 0.
  std::string summary() const;
};

// Copies every parameter of `m` from `ckpt`, the stored name being `prefix` +
// the parameter's dotted name (the same walk as load_model, for a module
// alone: a tower's unit tests and benchmarks). Throws naming `source`, the
// missing and the wrongly shaped tensors, before copying anything.
void load_prefixed(Module& m, const SafetensorsCheckpoint& ckpt, const std::string& prefix,
                   const std::string& source);
// The parameters of `m` as (prefix + name, tensor in `dtype`) pairs, for saving.
std::vector<std::pair<std::string, Tensor>> prefixed_tensors(const Module& m, const std::string& prefix,
                                                             DType dtype);

// Loads the model stored in `dir` (see the top of this file).
std::shared_ptr<Phi4MMForCausalLM> load_model(const std::string& dir, const LoadOptions& opts = {},
                                              LoadReport* report = nullptr);

// Adds the user adapter of the PEFT folder `dir` to a model built in memory
// (the demo model; load_model reads one with LoadOptions::lora_dir), checked
// as there. Throws naming the folder and the key or tensor; the model is
// unusable after a throw past the checks of its config.
void load_user_lora(Phi4MMForCausalLM& m, const std::string& dir);

// The user adapter a PEFT folder holds (r, alpha, dropout, targets), checked
// as LoadOptions::lora_dir does, for a model of `layers` decoder layers; no
// weight is read.
LoraConfig peft_lora_config(const std::string& dir, int64_t layers);

// Adds the PEFT folder `dir` to the model as served adapter `name`
// (ServedLora, `areno serve --lora-modules NAME=DIR`), checked as a user
// adapter folder is; returns its number. Throws naming the folder and the key
// or tensor, with nothing added.
// `source` is what ServedLora::source reports (default: `dir`).
int32_t load_served_lora(Phi4MMForCausalLM& m, const std::string& name, const std::string& dir,
                         const std::string& source = "");

// Writes the model's user adapter as peft saves one for transformers' port:
// `dir`/adapter_model.safetensors (base_model.model.<module>.lora_A.weight,
// ...) and adapter_config.json (r, lora_alpha, lora_dropout, target_modules
// as a regex over the decoder's layers), written to temporaries, synced and
// renamed. LoadOptions::lora_dir reads it back. Throws std::invalid_argument
// when the model has no user adapter.
void save_user_lora_peft(const Phi4MMForCausalLM& m, const std::string& dir);

struct SaveOptions {
  std::optional<DType> dtype;               // default: the model's dtype
  uint64_t max_shard_bytes = 5000000000ull;  // as the released checkpoint (about 5 GB)
  // Fold the user adapter into the base weights, W + s·B·A computed in f32
  // and rounded once to the saved dtype, and write neither its tensors nor its
  // config block: a checkpoint of the released names only, for tools that do
  // not know "user_lora" (`areno merge-lora`). No effect without one.
  bool merge_user_lora = false;
};

// Writes the model (every part it has) into `dir` (created when missing) in
// the original layout, replacing a checkpoint already there (see the top).
void save_model(const Phi4MMForCausalLM& model, const std::string& dir, const SaveOptions& opts = {});

// Copies the files of checkpoint folder `from` that are not weights, configs
// or training state (tokenizer, processor and remote-code files) into `to`,
// each written to a temporary, synced and renamed.
void copy_side_files(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace areno::phi4mm
