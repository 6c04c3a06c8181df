// The skinny GEMM kernels (kernels/cpu/gemm_skinny.h; issue 16, must-show 4):
// every dispatch level this CPU runs, f32 and bf16 weights, f32 and bf16
// outputs, odd M / N / K (tails of every tile and vector width), alpha and
// beta, against an f64 loop over the same (bf16-rounded) values; and the
// matmul op's routing of linear layers through it around kSkinnyMaxRows;
// the bf16 GEMM through oneDNN (gemm_dnnl.h) against the Eigen path.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/gemm_dnnl.h"
#include "kernels/cpu/gemm_skinny.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

using namespace areno;
using namespace areno::cpu;

namespace {

std::vector<float> values(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (auto& x : v) x = float(double(splitmix64(seed++) >> 11) * 0x1p-53 * 2.0 - 1.0);
  return v;
}

// Restores the dispatch level a test case changed.
struct IsaGuard {
  CpuIsa saved = cpu_isa();
  ~IsaGuard() { set_cpu_isa(saved); }
};

std::vector<CpuIsa> levels() {
  std::vector<CpuIsa> l;
  for (CpuIsa i : {CpuIsa::generic, CpuIsa::avx2, CpuIsa::avx512})
    if (i <= cpu_isa_supported()) l.push_back(i);
  return l;
}

// out = alpha x w^T + beta out0 through gemm_skinny<W, O>, checked against f64
// sums of the values as the kernel sees them (bf16 weights rounded first).
template <typename W, typename O>
void check_shape(int64_t M, int64_t N, int64_t K, float alpha, float beta, uint64_t seed) {
  CAPTURE(M);
  CAPTURE(N);
  CAPTURE(K);
  CAPTURE(beta);
  const int64_t ldx = K + 3, ldw = K + 5, ldo = N + 2;  // strides past the row ends
  std::vector<float> x = values(size_t(M * ldx), seed), wf = values(size_t(N * ldw), seed + 1000);
  std::vector<W> w(wf.begin(), wf.end());
  std::vector<float> o0 = values(size_t(M * ldo), seed + 2000);
  std::vector<O> out(o0.begin(), o0.end());
  gemm_skinny<W, O>(M, N, K, x.data(), ldx, w.data(), ldw, out.data(), ldo, alpha, beta);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = double(x[size_t(m * ldx + k)]) * double(float(w[size_t(n * ldw + k)]));
        s += p, mag += std::fabs(p);
      }
      const double init = double(float(O(o0[size_t(m * ldo + n)])));
      const double want = alpha * s + (beta != 0 ? beta * init : 0.0);
      double tol = 1e-6 * (std::fabs(alpha) * mag + std::fabs(beta * init)) + 1e-7;
      if (sizeof(O) == 2) tol += std::fabs(want) * 0x1p-8;  // one bf16 rounding of the result
      const double got = double(float(out[size_t(m * ldo + n)]));
      if (std::fabs(got - want) > tol) {
        FAIL_CHECK("m " << m << " n " << n << ": got " << got << " want " << want << " tol " << tol);
        return;
      }
    }
  // Columns past N in each output row stay as they were.
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = N; n < ldo; ++n) REQUIRE(float(out[size_t(m * ldo + n)]) == float(O(o0[size_t(m * ldo + n)])));
}

}  // namespace

TEST_CASE("gemm_skinny: every level, f32 and bf16 weights, odd shapes, alpha and beta, against f64") {
  IsaGuard guard;
  for (CpuIsa isa : levels()) {
    const std::string level = cpu_isa_name(isa);
    CAPTURE(level);
    REQUIRE(set_cpu_isa(isa) == isa);
    uint64_t seed = 1;
    for (int64_t M : {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32})
      for (int64_t N : {1, 3, 4, 8, 9, 17, 67})
        for (int64_t K : {1, 7, 8, 15, 16, 17, 33, 259}) {
          check_shape<float, float>(M, N, K, 1.0f, 0.0f, seed++);
          check_shape<BFloat16, BFloat16>(M, N, K, 1.0f, 0.0f, seed++);
        }
    for (int64_t M : {1, 5})
      for (int64_t N : {9, 67}) {
        check_shape<float, float>(M, N, 259, 0.5f, 2.0f, seed++);
        check_shape<BFloat16, float>(M, N, 259, -1.5f, 1.0f, seed++);
        check_shape<BFloat16, BFloat16>(M, N, 259, 0.5f, -1.0f, seed++);
        check_shape<float, BFloat16>(M, N, 33, 1.0f, 1.0f, seed++);
      }
  }
}

