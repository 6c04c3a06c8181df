#include "models/phi4mm/tokenizer/utf8.h"

#include <stdexcept>

#include <fmt/format.h>

namespace areno::tok {

namespace {

// Length of the valid sequence starting at text[i], or 0 if invalid. Sets
// `truncated` when the bytes so far are a valid start of a longer sequence
// that the text cuts off. `prefix` receives the number of bytes that form a
// valid start before the failure (the "maximal subpart" replaced by one
// U+FFFD), at least 1.
size_t valid_sequence_length(std::string_view text, size_t i, bool& truncated,
                             size_t* prefix = nullptr) {
  truncated = false;
  if (prefix) *prefix = 1;
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return 1;
  size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 == 0xE0) {
    need = 2; lo = 0xA0;
  } else if (b0 >= 0xE1 && b0 <= 0xEC) {
    need = 2;
  } else if (b0 == 0xED) {
    need = 2; hi = 0x9F;  // excludes surrogates
  } else if (b0 >= 0xEE && b0 <= 0xEF) {
    need = 2;
  } else if (b0 == 0xF0) {
    need = 3; lo = 0x90;
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    need = 3;
  } else if (b0 == 0xF4) {
    need = 3; hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= text.size()) {
      truncated = true;
      return 0;
    }
    const unsigned char b = byte(i + k);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return 0;
    if (prefix) *prefix = k + 1;
  }
  return need + 1;
}

}  // namespace

size_t find_invalid_utf8(std::string_view text) {
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, text.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    bool truncated;
    const size_t len = valid_sequence_length(text, i, truncated);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

void require_valid_utf8(std::string_view text, std::string_view what) {
  const size_t bad = find_invalid_utf8(text);
  if (bad == std::string_view::npos) return;
  throw std::runtime_error(fmt::format(
      "{} is not valid UTF-8: invalid byte 0x{:02X} at byte offset {} (text must be UTF-8; "
      "unpaired surrogates must be replaced by U+FFFD before tokenizing)",
      what, static_cast<unsigned char>(text[bad]), bad));
}

std::string replace_invalid_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    bool truncated;
    const size_t len = valid_sequence_length(text, i, truncated);
    if (len > 0) {
      out.append(text.substr(i, len));
      i += len;
      continue;
    }
    out.append("\xEF\xBF\xBD");
    size_t prefix = 1;
    valid_sequence_length(text, i, truncated, &prefix);
    i += truncated ? text.size() - i : prefix;
  }
  return out;
}

size_t utf8_complete_prefix(std::string_view bytes) {
  const size_t n = bytes.size();
  // Look at most 3 bytes back for the start of a truncated sequence.
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const size_t i = n - back;
    const auto b = static_cast<unsigned char>(bytes[i]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte, keep looking
    if (b < 0x80) return n;
    bool truncated;
    valid_sequence_length(bytes, i, truncated);
    return truncated ? i : n;
  }
  return n;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace areno::tok
