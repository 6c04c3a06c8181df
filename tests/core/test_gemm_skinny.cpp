// The skinny GEMM kernels (kernels/cpu/gemm_skinny.h; issue 16, must-show 4):
// every dispatch level this CPU runs, f32 and bf16 weights, f32 and bf16
// outputs, odd M / N / K (tails of every tile and vector width), alpha and
// beta, against an f64 loop over the same (bf16-rounded) values; and the
// matmul op's routing of linear layers through it around kSkinnyMaxRows;
// the bf16 GEMM through oneDNN (gemm_dnnl.h) against the Eigen path; the
// int8-weight kernels and ops (tensor/quantized.h) against f64 sums over the
// dequantized weights; the packed AVX2 GEMM (gemm_packed.h) the same way.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/gemm_dnnl.h"
#include "kernels/cpu/gemm_packed.h"
#include "kernels/cpu/gemm_skinny.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tensor/quantized.h"
#include "tests/test_util.h"

using namespace areno;
using namespace areno::cpu;

namespace {

std::vector<float> values(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (auto& x : v) x = float(double(splitmix64(seed++) >> 11) * 0x1p-53 * 2.0 - 1.0);
  return v;
}

// Restores whether oneDNN is on after a test case changed it.
struct DnnlGuard {
  bool saved = dnnl_enabled();
  ~DnnlGuard() { set_dnnl_enabled(saved); }
};

// Restores the dispatch level a test case changed.
struct IsaGuard {
  CpuIsa saved = cpu_isa();
  ~IsaGuard() { set_cpu_isa(saved); }
};

std::vector<CpuIsa> levels() {
  std::vector<CpuIsa> l;
  for (CpuIsa i : {CpuIsa::generic, CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512_bf16, CpuIsa::amx})
    if (i <= cpu_isa_supported()) l.push_back(i);
  return l;
}

// Runs body(level) at every dispatch level from `from` that this CPU runs,
// the level set and captured; the level in force before is restored.
template <typename Body>
void for_each_level(CpuIsa from, Body&& body) {
  IsaGuard guard;
  for (CpuIsa isa : levels()) {
    if (isa < from) continue;
    const std::string level = cpu_isa_name(isa);
    CAPTURE(level);
    REQUIRE(set_cpu_isa(isa) == isa);
    body(isa);
  }
}

// out (from gemm_skinny* with initial values o0) against f64 sums of x times
// weight(n, k), the weight as the kernel sees it; columns past N untouched.
template <typename O, typename Weight>
void check_result(int64_t M, int64_t N, int64_t K, const std::vector<float>& x, int64_t ldx,
                  const std::vector<float>& o0, const std::vector<O>& out, int64_t ldo, float alpha, float beta,
                  const Weight& weight) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = double(x[size_t(m * ldx + k)]) * weight(n, k);
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
  check_result(M, N, K, x, ldx, o0, out, ldo, alpha, beta,
               [&](int64_t n, int64_t k) { return double(float(w[size_t(n * ldw + k)])); });
}

// gemm_skinny_bf16<O>: bf16 activations and weights, against f64 sums of the
// same bf16 values (x passed with its own stride, the layout linear() gives).
template <typename O>
void check_bf16x_shape(int64_t M, int64_t N, int64_t K, float alpha, float beta, uint64_t seed) {
  CAPTURE(M);
  CAPTURE(N);
  CAPTURE(K);
  CAPTURE(beta);
  const int64_t ldx = K + 3, ldw = K + 5, ldo = N + 2;
  std::vector<float> xf = values(size_t(M * ldx), seed), wf = values(size_t(N * ldw), seed + 1000);
  std::vector<BFloat16> x(xf.begin(), xf.end()), w(wf.begin(), wf.end());
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = float(x[i]);
  std::vector<float> o0 = values(size_t(M * ldo), seed + 2000);
  std::vector<O> out(o0.begin(), o0.end());
  gemm_skinny_bf16<O>(M, N, K, x.data(), ldx, w.data(), ldw, out.data(), ldo, alpha, beta);
  check_result(M, N, K, xf, ldx, o0, out, ldo, alpha, beta,
               [&](int64_t n, int64_t k) { return double(float(w[size_t(n * ldw + k)])); });
}

// Random int8 values (the full range, -127..127) and positive scales.
struct Int8Case {
  std::vector<int8_t> w;
  std::vector<float> scales;
};
Int8Case int8_values(int64_t N, int64_t ldw, uint64_t seed) {
  Int8Case c;
  c.w.resize(size_t(N * ldw));
  for (auto& v : c.w) v = int8_t(int64_t(splitmix64(seed++) % 255) - 127);
  for (int64_t n = 0; n < N; ++n) c.scales.push_back(float(0.001 + 0.02 * double(splitmix64(seed++) >> 11) * 0x1p-53));
  return c;
}

// gemm_skinny_int8<O> against f64 sums of x times scales[n] * w[n, k].
template <typename O>
void check_int8_shape(int64_t M, int64_t N, int64_t K, float alpha, float beta, uint64_t seed) {
  CAPTURE(M);
  CAPTURE(N);
  CAPTURE(K);
  CAPTURE(beta);
  const int64_t ldx = K + 3, ldw = K + 5, ldo = N + 2;
  std::vector<float> x = values(size_t(M * ldx), seed);
  const Int8Case c = int8_values(N, ldw, seed + 1000);
  std::vector<float> o0 = values(size_t(M * ldo), seed + 2000);
  std::vector<O> out(o0.begin(), o0.end());
  gemm_skinny_int8<O>(M, N, K, x.data(), ldx, c.w.data(), ldw, c.scales.data(), out.data(), ldo, alpha, beta);
  check_result(M, N, K, x, ldx, o0, out, ldo, alpha, beta, [&](int64_t n, int64_t k) {
    return double(c.scales[size_t(n)]) * double(c.w[size_t(n * ldw + k)]);
  });
}

// Worst |got - want| beyond `rel` of |want|, over f64 values.
double worst_beyond(const Tensor& got, const Tensor& want, double rel) {
  const std::vector<double> g = got.to(DType::f64).to_vector<double>(), w = want.to(DType::f64).to_vector<double>();
  REQUIRE(g.size() == w.size());
  double worst = 0;
  for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::fabs(g[i] - w[i]) - std::fabs(w[i]) * rel);
  return worst;
}

}  // namespace

