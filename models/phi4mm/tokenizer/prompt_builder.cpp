#include "models/phi4mm/tokenizer/prompt_builder.h"

#include <stdexcept>

#include <fmt/format.h>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "models/phi4mm/tokenizer/utf8.h"

namespace areno::phi4mm {

using nlohmann::json;
using tok::require_valid_utf8;

std::string python_json_dumps(const json& v) {
  switch (v.type()) {
    case json::value_t::object: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, x] : v.items()) {
        if (!first) out += ", ";
        first = false;
        out += json(k).dump(-1, ' ', false, json::error_handler_t::replace);
        out += ": ";
        out += python_json_dumps(x);
      }
      return out + "}";
    }
    case json::value_t::array: {
      std::string out = "[";
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) out += ", ";
        out += python_json_dumps(v[i]);
      }
      return out + "]";
    }
    default:
      return v.dump(-1, ' ', false, json::error_handler_t::replace);
  }
}

std::string tools_to_string(const json& tools) {
  if (!tools.is_array()) throw std::runtime_error("'tools' must be an array of {\"type\": \"function\", \"function\": {...}}");
  std::string out = "[";
  for (size_t i = 0; i < tools.size(); ++i) {
    const json& t = tools[i];
    const json* fn = &t;
    if (t.is_object() && t.contains("function")) {
      if (t.value("type", "function") != "function") {
        throw std::runtime_error(fmt::format("tools[{}]: type '{}' is not supported (expected \"function\")", i, t.value("type", "")));
      }
      fn = &t["function"];
    }
    if (!fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string()) {
      throw std::runtime_error(fmt::format("tools[{}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", i));
    }
    // Model-card key order: name, description, parameters, then the rest.
    if (i) out += ", ";
    out += "{\"name\": " + python_json_dumps((*fn)["name"]);
    for (const char* key : {"description", "parameters"}) {
      if (fn->contains(key)) out += fmt::format(", \"{}\": {}", key, python_json_dumps((*fn)[key]));
    }
    for (const auto& [k, x] : fn->items()) {
      if (k == "name" || k == "description" || k == "parameters") continue;
      out += ", " + json(k).dump() + ": " + python_json_dumps(x);
    }
    out += "}";
  }
  return out + "]";
}

namespace {

std::string checked_text(const json& v, const std::string& where) {
  if (!v.is_string()) throw std::runtime_error(fmt::format("{} must be a string (got {})", where, v.type_name()));
  std::string s = v.get<std::string>();
  require_valid_utf8(s, where);
  return s;
}

// Kind of a content part, or throws for an unknown type.
enum class PartKind { kText, kImage, kAudio };

PartKind part_kind(const json& part, const std::string& where) {
  if (!part.is_object()) throw std::runtime_error(fmt::format("{} must be an object (got {})", where, part.type_name()));
  std::string type;
  if (part.contains("type")) {
    if (!part["type"].is_string()) throw std::runtime_error(fmt::format("{}.type must be a string", where));
    type = part["type"].get<std::string>();
  } else if (part.contains("image_url")) {  // shorthand without type (vLLM accepts it)
    type = "image_url";
  } else if (part.contains("audio_url")) {
    type = "audio_url";
  } else if (part.contains("input_audio")) {
    type = "input_audio";
  } else if (part.contains("text")) {
    type = "text";
  } else {
    throw std::runtime_error(fmt::format("{} has no 'type' (expected text, image_url, input_audio or audio_url)", where));
  }
  if (type == "text" || type == "input_text" || type == "refusal") return PartKind::kText;
  if (type == "image_url" || type == "input_image") {
    const json& u = part.contains("image_url") ? part["image_url"] : part.value("input_image", json());
    if (!(u.is_string() || (u.is_object() && u.contains("url") && u["url"].is_string()))) {
      throw std::runtime_error(fmt::format("{}.image_url must be {{\"url\": \"...\"}}", where));
    }
    return PartKind::kImage;
  }
  if (type == "audio_url") {
    const json& u = part.value("audio_url", json());
    if (!(u.is_string() || (u.is_object() && u.contains("url") && u["url"].is_string()))) {
      throw std::runtime_error(fmt::format("{}.audio_url must be {{\"url\": \"...\"}}", where));
    }
    return PartKind::kAudio;
  }
  if (type == "input_audio") {
    const json& a = part.value("input_audio", json());
    if (!a.is_object() || !a.contains("data") || !a["data"].is_string()) {
      throw std::runtime_error(fmt::format("{}.input_audio must be {{\"data\": \"<base64>\", \"format\": \"wav\"|\"mp3\"}}", where));
    }
    return PartKind::kAudio;
  }
  throw std::runtime_error(fmt::format(
      "{}: unsupported chat content part type '{}' (expected text, image_url, input_audio or audio_url)", where, type));
}

size_t count_occurrences(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + needle.size())) ++n;
  return n;
}

