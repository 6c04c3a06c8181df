#pragma once
// Phi-4-multimodal image processor (the released `Phi4MMImageProcessor`),
// reproduced bit for bit on the CPU: crop-grid choice, Pillow 8-bit BILINEAR
// resize, white right/bottom padding, float32 normalisation, per-crop patch
// masks, the bicubic global thumbnail and the token count.
// Spec: vision.md sections 1-2 and 12 (the project's shared spec folder).
#include <cstdint>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace areno::phi4mm {

// 8-bit RGB image, row-major HWC: rgb[(y * width + x) * 3 + c].
struct RgbImage {
  int64_t width = 0;
  int64_t height = 0;
  std::vector<uint8_t> rgb;
};

struct ImageProcessorOptions {
  int64_t max_crops = 36;  // `dynamic_hd` of preprocessor_config.json
  // Inputs with more pixels are rejected before any allocation (Pillow's
  // decompression-bomb error threshold is 2 * 89478485).
  int64_t max_pixels = 178956970;
  // Thumbnail accumulation: fused multiply-add as PyTorch's AVX2/AVX512 CPU
  // kernel (the usual reference), or plain float32 ops as its DEFAULT kernel.
  bool fma_thumbnail = true;
};

inline constexpr int64_t kCropSize = 448;

// The default options with max_crops (a model's dynamic_hd).
inline ImageProcessorOptions image_options(int64_t max_crops) {
  ImageProcessorOptions o;
  o.max_crops = max_crops;
  return o;
}
inline constexpr int64_t kPatchSize = 14;
inline constexpr int64_t kPatchesPerSide = kCropSize / kPatchSize;  // 32

// Everything about an image that follows from its size alone (spec 1.2, 1.3,
// 1.7, 2.1).
struct ImageLayout {
  int64_t gw = 0, gh = 0;          // crop grid: columns, rows
  bool search_path = false;        // grid from the aspect-ratio search
  int64_t canvas_w = 0, canvas_h = 0;  // 448 * gw, 448 * gh
  int64_t new_w = 0, new_h = 0;    // resized image, placed at the top-left
  int64_t pad_w = 0, pad_h = 0;    // white padding right / bottom
  int64_t valid_cols = 0, valid_rows = 0;  // unmasked patches of the full canvas
  int64_t num_tokens = 0;          // 273 + uh * (uw + 1)
  int64_t num_crops() const { return gw * gh; }  // HD crops, global excluded
};

// Crop grid (columns, rows) for a W x H image (spec 1.2).
std::pair<int64_t, int64_t> choose_crop_grid(int64_t width, int64_t height, int64_t max_crops = 36);
// Throws std::invalid_argument for empty, oversized or too extreme images.
ImageLayout image_layout(int64_t width, int64_t height, const ImageProcessorOptions& opts = {});
inline int64_t num_image_tokens(int64_t width, int64_t height, const ImageProcessorOptions& opts = {}) {
  return image_layout(width, height, opts).num_tokens;
}

// Pillow `Image.resize((new_w, new_h), BILINEAR)` on 8-bit RGB (libImaging
// Resample.c, fixed point with 22 fractional bits). Same size -> copy.
RgbImage pillow_resize_bilinear(const RgbImage& src, int64_t new_w, int64_t new_h);

// One processed image.
struct ProcessedImage {
  ImageLayout layout;
  Tensor pixel_values;    // [1 + n_crops, 3, 448, 448] f32; 0 = global thumbnail
  Tensor attention_mask;  // [1 + n_crops, 32, 32] f32 (1 = real patch); global all ones
  Tensor image_size;      // [2] i64: [Hc, Wc] of the padded canvas
};
ProcessedImage process_image(const RgbImage& image, const ImageProcessorOptions& opts = {});

// Several images, batched as the released processor does (spec 1.9): crops
// padded to the largest count with zero pixels and all-ones masks.
struct ImageBatch {
  Tensor input_image_embeds;    // [n_images, Nmax, 3, 448, 448] f32
  Tensor image_sizes;           // [n_images, 2] i64, [Hc, Wc]
  Tensor image_attention_mask;  // [n_images, Nmax, 32, 32] f32
  std::vector<int64_t> num_img_tokens;
};
ImageBatch process_images(const std::vector<RgbImage>& images, const ImageProcessorOptions& opts = {});

// Building blocks, exposed for tests.
// Normalised padded canvas [3, Hc, Wc] (CHW): (v / 255 - 0.5) / 0.5 in float32.
std::vector<float> normalized_canvas(const RgbImage& resized, int64_t canvas_w, int64_t canvas_h);
// Bicubic (A = -0.75, half-pixel, no antialias, no clamp) of a 3 x (448 gh) x
// (448 gw) canvas to 3 x 448 x 448, using the exact closed form of spec 1.8.
std::vector<float> global_thumbnail(const std::vector<float>& canvas, int64_t gw, int64_t gh, bool fma);

}  // namespace areno::phi4mm