TEST_CASE("gemm_skinny: every level, f32 and bf16 weights, bf16 activations, odd shapes, alpha and beta, against f64") {
  for_each_level(CpuIsa::generic, [&](CpuIsa) {
    uint64_t seed = 1;
    for (int64_t M : {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32})
      for (int64_t N : {1, 3, 4, 8, 9, 17, 67})
        for (int64_t K : {1, 7, 8, 15, 16, 17, 33, 64, 259}) {
          check_shape<float, float>(M, N, K, 1.0f, 0.0f, seed++);
          check_shape<BFloat16, BFloat16>(M, N, K, 1.0f, 0.0f, seed++);
          check_bf16x_shape<BFloat16>(M, N, K, 1.0f, 0.0f, seed++);
        }
    // Past 32 rows (the AMX tiles take up to kAmxMaxRows; every level runs these shapes).
    for (int64_t M : {33, 47, 64, 70})
      for (int64_t N : {17, 31, 32, 33, 67})
        for (int64_t K : {31, 32, 96, 259}) check_bf16x_shape<float>(M, N, K, 1.0f, 0.0f, seed++);
    for (int64_t M : {1, 5})
      for (int64_t N : {9, 67}) {
        check_shape<float, float>(M, N, 259, 0.5f, 2.0f, seed++);
        check_shape<BFloat16, float>(M, N, 259, -1.5f, 1.0f, seed++);
        check_shape<BFloat16, BFloat16>(M, N, 259, 0.5f, -1.0f, seed++);
        check_shape<float, BFloat16>(M, N, 33, 1.0f, 1.0f, seed++);
        check_bf16x_shape<float>(M, N, 259, -1.5f, 1.0f, seed++);
        check_bf16x_shape<BFloat16>(M, N, 95, 0.5f, -1.0f, seed++);
      }
  });
}

namespace {

// M rows of x times [N, K] weights at once through gemm_skinny with f32,
// bf16 and int8 (gemm_skinny_int8) weights: each output row has the bits of
// its row of x alone.
void check_rows_alone(int64_t M, int64_t N, int64_t K, uint64_t& seed) {
  const std::vector<float> x = values(size_t(M * K), seed++), wf = values(size_t(N * K), seed++);
  const std::vector<BFloat16> wb(wf.begin(), wf.end());
  const Int8Case c = int8_values(N, K, seed++);
  auto same_bits = [&](auto run) {
    std::vector<float> all(size_t(M * N)), rows(size_t(M * N));
    run(M, x.data(), all.data());
    for (int64_t m = 0; m < M; ++m) run(1, x.data() + m * K, rows.data() + m * N);
    return all == rows;
  };
  CHECK(same_bits([&](int64_t rows, const float* xr, float* out) {
    gemm_skinny<float, float>(rows, N, K, xr, K, wf.data(), K, out, N, 1.0f, 0.0f);
  }));
  CHECK(same_bits([&](int64_t rows, const float* xr, float* out) {
    gemm_skinny<BFloat16, float>(rows, N, K, xr, K, wb.data(), K, out, N, 1.0f, 0.0f);
  }));
  CHECK(same_bits([&](int64_t rows, const float* xr, float* out) {
    gemm_skinny_int8<float>(rows, N, K, xr, K, c.w.data(), K, c.scales.data(), out, N, 1.0f, 0.0f);
  }));
}

}  // namespace

TEST_CASE("gemm_skinny: rows of x alone give the bits of the multi-row tiles, short and long rows (one row of x takes several weight rows a tile from kLongK), against f64") {
  for_each_level(CpuIsa::generic, [&](CpuIsa) {
    uint64_t seed = 700;
    // N = 67: whole tiles of 1, 2, 4 or 8 weight rows and their tails.
    const int64_t M = 5, N = 67;
    for (int64_t K : {259, 1023, 1024, 1031, 3000}) {
      CAPTURE(K);
      check_shape<float, float>(1, N, K, 1.0f, 0.0f, seed++);
      check_shape<BFloat16, float>(1, N, K, 1.0f, 0.0f, seed++);
      check_rows_alone(M, N, K, seed);
    }
  });
}

TEST_CASE("gemm_skinny: 5 to 17 rows of x (tiles of 6 rows and their tails at the avx2 level, with the next block's weight rows prefetched) give each row's bits alone, every weight dtype, against f64") {
  for_each_level(CpuIsa::generic, [&](CpuIsa) {
    uint64_t seed = 900;
    // N = 67: whole column blocks and a tail; M: tiles of 6 (avx2) or 4
    // rows and tails of 1 to 5; K: tails of every width.
    const int64_t N = 67;
    for (int64_t K : {257, 264, 515, 3000})
      for (int64_t M : {5, 6, 7, 12, 16, 17}) {
        CAPTURE(K);
        CAPTURE(M);
        check_shape<float, float>(M, N, K, 1.0f, 0.0f, seed++);
        check_shape<BFloat16, BFloat16>(M, N, K, 0.5f, 1.0f, seed++);
        check_int8_shape<float>(M, N, K, -1.5f, 1.0f, seed++);
        check_rows_alone(M, N, K, seed);
      }
  });
}

