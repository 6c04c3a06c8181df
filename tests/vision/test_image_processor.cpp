// Phi-4-multimodal image processor against the released processor's outputs
// (tests/data/vision/vision-golden.json) and the worked examples of the
// vision spec (sections 1.2, 1.6, 2.2, 2.3).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/phi4mm/processor/image_processor.h"
#include "tests/sha256.h"

using namespace areno;
using namespace areno::phi4mm;
using areno::testing::sha256_hex;

namespace {

// The golden file's synthetic image: R=(7x+3y), G=x^y, B=5(x+2y)+x*y, mod 256.
RgbImage synthetic_image(int64_t w, int64_t h) {
  RgbImage im{w, h, std::vector<uint8_t>(size_t(w * h * 3))};
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x) {
      uint8_t* p = im.rgb.data() + (y * w + x) * 3;
      p[0] = uint8_t((7 * x + 3 * y) % 256);
      p[1] = uint8_t((x ^ y) % 256);
      p[2] = uint8_t((5 * (x + 2 * y) + x * y) % 256);
    }
  return im;
}

nlohmann::json load_golden() {
  const std::string path = "tests/data/vision/vision-golden.json";
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open " + path + " (run from the repository root)");
  return nlohmann::json::parse(f);
}

std::string sha_floats(const float* p, size_t n) { return sha256_hex(p, n * sizeof(float)); }

