// Skinny GEMM kernels (see gemm_skinny.h): one tile template per vector ISA
// (gemm_skinny_tile.inc compiled under each ISA's target), a plain-loop
// fallback, and the run-time choice between them.
// GCC 12 reports false "(may be) used uninitialized" inside its AVX-512
// intrinsics (the _mm256_undefined_pd of _mm512_reduce_add_ps), as in matmul.cpp.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "kernels/cpu/gemm_skinny.h"

#include <immintrin.h>

#include <atomic>
#include <omp.h>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_common.h"

namespace areno::cpu {

namespace {

// The fallback: the same per-output summation shape (16 lanes over k, then
// the lanes summed), in plain loops the compiler vectorizes for the base ISA.
namespace generic {
template <typename W, typename O>
void slice(int64_t M, int64_t n0, int64_t n1, int64_t K, const float* x, int64_t ldx, const W* w, int64_t ldw,
           const float* scale, O* out, int64_t ldo, float alpha, float beta) {
  constexpr int L = 16;
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * ldw;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * ldx;
      float acc[L] = {};
      int64_t k = 0;
      for (; k + L <= K; k += L)
        for (int j = 0; j < L; ++j) acc[j] += xr[k + j] * float(wr[k + j]);
      for (int j = 0; k < K; ++k, ++j) acc[j] += xr[k] * float(wr[k]);
      float s = 0;
      for (int j = 0; j < L; ++j) s += acc[j];
      store_out(out + m * ldo + n, scale ? s * scale[n] : s, alpha, beta);
    }
  }
}
}  // namespace generic

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct V {
  using Vec = __m256;
  using In = Vec;
  // One row of x (decode): one weight row at a time and no software prefetch.
  // On Zen 3 a plain sequential stream per thread reads fastest: a probe of
  // the 200064 x 256 f32 head on 2 threads read 22-25 GB/s that way against
  // 16-19 with 4 interleaved rows and prefetches 8 KiB ahead (the Xeon's
  // tuning, kept at the AVX-512 levels); `small` decode in alternating runs,
  // f32 84-95 -> 101-111 tokens/s, bf16 128-152 -> 157-162. Several rows of x
  // keep the prefetch: without it 8-row decode lost about a third. The sums
  // (lane j adds k = j mod 8 in k order) and so the bits are the same.
  static constexpr int kWidth = 8, kNB = 2, kWideNB = 1, kPrefetch = 8192, kPrefetch1 = 0;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(const BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static Vec load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  template <typename T>
  static Vec load_tail(const T* p, int n) {
    T buf[kWidth] = {};
    for (int i = 0; i < n; ++i) buf[i] = p[i];
    return load(buf);
  }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(Vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#include "kernels/cpu/gemm_skinny_tile.inc"
}  // namespace avx2
#pragma GCC pop_options

#if ARENO_WIDE_ISA
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {
struct V {
  using Vec = __m512;
  using In = Vec;
  static constexpr int kWidth = 16, kNB = 4, kWideNB = 8, kPrefetch = 8192, kPrefetch1 = kPrefetch;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static Vec load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static Vec load_tail(const float* p, int n) { return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p); }
  static Vec load_tail(const int8_t* p, int n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(__mmask16((1u << n) - 1), p)));
  }
  static Vec load_tail(const BFloat16* p, int n) {
    const __m256i h = _mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(Vec v) { return _mm512_reduce_add_ps(v); }
};
#include "kernels/cpu/gemm_skinny_tile.inc"
}  // namespace avx512
#pragma GCC pop_options

// bf16 activations times bf16 weights: vdpbf16ps multiplies 32 bf16 pairs and
// adds each pair's two products into one f32 lane (exact products; denormal
// inputs and results flushed to zero), one instruction per 32 weights where
// widening takes four per 16.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
namespace avx512bf16 {
struct V {
  using Vec = __m512;
  using In = __m512bh;
  static constexpr int kWidth = 32, kNB = 4, kWideNB = 8, kPrefetch = 8192, kPrefetch1 = kPrefetch;
  static Vec zero() { return _mm512_setzero_ps(); }
  static In load(const BFloat16* p) { return In(_mm512_loadu_si512(p)); }
  static In load_tail(const BFloat16* p, int n) {
    return In(_mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1), p));
  }
  static Vec fma(In x, In w, Vec acc) { return _mm512_dpbf16_ps(acc, x, w); }
  static float sum(Vec v) { return _mm512_reduce_add_ps(v); }
};
#include "kernels/cpu/gemm_skinny_tile.inc"
}  // namespace avx512bf16
#pragma GCC pop_options
#endif  // ARENO_WIDE_ISA

