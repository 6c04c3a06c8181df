// Row kernels over contiguous [m, n]: softmax, layer norm, RMS norm.
// GCC 12 reports false "(may be) used uninitialized" inside its AVX-512
// intrinsics once Eigen's packet code is inlined here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/vec_exp.h"

namespace areno::cpu {

namespace {

template <typename T> constexpr bool is_half_v = std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;
// Compute type of row kernels: f64 for f64, else f32.
template <typename T> using row_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The sum of f(j) over [0, n) in A, in kLanes interleaved partial sums added
// in lane order at the end (GCC vectorises this; one running sum is a chain
// of dependent adds, which made LayerNorm and RMSNorm latency-bound).
template <typename A, typename F>
A lane_sum(int64_t n, F f) {
  constexpr int kLanes = 16;
  A acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += f(j + l);
  for (int l = 0; j < n; ++j, ++l) acc[l] += f(j);
  A s = 0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

typedef double D4 __attribute__((vector_size(32)));

// The vectors of the softmax and cross-entropy row passes below: 16 lanes
// where the build has AVX-512 (half the instructions; the f64 sums then run
// in 8-lane halves), else 8 (GCC spills 16-lane selects below AVX-512).
#if defined(__AVX512F__)
using RowVec = F16;
typedef double RowVecD __attribute__((vector_size(64)));
#define ARENO_ROW_LO 0, 1, 2, 3, 4, 5, 6, 7
#define ARENO_ROW_HI 8, 9, 10, 11, 12, 13, 14, 15
#else
using RowVec = F8;
using RowVecD = D4;
#define ARENO_ROW_LO 0, 1, 2, 3
#define ARENO_ROW_HI 4, 5, 6, 7
#endif

}  // namespace

namespace {

// The largest of w[0, n) (NaN ignored; -inf when there is none), in 16-lane
// vectors where the build has AVX-512, else 8. A bf16 row is also widened
// into x in the same pass (x is unused for an f32 row).
template <typename W>
float row_max(const W* w, float* x, int64_t n) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr bool kWiden = std::is_same_v<W, BFloat16>;
  constexpr int kW = sizeof(RowVec) / sizeof(float);
  RowVec mxv = RowVec{} + kNegInf;
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    RowVec v;
    if constexpr (kWiden) {
      v = widen_bf16_lanes<RowVec>(w + j);
      std::memcpy(x + j, &v, sizeof v);
    } else {
      std::memcpy(&v, w + j, sizeof v);
    }
    mxv = v > mxv ? v : mxv;
  }
  float mx = kNegInf;
  for (int l = 0; l < kW; ++l) mx = std::max(mx, mxv[l]);
  for (; j < n; ++j) {
    const float v = float(w[j]);
    if constexpr (kWiden) x[j] = v;
    mx = std::max(mx, v);
  }
  return mx;
}

// The sum of exp(x - mx) over x[0, n) (exp_nonpositive, in f64 lanes: see
// RowExpSum), in one order whatever else the pass does. With Store, e[j] gets
// exp(x[j] - mx), exactly 0 where x[j] is -inf (the sum still takes the
// polynomial's value there, as without Store); e may be x.
template <bool Store>
double row_exp_sum_from(const float* x, float* e, int64_t n, float mx) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int kW = sizeof(RowVec) / sizeof(float);
  RowVecD s_lo = {}, s_hi = {};
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    RowVec v;
    std::memcpy(&v, x + j, sizeof v);
    const RowVec p = exp_nonpositive(v - mx);
    s_lo += __builtin_convertvector(__builtin_shufflevector(p, p, ARENO_ROW_LO), RowVecD);
    s_hi += __builtin_convertvector(__builtin_shufflevector(p, p, ARENO_ROW_HI), RowVecD);
    if constexpr (Store) {
      const RowVec masked = v == kNegInf ? RowVec{} : p;
      std::memcpy(e + j, &masked, sizeof masked);
    }
  }
  double sum = 0;
  for (int l = 0; l < kW / 2; ++l) sum += s_lo[l];
  for (int l = 0; l < kW / 2; ++l) sum += s_hi[l];
  for (; j < n; ++j) {
    const float v = x[j], p = exp_nonpositive(v - mx);
    sum += double(p);
    if constexpr (Store) e[j] = v == kNegInf ? 0.0f : p;
  }
  return sum;
}