// Extended-precision sum, so comparing against the golden sums does not depend
// on the summation order used to make them.
double sum_floats(const float* p, size_t n) {
  long double s = 0;
  for (size_t i = 0; i < n; ++i) s += p[i];
  return double(s);
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

TEST_CASE("vision/sha256 known answers") {
  CHECK(sha256_hex("", 0) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_hex("abc", 3) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // 56 bytes: 2 blocks
  CHECK(sha256_hex(two.data(), two.size()) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST_CASE("vision/golden processor outputs are bit-exact") {
  const nlohmann::json g = load_golden();
  int cases = 0, exact_crops = 0, exact_fma = 0, exact_nofma = 0;
  for (const auto& c : g.at("cases")) {
    const int64_t W = c.at("W"), H = c.at("H");
    CAPTURE(W);
    CAPTURE(H);
    const RgbImage im = synthetic_image(W, H);
    const ProcessedImage p = process_image(im);
    const ImageLayout& L = p.layout;
    const int64_t n = c.at("n_crops");
    CHECK(L.num_crops() == n);
    CHECK(L.num_tokens == c.at("tokens").get<int64_t>());
    CHECK(num_image_tokens(W, H) == c.at("tokens").get<int64_t>());
    const std::vector<int64_t> sizes = p.image_size.to_vector<int64_t>();
    CHECK(sizes == c.at("image_sizes").get<std::vector<int64_t>>());
    REQUIRE(p.pixel_values.shape() == Shape{1 + n, 3, 448, 448});
    REQUIRE(p.attention_mask.shape() == Shape{1 + n, 32, 32});

    const float* pv = p.pixel_values.data<float>();
    const size_t crop = 3 * 448 * 448;
    const std::string crops_sha = sha_floats(pv + crop, size_t(n) * crop);
    CHECK(crops_sha == c.at("crops_f32_sha256").get<std::string>());
    CHECK(std::fabs(sum_floats(pv + crop, size_t(n) * crop) - c.at("crops_sum").get<double>()) < 1e-6);
    const float* m = p.attention_mask.data<float>();
    CHECK(sha_floats(m, size_t(p.attention_mask.numel())) == c.at("mask_f32_sha256").get<std::string>());
    CHECK(sum_floats(m, size_t(p.attention_mask.numel())) == c.at("mask_valid_patches").get<double>());

    // FMA thumbnail (the default) is crop 0.
    const std::string fma_sha = sha_floats(pv, crop);
    CHECK(fma_sha == c.at("global_f32_sha256_fma").get<std::string>());
    // The FMA and no-FMA sums differ by ~1e-4, far above this tolerance.
    CHECK(std::fabs(sum_floats(pv, crop) - c.at("global_sum_fma").get<double>()) < 1e-6);
    const auto& spot = c.at("global_spot_fma");
    CHECK(pv[0] == spot.at("c0_r0_c0").get<float>());
    CHECK(pv[448 * 448 + 100 * 448 + 200] == spot.at("c1_r100_c200").get<float>());
    CHECK(pv[2 * 448 * 448 + 447 * 448 + 447] == spot.at("c2_r447_c447").get<float>());

    // Plain float32 (no FMA) thumbnail from the same canvas.
    const RgbImage resized = pillow_resize_bilinear(im, L.new_w, L.new_h);
    const std::vector<float> canvas = normalized_canvas(resized, L.canvas_w, L.canvas_h);
    const std::vector<float> plain = global_thumbnail(canvas, L.gw, L.gh, /*fma=*/false);
    const std::string nofma_sha = sha_floats(plain.data(), plain.size());
    CHECK(nofma_sha == c.at("global_f32_sha256_nofma").get<std::string>());
    CHECK(std::fabs(sum_floats(plain.data(), plain.size()) - c.at("global_sum_nofma").get<double>()) < 1e-6);
    const auto& spot_p = c.at("global_spot_nofma");
    CHECK(plain[0] == spot_p.at("c0_r0_c0").get<float>());
    CHECK(plain[448 * 448 + 100 * 448 + 200] == spot_p.at("c1_r100_c200").get<float>());

    ++cases;
    exact_crops += crops_sha == c.at("crops_f32_sha256").get<std::string>();
    exact_fma += fma_sha == c.at("global_f32_sha256_fma").get<std::string>();
    exact_nofma += nofma_sha == c.at("global_f32_sha256_nofma").get<std::string>();
  }
  MESSAGE("golden cases: " << cases << ", crops bit-exact " << exact_crops << ", FMA thumbnail "
                           << exact_fma << ", no-FMA thumbnail " << exact_nofma);
  CHECK(cases == 20);
}

TEST_CASE("vision/padded uint8 canvas matches the spec's test vectors") {
  // Spec section 12: first 16 hex digits of SHA-256 over the padded canvas
  // uint8 [Hc, Wc, 3] (white right/bottom padding); isolates the resize.
  struct V {
    int64_t w, h;
    const char* sha16;
  };
  const V vs[] = {{1000, 750, "19714060ee1222a8"},
                  {500, 100, "adec102814c6307b"},
                  {45, 80, "b7a22f1c07229f3e"},
                  {448, 448, "c4ab0d675f4408e7"},
                  {4032, 3024, "6ac223362965b26e"}};
  for (const V& v : vs) {
    CAPTURE(v.w);
    CAPTURE(v.h);
    const ImageLayout L = image_layout(v.w, v.h);
    const RgbImage r = pillow_resize_bilinear(synthetic_image(v.w, v.h), L.new_w, L.new_h);
    REQUIRE(r.width == L.new_w);
    REQUIRE(r.height == L.new_h);
    std::vector<uint8_t> canvas(size_t(L.canvas_w * L.canvas_h * 3), 255);
    for (int64_t y = 0; y < r.height; ++y)
      std::memcpy(canvas.data() + y * L.canvas_w * 3, r.rgb.data() + y * r.width * 3, size_t(r.width * 3));
    CHECK(sha256_hex(canvas.data(), canvas.size()).substr(0, 16) == v.sha16);
  }
}

TEST_CASE("vision/worked examples of spec section 2.2") {
  struct Ex {
    int64_t w, h, gw, gh, new_w, new_h, pad_w, pad_h, valid_cols, valid_rows, tokens;
    bool search;
  };
  const Ex ex[] = {
      {448, 448, 1, 1, 448, 448, 0, 0, 32, 32, 545, false},
      {45, 80, 1, 1, 251, 448, 197, 0, 18, 32, 433, false},
      {500, 100, 2, 1, 896, 179, 0, 269, 64, 13, 504, false},
      {449, 447, 2, 1, 450, 448, 446, 0, 33, 32, 561, false},
      {640, 480, 2, 2, 896, 672, 0, 224, 64, 48, 1065, false},
      {1000, 750, 3, 2, 1194, 896, 150, 0, 86, 64, 1681, false},
      {1344, 896, 3, 2, 1344, 896, 0, 0, 96, 64, 1841, false},
      {1920, 1080, 5, 3, 2240, 1260, 0, 84, 160, 90, 3918, false},
      {300, 2000, 1, 5, 336, 2240, 112, 0, 24, 160, 1313, false},
      {2000, 1000, 5, 3, 2240, 1120, 0, 224, 160, 80, 3513, false},
      {4032, 3024, 4, 3, 1792, 1344, 0, 0, 128, 96, 3393, true},
      {6000, 4000, 6, 4, 2688, 1792, 0, 0, 192, 128, 6481, true},
      {5000, 2500, 8, 4, 3584, 1792, 0, 0, 256, 128, 8529, true},
      {4480, 4480, 6, 6, 2688, 2688, 0, 0, 192, 192, 9585, true},
      {7500, 1000, 15, 2, 6720, 896, 0, 0, 480, 64, 7985, true},
      {12000, 300, 27, 1, 12096, 302, 0, 146, 864, 22, 5036, false},
      {448, 16128, 1, 36, 448, 16128, 0, 0, 32, 1152, 10065, false},
      {16128, 448, 36, 1, 16128, 448, 0, 0, 1152, 32, 9505, false},
  };
  for (const Ex& e : ex) {
    CAPTURE(e.w);
    CAPTURE(e.h);
    const ImageLayout L = image_layout(e.w, e.h);
    CHECK(L.gw == e.gw);
    CHECK(L.gh == e.gh);
    CHECK(L.search_path == e.search);
    CHECK(L.canvas_w == 448 * e.gw);
    CHECK(L.canvas_h == 448 * e.gh);
    CHECK(L.new_w == e.new_w);
    CHECK(L.new_h == e.new_h);
    CHECK(L.pad_w == e.pad_w);
    CHECK(L.pad_h == e.pad_h);
    CHECK(L.valid_cols == e.valid_cols);
    CHECK(L.valid_rows == e.valid_rows);
    CHECK(L.num_tokens == e.tokens);
  }
}

TEST_CASE("vision/crop grid search and token bounds") {
  using G = std::pair<int64_t, int64_t>;
  CHECK(choose_crop_grid(4032, 3024) == G{4, 3});
  CHECK(choose_crop_grid(6000, 4000) == G{6, 4});
  CHECK(choose_crop_grid(5000, 2500) == G{8, 4});
  CHECK(choose_crop_grid(4480, 4480) == G{6, 6});
  CHECK(choose_crop_grid(7500, 1000) == G{15, 2});
  CHECK(choose_crop_grid(1000, 750) == G{3, 2});
  // Small max_crops forces the search for a 2x2 ceil grid.
  CHECK(choose_crop_grid(800, 800, 3) == G{1, 1});
  // dynamic_hd 4 (spec 1.2 with MAX = 4, worked by hand): 4032x3024 and
  // 1000x750 tie (1,1) with (2,2) and are big enough for more crops; 800x500
  // takes the ceil path; 2000x500 matches 4:1 exactly; 1 crop at most: (1,1).
  CHECK(choose_crop_grid(4032, 3024, 4) == G{2, 2});
  CHECK(choose_crop_grid(1000, 750, 4) == G{2, 2});
  CHECK(choose_crop_grid(800, 500, 4) == G{2, 2});
  CHECK(choose_crop_grid(2000, 500, 4) == G{4, 1});
  CHECK(choose_crop_grid(4032, 3024, 1) == G{1, 1});
  // Fewer crops, fewer tokens: 273 + uh * (uw + 1) on the smaller canvas.
  CHECK(num_image_tokens(4032, 3024, image_options(4)) < num_image_tokens(4032, 3024));
  // The figures docs/serving.md gives: 1344x896 at 36 and at 2.
  CHECK(image_layout(1344, 896).num_tokens == 1841);
  CHECK(image_layout(1344, 896, image_options(2)).num_tokens == 673);
  CHECK(choose_crop_grid(1344, 896, 2) == G{2, 1});
  CHECK(num_image_tokens(4032, 3024, image_options(1)) == image_layout(4032, 3024, image_options(1)).num_tokens);
  for (int64_t max = 1; max <= 12; ++max) {
    const auto [gw, gh] = choose_crop_grid(3000, 1700, max);
    CHECK(gw * gh <= max);
  }
  // Section 2.3: minimum 290, 10x448 gives 305, 448x9 is rejected.
  CHECK(num_image_tokens(448, 10) == 290);
  CHECK(num_image_tokens(10, 448) == 305);
  CHECK_THROWS_WITH_AS(image_layout(448, 9), doctest::Contains("too extreme"), std::invalid_argument);
  // The worst case over a sweep stays within the documented bounds.
  int64_t lo = 1 << 30, hi = 0;
  for (int64_t w = 10; w <= 20000; w += 397)
    for (int64_t h = 10; h <= 20000; h += 401) {
      try {
        const int64_t t = num_image_tokens(w, h);
        lo = std::min(lo, t);
        hi = std::max(hi, t);
      } catch (const std::invalid_argument&) {
      }
    }
  CHECK(lo >= 290);
  CHECK(hi <= 10065);
}

TEST_CASE("vision/normalisation bit patterns") {
  RgbImage im{4, 1, {0, 1, 127, 128, 255, 0, 0, 0, 0, 0, 0, 0}};
  const std::vector<float> c = normalized_canvas(im, 448, 448);
  const size_t plane = 448 * 448;
  CHECK(c[0] == -1.0f);                  // R of pixel 0: v = 0
  CHECK(bits(c[plane]) == 0xBF7DFDFEu);  // G of pixel 0: v = 1
  CHECK(bits(c[2 * plane]) == 0xBB808080u);  // B of pixel 0: v = 127
  CHECK(bits(c[1]) == 0x3B808100u);      // R of pixel 1: v = 128
  CHECK(c[plane + 1] == 1.0f);           // G of pixel 1: v = 255
  CHECK(c[5] == 1.0f);                   // white padding
  CHECK(c[3 * plane - 1] == 1.0f);
}

TEST_CASE("vision/pillow resize invariants") {
  // A constant image stays constant under any resize (weights sum to 1).
  RgbImage flat{37, 23, std::vector<uint8_t>(37 * 23 * 3)};
  for (size_t i = 0; i < flat.rgb.size(); ++i) flat.rgb[i] = uint8_t(i % 3 == 0 ? 200 : i % 3 == 1 ? 17 : 255);
  for (auto [w, h] : {std::pair<int64_t, int64_t>{448, 300}, {5, 7}, {37, 100}, {90, 23}}) {
    const RgbImage r = pillow_resize_bilinear(flat, w, h);
    REQUIRE(r.rgb.size() == size_t(w * h * 3));
    for (size_t i = 0; i < r.rgb.size(); ++i)
      if (r.rgb[i] != flat.rgb[i % 3]) FAIL("resize of a constant image changed value " << i);
  }
  // Same size is a copy; a 2x horizontal upscale of [0, 255] follows Pillow's taps.
  const RgbImage s = synthetic_image(13, 9);
  CHECK(pillow_resize_bilinear(s, 13, 9).rgb == s.rgb);
  RgbImage two{2, 1, {0, 0, 0, 255, 255, 255}};
  const RgbImage up = pillow_resize_bilinear(two, 4, 1);
  // centers 0.25, 0.75, 1.25, 1.75 -> weights of pixel 1: 0, 0.25, 0.75, 1
  CHECK(up.rgb[0] == 0);
  CHECK(up.rgb[3] == 64);   // 63.75 rounded by the fixed-point sum
  CHECK(up.rgb[6] == 191);  // 191.25
  CHECK(up.rgb[9] == 255);
}

TEST_CASE("vision/batching pads with zero crops and all-ones masks") {
  const ImageBatch b = process_images({synthetic_image(500, 100), synthetic_image(1000, 750)});
  REQUIRE(b.input_image_embeds.shape() == Shape{2, 7, 3, 448, 448});
  REQUIRE(b.image_attention_mask.shape() == Shape{2, 7, 32, 32});
  CHECK(b.image_sizes.to_vector<int64_t>() == std::vector<int64_t>{448, 896, 896, 1344});
  CHECK(b.num_img_tokens == std::vector<int64_t>{504, 1681});
  const float* px = b.input_image_embeds.data<float>();
  const size_t crop = 3 * 448 * 448;
  // Image 0 has 3 real crops; crops 3..6 are zero padding with all-ones masks.
  double pad_abs = 0;
  for (size_t i = 3 * crop; i < 7 * crop; ++i) pad_abs += std::fabs(px[i]);
  CHECK(pad_abs == 0.0);
  const float* mk = b.image_attention_mask.data<float>();
  CHECK(sum_floats(mk + 3 * 1024, 4 * 1024) == 4 * 1024);
  // Image 1 equals its single-image result.
  const ProcessedImage p = process_image(synthetic_image(1000, 750));
  CHECK(std::memcmp(px + 7 * crop, p.pixel_values.data<float>(), 7 * crop * sizeof(float)) == 0);
}

TEST_CASE("vision/bad input gives clear errors") {
  CHECK_THROWS_WITH_AS(process_image(RgbImage{0, 0, {}}), doctest::Contains("empty"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(image_layout(0, 0), doctest::Contains("empty"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(image_layout(-5, 10), doctest::Contains("positive"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(process_image(RgbImage{4, 4, std::vector<uint8_t>(10)}),
                       doctest::Contains("expected width*height*3 = 48"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(image_layout(100000, 100000), doctest::Contains("max_pixels"), std::invalid_argument);
  ImageProcessorOptions small;
  small.max_pixels = 1000;
  CHECK_THROWS_WITH_AS(image_layout(40, 30, small), doctest::Contains("more than 1000 pixels"),
                       std::invalid_argument);
  CHECK(image_layout(40, 25, small).num_tokens > 0);
  CHECK_THROWS_WITH_AS(image_layout(int64_t(1) << 40, 1), doctest::Contains("absurdly large"),
                       std::invalid_argument);
  CHECK_THROWS_AS(process_images({}), std::invalid_argument);
  CHECK_THROWS_WITH_AS(process_images({synthetic_image(8, 8), RgbImage{0, 3, {}}}),
                       doctest::Contains("image 1: "), std::invalid_argument);
}
