// Image bytes: format sniffing, PNG/JPEG/BMP/GIF (stb_image) and PNM
// decoding, then the image processor on what decoded.
#include <exception>
#include <vector>

#include "models/phi4mm/processor/image_io.h"
#include "models/phi4mm/processor/image_processor.h"
#include "tests/fuzz/fuzz_common.h"

using namespace areno;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<uint8_t> bytes(data, data + size);
  try {
    const phi4mm::RgbImage im = phi4mm::decode_image(bytes, "fuzz", 1 << 20);
    if (im.width * im.height <= 4096) (void)phi4mm::process_images({im});
  } catch (const std::exception&) {
  }
  return 0;
}