// y[j] = x[j] * s over [0, n), to f32 or rounded once to bf16; y may be x.
template <typename Y>
void scale_row(const float* x, Y* y, int64_t n, float s) {
  constexpr int kW = sizeof(RowVec) / sizeof(float);
  int64_t j = 0;
  if constexpr (std::is_same_v<Y, BFloat16>) {
    using U = std::conditional_t<kW == 16, U16, U8>;
    using H = std::conditional_t<kW == 16, H16, H8>;
    for (; j + kW <= n; j += kW) {
      RowVec v;
      std::memcpy(&v, x + j, sizeof v);
      v *= s;
      U u;
      std::memcpy(&u, &v, sizeof u);
      const H h = __builtin_convertvector(bf16_bits_rne(u), H);
      std::memcpy(static_cast<void*>(y + j), &h, sizeof h);
    }
  } else {
    for (; j + kW <= n; j += kW) {
      RowVec v;
      std::memcpy(&v, x + j, sizeof v);
      v *= s;
      std::memcpy(y + j, &v, sizeof v);
    }
  }
  for (; j < n; ++j) y[j] = Y(x[j] * s);
}

#undef ARENO_ROW_LO
#undef ARENO_ROW_HI

}  // namespace

// (vec_exp.h) Unaligned loads from the row's start: the same sums whatever
// the buffer's alignment.
RowExpSum row_exp_sum(const float* x, int64_t n) {
  const float mx = row_max(x, nullptr, n);
  return {mx, row_exp_sum_from<false>(x, nullptr, n, mx)};
}

namespace {

// f32 rows (and bf16/f16 rows widened to f32): the reductions above, then
// x - (max + log(sum)), or exp(x - max) / sum. A row of -inf, or one holding
// a NaN or +inf (a NaN sum), comes out all NaN, as torch gives. out may
// alias in.
void softmax_row(const float* in, float* out, int64_t n, bool log) {
  const float mx = row_max(in, nullptr, n);
  // softmax: exp(x - max) goes to out as it is summed, then out is scaled.
  const double sum = log ? row_exp_sum_from<false>(in, nullptr, n, mx) : row_exp_sum_from<true>(in, out, n, mx);
  if (std::isnan(sum) || mx == -std::numeric_limits<float>::infinity()) {
    std::fill(out, out + n, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  if (!log) return scale_row(out, out, n, float(1.0 / sum));
  const float c = float(std::log(sum) + double(mx));
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    F8 v;
    std::memcpy(&v, in + j, sizeof v);
    v -= c;
    std::memcpy(out + j, &v, sizeof v);
  }
  for (int64_t i = j; i < n; ++i) out[i] = in[i] - c;
}

// f64 rows (Eigen's vectorised exp and sums); out may alias in.
void softmax_row(const double* in, double* out, int64_t n, bool log) {
  using Arr = Eigen::Array<double, Eigen::Dynamic, 1>;
  Eigen::Map<const Arr> a(in, n);
  Eigen::Map<Arr> o(out, n);
  const double mx = a.maxCoeff();
  if (std::isinf(mx) && mx < 0) {  // all -inf: torch gives NaN
    o.setConstant(std::numeric_limits<double>::quiet_NaN());
    return;
  }
  if (log) {
    o = a - (std::log((a - mx).exp().sum()) + mx);
  } else {
    o = (a - mx).exp();
    o *= 1.0 / o.sum();
  }
}

// dx = softmax'(y) dy, times scale (scaled_softmax's backward; 1 for softmax:
// the same bits as without it).
void softmax_backward_rows(const Tensor& y, const Tensor& dy, const Tensor& dx, bool log, double scale) {
  int64_t m = y.size(0), n = y.size(1);
  for_float_dtype(y.dtype(), "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    using C = row_t<T>;
    const T* yp = static_cast<const T*>(y.data_ptr());
    const T* gp = static_cast<const T*>(dy.data_ptr());
    T* op = static_cast<T*>(dx.data_ptr());
    const C sc = C(scale);
    parallel_for(m, n * 4, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const T* yr = yp + i * n;
        const T* gr = gp + i * n;
        T* o = op + i * n;
        // The row sums in lanes (lane_sum): one running sum was a chain of
        // dependent adds, most of the time of this pass.
        if (log) {
          const C s = lane_sum<C>(n, [&](int64_t j) { return C(gr[j]); });
          for (int64_t j = 0; j < n; ++j) o[j] = T(C(gr[j]) - std::exp(C(yr[j])) * s);
        } else {
          const C s = lane_sum<C>(n, [&](int64_t j) { return C(gr[j]) * C(yr[j]); });
          for (int64_t j = 0; j < n; ++j) o[j] = T(sc * C(yr[j]) * (C(gr[j]) - s));
        }
      }
    });
  });
}

}  // namespace

