// Core kernel benchmarks: f32 GEMM, elementwise add, softmax on the CPU, and
// on a GPU when present bf16 GEMM and device copies. Prints one JSON object
// per line: {"bench": ..., "device": ..., "ms": ..., "gflops"/"gbps": ...}.
// Timing: best of several repetitions after warm-up.
#include <fmt/format.h>

#include <array>
#include <cstdlib>
#include <chrono>
#include <functional>
#include <string>

#include "tensor/autograd.h"
#include "tensor/backend.h"
#include "tensor/ops.h"

using namespace areno;

static double best_ms(const std::function<void()>& f, Device d, int reps) {
  f();  // warm-up
  backend(d).synchronize(d);
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    backend(d).synchronize(d);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, ms);
  }
  return best;
}

static void gemm(Device d, DType t, int64_t m, int64_t n, int64_t k, int reps) {
  Generator g(0);
  Tensor a = rand_normal({m, k}, g, 0, 1, TensorOptions(t, d));
  Tensor b = rand_normal({k, n}, g, 0, 1, TensorOptions(t, d));
  double ms = best_ms([&] { matmul(a, b); }, d, reps);
  fmt::print("{{\"bench\": \"gemm_{}_{}x{}x{}\", \"device\": \"{}\", \"ms\": {:.3f}, \"gflops\": {:.1f}}}\n",
             dtype_name(t), m, n, k, d.str(), ms, 2.0 * m * n * k / ms / 1e6);
}

