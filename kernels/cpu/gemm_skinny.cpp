// Skinny GEMM kernels (see gemm_skinny.h): one tile template per vector ISA
// (gemm_skinny_tile.inc compiled under each ISA's target), a plain-loop
// fallback, and the run-time choice between them.
// GCC 12 reports false "(may be) used uninitialized" inside its AVX-512
// intrinsics (the _mm256_undefined_pd of _mm512_reduce_add_ps), as in matmul.cpp.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "kernels/cpu/gemm_skinny.h"

#include <immintrin.h>

#include <algorithm>
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
  // One row of x (decode), f32 or bf16 rows shorter than kLongK (`small`:
  // 256 to 768): one weight row at a time. On Zen 3 a plain sequential stream
  // per thread reads fastest there: a probe of the 200064 x 256 f32 head on 2
  // threads read 22-25 GB/s that way against 16-19 with 4 interleaved rows
  // and prefetches 8 KiB ahead (the Xeon's tuning, kept at the AVX-512
  // levels); `small` decode in alternating runs, f32 84-95 -> 101-111
  // tokens/s, bf16 128-152 -> 157-162. bf16 rows then gained from one
  // prefetch a cache line 8 KiB ahead (where one a step had cost): `small`
  // bf16 decode 118-131 -> 145-161 tokens/s, alternated three times; f32
  // rows showed no gain (75-85 against 77-92) and keep none.
  // Longer rows (`full`: 3072 and 8192) take four weight rows with the
  // prefetch: one row is one FMA chain of K/8 dependent steps (4 cycles each
  // on Zen 3) that the core cannot overlap with the next row's; `full` bf16
  // decode 467-505 -> 334-403 ms a token (`bench_llm --tg 16`, alternated
  // twice); on 400 MB of weights at K = 1024 to 8192, one row 12-16 GB/s,
  // four 16-24.
  // int8 weights (half bf16's bytes, three instructions to widen 8 of them)
  // take four rows at every K: `small` int8 decode 3.6-4.5 -> 2.5-3.0 ms a
  // token (one row without the prefetch was slowest, 8 rows slower than 4).
  // Those wide tiles prefetch at least the next tile's rows ahead, one
  // prefetch a cache line (on int8 rows of 3072, 8 KiB ahead asked for this
  // tile's own later rows; `full` int8 decode 257-273 -> 210-247 ms a token
  // in alternating runs, bf16 unchanged). Several rows of x keep the
  // prefetch 8 KiB ahead: without it 8-row decode lost about a third.
  // Several rows of x (a short prompt's prefill, a decode step of up to 16
  // sequences) take 6 rows a tile (12 accumulators: the two weight rows'
  // widening shared by 6 rows instead of 4), and the tiles of a column
  // block prefetch the next block's two weight rows, a share each, so the
  // weights stream in while every tile computes (with 8 KiB ahead on their
  // own rows, the first tile waited on memory and the others did not read
  // it). `full`'s four layer shapes in bf16 (bench/core/bench_skinny, best
  // of 15 and 25 interleaved repetitions): 8 rows 83.6 / 76.2 -> 97.4 /
  // 75.8 GFLOP/s, 12 rows 89.6 / 91.5 -> 95.1 / 97.6, 16 rows 93.5 / 91.5
  // -> 104.0 / 99.9.
  // The sums (lane j adds k = j mod 8 in k order) and so the bits are the
  // same in every tile.
  static constexpr int kWidth = 8, kNB = 2, kWideNB = 4, kShortNB = 1, kLongK = 1024;
  static constexpr int kPrefetch = 8192, kPrefetch1 = 0, kPrefetch1Bf16 = kPrefetch;
  static constexpr bool kLinePrefetch = true, kNextTilePrefetch = true, kNextBlockPrefetch = true;
  static constexpr int kMB = 6;
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
  static constexpr int kWidth = 16, kNB = 4, kWideNB = 8, kShortNB = kWideNB, kLongK = 0;
  static constexpr int kPrefetch = 8192, kPrefetch1 = kPrefetch, kPrefetch1Bf16 = kPrefetch;
  static constexpr bool kLinePrefetch = false, kNextTilePrefetch = false, kNextBlockPrefetch = false;
  static constexpr int kMB = 4;
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
  static constexpr int kWidth = 32, kNB = 4, kWideNB = 8, kShortNB = kWideNB, kLongK = 0;
  static constexpr int kPrefetch = 8192, kPrefetch1 = kPrefetch, kPrefetch1Bf16 = kPrefetch;
  static constexpr bool kLinePrefetch = false, kNextTilePrefetch = false, kNextBlockPrefetch = false;
  static constexpr int kMB = 4;
  static Vec zero() { return _mm512_setzero_ps(); }
  static In load(const BFloat16* p) { return In(_mm512_loadu_si512(p)); }
  static In load_tail(const BFloat16* p, int n) {
    return In(_mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1), p));
  }
  static Vec fma(In x, In w, Vec acc) { return _mm512_dpbf16_ps(acc, x, w); }
  static float sum(Vec v) { return _mm512_reduce_add_ps(v); }
};
#include "kernels/cpu/gemm_skinny_tile.inc"