std::string join(const std::vector<std::string>& parts, const char* sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

}  // namespace

std::vector<ChatMessage> flatten_messages(const json& messages, const json& tools, std::vector<MediaPart>& media) {
  if (!messages.is_array() || messages.empty()) {
    throw std::runtime_error("'messages' must be a non-empty array of {\"role\": ..., \"content\": ...}");
  }
  std::vector<ChatMessage> out;
  size_t n_images = 0, n_audios = 0;
  for (size_t mi = 0; mi < messages.size(); ++mi) {
    const json& m = messages[mi];
    const std::string where = fmt::format("messages[{}]", mi);
    if (!m.is_object()) throw std::runtime_error(fmt::format("{} must be an object", where));
    if (!m.contains("role") || !m["role"].is_string()) throw std::runtime_error(fmt::format("{}.role must be a string", where));
    ChatMessage msg;
    msg.role = m["role"].get<std::string>();
    if (msg.role == "developer") msg.role = "system";  // OpenAI's newer name for system
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool") {
      throw std::runtime_error(fmt::format("{}: unknown role '{}' (expected system, developer, user, assistant or tool)",
                                           where, msg.role));
    }
    const json content = m.contains("content") ? m["content"] : json();
    if (content.is_null()) {
      if (msg.role != "assistant") throw std::runtime_error(fmt::format("{}.content is missing", where));
    } else if (content.is_string()) {
      msg.content = checked_text(content, where + ".content");
    } else if (content.is_array()) {
      std::vector<std::string> texts;
      // Missing placeholders, grouped by modality in first-appearance order.
      std::vector<std::string> image_ph, audio_ph;
      std::vector<MediaKind> kind_order;
      for (size_t pi = 0; pi < content.size(); ++pi) {
        const json& part = content[pi];
        const std::string pwhere = fmt::format("{}.content[{}]", where, pi);
        switch (part_kind(part, pwhere)) {
          case PartKind::kText: {
            const json& t = part.contains("text") ? part["text"] : part.value("refusal", json());
            if (t.is_null()) break;  // vLLM skips null text
            texts.push_back(checked_text(t, pwhere + ".text"));
            break;
          }
          case PartKind::kImage:
            if (msg.role != "user") throw std::runtime_error(fmt::format("{}: images are only allowed in user messages", pwhere));
            media.push_back({MediaKind::kImage, n_images, mi, part});
            image_ph.push_back(fmt::format("<|image_{}|>", ++n_images));
            if (image_ph.size() == 1) kind_order.push_back(MediaKind::kImage);
            break;
          case PartKind::kAudio:
            if (msg.role != "user") throw std::runtime_error(fmt::format("{}: audio is only allowed in user messages", pwhere));
            media.push_back({MediaKind::kAudio, n_audios, mi, part});
            audio_ph.push_back(fmt::format("<|audio_{}|>", ++n_audios));
            if (audio_ph.size() == 1) kind_order.push_back(MediaKind::kAudio);
            break;
        }
      }
      const std::string text = join(texts, "\n");
      std::vector<std::string> lines;
      for (MediaKind k : kind_order) {
        for (const std::string& ph : k == MediaKind::kImage ? image_ph : audio_ph) {
          // A placeholder the user already wrote stays where it is (vLLM 2.6.3).
          if (count_occurrences(text, ph) == 0) lines.push_back(ph);
        }
      }
      if (!text.empty() || lines.empty()) lines.push_back(text);
      msg.content = join(lines, "\n");
    } else {
      throw std::runtime_error(fmt::format("{}.content must be a string, an array of parts or null (got {})", where,
                                           content.type_name()));
    }
    if (msg.role == "assistant" && m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      // Native Phi form (spec 5.2): <|tool_call|>[{"name", "arguments"}]<|/tool_call|>.
      const json& calls = m["tool_calls"];
      if (!calls.is_array()) throw std::runtime_error(fmt::format("{}.tool_calls must be an array", where));
      json list = json::array();
      for (size_t ci = 0; ci < calls.size(); ++ci) {
        const json& c = calls[ci];
        const json& fn = c.is_object() && c.contains("function") ? c["function"] : c;
        if (!fn.is_object() || !fn.contains("name")) {
          throw std::runtime_error(fmt::format("{}.tool_calls[{}] must be {{\"function\": {{\"name\", \"arguments\"}}}}", where, ci));
        }
        json args = fn.value("arguments", json::object());
        if (args.is_string()) {
          json parsed = json::parse(args.get<std::string>(), nullptr, false);
          if (!parsed.is_discarded()) args = parsed;
        }
        list.push_back({{"arguments", args}, {"name", fn["name"]}});
      }
      msg.content += "<|tool_call|>";
      std::string s = "[";
      for (size_t i = 0; i < list.size(); ++i) {
        if (i) s += ", ";
        s += "{\"name\": " + python_json_dumps(list[i]["name"]) + ", \"arguments\": " + python_json_dumps(list[i]["arguments"]) + "}";
      }
      msg.content += s + "]<|/tool_call|>";
    }
    if (msg.role == "system" && m.contains("tools") && !m["tools"].is_null()) {
      msg.tools = m["tools"].is_string() ? m["tools"].get<std::string>() : tools_to_string(m["tools"]);
    }
    out.push_back(std::move(msg));
  }
  if (!tools.is_null() && !(tools.is_array() && tools.empty())) {
    const std::string s = tools_to_string(tools);
    auto it = std::find_if(out.begin(), out.end(), [](const ChatMessage& m) { return m.role == "system"; });
    if (it == out.end()) {
      out.insert(out.begin(), ChatMessage{"system", kToolsDefaultSystem, s});
    } else {
      it->tools = s;
    }
  }
  return out;
}

