// PNM input for the image processor.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "models/phi4mm/processor/image_io.h"

using namespace areno::phi4mm;

namespace {
std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
}  // namespace

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
  CHECK_THROWS_WITH_AS(decode_pnm(png), doctest::Contains("PNG is not supported"), std::invalid_argument);
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
