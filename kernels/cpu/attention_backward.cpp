// The backward of the fused f32 attention (attention_train in
// kernels/cpu/attention.cpp), flash-style: no [TQ, TK] score or probability
// matrix in memory. Per block of keys and block of queries that sees it, the
// scores are recomputed, P = exp(scale * S - lse) from the forward's
// log-sum-exp, and
//   dV += P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),
//   dK += scale * dS^T Q,  dQ += scale * dS K.
// A work item is one (batch, KV head, chunk of key blocks): it owns those keys'
// dK and dV (every query head of the GQA group and every query block adds
// into them in a fixed order) and writes its dQ terms into its chunk's own
// buffer; the chunks' buffers are summed in chunk order at the end. The chunk
// count follows from the shapes alone, so the bits do not depend on the
// thread count.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"

namespace areno::cpu {

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Strided = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
using StridedMut = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;
constexpr int64_t kKeyBlock = 64, kQueryBlock = 64;
constexpr int64_t kMinItems = 16;  // work items wanted: key chunks per (batch, KV head) follow from it

}  // namespace

bool CpuBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                    const Tensor& dv, double scale, bool causal) {
  if (!attention_train_supported(q, k, v)) return false;
  for (const Tensor* t : {&out, &lse, &dq, &dk, &dv})
    if (t->dtype() != DType::f32 || !t->is_contiguous()) return false;
  const int64_t B = q.size(0), HQ = q.size(1), TQ = q.size(2), D = q.size(3);
  const int64_t HKV = k.size(1), TK = k.size(2), G = HQ / HKV;
  const float sc = float(scale);
  const Tensor go = dout.dtype() == DType::f32 && dout.stride(3) == 1 ? dout : dout.to(DType::f32).contiguous();
  count_attention_flops(q, k, causal, 5);  // S, dP, dV, dK, dQ
  const int64_t kblocks = (TK + kKeyBlock - 1) / kKeyBlock;
  const int64_t units = B * HKV;
  const int64_t chunks = std::clamp<int64_t>((kMinItems + units - 1) / units, 1, std::max<int64_t>(kblocks, 1));
  const int64_t shift = TK - TQ;  // query i sees keys j <= i + shift when causal

  // rowsum(dO * O) per query row.
  std::vector<float> delta(size_t(B * HQ * TQ));
  const float* op = static_cast<const float*>(out.data_ptr());
  const float* gp = static_cast<const float*>(go.data_ptr());
  parallel_for(B * HQ, TQ * D, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / HQ, h = bh % HQ;
      for (int64_t i = 0; i < TQ; ++i) {
        const float* o = op + (bh * TQ + i) * D;
        const float* g = gp + b * go.stride(0) + h * go.stride(1) + i * go.stride(2);
        float s = 0;
        for (int64_t d = 0; d < D; ++d) s += o[d] * g[d];
        delta[size_t(bh * TQ + i)] = s;
      }
    }
  });

  // dQ terms: straight into dq with one chunk, else one buffer per chunk.
  float* dqp = static_cast<float*>(dq.data_ptr());
  std::vector<float> dq_parts;
  if (chunks > 1) dq_parts.assign(size_t(chunks * B * HQ * TQ * D), 0.0f);
  else std::memset(dqp, 0, size_t(B * HQ * TQ * D) * sizeof(float));
  const float* qp = static_cast<const float*>(q.data_ptr());
  const float* kp = static_cast<const float*>(k.data_ptr());
  const float* vp = static_cast<const float*>(v.data_ptr());
  const float* lp = static_cast<const float*>(lse.data_ptr());
  float* dkp = static_cast<float*>(dk.data_ptr());
  float* dvp = static_cast<float*>(dv.data_ptr());

  parallel_for(units * chunks, TQ * TK * D / chunks, [&](int64_t lo, int64_t hi) {
    RowMat S, dP, dKacc, dVacc;
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t c = item % chunks, hk = (item / chunks) % HKV, b = item / chunks / HKV;
      float* dq_base = chunks > 1 ? dq_parts.data() + c * (B * HQ * TQ * D) : dqp;
      for (int64_t kb = c; kb < kblocks; kb += chunks) {
        const int64_t j0 = kb * kKeyBlock, nk = std::min(kKeyBlock, TK - j0);
        const Strided K(kp + b * k.stride(0) + hk * k.stride(1) + j0 * k.stride(2), nk, D,
                        Eigen::OuterStride<>(k.stride(2)));
        const Strided V(vp + b * v.stride(0) + hk * v.stride(1) + j0 * v.stride(2), nk, D,
                        Eigen::OuterStride<>(v.stride(2)));
        dKacc.setZero(nk, D);
        dVacc.setZero(nk, D);
        // The first query that sees key j0.
        const int64_t first = causal ? std::max<int64_t>(0, j0 - shift) : 0;
        for (int64_t r = 0; r < G; ++r) {
          const int64_t h = hk * G + r, bh = b * HQ + h;
          for (int64_t i0 = first / kQueryBlock * kQueryBlock; i0 < TQ; i0 += kQueryBlock) {
            const int64_t rows = std::min(kQueryBlock, TQ - i0);
            const Strided Q(qp + b * q.stride(0) + h * q.stride(1) + i0 * q.stride(2), rows, D,
                            Eigen::OuterStride<>(q.stride(2)));
            const Strided dO(gp + b * go.stride(0) + h * go.stride(1) + i0 * go.stride(2), rows, D,
                             Eigen::OuterStride<>(go.stride(2)));
            S.noalias() = Q * K.transpose();
            dP.noalias() = dO * V.transpose();
            // P in S's buffer, then dS in dP's; keys a row cannot see are zero in both.
            for (int64_t rr = 0; rr < rows; ++rr) {
              const int64_t i = i0 + rr;
              const int64_t vis = causal ? std::clamp<int64_t>(i + shift + 1 - j0, 0, nk) : nk;
              const float l = lp[bh * TQ + i], dl = delta[size_t(bh * TQ + i)];
              float* s = S.data() + rr * nk;
              float* p = dP.data() + rr * nk;
              for (int64_t j = 0; j < vis; ++j) {
                const float pj = std::exp(s[j] * sc - l);
                s[j] = pj;
                p[j] = pj * (p[j] - dl);
              }
              for (int64_t j = vis; j < nk; ++j) s[j] = p[j] = 0.0f;
            }
            dVacc.noalias() += S.transpose() * dO;
            dKacc.noalias() += dP.transpose() * Q;
            StridedMut(dq_base + (bh * TQ + i0) * D, rows, D, Eigen::OuterStride<>(D)).noalias() += dP * K;
          }
        }
        float* dkr = dkp + ((b * HKV + hk) * TK + j0) * D;
        float* dvr = dvp + ((b * HKV + hk) * TK + j0) * D;
        for (int64_t e = 0; e < nk * D; ++e) {
          dkr[e] = dKacc.data()[e] * sc;
          dvr[e] = dVacc.data()[e];
        }
      }
    }
  });

  // dQ = scale * the chunks' terms, summed in chunk order.
  const int64_t n = B * HQ * TQ * D;
  parallel_for(n, chunks, [&](int64_t lo, int64_t hi) {
    for (int64_t e = lo; e < hi; ++e) {
      float s = chunks > 1 ? dq_parts[size_t(e)] : dqp[e];
      for (int64_t c = 1; c < chunks; ++c) s += dq_parts[size_t(c * n + e)];
      dqp[e] = s * sc;
    }
  });
  return true;
}

}  // namespace areno::cpu
