#include "app/cmd_tokenize.h"

#include <cstdio>
#include <exception>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "models/phi4mm/tokenizer/prompt_builder.h"

namespace areno {

namespace {

constexpr const char* kUsage =
    "usage: areno tokenize --model-path DIR (--text TEXT | --messages FILE.json) [--decode]\n"
    "\n"
    "  --model-path DIR    model directory holding tokenizer.json\n"
    "  --text TEXT         tokenize TEXT as is (added tokens such as <|user|> are recognised)\n"
    "  --messages FILE     an OpenAI messages array, or an object {\"messages\": [...],\n"
    "                      \"tools\"?: [...], \"add_generation_prompt\"?: bool,\n"
    "                      \"media_token_counts\"?: {\"image\": [N...], \"audio\": [N...]}};\n"
    "                      renders the Phi-4 chat template and builds the prompt ids.\n"
    "                      Without media_token_counts every image/audio counts 1 id.\n"
    "  --decode            also print the decoded text and the text of each id\n"
    "\n"
    "Prints one JSON object: {\"ids\", \"count\", \"prompt\"?, \"media\"?, \"mode\"?, \"decoded\"?, \"tokens\"?}.\n";

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "areno tokenize: %s\n\n%s", msg.c_str(), kUsage);
  return 2;
}

}  // namespace

int cmd_tokenize(int argc, char** argv) {
  std::string model_path, text, messages_file;
  bool have_text = false, decode = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "--model-path") {
      const char* v = value();
      if (!v) return usage_error("--model-path needs a directory");
      model_path = v;
    } else if (a == "--text") {
      const char* v = value();
      if (!v) return usage_error("--text needs a value");
      text = v;
      have_text = true;
    } else if (a == "--messages") {
      const char* v = value();
      if (!v) return usage_error("--messages needs a file");
      messages_file = v;
    } else if (a == "--decode") {
      decode = true;
    } else {
      return usage_error("unknown argument '" + a + "'");
    }
  }
  if (model_path.empty()) return usage_error("--model-path is required");
  if (have_text == !messages_file.empty()) return usage_error("give exactly one of --text or --messages");

  try {
    const tok::Tokenizer tokenizer = phi4mm::load_tokenizer(model_path);
    nlohmann::ordered_json out;
    std::vector<tok::TokenId> ids;
    if (have_text) {
      ids = tokenizer.encode(text);
    } else {
      std::ifstream in(messages_file);
      if (!in) throw std::runtime_error("cannot open messages file '" + messages_file + "'");
      nlohmann::json doc;
      try {
        doc = nlohmann::json::parse(in);
      } catch (const nlohmann::json::parse_error& e) {
        throw std::runtime_error("messages file '" + messages_file + "' is not valid JSON: " + e.what());
      }
      nlohmann::json messages = doc;
      phi4mm::PromptOptions opt;
      nlohmann::json counts = nlohmann::json::object();
      if (doc.is_object()) {
        messages = doc.value("messages", nlohmann::json());
        opt.tools = doc.value("tools", nlohmann::json());
        opt.add_generation_prompt = doc.value("add_generation_prompt", true);
        counts = doc.value("media_token_counts", nlohmann::json::object());
      }
      const auto counter = [&](const phi4mm::MediaPart& m) -> size_t {
        const char* kind = phi4mm::media_kind_name(m.kind);
        if (counts.contains(kind) && counts[kind].is_array() && m.index < counts[kind].size()) {
          return counts[kind][m.index].get<size_t>();
        }
        return 1;
      };
      const phi4mm::Prompt p = phi4mm::build_prompt(tokenizer, messages, counter, opt);
      ids = p.ids;
      out["prompt"] = p.text;
      out["mode"] = phi4mm::input_mode_name(p.mode);
      nlohmann::ordered_json media = nlohmann::ordered_json::array();
      for (const auto& s : p.spans) {
        media.push_back({{"kind", phi4mm::media_kind_name(s.kind)}, {"index", s.index}, {"start", s.start},
                         {"length", s.length}});
      }
      out["media"] = media;
    }
    out["count"] = ids.size();
    out["ids"] = ids;
    if (decode) {
      out["decoded"] = tokenizer.decode(ids);
      nlohmann::ordered_json pieces = nlohmann::ordered_json::array();
      for (const tok::TokenId id : ids) pieces.push_back(tokenizer.decode(std::span<const tok::TokenId>(&id, 1)));
      out["tokens"] = pieces;
    }
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "areno tokenize: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

int app::cmd_tokenize(const std::vector<std::string>& args) {
  std::vector<std::string> copy = args;
  std::string name = "tokenize";
  std::vector<char*> argv = {name.data()};
  for (auto& a : copy) argv.push_back(a.data());
  return areno::cmd_tokenize(static_cast<int>(argv.size()), argv.data());
}

}  // namespace areno
