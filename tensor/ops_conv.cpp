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
