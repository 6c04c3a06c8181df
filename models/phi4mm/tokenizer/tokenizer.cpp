#include "models/phi4mm/tokenizer/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/byte_level.h"
#include "models/phi4mm/tokenizer/utf8.h"

namespace areno::tok {

namespace {

// GPT-2's pattern, used when the pre-tokenizer is ByteLevel(use_regex=true).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Decodes the code point at text[i] (text is valid UTF-8); sets len.
char32_t decode_cp(std::string_view text, size_t i, size_t& len) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(text[i + k]); };
  const unsigned char b0 = b(0);
  if (b0 < 0x80) { len = 1; return b0; }
  if (b0 < 0xE0) { len = 2; return ((b0 & 0x1F) << 6) | (b(1) & 0x3F); }
  if (b0 < 0xF0) { len = 3; return ((b0 & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F); }
  len = 4;
  return ((b0 & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

// Start of the code point that ends at text[end - 1].
size_t prev_cp_start(std::string_view text, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) --i;
  return i;
}

bool is_word_char(char32_t cp) {
  return cp == '_' || (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') ||
         cp >= 0x80;  // [A] non-ASCII counted as word characters for single_word
}

void append_json_string(std::string& out, std::string_view s) {
  out.push_back('"');
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned char>(c));
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

std::string read_file(const std::filesystem::path& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("cannot open {} '{}'", what, path.string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    const int v = base64_value(c);
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return true;
}

template <class T>
T json_get(const nlohmann::json& obj, const char* key, T fallback, std::string_view where) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception&) {
    throw std::runtime_error(fmt::format("{}: field '{}' has the wrong type (got {})", where, key,
                                         it->type_name()));
  }
}

// tokenizer.json, read by SAX: model.vocab and model.merges (nearly all of the
// file, 200k entries each for o200k) go straight into vectors and the rest
// becomes a DOM. A DOM of the whole file cost about 0.9 s and 290 MB on the
// 2-core machine (a std::map node per vocab key, freed again right after).
// Iterative like nlohmann's parser: nothing recurses on the file's nesting.
struct HfFile {
  nlohmann::json rest;                           // everything but the two tables
  bool have_vocab = false, have_merges = false;  // model.vocab an object, model.merges an array
  std::vector<std::pair<std::string, nlohmann::json>> vocab;  // in file order
  std::vector<nlohmann::json> merges;
};

class HfReader final : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit HfReader(HfFile& out) : out_(out) {}

  bool null() override { return put(nullptr); }
  bool boolean(bool v) override { return put(v); }
  bool number_integer(number_integer_t v) override { return put(v); }
  bool number_unsigned(number_unsigned_t v) override { return put(v); }
  bool number_float(number_float_t v, const string_t&) override { return put(v); }
  bool string(string_t& v) override { return put(std::move(v)); }
  bool binary(binary_t& v) override { return put(nlohmann::json::binary(std::move(v))); }
  bool key(string_t& k) override {
    stack_.back().key = std::move(k);
    return true;
  }
  bool start_object(std::size_t) override { return open(nlohmann::json::object()); }
  bool start_array(std::size_t) override { return open(nlohmann::json::array()); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) override {
    throw std::runtime_error(e.what());
  }

 private:
  enum class Table { none, vocab, merges };
  struct Frame {
    nlohmann::json value;
    std::string key;  // an object's current key
    Table table = Table::none;
  };

  bool put(nlohmann::json&& v) {
    if (stack_.empty()) {
      out_.rest = std::move(v);
      return true;
    }
    Frame& f = stack_.back();
    if (f.table == Table::vocab) {
      out_.vocab.emplace_back(std::move(f.key), std::move(v));
    } else if (f.table == Table::merges) {
      out_.merges.push_back(std::move(v));
    } else if (f.value.is_object()) {
      f.value[f.key] = std::move(v);  // a repeated key keeps its last value, as in nlohmann's DOM
    } else {
      f.value.push_back(std::move(v));
    }
    return true;
  }
  bool open(nlohmann::json&& v) {
    // root["model"]["vocab"] (an object) or root["model"]["merges"] (an
    // array); a repeated key's last table wins, as in a DOM.
    Table t = Table::none;
    if (stack_.size() == 1 && stack_[0].value.is_object() && stack_[0].key == "model") {
      out_ = HfFile{};  // a repeated "model" replaces the tables too
    } else if (stack_.size() == 2 && stack_[0].value.is_object() && stack_[0].key == "model" && stack_[1].value.is_object()) {
      if (stack_[1].key == "vocab" && v.is_object()) {
        t = Table::vocab;
        out_.vocab.clear();
        out_.have_vocab = true;
      } else if (stack_[1].key == "merges" && v.is_array()) {
        t = Table::merges;
        out_.merges.clear();
        out_.have_merges = true;
      }
    }
    stack_.push_back({std::move(v), {}, t});
    return true;
  }
  bool close() {
    nlohmann::json v = std::move(stack_.back().value);  // an empty container for a table
    stack_.pop_back();
    return put(std::move(v));
  }

  HfFile& out_;
  std::vector<Frame> stack_;
};

}  // namespace

bool is_unicode_whitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Per-piece BPE results. Pieces that are whole tokens never get here.
struct Tokenizer::Cache {
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return hash_bytes(s); }
  };
  static constexpr size_t kMaxEntries = 1 << 18;
  std::mutex mu;
  std::unordered_map<std::string, std::vector<TokenId>, Hash, std::equal_to<>> map;
};

