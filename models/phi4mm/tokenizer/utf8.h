// UTF-8 helpers for the tokenizer: validation, lenient repair, and the
// "complete prefix" rule used by streaming decode.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace areno::tok {

// Byte offset of the first invalid UTF-8 sequence, or std::string_view::npos
// when the whole text is valid. Overlong forms, surrogates (U+D800..U+DFFF)
// and code points above U+10FFFF are invalid, as in the Unicode standard.
size_t find_invalid_utf8(std::string_view text);

// Throws std::runtime_error naming `what` and the byte offset when `text` is
// not valid UTF-8.
void require_valid_utf8(std::string_view text, std::string_view what);

// Replaces every maximal invalid subsequence by U+FFFD (the WHATWG / Python
// "replace" policy), so the result is always valid UTF-8.
std::string replace_invalid_utf8(std::string_view text);

// Length of the longest prefix of `bytes` that does not end inside an
// incomplete (but so far valid) multi-byte sequence. Invalid bytes count as
// complete (they decode to U+FFFD); only a truncated tail of at most 3 bytes
// is held back.
size_t utf8_complete_prefix(std::string_view bytes);

// Appends the UTF-8 encoding of code point `cp` (must be a valid scalar).
void append_utf8(std::string& out, char32_t cp);

}  // namespace areno::tok
