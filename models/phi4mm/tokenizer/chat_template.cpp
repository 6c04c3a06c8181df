#include "models/phi4mm/tokenizer/chat_template.h"

namespace areno::phi4mm {

std::string render_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                        bool continue_final_message) {
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    out += "<|";
    out += m.role;
    out += "|>";
    out += m.content;
    if (m.role == "system" && m.tools) {
      out += "<|tool|>";
      out += *m.tools;
      out += "<|/tool|>";
    }
    if (continue_final_message && i + 1 == messages.size()) return out;
    out += "<|end|>";
  }
  out += add_generation_prompt ? "<|assistant|>" : "<|endoftext|>";
  return out;
}

}  // namespace areno::phi4mm
