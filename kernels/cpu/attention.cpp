// Inference attention on the CPU, f32 and bf16 (bf16 prefill: both products on
// oneDNN from the bf16 operands, gemm_dnnl.h; otherwise widened per block;
// computed in f32 either way, the output rounded once): per (batch, head, block of queries) the
// scores of only the keys that block can see, the causal mask, a row softmax
// and the value product, in one pass over a [rows, keys] scratch buffer. The
// f32 path keeps the composite op's rounding points (scores, then the scale
// multiply, then softmax, then P V); the sums run over fewer masked zeros, so
// results agree with it to a few f32 ulps. The bf16 prefill divides by the
// softmax's sum after P V instead of before (see below).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/gemm_dnnl.h"
#include "kernels/cpu/gemm_skinny.h"
#include "kernels/cpu/vec_exp.h"

namespace areno::cpu {

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Strided = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
constexpr int64_t kBlock = 64;  // query rows per work item

}  // namespace

namespace {

// Copies a strided [rows, D] block of 16-bit values into a dense f32 matrix.
template <typename T>
void widen_block(const T* p, int64_t rows, int64_t D, int64_t stride, RowMat& out) {
  out.resize(rows, D);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) out(r, d) = float(p[r * stride + d]);
}

// Row passes of the bf16 prefill's softmax (16 lanes at a time through GCC
// vector types; reductions in a fixed order, tails one at a time).

// s[i] *= sc in place; returns the largest.
inline float row_max_scaled(float* s, int64_t n, float sc) {
  int64_t i = 0;
  F16 mx16 = F16{} - std::numeric_limits<float>::infinity();
  for (; i + 16 <= n; i += 16) {
    F16 v;
    std::memcpy(&v, s + i, sizeof v);
    v *= sc;
    std::memcpy(s + i, &v, sizeof v);
    mx16 = v > mx16 ? v : mx16;
  }
  float mx = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < 16; ++l) mx = std::max(mx, mx16[l]);
  for (; i < n; ++i) {
    s[i] *= sc;
    mx = std::max(mx, s[i]);
  }
  return mx;
}

// exp_split_row's work one value at a time, for the tail from i.
inline float exp_split_tail(const float* s, int64_t i, int64_t n, float mx, BFloat16* hi, BFloat16* lo) {
  float sum = 0;
  for (; i < n; ++i) {
    const float x = s[i] - mx;
    const float e = x != x ? x : exp_nonpositive(x);  // NaN stays NaN
    const uint16_t hb = float_to_bf16_bits(e);
    hi[i].bits = hb;
    lo[i].bits = float_to_bf16_bits(e - bf16_bits_to_float(hb));
    sum += e;
  }
  return sum;
}

// One row of scores (n of them, all visible): times sc, then e = exp(x - max)
// (exp_nonpositive) split into a bf16 high part and the bf16 of what it
// leaves, hi = bf16(e), lo = bf16(e - hi), so hi + lo keeps about 16 bits of
// e; returns the sum of the e (the caller divides the row of P V by it).
// split(e, hi, lo) stores one 16-lane group; inlined into each caller so it
// compiles under the caller's target.
template <typename Split>
__attribute__((always_inline)) inline float exp_split_row_with(float* s, int64_t n, float sc, BFloat16* hi,
                                                               BFloat16* lo, Split split) {
  const float mx = row_max_scaled(s, n, sc);
  F16 sum16 = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    F16 v;
    std::memcpy(&v, s + i, sizeof v);
    const F16 e = exp_nonpositive(v - mx);
    sum16 += e;
    split(e, hi + i, lo + i);
  }
  float sum = 0;
  for (int l = 0; l < 16; ++l) sum += sum16[l];
  return sum + exp_split_tail(s, i, n, mx, hi, lo);
}

// Below avx512bf16: BFloat16(float)'s integer rounding, 16 lanes at a time.
float exp_split_row(float* s, int64_t n, float sc, BFloat16* hi, BFloat16* lo) {
  return exp_split_row_with(s, n, sc, hi, lo, [](F16 e, BFloat16* h, BFloat16* l) {
    U16 u;
    std::memcpy(&u, &e, sizeof u);
    const U16 hb = bf16_bits_rne(u), hu = hb << 16;
    F16 hf;
    std::memcpy(&hf, &hu, sizeof hf);
    const F16 d = e - hf;
    U16 du;
    std::memcpy(&du, &d, sizeof du);
    const H16 h16 = __builtin_convertvector(hb, H16), l16 = __builtin_convertvector(bf16_bits_rne(du), H16);
    std::memcpy(static_cast<void*>(h), &h16, sizeof h16);
    std::memcpy(static_cast<void*>(l), &l16, sizeof l16);
  });
}

