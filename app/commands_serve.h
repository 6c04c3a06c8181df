#pragma once
// Serving subcommands of `areno` (issue 7): `serve` runs the OpenAI-compatible
// HTTP server, `generate` runs one request from the command line, `score`
// prints per-token log-probabilities of a completion.
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "app/commands.h"
#include "app/served_model.h"
#include "serve/engine.h"
#include "serve/http_server.h"

namespace areno::app {

// areno serve [--model-path DIR] [--port 8000] ... (see `areno serve --help`)
int cmd_serve(const Args& args);
// areno batch -i FILE -o FILE [serve's model, engine, request and media flags]:
// OpenAI batch files through the server's routes (vLLM's run_batch).
int cmd_batch(const Args& args);

// What `areno serve` and `areno batch` share: the model, engine, request and
// media flags (and with `http` the listener's), and the model they load.
struct ServeSetup {
  std::string model_path, served_name, device = "cpu", dtype;
  serve::ServerOptions so;
  serve::EngineOptions eo;
  ModelNeeds needs;
  std::vector<std::pair<std::string, std::string>> lora_modules;  // --lora-modules NAME, DIR
  double kv_gb = 1.0, body_mb = 32, media_cache_mb = 256, decode_mb = 0, responses_store_mb = 64;
  std::optional<int64_t> dynamic_hd;  // --mm-processor-kwargs '{"dynamic_hd": N}'
};
void add_serve_flags(Flags& flags, ServeSetup& s, bool http);
// After parsing: the cross-flag checks, the sizes in bytes.
void finish_serve_flags(ServeSetup& s);
// Loads the model (phi4mm::load_served_model) and the --lora-modules, names
// the served model; `command` names the demo notice's sender.
ServedModel load_for_serving(ServeSetup& s, const char* command);
// areno generate [--model-path DIR] --prompt T [--image F] [--audio F] [--max-tokens N]
//                [--temperature T] [--seed S]
int cmd_generate(const Args& args);
// areno score [--model-path DIR] --prompt T --completion T
int cmd_score(const Args& args);

}  // namespace areno::app