// The f32 FMAs of several rows of bf16 x on bf16 weights (gemm_skinny_bf16
// from kPairsMinRows rows): one load of 32 weights gives the even-k ones as
// the high halves of its 32-bit lanes after a shift and the odd-k ones after
// a mask, one instruction per 16 weights where a zero-extend and a shift take
// two. x comes widened and split the same way (split_pairs): per 32 k, the 16
// even then the 16 odd, zero-padded to whole blocks of 32. Lane j of an
// accumulator adds x w at k = 32t + 2j + 1, then at 32t + 2j, for t in
// order, each product exact in f32: the pairs of vdpbf16ps in its order, so
// the same bits as the vdpbf16ps tile (the tests check it), except that bf16
// denormals count here. The lanes are then summed as _mm512_reduce_add_ps does.

// 32 bf16 at p (only `rest` of them where rest < 32, the others zero) as
// two f32 vectors: the even k, the odd k.
inline void pairs_at(const BFloat16* p, int64_t rest, __m512& even, __m512& odd) {
  const __m512i raw =
      rest >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << rest) - 1), p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xffff0000u))));
}

// One row of x, K bf16, into xs (K rounded up to 32 floats, 64-byte aligned).
inline void split_pairs(int64_t K, const BFloat16* x, float* xs) {
  for (int64_t k = 0; k < K; k += 32) {
    __m512 e, o;
    pairs_at(x + k, K - k, e, o);
    _mm512_store_ps(xs + k, e);
    _mm512_store_ps(xs + k + 16, o);
  }
}

// MB rows of xs (row stride Kp) times NB weight rows. prefetch_next: also ask
// for the next NB weight rows, one line of each per step, so that block's
// rows arrive from memory while this one computes (the first tile of a
// column block does it; the weights then stream once at the pace of the
// FMAs: `full`'s layers at 12 rows 4-10 % faster than with the prefetcher
// alone).
template <int MB, int NB, typename O>
inline void tile_pairs(int64_t Kp, const float* xs, int64_t K, const BFloat16* w, int64_t ldw, O* out, int64_t ldo,
                       float alpha, float beta, bool prefetch_next) {
  __m512 acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 32) {
    __m512 we[NB], wo[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const BFloat16* p = w + j * ldw + k;
      if (prefetch_next) _mm_prefetch(reinterpret_cast<const char*>(p + NB * ldw), _MM_HINT_T0);
      pairs_at(p, K - k, we[j], wo[j]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512 xe = _mm512_load_ps(xs + i * Kp + k), xo = _mm512_load_ps(xs + i * Kp + k + 16);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xe, we[j], _mm512_fmadd_ps(xo, wo[j], acc[i][j]));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) store_out(out + i * ldo + j, _mm512_reduce_add_ps(acc[i][j]), alpha, beta);
}

