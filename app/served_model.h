#pragma once
// The one model loader of the commands (serve, generate, score, logits): the
// checkpoint of --model-path through phi4mm::load_model, or the embedded demo.
#include <memory>
#include <optional>
#include <string>

#include "app/flags.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/text.h"
#include "models/phi4mm/tokenizer/tokenizer.h"

namespace areno::app {

// The model (towers included) and tokenizer of --model-path, or without one the
// embedded demo model (init_phi4mm("tiny", seed 0), random weights, every
// component) with the built-in tokenizer.
struct ServedModel {
  std::shared_ptr<phi4mm::Phi4MMForCausalLM> model;  // every part loaded
  std::shared_ptr<const tok::Tokenizer> tokenizer;   // null when not asked for
  std::string name;   // the model path, or "areno-demo"
  bool demo = false;
};
// What a command needs of the checkpoint (everything by default).
struct ModelNeeds {
  bool lora = true;
  bool towers = true;
  bool tokenizer = true;
  bool check_weights = false;  // --check-weights: refuse NaN / inf weights (phi4mm::LoadOptions)
  phi4mm::Quantize quantize = phi4mm::Quantize::none;  // --quantize (phi4mm::LoadOptions; the demo model too)
  std::string lora_dir;  // --lora: a PEFT adapter folder loaded as the user adapter (phi4mm::LoadOptions)
};
// Registers `--quantize none|int8` (into needs.quantize) and `--lora DIR`
// (needs.lora_dir) on a command that loads a model.
void add_model_flags(Flags& flags, ModelNeeds& needs);
// The one model loader of the commands (serve, generate, score, logits):
// `device` "cpu" | "cuda[:N]"; `dtype` as parse_dtype_flag (app/flags.h).
ServedModel load_served_model(const std::string& model_path, const std::string& device, const std::string& dtype,
                              const ModelNeeds& needs = {});

}  // namespace areno::app
