#include "models/phi4mm/processor/image_io.h"

#include <stb_image.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

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

bool starts_with(const std::vector<uint8_t>& b, std::initializer_list<uint8_t> magic, size_t at = 0) {
  if (b.size() < at + magic.size()) return false;
  return std::equal(magic.begin(), magic.end(), b.begin() + ptrdiff_t(at));
}

constexpr const char* kSupported = "expected PNG, JPEG, BMP, GIF or binary PNM";

// The format the magic bytes name: {name, decodable here}; {"", false} when
// no known format matches.
std::pair<std::string, bool> sniff_format(const std::vector<uint8_t>& b) {
  if (starts_with(b, {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A})) return {"PNG", true};
  if (starts_with(b, {0xFF, 0xD8, 0xFF})) return {"JPEG", true};
  if (starts_with(b, {'G', 'I', 'F', '8', '7', 'a'}) || starts_with(b, {'G', 'I', 'F', '8', '9', 'a'})) return {"GIF", true};
  if (starts_with(b, {'B', 'M'})) return {"BMP", true};
  if (starts_with(b, {'P', '5'}) || starts_with(b, {'P', '6'})) return {"PNM", true};
  if (b.size() >= 2 && b[0] == 'P' && b[1] >= '1' && b[1] <= '7') return {"ASCII or PAM PNM", false};
  if (starts_with(b, {'R', 'I', 'F', 'F'}) && starts_with(b, {'W', 'E', 'B', 'P'}, 8)) return {"WebP", false};
  if (starts_with(b, {'I', 'I', 42, 0}) || starts_with(b, {'M', 'M', 0, 42})) return {"TIFF", false};
  if (starts_with(b, {'f', 't', 'y', 'p'}, 4)) return {"HEIF/AVIF", false};
  if (starts_with(b, {'8', 'B', 'P', 'S'})) return {"PSD", false};
  if (starts_with(b, {0, 0, 1, 0})) return {"ICO", false};
  if (starts_with(b, {'#', '?'})) return {"Radiance HDR", false};
  return {"", false};
}

std::string first_bytes(const std::vector<uint8_t>& b) {
  std::string out;
  for (size_t i = 0; i < std::min<size_t>(b.size(), 4); ++i) out += fmt::format("{}{:02x}", i ? " " : "", b[i]);
  return out;
}

// A binary PNM header: channels, size and where the pixels start.
struct PnmHeader {
  int channels = 3;
  int64_t width = 0, height = 0;
  size_t data = 0;
};

PnmHeader read_pnm_header(const std::vector<uint8_t>& b, const std::string& what, int64_t max_pixels) {
  if (b.size() < 2 || b[0] != 'P' || (b[1] != '5' && b[1] != '6'))
    fail(what, "not a binary PNM image (expected magic P5 or P6)");
  PnmHeader h;
  h.channels = b[1] == '6' ? 3 : 1;
  size_t i = 2;
  h.width = header_int(b, i, what, "width");
  h.height = header_int(b, i, what, "height");
  const int64_t maxval = header_int(b, i, what, "maxval");
  if (h.width <= 0 || h.height <= 0)
    fail(what, "image is empty (" + std::to_string(h.width) + "x" + std::to_string(h.height) + ")");
  if (maxval != 255) fail(what, "only 8-bit PNM (maxval 255) is supported, got maxval " + std::to_string(maxval));
  check_pixels(h.width, h.height, max_pixels, what);
  if (i >= b.size() || !std::isspace(b[i])) fail(what, "PNM header: missing whitespace after maxval");
  h.data = i + 1;
  return h;
}

// stb_image keeps one failure reason, also set by the signature tests of
// formats it tried first: "bad png sig" for a JPEG is such a leftover.
std::string stb_reason(const std::string& format) {
  const char* r = stbi_failure_reason();
  const std::string reason = r ? r : "";
  if (reason.empty() || reason == "unknown image type" || (format != "PNG" && reason == "bad png sig")) return "";
  return " (stb_image: " + reason + ")";
}

}  // namespace

ImageInfo probe_image(const std::vector<uint8_t>& b, const std::string& what, int64_t max_pixels) {
  if (b.empty()) fail(what, "no image data (0 bytes)");
  const auto [format, supported] = sniff_format(b);
  if (format.empty())
    fail(what, fmt::format("not a supported image format (first bytes {}; {})", first_bytes(b), kSupported));
  if (!supported) fail(what, fmt::format("{} images are not supported ({})", format, kSupported));
  if (format == "PNM") {
    const PnmHeader h = read_pnm_header(b, what, max_pixels);
    return {format, h.width, h.height};
  }
  if (b.size() > size_t(INT32_MAX)) fail(what, "image data over 2 GiB");
  // stb_image reads missing header bytes as zeros: check the fixed-size headers' length here.
  const size_t header = format == "PNG" ? 33 : format == "GIF" ? 13 : format == "BMP" ? 26 : 4;
  if (b.size() < header) fail(what, fmt::format("{} header is truncated ({} bytes)", format, b.size()));
  int w = 0, h = 0, comp = 0;
  if (!stbi_info_from_memory(reinterpret_cast<const stbi_uc*>(b.data()), int(b.size()), &w, &h, &comp))
    fail(what, fmt::format("{} header is truncated or corrupt, or declares a size or variant stb_image does not decode",
                           format));
  check_pixels(w, h, max_pixels, what);
  return {format, w, h};
}

RgbImage decode_image(const std::vector<uint8_t>& b, const std::string& what, int64_t max_pixels) {
  // The header first, so an absurd size is refused before any pixel memory.
  const ImageInfo info = probe_image(b, what, max_pixels);
  if (info.format == "PNM") return decode_pnm(b, what, max_pixels);
  int w = 0, h = 0, comp = 0;
  // 3 channels: alpha is dropped without compositing and grey is replicated,
  // as PIL's convert('RGB') does (spec 1.1); GIF gives its first frame.
  stbi_uc* px = stbi_load_from_memory(reinterpret_cast<const stbi_uc*>(b.data()), int(b.size()), &w, &h, &comp, 3);
  if (!px) fail(what, fmt::format("{} data is truncated or corrupt{}", info.format, stb_reason(info.format)));
  std::unique_ptr<stbi_uc, void (*)(void*)> owned(px, stbi_image_free);
  if (w != info.width || h != info.height)
    fail(what, fmt::format("{} decoded to {}x{}, not the {}x{} its header declares", info.format, w, h, info.width,
                           info.height));
  return RgbImage{w, h, std::vector<uint8_t>(px, px + size_t(w) * size_t(h) * 3)};
}

RgbImage decode_pnm(const std::vector<uint8_t>& b, const std::string& what, int64_t max_pixels) {
  const PnmHeader ph = read_pnm_header(b, what, max_pixels);
  const int64_t w = ph.width, h = ph.height;
  const size_t i = ph.data, need = size_t(w * h * ph.channels);
  if (i > b.size() || b.size() - i < need)
    fail(what, "PNM data is truncated: " + std::to_string(b.size() - std::min(i, b.size())) + " pixel bytes, expected " +
                   std::to_string(need));
  RgbImage im{w, h, std::vector<uint8_t>(size_t(w * h * 3))};
  if (ph.channels == 3) {
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
