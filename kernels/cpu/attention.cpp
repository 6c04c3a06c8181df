// Inference attention on the CPU, f32 and bf16 (bf16 prefill: both products on
// oneDNN from the bf16 operands, gemm_dnnl.h; otherwise widened per block;
// computed in f32 either way, the output rounded once): per (batch, head, block of queries) the
// scores of only the keys that block can see, the causal mask, a row softmax
// and the value product, in one pass over a [rows, keys] scratch buffer. Same
// rounding points as the composite op (scores, then the scale multiply, then
// softmax, then P V); the sums run over fewer masked zeros, so results agree
// with it to a few f32 ulps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <limits>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/gemm_dnnl.h"

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

template <typename T>
void attention_impl(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, float sc, bool causal) {
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
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t blk = item % blocks, h = (item / blocks) % HQ, b = item / blocks / HQ;
      const int64_t i0 = blk * kB, rows = std::min(kB, TQ - i0);
      // Keys visible to the block's last query (all keys without the mask).
      const int64_t keys = causal ? std::min(TK, i0 + rows + TK - TQ) : TK;
      T* o = op + ((b * HQ + h) * TQ + i0) * D;
      if (keys <= 0) {  // no visible key: softmax of all -inf is NaN, as the composite gives
        std::fill(o, o + rows * D, T(std::numeric_limits<float>::quiet_NaN()));
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
            continue;
          }
          if (visible < keys) row.tail(keys - visible).setZero();
          auto live = row.head(visible);
          const float mx = live.maxCoeff();
          live = (live - mx).exp();
          live *= 1.0f / live.sum();
        }
      };
      if constexpr (std::is_same_v<T, BFloat16>) {
        // Scores from the bf16 operands in place (exact products, f32 sums);
        // the probabilities split into a bf16 high part and a bf16 low part
        // (P - high), each times V, so P V keeps about 16 bits of P where
        // one bf16 P would keep 8; the output is rounded once.
        if (native) {
          S.resize(rows, keys);
          if (dnnl_gemm_bf16(rows, keys, D, q0, q.stride(2), 1, k0, 1, k.stride(2), S.data(), keys)) {
            softmax_rows();
            const size_t n = size_t(rows * keys);
            Ph.resize(n);
            Pl.resize(n);
            const float* sp = S.data();
            for (size_t i = 0; i < n; ++i) {
              Ph[i] = BFloat16(sp[i]);
              Pl[i] = BFloat16(sp[i] - float(Ph[i]));
            }
            Ow.resize(rows, D);
            Ow2.resize(rows, D);
            if (dnnl_gemm_bf16(rows, D, keys, Ph.data(), keys, 1, v0, v.stride(2), 1, Ow.data(), D) &&
                dnnl_gemm_bf16(rows, D, keys, Pl.data(), keys, 1, v0, v.stride(2), 1, Ow2.data(), D)) {
              for (int64_t i = 0; i < rows * D; ++i) o[i] = T(Ow.data()[i] + Ow2.data()[i]);
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
  {  // Q K^T and P V over the keys each query sees (query i of TQ sees TK - TQ + i + 1 when causal).
    const double TQ = double(q.size(2)), TK = double(k.size(2));
    const double pairs = causal ? TQ * std::max(0.0, TK - TQ) + TQ * (TQ + 1) / 2 : TQ * TK;
    count_flops(4.0 * double(q.size(0)) * double(q.size(1)) * double(q.size(3)) * pairs);
  }
  if (dt == DType::f32)
    attention_impl<float>(q, k, v, out, float(scale), causal);
  else
    attention_impl<BFloat16>(q, k, v, out, float(scale), causal);
  return true;
}

}  // namespace areno::cpu