std::string rewrite_placeholders(const std::string& text, size_t n_images, size_t n_audios) {
  std::string out;
  out.reserve(text.size());
  size_t next[2] = {1, 1};
  const size_t total[2] = {n_images, n_audios};
  const char* names[2] = {"image", "audio"};
  const char* tokens[2] = {"<|endoftext10|>", "<|endoftext11|>"};
  size_t i = 0;
  while (i < text.size()) {
    int kind = -1;
    if (text.compare(i, 8, "<|image_") == 0) kind = 0;
    else if (text.compare(i, 8, "<|audio_") == 0) kind = 1;
    size_t j = i + 8, k = 0;
    if (kind >= 0) {
      while (j < text.size() && text[j] >= '0' && text[j] <= '9' && j - (i + 8) < 9) k = k * 10 + static_cast<size_t>(text[j++] - '0');
      if (j == i + 8 || text.compare(j, 2, "|>") != 0) kind = -1;
    }
    if (kind < 0) {
      out.push_back(text[i++]);
      continue;
    }
    const char* name = names[kind];
    if (k > total[kind] || k == 0) {
      throw std::runtime_error(fmt::format(
          "the prompt contains <|{}_{}|> but the request has only {} {} item(s): found more '<|{}_{}|>' placeholders "
          "than actual multimodal data items", name, k, total[kind], name, name, k));
    }
    if (k < next[kind]) {
      throw std::runtime_error(fmt::format("placeholder <|{}_{}|> appears more than once (each {} is referenced once)",
                                           name, k, name));
    }
    if (k > next[kind]) {
      throw std::runtime_error(fmt::format(
          "{} placeholders must be numbered 1..{} in order: found <|{}_{}|> where <|{}_{}|> was expected",
          name, total[kind], name, k, name, next[kind]));
    }
    ++next[kind];
    out += tokens[kind];
    i = j + 2;
  }
  for (int kind = 0; kind < 2; ++kind) {
    if (next[kind] - 1 != total[kind]) {
      throw std::runtime_error(fmt::format("the request has {} {} item(s) but the prompt references only {}",
                                           total[kind], names[kind], next[kind] - 1));
    }
  }
  return out;
}

