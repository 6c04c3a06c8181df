// Convolution and pooling: im2col + matmul, as the kernels (kernels/*/conv.*).
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

namespace {

// depthwise_conv2d_nhwc from differentiable ops, in the kernel's order and
// accumulation dtype (the same bits): one strided view of x per tap.
Tensor depthwise_composed(const Tensor& x, const Tensor& w, const Tensor& bias, int64_t sh, int64_t sw, int64_t ho,
                          int64_t wo) {
  const DType acc = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor xa = x.to(acc), wa = w.to(acc);
  Tensor y;
  for (int64_t a = 0; a < w.size(1); ++a)
    for (int64_t e = 0; e < w.size(2); ++e) {
      Tensor tap = xa.slice(1, a, a + sh * (ho - 1) + 1, sh).slice(2, e, e + sw * (wo - 1) + 1, sw);
      Tensor term = mul(tap, wa.select(2, e).select(1, a));
      y = y.defined() ? add(y, term) : term;
    }
  if (bias.defined()) y = add(y, bias.to(acc));
  return y.to(x.dtype());
}

}  // namespace

Tensor depthwise_conv2d_nhwc(const Tensor& x, const Tensor& w, const Tensor& bias,
                             std::pair<int64_t, int64_t> stride) {
  check_floating(x, "depthwise_conv2d_nhwc");
  const auto [sh, sw] = stride;
  if (x.dim() != 4 || w.dim() != 3 || w.size(0) != x.size(3) || w.dtype() != x.dtype() ||
      (bias.defined() && (bias.dim() != 1 || bias.size(0) != x.size(3) || bias.dtype() != x.dtype())))
    throw std::invalid_argument(fmt::format(
        "depthwise_conv2d_nhwc: x must be [B, H, W, C], w [C, KH, KW] and bias [C] (or none) in x's dtype, got {}, "
        "{} and {}", x.str(), w.str(), bias.defined() ? bias.str() : std::string("none")));
  check_same_device(x, w, "depthwise_conv2d_nhwc");
  if (bias.defined()) check_same_device(x, bias, "depthwise_conv2d_nhwc");
  const int64_t kh = w.size(1), kw = w.size(2);
  if (sh <= 0 || sw <= 0 || kh <= 0 || kw <= 0 || x.size(1) < kh || x.size(2) < kw)
    throw std::invalid_argument(fmt::format(
        "depthwise_conv2d_nhwc: stride ({}, {}) must be positive and the {}x{} kernel fit in x {}", sh, sw, kh, kw,
        x.str()));
  const int64_t ho = (x.size(1) - kh) / sh + 1, wo = (x.size(2) - kw) / sw + 1;
  if (needs_grad({x, w, bias})) return depthwise_composed(x, w, bias, sh, sw, ho, wo);
  Tensor out = empty({x.size(0), ho, wo, x.size(3)}, TensorOptions(x.dtype(), x.device()));
  if (out.numel())
    backend(x.device()).depthwise_conv2d_nhwc(x.detach().contiguous(), w.detach().contiguous(),
                                              bias.defined() ? bias.detach().contiguous() : Tensor(), out, sh, sw);
  return out;
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

}  // namespace areno