#if ARENO_WIDE_ISA
// vcvtneps2bf16 for the two roundings (nearest even; an e or remainder below
// 2^-126, nothing next to the row's largest e of 1, counts as zero), for the
// avx512bf16 level and up.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
// The loop is written out here, not through exp_split_row_with: the
// template compiles under the file's target, and on a machine below AVX-512
// an avx512bf16 lambda cannot be inlined into it (nor called with a 64-byte
// vector argument across the two ABIs).
float exp_split_row_bf16(float* s, int64_t n, float sc, BFloat16* hi, BFloat16* lo) {
  const float mx = row_max_scaled(s, n, sc);
  __m512 sum16 = _mm512_setzero_ps();
  const __m512 mxv = _mm512_set1_ps(mx);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 ev = __m512(exp_nonpositive(F16(_mm512_sub_ps(_mm512_loadu_ps(s + i), mxv))));
    sum16 = _mm512_add_ps(sum16, ev);
    const __m256i h16 = __m256i(_mm512_cvtneps_pbh(ev));
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h16), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), h16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), __m256i(_mm512_cvtneps_pbh(_mm512_sub_ps(ev, hf))));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum16);
  float sum = 0;
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  return sum + exp_split_tail(s, i, n, mx, hi, lo);
}
#pragma GCC pop_options
#else
float exp_split_row_bf16(float* s, int64_t n, float sc, BFloat16* hi, BFloat16* lo) {
  return exp_split_row(s, n, sc, hi, lo);  // never reached: cpu_isa() stops at avx2 here
}
#endif  // ARENO_WIDE_ISA