TEST_CASE("gemm_skinny_bf16: at the avx512bf16 level, from kPairsMinRows rows, f32 FMAs with the bits of vdpbf16ps one row at a time, but bf16 denormals count") {
  if (cpu_isa_supported() < CpuIsa::avx512_bf16) {
    MESSAGE("no AVX512-BF16 on this CPU");
    return;
  }
  IsaGuard guard;
  REQUIRE(set_cpu_isa(CpuIsa::avx512_bf16) == CpuIsa::avx512_bf16);
  // N: tiles of 4 weight rows and a tail, split over the threads.
  const int64_t N = 301;
  uint64_t seed = 40;
  for (int64_t K : {31, 32, 273, 1061})
    for (int64_t M : {kPairsMinRows - 1, kPairsMinRows, int64_t(13), int64_t(32)}) {
      CAPTURE(K);
      CAPTURE(M);
      const int64_t ldx = K + 3, ldw = K + 5;
      const std::vector<float> xf = values(size_t(M * ldx), seed++), wf = values(size_t(N * ldw), seed++);
      std::vector<BFloat16> x(xf.begin(), xf.end()), w(wf.begin(), wf.end());
      // A bf16 denormal in row 0 of x (the smallest, 2^-133) against 2^120 in
      // weight row 0: a product of 2^-13 that vdpbf16ps reads as zero.
      x[0].bits = 0x0001;
      w[0].bits = 0x7b80;
      std::vector<float> all(size_t(M * N)), rows(size_t(M * N));
      gemm_skinny_bf16<float>(M, N, K, x.data(), ldx, w.data(), ldw, all.data(), N, 1.0f, 0.0f);
      for (int64_t m = 0; m < M; ++m)
        gemm_skinny_bf16<float>(1, N, K, x.data() + m * ldx, ldx, w.data(), ldw, rows.data() + m * N, N, 1.0f, 0.0f);
      int64_t differ = 0;
      for (size_t i = 0; i < all.size(); ++i) differ += all[i] != rows[i];
      // Only out[0, 0] can differ, and it does where the f32 FMAs ran.
      CHECK(differ == (M >= kPairsMinRows ? 1 : 0));
      if (M >= kPairsMinRows) CHECK(all[0] - rows[0] == doctest::Approx(0x1p-13).epsilon(1e-3));
    }
}

TEST_CASE("gemm_skinny: the levels agree with each other and the result does not depend on the thread split") {
  IsaGuard guard;
  // N past 64 x 8 x threads rows: the chunks taken from a counter (2 threads).
  const int64_t M = 5, N = 2100, K = 300;
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
    // bf16 activations (AMX tiles at the amx level, 32-row panels): same bits on one thread.
    std::vector<BFloat16> xb(x.begin(), x.end()), wb(w.begin(), w.end());
    for (int64_t rows : {int64_t(1), int64_t(20), kAmxMaxRows}) {
      std::vector<BFloat16> xr(size_t(rows * K));
      for (size_t i = 0; i < xr.size(); ++i) xr[i] = BFloat16(float(xb[i % xb.size()]) * (1.0f + float(i % 7)));
      std::vector<float> b_out(size_t(rows * N)), b_one(size_t(rows * N));
      gemm_skinny_bf16<float>(rows, N, K, xr.data(), K, wb.data(), K, b_out.data(), N, 1.0f, 0.0f);
#pragma omp parallel num_threads(2)
      {
#pragma omp single
        gemm_skinny_bf16<float>(rows, N, K, xr.data(), K, wb.data(), K, b_one.data(), N, 1.0f, 0.0f);
      }
      CHECK(b_out == b_one);
    }
    if (first.empty()) first = out;
    for (size_t i = 0; i < out.size(); ++i) REQUIRE(std::fabs(out[i] - first[i]) <= 1e-5f * (1 + std::fabs(first[i])));
  }
}

// run(rows, x, w, out) over the first `rows` rows of a fixed [300, K] bf16 x
// and [N, K] w: each row gives the same bits whatever the row count (the
// first entry of `row_counts` is the reference), and on 2 threads as inside
// a parallel region (one thread).
template <typename Run>
void check_same_bits(std::initializer_list<int64_t> row_counts, int64_t N, int64_t K, uint64_t seed, Run run) {
  std::vector<float> xf = values(size_t(300 * K), seed), wf = values(size_t(N * K), seed + 1);
  std::vector<BFloat16> x(xf.begin(), xf.end()), w(wf.begin(), wf.end());
  std::vector<BFloat16> first;
  for (int64_t rows : row_counts) {
    CAPTURE(rows);
    std::vector<BFloat16> out(size_t(rows * N)), one(size_t(rows * N));
    run(rows, x.data(), w.data(), out.data());
#pragma omp parallel num_threads(2)
    {
#pragma omp single
      run(rows, x.data(), w.data(), one.data());
    }
    bool same_threads = true, same_rows = true;
    for (size_t i = 0; i < out.size(); ++i) same_threads = same_threads && out[i].bits == one[i].bits;
    if (first.empty()) first = out;
    for (size_t i = 0; i < first.size(); ++i) same_rows = same_rows && out[i].bits == first[i].bits;
    CHECK(same_threads);
    CHECK(same_rows);
  }
}

