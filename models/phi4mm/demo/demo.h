#pragma once
// The embedded demo model (docs/demo.md): what `areno serve`, `generate`,
// `logits` and `train` use without --model-path. It is the tiny preset from
// seed 0 (init_phi4mm("tiny", 0), what `areno init --preset tiny --seed 0
// --dtype f32` writes) with a weight delta applied (nn/io/weight_delta.h):
// the parameters `areno train` changed when scripts/make-demo.sh trained it on
// the synthetic set of examples/demo_data.cpp (arithmetic, the colour or shape
// in an image, beep or noise, loud or quiet). The delta is compiled into the
// program (demo_weights.safetensors, well under 1 MB).
#include <cstdint>
#include <memory>
#include <string_view>

#include "models/phi4mm/model.h"

namespace areno::phi4mm {

inline constexpr const char* kDemoPreset = "tiny";
inline constexpr uint64_t kDemoSeed = 0;

// The demo model in `dtype` (built in f32, the delta applied, then cast).
std::shared_ptr<Phi4MMForCausalLM> demo_model(DType dtype = DType::f32);

// The bytes of demo_weights.safetensors (demo_embed.cpp).
std::string_view embedded_demo_weights();

}  // namespace areno::phi4mm
