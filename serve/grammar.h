#pragma once
// Constrained decoding: the output grammars that `tool_choice` "required" or
// a named function, and `response_format` json_object or json_schema, impose
// on a sequence (as vLLM's guided decoding does for the same requests).
//
// A grammar is a fixed chain of segments: special tokens (<|tool_call|>),
// literal text, a choice among names, a JSON value that a JsonSchema
// (serve/json_schema.h) describes (any object, a response_format schema, or
// the chosen tool's `parameters`: one schema per name of the choice before
// it), and text that a regular expression (serve/regex.h) matches whole. Containers nest at most kMaxDepth deep. Before each draw the sampler asks it which
// ids may come next: an id is allowed when the output with its bytes appended
// is still a prefix of the grammar's language and can still be finished in
// the tokens left (max_tokens counts the stop token). A state's completion is
// its shortest in bytes (for each name of a choice not yet made), spelled in
// the fewest tokens (TokenBytes::spell); taking the first of those tokens
// leaves the rest as the next state's completion, one token shorter, so an
// output the mask lets through always fits: a call or object that runs long
// is closed, never cut. (A completion over 4096 bytes counts a token per
// byte, which keeps that rule, until it is short enough to spell.)
//
// The state is replayed from the sequence's generated tokens at each step
// (no state kept in the engine: preemption and re-prefill cannot break it).
// Log-probabilities stay the raw model's (the sampler's rule), so an RL
// trainer's forward agrees with them; the draw is from the masked
// distribution.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "models/phi4mm/tokenizer/tokenizer.h"
#include "serve/constraint.h"
#include "serve/json_schema.h"
#include "serve/regex.h"

namespace areno::serve {

// The bytes a UTF-8 sequence may take after lead byte c: how many follow,
// and the range of the first of them (the rest are 80-BF). 0 follow for
// ASCII; -1 for a byte that cannot begin a code point (a continuation,
// C0, C1, F5-FF: overlong or beyond U+10FFFF).
int utf8_lead(unsigned char c, unsigned char& lo, unsigned char& hi);

// The bytes of every id below vocab_size, special (added) tokens flagged, the
// id of each single-byte token, and the ordinary ids sorted by their bytes
// (for spell). Built once per tokenizer (about 0.1 s).
class TokenBytes {
 public:
  TokenBytes(const tok::Tokenizer& tokenizer, int64_t vocab_size);
  int64_t size() const { return int64_t(special_.size()); }
  std::string_view bytes(int64_t id) const {
    return std::string_view(data_).substr(size_t(offsets_[size_t(id)]),
                                          size_t(offsets_[size_t(id) + 1] - offsets_[size_t(id)]));
  }
  bool special(int64_t id) const { return special_[size_t(id)] != 0; }
  // The id whose bytes are exactly `c`, or -1.
  int64_t byte_token(unsigned char c) const { return byte_token_[c]; }
  // Not special, and no byte a JSON string reacts to (quote, backslash,
  // control): inside a string the token only adds text.
  bool string_safe(int64_t id) const { return string_safe_[size_t(id)] != 0; }
  // UTF-8 code points (lead bytes) of its bytes.
  int64_t code_points(int64_t id) const { return code_points_[size_t(id)]; }
  // The fewest ordinary (not special) tokens whose bytes spell `text` in
  // order: at most text.size(), every byte being one. With `out`, those ids
  // are appended to it (of several equally short spellings, the one whose
  // first token is longest, then likewise from there on). O(text.size() x
  // the longest token matched x log vocabulary), no allocation but the DP's.
  int64_t spell(std::string_view text, std::vector<int64_t>* out = nullptr) const;
  // Every ordinary id with bytes, sorted by its bytes (then by id): ids that
  // share a prefix are neighbours (a mask can walk them as a trie). Entry i:
  // its id, its bytes (stored in this order, so a walk reads memory in
  // order), and how many leading bytes it shares with entry i - 1.
  size_t ordered_size() const { return ordered_.size(); }
  int32_t ordered_id(size_t i) const { return ordered_[i]; }
  std::string_view ordered_bytes(size_t i) const {
    return std::string_view(ordered_data_).substr(ordered_offsets_[i], ordered_offsets_[i + 1] - ordered_offsets_[i]);
  }
  uint32_t ordered_shared(size_t i) const { return ordered_shared_[i]; }

 private:
  std::string data_;
  std::vector<int64_t> offsets_;
  std::vector<int32_t> ordered_;
  std::string ordered_data_;
  std::vector<uint32_t> ordered_offsets_, ordered_shared_;
  std::vector<int32_t> sorted_;  // ordered_ with one id per distinct bytes
  std::vector<uint8_t> special_, string_safe_;
  std::vector<uint16_t> code_points_;
  int64_t byte_token_[256];
};

class OutputGrammar final : public OutputConstraint {
 public:
  static constexpr int kMaxDepth = JsonSchema::kMaxDepth;
  static constexpr size_t kMaxNames = 64;
  static constexpr size_t kMaxNameBytes = 256;  // OpenAI allows 64 characters

