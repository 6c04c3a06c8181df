// See gemm_packed.h.
#include "kernels/cpu/gemm_packed.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>
#include <type_traits>

#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/gemm_skinny.h"  // cpu_isa(), ARENO_WIDE_ISA

namespace areno::cpu {

namespace {

// Register tile kMR x kNR; a block of kKC k x kNC columns of the weight is
// packed at a time (128 KiB of f32) and multiplied by kMB rows of x at a time
// (144 x 256 x 4 = 144 KiB of x, 72 KiB of partial sums): with the packed
// block, about 350 KiB, inside a Zen 3 core's 512 KiB L2.
constexpr int64_t kMR = 6, kNR = 16, kKC = 256, kNC = 128, kMB = 144;

}  // namespace

#if ARENO_WIDE_ISA
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace {
// Two adjacent packed panels (32 columns, the second kc * kNR floats after
// the first) on 16-lane vectors: c[R x 32] = (first ? 0 : c) + the kc
// products, each output summed in k order in one f32 accumulator with one
// fused multiply-add per product, as micro below does on 8 lanes (so the
// same bits). 2R accumulators: 12 independent chains at R = 6 cover the
// FMA latency of two ports.
template <int R>
void micro_pair512(int64_t kc, const float* a, int64_t lda, const float* b, float* c, int64_t ldc, bool first) {
  const float* b2 = b + kc * kNR;
  __m512 acc[R][2];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    acc[i][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc);
    acc[i][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + kNR);
  }
  const float* ar[R];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) ar[i] = a + i * lda;
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b + k * kNR), b1 = _mm512_loadu_ps(b2 + k * kNR);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m512 ai = _mm512_set1_ps(ar[i][k]);
      acc[i][0] = _mm512_fmadd_ps(ai, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(ai, b1, acc[i][1]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(c + i * ldc, acc[i][0]);
    _mm512_storeu_ps(c + i * ldc + kNR, acc[i][1]);
  }
}
}  // namespace
#pragma GCC pop_options
#endif

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// float_to_bf16_bits (tensor/dtype.h) on 8 lanes: nearest even, NaN quiet.
inline void store8(BFloat16* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), _mm256_and_si256(_mm256_srli_epi32(u, 16), one)),
      16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i bits = _mm256_blendv_epi8(rounded, quiet, nan);
  // Eight values below 2^16 to eight u16: pack within the 128-bit lanes, then
  // bring lane 1's four next to lane 0's.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Columns [n0, n0 + ncols) and k in [k0, k0 + kc) of the weight as f32
// panels of kNR columns: bp[p * kc * kNR + k * kNR + j] = w[n0 + p kNR + j, k0 + k],
// zero for columns past ncols.
// w_k_major: element (n, k) at w[k * ldw + n] instead (a right operand stored
// [K, N] row-major: x W in autograd's backward, P V): rows of 16 copied as they are.
template <typename W>
void pack_b(const W* w, int64_t ldw, bool w_k_major, int64_t n0, int64_t ncols, int64_t k0, int64_t kc, float* bp) {
  const int64_t panels = (ncols + kNR - 1) / kNR;
  if (w_k_major) {
    for (int64_t p = 0; p < panels; ++p) {
      float* dst = bp + p * kc * kNR;
      const int64_t j0 = p * kNR, valid = std::min<int64_t>(kNR, ncols - j0);
      for (int64_t k = 0; k < kc; ++k) {
        const W* src = w + (k0 + k) * ldw + n0 + j0;
        float* d = dst + k * kNR;
        if (valid == kNR) {
          _mm256_store_ps(d, load8(src));
          _mm256_store_ps(d + 8, load8(src + 8));
        } else {
          for (int64_t j = 0; j < kNR; ++j) d[j] = j < valid ? float(src[j]) : 0.0f;
        }
      }
    }
    return;
  }
  for (int64_t p = 0; p < panels; ++p) {
    float* dst = bp + p * kc * kNR;
    for (int64_t h = 0; h < kNR; h += 8) {
      const int64_t j0 = p * kNR + h, valid = std::clamp<int64_t>(ncols - j0, 0, 8);
      const W* src = w + (n0 + j0) * ldw + k0;
      int64_t k = 0;
      if (valid == 8) {
        for (; k + 8 <= kc; k += 8) {
          __m256 r[8];
          for (int i = 0; i < 8; ++i) r[i] = load8(src + i * ldw + k);
          transpose8(r);
          for (int i = 0; i < 8; ++i) _mm256_store_ps(dst + (k + i) * kNR + h, r[i]);
        }
      }
      for (; k < kc; ++k)
        for (int64_t i = 0; i < 8; ++i) dst[k * kNR + h + i] = i < valid ? float(src[i * ldw + k]) : 0.0f;
    }
  }
}

