// im2col / col2im for convolutions, and average pooling.
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"

namespace areno::cpu {

void CpuBackend::im2col(const Tensor& x, const ConvGeom& g, const Tensor& cols) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.data_ptr());
    T* cp = static_cast<T*>(cols.data_ptr());
    int64_t l = g.ho * g.wo, rows = g.c * g.kh * g.kw;
    // cols[n, (c, ki, kj), (oy, ox)] = x[n, c, oy*sh - ph + ki*dh, ox*sw - pw + kj*dw]
    parallel_for(g.n * rows, l, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        int64_t n = r / rows, q = r % rows;
        int64_t c = q / (g.kh * g.kw), ki = (q / g.kw) % g.kh, kj = q % g.kw;
        const T* xc = xp + (n * g.c + c) * g.h * g.w;
        T* dst = cp + r * l;
        for (int64_t oy = 0; oy < g.ho; ++oy) {
          int64_t iy = oy * g.sh - g.ph + ki * g.dh;
          for (int64_t ox = 0; ox < g.wo; ++ox) {
            int64_t ix = ox * g.sw - g.pw + kj * g.dw;
            bool in = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
            dst[oy * g.wo + ox] = in ? xc[iy * g.w + ix] : T(0.0f);
          }
        }
      }
    });
  });
}

// No fused multiply-adds: f32 inputs keep the bits of the composed mul / add
// per tap (16-bit products are exact in f32 either way).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void CpuBackend::depthwise_conv2d_nhwc(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out,
                                       int64_t sh, int64_t sw) {
  const int64_t B = x.size(0), H = x.size(1), W = x.size(2), C = x.size(3), kh = w.size(1), kw = w.size(2);
  const int64_t ho = out.size(1), wo = out.size(2), taps = kh * kw;
  for_float_dtype(x.dtype(), "depthwise_conv2d_nhwc", [&](auto tag) {
    using T = decltype(tag);
    using A = compute_t<T>;  // f32, f64 for f64
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(w.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    // Weights as [tap][C] and the bias, widened once.
    std::vector<A> wt(size_t(taps * C)), bt(bias.defined() ? size_t(C) : 0);
    for (int64_t c = 0; c < C; ++c)
      for (int64_t t = 0; t < taps; ++t) wt[size_t(t * C + c)] = A(wp[c * taps + t]);
    if (bias.defined())
      for (int64_t c = 0; c < C; ++c) bt[size_t(c)] = A(static_cast<const T*>(bias.data_ptr())[c]);
    // A block of kN channels (0: n < kBlock of them, the tail) of one output
    // pixel: the first tap's product, each further tap added, then the bias,
    // rounded once.
    constexpr int64_t kBlock = 64;
    auto pixel = [&]<int64_t kN>(const T* x0, int64_t c0, int64_t n, T* o) {
      A acc[kBlock];
      for (int64_t t = 0; t < taps; ++t) {
        const T* xr = x0 + ((t / kw) * W + t % kw) * C + c0;
        const A* wr = wt.data() + t * C + c0;
        if (t == 0)
          for (int64_t c = 0; c < (kN ? kN : n); ++c) acc[c] = A(xr[c]) * wr[c];
        else
          for (int64_t c = 0; c < (kN ? kN : n); ++c) acc[c] = acc[c] + A(xr[c]) * wr[c];
      }
      if (!bt.empty())
        for (int64_t c = 0; c < (kN ? kN : n); ++c) acc[c] = acc[c] + bt[size_t(c0 + c)];
      for (int64_t c = 0; c < (kN ? kN : n); ++c) o[c0 + c] = T(acc[c]);
    };
    parallel_for(B * ho, wo * C * taps, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t b = r / ho, i = r % ho;
        for (int64_t j = 0; j < wo; ++j) {
          const T* x0 = xp + ((b * H + i * sh) * W + j * sw) * C;
          T* o = op + (r * wo + j) * C;
          int64_t c0 = 0;
          for (; c0 + kBlock <= C; c0 += kBlock) pixel.template operator()<kBlock>(x0, c0, kBlock, o);
          if (c0 < C) pixel.template operator()<0>(x0, c0, C - c0, o);
        }
      }
    });
  });
}
#pragma GCC pop_options

