#pragma once
// Serving subcommands of `areno` (issue 7): `serve` runs the OpenAI-compatible
// HTTP server, `generate` runs one request from the command line, `score`
// prints per-token log-probabilities of a completion.
#include <memory>
#include <string>

#include "app/commands.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/text.h"
#include "serve/media.h"
#include "models/phi4mm/tokenizer/tokenizer.h"

namespace areno::app {

// areno serve [--model-path DIR] [--port 8000] ... (see `areno serve --help`)
int cmd_serve(const Args& args);
// areno generate [--model-path DIR] --prompt T [--image F] [--audio F] [--max-tokens N]
//                [--temperature T] [--seed S]
int cmd_generate(const Args& args);
// areno score [--model-path DIR] --prompt T --completion T
int cmd_score(const Args& args);

// The model (towers included) and tokenizer of --model-path, or without one the
// embedded demo model (init_phi4mm("tiny", seed 0), random weights, every
// component) with the built-in tokenizer.
struct ServedModel {
  std::shared_ptr<phi4mm::Phi4MM> mm;                 // every component loaded
  std::shared_ptr<phi4mm::Phi4MMForCausalLM> model;   // = mm->lm
  std::shared_ptr<serve::MediaEncoder> encoder;       // the towers (a modality without one is refused)
  std::shared_ptr<const tok::Tokenizer> tokenizer;
  std::string name;   // the model path, or "areno-demo"
  bool demo = false;
};
// `device` "cpu" | "cuda[:N]"; `dtype` "" (the checkpoint's) | "f32" | "bf16".
ServedModel load_served_model(const std::string& model_path, const std::string& device, const std::string& dtype);

}  // namespace areno::app