int main(int argc, char** argv) {
  NoGradGuard ng;
  bool gpu_only = argc > 1 && std::string(argv[1]) == "--gpu";
  Device cpu = Device::cpu();
  if (!gpu_only) {
    gemm(cpu, DType::f32, 1024, 1024, 1024, 10);
    gemm(cpu, DType::f32, 4096, 4096, 512, 5);
    Generator g(0);
    int64_t n = 16 * 1024 * 1024;
    Tensor x = rand_normal({n}, g), y = rand_normal({n}, g);
    double ms = best_ms([&] { add(x, y); }, cpu, 10);
    fmt::print("{{\"bench\": \"add_f32_16M\", \"device\": \"cpu\", \"ms\": {:.3f}, \"gbps\": {:.1f}}}\n", ms,
               3.0 * 4 * n / ms / 1e6);
    // bf16 elementwise passes at the image prefill's shape ([1848 tokens, 8192]):
    // GB/s counts the bytes each op reads and writes.
    {
      Tensor a = rand_normal({1848, 8192}, g).to(DType::bf16), b = rand_normal({1848, 8192}, g).to(DType::bf16);
      const double bytes = 2.0 * double(a.numel());
      auto row = [&](const char* name, double passes, auto&& f) {
        const double t = best_ms(f, cpu, 10);
        fmt::print("{{\"bench\": \"{}_bf16_1848x8192\", \"device\": \"cpu\", \"ms\": {:.3f}, \"gbps\": {:.1f}}}\n", name,
                   t, passes * bytes / t / 1e6);
      };
      row("add", 3, [&] { add(a, b); });
      row("mul", 3, [&] { mul(a, b); });
      row("mul_scalar", 2, [&] { mul(a, 2.0); });
      row("neg", 2, [&] { neg(a); });
      row("silu", 2, [&] { silu(a); });
      row("copy", 2, [&] { a.clone(); });
      Tensor bias = rand_normal({8192}, g).to(DType::bf16);
      row("add_bias", 2, [&] { add(a, bias); });
      Tensor gu = rand_normal({1848, 16384}, g).to(DType::bf16);
      const Tensor gate = gu.narrow(1, 0, 8192);
      row("silu_strided", 2, [&] { silu(gate); });
    }
    Tensor s = rand_normal({4096, 4096}, g);
    ms = best_ms([&] { softmax(s, -1); }, cpu, 10);
    fmt::print("{{\"bench\": \"softmax_f32_4096x4096\", \"device\": \"cpu\", \"ms\": {:.3f}, \"gbps\": {:.1f}}}\n",
               ms, 2.0 * 4 * 4096 * 4096 / ms / 1e6);
  }
  if (cuda_device_count() > 0) {
    Device d = Device::cuda(0);
    for (int64_t sz : {4096, 8192}) gemm(d, DType::bf16, sz, sz, sz, 20);
    // The training step's GEMM shapes (bench/train, small and full presets):
    // linear x [M, K] @ w [N, K]^T in bf16, and the loss's f32 weight
    // gradient p^T h (p [1024, 200064] transposed, h [1024, 256]).
    Generator g(1);
    for (auto [m, n, k] : {std::array<int64_t, 3>{16384, 384, 256}, {16384, 1536, 256}, {16384, 256, 768},
                           {8192, 5120, 3072}, {8192, 16384, 3072}, {8192, 3072, 8192}}) {
      Tensor x = rand_normal({m, k}, g, 0, 1, TensorOptions(DType::bf16, d));
      Tensor w = rand_normal({n, k}, g, 0, 1, TensorOptions(DType::bf16, d));
      double ms = best_ms([&] { linear(x, w); }, d, 20);
      fmt::print("{{\"bench\": \"linear_bf16_{}x{}x{}\", \"device\": \"{}\", \"ms\": {:.3f}, \"gflops\": {:.1f}}}\n", m, n,
                 k, d.str(), ms, 2.0 * m * n * k / ms / 1e6);
    }
    {
      Tensor p = rand_normal({1024, 200064}, g, 0, 1, TensorOptions(DType::f32, d));
      Tensor h = rand_normal({1024, 256}, g, 0, 1, TensorOptions(DType::f32, d));
      double ms = best_ms([&] { matmul(p.t(), h); }, d, 10);
      fmt::print("{{\"bench\": \"gemm_f32_pT_h_200064x256x1024\", \"device\": \"{}\", \"ms\": {:.3f}, \"gflops\": {:.1f}}}\n",
                 d.str(), ms, 2.0 * 200064 * 256 * 1024 / ms / 1e6);
    }
    // Causal attention at Phi-4-mini's heads (24 query, 8 KV, head dim 128),
    // bf16, q a transposed view as in the decoder: the fused kernels
    // (kernels/cuda/attention.cu) and the composed op
    // (ARENO_CUDA_FUSED_ATTENTION=0); TFLOP/s count the visible pairs only
    // (forward 2 products, backward 5), as FlashAttention reports.
    for (int64_t T : {int64_t(2048), int64_t(8192)})
      for (bool fused : {true, false}) {
        setenv("ARENO_CUDA_FUSED_ATTENTION", fused ? "1" : "0", 1);
        const int64_t HQ = 24, HKV = 8, D = 128;
        Tensor q = rand_normal({1, T, HQ, D}, g, 0, 1, TensorOptions(DType::bf16, d)).transpose(1, 2);
        Tensor k = rand_normal({1, HKV, T, D}, g, 0, 1, TensorOptions(DType::bf16, d));
        Tensor v = rand_normal({1, HKV, T, D}, g, 0, 1, TensorOptions(DType::bf16, d));
        Tensor w = rand_normal({1, HQ, T, D}, g, 0, 1, TensorOptions(DType::bf16, d));
        AttentionOptions o;
        o.causal = true;
        const double pairs = double(T) * double(T + 1) / 2, unit = 2.0 * HQ * D * pairs;
        const double fwd = best_ms([&] { scaled_dot_product_attention(q, k, v, o); }, d, 5);
        const double both = best_ms(
            [&] {
              GradModeGuard on(true);
              Tensor ql = q.detach(), kl = k.detach(), vl = v.detach();
              for (Tensor* t : {&ql, &kl, &vl}) t->set_requires_grad(true);
              sum(mul(scaled_dot_product_attention(ql, kl, vl, o), w)).backward();
            },
            d, 5);
        fmt::print("{{\"bench\": \"attention_{}_bf16_causal_24x8x{}x128\", \"device\": \"{}\", \"fwd_ms\": {:.3f}, "
                   "\"fwd_bwd_ms\": {:.3f}, \"fwd_tflops\": {:.1f}, \"fwd_bwd_tflops\": {:.1f}}}\n",
                   fused ? "fused" : "composed", T, d.str(), fwd, both, 2 * unit / fwd / 1e9, 7 * unit / both / 1e9);
      }
    unsetenv("ARENO_CUDA_FUSED_ATTENTION");
    Tensor src = empty({int64_t(1) << 28}, TensorOptions(DType::f32, d));  // 1 GiB
    Tensor dst = empty_like(src);
    double ms = best_ms([&] { dst.copy_(src); }, d, 20);
    fmt::print("{{\"bench\": \"copy_d2d_1GiB\", \"device\": \"{}\", \"ms\": {:.3f}, \"gbps\": {:.1f}}}\n", d.str(),
               ms, 2.0 * double(src.nbytes()) / ms / 1e6);
  }
  return 0;
}