void CpuBackend::col2im(const Tensor& cols, const ConvGeom& g, const Tensor& dx) {
  visit_dtype(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, bool>) {
      throw std::invalid_argument("col2im on bool");
    } else {
      const T* cp = static_cast<const T*>(cols.data_ptr());
      T* xp = static_cast<T*>(dx.data_ptr());
      int64_t l = g.ho * g.wo, k = g.kh * g.kw;
      // Parallel over (n, c): each owns its input plane.
      parallel_for(g.n * g.c, k * l, [&](int64_t lo, int64_t hi) {
        for (int64_t nc = lo; nc < hi; ++nc) {
          int64_t n = nc / g.c, c = nc % g.c;
          T* xc = xp + nc * g.h * g.w;
          for (int64_t q = 0; q < k; ++q) {
            int64_t ki = q / g.kw, kj = q % g.kw;
            const T* src = cp + ((n * g.c + c) * k + q) * l;
            for (int64_t oy = 0; oy < g.ho; ++oy) {
              int64_t iy = oy * g.sh - g.ph + ki * g.dh;
              if (iy < 0 || iy >= g.h) continue;
              for (int64_t ox = 0; ox < g.wo; ++ox) {
                int64_t ix = ox * g.sw - g.pw + kj * g.dw;
                if (ix < 0 || ix >= g.w) continue;
                T& d = xc[iy * g.w + ix];
                if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>)
                  d = T(float(d) + float(src[oy * g.wo + ox]));
                else
                  d = T(d + src[oy * g.wo + ox]);
              }
            }
          }
        }
      });
    }
  });
}

void CpuBackend::avg_pool2d(const Tensor& x, const PoolGeom& g, const Tensor& out) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    parallel_for(g.n * g.c, g.ho * g.wo * g.kh * g.kw, [&](int64_t lo, int64_t hi) {
      for (int64_t nc = lo; nc < hi; ++nc) {
        const T* xc = xp + nc * g.h * g.w;
        for (int64_t oy = 0; oy < g.ho; ++oy)
          for (int64_t ox = 0; ox < g.wo; ++ox) {
            C s = 0;
            for (int64_t i = 0; i < g.kh; ++i)
              for (int64_t j = 0; j < g.kw; ++j) {
                int64_t iy = oy * g.sh - g.ph + i, ix = ox * g.sw - g.pw + j;
                if (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) s += C(xc[iy * g.w + ix]);
              }
            op[(nc * g.ho + oy) * g.wo + ox] = T(s / C(g.kh * g.kw));
          }
      }
    });
  });
}

void CpuBackend::avg_pool2d_backward(const Tensor& dy, const PoolGeom& g, const Tensor& dx) {
  visit_dtype(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const T* gp = static_cast<const T*>(dy.data_ptr());
    T* xp = static_cast<T*>(dx.data_ptr());
    parallel_for(g.n * g.c, g.ho * g.wo * g.kh * g.kw, [&](int64_t lo, int64_t hi) {
      for (int64_t nc = lo; nc < hi; ++nc) {
        T* xc = xp + nc * g.h * g.w;
        for (int64_t oy = 0; oy < g.ho; ++oy)
          for (int64_t ox = 0; ox < g.wo; ++ox) {
            C v = C(gp[(nc * g.ho + oy) * g.wo + ox]) / C(g.kh * g.kw);
            for (int64_t i = 0; i < g.kh; ++i)
              for (int64_t j = 0; j < g.kw; ++j) {
                int64_t iy = oy * g.sh - g.ph + i, ix = ox * g.sw - g.pw + j;
                if (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) {
                  T& d = xc[iy * g.w + ix];
                  d = T(C(d) + v);
                }
              }
          }
      }
    });
  });
}

}  // namespace areno::cpu
