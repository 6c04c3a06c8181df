#pragma once
// Serving subcommands of `areno` (issue 7): `serve` runs the OpenAI-compatible
// HTTP server, `generate` runs one request from the command line, `score`
// prints per-token log-probabilities of a completion.
#include <memory>
#include <optional>
#include <string>

#include "app/commands.h"
#include "app/served_model.h"

namespace areno::app {

// areno serve [--model-path DIR] [--port 8000] ... (see `areno serve --help`)
int cmd_serve(const Args& args);
// areno generate [--model-path DIR] --prompt T [--image F] [--audio F] [--max-tokens N]
//                [--temperature T] [--seed S]
int cmd_generate(const Args& args);
// areno score [--model-path DIR] --prompt T --completion T
int cmd_score(const Args& args);

}  // namespace areno::app
