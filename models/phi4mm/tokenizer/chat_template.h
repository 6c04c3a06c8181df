// Phi-4 chat template, rendered natively (spec tokens-api.md 2.1): for each
// message "<|role|>" + content + "<|end|>" (a system message with tools adds
// "<|tool|>" + tools + "<|/tool|>" before "<|end|>"), then "<|assistant|>" if
// add_generation_prompt, else "<|endoftext|>". No whitespace is inserted.
// continue_final_message (transformers' apply_chat_template, vLLM's field):
// the text stops right after the last message's content, which the model then
// continues (no "<|end|>", no generation prompt, no "<|endoftext|>").
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace areno::phi4mm {

struct ChatMessage {
  std::string role;                  // used verbatim, as the template does
  std::string content;
  std::optional<std::string> tools;  // system messages only: the tool list as a string
};

std::string render_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                        bool continue_final_message = false);

}  // namespace areno::phi4mm