Tokenizer::Tokenizer() : cache_(std::make_unique<Cache>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

void Tokenizer::clear_cache() const {
  std::lock_guard lock(cache_->mu);
  cache_->map.clear();
}

size_t Tokenizer::vocab_size() const {
  TokenId m = bpe_.max_id();
  for (const auto& a : added_) m = std::max(m, a.id);
  return static_cast<size_t>(m) + 1;
}

void Tokenizer::init_added() {
  TokenId max_id = bpe_.max_id();
  for (const auto& a : added_) {
    if (a.id < 0) throw std::runtime_error(fmt::format("added token '{}' has negative id {}", a.content, a.id));
    if (a.content.empty()) throw std::runtime_error(fmt::format("added token id {} has empty content", a.id));
    require_valid_utf8(a.content, fmt::format("added token id {}", a.id));
    max_id = std::max(max_id, a.id);
  }
  added_index_.assign(static_cast<size_t>(max_id) + 1, -1);
  std::fill(std::begin(first_byte_), std::end(first_byte_), false);
  for (size_t k = 0; k < added_.size(); ++k) {
    if (added_index_[added_[k].id] >= 0) {
      throw std::runtime_error(fmt::format("added token id {} is defined twice", added_[k].id));
    }
    added_index_[added_[k].id] = static_cast<int32_t>(k);
    first_byte_[static_cast<unsigned char>(added_[k].content[0])] = true;
  }
  // Longest first, so the first match at a position is the longest.
  std::stable_sort(added_.begin(), added_.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  for (size_t k = 0; k < added_.size(); ++k) added_index_[added_[k].id] = static_cast<int32_t>(k);
}

const AddedToken* Tokenizer::added_token(TokenId id) const {
  if (id < 0 || static_cast<size_t>(id) >= added_index_.size() || added_index_[id] < 0) return nullptr;
  return &added_[added_index_[id]];
}

std::optional<TokenId> Tokenizer::token_to_id(std::string_view token) const {
  for (const auto& a : added_) {
    if (a.content == token) return a.id;
  }
  const TokenId id = bpe_.token_id(token);
  if (id >= 0) return id;
  return std::nullopt;
}

// ---- loading -----------------------------------------------------------------

Tokenizer Tokenizer::from_tiktoken_file(const std::filesystem::path& path, std::string pattern,
                                        std::vector<AddedToken> added) {
  const std::string data = read_file(path, "tiktoken rank file");
  return from_tiktoken_data(data, path.string(), std::move(pattern), std::move(added));
}

Tokenizer Tokenizer::from_tiktoken_data(std::string_view data, std::string_view source, std::string pattern,
                                        std::vector<AddedToken> added) {
  const std::string where = fmt::format("tiktoken rank file '{}'", source);
  Tokenizer t;
  size_t line_no = 0, pos = 0;
  std::string bytes;
  while (pos < data.size()) {
    size_t eol = data.find('\n', pos);
    if (eol == std::string::npos) eol = data.size();
    std::string_view line(data.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos || !base64_decode(line.substr(0, sp), bytes)) {
      throw std::runtime_error(fmt::format("{} line {}: expected '<base64 token> <rank>'", where, line_no));
    }
    TokenId rank = 0;
    const std::string_view num = line.substr(sp + 1);
    if (num.empty()) throw std::runtime_error(fmt::format("{} line {}: missing rank", where, line_no));
    for (char c : num) {
      if (c < '0' || c > '9') throw std::runtime_error(fmt::format("{} line {}: rank '{}' is not a number", where, line_no, num));
      rank = rank * 10 + (c - '0');
    }
    try {
      t.bpe_.add_token(rank, bytes);
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(fmt::format("{} line {}: {}", where, line_no, e.what()));
    }
  }
  t.bpe_.finalize(where);
  t.bpe_.derive_merges_from_ranks();
  t.regex_ = std::make_unique<SplitRegex>(std::move(pattern));
  t.ignore_merges_ = true;  // tiktoken emits a piece that is a token as is
  t.added_ = std::move(added);
  t.init_added();
  return t;
}

Tokenizer Tokenizer::from_hf_file(const std::filesystem::path& path) {
  return from_hf_text(read_file(path, "tokenizer file"), path.string());
}

Tokenizer Tokenizer::from_hf_text(std::string_view text, std::string_view source) {
  HfFile f;
  HfReader reader(f);
  try {
    nlohmann::json::sax_parse(text, &reader);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("'{}' is not valid JSON: {}", source, e.what()));
  }
  const nlohmann::json& j = f.rest;
  const std::string where = fmt::format("tokenizer.json '{}'", source);
  if (!j.is_object()) throw std::runtime_error(fmt::format("{}: top level must be an object", where));
  Tokenizer t;

  // normalizer: only null is supported (the o200k family has none).
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    throw std::runtime_error(fmt::format("{}: normalizer '{}' is not supported (expected null)", where,
                                         j["normalizer"].value("type", "?")));
  }

  // pre_tokenizer -> split pattern.
  std::string pattern;
  const auto pre = j.find("pre_tokenizer");
  if (pre == j.end() || pre->is_null()) {
    throw std::runtime_error(fmt::format("{}: pre_tokenizer is missing (expected Split + ByteLevel)", where));
  }
  std::vector<nlohmann::json> steps;
  if (pre->value("type", "") == "Sequence") {
    for (const auto& s : pre->at("pretokenizers")) steps.push_back(s);
  } else {
    steps.push_back(*pre);
  }
  bool have_byte_level = false;
  for (const auto& s : steps) {
    const std::string type = s.value("type", "");
    if (type == "Split") {
      const auto& p = s.at("pattern");
      if (!p.contains("Regex")) {
        throw std::runtime_error(fmt::format("{}: Split pattern must be {{\"Regex\": ...}}", where));
      }
      if (s.value("invert", false)) throw std::runtime_error(fmt::format("{}: Split invert=true is not supported", where));
      const std::string behavior = s.value("behavior", "Isolated");
      if (behavior != "Isolated" && behavior != "Removed") {
        throw std::runtime_error(fmt::format("{}: Split behavior '{}' is not supported (expected Isolated)", where, behavior));
      }
      if (!pattern.empty()) throw std::runtime_error(fmt::format("{}: more than one Split pre-tokenizer", where));
      pattern = p["Regex"].get<std::string>();
    } else if (type == "ByteLevel") {
      if (s.value("add_prefix_space", false)) {
        throw std::runtime_error(fmt::format("{}: ByteLevel add_prefix_space=true is not supported", where));
      }
      if (s.value("use_regex", true)) {
        if (!pattern.empty()) throw std::runtime_error(fmt::format("{}: ByteLevel use_regex=true after a Split", where));
        pattern = kGpt2Pattern;
      }
      have_byte_level = true;
    } else {
      throw std::runtime_error(fmt::format("{}: pre-tokenizer '{}' is not supported (expected Split, ByteLevel)", where, type));
    }
  }
  if (!have_byte_level || pattern.empty()) {
    throw std::runtime_error(fmt::format("{}: pre_tokenizer must contain ByteLevel and a split regex", where));
  }

  // model
  const auto mit = j.find("model");
  if (mit == j.end() || !mit->is_object()) throw std::runtime_error(fmt::format("{}: 'model' is missing", where));
  const auto& model = *mit;
  const std::string mwhere = where + " model";
  if (model.value("type", "BPE") != "BPE") {
    throw std::runtime_error(fmt::format("{}: type '{}' is not supported (expected BPE)", mwhere, model.value("type", "")));
  }
  if (json_get<bool>(model, "byte_fallback", false, mwhere)) {
    throw std::runtime_error(fmt::format("{}: byte_fallback=true is not supported", mwhere));
  }
  if (!json_get<std::string>(model, "continuing_subword_prefix", "", mwhere).empty() ||
      !json_get<std::string>(model, "end_of_word_suffix", "", mwhere).empty()) {
    throw std::runtime_error(fmt::format("{}: continuing_subword_prefix / end_of_word_suffix are not supported", mwhere));
  }
  if (json_get<double>(model, "dropout", 0.0, mwhere) > 0.0) {
    throw std::runtime_error(fmt::format("{}: BPE dropout is not supported for inference", mwhere));
  }
  t.ignore_merges_ = json_get<bool>(model, "ignore_merges", false, mwhere);

  // added tokens
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    size_t k = 0;
    for (const auto& a : j["added_tokens"]) {
      const std::string awhere = fmt::format("{} added_tokens[{}]", where, k++);
      AddedToken tok;
      tok.id = json_get<TokenId>(a, "id", -1, awhere);
      tok.content = json_get<std::string>(a, "content", "", awhere);
      tok.special = json_get<bool>(a, "special", false, awhere);
      tok.lstrip = json_get<bool>(a, "lstrip", false, awhere);
      tok.rstrip = json_get<bool>(a, "rstrip", false, awhere);
      tok.normalized = json_get<bool>(a, "normalized", false, awhere);
      tok.single_word = json_get<bool>(a, "single_word", false, awhere);
      if (tok.id < 0) throw std::runtime_error(fmt::format("{}: 'id' is missing", awhere));
      t.added_.push_back(std::move(tok));
    }
  }
  std::unordered_map<TokenId, const std::string*> added_by_id;
  for (const auto& a : t.added_) added_by_id[a.id] = &a.content;

  // vocab (byte-level keys). The merges name tokens by these keys.
  if (!f.have_vocab) throw std::runtime_error(fmt::format("{}: 'vocab' must be an object", mwhere));
  ByteStringMap id_of;
  id_of.reserve(f.vocab.size());
  for (const auto& [key, value] : f.vocab) {
    if (!value.is_number_integer()) {
      throw std::runtime_error(fmt::format("{}: vocab entry \"{}\" must map to an integer id", mwhere, key));
    }
    const TokenId id = value.get<TokenId>();
    if (id < 0) throw std::runtime_error(fmt::format("{}: vocab entry \"{}\" has the negative id {}", mwhere, key, id));
    if (!id_of.insert(key, id)) {
      throw std::runtime_error(fmt::format("{}: vocab entry \"{}\" appears twice", mwhere, key));
    }
    const auto a = added_by_id.find(id);
    if (a != added_by_id.end()) continue;  // added tokens are matched as text, not BPE
    const std::string bytes = byte_level_to_bytes(key, mwhere + " vocab");
    try {
      t.bpe_.add_token(id, bytes);
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(fmt::format("{}: vocab entry \"{}\": {}", mwhere, key, e.what()));
    }
  }
  t.bpe_.finalize(mwhere);

  // merges: ["a b", ...] (tokenizers < 0.20) or [["a", "b"], ...]
  if (!f.have_merges) throw std::runtime_error(fmt::format("{}: 'merges' must be an array", mwhere));
  const auto vocab_id = [&](std::string_view s, size_t rank) {
    const TokenId id = id_of.find(s);
    if (id < 0) throw std::runtime_error(fmt::format("{}: merges[{}] uses \"{}\", which is not in the vocab", mwhere, rank, s));
    return id;
  };
  t.file_merges_.reserve(f.merges.size());
  std::string joined;
  for (size_t rank = 0; rank < f.merges.size(); ++rank) {
    const nlohmann::json& m = f.merges[rank];
    std::string_view a, b;
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        throw std::runtime_error(fmt::format("{}: merges[{}] \"{}\" must be two tokens separated by one space", mwhere, rank, s));
      }
      a = std::string_view(s).substr(0, sp);
      b = std::string_view(s).substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get_ref<const std::string&>();
      b = m[1].get_ref<const std::string&>();
    } else {
      throw std::runtime_error(fmt::format("{}: merges[{}] must be \"a b\" or [\"a\", \"b\"]", mwhere, rank));
    }
    joined.assign(a).append(b);
    const TokenId l = vocab_id(a, rank), r = vocab_id(b, rank), merged = vocab_id(joined, rank);
    t.bpe_.add_merge(l, r, merged, static_cast<uint32_t>(rank));
    t.file_merges_.emplace_back(l, r);
  }

  t.regex_ = std::make_unique<SplitRegex>(std::move(pattern));
  t.init_added();
  return t;
}