TEST_CASE("gemm_skinny: the levels agree with each other and the result does not depend on the thread split") {
  IsaGuard guard;
  const int64_t M = 5, N = 1000, K = 300;
  std::vector<float> x = values(size_t(M * K), 7), w = values(size_t(N * K), 8);
  std::vector<float> first;
  for (CpuIsa isa : levels()) {
    set_cpu_isa(isa);
    std::vector<float> out(size_t(M * N)), one(size_t(M * N));
    gemm_skinny<float, float>(M, N, K, x.data(), K, w.data(), K, out.data(), N, 1.0f, 0.0f);
    // Inside a parallel region the kernel runs on one thread: same bits.
#pragma omp parallel num_threads(2)
    {
#pragma omp single
      gemm_skinny<float, float>(M, N, K, x.data(), K, w.data(), K, one.data(), N, 1.0f, 0.0f);
    }
    CHECK(out == one);
    if (first.empty()) first = out;
    for (size_t i = 0; i < out.size(); ++i) REQUIRE(std::fabs(out[i] - first[i]) <= 1e-5f * (1 + std::fabs(first[i])));
  }
}

TEST_CASE("gemm_skinny: linear() routes up to kSkinnyMaxRows rows through it, both dtypes, every level") {
  IsaGuard guard;
  const int64_t K = 67, N = 2100;
  std::vector<float> wv = values(size_t(N * K), 50);
  Tensor w32 = from_vector<float>(wv, Shape{N, K});
  Tensor w16 = w32.to(DType::bf16);
  for (CpuIsa isa : levels()) {
    const std::string level = cpu_isa_name(isa);
    CAPTURE(level);
    set_cpu_isa(isa);
    for (int64_t M : {int64_t(1), int64_t(4), int64_t(13), kSkinnyMaxRows, kSkinnyMaxRows + 1}) {
      CAPTURE(M);
      Tensor x = from_vector<float>(values(size_t(M * K), 60 + uint64_t(M)), Shape{M, K});
      Tensor want = linear(x.to(DType::f64), w32.to(DType::f64), Tensor());
      Tensor got32 = linear(x, w32, Tensor()).to(DType::f64);
      CHECK(max_abs_diff(got32, want) < 2e-5);
      // bf16: activations rounded to bf16 as the op's inputs are, result rounded once.
      Tensor want16 = linear(x.to(DType::bf16).to(DType::f64), w16.to(DType::f64), Tensor());
      Tensor got16 = linear(x.to(DType::bf16), w16, Tensor()).to(DType::f64);
      const std::vector<double> g = got16.to_vector<double>(), v = want16.to_vector<double>();
      double worst = 0;  // beyond one bf16 rounding of the result (2^-8 relative, halfway included)
      for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::fabs(g[i] - v[i]) - std::fabs(v[i]) * 0x1p-8);
      CHECK(worst < 1e-5);
    }
  }
}

TEST_CASE("gemm_dnnl: bf16 GEMMs above the skinny rows through oneDNN equal the widened f32 path within bf16 rounding") {
  struct Restore {
    bool saved = dnnl_enabled();
    ~Restore() { set_dnnl_enabled(saved); }
  } restore;
  const bool have = set_dnnl_enabled(true);
  const std::string built = have ? "yes" : "no";
  MESSAGE("oneDNN in this build: " << built);
  if (have) {  // the call itself succeeds (it returns false only when it ran nothing)
    std::vector<BFloat16> a(6, BFloat16(1.0f)), b(6, BFloat16(2.0f)), o(4);
    REQUIRE(dnnl_gemm_bf16(2, 2, 3, a.data(), 3, 1, b.data(), 2, 1, o.data(), 2));
    for (BFloat16 v : o) CHECK(float(v) == 6.0f);
  }
  for (auto [M, N, K] : {std::array<int64_t, 3>{33, 67, 259}, {100, 1000, 17}, {513, 31, 300}}) {
    CAPTURE(M);
    CAPTURE(N);
    CAPTURE(K);
    Tensor x = from_vector<float>(values(size_t(M * K), 70 + uint64_t(M)), Shape{M, K}).to(DType::bf16);
    Tensor w = from_vector<float>(values(size_t(N * K), 80 + uint64_t(N)), Shape{N, K}).to(DType::bf16);
    const std::vector<double> want = linear(x.to(DType::f64), w.to(DType::f64), Tensor()).to_vector<double>();
    // Transposed weight (linear), a plain [K, N] operand and a transposed activation.
    const Tensor xt = x.t().contiguous().t();
    for (const Tensor& got : {linear(x, w, Tensor()), matmul(x, w.t().contiguous()), linear(xt, w, Tensor())}) {
      const std::vector<double> g = got.to(DType::f64).to_vector<double>();
      REQUIRE(g.size() == want.size());
      double worst = 0;
      for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::fabs(g[i] - want[i]) - std::fabs(want[i]) * 0x1p-8);
      CHECK(worst < 1e-4);
    }
    set_dnnl_enabled(false);
    const Tensor off = linear(x, w, Tensor());
    set_dnnl_enabled(true);
    // Both paths round one f32 sum to bf16: they differ by at most one bf16 step.
    const std::vector<double> a = off.to(DType::f64).to_vector<double>(), b = linear(x, w, Tensor()).to(DType::f64).to_vector<double>();
    double step = 0;
    for (size_t i = 0; i < a.size(); ++i) step = std::max(step, std::fabs(a[i] - b[i]) - std::fabs(a[i]) * 0x1p-7);
    CHECK(step < 1e-4);
  }
}
