// im2col / col2im for convolutions and average pooling (count_include_pad:
// the divisor is always kh * kw, as the CPU kernel). The backward kernels
// gather per input element instead of scattering, so they need no atomics
// and are deterministic.
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

namespace areno::cuda {
namespace {

// cols[n, (c, ki, kj), (oy, ox)] = x[n, c, oy*sh - ph + ki*dh, ox*sw - pw + kj*dw] (0 outside)
template <typename T>
__global__ void im2col_kernel(const T* x, ConvGeom g, T* cols) {
  int64_t l = g.ho * g.wo, rows = g.c * g.kh * g.kw;
  ARENO_GRID_STRIDE_LOOP(i, g.n * rows * l) {
    int64_t p = i % l, r = i / l;
    int64_t n = r / rows, q = r % rows;
    int64_t c = q / (g.kh * g.kw), ki = (q / g.kw) % g.kh, kj = q % g.kw;
    int64_t oy = p / g.wo, ox = p % g.wo;
    int64_t iy = oy * g.sh - g.ph + ki * g.dh, ix = ox * g.sw - g.pw + kj * g.dw;
    bool in = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
    cols[i] = in ? x[((n * g.c + c) * g.h + iy) * g.w + ix] : cast_value<T>(0.0f);
  }
}

// dx[n, c, iy, ix] += sum over the (ki, kj, oy, ox) that read it.
template <typename T>
__global__ void col2im_kernel(const T* cols, ConvGeom g, T* dx) {
  using A = acc_t<T>;
  int64_t l = g.ho * g.wo, k = g.kh * g.kw;
  ARENO_GRID_STRIDE_LOOP(i, g.n * g.c * g.h * g.w) {
    int64_t ix = i % g.w, iy = (i / g.w) % g.h, nc = i / (g.w * g.h);
    A s = A(0);
    for (int64_t ki = 0; ki < g.kh; ++ki) {
      int64_t ty = iy + g.ph - ki * g.dh;  // = oy * sh
      if (ty < 0 || ty % g.sh != 0) continue;
      int64_t oy = ty / g.sh;
      if (oy >= g.ho) continue;
      for (int64_t kj = 0; kj < g.kw; ++kj) {
        int64_t tx = ix + g.pw - kj * g.dw;
        if (tx < 0 || tx % g.sw != 0) continue;
        int64_t ox = tx / g.sw;
        if (ox >= g.wo) continue;
        s += load_acc(cols, (nc * k + ki * g.kw + kj) * l + oy * g.wo + ox);
      }
    }
    dx[i] = cast_value<T>(load_acc(dx, i) + s);
  }
}

template <typename T>
__global__ void avg_pool2d_kernel(const T* x, PoolGeom g, T* out) {
  using A = acc_t<T>;
  ARENO_GRID_STRIDE_LOOP(i, g.n * g.c * g.ho * g.wo) {
    int64_t ox = i % g.wo, oy = (i / g.wo) % g.ho, nc = i / (g.wo * g.ho);
    const T* xc = x + nc * g.h * g.w;
    A s = A(0);
    for (int64_t a = 0; a < g.kh; ++a) {
      int64_t iy = oy * g.sh - g.ph + a;
      if (iy < 0 || iy >= g.h) continue;
      for (int64_t b = 0; b < g.kw; ++b) {
        int64_t ix = ox * g.sw - g.pw + b;
        if (ix >= 0 && ix < g.w) s += load_acc(xc, iy * g.w + ix);
      }
    }
    out[i] = cast_value<T>(s / A(g.kh * g.kw));
  }
}

template <typename T>
__global__ void avg_pool2d_backward_kernel(const T* dy, PoolGeom g, T* dx) {
  using A = acc_t<T>;
  ARENO_GRID_STRIDE_LOOP(i, g.n * g.c * g.h * g.w) {
    int64_t ix = i % g.w, iy = (i / g.w) % g.h, nc = i / (g.w * g.h);
    const T* gc = dy + nc * g.ho * g.wo;
    A s = A(0);
    for (int64_t a = 0; a < g.kh; ++a) {
      int64_t ty = iy + g.ph - a;
      if (ty < 0 || ty % g.sh != 0 || ty / g.sh >= g.ho) continue;
      for (int64_t b = 0; b < g.kw; ++b) {
        int64_t tx = ix + g.pw - b;
        if (tx < 0 || tx % g.sw != 0 || tx / g.sw >= g.wo) continue;
        s += load_acc(gc, (ty / g.sh) * g.wo + tx / g.sw);
      }
    }
    dx[i] = cast_value<T>(load_acc(dx, i) + s / A(g.kh * g.kw));
  }
}

void check_numel(const Tensor& t, int64_t want, const char* op, const char* name) {
  require_contiguous(t, op, name);
  if (t.numel() != want)
    throw std::invalid_argument(std::string("cuda ") + op + ": " + name + " " + t.str() + " should hold " +
                                std::to_string(want) + " elements for the given geometry");
}

template <typename A>
__device__ __forceinline__ A mul_rn(A a, A b) {
  if constexpr (std::is_same_v<A, double>) return __dmul_rn(a, b);
  else return __fmul_rn(a, b);
}
template <typename A>
__device__ __forceinline__ A add_rn(A a, A b) {
  if constexpr (std::is_same_v<A, double>) return __dadd_rn(a, b);
  else return __fadd_rn(a, b);
}

// out[b, i, j, c] = sum over taps of x[b, i sh + a, j sw + e, c] w[c, a, e],
// then + bias[c], in acc_t with the products rounded before each sum (no
// fused multiply-add, as the CPU kernel), rounded once to T.
template <typename T>
__global__ void depthwise_nhwc_kernel(const T* x, const T* w, const T* bias, T* out, int64_t H, int64_t W,
                                      int64_t C, int64_t kh, int64_t kw, int64_t ho, int64_t wo, int64_t sh,
                                      int64_t sw, int64_t total) {
  using A = acc_t<T>;
  ARENO_GRID_STRIDE_LOOP(idx, total) {
    const int64_t c = idx % C, j = (idx / C) % wo, i = (idx / (C * wo)) % ho, b = idx / (C * wo * ho);
    A acc = A(0);
    for (int64_t a = 0; a < kh; ++a)
      for (int64_t e = 0; e < kw; ++e) {
        const A p = mul_rn(load_acc(x, ((b * H + i * sh + a) * W + j * sw + e) * C + c),
                           load_acc(w, (c * kh + a) * kw + e));
        acc = (a == 0 && e == 0) ? p : add_rn(acc, p);
      }
    if (bias) acc = add_rn(acc, load_acc(bias, c));
    out[idx] = cast_value<T>(acc);
  }
}

}  // namespace
}  // namespace areno::cuda

