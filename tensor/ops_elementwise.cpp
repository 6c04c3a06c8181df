#include <cmath>

#include "tensor/ops_util.h"

namespace areno {
using namespace detail;

namespace {

bool is_comparison(BinaryOp op) {
  return op == BinaryOp::eq || op == BinaryOp::ne || op == BinaryOp::lt || op == BinaryOp::le ||
         op == BinaryOp::gt || op == BinaryOp::ge;
}

const char* binary_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::add: return "add";
    case BinaryOp::sub: return "sub";
    case BinaryOp::mul: return "mul";
    case BinaryOp::div: return "div";
    case BinaryOp::pow: return "pow";
    case BinaryOp::maximum: return "maximum";
    case BinaryOp::minimum: return "minimum";
    default: return "binary";
  }
}

// Runs a binary kernel with broadcasting and type promotion; no autograd.
Tensor binary_raw(BinaryOp op, const Tensor& a, const Tensor& b, double alpha = 1.0) {
  const char* name = binary_name(op);
  check_defined(a, name, "first operand");
  check_defined(b, name, "second operand");
  check_same_device(a, b, name);
  DType t = promote_types(a.dtype(), b.dtype());
  if (op == BinaryOp::logical_and || op == BinaryOp::logical_or) t = DType::boolean;
  if (op == BinaryOp::div && !is_floating(t)) t = DType::f32;  // true division
  Shape shape = broadcast_shapes(a.shape(), b.shape());
  Tensor ac = a.dtype() == t ? a.detach() : a.detach().to(t);
  Tensor bc = b.dtype() == t ? b.detach() : b.detach().to(t);
  DType out_t = is_comparison(op) ? DType::boolean : t;
  Tensor out = empty_on(shape, out_t, a.device());
  if (out.numel() > 0)
    backend(a.device()).binary(op, ac.expand(shape), bc.expand(shape), out, alpha);
  return out;
}

Tensor unary_raw(UnaryOp op, const Tensor& x, double p0 = 0, double p1 = 0) {
  check_defined(x, "unary op", "input");
  DType t = x.dtype();
  if (op == UnaryOp::logical_not) {
    Tensor xb = t == DType::boolean ? x.detach() : x.detach().to(DType::boolean);
    Tensor out = empty_on(x.shape(), DType::boolean, x.device());
    if (out.numel()) backend(x.device()).unary(op, xb, out, p0, p1);
    return out;
  }
  bool float_only = !(op == UnaryOp::neg || op == UnaryOp::abs || op == UnaryOp::square ||
                      op == UnaryOp::relu || op == UnaryOp::clamp || op == UnaryOp::affine);
  if (op == UnaryOp::affine && (p0 != std::floor(p0) || p1 != std::floor(p1))) float_only = true;
  if (op == UnaryOp::clamp && (p0 != std::floor(p0) || p1 != std::floor(p1))) float_only = true;
  Tensor xc = x.detach();
  if (t == DType::boolean || (float_only && !is_floating(t))) {
    t = DType::f32;
    xc = xc.to(t);
  }
  Tensor out = empty_on(x.shape(), t, x.device());
  if (out.numel()) backend(x.device()).unary(op, xc, out, p0, p1);
  return out;
}

}  // namespace

namespace detail {
Tensor binary_kernel(BinaryOp op, const Tensor& a, const Tensor& b, double alpha) {
  return binary_raw(op, a, b, alpha);
}
}  // namespace detail

// ---------------------------------------------------------------- arithmetic

