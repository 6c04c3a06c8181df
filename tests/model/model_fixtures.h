#pragma once
// Paths and comparison helpers shared by the model tests.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/init.h"
#include "nn/io/safetensors.h"
#include "tests/test_util.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace areno::testing {

inline const std::string kTinyDir = "tests/data/model/tiny";
inline const std::string kGoldenFile = "tests/data/model/golden.safetensors";

inline const SafetensorsFile& golden() {
  static SafetensorsFile f(kGoldenFile);
  return f;
}
inline Tensor gold(const std::string& name) { return golden().load_copy(name); }
inline std::vector<int64_t> gold_ids(const std::string& name) { return gold(name).to_vector<int64_t>(); }

// max |a - b| / max |b|: the "relative" error used against the goldens.
inline double rel_err(const Tensor& a, const Tensor& b) {
  Tensor bf = b.to(Device::cpu(), DType::f64);
  double scale = max(abs(bf)).item();
  return max_abs_diff(a.to(Device::cpu(), DType::f64), bf) / std::max(scale, 1e-30);
}

// Same shape, dtype and bytes.
inline bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  Tensor ac = a.contiguous(), bc = b.contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()) == 0;
}

// What load_model(dir) throws ("" when it loads).
inline std::string load_error(const std::string& dir) {
  try {
    phi4mm::load_model(dir);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Gives every user adapter weight of `m` random values (normal, std 0.3; B
// included, so the adapter changes the outputs).
inline void randomise_user(phi4mm::Phi4MMForCausalLM& m, uint64_t seed) {
  Generator g(seed);
  NoGradGuard ng;
  for (auto& [name, t] : m.named_parameters())
    if (name.find(".user.") != std::string::npos) t.copy_(rand_normal(t.shape(), g, 0.0, 0.3).to(t.dtype()));
}

// Writes a PEFT adapter folder (save_user_lora_peft) for models of `preset`
// (phi4mm::init_model): rank r, `alpha`, every target, random weights from `seed`.
inline void save_random_peft(const std::string& preset, const std::string& dir, int64_t r, double alpha,
                             uint64_t seed) {
  auto m = phi4mm::init_model(preset, 0);
  phi4mm::LoraConfig c;
  c.r = r;
  c.alpha = alpha;
  c.targets = phi4mm::kLoraTargets;
  m->add_user_lora(c, seed);
  randomise_user(*m, seed);
  phi4mm::save_user_lora_peft(*m, dir);
}

// Adds served LoRA `name` (phi4mm::ServedLora) to `m`: rank r, `alpha`, on
// `targets`, weights normal with std 0.3 from `seed` (B included, so it
// changes the outputs). Returns its number.
inline int32_t add_random_served_lora(phi4mm::Phi4MMForCausalLM& m, const std::string& name, int64_t r, double alpha,
                                      std::vector<std::string> targets, uint64_t seed) {
  phi4mm::LoraConfig c;
  c.r = r;
  c.alpha = alpha;
  c.targets = std::move(targets);
  Generator g(seed);
  return m.add_served_lora(name, "/adapters/" + name, c, [&](std::vector<std::pair<std::string, Tensor>>& ts) {
    NoGradGuard ng;
    for (auto& nt : ts) nt.second.copy_(rand_normal(nt.second.shape(), g, 0.0, 0.3));
  });
}

}  // namespace areno::testing
