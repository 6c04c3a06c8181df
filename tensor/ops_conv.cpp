#include <cmath>

#include "tensor/ops_util.h"

namespace areno {
using namespace detail;

namespace {

// Unfolds x [N, C, H, W] into [N, C*KH*KW, Ho*Wo]; backward folds.
Tensor im2col(const Tensor& x, const ConvGeom& g) {
  Tensor xc = x.detach().contiguous();
  Tensor cols = empty({g.n, g.c * g.kh * g.kw, g.ho * g.wo}, TensorOptions(x.dtype(), x.device()));
  if (cols.numel()) backend(x.device()).im2col(xc, g, cols);
  if (needs_grad({x}))
    record(cols, "im2col", {x}, [g](const Tensor& gr) {
      Tensor dx = zeros({g.n, g.c, g.h, g.w}, TensorOptions(gr.dtype(), gr.device()));
      if (dx.numel()) backend(gr.device()).col2im(gr.contiguous(), g, dx);
      return std::vector<Tensor>{dx};
    });
  return cols;
}

int64_t conv_out(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
  return (in + 2 * p - d * (k - 1) - 1) / s + 1;
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, std::pair<int64_t, int64_t> stride,
              std::pair<int64_t, int64_t> padding, std::pair<int64_t, int64_t> dilation, int64_t groups) {
  if (x.dim() != 4) throw std::invalid_argument("conv2d: input must be [N, C, H, W], got " + x.str());
  if (w.dim() != 4) throw std::invalid_argument("conv2d: weight must be [Cout, Cin/groups, KH, KW], got " + w.str());
  check_same_device(x, w, "conv2d");
  int64_t n = x.size(0), c = x.size(1), cout = w.size(0);
  if (groups <= 0 || c % groups || cout % groups || w.size(1) * groups != c)
    throw std::invalid_argument(fmt::format("conv2d: input {} and weight {} do not match groups = {}", x.str(),
                                            w.str(), groups));
  if (stride.first <= 0 || stride.second <= 0 || dilation.first <= 0 || dilation.second <= 0 ||
      padding.first < 0 || padding.second < 0)
    throw std::invalid_argument("conv2d: stride and dilation must be positive, padding non-negative");
  ConvGeom g{n, c, x.size(2), x.size(3), w.size(2), w.size(3), stride.first, stride.second,
             padding.first, padding.second, dilation.first, dilation.second, 0, 0};
  g.ho = conv_out(g.h, g.kh, g.sh, g.ph, g.dh);
  g.wo = conv_out(g.w, g.kw, g.sw, g.pw, g.dw);
  if (g.ho <= 0 || g.wo <= 0)
    throw std::invalid_argument(fmt::format("conv2d: input {} too small for kernel {}", x.str(), w.str()));
  Tensor xt = x.dtype() == w.dtype() ? x : x.to(w.dtype());
  Tensor cols = im2col(xt, g);  // [N, C*K, L]
  int64_t k = g.kh * g.kw, cg = c / groups, og = cout / groups, l = g.ho * g.wo;
  Tensor y;
  if (groups == 1) {
    y = matmul(w.reshape({cout, c * k}), cols);  // [N, Cout, L]
  } else {
    Tensor cg4 = cols.view({n, groups, cg * k, l});
    Tensor wg = w.reshape({1, groups, og, cg * k});
    y = matmul(wg, cg4).reshape({n, cout, l});
  }
  y = y.reshape({n, cout, g.ho, g.wo});
  if (bias.defined()) y = add(y, bias.reshape({1, cout, 1, 1}));
  return y;
}

Tensor conv1d(const Tensor& x, const Tensor& w, const Tensor& bias, int64_t stride, int64_t padding,
              int64_t dilation, int64_t groups) {
  if (x.dim() != 3) throw std::invalid_argument("conv1d: input must be [N, C, L], got " + x.str());
  if (w.dim() != 3) throw std::invalid_argument("conv1d: weight must be [Cout, Cin/groups, K], got " + w.str());
  Tensor y = conv2d(x.unsqueeze(2), w.unsqueeze(2), bias, {1, stride}, {0, padding}, {1, dilation}, groups);
  return y.squeeze(2);
}

Tensor avg_pool2d(const Tensor& x, std::pair<int64_t, int64_t> kernel, std::pair<int64_t, int64_t> stride,
                  std::pair<int64_t, int64_t> padding) {
  if (x.dim() != 4) throw std::invalid_argument("avg_pool2d: input must be [N, C, H, W], got " + x.str());
  check_floating(x, "avg_pool2d");
  if (stride.first == 0) stride = kernel;
  PoolGeom g{x.size(0), x.size(1), x.size(2), x.size(3), kernel.first, kernel.second,
             stride.first, stride.second, padding.first, padding.second, 0, 0};
  if (g.kh <= 0 || g.kw <= 0 || g.sh <= 0 || g.sw <= 0 || g.ph < 0 || g.pw < 0 || 2 * g.ph > g.kh ||
      2 * g.pw > g.kw)
    throw std::invalid_argument("avg_pool2d: bad kernel/stride/padding");
  g.ho = (g.h + 2 * g.ph - g.kh) / g.sh + 1;
  g.wo = (g.w + 2 * g.pw - g.kw) / g.sw + 1;
  if (g.ho <= 0 || g.wo <= 0) throw std::invalid_argument("avg_pool2d: input " + x.str() + " smaller than the kernel");
  Tensor out = empty({g.n, g.c, g.ho, g.wo}, TensorOptions(x.dtype(), x.device()));
  if (out.numel()) backend(x.device()).avg_pool2d(x.detach().contiguous(), g, out);
  if (needs_grad({x}))
    record(out, "avg_pool2d", {x}, [g](const Tensor& gr) {
      Tensor dx = zeros({g.n, g.c, g.h, g.w}, TensorOptions(gr.dtype(), gr.device()));
      backend(gr.device()).avg_pool2d_backward(gr.contiguous(), g, dx);
      return std::vector<Tensor>{dx};
    });
  return out;
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  check_floating(x, "layer_norm");
  int64_t n = x.size(-1);
  if ((weight.defined() && weight.shape() != Shape{n}) || (bias.defined() && bias.shape() != Shape{n}))
    throw std::invalid_argument(fmt::format("layer_norm: weight/bias must be [{}] for input {}", n, x.str()));
  Tensor rows = x.detach().contiguous().reshape({-1, n});
  DType st = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor y = empty_like(rows), mu = empty({rows.size(0)}, TensorOptions(st, x.device())), rs = empty_like(mu);
  Tensor w = weight.defined() ? weight.detach().to(x.dtype()).contiguous() : ones({n}, TensorOptions(x.dtype(), x.device()));
  Tensor b = bias.defined() ? bias.detach().to(x.dtype()).contiguous() : Tensor();
  if (y.numel()) backend(x.device()).layer_norm(rows, w, b, eps, y, mu, rs);
  Tensor out = y.reshape(x.shape());
  if (needs_grad({x, weight, bias})) {
    bool gw = weight.defined() && weight.requires_grad(), gb = bias.defined() && bias.requires_grad();
    record(out, "layer_norm", {x, weight, bias}, [rows, w, mu, rs, gw, gb, n](const Tensor& g) {
      Tensor dy = g.to(rows.dtype()).contiguous().reshape({-1, n});
      Tensor dx = empty_like(rows);
      Tensor dw = gw ? empty({n}, TensorOptions(rows.dtype(), rows.device())) : Tensor();
      Tensor db = gb ? empty({n}, TensorOptions(rows.dtype(), rows.device())) : Tensor();
      backend(rows.device()).layer_norm_backward(rows, w, mu, rs, dy, dx, dw, db);
      return std::vector<Tensor>{dx.reshape(g.shape()), dw, db};
    });
  }
  return out;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_floating(x, "rms_norm");
  int64_t n = x.size(-1);
  if (weight.shape() != Shape{n})
    throw std::invalid_argument(fmt::format("rms_norm: weight must be [{}] for input {}, got {}", n, x.str(), weight.str()));
  Tensor rows = x.detach().contiguous().reshape({-1, n});
  DType st = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor y = empty_like(rows), rs = empty({rows.size(0)}, TensorOptions(st, x.device()));
  Tensor w = weight.detach().to(x.dtype()).contiguous();
  if (y.numel()) backend(x.device()).rms_norm(rows, w, eps, y, rs);
  Tensor out = y.reshape(x.shape());
  if (needs_grad({x, weight})) {
    bool gw = weight.requires_grad();
    record(out, "rms_norm", {x, weight}, [rows, w, rs, gw, n](const Tensor& g) {
      Tensor dy = g.to(rows.dtype()).contiguous().reshape({-1, n});
      Tensor dx = empty_like(rows);
      Tensor dw = gw ? empty({n}, TensorOptions(rows.dtype(), rows.device())) : Tensor();
      backend(rows.device()).rms_norm_backward(rows, w, rs, dy, dx, dw);
      return std::vector<Tensor>{dx.reshape(g.shape()), dw};
    });
  }
  return out;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                     const std::string& reduction) {
  if (logits.dim() != 2) throw std::invalid_argument("cross_entropy: logits must be [N, C], got " + logits.str());
  if (target.dim() != 1 || target.size(0) != logits.size(0) || !is_integral(target.dtype()))
    throw std::invalid_argument(fmt::format("cross_entropy: target must be an integer [{}] tensor, got {}",
                                            logits.size(0), target.str()));
  Tensor t = target.to(DType::i64);
  Tensor ignore = full({}, double(ignore_index), TensorOptions(DType::i64, t.device()));
  Tensor valid = ne(t, ignore);
  Tensor safe = where(valid, t, zeros({}, TensorOptions(DType::i64, t.device())));
  {
    NoGradGuard ng;
    if (safe.numel()) {
      int64_t hi = int64_t(max(safe).item()), lo = int64_t(min(safe, 0).item());
      if (lo < 0 || hi >= logits.size(1))
        throw std::out_of_range(fmt::format("cross_entropy: target {} out of range for {} classes",
                                            lo < 0 ? lo : hi, logits.size(1)));
    }
  }
  Tensor x = logits.dtype() == DType::f64 ? logits : logits.to(DType::f32);
  Tensor lp = gather(log_softmax(x, -1), 1, safe.unsqueeze(1)).squeeze(1);
  Tensor losses = neg(mul(lp, valid.to(lp.dtype())));
  if (reduction == "none") return losses;
  if (reduction == "sum") return sum(losses);
  if (reduction != "mean") throw std::invalid_argument("cross_entropy: reduction must be mean, sum or none");
  Tensor count = sum(valid.to(lp.dtype()));
  return div(sum(losses), count);
}

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  if (p < 0 || p >= 1) {
    if (p == 1 && training) return mul(x, 0.0);
    if (p < 0 || p > 1) throw std::invalid_argument("dropout probability must be in [0, 1)");
  }
  if (!training || p == 0) return x;
  Tensor u = rand_uniform(x.shape(), gen, 0.0, 1.0, TensorOptions(DType::f32, x.device()));
  Tensor keep = ge(u, full({}, p, TensorOptions(DType::f32, x.device())));
  return mul(x, mul(keep.to(x.dtype()), 1.0 / (1.0 - p)));
}

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
  // Inference without bias or padding mask: the backend's fused kernel when it
  // has one (no [TQ, TK] score tensor per head, no separate mask/softmax passes).
  const bool needs_grad = grad_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (!needs_grad && !opts.bias.defined() && !opts.key_padding_mask.defined() && q.device() == k.device() &&
      q.device() == v.device()) {
    Tensor out = empty({b, hq, tq, d}, TensorOptions(q.dtype(), q.device()));
    if (backend(q.device()).attention_inference(q, k, v, out, scale, opts.causal)) return out;
  }
  // q heads h = j * groups + r use kv head j.
  Tensor q5 = q.reshape({b, hkv, groups * tq, d});
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