// R rows of x (f32, row stride lda, from k0) times one packed panel: c[R x
// kNR] (row stride ldc) = (first ? 0 : c) + the kc products, in k order.
template <int R>
inline void micro(int64_t kc, const float* a, int64_t lda, const float* b, float* c, int64_t ldc, bool first) {
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    acc[i][0] = first ? _mm256_setzero_ps() : _mm256_load_ps(c + i * ldc);
    acc[i][1] = first ? _mm256_setzero_ps() : _mm256_load_ps(c + i * ldc + 8);
  }
  const float* ar[R];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) ar[i] = a + i * lda;
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(b + k * kNR), b1 = _mm256_load_ps(b + k * kNR + 8);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 ai = _mm256_broadcast_ss(ar[i] + k);
      acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    _mm256_store_ps(c + i * ldc, acc[i][0]);
    _mm256_store_ps(c + i * ldc + 8, acc[i][1]);
  }
}

// All `rows` rows of x times one packed panel (Pair: two, micro_pair512), in
// tiles of kMR rows and one tile for the rest.
template <bool Pair, int R>
inline void micro_at(int64_t kc, const float* a, int64_t lda, const float* b, float* c, int64_t ldc, bool first) {
#if ARENO_WIDE_ISA
  if constexpr (Pair) {
    micro_pair512<R>(kc, a, lda, b, c, ldc, first);
    return;
  }
#endif
  micro<R>(kc, a, lda, b, c, ldc, first);
}

template <bool Pair>
void panel_rows(int64_t rows, int64_t kc, const float* a, int64_t lda, const float* b, float* c, int64_t ldc,
                bool first) {
  int64_t i = 0;
  for (; i + kMR <= rows; i += kMR) micro_at<Pair, kMR>(kc, a + i * lda, lda, b, c + i * ldc, ldc, first);
  switch (rows - i) {
    case 5: micro_at<Pair, 5>(kc, a + i * lda, lda, b, c + i * ldc, ldc, first); break;
    case 4: micro_at<Pair, 4>(kc, a + i * lda, lda, b, c + i * ldc, ldc, first); break;
    case 3: micro_at<Pair, 3>(kc, a + i * lda, lda, b, c + i * ldc, ldc, first); break;
    case 2: micro_at<Pair, 2>(kc, a + i * lda, lda, b, c + i * ldc, ldc, first); break;
    case 1: micro_at<Pair, 1>(kc, a + i * lda, lda, b, c + i * ldc, ldc, first); break;
    default: break;
  }
}

// out = alpha c (+ beta out) (+ bias), rounded once: the same operations in
// the vector body and the scalar tail.
template <typename W, typename O>
void write_out(int64_t rows, int64_t ncols, const float* c, int64_t ldc, O* out, int64_t ldo, float alpha, float beta,
               const W* bias, const float* scale) {
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  for (int64_t m = 0; m < rows; ++m) {
    const float* cr = c + m * ldc;
    O* o = out + m * ldo;
    int64_t n = 0;
    for (; n + 8 <= ncols; n += 8) {
      __m256 dot = _mm256_load_ps(cr + n);
      if (scale) dot = _mm256_mul_ps(dot, _mm256_loadu_ps(scale + n));
      __m256 v = _mm256_mul_ps(va, dot);
      if (beta != 0.0f) v = _mm256_fmadd_ps(vb, load8(o + n), v);
      if (bias) v = _mm256_add_ps(v, load8(bias + n));
      store8(o + n, v);
    }
    for (; n < ncols; ++n) {
      float v = alpha * (scale ? cr[n] * scale[n] : cr[n]);
      if (beta != 0.0f) v = std::fma(beta, float(o[n]), v);
      if (bias) v += float(bias[n]);
      o[n] = O(v);
    }
  }
}

// One thread's columns [c0, c1) of out, all M rows; `wide`: pairs of panels
// on micro_pair512 (the AVX-512 level).
template <typename W, typename O>
void columns(int64_t M, int64_t c0, int64_t c1, int64_t K, const float* x, int64_t ldx, const W* w, int64_t ldw,
             bool w_k_major, O* out, int64_t ldo, float alpha, float beta, const W* bias, const float* scale,
             [[maybe_unused]] bool wide) {
  constexpr int64_t kLdc = kNC;
  float* bp = thread_scratch<float>(ScratchSlot::packed_b, kKC * kNC);
  float* c = thread_scratch<float>(ScratchSlot::packed_c, (kMB + kMR) * kLdc);
  for (int64_t m0 = 0; m0 < M; m0 += kMB) {
    const int64_t rows = std::min(kMB, M - m0);
    for (int64_t n0 = c0; n0 < c1; n0 += kNC) {
      const int64_t ncols = std::min(kNC, c1 - n0), panels = (ncols + kNR - 1) / kNR;
      for (int64_t k0 = 0; k0 < K; k0 += kKC) {
        const int64_t kc = std::min(kKC, K - k0);
        pack_b(w, ldw, w_k_major, n0, ncols, k0, kc, bp);
        const bool first = k0 == 0;
        const float* a = x + m0 * ldx + k0;
        for (int64_t p = 0; p < panels;) {
          const float* b = bp + p * kc * kNR;
          float* cp = c + p * kNR;
#if ARENO_WIDE_ISA
          if (wide && p + 1 < panels) {  // two panels at once on 16 lanes
            panel_rows<true>(rows, kc, a, ldx, b, cp, kLdc, first);
            p += 2;
            continue;
          }
#endif
          panel_rows<false>(rows, kc, a, ldx, b, cp, kLdc, first);
          ++p;
        }
      }
      if (K <= 0)
        for (int64_t i = 0; i < rows; ++i) std::fill(c + i * kLdc, c + i * kLdc + ncols, 0.0f);
      write_out<W, O>(rows, ncols, c, kLdc, out + m0 * ldo + n0, ldo, alpha, beta, bias ? bias + n0 : nullptr,
                      scale ? scale + n0 : nullptr);
    }
  }
}