TEST_CASE("gemm_amx_bf16: past kAmxInPlaceRows (the k-blocked kernel), odd shapes, strides, alpha and beta, against f64; same bits at every M and thread split") {
  if (cpu_isa_supported() < CpuIsa::amx) {
    MESSAGE("no AMX on this CPU: the blocked AMX kernel is not run");
    return;
  }
  IsaGuard guard;
  REQUIRE(set_cpu_isa(CpuIsa::amx) == CpuIsa::amx);
  uint64_t seed = 77;
  // Both chunk settings (up to 160 rows and above), k tails inside a chunk and
  // past the chunk, N tails inside a panel and past its first tile; a last
  // 32-row pair with at most 16 rows (one B tile: 33, 48, 65, 97, 133, 161).
  for (int64_t M : {33, 48, 65, 97, 133, 160, 161, 200, 256})
    for (int64_t N : {1, 17, 45})
      for (int64_t K : {7, 33, 259, 300}) {
        check_bf16x_shape<BFloat16>(M, N, K, 1.0f, 0.0f, seed++);
        check_bf16x_shape<float>(M, N, K, 1.0f, 0.0f, seed++);
      }
  // Up to 160 rows: k in one chunk up to K = 512, chunks of 4 k-blocks past it
  // (k tail in the last chunk), groups of 2 panels past 1 MB of packed x.
  for (int64_t M : {33, 133, 160})
    for (int64_t K : {513, 700, 3500}) check_bf16x_shape<BFloat16>(M, 45, K, 1.0f, 0.0f, seed++);
  // Super-chunks of k (packed x past 1.25 MB, few panels): 2 at 160 and 200
  // rows, with 7 panels split unevenly, and a k tail in the last one.
  for (int64_t M : {160, 200}) check_bf16x_shape<BFloat16>(M, 200, 4500, 1.0f, 0.0f, seed++);
  check_bf16x_shape<float>(200, 45, 4500, -1.5f, 1.0f, seed++);
  // Groups of panels (7 panels: a partial group per thread) over several chunks.
  for (int64_t M : {161, 256}) check_bf16x_shape<BFloat16>(M, 200, 600, 1.0f, 0.0f, seed++);
  for (int64_t M : {40, 170}) {
    check_bf16x_shape<BFloat16>(M, 67, 259, 0.5f, -1.0f, seed++);
    check_bf16x_shape<float>(M, 67, 130, -1.5f, 1.0f, seed++);
  }
  // The same rows give the same bits in place (20 rows), blocked with small
  // chunks (100) and large chunks (300), on 2 threads or one.
  const int64_t N = 1000, K = 300;
  check_same_bits({20, 100, 300}, N, K, 5, [&](int64_t rows, const BFloat16* x, const BFloat16* w, BFloat16* out) {
    gemm_amx_bf16<BFloat16>(rows, N, K, x, K, w, K, out, N, 1.0f, 0.0f);
  });
  // The same with K = 4500: one chunk run at 100 rows, 3 super-chunks at 300.
  check_same_bits({20, 100, 300}, 200, 4500, 9, [&](int64_t rows, const BFloat16* x, const BFloat16* w, BFloat16* out) {
    gemm_amx_bf16<BFloat16>(rows, 200, 4500, x, 4500, w, 4500, out, 200, 1.0f, 0.0f);
  });
  std::vector<float> xf = values(size_t(300 * K), 5), wf = values(size_t(N * K), 6);
  std::vector<BFloat16> x(xf.begin(), xf.end()), w(wf.begin(), wf.end());
  for (int64_t rows : {int64_t(20), int64_t(100), int64_t(300)}) {
    CAPTURE(rows);
    std::vector<BFloat16> out(size_t(rows * N));
    gemm_amx_bf16<BFloat16>(rows, N, K, x.data(), K, w.data(), K, out.data(), N, 1.0f, 0.0f);
    // A bias in the write-out: the bits of out filled with the bias and beta = 1.
    std::vector<BFloat16> bias(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) bias[size_t(n)] = BFloat16(0.25f * float(n % 13) - 1.5f);
    std::vector<BFloat16> with(size_t(rows * N)), filled(size_t(rows * N));
    std::vector<float> with_f(size_t(rows * N)), filled_f(size_t(rows * N));
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t n = 0; n < N; ++n) {
        filled[size_t(m * N + n)] = bias[size_t(n)];
        filled_f[size_t(m * N + n)] = float(bias[size_t(n)]);
      }
    gemm_amx_bf16<BFloat16>(rows, N, K, x.data(), K, w.data(), K, with.data(), N, 1.0f, 0.0f, bias.data());
    gemm_amx_bf16<BFloat16>(rows, N, K, x.data(), K, w.data(), K, filled.data(), N, 1.0f, 1.0f);
    gemm_amx_bf16<float>(rows, N, K, x.data(), K, w.data(), K, with_f.data(), N, 1.0f, 0.0f, bias.data());
    gemm_amx_bf16<float>(rows, N, K, x.data(), K, w.data(), K, filled_f.data(), N, 1.0f, 1.0f);
    bool same_bias = with_f == filled_f;
    for (size_t i = 0; i < with.size(); ++i) same_bias = same_bias && with[i].bits == filled[i].bits;
    CHECK(same_bias);
    CHECK(with[0].bits != out[0].bits);  // (the bias changed something)
  }
}

// gemm_packed_avx2<X, W, O> with a bias or not, x row-major or transposed,
// against f64 sums of the values as the kernel sees them.
template <typename X, typename W, typename O>
void check_packed_shape(int64_t M, int64_t N, int64_t K, float alpha, float beta, bool with_bias, bool x_t,
                        uint64_t seed, bool w_k_major = false) {
  CAPTURE(M);
  CAPTURE(N);
  CAPTURE(K);
  CAPTURE(beta);
  CAPTURE(with_bias);
  CAPTURE(x_t);
  CAPTURE(w_k_major);
  const int64_t ldx = K + 3, ldw = K + 5, ldo = N + 2;
  std::vector<float> xf = values(size_t(M * ldx), seed), wf = values(size_t(N * ldw), seed + 1000);
  std::vector<X> x(xf.begin(), xf.end());
  std::vector<W> w(wf.begin(), wf.end());
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = float(x[i]);
  // The transposed layout: element (m, k) at xt[k * (M + 1) + m].
  std::vector<X> xt(size_t((M + 1) * std::max<int64_t>(K, 1)));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[size_t(k * (M + 1) + m)] = x[size_t(m * ldx + k)];
  std::vector<W> bias;
  for (int64_t n = 0; n < N; ++n) bias.push_back(W(0.5f * float(n % 7) - 1.25f));
  // The right operand stored [K, N] (row stride N + 3) for w_k_major.
  std::vector<W> wk(size_t(std::max<int64_t>(K, 1) * (N + 3)));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) wk[size_t(k * (N + 3) + n)] = w[size_t(n * ldw + k)];
  const W* wp = w_k_major ? wk.data() : w.data();
  const int64_t wld = w_k_major ? N + 3 : ldw;
  std::vector<float> o0 = values(size_t(M * ldo), seed + 2000);
  std::vector<O> out(o0.begin(), o0.end());
  if (x_t)
    gemm_packed_avx2<X, W, O>(M, N, K, xt.data(), 1, M + 1, wp, wld, out.data(), ldo, alpha, beta,
                              with_bias ? bias.data() : nullptr, w_k_major);
  else
    gemm_packed_avx2<X, W, O>(M, N, K, x.data(), ldx, 1, wp, wld, out.data(), ldo, alpha, beta,
                              with_bias ? bias.data() : nullptr, w_k_major);
  // The bias as one more k: x 1, weight bias[n] / alpha (exact for these values and alpha).
  std::vector<float> xb(size_t(M * (K + 1)));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) xb[size_t(m * (K + 1) + k)] = xf[size_t(m * ldx + k)];
    xb[size_t(m * (K + 1) + K)] = with_bias ? 1.0f : 0.0f;
  }
  check_result(M, N, K + 1, xb, K + 1, o0, out, ldo, alpha, beta, [&](int64_t n, int64_t k) {
    return k < K ? double(float(w[size_t(n * ldw + k)])) : double(float(bias[size_t(n)])) / alpha;
  });
}

