// Byte-level BPE tokenizer with added tokens (spec tokens-api.md section 1).
//
// Encode pipeline: added-token extraction on the raw text (leftmost-longest,
// with lstrip/rstrip whitespace swallowing) -> split regex per plain segment
// -> BPE per piece (cached). No normalizer, no BOS/EOS.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "models/phi4mm/tokenizer/bpe.h"
#include "models/phi4mm/tokenizer/split_regex.h"

namespace areno::tok {

// One entry of tokenizer.json `added_tokens` (HF AddedToken flags).
struct AddedToken {
  TokenId id = -1;
  std::string content;  // literal text, matched in the raw input
  bool special = false;  // dropped by decode(skip_special_tokens = true)
  bool lstrip = false;   // swallow whitespace before the token
  bool rstrip = false;   // swallow whitespace after the token
  bool normalized = false;
  bool single_word = false;
};

// A piece of the input after added-token extraction: either an added token
// (token >= 0; [begin, end) includes swallowed whitespace) or plain text.
struct Segment {
  size_t begin = 0;
  size_t end = 0;
  TokenId token = -1;
};

class Tokenizer {
 public:
  // Loads a Hugging Face tokenizer.json (byte-level BPE only); from_hf_text
  // takes the file's contents, `source` naming it in error messages.
  static Tokenizer from_hf_file(const std::filesystem::path& path);
  static Tokenizer from_hf_text(std::string_view text, std::string_view source);
  // Loads a tiktoken rank file ("<base64 bytes> <rank>" per line); ranks are
  // ids, pair merges follow tiktoken (rank of the merged token).
  static Tokenizer from_tiktoken_file(const std::filesystem::path& path, std::string pattern,
                                      std::vector<AddedToken> added);
  // The same from the file's contents; `source` names it in error messages.
  static Tokenizer from_tiktoken_data(std::string_view data, std::string_view source, std::string pattern,
                                      std::vector<AddedToken> added);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Full encode (added tokens are recognised in the text). Throws
  // std::runtime_error on invalid UTF-8.
  std::vector<TokenId> encode(std::string_view text) const;
  // Encode with no added-token matching (tiktoken's encode_ordinary): use for
  // untrusted text that must not produce control tokens.
  std::vector<TokenId> encode_ordinary(std::string_view text) const;
  void encode_ordinary_into(std::string_view text, std::vector<TokenId>& out) const;
  // Added-token extraction alone (step 1 of encode).
  std::vector<Segment> split_added_tokens(std::string_view text) const;

  // Raw bytes of the ids (added tokens give their content). Ids without a
  // token but below padded_vocab_size() give nothing; other ids throw.
  std::string decode_bytes(std::span<const TokenId> ids, bool skip_special_tokens = false) const;
  // decode_bytes with invalid UTF-8 replaced by U+FFFD.
  std::string decode(std::span<const TokenId> ids, bool skip_special_tokens = false) const;

  std::optional<TokenId> token_to_id(std::string_view token) const;  // added content or raw bytes
  const AddedToken* added_token(TokenId id) const;
  const std::vector<AddedToken>& added_tokens() const { return added_; }
  const BpeModel& model() const { return bpe_; }
  const std::string& pattern() const { return regex_->pattern(); }
  bool ignore_merges() const { return ignore_merges_; }

  // Largest id + 1 over BPE and added tokens.
  size_t vocab_size() const;
  // Rows of the model's embedding (>= vocab_size()); ids in between decode to
  // nothing. Phi-4: 200064.
  size_t padded_vocab_size() const { return std::max(padded_vocab_size_, vocab_size()); }
  void set_padded_vocab_size(size_t n) { padded_vocab_size_ = n; }

  // Serialises as a HF tokenizer.json that `tokenizers` loads to the same ids.
  // Merges are written one per token, in rank order, as ["a", "b"] pairs
  // (the tiktoken -> HF conversion); `merges_as_strings` writes "a b".
  std::string to_hf_json(bool merges_as_strings = false) const;

  void clear_cache() const;

 private:
  Tokenizer();
  void init_added();
  void encode_segment(std::string_view text, std::vector<TokenId>& out) const;
  std::vector<std::pair<TokenId, TokenId>> merge_list() const;

  BpeModel bpe_;
  std::unique_ptr<SplitRegex> regex_;
  bool ignore_merges_ = true;
  std::vector<AddedToken> added_;
  std::vector<int32_t> added_index_;  // id -> index into added_, -1 otherwise
  bool first_byte_[256] = {};         // bytes that start some added token
  // Merges in file order when loaded from tokenizer.json (empty for tiktoken).
  std::vector<std::pair<TokenId, TokenId>> file_merges_;
  size_t padded_vocab_size_ = 0;
  struct Cache;
  std::unique_ptr<Cache> cache_;
};

// Streaming detokenizer: push ids one at a time, get text that is always
// valid UTF-8 (bytes of an incomplete character are held until it completes).
// Concatenating all push() results and flush() equals decode() of all ids.
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tok, bool skip_special_tokens = false)
      : tok_(&tok), skip_special_(skip_special_tokens) {}
  std::string push(TokenId id);
  std::string push(std::span<const TokenId> ids);
  // Emits the held bytes (invalid ones as U+FFFD) and resets.
  std::string flush();
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tok_;
  bool skip_special_;
  std::string pending_;
};

// Unicode White_Space (Rust char::is_whitespace), used by lstrip/rstrip.
bool is_unicode_whitespace(char32_t cp);

}  // namespace areno::tok
