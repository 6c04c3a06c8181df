#pragma once
// Model subcommands of `areno` (issue 3): `init` writes a random-weight
// checkpoint, `logits` runs the language model on token ids.
#include "app/commands.h"

namespace areno::app {

// areno init --preset tiny|small|full --out DIR --seed N [--dtype bf16|f32]
int cmd_init(const Args& args);
// areno logits --model-path DIR --token-ids 1,2,3 [--adapter none|vision|speech]
//              [--dtype f32|bf16] --out FILE.safetensors
int cmd_logits(const Args& args);

}  // namespace areno::app
