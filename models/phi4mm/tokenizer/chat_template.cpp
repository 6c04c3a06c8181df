#include "models/phi4mm/tokenizer/chat_template.h"

namespace areno::phi4mm {

std::string render_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  std::string out;
  for (const ChatMessage& m : messages) {
    out += "<|";
    out += m.role;
    out += "|>";
    out += m.content;
    if (m.role == "system" && m.tools) {
      out += "<|tool|>";
      out += *m.tools;
      out += "<|/tool|>";
    }
    out += "<|end|>";
  }
  out += add_generation_prompt ? "<|assistant|>" : "<|endoftext|>";
  return out;
}

}  // namespace areno::phi4mm