void CpuBackend::softmax(const Tensor& x, const Tensor& out, bool log) {
  int64_t m = x.size(0), n = x.size(1);
  for_float_dtype(x.dtype(), "softmax", [&](auto tag) {
    using T = decltype(tag);
    using C = row_t<T>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    parallel_for(m, n * 4, [&](int64_t lo, int64_t hi) {
      // bf16/f16 rows are widened into this f32 buffer, one row at a time.
      std::vector<C> buf(is_half_v<T> ? size_t(n) : 0);
      for (int64_t i = lo; i < hi; ++i) {
        if constexpr (is_half_v<T>) {
          load_row(xp + i * n, buf.data(), n);
          softmax_row(buf.data(), buf.data(), n, log);
          store_row(buf.data(), op + i * n, n);
        } else {
          softmax_row(xp + i * n, op + i * n, n, log);
        }
      }
    });
  });
}

// Each row widened and scaled into an f32 (f64) buffer over its visible
// prefix, softmax_row over it, zeros after it; the whole row NaN when the
// prefix is empty or softmax_row gave NaN (it fills all or nothing).
void CpuBackend::scaled_softmax(const Tensor& x, const Tensor& out, double scale, int64_t tq) {
  const int64_t m = x.size(0), n = x.size(1);
  for_float_dtype(x.dtype(), "scaled_softmax", [&](auto tag) {
    using T = decltype(tag);
    using C = row_t<T>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    const C sc = C(scale);
    parallel_for(m, n * 4, [&](int64_t lo, int64_t hi) {
      std::vector<C> buf(static_cast<size_t>(n));
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t vis = tq > 0 ? std::clamp<int64_t>(i % tq + n - tq + 1, 0, n) : n;
        const T* xr = xp + i * n;
        T* o = op + i * n;
        for (int64_t j = 0; j < vis; ++j) buf[size_t(j)] = C(xr[j]) * sc;
        if (vis > 0) softmax_row(buf.data(), buf.data(), vis, false);
        const bool nan_row = vis == 0 || std::isnan(buf[0]);
        for (int64_t j = 0; j < n; ++j)
          o[j] = nan_row ? T(std::numeric_limits<C>::quiet_NaN()) : j < vis ? T(buf[size_t(j)]) : T(C(0));
      }
    });
  });
}

void CpuBackend::scaled_softmax_backward(const Tensor& y, const Tensor& dy, const Tensor& dx, double scale) {
  softmax_backward_rows(y, dy, dx, false, scale);
}