FlatChat flatten_chat(const json& messages, const json& tools) {
  FlatChat f;
  f.chat = flatten_messages(messages, tools, f.media);
  return f;
}

Prompt build_prompt(const tok::Tokenizer& tokenizer, const json& messages, const MediaTokenCounter& count_tokens,
                    const PromptOptions& options) {
  return build_prompt(tokenizer, flatten_chat(messages, options.tools), count_tokens, options.add_generation_prompt,
                      options.continue_final_message);
}

Prompt build_prompt(const tok::Tokenizer& tokenizer, FlatChat flat, const MediaTokenCounter& count_tokens,
                    bool add_generation_prompt, bool continue_final_message) {
  Prompt p;
  p.media = std::move(flat.media);
  if (continue_final_message && flat.chat.empty())
    throw std::runtime_error("continue_final_message: there is no message to continue");
  p.text = render_chat(flat.chat, add_generation_prompt, continue_final_message);
  size_t n[2] = {0, 0};
  for (const MediaPart& m : p.media) ++n[m.kind == MediaKind::kImage ? 0 : 1];
  const std::string rewritten = rewrite_placeholders(p.text, n[0], n[1]);
  const std::vector<tok::TokenId> ids = tokenizer.encode(rewritten);

  // Expand: the k-th 200010 is the k-th image, the k-th 200011 the k-th audio.
  std::vector<const MediaPart*> by_kind[2];
  for (const MediaPart& m : p.media) by_kind[m.kind == MediaKind::kImage ? 0 : 1].push_back(&m);
  size_t seen[2] = {0, 0};
  for (const tok::TokenId id : ids) {
    const int kind = id == kImageToken ? 0 : id == kAudioToken ? 1 : -1;
    if (kind < 0) {
      p.ids.push_back(id);
      continue;
    }
    if (seen[kind] >= by_kind[kind].size()) {
      throw std::runtime_error(fmt::format(
          "number of {} tokens in the prompt ({}+) does not match the number of {} items ({}); the text must not "
          "contain the literal token {}", kind ? "audio" : "image", seen[kind] + 1, kind ? "audio" : "image",
          by_kind[kind].size(), kind ? "<|endoftext11|>" : "<|endoftext10|>"));
    }
    const MediaPart& item = *by_kind[kind][seen[kind]++];
    const size_t count = count_tokens(item);
    if (count == 0) {
      throw std::runtime_error(fmt::format("{} {} has a token count of 0 (processors must report >= 1)",
                                           media_kind_name(item.kind), item.index + 1));
    }
    p.spans.push_back({item.kind, item.index, p.ids.size(), count});
    p.ids.insert(p.ids.end(), count, id);
  }
  if (n[0] > 0) p.mode = InputMode::kVision;
  if (n[1] > 0) p.mode = n[0] > 0 ? InputMode::kVisionSpeech : InputMode::kSpeech;
  return p;
}

}  // namespace areno::phi4mm
