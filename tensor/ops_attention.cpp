// Scaled dot-product attention: the backend's fused kernel with a backward
// when it has one (kernels/cpu/attention.cpp and attention_backward.cpp: f32),
// else its fused inference kernel when nothing records (with a key padding
// mask too: per batch element over its kept keys), else the composition of
// matmul and softmax (scaled_softmax: scale, causal mask and softmax in one
// pass; the separate passes only with a bias or a key padding mask).
#include <cmath>

#include <fmt/format.h>

#include "tensor/ops_util.h"

namespace areno {
using namespace detail;

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionOptions& opts) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    throw std::invalid_argument("attention: q, k, v must be [B, H, T, D]");
  int64_t b = q.size(0), hq = q.size(1), tq = q.size(2), d = q.size(3);
  int64_t hkv = k.size(1), tk = k.size(2);
  if (k.size(0) != b || v.size(0) != b || v.size(1) != hkv || v.size(2) != tk || k.size(3) != d)
    throw std::invalid_argument(fmt::format("attention: shapes q {} k {} v {} do not match", q.str(), k.str(), v.str()));
  if (hkv == 0 || hq % hkv)
    throw std::invalid_argument(fmt::format("attention: {} query heads not a multiple of {} kv heads", hq, hkv));
  int64_t groups = hq / hkv;
  double scale = opts.scale != 0 ? opts.scale : 1.0 / std::sqrt(double(d));
  const bool needs_grad = grad_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (!opts.bias.defined() && !opts.key_padding_mask.defined() && q.device() == k.device() &&
      q.device() == v.device()) {
    Backend& be = backend(q.device());
    Tensor out = empty({b, hq, tq, d}, TensorOptions(q.dtype(), q.device()));
    // The fused kernel with a backward (flash-style: no [TQ, TK] scores kept
    // for it), with or without a tape, so that a checkpointed forward and its
    // recomputation agree bit for bit.
    Tensor lse = empty({b, hq, tq}, TensorOptions(DType::f32, q.device()));
    if (be.attention_train(q, k, v, out, lse, scale, opts.causal)) {
      if (needs_grad) {
        const Tensor qd = q.detach(), kd = k.detach(), vd = v.detach(), od = out.detach();
        const bool causal = opts.causal;
        record(out, "scaled_dot_product_attention", {q, k, v}, [qd, kd, vd, od, lse, scale, causal](const Tensor& g) {
          const TensorOptions f32(DType::f32, qd.device());
          Tensor dq = empty(qd.shape(), f32), dk = empty(kd.shape(), f32), dv = empty(vd.shape(), f32);
          if (!backend(qd.device()).attention_backward(qd, kd, vd, od, lse, g, dq, dk, dv, scale, causal))
            throw std::logic_error("attention: the backend ran the fused forward but has no backward for it");
          return std::vector<Tensor>{dq, dk, dv};
        });
      }
      return out;
    }
    // Inference: the backend's fused kernel when it has one (no [TQ, TK]
    // score tensor per head, no separate mask/softmax passes).
    if (!needs_grad && inference_kernels_enabled() && be.attention_inference(q, k, v, out, scale, opts.causal))
      return out;
  }
  // Inference with a key padding mask and no bias: a masked key has weight 0,
  // so each batch element's attention is the fused kernel's over the keys it
  // keeps (gathered), with no [TQ, TK] scores or mask passes. An element that
  // keeps no key falls through to the composition (its rows are NaN there).
  if (!opts.bias.defined() && opts.key_padding_mask.defined() && !opts.causal && !needs_grad &&
      inference_kernels_enabled() && q.device() == k.device() && q.device() == v.device() &&
      opts.key_padding_mask.shape() == Shape{b, tk}) {
    const std::vector<float> masked = opts.key_padding_mask.to(DType::f32).to_vector<float>();
    std::vector<std::vector<int64_t>> keep(static_cast<size_t>(b));
    bool all_keep_some = true;
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t j = 0; j < tk; ++j)
        if (masked[size_t(i * tk + j)] == 0.0f) keep[size_t(i)].push_back(j);
      all_keep_some = all_keep_some && !keep[size_t(i)].empty();
    }
    Backend& be = backend(q.device());
    std::vector<Tensor> outs;
    for (int64_t i = 0; all_keep_some && i < b; ++i) {
      Tensor ki = k.narrow(0, i, 1), vi = v.narrow(0, i, 1);
      const std::vector<int64_t>& kept = keep[size_t(i)];
      if (int64_t(kept.size()) < tk) {
        const Tensor idx = from_vector(kept, {int64_t(kept.size())}).to(q.device());
        ki = index_select(ki, 2, idx);
        vi = index_select(vi, 2, idx);
      }
      Tensor out = empty({1, hq, tq, d}, TensorOptions(q.dtype(), q.device()));
      if (!be.attention_inference(q.narrow(0, i, 1), ki, vi, out, scale, /*causal=*/false)) break;
      outs.push_back(out);
    }
    if (all_keep_some && int64_t(outs.size()) == b) return b == 1 ? outs[0] : cat(outs, 0);
  }
  // q heads h = j * groups + r use kv head j.
  Tensor q5 = q.reshape({b, hkv, groups * tq, d});
  if (!opts.bias.defined() && !opts.key_padding_mask.defined()) {
    // The scale, the causal mask and the softmax in one pass over the scores
    // (in q's dtype, as the product gives them), f32 inside, one rounding.
    Tensor p = scaled_softmax(matmul(q5, k.transpose(-1, -2)).reshape({b, hq, tq, tk}), scale, opts.causal);
    if (p.dtype() != v.dtype()) p = p.to(v.dtype());
    return matmul(p.reshape({b, hkv, groups * tq, tk}), v).reshape({b, hq, tq, d});
  }
  Tensor s = mul(matmul(q5, k.transpose(-1, -2)), scale);  // [B, Hkv, G*Tq, Tk]
  s = s.reshape({b, hq, tq, tk});
  DType acc = q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  s = s.to(acc);
  if (opts.bias.defined()) s = add(s, opts.bias.to(acc));
  Tensor neg_inf = full({}, -INFINITY, TensorOptions(acc, q.device()));
  if (opts.causal) {
    Tensor qi = arange(tq, TensorOptions(DType::i64, q.device())).reshape({tq, 1});
    Tensor kj = arange(tk, TensorOptions(DType::i64, q.device())).reshape({1, tk});
    Tensor future = gt(kj, add(qi, double(tk - tq)));
    s = where(future, neg_inf, s);
  }
  if (opts.key_padding_mask.defined()) {
    if (opts.key_padding_mask.shape() != Shape{b, tk})
      throw std::invalid_argument(fmt::format("attention: key_padding_mask must be [{}, {}], got {}", b, tk,
                                              opts.key_padding_mask.str()));
    s = where(opts.key_padding_mask.to(DType::boolean).reshape({b, 1, 1, tk}), neg_inf, s);
  }
  Tensor p = softmax(s, -1).to(v.dtype());
  Tensor o = matmul(p.reshape({b, hkv, groups * tq, tk}), v);  // [B, Hkv, G*Tq, D]
  return o.reshape({b, hq, tq, d});
}

}  // namespace areno
