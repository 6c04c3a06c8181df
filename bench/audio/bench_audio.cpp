// Audio-path benchmarks (issue 6, "Benchmarks"):
//   features_30s     log-mel features of 30 s of 16 kHz audio (audio_features)
//   frontend_30s     AudioEmbed::embed (CMVN, NeMo subsampling, Linear) of those
//                    2998 frames at the released widths (conv channels 1024, f32)
//   block_30s        one Conformer block (1024 wide, 16 heads) on the 375 rows
//   encoder_30s_NB   AudioEmbed::encode with N blocks instead of 24 (a check of
//                    frontend + N x block; run.sh extrapolates to 24 blocks)
//   project_30s      the speech projector on the 375 encoder rows
// The weights (random, seed 1) are written to WEIGHTS (released names), so
// bench/audio/peer_torch.py runs transformers' module on the same tensors.
// Prints one JSON object per line: {"bench", "ms" (median), "min_ms", ...}.
// Timing: median of --reps repetitions after one warm-up (the machine is shared).
//
// usage: bench_audio WEIGHTS.safetensors [--reps N] [--blocks N]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "models/phi4mm/audio/audio_features.h"
#include "models/phi4mm/audio/encoder.h"
#include "models/phi4mm/checkpoint.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"

using namespace areno;
using namespace areno::phi4mm;

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::pair<double, double> median_min_ms(const std::function<void()>& f, int reps) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_ms();
    f();
    t.push_back(now_ms() - t0);
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front()};
}

// 30 s of a deterministic test signal (the same formula as peer_torch.py):
// a 200 -> 4000 Hz chirp plus a 440 Hz tone, quantised to int16 / 32768.
std::vector<double> signal_30s() {
  const int64_t n = 480000;
  std::vector<double> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double t = double(i) / 16000.0;
    const double v = 0.3 * std::sin(2 * M_PI * (200.0 * t + (3800.0 / 60.0) * t * t)) + 0.2 * std::sin(2 * M_PI * 440.0 * t);
    x[size_t(i)] = std::rint(v * 32767.0) / 32768.0;
  }
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fmt::print(stderr, "usage: bench_audio WEIGHTS.safetensors [--reps N] [--blocks N]\n");
    return 2;
  }
  const std::string weights = argv[1];
  int reps = 5, blocks = 3;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--reps") reps = std::stoi(argv[i + 1]);
    if (a == "--blocks") blocks = std::stoi(argv[i + 1]);
  }

  const auto x = signal_30s();
  Tensor feats;
  auto [fm, fmin] = median_min_ms([&] { feats = audio_features(x, 16000); }, reps);
  fmt::print("{{\"bench\": \"features_30s\", \"ms\": {:.3f}, \"min_ms\": {:.3f}, \"frames\": {}}}\n", fm, fmin,
             feats.size(0));

  AudioConfig cfg;  // released widths
  cfg.num_blocks = blocks;
  {
    AudioEmbed init(cfg);
    Generator gen(1);
    init_audio_weights(init, gen);
    {
      NoGradGuard ng;  // a realistic CMVN so activations have speech-like scale
      init.global_mean.fill_(12.0);
      init.global_invstd.fill_(0.25);
    }
    save_safetensors(weights, prefixed_tensors(init, kAudioEmbedPrefix, DType::f32));
  }
  SafetensorsCheckpoint ckpt(weights);
  NoGradGuard ng;
  AudioEmbed m(cfg);
  load_prefixed(m, ckpt, kAudioEmbedPrefix, weights);
  Tensor in = feats.unsqueeze(0);
  // Front end (CMVN + subsampling + Linear) and one Conformer block, each timed
  // on its own: 24 blocks = front end + 24 x block (+ the T5 bias, negligible).
  Tensor h;
  auto [fe_ms, fe_min] = median_min_ms([&] { h = m.embed(in); }, reps);
  fmt::print("{{\"bench\": \"frontend_30s\", \"ms\": {:.3f}, \"min_ms\": {:.3f}, \"rows\": {}}}\n", fe_ms, fe_min,
             h.size(1));
  Generator gen(2);
  Tensor bias = rand_normal({1, cfg.attention_heads, h.size(1), h.size(1)}, gen);
  auto [bl_ms, bl_min] = median_min_ms([&] { m.blocks[0]->forward(h, bias, Tensor(), Tensor()); }, reps);
  fmt::print("{{\"bench\": \"block_30s\", \"ms\": {:.3f}, \"min_ms\": {:.3f}}}\n", bl_ms, bl_min);
  AudioEncoderOutput out;
  auto [em, emin] = median_min_ms([&] { out = m.encode(in); }, std::max(1, reps / 2));
  auto head = out.hidden.select(0, 0).select(0, 0).narrow(0, 0, 4).to_vector<double>();
  fmt::print("{{\"bench\": \"encoder_30s_{}b\", \"ms\": {:.3f}, \"min_ms\": {:.3f}, \"rows\": {}, "
             "\"out0_3\": [{:.6f}, {:.6f}, {:.6f}, {:.6f}]}}\n",
             blocks, em, emin, out.hidden.size(1), head[0], head[1], head[2], head[3]);
  auto [pm, pmin] = median_min_ms([&] { m.project(out, AudioProjection::speech); }, reps);
  fmt::print("{{\"bench\": \"project_30s\", \"ms\": {:.3f}, \"min_ms\": {:.3f}}}\n", pm, pmin);
  return 0;
}