namespace {

// One cross-entropy row (see Backend::cross_entropy_rows) over the f32 row x
// (for bf16 logits, their widening into x in the first pass): the largest
// logit; exp(x - max) into x as its sum is taken (the sum of row_exp_sum, f64
// lanes); then p = exp(x - max) / sum written to out (x itself, or the bf16
// row, each value rounded once), minus 1 at the target. One exp per logit.
// Logits of -inf get p = 0 exactly. A NaN logit (or +inf) makes the sum NaN:
// the row is then all NaN, as softmax gives. Returns the row's loss,
// log(sum) + max - x[target].
template <typename T>
float cross_entropy_row(float* x, T* out, int64_t n, int64_t target) {
  const float xt = float(out[target]);
  const float mx = row_max(static_cast<const T*>(out), x, n);  // an f32 out is x
  const double sum = row_exp_sum_from<true>(x, x, n, mx);
  if (std::isnan(sum) || mx == -std::numeric_limits<float>::infinity()) {  // a NaN or +inf logit, or nothing finite
    std::fill(out, out + n, T(std::numeric_limits<float>::quiet_NaN()));
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float inv = float(1.0 / sum);
  const float pt = x[target] * inv;
  scale_row(x, out, n, inv);
  out[target] = T(pt - 1.0f);
  return float(std::log(sum) + double(mx) - double(xt));
}

}  // namespace

bool CpuBackend::cross_entropy_rows(const Tensor& logits, const Tensor& targets, const Tensor& loss) {
  if (!cross_entropy_rows_layout_ok(logits, targets, loss)) return false;
  const int64_t R = logits.size(0), V = logits.size(1);
  const int64_t* t = static_cast<const int64_t*>(targets.data_ptr());
  float* l = static_cast<float*>(loss.data_ptr());
  if (logits.dtype() == DType::bf16) {
    // Each row widened into a buffer that stays in cache, the f32 row's
    // kernel, each value rounded once on its way back: the bits of the f32
    // kernel on the widened logits followed by a cast to bf16.
    BFloat16* x = static_cast<BFloat16*>(logits.data_ptr());
    parallel_for(R, V * 8, [&](int64_t lo, int64_t hi) {
      std::vector<float> buf(static_cast<size_t>(V));
      for (int64_t r = lo; r < hi; ++r) l[r] = cross_entropy_row(buf.data(), x + r * V, V, t[r]);
    });
    return true;
  }
  float* x = static_cast<float*>(logits.data_ptr());
  parallel_for(R, V * 4, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) l[r] = cross_entropy_row(x + r * V, x + r * V, V, t[r]);
  });
  return true;
}

void CpuBackend::softmax_backward(const Tensor& y, const Tensor& dy, const Tensor& dx, bool log) {
  softmax_backward_rows(y, dy, dx, log, 1.0);
}


void CpuBackend::layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps,
                            const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  int64_t m = x.size(0), n = x.size(1);
  for_float_dtype(x.dtype(), "layer_norm", [&](auto tag) {
    using T = decltype(tag);
    using C = row_t<T>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(w.data_ptr());
    const T* bp = b.defined() ? static_cast<const T*>(b.data_ptr()) : nullptr;
    T* yp = static_cast<T*>(y.data_ptr());
    C* mp = static_cast<C*>(mean.data_ptr());
    C* rp = static_cast<C*>(rstd.data_ptr());
    parallel_for(m, n * 4, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const T* r = xp + i * n;
        const double s = lane_sum<double>(n, [&](int64_t j) { return double(C(r[j])); });
        C mu = C(s / double(n));
        const double v = lane_sum<double>(n, [&](int64_t j) {
          const double d = double(C(r[j]) - mu);
          return d * d;
        });
        C rs = C(1.0 / std::sqrt(v / double(n) + eps));
        mp[i] = mu;
        rp[i] = rs;
        for (int64_t j = 0; j < n; ++j) {
          C val = (C(r[j]) - mu) * rs * C(wp[j]);
          if (bp) val += C(bp[j]);
          yp[i * n + j] = T(val);
        }
      }
    });
  });
}

void CpuBackend::layer_norm_backward(const Tensor& x, const Tensor& w, const Tensor& mean,
                                     const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                                     const Tensor& dw, const Tensor& db) {
  int64_t m = x.size(0), n = x.size(1);
  for_float_dtype(x.dtype(), "layer_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    using C = row_t<T>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(w.data_ptr());
    const T* gp = static_cast<const T*>(dy.data_ptr());
    const C* mp = static_cast<const C*>(mean.data_ptr());
    const C* rp = static_cast<const C*>(rstd.data_ptr());
    T* dxp = static_cast<T*>(dx.data_ptr());
    parallel_for(m, n * 6, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const T* r = xp + i * n;
        const T* g = gp + i * n;
        C mu = mp[i], rs = rp[i];
        double sum_g = 0, sum_gx = 0;  // over g*w and g*w*xhat
        for (int64_t j = 0; j < n; ++j) {
          C xh = (C(r[j]) - mu) * rs;
          C gw = C(g[j]) * C(wp[j]);
          sum_g += gw;
          sum_gx += gw * xh;
        }
        C a = C(sum_g / double(n)), bb = C(sum_gx / double(n));
        for (int64_t j = 0; j < n; ++j) {
          C xh = (C(r[j]) - mu) * rs;
          C gw = C(g[j]) * C(wp[j]);
          dxp[i * n + j] = T(rs * (gw - a - xh * bb));
        }
      }
    });
    // Parameter gradients: column sums, parallel over columns.
    if (dw.defined() || db.defined()) {
      T* dwp = dw.defined() ? static_cast<T*>(dw.data_ptr()) : nullptr;
      T* dbp = db.defined() ? static_cast<T*>(db.data_ptr()) : nullptr;
      parallel_for(n, m * 2, [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
          double sw = 0, sb = 0;
          for (int64_t i = 0; i < m; ++i) {
            C g = C(gp[i * n + j]);
            sw += double(g * (C(xp[i * n + j]) - mp[i]) * rp[i]);
            sb += double(g);
          }
          if (dwp) dwp[j] = T(C(sw));
          if (dbp) dbp[j] = T(C(sb));
        }
      });
    }
  });
}