namespace areno {

using namespace cuda;

void CudaBackend::im2col(const Tensor& x, const ConvGeom& g, const Tensor& cols) {
  check_numel(x, g.n * g.c * g.h * g.w, "im2col", "x");
  check_numel(cols, g.n * g.c * g.kh * g.kw * g.ho * g.wo, "im2col", "cols");
  if (cols.numel() == 0) return;
  Launch l(cols);
  visit_floating(x.dtype(), "im2col", [&](auto tag) {
    using T = typename decltype(tag)::type;
    im2col_kernel<T><<<grid_for(cols.numel()), kBlock, 0, l.stream>>>(ptr<const T>(x), g, ptr<T>(cols));
    ARENO_LAUNCH_CHECK("im2col_kernel");
  });
}

void CudaBackend::depthwise_conv2d_nhwc(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out,
                                        int64_t sh, int64_t sw) {
  const int64_t total = out.numel();
  if (total == 0) return;
  Launch l(out);
  visit_floating(x.dtype(), "depthwise_conv2d_nhwc", [&](auto tag) {
    using T = typename decltype(tag)::type;
    depthwise_nhwc_kernel<T><<<grid_for(total), kBlock, 0, l.stream>>>(
        ptr<const T>(x), ptr<const T>(w), bias.defined() ? ptr<const T>(bias) : nullptr, ptr<T>(out), x.size(1),
        x.size(2), x.size(3), w.size(1), w.size(2), out.size(1), out.size(2), sh, sw, total);
    ARENO_LAUNCH_CHECK("depthwise_nhwc_kernel");
  });
}

void CudaBackend::col2im(const Tensor& cols, const ConvGeom& g, const Tensor& dx) {
  check_numel(dx, g.n * g.c * g.h * g.w, "col2im", "dx");
  check_numel(cols, g.n * g.c * g.kh * g.kw * g.ho * g.wo, "col2im", "cols");
  if (dx.numel() == 0) return;
  Launch l(dx);
  visit_floating(dx.dtype(), "col2im", [&](auto tag) {
    using T = typename decltype(tag)::type;
    col2im_kernel<T><<<grid_for(dx.numel()), kBlock, 0, l.stream>>>(ptr<const T>(cols), g, ptr<T>(dx));
    ARENO_LAUNCH_CHECK("col2im_kernel");
  });
}

void CudaBackend::avg_pool2d(const Tensor& x, const PoolGeom& g, const Tensor& out) {
  check_numel(x, g.n * g.c * g.h * g.w, "avg_pool2d", "x");
  check_numel(out, g.n * g.c * g.ho * g.wo, "avg_pool2d", "out");
  if (out.numel() == 0) return;
  Launch l(out);
  visit_floating(x.dtype(), "avg_pool2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    avg_pool2d_kernel<T><<<grid_for(out.numel()), kBlock, 0, l.stream>>>(ptr<const T>(x), g, ptr<T>(out));
    ARENO_LAUNCH_CHECK("avg_pool2d_kernel");
  });
}

void CudaBackend::avg_pool2d_backward(const Tensor& dy, const PoolGeom& g, const Tensor& dx) {
  check_numel(dx, g.n * g.c * g.h * g.w, "avg_pool2d_backward", "dx");
  check_numel(dy, g.n * g.c * g.ho * g.wo, "avg_pool2d_backward", "dy");
  if (dx.numel() == 0) return;
  Launch l(dx);
  visit_floating(dx.dtype(), "avg_pool2d_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    avg_pool2d_backward_kernel<T><<<grid_for(dx.numel()), kBlock, 0, l.stream>>>(ptr<const T>(dy), g,
                                                                                  ptr<T>(dx));
    ARENO_LAUNCH_CHECK("avg_pool2d_backward_kernel");
  });
}

}  // namespace areno