Tensor add_scaled(const Tensor& a, const Tensor& b, double alpha) {
  Tensor out = binary_raw(BinaryOp::add, a, b, alpha);
  if (needs_grad({a, b}))
    record(out, "add", {a, b}, [alpha](const Tensor& g) {
      return std::vector<Tensor>{g, alpha == 1.0 ? g : mul(g, alpha)};
    });
  return out;
}
Tensor add(const Tensor& a, const Tensor& b) { return add_scaled(a, b, 1.0); }

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::sub, a, b);
  if (needs_grad({a, b}))
    record(out, "sub", {a, b}, [](const Tensor& g) { return std::vector<Tensor>{g, neg(g)}; });
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::mul, a, b);
  if (needs_grad({a, b})) {
    bool ga = a.requires_grad(), gb = b.requires_grad();
    record(out, "mul", {a, b}, [a, b, ga, gb](const Tensor& g) {
      return std::vector<Tensor>{ga ? mul(g, b) : Tensor(), gb ? mul(g, a) : Tensor()};
    });
  }
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::div, a, b);
  if (needs_grad({a, b})) {
    bool gb = b.requires_grad();
    record(out, "div", {a, b}, [a, b, gb](const Tensor& g) {
      Tensor ga = div(g, b);
      return std::vector<Tensor>{ga, gb ? neg(mul(ga, div(a, b))) : Tensor()};
    });
  }
  return out;
}

Tensor pow(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::pow, a, b);
  if (needs_grad({a, b})) {
    bool gb = b.requires_grad();
    record(out, "pow", {a, b}, [a, b, out = out.detach(), gb](const Tensor& g) {
      // d/da a^b = b a^(b-1); d/db a^b = a^b log a (0 where a == 0)
      Tensor da = mul(g, mul(b, pow(a, sub(b, ones_like(b)))));
      Tensor db;
      if (gb) {
        Tensor la = where(eq(a, zeros_like(a)), zeros_like(a), log(a));
        db = mul(g, mul(out, la));
      }
      return std::vector<Tensor>{da, db};
    });
  }
  return out;
}

static Tensor minmax(BinaryOp op, const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(op, a, b);
  if (needs_grad({a, b})) {
    record(out, op == BinaryOp::maximum ? "maximum" : "minimum", {a, b}, [a, b, op](const Tensor& g) {
      // Ties split the gradient evenly, as torch does.
      Tensor pick_a = op == BinaryOp::maximum ? gt(a, b) : lt(a, b);
      Tensor tie = eq(a, b);
      Tensor wa = add(pick_a.to(g.dtype()), mul(tie.to(g.dtype()), 0.5));
      Tensor ga = mul(g, wa);
      return std::vector<Tensor>{ga, sub(g, ga)};
    });
  }
  return out;
}
Tensor maximum(const Tensor& a, const Tensor& b) { return minmax(BinaryOp::maximum, a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return minmax(BinaryOp::minimum, a, b); }

Tensor add(const Tensor& a, double b) {
  Tensor out = unary_raw(UnaryOp::affine, a, 1.0, b);
  if (needs_grad({a})) record(out, "add_scalar", {a}, [](const Tensor& g) { return std::vector<Tensor>{g}; });
  return out;
}

Tensor mul(const Tensor& a, double b) {
  Tensor out = unary_raw(UnaryOp::affine, a, b, 0.0);
  if (needs_grad({a}))
    record(out, "mul_scalar", {a}, [b](const Tensor& g) { return std::vector<Tensor>{mul(g, b)}; });
  return out;
}

Tensor pow(const Tensor& a, double e) {
  Tensor out = unary_raw(UnaryOp::pow_scalar, a, e);
  if (needs_grad({a}))
    record(out, "pow_scalar", {a}, [a, e](const Tensor& g) {
      return std::vector<Tensor>{mul(g, mul(pow(a, e - 1.0), e))};
    });
  return out;
}

// ---------------------------------------------------------------- comparisons

Tensor eq(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::eq, a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::ne, a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::lt, a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::le, a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::gt, a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::ge, a, b); }
Tensor logical_and(const Tensor& a, const Tensor& b) {
  return binary_raw(BinaryOp::logical_and, a.to(DType::boolean), b.to(DType::boolean));
}
Tensor logical_or(const Tensor& a, const Tensor& b) {
  return binary_raw(BinaryOp::logical_or, a.to(DType::boolean), b.to(DType::boolean));
}
Tensor logical_not(const Tensor& a) { return unary_raw(UnaryOp::logical_not, a); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_same_device(cond, a, "where");
  check_same_device(a, b, "where");
  DType t = promote_types(a.dtype(), b.dtype());
  Shape shape = broadcast_shapes(broadcast_shapes(cond.shape(), a.shape()), b.shape());
  Tensor c = cond.dtype() == DType::boolean ? cond.detach() : cond.detach().to(DType::boolean);
  Tensor out = empty_on(shape, t, a.device());
  if (out.numel())
    backend(a.device()).where(c.expand(shape), a.detach().to(t).expand(shape),
                              b.detach().to(t).expand(shape), out);
  if (needs_grad({a, b}))
    record(out, "where", {a, b}, [c](const Tensor& g) {
      Tensor z = zeros_like(g);
      return std::vector<Tensor>{where(c, g, z), where(c, z, g)};
    });
  return out;
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  return where(mask, full({}, value, TensorOptions(x.dtype(), x.device())), x);
}