namespace {

// RMSNorm of rows [m, n]; with b, the rows are a + b, rounded to T and
// written to sum first (add_rms_norm).
void rms_rows(const Tensor& x, const Tensor* b, const Tensor* sum, const Tensor& w, double eps, const Tensor& y,
              const Tensor& rstd, const char* op) {
  int64_t m = x.size(0), n = x.size(1);
  for_float_dtype(x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    using C = row_t<T>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* bp = b ? static_cast<const T*>(b->data_ptr()) : nullptr;
    T* sp = sum ? static_cast<T*>(sum->data_ptr()) : nullptr;
    const T* wp = static_cast<const T*>(w.data_ptr());
    T* yp = static_cast<T*>(y.data_ptr());
    C* rp = static_cast<C*>(rstd.data_ptr());
    parallel_for(m, n * (b ? 5 : 3), [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const T* r = xp + i * n;
        if (bp) {
          T* s = sp + i * n;
          const T* br = bp + i * n;
          for (int64_t j = 0; j < n; ++j) s[j] = T(C(r[j]) + C(br[j]));
          r = s;
        }
        const C ss = lane_sum<C>(n, [&](int64_t j) { return C(r[j]) * C(r[j]); });
        C rs = C(1) / std::sqrt(ss / C(n) + C(eps));
        rp[i] = rs;
        for (int64_t j = 0; j < n; ++j) {
          if constexpr (is_half_v<T>) {
            // Reference rounding: normalised value to the input dtype, then weight * it.
            yp[i * n + j] = T(float(wp[j]) * float(T(C(r[j]) * rs)));
          } else {
            yp[i * n + j] = T(C(r[j]) * rs * C(wp[j]));
          }
        }
      }
    });
  });
}

}  // namespace

void CpuBackend::rms_norm(const Tensor& x, const Tensor& w, double eps, const Tensor& y,
                          const Tensor& rstd) {
  rms_rows(x, nullptr, nullptr, w, eps, y, rstd, "rms_norm");
}

void CpuBackend::add_rms_norm(const Tensor& a, const Tensor& b, const Tensor& w, double eps, const Tensor& sum,
                              const Tensor& y, const Tensor& rstd) {
  rms_rows(a, &b, &sum, w, eps, y, rstd, "add_rms_norm");
}

void CpuBackend::rms_norm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd,
                                   const Tensor& dy, const Tensor& dx, const Tensor& dw) {
  int64_t m = x.size(0), n = x.size(1);
  for_float_dtype(x.dtype(), "rms_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    using C = row_t<T>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(w.data_ptr());
    const T* gp = static_cast<const T*>(dy.data_ptr());
    const C* rp = static_cast<const C*>(rstd.data_ptr());
    T* dxp = static_cast<T*>(dx.data_ptr());
    parallel_for(m, n * 4, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        C rs = rp[i];
        double dot = 0;  // sum of g*w*x
        for (int64_t j = 0; j < n; ++j) dot += double(C(gp[i * n + j]) * C(wp[j]) * C(xp[i * n + j]));
        C c = C(dot / double(n)) * rs * rs * rs;
        for (int64_t j = 0; j < n; ++j)
          dxp[i * n + j] = T(C(gp[i * n + j]) * C(wp[j]) * rs - C(xp[i * n + j]) * c);
      }
    });
    if (dw.defined()) {
      T* dwp = static_cast<T*>(dw.data_ptr());
      parallel_for(n, m * 2, [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
          double s = 0;
          for (int64_t i = 0; i < m; ++i) s += double(C(gp[i * n + j]) * C(xp[i * n + j]) * rp[i]);
          dwp[j] = T(C(s));
        }
      });
    }
  });
}

