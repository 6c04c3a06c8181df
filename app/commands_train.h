#pragma once
// Training subcommands of `areno` (issue 14).
#include "app/commands.h"

namespace areno::app {

// areno train --algo sft --dataset-path FILE [--ckpt DIR] [options]
int cmd_train(const Args& args);

// areno eval --dataset-path FILE [--model-path DIR] [--group-by FIELD]
int cmd_eval(const Args& args);

}  // namespace areno::app
