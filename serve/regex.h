#pragma once
// Regular expressions for constrained decoding (vLLM's `guided_regex` and
// `structured_outputs.regex`): a pattern compiled to a deterministic
// automaton over UTF-8 bytes that the whole output must match, with each
// state's shortest accepted continuation, so the grammar (serve/grammar.h)
// can mask tokens and always finish within max_tokens.
//
// The syntax is the part Python's `re` and ECMAScript agree on:
//   literals (any UTF-8 text; a quantifier after a character takes the whole
//   code point), `.` (any code point but newline), classes `[...]` / `[^...]`
//   with ranges and the escapes below, `\d \D \w \W \s \S` (ASCII: \w is
//   [A-Za-z0-9_], \s is [ \t\n\r\f\v]), `\n \t \r \f \v \0 \xHH \uHHHH`, any
//   escaped punctuation, groups `(...)`, `(?:...)`, `(?P<name>...)`,
//   `(?<name>...)`, alternation `|`, quantifiers `* + ? {n} {n,} {n,m}` (a
//   lazy `?` or possessive `+` after one is accepted: the language is the
//   same), `^` first and `$` last (the match is always the whole output).
// Refused with a message naming the construct (never read differently):
// backreferences, lookaround, `\b \B \A \Z \z`, `\p{...}`, inline flags
// such as `(?i)`, POSIX classes, `^` / `$` elsewhere, unbalanced groups.
//
// Bounds, each a clear std::invalid_argument: the pattern's bytes, repeat
// counts, the automaton's states and the work of building it. The parser
// walks the pattern with an explicit stack: nothing recurses on it.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace areno::serve {

class Regex {
 public:
  static constexpr size_t kMaxPatternBytes = 4096;
  static constexpr uint32_t kMaxRepeat = 1000;         // n and m in {n,m}
  static constexpr size_t kMaxNfaStates = 1 << 15;     // after repeats are expanded
  static constexpr size_t kMaxDfaStates = 32767;   // `.{0,1000}` needs 8001
  static constexpr int64_t kMaxBuildWork = int64_t(1) << 24;  // NFA states visited while building
  static constexpr int32_t kDead = -1;

  struct Options {
    // The text is a JSON string's inside as written: no character that JSON
    // must escape (controls, '"', '\\') is matched, so the written text is
    // the value (a JSON Schema `pattern` or `format`).
    bool json_string = false;
    // As a JSON Schema `pattern` (ECMAScript search): a match anywhere in
    // the text, unless '^' / '$' anchor it (refused beside a top-level '|',
    // where they would anchor one alternative only).
    bool search = false;
    // Construction work left across the patterns of one request (null:
    // each pattern alone is bounded by kMaxBuildWork).
    int64_t* work_left = nullptr;
  };
  // Throws std::invalid_argument (what is wrong, and where) for a pattern
  // outside the syntax or the bounds, or one that matches no string.
  static std::shared_ptr<const Regex> compile(std::string_view pattern, const Options& options);
  static std::shared_ptr<const Regex> compile(std::string_view pattern) { return compile(pattern, Options{}); }

  int32_t start() const { return 0; }
  // The state after byte c, or kDead where no match can follow.
  int32_t next(int32_t s, unsigned char c) const { return next_[size_t(s) * classes_ + class_of_[c]]; }
  bool accepting(int32_t s) const { return dist_[size_t(s)] == 0; }
  // Bytes of the shortest accepted continuation (0: accepting).
  int64_t distance(int32_t s) const { return dist_[size_t(s)]; }
  // That continuation: its first byte leads to a state whose shortest
  // continuation is the rest (printable ASCII preferred among equals).
  std::string shortest(int32_t s) const;
  // Whether the whole of `text` matches (tests).
  bool matches(std::string_view text) const;
  size_t states() const { return dist_.size(); }

  static constexpr uint32_t kNoMaxLength = 0xffffffffu;
  // The same language limited to texts of min_cp to max_cp code points
  // (UTF-8 lead bytes and ASCII counted; kNoMaxLength: no upper bound): the
  // product of the automaton and a counter, bounded like compile (its work
  // is taken from *work_left when given). A JSON Schema string's `pattern`
  // beside `minLength` / `maxLength`.
  std::shared_ptr<const Regex> with_length(uint32_t min_cp, uint32_t max_cp, int64_t* work_left = nullptr) const;

  // The same language limited to the texts whose decimal value times
  // 10^scale is a multiple of `divisor` (JSON Schema's `multipleOf` of
  // divisor x 10^-scale), and never a negative zero: this automaton's texts
  // must be JSON numbers without exponent ('-', digits, one '.'). Beyond
  // `scale` fraction digits only zeros follow. The product of the automaton
  // and the remainder, bounded like with_length.
  std::shared_ptr<const Regex> with_multiple(uint64_t divisor, uint32_t scale, int64_t* work_left = nullptr) const;

 private:
  // The automaton from its transition table (per state, per byte class) and
  // accepting states: the shortest continuations, dead ends pruned. Throws
  // `matches_nothing` when the start reaches no accepting state.
  static std::shared_ptr<Regex> from_table(const std::vector<std::vector<int32_t>>& trans,
                                           const std::vector<uint8_t>& accepting, const uint8_t* class_of, size_t C,
                                           const char* matches_nothing);

  // Per state, one entry per byte class (bytes no edge of the pattern tells
  // apart): a 1000-state automaton of 20 classes takes 40 KB, not 512.
  std::vector<int16_t> next_;
  uint8_t class_of_[256] = {};
  size_t classes_ = 1;
  std::vector<int64_t> dist_;
  std::vector<uint8_t> toward_;
};

}  // namespace areno::serve
