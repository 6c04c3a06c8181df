// The released Phi-4-multimodal image processor (spec vision.md sections 1-2).
//
// Float arithmetic here must round exactly as the reference: the no-FMA
// thumbnail needs every product rounded, and our FMA-capable builds would
// otherwise let GCC fuse a*b+c. The FMA variant calls std::fma explicitly, so
// both variants are available whatever the compiler flags.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "models/phi4mm/processor/image_processor.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>

namespace areno::phi4mm {
namespace {

constexpr int64_t kMaxSide = int64_t(1) << 24;  // keeps width*height in range

std::string size_str(int64_t w, int64_t h) { return std::to_string(w) + "x" + std::to_string(h); }

void check_size(int64_t width, int64_t height, const ImageProcessorOptions& opts) {
  if (width <= 0 || height <= 0)
    throw std::invalid_argument("image processor: image is empty (" + size_str(width, height) +
                                "); width and height must be positive");
  if (width > kMaxSide || height > kMaxSide)
    throw std::invalid_argument("image processor: image " + size_str(width, height) +
                                " is absurdly large (a side over " + std::to_string(kMaxSide) + " px)");
  if (opts.max_pixels > 0 && (width > opts.max_pixels || height > opts.max_pixels ||
                              width * height > opts.max_pixels))
    throw std::invalid_argument("image processor: image " + size_str(width, height) + " has more than " +
                                std::to_string(opts.max_pixels) +
                                " pixels (ImageProcessorOptions::max_pixels); downscale it first");
  if (opts.max_crops < 1)
    throw std::invalid_argument("image processor: max_crops must be >= 1 (got " +
                                std::to_string(opts.max_crops) + ")");
}

// (v / 255 - 0.5) / 0.5 in float32, in this exact order (spec 1.6).
const std::array<float, 256>& normalize_lut() {
  static const std::array<float, 256> lut = [] {
    std::array<float, 256> t{};
    for (int v = 0; v < 256; ++v) {
      float x = float(v) / 255.0f;
      x = x - 0.5f;
      x = x / 0.5f;
      t[v] = x;
    }
    return t;
  }();
  return lut;
}

constexpr float kW0 = -0.09375f, kW1 = 0.59375f;  // Keys A=-0.75 at t = 0.5

// 4-tap sum accumulated as PyTorch's CPU bicubic kernel does.
inline float tap4(float v0, float v1, float v2, float v3, bool fma) {
  if (fma) {
    float s = std::fma(v0, kW0, v1 * kW1);
    s = std::fma(v2, kW1, s);
    return std::fma(v3, kW0, s);
  }
  float s = v0 * kW0;
  s = s + v1 * kW1;
  s = s + v2 * kW1;
  return s + v3 * kW0;
}

}  // namespace

std::pair<int64_t, int64_t> choose_crop_grid(int64_t width, int64_t height, int64_t max_crops) {
  if (width <= 0 || height <= 0 || max_crops < 1)
    throw std::invalid_argument("choose_crop_grid: need a positive size and max_crops >= 1 (got " +
                                size_str(width, height) + ", max_crops " + std::to_string(max_crops) + ")");
  const int64_t wc = (width + kCropSize - 1) / kCropSize;
  const int64_t hc = (height + kCropSize - 1) / kCropSize;
  if (wc * hc <= max_crops) return {wc, hc};
  // Aspect-ratio search over (i, j), i*j <= max_crops, ascending i*j.
  std::vector<std::pair<int64_t, int64_t>> cand;
  for (int64_t i = 1; i <= max_crops; ++i)
    for (int64_t j = 1; i * j <= max_crops; ++j) cand.emplace_back(i, j);
  std::stable_sort(cand.begin(), cand.end(),
                   [](const auto& a, const auto& b) { return a.first * a.second < b.first * b.second; });
  const double aspect = double(width) / double(height);
  const double area = double(width) * double(height);
  std::pair<int64_t, int64_t> best{1, 1};
  double best_d = std::numeric_limits<double>::infinity();
  for (const auto& [i, j] : cand) {
    const double d = std::fabs(aspect - double(i) / double(j));
    if (d < best_d) {
      best = {i, j};
      best_d = d;
    } else if (d == best_d && area > 0.5 * double(kCropSize) * double(kCropSize) * double(i) * double(j)) {
      best = {i, j};
    }
  }
  return best;
}

ImageLayout image_layout(int64_t width, int64_t height, const ImageProcessorOptions& opts) {
  check_size(width, height, opts);
  ImageLayout L;
  const int64_t wc = (width + kCropSize - 1) / kCropSize, hc = (height + kCropSize - 1) / kCropSize;
  L.search_path = wc * hc > opts.max_crops;
  std::tie(L.gw, L.gh) = choose_crop_grid(width, height, opts.max_crops);
  L.canvas_w = kCropSize * L.gw;
  L.canvas_h = kCropSize * L.gh;
  // Double arithmetic with truncation, as the reference (spec 1.3).
  const double rw = double(L.canvas_w) / double(width);
  const double rh = double(L.canvas_h) / double(height);
  if (rw < rh) {
    L.new_w = L.canvas_w;
    L.new_h = int64_t(double(height) * rw);
  } else {
    L.new_w = int64_t(double(width) * rh);
    L.new_h = L.canvas_h;
  }
  L.pad_w = L.canvas_w - L.new_w;
  L.pad_h = L.canvas_h - L.new_h;
  if (std::min(L.new_h, L.canvas_h) < 10 || std::min(L.new_w, L.canvas_w) < 10)
    throw std::invalid_argument("image processor: aspect ratio of " + size_str(width, height) +
                                " is too extreme (it would be resized to " + size_str(L.new_w, L.new_h) +
                                "; both sides must be >= 10 px)");
  L.valid_cols = kPatchesPerSide * L.gw - L.pad_w / kPatchSize;
  L.valid_rows = kPatchesPerSide * L.gh - L.pad_h / kPatchSize;
  const int64_t uw = (L.valid_cols + 1) / 2, uh = (L.valid_rows + 1) / 2;
  L.num_tokens = 273 + uh * (uw + 1);
  return L;
}

std::vector<float> normalized_canvas(const RgbImage& resized, int64_t canvas_w, int64_t canvas_h) {
  if (resized.width > canvas_w || resized.height > canvas_h)
    throw std::invalid_argument("normalized_canvas: image " + size_str(resized.width, resized.height) +
                                " does not fit the canvas " + size_str(canvas_w, canvas_h));
  const auto& lut = normalize_lut();
  const size_t plane = size_t(canvas_w) * canvas_h;
  std::vector<float> out(3 * plane, lut[255]);  // white padding
  for (int64_t y = 0; y < resized.height; ++y)
    for (int64_t x = 0; x < resized.width; ++x) {
      const uint8_t* p = resized.rgb.data() + (size_t(y) * resized.width + x) * 3;
      for (int c = 0; c < 3; ++c) out[c * plane + size_t(y) * canvas_w + x] = lut[p[c]];
    }
  return out;
}

std::vector<float> global_thumbnail(const std::vector<float>& canvas, int64_t gw, int64_t gh, bool fma) {
  const int64_t S = kCropSize, W = S * gw, H = S * gh;
  if (gw < 1 || gh < 1 || canvas.size() != size_t(3 * W * H))
    throw std::invalid_argument("global_thumbnail: canvas must be 3 x (448*gh) x (448*gw) floats");
  std::vector<float> out(size_t(3 * S * S));
  std::vector<float> rows(4 * S);  // x-interpolated input rows of one output row
  auto clampi = [](int64_t v, int64_t hi) { return std::min(std::max<int64_t>(v, 0), hi); };
  // x axis: interpolate input row `y` of plane `src` into `dst` (448 values).
  auto x_pass = [&](const float* src, int64_t y, float* dst) {
    const float* row = src + y * W;
    for (int64_t o = 0; o < S; ++o) {
      if (gw % 2 == 1) {
        dst[o] = row[gw * o + (gw - 1) / 2];
      } else {
        const int64_t c = gw * o + gw / 2 - 1;
        dst[o] = tap4(row[clampi(c - 1, W - 1)], row[c], row[clampi(c + 1, W - 1)],
                      row[clampi(c + 2, W - 1)], fma);
      }
    }
  };
  for (int64_t ch = 0; ch < 3; ++ch) {
    const float* src = canvas.data() + ch * W * H;
    float* dst = out.data() + ch * S * S;
    for (int64_t oy = 0; oy < S; ++oy) {
      float* orow = dst + oy * S;
      if (gh % 2 == 1) {
        x_pass(src, gh * oy + (gh - 1) / 2, orow);
        continue;
      }
      const int64_t c = gh * oy + gh / 2 - 1;
      for (int t = 0; t < 4; ++t) x_pass(src, clampi(c - 1 + t, H - 1), rows.data() + t * S);
      for (int64_t o = 0; o < S; ++o)
        orow[o] = tap4(rows[o], rows[S + o], rows[2 * S + o], rows[3 * S + o], fma);
    }
  }
  return out;
}

ProcessedImage process_image(const RgbImage& image, const ImageProcessorOptions& opts) {
  check_size(image.width, image.height, opts);
  if (image.rgb.size() != size_t(image.width * image.height * 3))
    throw std::invalid_argument("image processor: rgb holds " + std::to_string(image.rgb.size()) +
                                " bytes, expected width*height*3 = " +
                                std::to_string(image.width * image.height * 3) + " for " +
                                size_str(image.width, image.height));
  ProcessedImage r;
  const ImageLayout& L = r.layout = image_layout(image.width, image.height, opts);
  const RgbImage resized = pillow_resize_bilinear(image, L.new_w, L.new_h);
  const std::vector<float> canvas = normalized_canvas(resized, L.canvas_w, L.canvas_h);
  const std::vector<float> thumb = global_thumbnail(canvas, L.gw, L.gh, opts.fma_thumbnail);

  const int64_t S = kCropSize, P = kPatchesPerSide, n = L.num_crops();
  r.pixel_values = empty(Shape{1 + n, 3, S, S});
  float* pv = r.pixel_values.data<float>();
  std::copy(thumb.begin(), thumb.end(), pv);
  const size_t plane = size_t(L.canvas_w) * L.canvas_h;
  for (int64_t cr = 0; cr < L.gh; ++cr)
    for (int64_t cc = 0; cc < L.gw; ++cc) {
      float* crop = pv + (1 + cr * L.gw + cc) * 3 * S * S;
      for (int64_t ch = 0; ch < 3; ++ch)
        for (int64_t y = 0; y < S; ++y) {
          const float* src = canvas.data() + ch * plane + size_t(cr * S + y) * L.canvas_w + cc * S;
          std::copy(src, src + S, crop + (ch * S + y) * S);
        }
    }

  r.attention_mask = empty(Shape{1 + n, P, P});
  float* m = r.attention_mask.data<float>();
  std::fill(m, m + P * P, 1.0f);
  for (int64_t cr = 0; cr < L.gh; ++cr)
    for (int64_t cc = 0; cc < L.gw; ++cc) {
      float* mk = m + (1 + cr * L.gw + cc) * P * P;
      for (int64_t y = 0; y < P; ++y)
        for (int64_t x = 0; x < P; ++x)
          mk[y * P + x] = (cr * P + y < L.valid_rows && cc * P + x < L.valid_cols) ? 1.0f : 0.0f;
    }
  r.image_size = from_vector(std::vector<int64_t>{L.canvas_h, L.canvas_w}, Shape{2});
  return r;
}

ImageBatch process_images(const std::vector<RgbImage>& images, const ImageProcessorOptions& opts) {
  if (images.empty()) throw std::invalid_argument("image processor: no images given");
  std::vector<ProcessedImage> per;
  per.reserve(images.size());
  int64_t nmax = 0;
  for (size_t i = 0; i < images.size(); ++i) {
    try {
      per.push_back(process_image(images[i], opts));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("image " + std::to_string(i) + ": " + e.what());
    }
    nmax = std::max(nmax, per.back().pixel_values.size(0));
  }
  const int64_t n = int64_t(images.size()), S = kCropSize, P = kPatchesPerSide;
  ImageBatch b;
  b.input_image_embeds = zeros(Shape{n, nmax, 3, S, S});
  b.image_attention_mask = ones(Shape{n, nmax, P, P});
  std::vector<int64_t> sizes;
  float* px = b.input_image_embeds.data<float>();
  float* mk = b.image_attention_mask.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    const ProcessedImage& p = per[size_t(i)];
    const float* a = p.pixel_values.data<float>();
    std::copy(a, a + p.pixel_values.numel(), px + i * nmax * 3 * S * S);
    const float* am = p.attention_mask.data<float>();
    std::copy(am, am + p.attention_mask.numel(), mk + i * nmax * P * P);
    sizes.push_back(p.layout.canvas_h);
    sizes.push_back(p.layout.canvas_w);
    b.num_img_tokens.push_back(p.layout.num_tokens);
  }
  b.image_sizes = from_vector(sizes, Shape{n, 2});
  return b;
}

}  // namespace areno::phi4mm
