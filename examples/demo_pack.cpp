// areno-demo-pack: turns a checkpoint trained from the demo's base (the tiny
// preset from seed 0) into the weight delta the program embeds
// (models/phi4mm/demo/demo_weights.safetensors; docs/demo.md,
// scripts/make-demo.sh).
//
//   areno-demo-pack --model-path STEP_DIR --out FILE
//
// Loads STEP_DIR in f32, computes the delta against init_phi4mm("tiny", 0)
// (nn/io/weight_delta.h), writes it (temp + fsync + rename), reads it back
// and checks that base + delta equals the checkpoint bit for bit.
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/demo/demo.h"
#include "nn/io/safetensors.h"
#include "nn/io/weight_delta.h"

using namespace areno;

int main(int argc, char** argv) {
  constexpr const char* kUsage =
      "usage: areno-demo-pack --model-path STEP_DIR --out FILE\n"
      "\n"
      "Writes the weights STEP_DIR changed relative to the demo's base (the tiny preset\n"
      "from seed 0) as a weight delta, and checks that base + delta equals STEP_DIR.\n";
  try {
    std::string model_path, out;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "-h" || a == "--help") {
        fmt::print("{}", kUsage);
        return 0;
      }
      if (i + 1 >= argc) throw std::invalid_argument(fmt::format("{}: needs a value (or unknown flag)", a));
      if (a == "--model-path") model_path = argv[++i];
      else if (a == "--out") out = argv[++i];
      else throw std::invalid_argument(fmt::format("unknown flag '{}'", a));
    }
    if (model_path.empty() || out.empty()) {
      fmt::print(stderr, "areno-demo-pack: --model-path and --out are required\n\n{}", kUsage);
      return 2;
    }
    phi4mm::LoadOptions lo;
    lo.dtype = DType::f32;
    const auto trained = phi4mm::load_model(model_path, lo);
    const auto base = phi4mm::init_phi4mm(phi4mm::kDemoPreset, phi4mm::kDemoSeed, DType::f32);
    WeightDeltaStats st;
    const auto delta = weight_delta(*base, *trained, &st);
    save_safetensors(out, delta,
                     {{"base", fmt::format("{}:{}", phi4mm::kDemoPreset, phi4mm::kDemoSeed)},
                      {"source", std::filesystem::path(model_path).filename().string()}});
    // Read back and check.
    const auto rebuilt = phi4mm::init_phi4mm(phi4mm::kDemoPreset, phi4mm::kDemoSeed, DType::f32);
    apply_weight_delta(*rebuilt, SafetensorsFile(out));
    WeightDeltaStats check;
    const auto rest = weight_delta(*trained, *rebuilt, &check);
    if (!rest.empty())
      throw std::runtime_error(fmt::format("{}: base + delta differs from {} in {} tensors (first '{}')", out,
                                           model_path, rest.size(), rest.front().first));
    fmt::print(stderr,
               "areno-demo-pack: {} ({} bytes): {} tensors whole, {} row-sparse ({} rows), {} unchanged; "
               "base + delta equals {} bitwise\n",
               out, std::filesystem::file_size(out), st.whole, st.sparse, st.sparse_rows, st.unchanged, model_path);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "areno-demo-pack: {}\n", e.what());
    return 1;
  }
}