// ---------------------------------------------------------------- unary

static Tensor unary_with_grad(UnaryOp op, const Tensor& x, const char* name,
                              std::function<Tensor(const Tensor& x, const Tensor& y, const Tensor& g)> dfn,
                              double p0 = 0, double p1 = 0) {
  Tensor out = unary_raw(op, x, p0, p1);
  if (needs_grad({x}))
    // Capture the output detached: the output owns this node, so holding it would be a cycle.
    record(out, name, {x}, [x, y = out.detach(), dfn](const Tensor& g) { return std::vector<Tensor>{dfn(x, y, g)}; });
  return out;
}

Tensor neg(const Tensor& x) {
  return unary_with_grad(UnaryOp::neg, x, "neg", [](auto&, auto&, const Tensor& g) { return neg(g); });
}
Tensor exp(const Tensor& x) {
  return unary_with_grad(UnaryOp::exp, x, "exp", [](auto&, const Tensor& y, const Tensor& g) { return mul(g, y); });
}
Tensor log(const Tensor& x) {
  return unary_with_grad(UnaryOp::log, x, "log", [](const Tensor& x, auto&, const Tensor& g) { return div(g, x); });
}
Tensor sqrt(const Tensor& x) {
  return unary_with_grad(UnaryOp::sqrt, x, "sqrt",
                         [](auto&, const Tensor& y, const Tensor& g) { return div(mul(g, 0.5), y); });
}
Tensor rsqrt(const Tensor& x) {
  return unary_with_grad(UnaryOp::rsqrt, x, "rsqrt", [](const Tensor& x, const Tensor& y, const Tensor& g) {
    return mul(mul(g, div(y, x)), -0.5);
  });
}
Tensor abs(const Tensor& x) {
  return unary_with_grad(UnaryOp::abs, x, "abs", [](const Tensor& x, auto&, const Tensor& g) {
    Tensor z = zeros_like(x);
    return mul(g, sub(gt(x, z).to(g.dtype()), lt(x, z).to(g.dtype())));
  });
}
Tensor sin(const Tensor& x) {
  return unary_with_grad(UnaryOp::sin, x, "sin", [](const Tensor& x, auto&, const Tensor& g) { return mul(g, cos(x)); });
}
Tensor cos(const Tensor& x) {
  return unary_with_grad(UnaryOp::cos, x, "cos",
                         [](const Tensor& x, auto&, const Tensor& g) { return neg(mul(g, sin(x))); });
}
Tensor square(const Tensor& x) {
  return unary_with_grad(UnaryOp::square, x, "square",
                         [](const Tensor& x, auto&, const Tensor& g) { return mul(g, mul(x, 2.0)); });
}
Tensor reciprocal(const Tensor& x) {
  return unary_with_grad(UnaryOp::reciprocal, x, "reciprocal",
                         [](auto&, const Tensor& y, const Tensor& g) { return neg(mul(g, mul(y, y))); });
}
Tensor clamp(const Tensor& x, std::optional<double> lo, std::optional<double> hi) {
  double l = lo.value_or(-INFINITY), h = hi.value_or(INFINITY);
  return unary_with_grad(UnaryOp::clamp, x, "clamp", [l, h](const Tensor& x, auto&, const Tensor& g) {
    Tensor inside = logical_and(ge(x, full_like(x, l)), le(x, full_like(x, h)));
    return mul(g, inside.to(g.dtype()));
  }, l, h);
}

