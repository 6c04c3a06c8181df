// The pre-tokenizer split pattern, compiled with PCRE2 (UTF + UCP, JIT when
// available). Pieces are the regex matches; text between matches (never
// produced by the o200k pattern) becomes pieces too, as in HF's Split with
// behaviour "Isolated".
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace areno::tok {

// The o200k split pattern exactly as in the spec (tokens-api.md 1.4).
extern const char* const kO200kPattern;

class SplitRegex {
 public:
  // Throws std::runtime_error with PCRE2's message and offset if the pattern
  // does not compile.
  explicit SplitRegex(std::string pattern);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;

  const std::string& pattern() const { return pattern_; }
  bool jit() const { return jit_; }

  // Calls fn(piece) for every piece of `text`, in order. `text` must be valid
  // UTF-8 (checked by the caller).
  template <class Fn>
  void split(std::string_view text, Fn&& fn) const {
    size_t start = 0;
    while (start < text.size()) {
      size_t b, e;
      if (!next_match(text, start, b, e)) {
        fn(text.substr(start));
        return;
      }
      if (b > start) fn(text.substr(start, b - start));
      fn(text.substr(b, e - b));
      start = e;
    }
  }
  std::vector<std::string_view> split(std::string_view text) const;

 private:
  // Finds the next non-empty match at or after `start`.
  bool next_match(std::string_view text, size_t start, size_t& b, size_t& e) const;

  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8
  bool jit_ = false;
};

// Rewrites \s and \S to the Unicode White_Space set used by Rust regex and
// Oniguruma: PCRE2's UCP \s also matches U+180E, which they do not.
std::string to_pcre2_pattern(std::string_view pattern);

}  // namespace areno::tok
