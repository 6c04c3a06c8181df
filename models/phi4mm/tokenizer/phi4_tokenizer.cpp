#include "models/phi4mm/tokenizer/phi4_tokenizer.h"

#include <fstream>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "nn/io/atomic_file.h"

namespace areno::phi4mm {

namespace fs = std::filesystem;

const char* const kChatTemplateJinja =
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}";

std::vector<tok::AddedToken> added_tokens() {
  // id, content, special, rstrip. All have lstrip = normalized = single_word =
  // false. Flags of 200026..200028 are [A] in the spec (same as 200025).
  struct Row {
    TokenId id;
    const char* content;
    bool special, rstrip;
  };
  static constexpr Row kRows[] = {
      {kEndOfText, "<|endoftext|>", true, false},
      {kImageToken, "<|endoftext10|>", true, false},
      {kAudioToken, "<|endoftext11|>", true, false},
      {kEndOfPrompt, "<|endofprompt|>", true, false},
      {kAssistant, "<|assistant|>", true, true},
      {kEnd, "<|end|>", true, true},
      {kUser, "<|user|>", true, true},
      {kSystem, "<|system|>", true, true},
      {kTool, "<|tool|>", false, true},
      {kToolEnd, "<|/tool|>", false, true},
      {kToolCall, "<|tool_call|>", false, true},
      {kToolCallEnd, "<|/tool_call|>", false, true},
      {kToolResponse, "<|tool_response|>", false, true},
      {kTag, "<|tag|>", false, true},
  };
  std::vector<tok::AddedToken> out;
  for (const Row& r : kRows) {
    tok::AddedToken a;
    a.id = r.id;
    a.content = r.content;
    a.special = r.special;
    a.rstrip = r.rstrip;
    out.push_back(std::move(a));
  }
  return out;
}

bool is_unused_id(TokenId id) {
  if (id < 0) return true;
  if (id >= kFirstPaddingId) return true;
  if (id == 199998) return true;
  return id >= 200000 && id <= 200017 && id != kImageToken && id != kAudioToken;
}

std::shared_ptr<const tok::Tokenizer> padded_tokenizer(tok::Tokenizer t, int64_t vocab_size) {
  t.set_padded_vocab_size(size_t(vocab_size));
  return std::make_shared<const tok::Tokenizer>(std::move(t));
}

tok::Tokenizer make_tokenizer() {
  tok::Tokenizer t = tok::Tokenizer::from_tiktoken_data(embedded_o200k_ranks(), "embedded o200k_base.tiktoken",
                                                        tok::kO200kPattern, added_tokens());
  t.set_padded_vocab_size(kVocabSize);
  return t;
}

tok::Tokenizer make_tokenizer(const fs::path& rank_file) {
  if (!fs::exists(rank_file)) {
    throw std::runtime_error(fmt::format(
        "o200k_base rank file '{}' not found (it ships in the repository as {}; run from the repository "
        "root or pass its path)", rank_file.string(), kO200kRankFile));
  }
  tok::Tokenizer t = tok::Tokenizer::from_tiktoken_file(rank_file, tok::kO200kPattern, added_tokens());
  t.set_padded_vocab_size(kVocabSize);
  return t;
}

tok::Tokenizer load_tokenizer(const fs::path& model_dir) {
  if (!fs::is_directory(model_dir)) {
    throw std::runtime_error(fmt::format("model directory '{}' does not exist", model_dir.string()));
  }
  const fs::path file = model_dir / "tokenizer.json";
  if (!fs::exists(file)) {
    throw std::runtime_error(fmt::format(
        "model directory '{}' has no tokenizer.json (expected the Hugging Face tokenizer file; "
        "`areno init` writes one)", model_dir.string()));
  }
  tok::Tokenizer t = tok::Tokenizer::from_hf_file(file);
  t.set_padded_vocab_size(kVocabSize);
  const fs::path config = model_dir / "config.json";
  if (fs::exists(config)) {
    std::ifstream in(config);
    const nlohmann::json c = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (c.is_object() && c.contains("vocab_size") && c["vocab_size"].is_number_unsigned()) {
      t.set_padded_vocab_size(c["vocab_size"].get<size_t>());
    }
  }
  return t;
}

namespace {

nlohmann::ordered_json token_object(const std::string& content) {
  return {{"content", content}, {"lstrip", false}, {"normalized", false}, {"rstrip", false}, {"single_word", false}};
}

}  // namespace

void write_tokenizer_files(const tok::Tokenizer& tokenizer, const fs::path& model_dir) {
  fs::create_directories(model_dir);
  // The four files are written, then put in place together (nn/io/atomic_file.h).
  FileSet files;
  files.add((model_dir / "tokenizer.json").string()).write(tokenizer.to_hf_json());

  std::vector<tok::AddedToken> added = tokenizer.added_tokens();
  std::sort(added.begin(), added.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  nlohmann::ordered_json decoder = nlohmann::ordered_json::object();
  nlohmann::ordered_json added_json = nlohmann::ordered_json::object();
  for (const auto& a : added) {
    decoder[std::to_string(a.id)] = {{"content", a.content}, {"lstrip", a.lstrip}, {"normalized", a.normalized},
                                     {"rstrip", a.rstrip}, {"single_word", a.single_word}, {"special", a.special}};
    added_json[a.content] = a.id;
  }
  const std::string eos = "<|endoftext|>";
  nlohmann::ordered_json config = {
      {"add_bos_token", false},
      {"add_eos_token", false},
      {"add_prefix_space", false},
      {"added_tokens_decoder", decoder},
      {"bos_token", eos},
      {"chat_template", kChatTemplateJinja},
      {"clean_up_tokenization_spaces", false},
      {"eos_token", eos},
      {"model_max_length", kModelMaxLength},
      {"pad_token", eos},
      {"tokenizer_class", "GPT2Tokenizer"},
      {"unk_token", eos},
  };
  files.add((model_dir / "tokenizer_config.json").string()).write(config.dump(2) + "\n");
  nlohmann::ordered_json special = {
      {"bos_token", token_object(eos)},
      {"eos_token", token_object(eos)},
      {"pad_token", eos},
      {"unk_token", token_object(eos)},
  };
  files.add((model_dir / "special_tokens_map.json").string()).write(special.dump(2) + "\n");
  files.add((model_dir / "added_tokens.json").string()).write(added_json.dump(2) + "\n");
  files.commit();
}

}  // namespace areno::phi4mm
