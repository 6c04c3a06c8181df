// Image file input for the image processor: PNM by hand, PNG/BMP/JPEG/GIF through stb_image.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <stb_image_write.h>

#include "models/phi4mm/processor/image_io.h"

using namespace areno::phi4mm;

namespace {
std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

void append(void* ctx, void* data, int size) {
  auto* out = static_cast<std::vector<uint8_t>*>(ctx);
  out->insert(out->end(), static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + size);
}

// A w x h image with `comp` channels encoded as PNG (or BMP) by stb_image_write.
std::vector<uint8_t> encode(int w, int h, int comp, bool bmp, std::vector<uint8_t>* pixels = nullptr) {
  std::vector<uint8_t> px(size_t(w * h * comp));
  for (size_t i = 0; i < px.size(); ++i) px[i] = uint8_t((i * 53 + 7) % 256);
  std::vector<uint8_t> out;
  int ok = bmp ? stbi_write_bmp_to_func(append, &out, w, h, comp, px.data())
               : stbi_write_png_to_func(append, &out, w, h, comp, px.data(), w * comp);
  REQUIRE(ok != 0);
  if (pixels) *pixels = px;
  return out;
}
}  // namespace

TEST_CASE("vision/png and bmp decode to the exact RGB bytes, alpha dropped without compositing") {
  std::vector<uint8_t> px;
  const RgbImage rgb = decode_image(encode(37, 11, 3, false, &px));
  CHECK(rgb.width == 37);
  CHECK(rgb.height == 11);
  CHECK(rgb.rgb == px);
  CHECK(decode_image(encode(37, 11, 3, true)).rgb == px);  // 24-bit BMP

  const RgbImage rgba = decode_image(encode(5, 4, 4, false, &px));  // PIL convert('RGB'): alpha dropped
  REQUIRE(rgba.rgb.size() == 5 * 4 * 3);
  for (size_t p = 0; p < 20; ++p)
    for (size_t c = 0; c < 3; ++c) CHECK(rgba.rgb[3 * p + c] == px[4 * p + c]);

  const RgbImage grey = decode_image(encode(6, 2, 1, false, &px));  // L -> RGB replicates
  for (size_t p = 0; p < 12; ++p)
    for (size_t c = 0; c < 3; ++c) CHECK(grey.rgb[3 * p + c] == px[p]);

  const RgbImage one = decode_image(encode(1, 1, 3, false, &px));
  CHECK(one.rgb == px);
}

TEST_CASE("vision/corrupt, truncated, huge and non-image inputs are rejected") {
  CHECK_THROWS_WITH_AS(decode_image({}), doctest::Contains("0 bytes"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(decode_image(bytes("definitely not an image"), "x.bin"),
                       doctest::Contains("x.bin: not a supported image format (first bytes 64 65 66 69"), std::invalid_argument);
  std::vector<uint8_t> png = encode(64, 64, 3, false);
  std::vector<uint8_t> cut(png.begin(), png.begin() + ptrdiff_t(png.size() / 2));
  CHECK_THROWS_WITH_AS(decode_image(cut), doctest::Contains("PNG data is truncated or corrupt"), std::invalid_argument);
  // Over the pixel limit: refused from the header, before decoding.
  CHECK_THROWS_WITH_AS(decode_image(png, "big.png", 1000), doctest::Contains("big.png: 64x64 has more than 1000"),
                       std::invalid_argument);
  // IHDR claiming 100000 x 100000 (30 GB of RGB): stb_image's own size guard refuses it.
  std::vector<uint8_t> huge = encode(1, 1, 3, false);
  for (int k = 0; k < 2; ++k) {
    const uint32_t v = 100000;
    for (int j = 0; j < 4; ++j) huge[size_t(16 + 4 * k + j)] = uint8_t(v >> (24 - 8 * j));
  }
  CHECK_THROWS_WITH_AS(decode_image(huge, "huge.png"), doctest::Contains("huge.png: PNG header is truncated or corrupt"),
                       std::invalid_argument);
}

TEST_CASE("vision/ppm round trip through a file feeds the processor") {
  RgbImage im{45, 80, std::vector<uint8_t>(45 * 80 * 3)};
  for (size_t i = 0; i < im.rgb.size(); ++i) im.rgb[i] = uint8_t((i * 37) % 251);
  const auto path = std::filesystem::temp_directory_path() / ("areno_test_vision_" + std::to_string(::getpid()) + ".ppm");
  {
    const std::vector<uint8_t> ppm = encode_ppm(im);
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(ppm.data()), std::streamsize(ppm.size()));
  }
  const RgbImage back = read_image_file(path.string());
  std::filesystem::remove(path);
  CHECK(back.width == 45);
  CHECK(back.height == 80);
  CHECK(back.rgb == im.rgb);
  CHECK(process_image(back).layout.num_tokens == 433);
}

TEST_CASE("vision/pnm header comments and grey expansion") {
  std::vector<uint8_t> b = bytes("P5\n# a comment\n3 1 # trailing\n255\n");
  b.insert(b.end(), {0, 128, 255});
  const RgbImage g = decode_pnm(b);
  CHECK(g.width == 3);
  CHECK(g.height == 1);
  CHECK(g.rgb == std::vector<uint8_t>{0, 0, 0, 128, 128, 128, 255, 255, 255});
}

TEST_CASE("vision/bad image files give clear errors") {
  CHECK_THROWS_WITH_AS(read_image_file("/nonexistent/x.ppm"), doctest::Contains("cannot open image file"),
                       std::runtime_error);
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
  CHECK_THROWS_WITH_AS(decode_pnm(png), doctest::Contains("not a binary PNM"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(decode_pnm(bytes("GIF89a")), doctest::Contains("not a binary PNM"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(decode_pnm(bytes("P6\n0 0\n255\n")), doctest::Contains("empty"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(decode_pnm(bytes("P6\n2 2\n65535\n")), doctest::Contains("maxval 255"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(decode_pnm(bytes("P6\n2 2\n255\nabc")), doctest::Contains("truncated"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(decode_pnm(bytes("P6\n100000 100000\n255\n"), "big.ppm"),
                       doctest::Contains("big.ppm: 100000x100000 has more than"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(decode_pnm(bytes("P6\n99999999999 1\n255\n")), doctest::Contains("absurdly large"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(decode_pnm(bytes("P6\nx")), doctest::Contains("expected the width"), std::invalid_argument);
}