TEST_CASE("gemm_packed_avx2: odd shapes, every operand dtype, strides, transposed x, a [K, N] right operand, alpha, beta and bias, against f64; same bits at every M and thread split, every level from avx2") {
  if (cpu_isa_supported() < CpuIsa::avx2) {
    MESSAGE("no AVX2 on this CPU: the packed kernel is not run");
    return;
  }
  // (avx512 and up: pairs of panels on 16 lanes)
  for_each_level(CpuIsa::avx2, [&](CpuIsa) {
    uint64_t seed = 900;
    // Row tails of the 6-row tile and of the 144-row block, column tails inside
    // a 16-column panel and of the 128-column block, k tails of the 8-wide
    // transpose and of the 256-deep block.
    for (int64_t M : {1, 5, 6, 7, 13, 144, 151})
      for (int64_t N : {1, 9, 16, 17, 130})
        for (int64_t K : {1, 7, 8, 9, 256, 300}) {
          check_packed_shape<BFloat16, BFloat16, BFloat16>(M, N, K, 1.0f, 0.0f, false, false, seed++);
          check_packed_shape<float, float, float>(M, N, K, 1.0f, 0.0f, false, false, seed++);
        }
    for (int64_t M : {7, 150})
      for (int64_t K : {9, 513}) {
        check_packed_shape<BFloat16, BFloat16, BFloat16>(M, 67, K, 1.0f, 0.0f, true, false, seed++);
        check_packed_shape<BFloat16, BFloat16, float>(M, 67, K, 0.5f, 1.0f, true, true, seed++);
        check_packed_shape<float, BFloat16, BFloat16>(M, 67, K, -1.5f, 2.0f, false, false, seed++);
        check_packed_shape<float, float, BFloat16>(M, 67, K, 2.0f, 1.0f, true, true, seed++);
        check_packed_shape<float, float, float>(M, 300, K, 1.0f, -1.0f, true, true, seed++);
      }
    // A right operand stored [K, N]: column tails of the 16-wide rows.
    for (int64_t M : {1, 7, 150})
      for (int64_t N : {1, 16, 17, 130})
        for (int64_t K : {1, 9, 300}) {
          check_packed_shape<float, float, float>(M, N, K, 1.0f, 0.0f, false, false, seed++, true);
          check_packed_shape<BFloat16, BFloat16, BFloat16>(M, N, K, 1.0f, 1.0f, N % 2 == 0, M == 7, seed++, true);
        }
    // The same rows give the same bits at any M (alone, inside a block, past
    // it) and on one thread or two.
    check_same_bits({5, 100, 300}, 300, 600, 15, [](int64_t rows, const BFloat16* x, const BFloat16* w, BFloat16* out) {
      gemm_packed_avx2<BFloat16, BFloat16, BFloat16>(rows, 300, 600, x, 600, 1, w, 600, out, 300, 1.0f, 0.0f);
    });
  });
}

// gemm_packed_avx2 with int8 weights and per-row scales (X f32 or bf16 rows,
// the layout linear() gives), against f64 sums of x times scales[n] * w[n, k].
template <typename X, typename O>
void check_int8_packed_shape(int64_t M, int64_t N, int64_t K, float alpha, float beta, uint64_t seed) {
  CAPTURE(M);
  CAPTURE(N);
  CAPTURE(K);
  CAPTURE(beta);
  const int64_t ldx = K + 3, ldw = K + 5, ldo = N + 2;
  const std::vector<float> xv = values(size_t(M * ldx), seed);
  const std::vector<X> x(xv.begin(), xv.end());
  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = float(x[i]);
  const Int8Case c = int8_values(N, ldw, seed + 1000);
  std::vector<float> o0 = values(size_t(M * ldo), seed + 2000);
  std::vector<O> out(o0.begin(), o0.end());
  gemm_packed_avx2<X, int8_t, O>(M, N, K, x.data(), ldx, 1, c.w.data(), ldw, out.data(), ldo, alpha, beta, nullptr,
                                 false, c.scales.data());
  check_result(M, N, K, xf, ldx, o0, out, ldo, alpha, beta, [&](int64_t n, int64_t k) {
    return double(c.scales[size_t(n)]) * double(c.w[size_t(n * ldw + k)]);
  });
}

TEST_CASE("gemm_packed_avx2: int8 weights, each sum times its row's scale, odd shapes, alpha and beta, against f64; same bits at every M and thread split") {
  if (cpu_isa_supported() < CpuIsa::avx2) {
    MESSAGE("no AVX2 on this CPU: the packed kernel is not run");
    return;
  }
  for_each_level(CpuIsa::avx2, [&](CpuIsa) {
    uint64_t seed = 12000;
    // Column tails of the 8-wide widening and transpose, of a panel and of
    // the 128-column block; k tails of the 8-deep transpose and the 256-deep block.
    for (int64_t M : {1, 7, 17, 151})
      for (int64_t N : {1, 9, 17, 130})
        for (int64_t K : {1, 9, 300}) {
          check_int8_packed_shape<float, float>(M, N, K, 1.0f, 0.0f, seed++);
          check_int8_packed_shape<BFloat16, BFloat16>(M, N, K, 1.0f, 0.0f, seed++);
        }
    check_int8_packed_shape<float, BFloat16>(33, 67, 259, -1.5f, 1.0f, seed++);
    check_int8_packed_shape<float, float>(33, 67, 259, 0.5f, 2.0f, seed++);
    // Each row's bits whatever the row count, on two threads and on one.
    const int64_t N = 300, K = 600;
    const std::vector<float> x = values(size_t(300 * K), 12500);
    const Int8Case c = int8_values(N, K, 12600);
    std::vector<float> first;
    for (int64_t rows : {5, 100, 300}) {
      CAPTURE(rows);
      std::vector<float> out(size_t(rows * N)), one(size_t(rows * N));
      gemm_packed_avx2<float, int8_t, float>(rows, N, K, x.data(), K, 1, c.w.data(), K, out.data(), N, 1.0f, 0.0f,
                                             nullptr, false, c.scales.data());
#pragma omp parallel num_threads(2)
      {
#pragma omp single
        gemm_packed_avx2<float, int8_t, float>(rows, N, K, x.data(), K, 1, c.w.data(), K, one.data(), N, 1.0f, 0.0f,
                                               nullptr, false, c.scales.data());
      }
      CHECK(std::memcmp(out.data(), one.data(), out.size() * sizeof(float)) == 0);
      if (first.empty()) first = out;
      CHECK(std::memcmp(out.data(), first.data(), first.size() * sizeof(float)) == 0);
    }
  });
}

