// `areno`: one program, several subcommands.
#include <fmt/format.h>

#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "app/cmd_tokenize.h"
#include "app/commands.h"
#include "app/commands_model.h"
#include "app/commands_serve.h"
#include "app/commands_train.h"
#include "areno_build_config.h"

namespace {

struct Command {
  const char* name;
  const char* summary;
  std::function<int(const areno::app::Args&)> run;
};

const std::vector<Command>& commands() {
  static const std::vector<Command> cmds = {
      {"env", "print version, build options, CUDA devices and library versions", areno::app::cmd_env},
      {"init", "write a random-weight checkpoint (tiny|small|full preset)", areno::app::cmd_init},
      {"logits", "write the logits of token ids or of a chat request with media", areno::app::cmd_logits},
      {"preprocess", "write the processor tensors (ids, crops, masks, log-mels) of a chat request",
       areno::app::cmd_preprocess},
      {"tokenize", "tokenize text or a messages file and print the ids as JSON", areno::app::cmd_tokenize},
      {"serve", "OpenAI-compatible HTTP server (demo model without --model-path)", areno::app::cmd_serve},
      {"batch", "run an OpenAI batch file (JSONL) through the server's routes", areno::app::cmd_batch},
      {"generate", "run one chat request and stream the answer", areno::app::cmd_generate},
      {"score", "print per-token log-probabilities of a completion (JSON)", areno::app::cmd_score},
      {"train", "fine-tune: chat rows (--algo sft), RL on prompts (grpo|gspo|ppo), preference pairs (dpo)", areno::app::cmd_train},
      {"eval", "greedy exact-match accuracy on chat rows", areno::app::cmd_eval},
      {"merge-lora", "fold a checkpoint's user LoRA (train --lora-rank) into its base weights",
       areno::app::cmd_merge_lora},
      {"export-lora", "write a checkpoint's user LoRA as a PEFT adapter folder", areno::app::cmd_export_lora},
  };
  return cmds;
}

void print_help() {
  fmt::print(
      "areno {} - train and serve Phi-4-multimodal natively\n\n"
      "usage: areno <command> [options]\n       areno <command> --help\n\ncommands:\n",
      ARENO_VERSION);
  for (auto& c : commands()) fmt::print("  {:<12} {}\n", c.name, c.summary);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    print_help();
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version")) {
    fmt::print("areno {}\n", ARENO_VERSION);
    return 0;
  }
  for (auto& c : commands()) {
    if (c.name == std::string(argv[1])) {
      try {
        return c.run(areno::app::Args(argv + 2, argv + argc));
      } catch (const std::exception& e) {
        fmt::print(stderr, "areno {}: error: {}\n", c.name, e.what());
        return 1;
      }
    }
  }
  fmt::print(stderr, "areno: unknown command '{}' (see areno --help)\n", argv[1]);
  return 2;
}