static Tensor act_backward(BinaryOp op, const Tensor& a, const Tensor& g) {
  return detail::binary_kernel(op, a, g, 1.0);
}
Tensor relu(const Tensor& x) {
  return unary_with_grad(UnaryOp::relu, x, "relu",
                         [](const Tensor& x, auto&, const Tensor& g) { return act_backward(BinaryOp::relu_backward, x, g); });
}
Tensor silu(const Tensor& x) {
  return unary_with_grad(UnaryOp::silu, x, "silu",
                         [](const Tensor& x, auto&, const Tensor& g) { return act_backward(BinaryOp::silu_backward, x, g); });
}
Tensor silu_and_mul(const Tensor& x) {
  check_floating(x, "silu_and_mul");
  if (x.dim() < 1 || x.size(-1) % 2 != 0)
    throw std::invalid_argument("silu_and_mul: the last dim must be even (gate | up), got " + x.str());
  const int64_t n = x.size(-1) / 2;
  // Rows of unit stride a fixed distance apart (a packed linear output, or a
  // slice of one) go in as they are; anything else is made dense first.
  Tensor rows = x.detach();
  if (!(rows.dim() == 2 && rows.stride(1) == 1)) rows = rows.contiguous().reshape({-1, 2 * n});
  Tensor y = empty({rows.size(0), n}, TensorOptions(x.dtype(), x.device()));
  if (y.numel()) backend(x.device()).silu_and_mul(rows, y);
  Shape shape = x.shape();
  shape.back() = n;
  Tensor out = y.reshape(shape);
  if (needs_grad({x})) {
    record(out, "silu_and_mul", {x}, [rows, n, shape = x.shape()](const Tensor& g) {
      // d gate = silu'(gate) * (dy * up), d up = dy * silu(gate): the
      // gradients of mul(up, silu(gate)), with the same rounding points.
      Tensor gate = rows.narrow(1, 0, n), up = rows.narrow(1, n, n);
      Tensor dy = g.reshape({-1, n});
      Tensor dgate = act_backward(BinaryOp::silu_backward, gate, mul(dy, up));
      return std::vector<Tensor>{cat({dgate, mul(dy, silu(gate))}, 1).reshape(shape)};
    });
  }
  return out;
}
Tensor sigmoid(const Tensor& x) {
  return unary_with_grad(UnaryOp::sigmoid, x, "sigmoid",
                         [](auto&, const Tensor& y, const Tensor& g) { return act_backward(BinaryOp::sigmoid_backward, y, g); });
}
Tensor tanh(const Tensor& x) {
  return unary_with_grad(UnaryOp::tanh, x, "tanh",
                         [](auto&, const Tensor& y, const Tensor& g) { return act_backward(BinaryOp::tanh_backward, y, g); });
}
Tensor gelu(const Tensor& x) {
  return unary_with_grad(UnaryOp::gelu, x, "gelu",
                         [](const Tensor& x, auto&, const Tensor& g) { return act_backward(BinaryOp::gelu_backward, x, g); });
}
Tensor gelu_tanh(const Tensor& x) {
  return unary_with_grad(UnaryOp::gelu_tanh, x, "gelu_tanh", [](const Tensor& x, auto&, const Tensor& g) {
    return act_backward(BinaryOp::gelu_tanh_backward, x, g);
  });
}

Tensor cast(const Tensor& x, DType dtype) { return x.to(dtype); }

// ---------------------------------------------------------------- checks

double max_abs_diff(const Tensor& a, const Tensor& b) {
  NoGradGuard ng;
  auto va = a.to_vector<double>(), vb = b.expand(a.shape()).to_vector<double>();
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    if (std::isnan(va[i]) != std::isnan(vb[i])) return INFINITY;
    if (!std::isnan(va[i])) m = std::max(m, std::abs(va[i] - vb[i]));
  }
  return m;
}

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol) {
  NoGradGuard ng;
  if (a.shape() != b.shape()) return false;
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i) {
    if (std::isnan(va[i]) || std::isnan(vb[i])) {
      if (std::isnan(va[i]) != std::isnan(vb[i])) return false;
      continue;
    }
    if (va[i] == vb[i]) continue;  // infinities
    if (std::abs(va[i] - vb[i]) > atol + rtol * std::abs(vb[i])) return false;
  }
  return true;
}

}  // namespace areno
