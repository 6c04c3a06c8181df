// See gemm_dnnl.h.
#include "kernels/cpu/gemm_dnnl.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "areno_build_config.h"
#include "kernels/cpu/gemm_skinny.h"  // cpu_isa_supported()

#if ARENO_HAVE_DNNL
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace areno::cpu {

#if ARENO_HAVE_DNNL

namespace {
struct Dnnl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
};
Dnnl& dnnl_state() {
  static Dnnl d;
  return d;
}

// Default: on where the CPU has AMX only. Without AMX (AVX512-BF16 alone) the
// packed kernel with its AVX-512 micro-kernel (gemm_packed.h) ran this
// Xeon's bf16 GEMMs at 242-280 GFLOP/s against oneDNN's 163-171, and the
// prefill attention widened to f32 on Eigen beat oneDNN's bf16 products
// (docs/perf.md, "A Xeon without AMX").
std::atomic<bool>& dnnl_slot() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("ARENO_DNNL");
    if (env == nullptr) return cpu_isa_supported() >= CpuIsa::amx;
    return std::strcmp(env, "0") != 0;
  }()};
  return on;
}

// Whether oneDNN runs a bf16 matmul on this CPU at all (creating the
// primitive throws `unimplemented` where it does not), asked once: without
// it every bf16 GEMM would pay for a thrown exception before its fallback.
bool bf16_runs_here() {
  static const bool runs = [] {
    using dt = dnnl::memory::data_type;
    using dims = dnnl::memory::dims;
    try {
      const dnnl::memory::desc m(dims{2, 2}, dt::bf16, dims{2, 1});
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(m, m, m), dnnl_state().engine);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return runs;
}

}  // namespace

bool dnnl_enabled() { return dnnl_slot().load(std::memory_order_relaxed) && bf16_runs_here(); }

bool set_dnnl_enabled(bool on) {
  dnnl_slot().store(on, std::memory_order_relaxed);
  return on && bf16_runs_here();
}

namespace {

template <typename O>
bool gemm(int64_t M, int64_t N, int64_t K, const BFloat16* a, int64_t a_rs, int64_t a_cs, const BFloat16* b,
          int64_t b_rs, int64_t b_cs, O* out, int64_t ldo, const BFloat16* bias = nullptr, float beta = 0.0f,
          float alpha = 1.0f) {
  if (!dnnl_enabled() || M <= 0 || N <= 0 || K <= 0) return false;
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  try {
    Dnnl& d = dnnl_state();
    const dnnl::memory::desc am(dims{M, K}, dt::bf16, dims{a_rs, a_cs});
    const dnnl::memory::desc bm(dims{K, N}, dt::bf16, dims{b_rs, b_cs});
    const dnnl::memory::desc cm(dims{M, N}, std::is_same_v<O, float> ? dt::f32 : dt::bf16, dims{ldo, 1});
    // oneDNN's primitive cache makes the repeated creation for a shape cheap.
    const dnnl::memory::desc biasm = bias ? dnnl::memory::desc(dims{1, N}, dt::bf16, dims{N, 1}) : dnnl::memory::desc();
    dnnl::primitive_attr attr;
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});  // alpha times the product, before the sum
    if (beta != 0.0f) {  // out = beta out + the product, before the rounding
      dnnl::post_ops po;
      po.append_sum(beta);
      attr.set_post_ops(po);
    }
    const dnnl::matmul::primitive_desc pd(
        bias ? dnnl::matmul::desc(am, bm, biasm, cm) : dnnl::matmul::desc(am, bm, cm), attr, d.engine);
    const dnnl::matmul prim(pd);
    dnnl::memory A(am, d.engine, const_cast<BFloat16*>(a)), B(bm, d.engine, const_cast<BFloat16*>(b)),
        C(cm, d.engine, out);
    if (bias) {
      dnnl::memory Bias(biasm, d.engine, const_cast<BFloat16*>(bias));
      prim.execute(d.stream, {{DNNL_ARG_SRC, A}, {DNNL_ARG_WEIGHTS, B}, {DNNL_ARG_BIAS, Bias}, {DNNL_ARG_DST, C}});
    } else {
      prim.execute(d.stream, {{DNNL_ARG_SRC, A}, {DNNL_ARG_WEIGHTS, B}, {DNNL_ARG_DST, C}});
    }
    d.stream.wait();
    return true;
  } catch (const dnnl::error&) {
    return false;  // shapes or strides it does not take: the caller's own path runs
  }
}

}  // namespace

bool dnnl_gemm_bf16(int64_t M, int64_t N, int64_t K, const BFloat16* a, int64_t a_rs, int64_t a_cs,
                    const BFloat16* b, int64_t b_rs, int64_t b_cs, BFloat16* out, int64_t ldo, float beta,
                    const BFloat16* bias) {
  return gemm(M, N, K, a, a_rs, a_cs, b, b_rs, b_cs, out, ldo, bias, beta);
}

bool dnnl_gemm_bf16(int64_t M, int64_t N, int64_t K, const BFloat16* a, int64_t a_rs, int64_t a_cs,
                    const BFloat16* b, int64_t b_rs, int64_t b_cs, float* out, int64_t ldo, float beta,
                    float alpha) {
  return gemm(M, N, K, a, a_rs, a_cs, b, b_rs, b_cs, out, ldo, nullptr, beta, alpha);
}

#else

bool dnnl_enabled() { return false; }
bool set_dnnl_enabled(bool) { return false; }

bool dnnl_gemm_bf16(int64_t, int64_t, int64_t, const BFloat16*, int64_t, int64_t, const BFloat16*, int64_t, int64_t,
                    BFloat16*, int64_t, float, const BFloat16*) {
  return false;
}
bool dnnl_gemm_bf16(int64_t, int64_t, int64_t, const BFloat16*, int64_t, int64_t, const BFloat16*, int64_t, int64_t,
                    float*, int64_t, float, float) {
  return false;
}

#endif

}  // namespace areno::cpu
