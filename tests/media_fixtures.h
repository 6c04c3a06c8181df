#pragma once
// Synthetic media shared by the tests and the reference scripts that write
// their goldens (tests/reference/model/make_e2e_golden.py,
// tests/reference/train/make_train_golden.py use the same formulas).
#include <cmath>
#include <cstdint>
#include <vector>

#include "models/phi4mm/processor/image_io.h"

namespace areno::testing {

// Spec vision.md 12: R = 7x + 3y, G = x ^ y, B = 5(x + 2y) + xy, all mod 256.
inline phi4mm::RgbImage formula_image(int64_t w, int64_t h) {
  phi4mm::RgbImage im;
  im.width = w, im.height = h;
  im.rgb.resize(size_t(w * h * 3));
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x) {
      uint8_t* p = &im.rgb[size_t((y * w + x) * 3)];
      p[0] = uint8_t((7 * x + 3 * y) % 256);
      p[1] = uint8_t((x ^ y) % 256);
      p[2] = uint8_t((5 * (x + 2 * y) + x * y) % 256);
    }
  return im;
}

// make_e2e_golden.py clip_b: 1.25 s chirp at 16 kHz.
inline std::vector<double> clip_b() {
  std::vector<double> s(20000);
  for (size_t i = 0; i < s.size(); ++i) {
    const double t = double(i) / 16000.0;
    s[i] = std::sin(2 * M_PI * (200.0 * t + 1200.0 * t * t)) * 0.5;
  }
  return s;
}

// make_e2e_golden.py clip_c: 1.25 s of two tones at 8 kHz.
inline std::vector<double> clip_c() {
  std::vector<double> s(10000);
  for (size_t i = 0; i < s.size(); ++i) {
    const double t = double(i) / 8000.0;
    s[i] = 0.3 * std::sin(2 * M_PI * 440.0 * t) + 0.2 * std::sin(2 * M_PI * 1250.0 * t);
  }
  return s;
}

}  // namespace areno::testing
