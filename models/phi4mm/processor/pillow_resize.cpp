// Pillow BILINEAR resize of 8-bit images, transcribed from libImaging
// Resample.c (Pillow 9.x), which the released processor runs through
// torchvision's F.resize on PIL images (spec 1.4).
//
// Bit-exactness needs the coefficient arithmetic in double exactly as Pillow
// compiles it for baseline x86-64, i.e. without fused multiply-add: our build
// targets FMA-capable CPUs (-march=native or x86-64-v3) and GCC contracts a*b+c
// even in ISO mode, so contraction is
// switched off for this file.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "models/phi4mm/processor/image_processor.h"

namespace areno::phi4mm {
namespace {

constexpr int kPrecisionBits = 22;  // 32 - 8 - 2, as Pillow

// Fixed-point taps of one axis: for output o, taps k[o*ksize + t] apply to
// input samples [xmin[o], xmin[o] + n[o]).
struct AxisCoeffs {
  int ksize = 0;
  std::vector<int> xmin, n;
  std::vector<int32_t> k;
};

double bilinear_filter(double x) {
  if (x < 0.0) x = -x;
  if (x < 1.0) return 1.0 - x;
  return 0.0;
}

AxisCoeffs precompute_coeffs(int in_size, int out_size) {
  const double support_base = 1.0;  // bilinear
  const double scale = double(in_size) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = support_base * filterscale;
  AxisCoeffs c;
  c.ksize = int(std::ceil(support)) * 2 + 1;
  c.xmin.resize(out_size);
  c.n.resize(out_size);
  c.k.assign(size_t(out_size) * c.ksize, 0);
  std::vector<double> w(c.ksize);
  for (int o = 0; o < out_size; ++o) {
    const double center = 0.0 + (o + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = int(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = int(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double ww = 0.0;
    for (int t = 0; t < xmax; ++t) {
      w[t] = bilinear_filter((t + xmin - center + 0.5) * ss);
      ww += w[t];
    }
    for (int t = 0; t < xmax; ++t)
      if (ww != 0.0) w[t] /= ww;
    for (int t = 0; t < xmax; ++t) {
      const double s = w[t] * (1 << kPrecisionBits);
      c.k[size_t(o) * c.ksize + t] = w[t] < 0 ? int32_t(-0.5 + s) : int32_t(0.5 + s);
    }
    c.xmin[o] = xmin;
    c.n[o] = xmax;
  }
  return c;
}

inline uint8_t clip8(int32_t v) {
  if (v >= (1 << kPrecisionBits << 8)) return 255;
  if (v <= 0) return 0;
  return uint8_t(v >> kPrecisionBits);
}

// Rows [y0, y0 + rows) of `src` (width w_in) resized horizontally to w_out.
RgbImage resample_horizontal(const RgbImage& src, int y0, int rows, int w_out, const AxisCoeffs& c) {
  RgbImage out{w_out, rows, std::vector<uint8_t>(size_t(w_out) * rows * 3)};
  for (int y = 0; y < rows; ++y) {
    const uint8_t* in = src.rgb.data() + size_t(y0 + y) * src.width * 3;
    uint8_t* o_row = out.rgb.data() + size_t(y) * w_out * 3;
    for (int x = 0; x < w_out; ++x) {
      const int32_t* k = c.k.data() + size_t(x) * c.ksize;
      const int xmin = c.xmin[x], n = c.n[x];
      for (int ch = 0; ch < 3; ++ch) {
        int32_t acc = 1 << (kPrecisionBits - 1);
        for (int t = 0; t < n; ++t) acc += int32_t(in[size_t(xmin + t) * 3 + ch]) * k[t];
        o_row[size_t(x) * 3 + ch] = clip8(acc);
      }
    }
  }
  return out;
}

// Vertical pass; `shift` is subtracted from the tap bounds (first row used).
RgbImage resample_vertical(const RgbImage& src, int h_out, const AxisCoeffs& c, int shift) {
  const int64_t w = src.width;
  RgbImage out{w, h_out, std::vector<uint8_t>(size_t(w) * h_out * 3)};
  for (int y = 0; y < h_out; ++y) {
    const int32_t* k = c.k.data() + size_t(y) * c.ksize;
    const int ymin = c.xmin[y] - shift, n = c.n[y];
    uint8_t* o_row = out.rgb.data() + size_t(y) * w * 3;
    for (int64_t i = 0; i < w * 3; ++i) {
      int32_t acc = 1 << (kPrecisionBits - 1);
      for (int t = 0; t < n; ++t) acc += int32_t(src.rgb[size_t(ymin + t) * w * 3 + i]) * k[t];
      o_row[i] = clip8(acc);
    }
  }
  return out;
}

}  // namespace

RgbImage pillow_resize_bilinear(const RgbImage& src, int64_t new_w, int64_t new_h) {
  if (src.width <= 0 || src.height <= 0 || new_w <= 0 || new_h <= 0)
    throw std::invalid_argument("pillow_resize_bilinear: sizes must be positive (got " +
                                std::to_string(src.width) + "x" + std::to_string(src.height) + " -> " +
                                std::to_string(new_w) + "x" + std::to_string(new_h) + ")");
  if (src.rgb.size() != size_t(src.width * src.height * 3))
    throw std::invalid_argument("pillow_resize_bilinear: rgb holds " + std::to_string(src.rgb.size()) +
                                " bytes, expected width*height*3 = " +
                                std::to_string(src.width * src.height * 3));
  if (std::max({src.width, src.height, new_w, new_h}) > (int64_t(1) << 30))
    throw std::invalid_argument("pillow_resize_bilinear: dimension too large");
  const bool need_h = new_w != src.width;
  const bool need_v = new_h != src.height;
  if (!need_h && !need_v) return src;

  const AxisCoeffs ch = precompute_coeffs(int(src.width), int(new_w));
  const AxisCoeffs cv = precompute_coeffs(int(src.height), int(new_h));
  // Only the rows the vertical pass reads are resampled horizontally.
  const int y_first = cv.xmin[0];
  const int y_last = cv.xmin[new_h - 1] + cv.n[new_h - 1];
  if (!need_v) return resample_horizontal(src, 0, int(src.height), int(new_w), ch);
  if (!need_h) return resample_vertical(src, int(new_h), cv, 0);
  const RgbImage tmp = resample_horizontal(src, y_first, y_last - y_first, int(new_w), ch);
  return resample_vertical(tmp, int(new_h), cv, y_first);
}

}  // namespace areno::phi4mm