CpuIsa detect() {
  __builtin_cpu_init();
  if (!ARENO_WIDE_ISA) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? CpuIsa::avx2 : CpuIsa::generic;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return amx_usable() ? CpuIsa::amx : CpuIsa::avx512_bf16;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return CpuIsa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::avx2;
  return CpuIsa::generic;
}

CpuIsa from_env() {
  const CpuIsa best = detect();
  const char* env = std::getenv("ARENO_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  const std::string s = env;
  CpuIsa want;
  if (s == "generic") want = CpuIsa::generic;
  else if (s == "avx2") want = CpuIsa::avx2;
  else if (s == "avx512") want = CpuIsa::avx512;
  else if (s == "avx512bf16") want = CpuIsa::avx512_bf16;
  else if (s == "amx") want = CpuIsa::amx;
  else throw std::invalid_argument("ARENO_CPU_ISA: '" + s + "' is not a level (generic, avx2, avx512, avx512bf16, amx)");
  return std::min(want, best);
}

std::atomic<int>& isa_slot() {
  static std::atomic<int> slot{int(from_env())};
  return slot;
}

}  // namespace

CpuIsa cpu_isa_supported() {
  static const CpuIsa best = detect();
  return best;
}

CpuIsa cpu_isa() { return CpuIsa(isa_slot().load(std::memory_order_relaxed)); }

CpuIsa set_cpu_isa(CpuIsa isa) {
  const CpuIsa v = std::min(isa, cpu_isa_supported());
  isa_slot().store(int(v), std::memory_order_relaxed);
  return v;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::generic: return "generic";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512: return "avx512";
    case CpuIsa::avx512_bf16: return "avx512bf16";
    case CpuIsa::amx: return "amx";
  }
  return "?";
}

namespace {

// X is float, or BFloat16 at the avx512bf16 level only.
template <typename X, typename W, typename O>
void run(int64_t M, int64_t N, int64_t K, const X* x, int64_t ldx, const W* w, int64_t ldw, const float* scale,
         O* out, int64_t ldo, float alpha, float beta) {
  if (M <= 0 || N <= 0) return;
  const CpuIsa isa = cpu_isa();
  // Groups of 8 weight rows, so every thread's slice starts on a whole tile.
  constexpr int64_t G = 8;
  const int64_t groups = (N + G - 1) / G;
  auto body = [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * G, n1 = std::min(N, g1 * G);
    if constexpr (std::is_same_v<X, BFloat16>) {
#if ARENO_WIDE_ISA
      return avx512bf16::slice(M, n0, n1, K, x, ldx, w, ldw, scale, out, ldo, alpha, beta);
#else
      throw std::logic_error("skinny GEMM: bf16 rows need the avx512bf16 level, which this build leaves out");
#endif
    } else switch (isa) {
      case CpuIsa::amx:
      case CpuIsa::avx512_bf16:
      case CpuIsa::avx512:
#if ARENO_WIDE_ISA
        return avx512::slice(M, n0, n1, K, x, ldx, w, ldw, scale, out, ldo, alpha, beta);
#else
        [[fallthrough]];
#endif
      case CpuIsa::avx2: return avx2::slice(M, n0, n1, K, x, ldx, w, ldw, scale, out, ldo, alpha, beta);
      case CpuIsa::generic: return generic::slice(M, n0, n1, K, x, ldx, w, ldw, scale, out, ldo, alpha, beta);
    }
  };
  // Many rows (the head, the larger layers): chunks of 64 groups (512 weight
  // rows) taken in turn from a counter instead of one fixed half per thread,
  // so a thread whose core is slowed (a shared machine's neighbours) does not
  // leave the other spinning at the barrier. Each output's sum is the same
  // either way. On the Zen 3 VM, alternating runs of `small` decode: bf16
  // 8.57 against 8.96 ms a token on average over four pairs, f32 3-7 %
  // faster in two of three pairs.
  const int threads = num_threads();
  constexpr int64_t kChunk = 64;
  if (threads > 1 && !omp_in_parallel() && groups >= kChunk * threads && M * K * G * kChunk >= kParallelGrain) {
    std::atomic<int64_t> next{0};
    const int64_t chunk = kChunk;
#pragma omp parallel num_threads(threads)
    for (;;) {
      const int64_t g0 = next.fetch_add(chunk, std::memory_order_relaxed);
      if (g0 >= groups) break;
      body(g0, std::min(groups, g0 + chunk));
    }
    return;
  }
  parallel_for(groups, M * K * G, body);
}

}  // namespace