// ---- encoding ----------------------------------------------------------------

std::vector<Segment> Tokenizer::split_added_tokens(std::string_view text) const {
  std::vector<Segment> segs;
  size_t plain_start = 0;  // start of the current plain run
  size_t i = 0;
  while (i < text.size()) {
    if (!first_byte_[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    const AddedToken* hit = nullptr;
    for (const auto& a : added_) {  // longest first
      if (text.compare(i, a.content.size(), a.content) != 0) continue;
      if (a.single_word) {
        size_t len;
        const bool before_ok = i == 0 || !is_word_char(decode_cp(text, prev_cp_start(text, i), len));
        const size_t e = i + a.content.size();
        const bool after_ok = e >= text.size() || !is_word_char(decode_cp(text, e, len));
        if (!before_ok || !after_ok) continue;
      }
      hit = &a;
      break;
    }
    if (!hit) {
      ++i;
      continue;
    }
    size_t begin = i, end = i + hit->content.size();
    if (hit->lstrip) {
      while (begin > plain_start) {
        const size_t p = prev_cp_start(text, begin);
        size_t len;
        if (!is_unicode_whitespace(decode_cp(text, p, len))) break;
        begin = p;
      }
    }
    if (hit->rstrip) {
      while (end < text.size()) {
        size_t len;
        if (!is_unicode_whitespace(decode_cp(text, end, len))) break;
        end += len;
      }
    }
    if (begin > plain_start) segs.push_back({plain_start, begin, -1});
    segs.push_back({begin, end, hit->id});
    plain_start = i = end;
  }
  if (plain_start < text.size()) segs.push_back({plain_start, text.size(), -1});
  return segs;
}

void Tokenizer::encode_segment(std::string_view text, std::vector<TokenId>& out) const {
  regex_->split(text, [&](std::string_view piece) {
    if (piece.size() == 1 || ignore_merges_) {
      const TokenId whole = bpe_.token_id(piece);
      if (whole >= 0) {
        out.push_back(whole);
        return;
      }
    }
    {
      std::lock_guard lock(cache_->mu);
      const auto it = cache_->map.find(piece);
      if (it != cache_->map.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const size_t before = out.size();
    bpe_.encode_piece(piece, false, out);
    std::vector<TokenId> ids(out.begin() + static_cast<std::ptrdiff_t>(before), out.end());
    std::lock_guard lock(cache_->mu);
    if (cache_->map.size() >= Cache::kMaxEntries) cache_->map.clear();
    cache_->map.emplace(std::string(piece), std::move(ids));
  });
}

void Tokenizer::encode_ordinary_into(std::string_view text, std::vector<TokenId>& out) const {
  require_valid_utf8(text, "text to tokenize");
  encode_segment(text, out);
}

std::vector<TokenId> Tokenizer::encode_ordinary(std::string_view text) const {
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  encode_ordinary_into(text, out);
  return out;
}

std::vector<TokenId> Tokenizer::encode(std::string_view text) const {
  require_valid_utf8(text, "text to tokenize");
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  for (const Segment& s : split_added_tokens(text)) {
    if (s.token >= 0) {
      out.push_back(s.token);
    } else {
      encode_segment(text.substr(s.begin, s.end - s.begin), out);
    }
  }
  return out;
}

// ---- decoding ----------------------------------------------------------------

std::string Tokenizer::decode_bytes(std::span<const TokenId> ids, bool skip_special_tokens) const {
  std::string out;
  const size_t padded = padded_vocab_size();
  for (const TokenId id : ids) {
    if (const AddedToken* a = added_token(id)) {
      if (!(skip_special_tokens && a->special)) out += a->content;
      continue;
    }
    if (bpe_.has_token(id)) {
      out += bpe_.token_bytes(id);
      continue;
    }
    if (id < 0 || static_cast<size_t>(id) >= padded) {
      throw std::runtime_error(fmt::format("cannot decode token id {}: ids must be in [0, {})", id, padded));
    }
    // A reserved or padding id: no text.
  }
  return out;
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special_tokens) const {
  return replace_invalid_utf8(decode_bytes(ids, skip_special_tokens));
}

std::string IncrementalDecoder::push(TokenId id) {
  pending_ += tok_->decode_bytes(std::span<const TokenId>(&id, 1), skip_special_);
  const size_t n = utf8_complete_prefix(pending_);
  if (n == 0) return {};
  std::string out = replace_invalid_utf8(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string IncrementalDecoder::push(std::span<const TokenId> ids) {
  std::string out;
  for (const TokenId id : ids) out += push(id);
  return out;
}

std::string IncrementalDecoder::flush() {
  std::string out = replace_invalid_utf8(pending_);
  pending_.clear();
  return out;
}

// ---- tokenizer.json ----------------------------------------------------------

std::vector<std::pair<TokenId, TokenId>> Tokenizer::merge_list() const {
  if (!file_merges_.empty()) return file_merges_;
  // tiktoken -> HF conversion: the merge of token T is the two parts that BPE
  // with ranks below rank(T) leaves of T's bytes.
  std::vector<std::pair<TokenId, TokenId>> merges;
  const PairMap& pairs = bpe_.pairs();
  std::vector<TokenId> parts;
  for (TokenId id = 0; id <= bpe_.max_id(); ++id) {
    const std::string_view bytes = bpe_.token_bytes(id);
    if (bytes.size() < 2) continue;
    parts.clear();
    for (unsigned char b : bytes) parts.push_back(bpe_.token_id(std::string_view(reinterpret_cast<const char*>(&b), 1)));
    for (;;) {
      uint32_t best = UINT32_MAX;
      size_t at = 0;
      TokenId merged = -1;
      for (size_t i = 0; i + 1 < parts.size(); ++i) {
        const PairMap::Merge* m = pairs.find(parts[i], parts[i + 1]);
        if (m && m->rank < static_cast<uint32_t>(id) && m->rank < best) {
          best = m->rank;
          at = i;
          merged = m->merged;
        }
      }
      if (merged < 0) break;
      parts[at] = merged;
      parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    if (parts.size() != 2) {
      throw std::runtime_error(fmt::format(
          "cannot write merges: token id {} is not reachable by one merge of lower-ranked tokens "
          "(BPE on its bytes leaves {} parts)", id, parts.size()));
    }
    merges.emplace_back(parts[0], parts[1]);
  }
  return merges;
}

std::string Tokenizer::to_hf_json(bool merges_as_strings) const {
  std::string out;
  out.reserve(16 << 20);
  out += "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": [";
  std::vector<AddedToken> added = added_;
  std::sort(added.begin(), added.end(), [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
  for (size_t k = 0; k < added.size(); ++k) {
    const auto& a = added[k];
    out += k ? ",\n    {" : "\n    {";
    out += fmt::format("\"id\": {}, \"content\": ", a.id);
    append_json_string(out, a.content);
    out += fmt::format(", \"single_word\": {}, \"lstrip\": {}, \"rstrip\": {}, \"normalized\": {}, \"special\": {}}}",
                       a.single_word, a.lstrip, a.rstrip, a.normalized, a.special);
  }
  out += "\n  ],\n  \"normalizer\": null,\n  \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [";
  out += "{\"type\": \"Split\", \"pattern\": {\"Regex\": ";
  append_json_string(out, pattern());
  out += "}, \"behavior\": \"Isolated\", \"invert\": false}, ";
  out += "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": false}]},\n";
  out += "  \"post_processor\": null,\n";
  out += "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, \"use_regex\": true},\n";
  out += "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, \"continuing_subword_prefix\": null, "
         "\"end_of_word_suffix\": null, \"fuse_unk\": false, \"byte_fallback\": false, ";
  out += fmt::format("\"ignore_merges\": {},\n    \"vocab\": {{", ignore_merges_);
  bool first = true;
  std::vector<std::string> level(static_cast<size_t>(bpe_.max_id()) + 1);
  for (TokenId id = 0; id <= bpe_.max_id(); ++id) {
    if (!bpe_.has_token(id)) continue;
    level[id] = bytes_to_byte_level(bpe_.token_bytes(id));
    out += first ? "\n      " : ",\n      ";
    first = false;
    append_json_string(out, level[id]);
    out += fmt::format(": {}", id);
  }
  // Added tokens are also vocab entries so that `tokenizers` keeps their ids
  // (it re-numbers added tokens that the model vocab does not know).
  for (const auto& a : added) {
    if (bpe_.has_token(a.id)) continue;
    out += first ? "\n      " : ",\n      ";
    first = false;
    append_json_string(out, a.content);
    out += fmt::format(": {}", a.id);
  }
  out += "\n    },\n    \"merges\": [";
  first = true;
  for (const auto& [l, r] : merge_list()) {
    out += first ? "\n      " : ",\n      ";
    first = false;
    if (merges_as_strings) {
      append_json_string(out, level[l] + " " + level[r]);
    } else {
      out += '[';
      append_json_string(out, level[l]);
      out += ", ";
      append_json_string(out, level[r]);
      out += ']';
    }
  }
  out += "\n    ]\n  }\n}\n";
  return out;
}

}  // namespace areno::tok
