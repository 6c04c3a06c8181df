// The skinny GEMM (kernels/cpu/gemm_skinny.h) on the `full` decoder's layer
// shapes: M rows of bf16 x against bf16 weights [N, K] read in place, as a
// short prompt's prefill or a decode step of M sequences runs them. The
// weights of `--layers` layers (default 4: 800 MB, past any L3) are visited in
// turn, so every product reads its weights from memory. Prints one JSON
// object per M: ms per layer (the four products) and GFLOP/s, best of
// `--reps`. (ARENO_CPU_ISA picks a lower level.)
//   bench_skinny [--rows 1,4,8,12,16] [--layers 4] [--reps 5]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/gemm_skinny.h"
#include "tensor/dtype.h"

using namespace areno;

namespace {

struct Shape {
  const char* name;
  int64_t n, k;
};
// Phi-4-mini: hidden 3072, 24 query heads and 8 key/value heads of 128, MLP 8192.
constexpr Shape kShapes[] = {{"qkv", 5120, 3072}, {"o", 3072, 3072}, {"gate_up", 16384, 3072}, {"down", 3072, 8192}};

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    v.push_back(std::stoll(item));
    if (v.back() < 1) throw std::invalid_argument("bench_skinny: --rows takes counts of at least 1");
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> rows = {1, 4, 8, 12, 16};
  int layers = 4, reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--rows") rows = parse_list(argv[i + 1]);
    else if (a == "--layers") layers = std::atoi(argv[i + 1]);
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else {
      fmt::print(stderr, "bench_skinny: unknown flag {}\n", a);
      return 2;
    }
  }
  std::mt19937 rng(1);
  std::vector<std::vector<BFloat16>> w;  // [layer * 4 + shape]
  for (int l = 0; l < layers; ++l)
    for (const Shape& s : kShapes) {
      std::vector<BFloat16> m(size_t(s.n * s.k));
      for (auto& v : m) v = BFloat16(float(int(rng() % 2001) - 1000) * 2e-5f);
      w.push_back(std::move(m));
    }
  const int64_t max_m = *std::max_element(rows.begin(), rows.end());
  std::vector<BFloat16> x(size_t(max_m * 8192));
  for (auto& v : x) v = BFloat16(float(int(rng() % 2001) - 1000) * 1e-3f);
  std::vector<BFloat16> out(size_t(max_m * 16384));
  for (int64_t M : rows) {
    double flops = 0;
    for (const Shape& s : kShapes) flops += 2.0 * double(M * s.n * s.k);
    auto pass = [&] {
      for (int l = 0; l < layers; ++l)
        for (size_t i = 0; i < 4; ++i) {
          const Shape& s = kShapes[i];
          cpu::gemm_skinny_bf16<BFloat16>(M, s.n, s.k, x.data(), s.k, w[size_t(l) * 4 + i].data(), s.k, out.data(),
                                          s.n, 1.0f, 0.0f);
        }
    };
    pass();
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      pass();
      best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    const double ms = best / layers;
    fmt::print("{{\"bench\": \"skinny_bf16_full_layer\", \"rows\": {}, \"ms\": {:.3f}, \"gflops\": {:.1f}}}\n", M, ms,
               flops / ms / 1e6);
  }
  return 0;
}
