#pragma once
// Paths and comparison helpers shared by the model tests.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>

#include "nn/io/safetensors.h"
#include "tests/test_util.h"
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

}  // namespace areno::testing
