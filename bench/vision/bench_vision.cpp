// Vision-path benchmarks (issue 5, "Benchmarks"), CPU:
//   tower_embed_bN    patch + position embeddings of N 448x448 crops
//   tower_layer_bN    one SigLIP encoder layer at the released widths (1152
//                     wide, 16 heads, MLP 4304), averaged over --layers layers
//   tower_bN          embeddings + --layers layers; per crop
//   tower_full_est    embeddings + 26 layers (the image path's depth),
//                     extrapolated from the two above, per crop
//   preprocess_jpeg   decode_image + process_images of a JPEG file in memory
// Prints one JSON object per line: {"bench", "ms", ...}; ms is per crop for the
// tower rows. Timing: median of --reps repetitions after one warm-up run.
//
// The tower weights are random (init_weights, seed 1, std 0.02) at the
// released widths with --layers layers; --save-weights writes them with their
// checkpoint names so that peer_torch.py runs the same weights.
//
// usage: bench_vision [--layers N] [--reps N] [--save-weights FILE] [--jpeg FILE]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/phi4mm/processor/image_io.h"
#include "models/phi4mm/processor/image_processor.h"
#include "models/phi4mm/vision/vision.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"

using namespace areno;
using namespace areno::phi4mm;

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median_ms(const std::function<void()>& f, int reps) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    double t0 = now_ms();
    f();
    t.push_back(now_ms() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Crops built from the spec's synthetic pixel formula, normalised as the
// processor does; peer_torch.py builds the same ones.
Tensor bench_crops(int64_t n) {
  std::vector<float> v(size_t(n * 3 * 448 * 448));
  size_t i = 0;
  for (int64_t k = 0; k < n; ++k)
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t y = 0; y < 448; ++y)
        for (int64_t x = 0; x < 448; ++x) {
          const int64_t xx = x + 448 * k;
          const int64_t u = c == 0 ? (7 * xx + 3 * y) % 256 : c == 1 ? (xx ^ y) % 256 : (5 * (xx + 2 * y) + xx * y) % 256;
          v[i++] = ((float(u) / 255.0f) - 0.5f) / 0.5f;
        }
  return from_vector(v, {n, 3, 448, 448});
}

}  // namespace

int main(int argc, char** argv) {
  int64_t layers = 2;
  int reps = 5;
  std::string save_path, jpeg_path;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--layers") layers = std::stoll(next());
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--save-weights") save_path = next();
    else if (a == "--jpeg") jpeg_path = next();
    else throw std::invalid_argument("unknown argument " + a);
  }

  VisionConfig c;  // released widths
  c.num_hidden_layers = layers;
  c.feature_layer = -1;  // run every stored layer
  ImageEmbed m(c, DType::f32);
  Generator gen(1);
  init_weights(m, gen, 0.02);
  if (!save_path.empty()) save_safetensors(save_path, image_embed_tensors(m, DType::f32));

  NoGradGuard ng;
  const int64_t P = c.patches_per_side();
  for (int64_t n : {int64_t(1), int64_t(4)}) {
    Tensor crops = bench_crops(n);
    std::vector<int64_t> ids;
    for (int64_t k = 0; k < n; ++k)
      for (int64_t p = 0; p < P * P; ++p) ids.push_back(p);
    Tensor pos = from_vector(ids, {n * P * P});
    PatchMasks no_padding;
    no_padding.crop_padded.assign(size_t(n), false);
    Tensor h0 = m.img_processor->embeddings->forward(crops, pos);
    const double embed = median_ms([&] { h0 = m.img_processor->embeddings->forward(crops, pos); }, reps) / double(n);
    Tensor h;
    const double all = median_ms([&] { h = m.tower(crops); }, reps) / double(n);
    std::vector<double> per;
    for (int64_t l = 0; l < layers; ++l) {
      auto layer = m.img_processor->layers->at<SiglipEncoderLayer>(size_t(l));
      per.push_back(median_ms([&] { layer->forward(h0, no_padding); }, reps) / double(n));
    }
    double layer_ms = 0;
    for (double t : per) layer_ms += t;
    layer_ms /= double(per.size());
    auto first = h.select(0, 0).select(0, 0).narrow(0, 0, 4).to_vector<float>();
    fmt::print("{{\"bench\": \"tower_embed_b{}\", \"ms\": {:.3f}}}\n", n, embed);
    fmt::print("{{\"bench\": \"tower_layer_b{}\", \"ms\": {:.3f}}}\n", n, layer_ms);
    fmt::print("{{\"bench\": \"tower_b{}\", \"ms\": {:.3f}, \"layers\": {}, \"hidden0_3\": [{:.6g}, {:.6g}, {:.6g}, {:.6g}]}}\n",
               n, all, layers, first[0], first[1], first[2], first[3]);
    fmt::print("{{\"bench\": \"tower_full_est_b{}\", \"ms\": {:.1f}, \"layers\": 26}}\n", n, embed + 26 * layer_ms);
    std::fflush(stdout);
  }

  if (!jpeg_path.empty()) {
    std::ifstream f(jpeg_path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot open " + jpeg_path);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    ImageBatch b;
    const double ms = median_ms([&] { b = process_images({decode_image(bytes, jpeg_path)}); }, reps * 2);
    fmt::print("{{\"bench\": \"preprocess_jpeg\", \"ms\": {:.3f}, \"tokens\": {}, \"crops\": {}}}\n", ms,
               b.num_img_tokens[0], b.input_image_embeds.size(1));
  }
  return 0;
}
