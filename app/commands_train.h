#pragma once
// Training subcommands of `areno` (issue 14).
#include "app/commands.h"

namespace areno::app {

// areno train --algo sft --dataset-path FILE [--ckpt DIR] [options]
int cmd_train(const Args& args);

}  // namespace areno::app
