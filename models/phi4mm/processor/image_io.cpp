#include "models/phi4mm/processor/image_io.h"

#include <stb_image.h>

#include <cctype>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace areno::phi4mm {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& msg) {
  throw std::invalid_argument(what + ": " + msg);
}

// Next header integer, skipping whitespace and '#' comments.
int64_t header_int(const std::vector<uint8_t>& b, size_t& i, const std::string& what, const char* field) {
  for (;;) {
    while (i < b.size() && std::isspace(b[i])) ++i;
    if (i < b.size() && b[i] == '#') {
      while (i < b.size() && b[i] != '\n') ++i;
      continue;
    }
    break;
  }
  if (i >= b.size() || !std::isdigit(b[i])) fail(what, std::string("PNM header: expected the ") + field);
  int64_t v = 0;
  while (i < b.size() && std::isdigit(b[i])) {
    v = v * 10 + (b[i++] - '0');
    if (v > (int64_t(1) << 31)) fail(what, std::string("PNM header: ") + field + " is absurdly large");
  }
  return v;
}

void check_pixels(int64_t w, int64_t h, int64_t max_pixels, const std::string& what) {
  if (w <= 0 || h <= 0) fail(what, "image is empty (" + std::to_string(w) + "x" + std::to_string(h) + ")");
  if (max_pixels > 0 && w * h > max_pixels)
    fail(what, std::to_string(w) + "x" + std::to_string(h) + " has more than " + std::to_string(max_pixels) +
                   " pixels");
}

bool is_pnm(const std::vector<uint8_t>& b) { return b.size() >= 2 && b[0] == 'P' && (b[1] == '5' || b[1] == '6'); }

}  // namespace

RgbImage decode_image(const std::vector<uint8_t>& b, const std::string& what, int64_t max_pixels) {
  if (b.empty()) fail(what, "no image data (0 bytes)");
  if (is_pnm(b)) return decode_pnm(b, what, max_pixels);
  if (b.size() > size_t(INT32_MAX)) fail(what, "image data over 2 GiB");
  const auto* data = reinterpret_cast<const stbi_uc*>(b.data());
  const int len = int(b.size());
  int w = 0, h = 0, comp = 0;
  // Dimensions first, so an absurd header is refused before any pixel memory.
  if (!stbi_info_from_memory(data, len, &w, &h, &comp))
    fail(what, std::string("not a decodable image (PNG, JPEG, BMP, GIF or binary PNM expected): ") +
                   stbi_failure_reason());
  check_pixels(w, h, max_pixels, what);
  // 3 channels: alpha is dropped without compositing and grey is replicated,
  // as PIL's convert('RGB') does (spec 1.1); GIF gives its first frame.
  stbi_uc* px = stbi_load_from_memory(data, len, &w, &h, &comp, 3);
  if (!px) fail(what, std::string("corrupt or truncated image: ") + stbi_failure_reason());
  RgbImage im{w, h, std::vector<uint8_t>(px, px + size_t(w) * size_t(h) * 3)};
  stbi_image_free(px);
  return im;
}

RgbImage decode_pnm(const std::vector<uint8_t>& b, const std::string& what, int64_t max_pixels) {
  if (b.size() < 2 || b[0] != 'P' || (b[1] != '5' && b[1] != '6'))
    fail(what, "not a binary PNM image (expected magic P5 or P6)");
  const int channels = b[1] == '6' ? 3 : 1;
  size_t i = 2;
  const int64_t w = header_int(b, i, what, "width");
  const int64_t h = header_int(b, i, what, "height");
  const int64_t maxval = header_int(b, i, what, "maxval");
  if (w <= 0 || h <= 0) fail(what, "image is empty (" + std::to_string(w) + "x" + std::to_string(h) + ")");
  if (maxval != 255) fail(what, "only 8-bit PNM (maxval 255) is supported, got maxval " + std::to_string(maxval));
  check_pixels(w, h, max_pixels, what);
  if (i >= b.size() || !std::isspace(b[i])) fail(what, "PNM header: missing whitespace after maxval");
  ++i;
  const size_t need = size_t(w * h * channels);
  if (b.size() - i < need)
    fail(what, "truncated pixel data: " + std::to_string(b.size() - i) + " bytes, expected " +
                   std::to_string(need));
  RgbImage im{w, h, std::vector<uint8_t>(size_t(w * h * 3))};
  if (channels == 3) {
    std::copy(b.begin() + ptrdiff_t(i), b.begin() + ptrdiff_t(i + need), im.rgb.begin());
  } else {
    for (size_t p = 0; p < need; ++p) im.rgb[3 * p] = im.rgb[3 * p + 1] = im.rgb[3 * p + 2] = b[i + p];
  }
  return im;
}

RgbImage read_image_file(const std::string& path, int64_t max_pixels) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open image file '" + path + "'");
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return decode_image(bytes, "image file '" + path + "'", max_pixels);
}

std::vector<uint8_t> encode_ppm(const RgbImage& image) {
  if (image.rgb.size() != size_t(image.width * image.height * 3))
    throw std::invalid_argument("encode_ppm: rgb size does not match width*height*3");
  const std::string head = "P6\n" + std::to_string(image.width) + " " + std::to_string(image.height) + "\n255\n";
  std::vector<uint8_t> out(head.begin(), head.end());
  out.insert(out.end(), image.rgb.begin(), image.rgb.end());
  return out;
}

}  // namespace areno::phi4mm