// lse (f32 only; may be null): per query row [B, HQ, TQ], the log of the sum of
// exp(scaled score) over its visible keys, for the backward
// (kernels/cpu/attention_backward.cpp); writing it changes no other value.
template <typename T>
void attention_impl(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, float sc, bool causal,
                    float* lse = nullptr) {
  const int64_t B = q.size(0), HQ = q.size(1), TQ = q.size(2), D = q.size(3);
  const int64_t HKV = k.size(1), TK = k.size(2), G = HQ / HKV;
  // bf16 prefill: both products on oneDNN (AMX here) in blocks of 256 queries.
  const bool native = std::is_same_v<T, BFloat16> && TQ >= kBlock && dnnl_enabled();
  const int64_t kB = native ? 4 * kBlock : kBlock;
  const int64_t blocks = (TQ + kB - 1) / kB;
  const T* qp = static_cast<const T*>(q.data_ptr());
  const T* kp = static_cast<const T*>(k.data_ptr());
  const T* vp = static_cast<const T*>(v.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  parallel_for(B * HQ * blocks, kB * TK * D * 2, [&](int64_t lo, int64_t hi) {
    // Eigen-allocated (64-byte aligned) scratch: Eigen's vectorised row
    // reductions peel an unaligned head, so a scratch at a varying malloc
    // alignment would change the summation order from run to run.
    RowMat S, Qw, Kw, Vw, Ow, Ow2;
    std::vector<BFloat16> Ph, Pl;
    std::vector<float> inv;  // per query row: 1 / the sum of its exponentials
    const bool bf16_level = cpu_isa() >= CpuIsa::avx512_bf16;
    // oneDNN gets dense operands: K and V of one (batch, KV head) copied once
    // for all the blocks of queries (and query heads of a GQA group) that
    // follow, each block of Q copied; with the rows of the [tokens, heads, D]
    // layout strided, the scores took 2.1x and P V 1.5x longer (docs/perf.md).
    // Head dimensions that are not a multiple of 32 (SigLIP's 72) are
    // zero-padded to one (96): the scores took 3.6x longer at 72. Zeros add nothing.
    const int64_t Dp = native && D % 32 != 0 ? (D + 31) / 32 * 32 : D;
    std::vector<BFloat16> Qp, Kp, Vp;
    int64_t packed_for = -1;  // the (batch, KV head) in Kp and Vp
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t blk = item % blocks, h = (item / blocks) % HQ, b = item / blocks / HQ;
      const int64_t i0 = blk * kB, rows = std::min(kB, TQ - i0);
      // Keys visible to the block's last query (all keys without the mask).
      const int64_t keys = causal ? std::min(TK, i0 + rows + TK - TQ) : TK;
      T* o = op + ((b * HQ + h) * TQ + i0) * D;
      float* lse_rows = lse ? lse + (b * HQ + h) * TQ + i0 : nullptr;
      if (keys <= 0) {  // no visible key: softmax of all -inf is NaN, as the composite gives
        std::fill(o, o + rows * D, T(std::numeric_limits<float>::quiet_NaN()));
        if (lse_rows) std::fill(lse_rows, lse_rows + rows, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      const int64_t hk = h / G;
      const T* q0 = qp + b * q.stride(0) + h * q.stride(1) + i0 * q.stride(2);
      const T* k0 = kp + b * k.stride(0) + hk * k.stride(1);
      const T* v0 = vp + b * v.stride(0) + hk * v.stride(1);
      // Scale, causal mask and softmax of S's rows, in place (f32).
      auto softmax_rows = [&] {
        S *= sc;
        for (int64_t r = 0; r < rows; ++r) {
          int64_t visible = keys;
          if (causal) visible = std::min(keys, i0 + r + TK - TQ + 1);
          auto row = S.row(r).array();
          if (visible <= 0) {
            row.setConstant(std::numeric_limits<float>::quiet_NaN());
            if (lse_rows) lse_rows[r] = std::numeric_limits<float>::quiet_NaN();
            continue;
          }
          if (visible < keys) row.tail(keys - visible).setZero();
          auto live = row.head(visible);
          const float mx = live.maxCoeff();
          live = (live - mx).exp();
          const float sum = live.sum();
          if (lse_rows) lse_rows[r] = mx + std::log(sum);
          live *= 1.0f / sum;
        }
      };
      if constexpr (std::is_same_v<T, BFloat16>) {
        // Scores from the bf16 operands (exact products, f32 sums); per row
        // the exponentials e split into a bf16 high part and a bf16 low part
        // (e - high), each times V, so P V keeps about 16 bits of P where one
        // bf16 P would keep 8; the sum of the two products divided by the
        // row's sum of e and rounded once.
        if (native) {
          if (packed_for != b * HKV + hk) {
            packed_for = b * HKV + hk;
            if (Dp != D) {  // the padding columns zero
              Kp.assign(size_t(TK * Dp), BFloat16{});
              Vp.assign(size_t(TK * Dp), BFloat16{});
            } else {
              Kp.resize(size_t(TK * Dp));
              Vp.resize(size_t(TK * Dp));
            }
            for (int64_t j = 0; j < TK; ++j) {
              std::memcpy(Kp.data() + j * Dp, k0 + j * k.stride(2), size_t(D) * sizeof(T));
              std::memcpy(Vp.data() + j * Dp, v0 + j * v.stride(2), size_t(D) * sizeof(T));
            }
          }
          if (Dp != D) Qp.assign(size_t(rows * Dp), BFloat16{});
          else Qp.resize(size_t(rows * Dp));
          for (int64_t r = 0; r < rows; ++r)
            std::memcpy(Qp.data() + r * Dp, q0 + r * q.stride(2), size_t(D) * sizeof(T));
          S.resize(rows, keys);
          if (dnnl_gemm_bf16(rows, keys, Dp, Qp.data(), Dp, 1, Kp.data(), 1, Dp, S.data(), keys)) {
            const size_t n = size_t(rows * keys);
            Ph.resize(n);
            Pl.resize(n);
            inv.assign(size_t(rows), std::numeric_limits<float>::quiet_NaN());
            for (int64_t r = 0; r < rows; ++r) {
              BFloat16* hr = Ph.data() + r * keys;
              BFloat16* lr = Pl.data() + r * keys;
              const int64_t visible = causal ? std::min(keys, i0 + r + TK - TQ + 1) : keys;
              if (visible <= 0) {
                std::fill(hr, hr + keys, BFloat16(std::numeric_limits<float>::quiet_NaN()));
                std::fill(lr, lr + keys, BFloat16(std::numeric_limits<float>::quiet_NaN()));
                continue;
              }
              float* sr = S.data() + r * keys;
              inv[size_t(r)] = 1.0f / (bf16_level ? exp_split_row_bf16(sr, visible, sc, hr, lr)
                                                  : exp_split_row(sr, visible, sc, hr, lr));
              std::fill(hr + visible, hr + keys, BFloat16{});
              std::fill(lr + visible, lr + keys, BFloat16{});
            }
            Ow.resize(rows, Dp);
            Ow2.resize(rows, Dp);
            if (dnnl_gemm_bf16(rows, Dp, keys, Ph.data(), keys, 1, Vp.data(), Dp, 1, Ow.data(), Dp) &&
                dnnl_gemm_bf16(rows, Dp, keys, Pl.data(), keys, 1, Vp.data(), Dp, 1, Ow2.data(), Dp)) {
              for (int64_t r = 0; r < rows; ++r)
                for (int64_t d = 0; d < D; ++d) o[r * D + d] = T((Ow(r, d) + Ow2(r, d)) * inv[size_t(r)]);
              continue;
            }
          }
        }
      }
      // f32 operands in place; 16-bit ones widened per block (the products
      // and sums run in f32, the output is rounded once).
      auto view = [&](const T* p, int64_t n, int64_t stride, RowMat& buf) {
        if constexpr (std::is_same_v<T, float>) {
          return Strided(p, n, D, Eigen::OuterStride<>(stride));
        } else {
          widen_block(p, n, D, stride, buf);
          return Strided(buf.data(), n, D, Eigen::OuterStride<>(D));
        }
      };
      const Strided Q = view(q0, rows, q.stride(2), Qw), K = view(k0, keys, k.stride(2), Kw),
                    V = view(v0, keys, v.stride(2), Vw);
      S.resize(rows, keys);
      S.noalias() = Q * K.transpose();
      softmax_rows();
      if constexpr (std::is_same_v<T, float>) {
        Eigen::Map<RowMat>(o, rows, D).noalias() = S * V;
      } else {
        Ow.noalias() = S * V;
        for (int64_t i = 0; i < rows * D; ++i) o[i] = T(Ow.data()[i]);
      }
    }
  });
}

}  // namespace

bool CpuBackend::attention_inference(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& out, double scale, bool causal) {
  const DType dt = q.dtype();
  if ((dt != DType::f32 && dt != DType::bf16) || k.dtype() != dt || v.dtype() != dt || out.dtype() != dt)
    return false;
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1 || !out.is_contiguous()) return false;
  count_attention_flops(q, k, causal, 2);  // Q K^T and P V
  if (dt == DType::f32)
    attention_impl<float>(q, k, v, out, float(scale), causal);
  else
    attention_impl<BFloat16>(q, k, v, out, float(scale), causal);
  return true;
}