// x as dense f32 rows (bf16 widened; any strides). A transposed x (rows
// adjacent, x_rs == 1: autograd's x^T dy) is read a block of 64 rows at a
// time along each column, so every read is a run of adjacent values and the
// block's 64 destination rows stay in L1; row by row it was one cache line
// (and often one page) per value.
template <typename X>
void dense_rows(int64_t M, int64_t K, const X* x, int64_t x_rs, int64_t x_cs, float* dst) {
  if (x_rs == 1 && x_cs != 1) {
    constexpr int64_t kRows = 64;
    parallel_for((M + kRows - 1) / kRows, kRows * K, [&](int64_t lo, int64_t hi) {
      for (int64_t blk = lo; blk < hi; ++blk) {
        const int64_t m0 = blk * kRows, rows = std::min(kRows, M - m0);
        int64_t k = 0;
        if (rows == kRows)  // 8 x 8 tiles through registers: 32-byte reads and writes
          for (; k + 8 <= K; k += 8)
            for (int64_t r0 = 0; r0 < kRows; r0 += 8) {
              __m256 t[8];
              for (int i = 0; i < 8; ++i) t[i] = load8(x + m0 + r0 + (k + i) * x_cs);
              transpose8(t);
              for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (m0 + r0 + i) * K + k, t[i]);
            }
        for (; k < K; ++k) {
          const X* s = x + m0 + k * x_cs;
          float* d = dst + m0 * K + k;
          for (int64_t r = 0; r < rows; ++r) d[r * K] = float(s[r]);
        }
      }
    });
    return;
  }
  parallel_for(M, K, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      const X* s = x + m * x_rs;
      float* d = dst + m * K;
      int64_t k = 0;
      if (x_cs == 1)
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(d + k, load8(s + k));
      for (; k < K; ++k) d[k] = float(s[k * x_cs]);
    }
  });
}

}  // namespace

template <typename X, typename W, typename O>
void gemm_packed_avx2(int64_t M, int64_t N, int64_t K, const X* x, int64_t x_rs, int64_t x_cs, const W* w,
                      int64_t ldw, O* out, int64_t ldo, float alpha, float beta, const W* bias, bool w_k_major,
                      const float* scale) {
  if (M <= 0 || N <= 0) return;
  const float* xf;
  int64_t ldxf;
  if (std::is_same_v<X, float> && (x_cs == 1 || K <= 1)) {
    xf = reinterpret_cast<const float*>(x), ldxf = x_rs;
  } else {
    float* t = thread_scratch<float>(ScratchSlot::packed_x, M * std::max<int64_t>(K, 1));
    dense_rows(M, K, x, x_rs, x_cs, t);
    xf = t, ldxf = K;
  }
  // Threads take whole pairs of panels, so micro_pair512 sees every pair.
  const int64_t pairs = (N + 2 * kNR - 1) / (2 * kNR);
  const bool wide = ARENO_WIDE_ISA && cpu_isa() >= CpuIsa::avx512;
  parallel_for(pairs, M * std::max<int64_t>(K, 1) * 2 * kNR, [&](int64_t p0, int64_t p1) {
    columns<W, O>(M, p0 * 2 * kNR, std::min(N, p1 * 2 * kNR), K, xf, ldxf, w, ldw, w_k_major, out, ldo, alpha, beta,
                  bias, scale, wide);
  });
}

#define ARENO_GEMM_PACKED(X, W, O)                                                                            \
  template void gemm_packed_avx2<X, W, O>(int64_t, int64_t, int64_t, const X*, int64_t, int64_t, const W*, \
                                          int64_t, O*, int64_t, float, float, const W*, bool, const float*);
ARENO_GEMM_PACKED(float, float, float)
ARENO_GEMM_PACKED(float, float, BFloat16)
ARENO_GEMM_PACKED(float, BFloat16, float)
ARENO_GEMM_PACKED(float, BFloat16, BFloat16)
ARENO_GEMM_PACKED(BFloat16, BFloat16, float)
ARENO_GEMM_PACKED(BFloat16, BFloat16, BFloat16)
ARENO_GEMM_PACKED(float, int8_t, float)
ARENO_GEMM_PACKED(float, int8_t, BFloat16)
ARENO_GEMM_PACKED(BFloat16, int8_t, BFloat16)
#undef ARENO_GEMM_PACKED

#pragma GCC pop_options

}  // namespace areno::cpu
