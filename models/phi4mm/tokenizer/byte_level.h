// GPT-2 byte-level alphabet (spec tokens-api.md 1.5): every byte maps to one
// printable code point, so byte strings can be stored as JSON text.
#pragma once

#include <array>
#include <string>
#include <string_view>

namespace areno::tok {

// The code point that byte `b` maps to (0x20 -> U+0120 'Ġ', 'a' -> 'a').
char32_t byte_to_unicode(unsigned char b);

// Raw bytes -> byte-level string (UTF-8 encoded code points).
std::string bytes_to_byte_level(std::string_view bytes);

// Byte-level string -> raw bytes. Throws std::runtime_error naming `what` when
// a character is outside the 256-character alphabet.
std::string byte_level_to_bytes(std::string_view text, std::string_view what);

}  // namespace areno::tok
