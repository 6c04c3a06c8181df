#pragma once
// Model subcommands of `areno` (issue 3): `init` writes a random-weight
// checkpoint, `logits` runs the language model on token ids.
#include "app/commands.h"
#include "models/phi4mm/processor/chat_processor.h"

namespace areno::app {

// areno init --preset tiny|small|full --out DIR --seed N [--dtype bf16|f32]
int cmd_init(const Args& args);
// areno logits --model-path DIR --token-ids 1,2,3 [--adapter none|vision|speech]
//              [--dtype f32|bf16] --out FILE.safetensors
int cmd_logits(const Args& args);
// areno preprocess [--model-path DIR] --messages FILE.json --out FILE.safetensors
int cmd_preprocess(const Args& args);
// areno merge-lora --model-path DIR --out DIR [--dtype f32|bf16]
int cmd_merge_lora(const Args& args);
// areno export-lora --model-path DIR --out PEFT_DIR
int cmd_export_lora(const Args& args);

// An OpenAI chat request from a JSON file (array of messages, or an object with
// "messages" and optional "tools"); media paths resolve under the file's
// folder; `options` says which modalities are accepted.
phi4mm::ProcessedChat read_messages_file(const std::string& path, const tok::Tokenizer& tokenizer,
                                         phi4mm::ProcessorOptions options = {});

}  // namespace areno::app