void count_attention_flops(const Tensor& q, const Tensor& k, bool causal, int products) {
  // Query i of TQ sees TK - TQ + i + 1 keys when causal, all TK otherwise.
  const double TQ = double(q.size(2)), TK = double(k.size(2));
  const double pairs = causal ? TQ * std::max(0.0, TK - TQ) + TQ * (TQ + 1) / 2 : TQ * TK;
  count_flops(2.0 * products * double(q.size(0)) * double(q.size(1)) * double(q.size(3)) * pairs);
}

bool attention_train_supported(const Tensor& q, const Tensor& k, const Tensor& v) {
  return q.dtype() == DType::f32 && k.dtype() == DType::f32 && v.dtype() == DType::f32 && q.stride(3) == 1 &&
         k.stride(3) == 1 && v.stride(3) == 1;
}

bool CpuBackend::attention_train(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                 const Tensor& lse, double scale, bool causal) {
  if (!attention_train_supported(q, k, v) || out.dtype() != DType::f32 || !out.is_contiguous() ||
      lse.dtype() != DType::f32 || !lse.is_contiguous() || lse.numel() != q.size(0) * q.size(1) * q.size(2))
    return false;
  count_attention_flops(q, k, causal, 2);
  attention_impl<float>(q, k, v, out, float(scale), causal, static_cast<float*>(lse.data_ptr()));
  return true;
}

}  // namespace areno::cpu