template <typename W, typename O>
void gemm_skinny(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const W* w, int64_t ldw, O* out,
                 int64_t ldo, float alpha, float beta) {
  run<float, W, O>(M, N, K, x, ldx, w, ldw, nullptr, out, ldo, alpha, beta);
}

template <typename O>
void gemm_skinny_bf16(int64_t M, int64_t N, int64_t K, const BFloat16* x, int64_t ldx, const BFloat16* w,
                      int64_t ldw, O* out, int64_t ldo, float alpha, float beta) {
  if (cpu_isa() >= CpuIsa::amx && M >= kAmxMinRows) {
    gemm_amx_bf16<O>(M, N, K, x, ldx, w, ldw, out, ldo, alpha, beta);
    return;
  }
  const bool widen_x = cpu_isa() == CpuIsa::avx512_bf16 && M >= kWidenMinRows && K >= kWidenMinK;
  if (cpu_isa() >= CpuIsa::avx512_bf16 && !widen_x) {
    run<BFloat16, BFloat16, O>(M, N, K, x, ldx, w, ldw, nullptr, out, ldo, alpha, beta);
    return;
  }
  // x widened once into this thread's scratch (the prefill of a short prompt
  // comes here for every linear: no fresh block per call).
  float* xf = thread_scratch<float>(ScratchSlot::packed_x, std::max<int64_t>(M, 1) * std::max<int64_t>(K, 1));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = float(x[m * ldx + k]);
  run<float, BFloat16, O>(M, N, K, xf, K, w, ldw, nullptr, out, ldo, alpha, beta);
}

template <typename O>
void gemm_skinny_int8(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const int8_t* w, int64_t ldw,
                      const float* scales, O* out, int64_t ldo, float alpha, float beta) {
  run<float, int8_t, O>(M, N, K, x, ldx, w, ldw, scales, out, ldo, alpha, beta);
}

template void gemm_skinny_bf16<float>(int64_t, int64_t, int64_t, const BFloat16*, int64_t, const BFloat16*, int64_t,
                                      float*, int64_t, float, float);
template void gemm_skinny_bf16<BFloat16>(int64_t, int64_t, int64_t, const BFloat16*, int64_t, const BFloat16*,
                                         int64_t, BFloat16*, int64_t, float, float);
template void gemm_skinny_int8<float>(int64_t, int64_t, int64_t, const float*, int64_t, const int8_t*, int64_t,
                                      const float*, float*, int64_t, float, float);
template void gemm_skinny_int8<BFloat16>(int64_t, int64_t, int64_t, const float*, int64_t, const int8_t*, int64_t,
                                         const float*, BFloat16*, int64_t, float, float);
template void gemm_skinny<float, float>(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t,
                                        float*, int64_t, float, float);
template void gemm_skinny<BFloat16, float>(int64_t, int64_t, int64_t, const float*, int64_t, const BFloat16*,
                                           int64_t, float*, int64_t, float, float);
template void gemm_skinny<BFloat16, BFloat16>(int64_t, int64_t, int64_t, const float*, int64_t, const BFloat16*,
                                              int64_t, BFloat16*, int64_t, float, float);
template void gemm_skinny<float, BFloat16>(int64_t, int64_t, int64_t, const float*, int64_t, const float*,
                                           int64_t, BFloat16*, int64_t, float, float);

}  // namespace areno::cpu
