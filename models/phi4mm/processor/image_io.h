#pragma once
// Image input for the processor: PNG, JPEG, BMP, GIF (first frame) through
// stb_image (Debian libstb), and binary PNM (P5 grey, P6 RGB, 8-bit) by hand.
// Bit-exactness with the reference needs the same decoded RGB bytes (spec
// 1.1): lossless formats decode identically; JPEG decoders may differ.
#include <cstdint>
#include <string>
#include <vector>

#include "models/phi4mm/processor/image_processor.h"

namespace areno::phi4mm {

// The format the leading bytes name and the size the header declares, read
// without decoding any pixel. `format` is "PNG", "JPEG", "GIF", "BMP" or
// "PNM". Throws std::invalid_argument naming `what`: a format recognised but
// not supported ("WebP images are not supported ..."), an unknown one ("not a
// supported image format (first bytes 68 65 6c 6c) ..."), a header that is
// truncated or corrupt, or more than `max_pixels` pixels.
struct ImageInfo {
  std::string format;
  int64_t width = 0;
  int64_t height = 0;
};
ImageInfo probe_image(const std::vector<uint8_t>& bytes, const std::string& what = "image",
                      int64_t max_pixels = ImageProcessorOptions{}.max_pixels);

// Any supported format, sniffed from the magic bytes (probe_image first, so an
// image over `max_pixels` is refused before pixel memory is allocated). `what`
// names the source in error messages, which name the format and the decoder's
// reason ("JPEG data is truncated or corrupt (stb_image: ...)"). Grey (P5) is
// expanded to RGB as PIL's convert('RGB') does (R = G = B).
RgbImage decode_image(const std::vector<uint8_t>& bytes, const std::string& what = "image",
                      int64_t max_pixels = ImageProcessorOptions{}.max_pixels);
RgbImage decode_pnm(const std::vector<uint8_t>& bytes, const std::string& what = "image",
                    int64_t max_pixels = ImageProcessorOptions{}.max_pixels);
RgbImage read_image_file(const std::string& path, int64_t max_pixels = ImageProcessorOptions{}.max_pixels);
// Binary P6 bytes of an image (for tests and debugging dumps).
std::vector<uint8_t> encode_ppm(const RgbImage& image);

}  // namespace areno::phi4mm
