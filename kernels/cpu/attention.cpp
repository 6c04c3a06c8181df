// Inference attention on the CPU, f32: per (batch, head, block of queries) the
// scores of only the keys that block can see, the causal mask, a row softmax
// and the value product, in one pass over a [rows, keys] scratch buffer. Same
// rounding points as the composite op (scores, then the scale multiply, then
// softmax, then P V); the sums run over fewer masked zeros, so results agree
// with it to a few f32 ulps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"

namespace areno::cpu {

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Strided = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
constexpr int64_t kBlock = 64;  // query rows per work item

}  // namespace

bool CpuBackend::attention_inference(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& out, double scale, bool causal) {
  if (q.dtype() != DType::f32 || k.dtype() != DType::f32 || v.dtype() != DType::f32 || out.dtype() != DType::f32)
    return false;
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1 || !out.is_contiguous()) return false;
  const int64_t B = q.size(0), HQ = q.size(1), TQ = q.size(2), D = q.size(3);
  const int64_t HKV = k.size(1), TK = k.size(2), G = HQ / HKV;
  const int64_t blocks = (TQ + kBlock - 1) / kBlock;
  const float* qp = static_cast<const float*>(q.data_ptr());
  const float* kp = static_cast<const float*>(k.data_ptr());
  const float* vp = static_cast<const float*>(v.data_ptr());
  float* op = static_cast<float*>(out.data_ptr());
  const float sc = float(scale);
  parallel_for(B * HQ * blocks, kBlock * TK * D * 2, [&](int64_t lo, int64_t hi) {
    // Eigen-allocated (64-byte aligned) scratch: Eigen's vectorised row
    // reductions peel an unaligned head, so a scratch at a varying malloc
    // alignment would change the summation order from run to run.
    RowMat S;
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t blk = item % blocks, h = (item / blocks) % HQ, b = item / blocks / HQ;
      const int64_t i0 = blk * kBlock, rows = std::min(kBlock, TQ - i0);
      // Keys visible to the block's last query (all keys without the mask).
      const int64_t keys = causal ? std::min(TK, i0 + rows + TK - TQ) : TK;
      float* o = op + ((b * HQ + h) * TQ + i0) * D;
      if (keys <= 0) {  // no visible key: softmax of all -inf is NaN, as the composite gives
        std::fill(o, o + rows * D, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      const int64_t hk = h / G;
      Strided Q(qp + b * q.stride(0) + h * q.stride(1) + i0 * q.stride(2), rows, D, Eigen::OuterStride<>(q.stride(2)));
      Strided K(kp + b * k.stride(0) + hk * k.stride(1), keys, D, Eigen::OuterStride<>(k.stride(2)));
      Strided V(vp + b * v.stride(0) + hk * v.stride(1), keys, D, Eigen::OuterStride<>(v.stride(2)));
      S.resize(rows, keys);
      S.noalias() = Q * K.transpose();
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
      Eigen::Map<RowMat>(o, rows, D).noalias() = S * V;
    }
  });
  return true;
}

}  // namespace areno::cpu
