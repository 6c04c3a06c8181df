// Row ops (the kernels in kernels/*/rows.*): softmax, layer norm, RMS norm,
// and cross-entropy over log_softmax. Each runs on a contiguous [m, n] view
// with the reduced dimension last.
#include <algorithm>
#include <cmath>

#include "tensor/ops_util.h"

namespace areno {
using namespace detail;

namespace detail {

RowsView to_rows(const Tensor& x, int64_t dim) {
  RowsView rv;
  rv.dim = wrap_dim(dim, std::max<int64_t>(x.dim(), 1));
  Tensor xd = x.detach();
  if (x.dim() == 0) xd = xd.reshape({1});
  Tensor moved = rv.dim == xd.dim() - 1 ? xd : xd.transpose(rv.dim, -1);
  rv.moved = moved.shape();
  int64_t n = moved.size(-1);
  rv.rows = moved.contiguous().reshape({n == 0 ? 0 : moved.numel() / n, n});
  return rv;
}

Tensor from_rows(const Tensor& rows, const RowsView& rv) {
  Shape s = rv.moved;
  s.back() = rows.size(1);
  Tensor t = rows.reshape(s);
  int64_t last = int64_t(s.size()) - 1;
  return rv.dim == last ? t : t.transpose(rv.dim, -1);
}

}  // namespace detail

static Tensor softmax_impl(const Tensor& x, int64_t dim, bool log) {
  check_floating(x, log ? "log_softmax" : "softmax");
  RowsView rv = to_rows(x, dim);
  Tensor y = empty_like(rv.rows);
  if (y.numel()) backend(x.device()).softmax(rv.rows, y, log);
  Tensor out = from_rows(y, rv);
  if (x.dim() == 0) out = out.reshape({});
  if (needs_grad({x})) {
    record(out, log ? "log_softmax" : "softmax", {x}, [y, rv, log, x](const Tensor& g) {
      RowsView gv = to_rows(g, rv.dim);
      Tensor dx = empty_like(y);
      backend(y.device()).softmax_backward(y, gv.rows.to(y.dtype()), dx, log);
      Tensor r = from_rows(dx, rv);
      return std::vector<Tensor>{x.dim() == 0 ? r.reshape({}) : r};
    });
  }
  return out;
}
Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, false); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, true); }

Tensor scaled_softmax(const Tensor& x, double scale, bool causal) {
  check_floating(x, "scaled_softmax");
  if (x.dim() < (causal ? 2 : 1))
    throw std::invalid_argument(fmt::format("scaled_softmax: x {} needs {} dims", x.str(), causal ? 2 : 1));
  if (!std::isfinite(scale)) throw std::invalid_argument("scaled_softmax: the scale must be finite");
  const int64_t n = x.size(-1), tq = causal ? x.size(-2) : 0;
  const Tensor rows = x.detach().contiguous().reshape({n == 0 ? 0 : x.numel() / n, n});
  Tensor y = empty_like(rows);
  if (y.numel()) backend(x.device()).scaled_softmax(rows, y, scale, tq);
  Tensor out = y.reshape(x.shape());
  if (needs_grad({x})) {
    record(out, "scaled_softmax", {x}, [y, scale, x](const Tensor& g) {
      Tensor dx = empty_like(y);
      if (y.numel())
        backend(y.device()).scaled_softmax_backward(y, g.contiguous().reshape(y.shape()).to(y.dtype()), dx, scale);
      return std::vector<Tensor>{dx.reshape(x.shape())};
    });
  }
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

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& a, const Tensor& b, const Tensor& weight, double eps) {
  check_floating(a, "add_rms_norm");
  const int64_t n = a.size(-1);
  if (a.shape() != b.shape() || a.dtype() != b.dtype() || weight.shape() != Shape{n})
    throw std::invalid_argument(fmt::format("add_rms_norm: a and b must match and weight be [{}], got {}, {} and {}", n,
                                            a.str(), b.str(), weight.str()));
  check_same_device(a, b, "add_rms_norm");
  check_same_device(a, weight, "add_rms_norm");
  if (needs_grad({a, b, weight}) || a.numel() == 0) {
    Tensor s = add(a, b);
    return {s, rms_norm(s, weight, eps)};
  }
  Tensor ra = a.contiguous().reshape({-1, n}), rb = b.contiguous().reshape({-1, n});
  const DType st = a.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor s = empty_like(ra), y = empty_like(ra), rs = empty({ra.size(0)}, TensorOptions(st, a.device()));
  backend(a.device()).add_rms_norm(ra, rb, weight.detach().to(a.dtype()).contiguous(), eps, s, y, rs);
  return {s.reshape(a.shape()), y.reshape(a.shape())};
}

namespace {

// The composed rotary (what the fused kernel equals): training through cos
// and sin, which the kernel does not differentiate.
Tensor rotary_composed(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const int64_t d = x.size(-1), r = cos.size(-1);
  Tensor x_rot = r == d ? x : x.narrow(-1, 0, r);
  Tensor rotated = cat({neg(x_rot.narrow(-1, r / 2, r / 2)), x_rot.narrow(-1, 0, r / 2)}, -1);
  Tensor out = add(mul(x_rot, cos), mul(rotated, sin));
  return r == d ? out : cat({out, x.narrow(-1, r, d - r)}, -1);
}

// x [T, H, D] as the kernel takes it: each token's H x D values contiguous.
Tensor rotary_rows(const Tensor& x) {
  const int64_t h = x.size(1), d = x.size(2);
  return x.stride(2) == 1 && (h == 1 || x.stride(1) == d) ? x : x.contiguous();
}

Tensor rotary_run(const Tensor& x, const Tensor& c, const Tensor& s, bool transpose) {
  Tensor out = empty(x.shape(), TensorOptions(x.dtype(), x.device()));
  if (out.numel()) backend(x.device()).rotary(rotary_rows(x), c, s, out, transpose);
  return out;
}

}  // namespace

Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  check_floating(x, "rotary_embedding");
  if (x.dim() != 3)
    throw std::invalid_argument("rotary_embedding: x must be [T, H, D], got " + x.str());
  const int64_t t = x.size(0), d = x.size(2), r = cos.size(-1);
  auto table_ok = [&](const Tensor& c) {
    return c.dtype() == x.dtype() && c.device() == x.device() && c.numel() == t * r &&
           (c.shape() == Shape{t, r} || c.shape() == Shape{t, 1, r});
  };
  if (r % 2 != 0 || r > d || !table_ok(cos) || !table_ok(sin))
    throw std::invalid_argument(fmt::format(
        "rotary_embedding: cos and sin must be [{}, R] or [{}, 1, R] in x's dtype and device with R even and <= "
        "{}, got {} and {} for x {}", t, t, d, cos.str(), sin.str(), x.str()));
  if (cos.requires_grad() || sin.requires_grad())
    return rotary_composed(x, cos.reshape({t, 1, r}), sin.reshape({t, 1, r}));
  Tensor c = cos.detach().contiguous().reshape({t, r}), s = sin.detach().contiguous().reshape({t, r});
  Tensor out = rotary_run(x.detach(), c, s, false);
  if (needs_grad({x}))
    record(out, "rotary_embedding", {x}, [c, s](const Tensor& g) {
      return std::vector<Tensor>{rotary_run(g.detach(), c, s, true)};
    });
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

}  // namespace areno
