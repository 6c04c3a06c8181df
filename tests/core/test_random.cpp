// Seeded random numbers: moments, reproducibility, and the same stream on
// every device for the same (seed, offset).
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "tensor/ops.h"
#include "tests/test_util.h"

using namespace areno;

DEVICE_TEST_CASE("random/uniform and normal have the requested moments") {
  const int64_t n = 200000;
  Generator g(1234);
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    auto u = rand_uniform({n}, g, -2.0, 3.0, TensorOptions(dt, device)).to_vector<double>();
    double s = 0, ss = 0, lo = 1e9, hi = -1e9;
    for (double x : u) s += x, ss += x * x, lo = std::min(lo, x), hi = std::max(hi, x);
    double mean = s / n, var = ss / n - mean * mean;
    CHECK(mean == doctest::Approx(0.5).epsilon(0.02));
    CHECK(var == doctest::Approx(25.0 / 12.0).epsilon(0.02));
    CHECK(lo >= -2.0);
    CHECK(hi <= 3.0);
    auto z = rand_normal({n}, g, 1.0, 0.5, TensorOptions(dt, device)).to_vector<double>();
    s = ss = 0;
    for (double x : z) s += x, ss += x * x;
    mean = s / n, var = ss / n - mean * mean;
    CHECK(mean == doctest::Approx(1.0).epsilon(0.01));
    CHECK(std::sqrt(var) == doctest::Approx(0.5).epsilon(0.02));
  }
}

DEVICE_TEST_CASE("random/same seed same numbers, draws advance the offset") {
  Generator a(7), b(7);
  auto x1 = rand_normal({1001}, a, 0, 1, TensorOptions(DType::f32, device)).to_vector<float>();
  CHECK(a.offset() >= 1001);
  auto x2 = rand_normal({1001}, a, 0, 1, TensorOptions(DType::f32, device)).to_vector<float>();
  auto y1 = rand_normal({1001}, b, 0, 1, TensorOptions(DType::f32, device)).to_vector<float>();
  CHECK(x1 == y1);
  CHECK(x1 != x2);
}

TEST_CASE("random/a CUDA device draws the CPU's stream" *
          doctest::skip(!areno::testing::has_cuda())) {
  const Device device = Device::cuda(0);
  Generator a(99), b(99);
  auto c = rand_uniform({4099}, a, 0, 1, TensorOptions(DType::f32, Device::cpu())).to_vector<float>();
  auto d = rand_uniform({4099}, b, 0, 1, TensorOptions(DType::f32, device)).to_vector<float>();
  REQUIRE(c.size() == d.size());
  int64_t differ = 0;
  for (size_t i = 0; i < c.size(); ++i) differ += std::abs(c[i] - d[i]) > 1e-6f;
  CHECK(differ == 0);
  CHECK(a.offset() == b.offset());
}