TEST_CASE("gemm_packed_avx2: the AVX-512 micro-kernel gives the AVX2 kernel's bits (each output one k-order FMA chain)") {
  if (cpu_isa_supported() < CpuIsa::avx512) {
    MESSAGE("no AVX-512 on this CPU: one level only");
    return;
  }
  IsaGuard guard;
  // Column counts with an odd last panel (no pair) and a partial one; rows
  // past a 6-row tile; k past a 256-deep block.
  for (int64_t N : {16, 48, 67, 300})
    for (int64_t M : {1, 7, 150})
      for (int64_t K : {9, 300}) {
        CAPTURE(N);
        CAPTURE(M);
        CAPTURE(K);
        std::vector<float> xf = values(size_t(M * K), 7000 + uint64_t(N + M + K)), wf = values(size_t(N * K), 8000);
        const std::vector<BFloat16> x(xf.begin(), xf.end()), w(wf.begin(), wf.end());
        std::vector<float> bias;
        for (int64_t n = 0; n < N; ++n) bias.push_back(0.25f * float(n % 5));
        // f32 operands with alpha, beta and a bias, then bf16 operands: f32 outputs, so every bit of the sums shows.
        auto run = [&](CpuIsa isa) {
          REQUIRE(set_cpu_isa(isa) == isa);
          const std::vector<float> o0 = values(size_t(M * N), 9000);
          std::vector<float> o = o0, ob = o0;
          gemm_packed_avx2(M, N, K, xf.data(), K, 1, wf.data(), K, o.data(), N, 0.5f, 1.0f, bias.data());
          gemm_packed_avx2(M, N, K, x.data(), K, 1, w.data(), K, ob.data(), N, 1.0f, 0.0f);
          o.insert(o.end(), ob.begin(), ob.end());
          return o;
        };
        const std::vector<float> a = run(CpuIsa::avx2), b = run(CpuIsa::avx512);
        CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
      }
}

TEST_CASE("gemm_skinny: linear() routes up to kSkinnyMaxRows (bf16 with AMX: kAmxMaxRows) rows through it, both dtypes, every level") {
  IsaGuard guard;
  const int64_t K = 67, N = 2100;
  std::vector<float> wv = values(size_t(N * K), 50);
  Tensor w32 = from_vector<float>(wv, Shape{N, K});
  Tensor w16 = w32.to(DType::bf16);
  for (CpuIsa isa : levels()) {
    const std::string level = cpu_isa_name(isa);
    CAPTURE(level);
    set_cpu_isa(isa);
    for (int64_t M : {int64_t(1), int64_t(4), int64_t(13), kSkinnyMaxRows, kSkinnyMaxRows + 1, kAmxMaxRows,
                      kAmxMaxRows + 1}) {
      CAPTURE(M);
      Tensor x = from_vector<float>(values(size_t(M * K), 60 + uint64_t(M)), Shape{M, K});
      Tensor want = linear(x.to(DType::f64), w32.to(DType::f64), Tensor());
      Tensor got32 = linear(x, w32, Tensor()).to(DType::f64);
      CHECK(max_abs_diff(got32, want) < 2e-5);
      // bf16: activations rounded to bf16 as the op's inputs are, result rounded once.
      Tensor want16 = linear(x.to(DType::bf16).to(DType::f64), w16.to(DType::f64), Tensor());
      Tensor got16 = linear(x.to(DType::bf16), w16, Tensor()).to(DType::f64);
      // A transposed (column-major) activation gives the same bits.
      const Tensor x16t = x.to(DType::bf16).t().contiguous().t();
      CHECK(max_abs_diff(linear(x16t, w16, Tensor()).to(DType::f64), got16) == 0.0);
      const std::vector<double> g = got16.to_vector<double>(), v = want16.to_vector<double>();
      double worst = 0;  // beyond one bf16 rounding of the result (2^-8 relative, halfway included)
      for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::fabs(g[i] - v[i]) - std::fabs(v[i]) * 0x1p-8);
      CHECK(worst < 1e-5);
    }
  }
}