  // <|tool_call|>[{"name": "NAME", "arguments": {...}}]<|/tool_call|><|end|>
  // with NAME one of `names` (1 to kMaxNames of 1 to kMaxNameBytes bytes;
  // JSON-escaped in the output) and the arguments an instance of that name's
  // schema (`schemas` parallel to `names`; empty, or a null entry: any object).
  static std::shared_ptr<const OutputGrammar> tool_call(
      std::shared_ptr<const TokenBytes> bytes, const std::vector<std::string>& names,
      const std::vector<std::shared_ptr<const JsonSchema>>& schemas = {});
  // {...}<|end|>: one JSON object.
  static std::shared_ptr<const OutputGrammar> json_object(std::shared_ptr<const TokenBytes> bytes);
  // CHOICE<|end|>: one of `options` (1 to kMaxNames of 1 to kMaxNameBytes
  // bytes, as written: vLLM's guided_choice).
  static std::shared_ptr<const OutputGrammar> choice(std::shared_ptr<const TokenBytes> bytes,
                                                     const std::vector<std::string>& options);
  // {...}<|end|>: one instance of `schema`.
  static std::shared_ptr<const OutputGrammar> json_schema(std::shared_ptr<const TokenBytes> bytes,
                                                          std::shared_ptr<const JsonSchema> schema);
  // TEXT<|end|>: a whole match of `regex` (vLLM's guided_regex).
  static std::shared_ptr<const OutputGrammar> regex(std::shared_ptr<const TokenBytes> bytes,
                                                    std::shared_ptr<const Regex> regex);

  // Sets work[id] to -inf for every id (of V) not allowed after `generated`,
  // with `remaining` tokens left including this one. When no finite id is
  // left (penalties, logit_bias or min_tokens masked every allowed one), the
  // first token of the shortest completion gets 0 and every other -inf. A
  // finished grammar (its last token generated) leaves work as it is.
  // Throws std::logic_error when `generated` is not a prefix of the language.
  void mask(std::span<const int64_t> generated, int64_t remaining, float* work, int64_t V) const override;

  // The output's text so far is a prefix of the language (tests; the replay).
  bool accepts(std::span<const int64_t> generated) const;
  // The tokens of the completion after `generated` as the mask counts it
  // (tests): its bytes the shortest completion of the name it ends with,
  // among the names still possible, spelled in the fewest tokens.
  std::vector<int64_t> completion(std::span<const int64_t> generated) const;
  // Its length (tests: equal to the above's size).
  int64_t completion_length(std::span<const int64_t> generated) const override;
  // The tokens the shortest complete output needs, counted as the mask
  // counts: max_tokens below it cannot give a complete output (the HTTP
  // layer refuses such a request).
  int64_t min_tokens() const override { return min_tokens_; }

  struct Segment {
    enum Kind { special, literal, choice, json, regex } kind;
    int64_t id = -1;                 // special
    std::string text;                // literal
    std::vector<std::string> names;  // choice (escaped)
    // json: one schema, or one per name of the choice segment before it.
    std::vector<std::shared_ptr<const JsonSchema>> schemas;
    std::shared_ptr<const Regex> automaton;  // regex: its automaton (the state in State::vnode)
  };
  struct State;
  ~OutputGrammar() override;

 private:
  OutputGrammar(std::shared_ptr<const TokenBytes> bytes, std::vector<Segment> segments);
  // The state after `generated`, from the longest output replayed before
  // that it starts with; `remember` keeps it for the next step (the mask).
  bool replay(std::span<const int64_t> generated, State& st, bool remember = false) const;
  bool step_token(State& st, int64_t id) const;
  bool step_byte(State& st, unsigned char c) const;
  bool step_json(State& st, unsigned char c) const;
  template <typename F>
  void for_completion(const State& st, F&& emit, int force = -1) const;
  int64_t completion_bytes(const State& st) const;
  struct SpellCache;
  int64_t completion_tokens(const State& st, std::vector<int64_t>* out, SpellCache* cache = nullptr) const;
  int64_t json_length(const State& st) const;
  const JsonSchema& schema(const State& st) const;
  int64_t tail(size_t k, uint8_t chosen) const;
  // The bytes of what decides a state's future (the mask cache's key).
  std::string state_key(const State& st) const;

  std::shared_ptr<const TokenBytes> bytes_;
  std::vector<Segment> segments_;
  size_t choice_seg_ = size_t(-1);       // the choice segment, if any
  // Completion length of segments k.. from their start: per chosen name
  // (one row without a choice), and the least over the names.
  std::vector<std::vector<int64_t>> tails_;
  std::vector<int64_t> tail_min_;
  int64_t min_tokens_ = 0;
  // The ids allowed after the last few states masked, with the budget from
  // which they all fit: a state met again (inside a free string or a regex's
  // free text, every step) costs one pass over the ids.
  std::unique_ptr<MaskCache> masks_;
  // The states after the last few outputs masked (one per sample of a
  // request): a step replays only its new tokens.
  std::unique_ptr<ReplayCache<State>> replayed_;
};

// tool_choice "auto" with tools: the output is free text until the model
// writes <|tool_call|>; from that token on, `call` (OutputGrammar::tool_call
// over every offered tool) constrains the rest, so a call the model begins
// always parses and its arguments follow its tool's `parameters`. Before the
// marker nothing is masked, except the marker itself when fewer tokens are
// left than the shortest call needs (a call is never begun that would be
// cut), unless it is the only id left.
class AutoToolCall final : public OutputConstraint {
 public:
  explicit AutoToolCall(std::shared_ptr<const OutputGrammar> call);
  void mask(std::span<const int64_t> generated, int64_t remaining, float* work, int64_t V) const override;
  int64_t min_tokens() const override { return 1; }  // free text: the stop token alone
  // 0 before the marker (free text may stop), else the call's.
  int64_t completion_length(std::span<const int64_t> generated) const override;

 private:
  std::shared_ptr<const OutputGrammar> call_;
};

}  // namespace areno::serve
