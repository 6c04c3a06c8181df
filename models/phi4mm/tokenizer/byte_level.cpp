#include "models/phi4mm/tokenizer/byte_level.h"

#include <stdexcept>

#include <fmt/format.h>

#include "models/phi4mm/tokenizer/utf8.h"

namespace areno::tok {

namespace {

struct ByteTables {
  std::array<char32_t, 256> to_unicode{};
  std::array<std::string, 256> to_utf8;
  std::array<int, 0x144> from_unicode{};  // -1 where not in the alphabet

  ByteTables() {
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_unicode[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    from_unicode.fill(-1);
    for (int b = 0; b < 256; ++b) {
      append_utf8(to_utf8[b], to_unicode[b]);
      from_unicode[to_unicode[b]] = b;
    }
  }
};

const ByteTables& tables() {
  static const ByteTables t;
  return t;
}

}  // namespace

char32_t byte_to_unicode(unsigned char b) { return tables().to_unicode[b]; }

std::string bytes_to_byte_level(std::string_view bytes) {
  const auto& t = tables();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) out += t.to_utf8[b];
  return out;
}

std::string byte_level_to_bytes(std::string_view text, std::string_view what) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const auto b0 = static_cast<unsigned char>(text[i]);
    char32_t cp;
    size_t len;
    if (b0 < 0x80) {
      cp = b0; len = 1;
    } else if ((b0 & 0xE0) == 0xC0 && i + 1 < text.size()) {
      cp = ((b0 & 0x1F) << 6) | (static_cast<unsigned char>(text[i + 1]) & 0x3F);
      len = 2;
    } else {
      cp = 0x110000; len = 1;  // any 3/4-byte character is outside the alphabet
    }
    const int byte = cp < 0x144 ? tables().from_unicode[cp] : -1;
    if (byte < 0) {
      throw std::runtime_error(fmt::format(
          "{}: character at byte offset {} of \"{}\" is not in the byte-level alphabet "
          "(expected GPT-2 bytes_to_unicode characters)", what, i, text));
    }
    out.push_back(static_cast<char>(byte));
    i += len;
  }
  return out;
}

}  // namespace areno::tok