TEST_CASE("gemm_dnnl: bf16 GEMMs above the skinny rows through oneDNN equal the widened f32 path within bf16 rounding") {
  DnnlGuard restore;
  const bool have = set_dnnl_enabled(true);
  const std::string built = have ? "yes" : "no";
  MESSAGE("oneDNN runs bf16 here (built, on, and this CPU): " << built);
  if (have) {  // the call itself succeeds (it returns false only when it ran nothing)
    std::vector<BFloat16> a(6, BFloat16(1.0f)), b(6, BFloat16(2.0f)), o(4);
    REQUIRE(dnnl_gemm_bf16(2, 2, 3, a.data(), 3, 1, b.data(), 2, 1, o.data(), 2));
    for (BFloat16 v : o) CHECK(float(v) == 6.0f);
  }
  for (const auto& shape : {std::array<int64_t, 3>{33, 67, 259}, {100, 1000, 17}, {513, 31, 300}}) {
    const int64_t M = shape[0], N = shape[1], K = shape[2];  // plain variables for CAPTURE (clang 14)
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

TEST_CASE("gemm_skinny_int8: every level, f32 and bf16 outputs, odd shapes, alpha and beta, against f64") {
  for_each_level(CpuIsa::generic, [&](CpuIsa) {
    uint64_t seed = 5000;
    for (int64_t M : {1, 2, 3, 4, 5, 7, 9, 16, 17, 31, 32})
      for (int64_t N : {1, 3, 4, 8, 9, 17, 67})
        for (int64_t K : {1, 7, 8, 15, 16, 17, 33, 259}) {
          check_int8_shape<float>(M, N, K, 1.0f, 0.0f, seed++);
          if (K % 2) check_int8_shape<BFloat16>(M, N, K, 1.0f, 0.0f, seed++);
        }
    for (int64_t M : {1, 6})
      for (int64_t N : {9, 67}) {
        check_int8_shape<float>(M, N, 259, 0.5f, 2.0f, seed++);
        check_int8_shape<BFloat16>(M, N, 259, -1.5f, 1.0f, seed++);
      }
  });
}

TEST_CASE("quantize_int8: per-row symmetric scales, rounding within half a step, zero rows, refusals") {
  const int64_t N = 37, K = 131;
  std::vector<float> wv = values(size_t(N * K), 900);
  for (int64_t k = 0; k < K; ++k) wv[size_t(5 * K + k)] = 0.0f;        // an all-zero row
  for (int64_t k = 0; k < K; ++k) wv[size_t(7 * K + k)] *= 1000.0f;    // a large row
  const Tensor w = from_vector<float>(wv, Shape{N, K});
  for (const Tensor& src : {w, w.to(DType::bf16), w.t().contiguous().t()}) {  // f32, bf16, column-major
    const Int8Weight q = quantize_int8(src, DType::f32);
    REQUIRE(q.rows == N);
    REQUIRE(q.cols == K);
    const std::vector<float> s = src.to(DType::f32).contiguous().to_vector<float>();
    for (int64_t n = 0; n < N; ++n) {
      float amax = 0;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(s[size_t(n * K + k)]));
      CHECK(q.scales[size_t(n)] == amax / 127.0f);
      bool full = false;
      for (int64_t k = 0; k < K; ++k) {
        const int8_t v = q.values[size_t(n * K + k)];
        REQUIRE(v >= -127);
        full = full || v == 127 || v == -127;
        // Round to nearest: within half a step of the value (plus f32 slack).
        REQUIRE(std::fabs(double(q.scales[size_t(n)]) * v - s[size_t(n * K + k)]) <= 0.5001 * q.scales[size_t(n)] + 1e-12);
      }
      CHECK((full || amax == 0));
    }
  }
  CHECK(quantize_int8(w, DType::bf16).dtype == DType::bf16);
  std::vector<float> bad = wv;
  bad[size_t(11 * K + 3)] = std::nanf("");
  CHECK_THROWS_WITH_AS(quantize_int8(from_vector<float>(bad, Shape{N, K}), DType::f32),
                       doctest::Contains("row 11"), std::invalid_argument);
  CHECK_THROWS_AS(quantize_int8(w, DType::f16), std::invalid_argument);
  CHECK_THROWS_AS(quantize_int8(w.reshape({-1}), DType::f32), std::invalid_argument);
}

TEST_CASE("linear (int8): both dtypes, every level, skinny and prefill rows (oneDNN on and off), against f64") {
  IsaGuard guard;
  DnnlGuard restore;
  const int64_t K = 67, N = 1043;
  const Int8Weight q = quantize_int8(from_vector<float>(values(size_t(N * K), 300), Shape{N, K}), DType::f32);
  const Tensor wd = dequantize(q).to(DType::f64);
  for (CpuIsa isa : levels()) {
    const std::string level = cpu_isa_name(isa);
    CAPTURE(level);
    set_cpu_isa(isa);
    for (int64_t M : {int64_t(1), int64_t(3), int64_t(17), kSkinnyMaxRows, kSkinnyMaxRows + 1, int64_t(100)}) {
      CAPTURE(M);
      const Tensor x = from_vector<float>(values(size_t(M * K), 400 + uint64_t(M)), Shape{M, K});
      const Tensor want = linear(x.to(DType::f64), wd, Tensor());
      const Tensor got = linear(x, q);
      REQUIRE(got.dtype() == DType::f32);
      REQUIRE(got.shape() == Shape{M, N});
      CHECK(max_abs_diff(got.to(DType::f64), want) < 2e-5);
      // bf16 activations (rounded as the op's inputs are), the result rounded once.
      const Tensor xb = x.to(DType::bf16);
      const Tensor want16 = linear(xb.to(DType::f64), wd, Tensor());
      // oneDNN (prefill rows) multiplies the dequantized weights rounded to bf16.
      const Tensor want16r = linear(xb.to(DType::f64), wd.to(DType::bf16).to(DType::f64), Tensor());
      for (bool dnnl : {true, false}) {
        CAPTURE(dnnl);
        const bool rounded = set_dnnl_enabled(dnnl) && M > kSkinnyMaxRows;
        const Tensor got16 = linear(xb, q);
        REQUIRE(got16.dtype() == DType::bf16);
        CHECK(worst_beyond(got16, rounded ? want16r : want16, 0x1p-8) < 1e-4);
      }
    }
  }
  // Leading dims are kept; a 3-D input.
  const Tensor x3 = from_vector<float>(values(size_t(2 * 3 * K), 77), Shape{2, 3, K});
  CHECK(linear(x3, q).shape() == Shape{2, 3, N});
  CHECK(max_abs_diff(linear(x3, q).to(DType::f64), linear(x3.to(DType::f64), wd, Tensor())) < 2e-5);
  CHECK_THROWS_WITH_AS(linear(from_vector<float>(values(5, 1), Shape{1, 5}), q), doctest::Contains("expects 67"),
                       std::invalid_argument);
  Tensor xg = from_vector<float>(values(size_t(K), 3), Shape{1, K});
  xg.set_requires_grad(true);
  CHECK_THROWS_WITH_AS(linear(xg, q), doctest::Contains("inference"), std::invalid_argument);
  {
    NoGradGuard ng;
    CHECK(linear(xg, q).shape() == Shape{1, N});
  }
}

TEST_CASE("embedding (int8): dequantized rows in the weight's dtype; ids out of range throw") {
  const int64_t N = 50, K = 33;
  const Int8Weight q = quantize_int8(from_vector<float>(values(size_t(N * K), 10), Shape{N, K}), DType::bf16);
  const Tensor ids = from_vector<int64_t>({4, 0, 49, 4}, Shape{2, 2});
  const Tensor e = embedding(q, ids);
  REQUIRE(e.dtype() == DType::bf16);
  REQUIRE(e.shape() == Shape{2, 2, K});
  const Tensor want = embedding(dequantize(q).to(DType::bf16), ids);
  CHECK(max_abs_diff(e.to(DType::f64), want.to(DType::f64)) == 0);
  CHECK_THROWS_WITH_AS(embedding(q, from_vector<int64_t>({50}, Shape{1})), doctest::Contains("outside"),
                       std::invalid_argument);
}

TEST_CASE("linear (bf16, bias): the bias joins the f32 sums before the one rounding, every level, oneDNN on and off") {
  IsaGuard guard;
  DnnlGuard restore;
  const int64_t K = 67, N = 150;
  const Tensor w = from_vector<float>(values(size_t(N * K), 300), Shape{N, K}).to(DType::bf16);
  // A bias large next to the products, so that a second rounding would show.
  std::vector<float> bv = values(size_t(N), 301);
  for (float& v : bv) v *= 40.0f;
  const Tensor bias = from_vector<float>(bv, Shape{N}).to(DType::bf16);
  for (CpuIsa isa : levels()) {
    const std::string level = cpu_isa_name(isa);
    CAPTURE(level);
    set_cpu_isa(isa);
    for (bool want_dnnl : {true, false}) {
      // (false where the build lacks oneDNN or oneDNN runs no bf16 on this CPU)
      const bool dnnl = set_dnnl_enabled(want_dnnl);
      for (int64_t M : {int64_t(1), int64_t(13), kSkinnyMaxRows + 1, kAmxMaxRows, kAmxMaxRows + 1, int64_t(300)}) {
        CAPTURE(M);
        CAPTURE(dnnl);
        const Tensor x = from_vector<float>(values(size_t(M * K), 310 + uint64_t(M)), Shape{M, K}).to(DType::bf16);
        const std::vector<double> want =
            add(linear(x.to(DType::f64), w.to(DType::f64), Tensor()), bias.to(DType::f64)).to_vector<double>();
        const Tensor got = linear(x, w, bias);
        REQUIRE(got.dtype() == DType::bf16);
        const std::vector<double> g = got.to(DType::f64).to_vector<double>();
        // Fused: the f32 sum plus the bias rounded once, so nearly every output is
        // the f64 value rounded to bf16 (a reassociated f32 sum can fall on the
        // other side of a halfway point), and all within one bf16 rounding (2^-8).
        // The composed op (two roundings, as with autograd, or below the amx
        // level without oneDNN past the skinny rows) misses on far more: 8-10 % here.
        const Tensor xg = x.detach().set_requires_grad(true);
        const std::vector<double> c = linear(xg, w, bias).detach().to(DType::f64).to_vector<double>();
        const bool fused = dnnl || isa >= CpuIsa::amx || M <= kSkinnyMaxRows;  // (AMX: every row count)
        int64_t off = 0, off_composed = 0;
        double worst = 0;
        for (size_t i = 0; i < g.size(); ++i) {
          const double once = double(float(BFloat16(float(want[i]))));
          off += g[i] != once;
          off_composed += c[i] != once;
          worst = std::max(worst, std::fabs(g[i] - want[i]) - std::fabs(want[i]) * 0x1p-8);
        }
        if (fused) {
          CHECK(worst <= 1e-6);
          CHECK(off * 100 <= int64_t(g.size()));
        }
        CHECK(off_composed * 20 > int64_t(g.size()));
      }
    }
  }
}

TEST_CASE("linear_add_: y += x wᵀ in place with one rounding, f32 and bf16, skinny and oneDNN rows; refuses autograd") {
  IsaGuard guard;
  DnnlGuard restore;
  const int64_t K = 67, N = 150;
  for (CpuIsa isa : levels()) {
    const std::string level = cpu_isa_name(isa);
    CAPTURE(level);
    set_cpu_isa(isa);
    for (bool dnnl : {true, false})
      for (int64_t M : {int64_t(1), int64_t(13), kAmxMaxRows, kAmxMaxRows + 1, int64_t(300)})
        for (DType dt : {DType::f32, DType::bf16}) {
          CAPTURE(M);
          CAPTURE(dnnl);
          set_dnnl_enabled(dnnl);
          const Tensor x = from_vector<float>(values(size_t(M * K), 400 + uint64_t(M)), Shape{M, K}).to(dt);
          const Tensor w = from_vector<float>(values(size_t(N * K), 401), Shape{N, K}).to(dt);
          std::vector<float> yv = values(size_t(M * N), 402);
          for (float& v : yv) v *= 30.0f;
          const Tensor y0 = from_vector<float>(yv, Shape{M, N}).to(dt);
          const std::vector<double> want =
              add(y0.to(DType::f64), linear(x.to(DType::f64), w.to(DType::f64), Tensor())).to_vector<double>();
          Tensor y = y0.clone();
          linear_add_(y, x, w);
          const std::vector<double> g = y.to(DType::f64).to_vector<double>();
          // One rounding of the exact value: 2^-8 relative in bf16, f32 sums' reassociation in f32.
          const double rel = dt == DType::bf16 ? 0x1p-8 : 1e-6;
          double worst = 0;
          for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::fabs(g[i] - want[i]) - std::fabs(want[i]) * rel);
          CHECK(worst <= 1e-5);
        }
  }
  Tensor y = zeros({2, 3}), x = ones({2, 4}), w = ones({3, 4});
  linear_add_(y, x, w);
  CHECK(y.to_vector<float>() == std::vector<float>(6, 4.0f));
  CHECK_THROWS_AS(linear_add_(y, x.detach().set_requires_grad(true), w), std::invalid_argument);
  CHECK_THROWS_AS(linear_add_(y, x, ones({3, 5})), std::invalid_argument);
  CHECK_THROWS_AS(linear_add_(zeros({3, 2}).t(), x, w), std::invalid_argument);  // y not contiguous
}
