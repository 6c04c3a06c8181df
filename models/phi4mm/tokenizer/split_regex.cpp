#include "models/phi4mm/tokenizer/split_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdexcept>

#include <fmt/format.h>

namespace areno::tok {

const char* const kO200kPattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

// Unicode White_Space (what \s means in Rust regex and Oniguruma).
constexpr const char* kWhiteSpaceSet =
    R"(\t\n\x{0B}\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

// Match data is per thread: pcre2 match data is not shareable between threads.
struct MatchData {
  pcre2_match_data* md = nullptr;
  ~MatchData() { if (md) pcre2_match_data_free(md); }
};

}  // namespace

std::string to_pcre2_pattern(std::string_view p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char n = p[i + 1];
      if (n == 's') {
        out += in_class ? std::string(kWhiteSpaceSet) : fmt::format("[{}]", kWhiteSpaceSet);
      } else if (n == 'S') {
        if (in_class) {
          throw std::runtime_error(fmt::format(
              "split pattern: \\S inside a character class is not supported (in \"{}\")", p));
        }
        out += fmt::format("[^{}]", kWhiteSpaceSet);
      } else {
        out += c;
        out += n;
      }
      ++i;
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is literal.
      if (i + 1 < p.size() && p[i + 1] == '^') { out += '^'; ++i; }
      if (i + 1 < p.size() && p[i + 1] == ']') { out += ']'; ++i; }
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

SplitRegex::SplitRegex(std::string pattern) : pattern_(std::move(pattern)) {
  const std::string translated = to_pcre2_pattern(pattern_);
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &offset, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw std::runtime_error(fmt::format("split pattern does not compile at offset {}: {} (pattern \"{}\")",
                                         offset, reinterpret_cast<const char*>(msg), pattern_));
  }
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

SplitRegex::~SplitRegex() {
  if (code_) pcre2_code_free(static_cast<pcre2_code*>(code_));
}

bool SplitRegex::next_match(std::string_view text, size_t start, size_t& b, size_t& e) const {
  thread_local MatchData tl;
  if (!tl.md) tl.md = pcre2_match_data_create(4, nullptr);
  auto* code = static_cast<pcre2_code*>(code_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  // The caller validated the UTF-8 once for the whole text.
  const uint32_t opts = PCRE2_NO_UTF_CHECK | PCRE2_NOTEMPTY_ATSTART;
  const int rc = jit_ ? pcre2_jit_match(code, subject, text.size(), start, opts, tl.md, nullptr)
                      : pcre2_match(code, subject, text.size(), start, opts, tl.md, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    throw std::runtime_error(fmt::format("split pattern match failed at byte {}: {}", start,
                                         reinterpret_cast<const char*>(msg)));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(tl.md);
  b = ov[0];
  e = ov[1];
  return e > b;
}

std::vector<std::string_view> SplitRegex::split(std::string_view text) const {
  std::vector<std::string_view> out;
  split(text, [&](std::string_view p) { out.push_back(p); });
  return out;
}

}  // namespace areno::tok