// No fused multiply-adds: the composed ops round each product before the sum.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace {

// The 16-lane rotary below AVX-512 would run its rounding selects nearly lane
// by lane (GCC 12; see reduce.cpp): the scalar loop there.
#ifdef __AVX512F__
constexpr bool kVectorRotary = true;
#else
constexpr bool kVectorRotary = false;
#endif

// 16 values of T (float or bf16) as f32 lanes, and back (bf16 rounded to
// nearest even, as BFloat16(float)); round16 rounds the lanes to T and back.
template <typename T>
__attribute__((always_inline)) inline F16 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    F16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else {
    return widen_bf16_lanes<F16>(p);
  }
}
template <typename T>
__attribute__((always_inline)) inline void store16(T* p, F16 v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof v);
  } else {
    U16 u;
    std::memcpy(&u, &v, sizeof u);
    const H16 h = __builtin_convertvector(bf16_bits_rne(u), H16);
    std::memcpy(static_cast<void*>(p), &h, sizeof h);
  }
}
template <typename T>
__attribute__((always_inline)) inline F16 round16(F16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    U16 u;
    std::memcpy(&u, &v, sizeof u);
    u = bf16_bits_rne(u) << 16;
    std::memcpy(&v, &u, sizeof v);
    return v;
  }
}

}  // namespace

void CpuBackend::rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& out,
                        bool transpose) {
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2), r = cos.size(1), f = r / 2, ld = x.stride(0);
  for_float_dtype(x.dtype(), "rotary", [&](auto tag) {
    using T = decltype(tag);
    using C = row_t<T>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* cp = static_cast<const T*>(cos.data_ptr());
    const T* sp = static_cast<const T*>(sin.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    // A product or sum rounded to T, as the composed ops round each result.
    auto rd = [](C v) { return C(T(v)); };
    parallel_for(t, h * d * 4, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const T* c = cp + i * r;
        const T* s = sp + i * r;
        for (int64_t k = 0; k < h; ++k) {
          const T* v = xp + i * ld + k * d;
          T* o = op + (i * h + k) * d;
          int64_t j = 0;
          if constexpr (kVectorRotary && (std::is_same_v<T, float> || std::is_same_v<T, BFloat16>)) {
            // 16 pairs at a time: the same products, roundings and sums per lane.
            for (; j + 16 <= f; j += 16) {
              const F16 v1 = load16(v + j), v2 = load16(v + j + f);
              const F16 c1 = load16(c + j), c2 = load16(c + j + f), s1 = load16(s + j), s2 = load16(s + j + f);
              if (!transpose) {
                store16(o + j, round16<T>(v1 * c1) + round16<T>(-v2 * s1));
                store16(o + j + f, round16<T>(v2 * c2) + round16<T>(v1 * s2));
              } else {
                store16(o + j, round16<T>(v1 * c1) + round16<T>(v2 * s2));
                store16(o + j + f, round16<T>(v2 * c2) - round16<T>(v1 * s1));
              }
            }
          }
          for (; j < f; ++j) {
            const C v1 = C(v[j]), v2 = C(v[j + f]);
            if (!transpose) {
              o[j] = T(rd(v1 * C(c[j])) + rd(-v2 * C(s[j])));
              o[j + f] = T(rd(v2 * C(c[j + f])) + rd(v1 * C(s[j + f])));
            } else {
              o[j] = T(rd(v1 * C(c[j])) + rd(v2 * C(s[j + f])));
              o[j + f] = T(rd(v2 * C(c[j + f])) - rd(v1 * C(s[j])));
            }
          }
          if (r < d) std::memcpy(o + r, v + r, size_t(d - r) * sizeof(T));
        }
      }
    });
  });
}
#pragma GCC pop_options

}  // namespace areno::cpu