// All M rows of xs times the NB weight rows at w.
template <int NB, typename O>
inline void column_block_pairs(int64_t M, int64_t Kp, const float* xs, int64_t K, const BFloat16* w, int64_t ldw,
                               O* out, int64_t ldo, float alpha, float beta) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    tile_pairs<4, NB>(Kp, xs + m * Kp, K, w, ldw, out + m * ldo, ldo, alpha, beta, m == 0);
  const float* x = xs + m * Kp;
  O* o = out + m * ldo;
  switch (M - m) {
    case 3: tile_pairs<3, NB>(Kp, x, K, w, ldw, o, ldo, alpha, beta, m == 0); break;
    case 2: tile_pairs<2, NB>(Kp, x, K, w, ldw, o, ldo, alpha, beta, m == 0); break;
    case 1: tile_pairs<1, NB>(Kp, x, K, w, ldw, o, ldo, alpha, beta, m == 0); break;
    default: break;
  }
}

// All M rows of xs times the weight rows [n0, n1).
template <typename O>
void slice_pairs(int64_t M, int64_t n0, int64_t n1, int64_t Kp, const float* xs, int64_t K, const BFloat16* w,
                 int64_t ldw, O* out, int64_t ldo, float alpha, float beta) {
  constexpr int NB = 4;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) column_block_pairs<NB>(M, Kp, xs, K, w + n * ldw, ldw, out + n, ldo, alpha, beta);
  for (; n < n1; ++n) column_block_pairs<1>(M, Kp, xs, K, w + n * ldw, ldw, out + n, ldo, alpha, beta);
}
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

// Calls body(n0, n1) over groups of 8 weight rows of [0, N), so every
// thread's slice starts on a whole tile, on the OpenMP threads.
template <typename Body>
void split_rows(int64_t M, int64_t N, int64_t K, Body&& body) {
  constexpr int64_t G = 8;
  const int64_t groups = (N + G - 1) / G;
  auto groups_body = [&](int64_t g0, int64_t g1) { body(g0 * G, std::min(N, g1 * G)); };
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
      groups_body(g0, std::min(groups, g0 + chunk));
    }
    return;
  }
  parallel_for(groups, M * K * G, groups_body);
}

// X is float, or BFloat16 at the avx512bf16 level only.
template <typename X, typename W, typename O>
void run(int64_t M, int64_t N, int64_t K, const X* x, int64_t ldx, const W* w, int64_t ldw, const float* scale,
         O* out, int64_t ldo, float alpha, float beta) {
  if (M <= 0 || N <= 0) return;
  const CpuIsa isa = cpu_isa();
  split_rows(M, N, K, [&](int64_t n0, int64_t n1) {
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
  });
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
  const bool pairs = cpu_isa() == CpuIsa::avx512_bf16 && M >= kPairsMinRows;
  if (cpu_isa() >= CpuIsa::avx512_bf16 && !pairs) {
    run<BFloat16, BFloat16, O>(M, N, K, x, ldx, w, ldw, nullptr, out, ldo, alpha, beta);
    return;
  }
#if ARENO_WIDE_ISA
  if (pairs) {
    // x split once into this thread's scratch (the prefill of a short prompt
    // comes here for every linear: no fresh block per call).
    if (M <= 0 || N <= 0) return;
    const int64_t Kp = (K + 31) / 32 * 32;
    float* xs = thread_scratch<float>(ScratchSlot::packed_x, M * Kp);
    for (int64_t m = 0; m < M; ++m) avx512bf16::split_pairs(K, x + m * ldx, xs + m * Kp);
    split_rows(M, N, K, [&](int64_t n0, int64_t n1) {
      avx512bf16::slice_pairs(M, n0, n1, Kp, xs, K, w, ldw, out, ldo, alpha, beta);
    });
    return;
  }
#endif
  // Below avx512bf16: x widened once into this thread's scratch.
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
