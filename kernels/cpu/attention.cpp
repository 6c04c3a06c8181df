// Inference attention on the CPU, f32 and bf16 (bf16 prefill: both products
// from the bf16 operands, on AMX tiles where the CPU has them (attention_amx)
// and on oneDNN otherwise, gemm_dnnl.h; otherwise widened per block;
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

// bf16 prefill on AMX tiles (the amx level), both products from the bf16
// operands as the oneDNN path below computes them, without its [256, keys]
// buffers that outgrew L2 (score, scale/max and split passes went to L3): a
// work item is 32 queries of one head. K and V of each (batch, KV head) are
// packed once as B tiles (K: 16 keys x 32 d per tile, V: 32 keys as 16
// pairs x 16 d); Q's 32 rows are copied zero-padded to Dp (a multiple of 32)
// as A tiles. Per 32 keys the four C tiles of S = Q Kᵀ go straight to a
// [32, keys] f32 row buffer; each row is scaled, its max taken and its
// exponentials split into bf16 high and low parts (exp_split_row_bf16, as
// below); then P V runs over the visible keys with both parts into the same
// f32 tiles (hi V + lo V summed in the tiles instead of after two products),
// and the output is divided by the row's sum and rounded once. Zeros pad keys
// to 32 and d to 16: they add nothing. False when this build has no AMX code.
#if ARENO_AMX_ISA
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
bool attention_amx(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, float sc, bool causal) {
  constexpr int64_t kQ = 32;  // queries per work item: two A tiles
  const int64_t B = q.size(0), HQ = q.size(1), TQ = q.size(2), D = q.size(3);
  const int64_t HKV = k.size(1), TK = k.size(2), G = HQ / HKV;
  const int64_t Dp = (D + 31) / 32 * 32, dblocks = Dp / 32;  // d as the k of Q Kᵀ
  const int64_t Dn = (D + 15) / 16 * 16, dtiles = Dn / 16;   // d as the columns of P V
  const int64_t kp_all = (TK + 31) / 32 * 32;
  const int64_t k_words = kp_all * Dp / 2, v_words = kp_all * Dn / 2;  // per (batch, KV head)
  // From the host allocator (64-byte aligned, as amx_pack_rows stores whole
  // lines; large blocks cached, so no page faults or zeroing per call); every
  // word is written below.
  const Tensor kbuf = empty({B * HKV * k_words}, TensorOptions(DType::i32, Device::cpu()));
  const Tensor vbuf = empty({B * HKV * v_words}, TensorOptions(DType::i32, Device::cpu()));
  uint32_t* kpack = static_cast<uint32_t*>(kbuf.data_ptr());
  uint32_t* vpack = static_cast<uint32_t*>(vbuf.data_ptr());
  const auto* qp = static_cast<const BFloat16*>(q.data_ptr());
  const auto* kptr = static_cast<const BFloat16*>(k.data_ptr());
  const auto* vptr = static_cast<const BFloat16*>(v.data_ptr());
  auto* op = static_cast<BFloat16*>(out.data_ptr());
  parallel_for(B * HKV, TK * D, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / HKV, hk = bh % HKV;
      const BFloat16* k0 = kptr + b * k.stride(0) + hk * k.stride(1);
      const BFloat16* v0 = vptr + b * v.stride(0) + hk * v.stride(1);
      uint32_t* kt = kpack + bh * k_words;
      for (int64_t j16 = 0; j16 < kp_all / 16; ++j16)
        amx_pack_rows(j16, TK, D, dblocks, k0, k.stride(2), kt + j16 * dblocks * 256);
      // V: tile (32 keys, 16 d) holds pair p, column c at [p][c] = (v[2p][c], v[2p + 1][c]).
      uint32_t* vt = vpack + bh * v_words;
      for (int64_t kb = 0; kb < kp_all / 32; ++kb)
        for (int64_t t = 0; t < dtiles; ++t) {
          const int64_t d0 = t * 16;
          const __mmask16 dm = D - d0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (D - d0)) - 1);
          for (int64_t pr = 0; pr < 16; ++pr) {
            const int64_t j = kb * 32 + 2 * pr;
            const __m256i e = j < TK ? _mm256_maskz_loadu_epi16(dm, v0 + j * v.stride(2) + d0) : _mm256_setzero_si256();
            const __m256i o = j + 1 < TK ? _mm256_maskz_loadu_epi16(dm, v0 + (j + 1) * v.stride(2) + d0)
                                         : _mm256_setzero_si256();
            const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(e), _mm512_slli_epi32(_mm512_cvtepu16_epi32(o), 16));
            _mm512_storeu_si512(vt + (kb * dtiles + t) * 256 + pr * 16, w);
          }
        }
    }
  });
  const int64_t qblocks = (TQ + kQ - 1) / kQ;
  parallel_for(B * HQ * qblocks, kQ * TK * D * 4, [&](int64_t lo, int64_t hi) {
    amx_configure_tiles();
    float* S = thread_scratch<float>(ScratchSlot::attn_scores, kQ * kp_all);
    BFloat16* Ph = thread_scratch<BFloat16>(ScratchSlot::attn_probs, 2 * kQ * kp_all);
    BFloat16* Pl = Ph + kQ * kp_all;
    // Q rows (zero-padded), then the output tiles [32, Dn] f32.
    float* rowbuf = thread_scratch<float>(ScratchSlot::attn_rows, kQ * Dp / 2 + kQ * Dn);
    BFloat16* Qb = reinterpret_cast<BFloat16*>(rowbuf);
    float* Ob = rowbuf + kQ * Dp / 2;
    float inv[kQ];
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t blk = item % qblocks, h = (item / qblocks) % HQ, b = item / qblocks / HQ;
      const int64_t i0 = blk * kQ, rows = std::min(kQ, TQ - i0), hk = h / G;
      const int64_t keys = causal ? std::min(TK, i0 + rows + TK - TQ) : TK;
      BFloat16* o = op + ((b * HQ + h) * TQ + i0) * D;
      if (keys <= 0) {  // no visible key: softmax of all -inf is NaN, as the composite gives
        std::fill(o, o + rows * D, BFloat16(std::numeric_limits<float>::quiet_NaN()));
        continue;
      }
      const int64_t kp = (keys + 31) / 32 * 32;
      const BFloat16* q0 = qp + b * q.stride(0) + h * q.stride(1) + i0 * q.stride(2);
      for (int64_t r = 0; r < kQ; ++r) {
        BFloat16* dst = Qb + r * Dp;
        if (r < rows) std::memcpy(dst, q0 + r * q.stride(2), size_t(D) * sizeof(BFloat16));
        std::fill(dst + (r < rows ? D : 0), dst + Dp, BFloat16{});
      }
      // S = Q Kᵀ, 32 keys at a time: C tiles (rows 0-15 | 16-31) x (keys j..j+15 | j+16..j+31).
      const uint32_t* kt = kpack + (b * HKV + hk) * k_words;
      for (int64_t j = 0; j < kp; j += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t db = 0; db < dblocks; ++db) {
          _tile_loadd(4, Qb + db * 32, Dp * 2);
          _tile_loadd(5, Qb + 16 * Dp + db * 32, Dp * 2);
          _tile_loadd(6, kt + ((j / 16) * dblocks + db) * 256, 64);
          _tile_loadd(7, kt + ((j / 16 + 1) * dblocks + db) * 256, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, S + j, kp * 4);
        _tile_stored(1, S + j + 16, kp * 4);
        _tile_stored(2, S + 16 * kp + j, kp * 4);
        _tile_stored(3, S + 16 * kp + j + 16, kp * 4);
      }
      // Each row's softmax parts over its visible keys, zeros past them (and in rows past TQ).
      for (int64_t r = 0; r < kQ; ++r) {
        BFloat16* hr = Ph + r * kp;
        BFloat16* lr = Pl + r * kp;
        const int64_t visible = r >= rows ? 0 : causal ? std::min(keys, i0 + r + TK - TQ + 1) : keys;
        inv[r] = std::numeric_limits<float>::quiet_NaN();  // no visible key: NaN, as above
        if (visible > 0) inv[r] = 1.0f / exp_split_row_bf16(S + r * kp, visible, sc, hr, lr);
        std::fill(hr + std::max<int64_t>(visible, 0), hr + kp, BFloat16{});
        std::fill(lr + std::max<int64_t>(visible, 0), lr + kp, BFloat16{});
      }
      // O = hi V + lo V, two 16-wide column tiles of d at a time.
      const uint32_t* vt = vpack + (b * HKV + hk) * v_words;
      for (int64_t t = 0; t < dtiles; t += 2) {
        const bool two = t + 1 < dtiles;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < kp / 32; ++kb) {
          _tile_loadd(6, vt + (kb * dtiles + t) * 256, 64);
          if (two) _tile_loadd(7, vt + (kb * dtiles + t + 1) * 256, 64);
          for (const BFloat16* P : {Ph, Pl}) {
            _tile_loadd(4, P + kb * 32, kp * 2);
            _tile_loadd(5, P + 16 * kp + kb * 32, kp * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
              _tile_dpbf16ps(1, 4, 7);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
        }
        _tile_stored(0, Ob + t * 16, Dn * 4);
        _tile_stored(2, Ob + 16 * Dn + t * 16, Dn * 4);
        if (two) {
          _tile_stored(1, Ob + t * 16 + 16, Dn * 4);
          _tile_stored(3, Ob + 16 * Dn + t * 16 + 16, Dn * 4);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < D; ++d) o[r * D + d] = BFloat16(Ob[r * Dn + d] * inv[r]);
    }
    _tile_release();
  });
  return true;
}
#pragma GCC pop_options
#else
bool attention_amx(const Tensor&, const Tensor&, const Tensor&, const Tensor&, float, bool) { return false; }
#endif  // ARENO_AMX_ISA

// lse (f32 only; may be null): per query row [B, HQ, TQ], the log of the sum of
// exp(scaled score) over its visible keys, for the backward
// (kernels/cpu/attention_backward.cpp); writing it changes no other value.
template <typename T>
void attention_impl(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, float sc, bool causal,
                    float* lse = nullptr) {
  const int64_t B = q.size(0), HQ = q.size(1), TQ = q.size(2), D = q.size(3);
  const int64_t HKV = k.size(1), TK = k.size(2), G = HQ / HKV;
  // bf16 prefill: on AMX tiles where the CPU has them, else both products on
  // oneDNN in blocks of 256 queries.
  if constexpr (std::is_same_v<T, BFloat16>)
    if (TQ >= kBlock && cpu_isa() >= CpuIsa::amx && attention_amx(q, k, v, out, sc, causal)) return;
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
