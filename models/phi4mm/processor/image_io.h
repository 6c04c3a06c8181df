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

// `what` names the source in error messages. Grey (P5) is expanded to RGB as
// PIL's convert('RGB') does (R = G = B). Images over `max_pixels` are rejected
// before allocation.
// Any supported format, sniffed from the bytes. Images over `max_pixels` are
// rejected from the header, before pixel memory is allocated.
RgbImage decode_image(const std::vector<uint8_t>& bytes, const std::string& what = "image",
                      int64_t max_pixels = ImageProcessorOptions{}.max_pixels);
RgbImage decode_pnm(const std::vector<uint8_t>& bytes, const std::string& what = "image",
                    int64_t max_pixels = ImageProcessorOptions{}.max_pixels);
RgbImage read_image_file(const std::string& path, int64_t max_pixels = ImageProcessorOptions{}.max_pixels);
// Binary P6 bytes of an image (for tests and debugging dumps).
std::vector<uint8_t> encode_ppm(const RgbImage& image);

}  // namespace areno::phi4mm
