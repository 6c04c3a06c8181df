#include "tensor/ops_util.h"

namespace areno {
using namespace detail;

namespace {

// A matrix operand the kernel accepts: last two dims row- or column-major.
bool kernel_layout_ok(const Tensor& t) {
  int64_t r = t.size(-2), c = t.size(-1);
  int64_t sr = t.stride(-2), sc = t.stride(-1);
  if (c == 1 || r == 1) return true;
  return (sc == 1 && sr >= c) || (sr == 1 && sc >= r);
}

// x expanded to batch + [r, c] as a [B, r, c] tensor the kernel accepts.
Tensor as_batched(const Tensor& x, const Shape& batch) {
  Shape full = batch;
  full.push_back(x.size(-2));
  full.push_back(x.size(-1));
  Tensor e = x.expand(full);
  int64_t b = shape_numel(batch);
  Tensor v;
  // One batch dim of stride 0 (pure broadcast) keeps the data shared.
  bool all_broadcast = true;
  for (size_t i = 0; i < batch.size(); ++i)
    if (e.stride(int64_t(i)) != 0 && batch[i] != 1) all_broadcast = false;
  if (all_broadcast) {
    v = make_tensor(e.storage(), e.offset(), {b, full[full.size() - 2], full.back()},
                    {0, e.stride(-2), e.stride(-1)}, e.dtype());
  } else {
    Tensor r = e.reshape({b, full[full.size() - 2], full.back()});
    v = r;
  }
  if (!kernel_layout_ok(v)) v = v.contiguous();
  return v;
}

Tensor matmul_raw(const Tensor& a, const Tensor& b) {
  // a: [..., M, K], b: [..., K, N], both at least 2-D
  int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  if (b.size(-2) != K)
    throw std::invalid_argument(fmt::format("matmul: {} @ {}: inner dimensions differ ({} vs {})",
                                            shape_str(a.shape()), shape_str(b.shape()), K, b.size(-2)));
  DType t = promote_types(a.dtype(), b.dtype());
  if (!is_floating(t)) throw std::invalid_argument("matmul needs floating-point operands");
  Tensor ad = a.detach().to(t), bd = b.detach().to(t);
  Shape ab(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
  Shape batch = broadcast_shapes(ab, bb);
  Shape out_shape = batch;
  out_shape.push_back(M);
  out_shape.push_back(N);
  // Fold a's batch into rows when b is one shared matrix: one large GEMM.
  if (bb.empty() && !ab.empty()) {
    Tensor a2 = ad.reshape({-1, K});
    if (!kernel_layout_ok(a2)) a2 = a2.contiguous();
    Tensor b2 = kernel_layout_ok(bd) ? bd : bd.contiguous();
    Tensor out = empty({1, a2.size(0), N}, TensorOptions(t, a.device()));
    if (out.numel()) {
      if (K == 0) out.fill_(0);
      else backend(a.device()).matmul(a2.unsqueeze(0), b2.unsqueeze(0), out, 1.0, 0.0);
    }
    return out.reshape(out_shape);
  }
  Tensor a3 = as_batched(ad, batch), b3 = as_batched(bd, batch);
  Tensor out = empty({shape_numel(batch), M, N}, TensorOptions(t, a.device()));
  if (out.numel()) {
    if (K == 0) out.fill_(0);
    else backend(a.device()).matmul(a3, b3, out, 1.0, 0.0);
  }
  return out.reshape(out_shape);
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  check_defined(a, "matmul", "a");
  check_defined(b, "matmul", "b");
  check_same_device(a, b, "matmul");
  if (a.dim() == 0 || b.dim() == 0) throw std::invalid_argument("matmul of a 0-d tensor");
  if (a.dim() == 1 && b.dim() == 1) return sum(mul(a, b));
  if (a.dim() == 1) return matmul(a.unsqueeze(0), b).squeeze(-2);
  if (b.dim() == 1) return matmul(a, b.unsqueeze(-1)).squeeze(-1);
  Tensor out = matmul_raw(a, b);
  if (needs_grad({a, b})) {
    bool ga = a.requires_grad(), gb = b.requires_grad();
    record(out, "matmul", {a, b}, [a, b, ga, gb](const Tensor& g) {
      Tensor da = ga ? sum_to(matmul(g, b.transpose(-1, -2)), a.shape()) : Tensor();
      Tensor db = gb ? sum_to(matmul(a.transpose(-1, -2), g), b.shape()) : Tensor();
      return std::vector<Tensor>{da, db};
    });
  }
  return out;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (weight.dim() != 2)
    throw std::invalid_argument("linear: weight must be [out, in], got " + weight.str());
  if (x.size(-1) != weight.size(1))
    throw std::invalid_argument(fmt::format("linear: input {} has {} features, weight {} expects {}",
                                            x.str(), x.size(-1), weight.str(), weight.size(1)));
  // Inference in bf16: the bias in the GEMM's one rounding where the backend can.
  if (bias.defined() && x.dtype() == DType::bf16 && weight.dtype() == DType::bf16 && bias.dtype() == DType::bf16 &&
      bias.dim() == 1 && bias.size(0) == weight.size(0) && x.device() == weight.device() &&
      bias.device() == x.device() && x.numel() > 0 && weight.size(1) > 0 && !needs_grad({x, weight, bias})) {
    Shape out_shape = x.shape();
    out_shape.back() = weight.size(0);
    const Tensor x2 = x.reshape({-1, weight.size(1)}).contiguous();
    Tensor out = empty({x2.size(0), weight.size(0)}, TensorOptions(x.dtype(), x.device()));
    if (backend(x.device()).linear_bias(x2, weight.contiguous(), bias.contiguous(), out)) return out.reshape(out_shape);
  }
  Tensor y = matmul(x, weight.t());
  if (bias.defined()) y = add(y, bias);
  return y;
}

std::pair<Tensor, Tensor> linear_pair(const Tensor& x, const Tensor& w1, const Tensor& w2) {
  check_defined(x, "linear_pair", "x");
  check_defined(w1, "linear_pair", "w1");
  check_defined(w2, "linear_pair", "w2");
  if (x.dim() == 2 && w1.dim() == 2 && w2.dim() == 2 && x.size(1) == w1.size(1) && x.size(1) == w2.size(1) &&
      x.dtype() == w1.dtype() && x.dtype() == w2.dtype() && x.device() == w1.device() &&
      x.device() == w2.device() && x.numel() > 0 && w1.numel() > 0 && w2.numel() > 0 && !needs_grad({x, w1, w2})) {
    const TensorOptions o(x.dtype(), x.device());
    Tensor y1 = empty({x.size(0), w1.size(0)}, o), y2 = empty({x.size(0), w2.size(0)}, o);
    if (backend(x.device()).linear_pair(x.contiguous(), w1.contiguous(), w2.contiguous(), y1, y2)) return {y1, y2};
  }
  return {linear(x, w1), linear(x, w2)};
}

namespace {

// The checks of linear_add_ and linear_accumulate (`op` names the caller).
void check_linear_add(const Tensor& y, const Tensor& x, const Tensor& weight, const char* op) {
  check_defined(y, op, "y");
  check_defined(x, op, "x");
  check_defined(weight, op, "weight");
  check_same_device(x, weight, op);
  check_same_device(x, y, op);
  if (x.dim() != 2 || weight.dim() != 2 || y.dim() != 2 || x.size(1) != weight.size(1) || y.size(0) != x.size(0) ||
      y.size(1) != weight.size(0))
    throw std::invalid_argument(fmt::format("{}: y {} += x {} · weight {}ᵀ: shapes do not fit", op, y.str(), x.str(),
                                            weight.str()));
  if (x.dtype() != y.dtype() || weight.dtype() != y.dtype() || !is_floating(y.dtype()))
    throw std::invalid_argument(fmt::format("{}: y {}, x {} and weight {} need one floating dtype", op, y.str(),
                                            x.str(), weight.str()));
  if (!y.is_contiguous()) throw std::invalid_argument(fmt::format("{}: y must be contiguous, got {}", op, y.str()));
}

// t times alpha (t itself for 1): the backward of an alpha-scaled product.
Tensor scaled(const Tensor& t, double alpha) { return alpha == 1.0 ? t : mul(t, alpha); }

// y += alpha·x·weightᵀ on the backend (checked operands).
void gemm_into(const Tensor& y, const Tensor& x, const Tensor& weight, double alpha) {
  if (y.numel() == 0 || x.size(1) == 0) return;
  Tensor a = kernel_layout_ok(x) ? x : x.contiguous();
  Tensor b = weight.t();
  if (!kernel_layout_ok(b)) b = weight.contiguous().t();
  backend(y.device()).matmul(a.unsqueeze(0), b.unsqueeze(0), y.unsqueeze(0), alpha, 1.0);
}

}  // namespace

void linear_add_(const Tensor& y, const Tensor& x, const Tensor& weight, double alpha) {
  check_linear_add(y, x, weight, "linear_add_");
  if (needs_grad({x, weight}) || y.requires_grad())
    throw std::invalid_argument("linear_add_: an operand records autograd history (use linear_accumulate)");
  gemm_into(y, x, weight, alpha);
}

Tensor linear_accumulate(const Tensor& y, const Tensor& x, const Tensor& weight, double alpha) {
  check_linear_add(y, x, weight, "linear_accumulate");
  if (y.requires_grad() && !y.impl()->grad_fn)
    throw std::invalid_argument("linear_accumulate: y is a leaf that requires grad; it cannot be overwritten");
  // A handle of its own on y's storage: the result gets its own history while
  // y's node (which does not read y's value) stays where it is in the graph.
  Tensor out = make_tensor(y.storage(), y.offset(), y.shape(), y.strides(), y.dtype());
  gemm_into(out, x.detach(), weight.detach(), alpha);
  if (needs_grad({y, x, weight})) {
    const bool gx = x.requires_grad(), gw = weight.requires_grad();
    record(out, "linear_accumulate", {y, x, weight}, [x, weight, alpha, gx, gw](const Tensor& g) {
      return std::vector<Tensor>{g, gx ? scaled(matmul(g, weight.detach()), alpha) : Tensor(),
                                 gw ? scaled(matmul(g.t(), x.detach()), alpha) : Tensor()};
    });
  }
  return out;
}

Tensor lora_linear(const Tensor& x, const Tensor& weight, const Tensor& a, const Tensor& b, double alpha) {
  check_defined(x, "lora_linear", "x");
  check_defined(weight, "lora_linear", "weight");
  check_defined(a, "lora_linear", "a");
  check_defined(b, "lora_linear", "b");
  if (x.dim() != 2 || weight.dim() != 2 || a.dim() != 2 || b.dim() != 2 || weight.size(1) != x.size(1) ||
      a.size(1) != x.size(1) || b.size(0) != weight.size(0) || b.size(1) != a.size(0))
    throw std::invalid_argument(fmt::format("lora_linear: x {}, weight {}, a {}, b {}: shapes do not fit", x.str(),
                                            weight.str(), a.str(), b.str()));
  if (weight.dtype() != x.dtype() || a.dtype() != x.dtype() || b.dtype() != x.dtype() || !is_floating(x.dtype()))
    throw std::invalid_argument(fmt::format("lora_linear: x {}, weight {}, a {} and b {} need one floating dtype",
                                            x.str(), weight.str(), a.str(), b.str()));
  Tensor xa, y;
  {
    NoGradGuard ng;
    xa = linear(x, a);
    y = linear(x, weight);
  }
  check_linear_add(y, xa, b, "lora_linear");  // dtypes and devices
  gemm_into(y, xa, b.detach(), alpha);
  if (!needs_grad({x, weight, a, b})) return y;
  const bool gx = x.requires_grad(), gw = weight.requires_grad(), ga = a.requires_grad(), gb = b.requires_grad();
  const Tensor xd = x.detach(), wd = weight.detach(), ad = a.detach(), bd = b.detach();
  record(y, "lora_linear", {x, weight, a, b}, [xd, wd, ad, bd, xa, alpha, gx, gw, ga, gb](const Tensor& g) {
    const Tensor gxa = gx || ga ? scaled(matmul(g, bd), alpha) : Tensor();  // d/d(x·aᵀ)
    Tensor dx;
    if (gx) {
      dx = matmul(g, wd);
      gemm_into(dx, gxa, ad.t(), 1.0);  // += gxa·a, in the same sums
    }
    return std::vector<Tensor>{dx, gw ? matmul(g.t(), xd) : Tensor(), ga ? matmul(gxa.t(), xd) : Tensor(),
                               gb ? scaled(matmul(g.t(), xa), alpha) : Tensor()};
  });
  return y;
}

}  // namespace areno
