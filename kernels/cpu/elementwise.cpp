// Elementwise CPU kernels: copy/cast, fill, arange, unary, binary, where.
// GCC 12 reports false "(may be) used uninitialized" inside its AVX-512
// intrinsics once Eigen's packet code is inlined here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>
#include <cmath>
#include <stdexcept>
#include <type_traits>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"

namespace areno::cpu {

namespace {

template <typename T> inline T load(const char* p) { return *reinterpret_cast<const T*>(p); }
template <typename T> inline void store(char* p, T v) { *reinterpret_cast<T*>(p) = v; }

template <typename To, typename From>
inline To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<From, BFloat16> || std::is_same_v<From, Half>) {
    return convert<To>(float(v));
  } else if constexpr (std::is_same_v<To, BFloat16> || std::is_same_v<To, Half>) {
    return To(float(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else {
    return static_cast<To>(v);
  }
}

// out[i] = f(x[i]) with x: T, out: O; f works on compute types.
template <typename T, typename O, typename F>
void map1(const Tensor& x, const Tensor& out, F f) {
  using C = compute_t<T>;
  strided_loop<2>(out.shape(), {&x, &out}, [&](const std::array<char*, 2>& p, const std::array<int64_t, 2>& s, int64_t n) {
    if (s[0] == int64_t(sizeof(T)) && s[1] == int64_t(sizeof(O))) {
      const T* xi = reinterpret_cast<const T*>(p[0]);
      O* o = reinterpret_cast<O*>(p[1]);
      for (int64_t i = 0; i < n; ++i) o[i] = convert<O>(f(convert<C>(xi[i])));
    } else {
      for (int64_t i = 0; i < n; ++i)
        store<O>(p[1] + i * s[1], convert<O>(f(convert<C>(load<T>(p[0] + i * s[0])))));
    }
  });
}

template <typename T, typename O, typename F>
void map2(const Tensor& a, const Tensor& b, const Tensor& out, F f) {
  using C = compute_t<T>;
  strided_loop<3>(out.shape(), {&a, &b, &out},
                  [&](const std::array<char*, 3>& p, const std::array<int64_t, 3>& s, int64_t n) {
    if (s[0] == int64_t(sizeof(T)) && s[1] == int64_t(sizeof(T)) && s[2] == int64_t(sizeof(O))) {
      const T* ai = reinterpret_cast<const T*>(p[0]);
      const T* bi = reinterpret_cast<const T*>(p[1]);
      O* o = reinterpret_cast<O*>(p[2]);
      for (int64_t i = 0; i < n; ++i) o[i] = convert<O>(f(convert<C>(ai[i]), convert<C>(bi[i])));
    } else if (s[1] == 0 && s[0] == int64_t(sizeof(T)) && s[2] == int64_t(sizeof(O))) {
      const T* ai = reinterpret_cast<const T*>(p[0]);
      C bv = convert<C>(load<T>(p[1]));
      O* o = reinterpret_cast<O*>(p[2]);
      for (int64_t i = 0; i < n; ++i) o[i] = convert<O>(f(convert<C>(ai[i]), bv));
    } else {
      for (int64_t i = 0; i < n; ++i)
        store<O>(p[2] + i * s[2], convert<O>(f(convert<C>(load<T>(p[0] + i * s[0])),
                                              convert<C>(load<T>(p[1] + i * s[1])))));
    }
  });
}

template <typename To>
void copy_to(const Tensor& src, const Tensor& dst) {
  visit_dtype(src.dtype(), [&](auto tag) {
    using From = decltype(tag);
    strided_loop<2>(dst.shape(), {&src, &dst}, [&](const std::array<char*, 2>& p, const std::array<int64_t, 2>& s, int64_t n) {
      if (s[0] == int64_t(sizeof(From)) && s[1] == int64_t(sizeof(To))) {
        if constexpr (std::is_same_v<From, To>) {
          std::memcpy(p[1], p[0], size_t(n) * sizeof(To));
        } else {
          const From* a = reinterpret_cast<const From*>(p[0]);
          To* o = reinterpret_cast<To*>(p[1]);
          for (int64_t i = 0; i < n; ++i) o[i] = convert<To>(a[i]);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) store<To>(p[1] + i * s[1], convert<To>(load<From>(p[0] + i * s[0])));
      }
    });
  });
}

inline double gelu_exact(double x) { return 0.5 * x * (1.0 + std::erf(x * M_SQRT1_2)); }
inline float gelu_exact(float x) { return 0.5f * x * (1.0f + std::erf(x * float(M_SQRT1_2))); }
template <typename C> inline C gelu_tanh_f(C x) {
  const C k = C(0.7978845608028654);
  return C(0.5) * x * (C(1) + std::tanh(k * (x + C(0.044715) * x * x * x)));
}
template <typename C> inline C sigmoid_f(C x) { return C(1) / (C(1) + std::exp(-x)); }

// Eigen's vectorised transcendental functions for contiguous f32, and for
// contiguous bf16 widened in chunks (computed in f32, rounded once: the same
// rounding points as the scalar path, whose libm calls were a tenth of the
// vision tower's time in GELU-tanh alone).
template <typename A, typename R>
void apply_fast(UnaryOp op, const A& a, R& r) {
  switch (op) {
    case UnaryOp::exp: r = a.exp(); break;
    case UnaryOp::log: r = a.log(); break;
    case UnaryOp::tanh: r = a.tanh(); break;
    case UnaryOp::sigmoid: r = a.logistic(); break;
    case UnaryOp::sqrt: r = a.sqrt(); break;
    case UnaryOp::rsqrt: r = a.rsqrt(); break;
    case UnaryOp::silu: r = a * a.logistic(); break;
    case UnaryOp::gelu_tanh:
      r = 0.5f * a * (1.0f + (0.7978845608028654f * (a + 0.044715f * a * a * a)).tanh());
      break;
    default: break;
  }
}

// n contiguous values of x through op into o (see apply_fast).
void fast_run(UnaryOp op, const float* x, float* o, int64_t n) {
  Eigen::Map<const Eigen::ArrayXf> a(x, n);
  Eigen::Map<Eigen::ArrayXf> r(o, n);
  apply_fast(op, a, r);
}
void fast_run(UnaryOp op, const BFloat16* x, BFloat16* o, int64_t n) {
  constexpr int64_t kChunk = 1024;
  alignas(64) float in[kChunk], res[kChunk];
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t m = std::min(kChunk, n - c);
    for (int64_t i = 0; i < m; ++i) in[i] = float(x[c + i]);
    Eigen::Map<const Eigen::ArrayXf> a(in, m);
    Eigen::Map<Eigen::ArrayXf> r(res, m);
    apply_fast(op, a, r);
    for (int64_t i = 0; i < m; ++i) o[c + i] = BFloat16(res[i]);
  }
}

// x as rows of contiguous elements a fixed stride apart (a slice of the last
// dimension, such as the gate half of a packed gate_up output): false when
// it is not.
bool as_rows(const Tensor& x, int64_t& rows, int64_t& cols, int64_t& ld) {
  const int64_t nd = x.dim();
  if (nd < 2 || x.stride(nd - 1) != 1) return false;
  cols = x.size(nd - 1), ld = x.stride(nd - 2), rows = 1;
  for (int64_t d = nd - 2; d >= 0; --d) {
    const int64_t want = d == nd - 2 ? ld : x.stride(d + 1) * x.size(d + 1);
    if (x.size(d) != 1 && x.stride(d) != want) return false;
    rows *= x.size(d);
  }
  return true;
}

bool unary_fast(UnaryOp op, const Tensor& x, const Tensor& out) {
  const DType dt = x.dtype();
  if ((dt != DType::f32 && dt != DType::bf16) || out.dtype() != dt || !out.is_contiguous()) return false;
  switch (op) {
    case UnaryOp::exp: case UnaryOp::log: case UnaryOp::tanh: case UnaryOp::sigmoid:
    case UnaryOp::sqrt: case UnaryOp::rsqrt: case UnaryOp::silu: case UnaryOp::gelu_tanh:
      break;
    default:
      return false;
  }
  int64_t rows = 1, cols = x.numel(), ld = cols;
  if (!x.is_contiguous() && !as_rows(x, rows, cols, ld)) return false;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xi = static_cast<const T*>(x.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    if (rows == 1) {
      parallel_for(cols, 8, [&](int64_t lo, int64_t hi) { fast_run(op, xi + lo, o + lo, hi - lo); });
    } else {  // rows of a strided x, out dense
      parallel_for(rows, cols * 8, [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) fast_run(op, xi + r * ld, o + r * cols, cols);
      });
    }
  };
  if (dt == DType::f32) run(float{});
  else run(BFloat16{});
  return true;
}

}  // namespace

void CpuBackend::copy(const Tensor& src, const Tensor& dst) {
  visit_dtype(dst.dtype(), [&](auto tag) { copy_to<decltype(tag)>(src, dst); });
}

void CpuBackend::fill(const Tensor& dst, double value) {
  visit_dtype(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T v = convert<T>(value);
    strided_loop<1>(dst.shape(), {&dst}, [&](const std::array<char*, 1>& p, const std::array<int64_t, 1>& s, int64_t n) {
      for (int64_t i = 0; i < n; ++i) store<T>(p[0] + i * s[0], v);
    });
  });
}

void CpuBackend::arange(const Tensor& dst, double start, double step) {
  visit_dtype(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(dst.data_ptr());
    for (int64_t i = 0; i < dst.numel(); ++i) p[i] = convert<T>(start + double(i) * step);
  });
}

void CpuBackend::unary(UnaryOp op, const Tensor& x, const Tensor& out, double p0, double p1) {
  if (op == UnaryOp::logical_not) {
    map1<bool, bool>(x, out, [](bool v) { return !v; });
    return;
  }
  if (unary_fast(op, x, out)) return;
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    if constexpr (std::is_same_v<T, bool>) {
      throw std::invalid_argument("unary op on a bool tensor");
    } else {
      switch (op) {
        case UnaryOp::neg: return map1<T, T>(x, out, [](C v) { return C(-v); });
        case UnaryOp::abs: return map1<T, T>(x, out, [](C v) { return v < C(0) ? C(-v) : v; });
        case UnaryOp::square: return map1<T, T>(x, out, [](C v) { return C(v * v); });
        case UnaryOp::relu: return map1<T, T>(x, out, [](C v) { return v != v ? v : v > C(0) ? v : C(0); });
        case UnaryOp::affine: {
          C a = C(p0), b = C(p1);
          return map1<T, T>(x, out, [a, b](C v) { return C(v * a + b); });
        }
        case UnaryOp::clamp: {
          C lo = std::isinf(p0) ? std::numeric_limits<C>::lowest() : C(p0);
          C hi = std::isinf(p1) ? std::numeric_limits<C>::max() : C(p1);
          return map1<T, T>(x, out, [lo, hi](C v) { return v != v ? v : v < lo ? lo : v > hi ? hi : v; });
        }
        default: break;
      }
      if constexpr (std::is_floating_point_v<C>) {
        switch (op) {
          case UnaryOp::exp: return map1<T, T>(x, out, [](C v) { return std::exp(v); });
          case UnaryOp::log: return map1<T, T>(x, out, [](C v) { return std::log(v); });
          case UnaryOp::sqrt: return map1<T, T>(x, out, [](C v) { return std::sqrt(v); });
          case UnaryOp::rsqrt: return map1<T, T>(x, out, [](C v) { return C(1) / std::sqrt(v); });
          case UnaryOp::sin: return map1<T, T>(x, out, [](C v) { return std::sin(v); });
          case UnaryOp::cos: return map1<T, T>(x, out, [](C v) { return std::cos(v); });
          case UnaryOp::reciprocal: return map1<T, T>(x, out, [](C v) { return C(1) / v; });
          case UnaryOp::silu: return map1<T, T>(x, out, [](C v) { return v * sigmoid_f(v); });
          case UnaryOp::sigmoid: return map1<T, T>(x, out, [](C v) { return sigmoid_f(v); });
          case UnaryOp::tanh: return map1<T, T>(x, out, [](C v) { return std::tanh(v); });
          case UnaryOp::gelu: return map1<T, T>(x, out, [](C v) { return gelu_exact(v); });
          case UnaryOp::gelu_tanh: return map1<T, T>(x, out, [](C v) { return gelu_tanh_f(v); });
          case UnaryOp::pow_scalar: {
            C e = C(p0);
            return map1<T, T>(x, out, [e](C v) { return std::pow(v, e); });
          }
          default: break;
        }
      }
      throw std::invalid_argument("unary op not supported for dtype " + std::string(dtype_name(x.dtype())));
    }
  });
}

void CpuBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out,
                        double alpha) {
  if (op == BinaryOp::logical_and) return map2<bool, bool>(a, b, out, [](bool x, bool y) { return x && y; });
  if (op == BinaryOp::logical_or) return map2<bool, bool>(a, b, out, [](bool x, bool y) { return x || y; });
  visit_dtype(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    switch (op) {
      case BinaryOp::eq: return map2<T, bool>(a, b, out, [](C x, C y) { return x == y; });
      case BinaryOp::ne: return map2<T, bool>(a, b, out, [](C x, C y) { return x != y; });
      case BinaryOp::lt: return map2<T, bool>(a, b, out, [](C x, C y) { return x < y; });
      case BinaryOp::le: return map2<T, bool>(a, b, out, [](C x, C y) { return x <= y; });
      case BinaryOp::gt: return map2<T, bool>(a, b, out, [](C x, C y) { return x > y; });
      case BinaryOp::ge: return map2<T, bool>(a, b, out, [](C x, C y) { return x >= y; });
      default: break;
    }
    if constexpr (std::is_same_v<T, bool>) {
      throw std::invalid_argument("arithmetic on bool tensors");
    } else {
      switch (op) {
        case BinaryOp::add:
          if (alpha == 1.0) return map2<T, T>(a, b, out, [](C x, C y) { return C(x + y); });
          return map2<T, T>(a, b, out, [al = C(alpha)](C x, C y) { return C(x + al * y); });
        case BinaryOp::sub:
          if (alpha == 1.0) return map2<T, T>(a, b, out, [](C x, C y) { return C(x - y); });
          return map2<T, T>(a, b, out, [al = C(alpha)](C x, C y) { return C(x - al * y); });
        case BinaryOp::mul: return map2<T, T>(a, b, out, [](C x, C y) { return C(x * y); });
        case BinaryOp::div: return map2<T, T>(a, b, out, [](C x, C y) { return C(x / y); });
        case BinaryOp::pow: return map2<T, T>(a, b, out, [](C x, C y) { return C(std::pow(x, y)); });
        case BinaryOp::maximum:
          return map2<T, T>(a, b, out, [](C x, C y) { return x != x ? x : y != y ? y : x > y ? x : y; });
        case BinaryOp::minimum:
          return map2<T, T>(a, b, out, [](C x, C y) { return x != x ? x : y != y ? y : x < y ? x : y; });
        case BinaryOp::relu_backward: return map2<T, T>(a, b, out, [](C x, C dy) { return x > C(0) ? dy : C(0); });
        default: break;
      }
      if constexpr (std::is_floating_point_v<C>) {
        switch (op) {
          case BinaryOp::silu_backward:
            return map2<T, T>(a, b, out, [](C x, C dy) {
              C s = sigmoid_f(x);
              return dy * s * (C(1) + x * (C(1) - s));
            });
          case BinaryOp::sigmoid_backward:
            return map2<T, T>(a, b, out, [](C y, C dy) { return dy * y * (C(1) - y); });
          case BinaryOp::tanh_backward:
            return map2<T, T>(a, b, out, [](C y, C dy) { return dy * (C(1) - y * y); });
          case BinaryOp::gelu_backward:
            return map2<T, T>(a, b, out, [](C x, C dy) {
              C cdf = C(0.5) * (C(1) + std::erf(x * C(M_SQRT1_2)));
              C pdf = std::exp(C(-0.5) * x * x) * C(0.3989422804014327);
              return dy * (cdf + x * pdf);
            });
          case BinaryOp::gelu_tanh_backward:
            return map2<T, T>(a, b, out, [](C x, C dy) {
              const C k = C(0.7978845608028654), c = C(0.044715);
              C t = std::tanh(k * (x + c * x * x * x));
              return dy * (C(0.5) * (C(1) + t) + C(0.5) * x * (C(1) - t * t) * k * (C(1) + C(3) * c * x * x));
            });
          default: break;
        }
      }
      throw std::invalid_argument("binary op not supported for dtype " + std::string(dtype_name(a.dtype())));
    }
  });
}

void CpuBackend::silu_and_mul(const Tensor& x, const Tensor& out) {
  const int64_t m = out.size(0), n = out.size(1), ld = x.stride(0);
  // Columns in chunks, so that one row (decode) still spreads over the threads.
  constexpr int64_t kChunk = 1024;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    parallel_for(m * chunks, std::min(n, kChunk) * 8, [&](int64_t lo, int64_t hi) {
      alignas(64) float in[kChunk], res[kChunk];
      for (int64_t w = lo; w < hi; ++w) {
        const int64_t r = w / chunks, c0 = (w % chunks) * kChunk, len = std::min(kChunk, n - c0);
        const T* gate = xp + r * ld + c0;
        const T* up = gate + n;
        T* o = op + r * n + c0;
        if constexpr (std::is_same_v<T, float> || std::is_same_v<T, BFloat16>) {
          // Eigen's vectorised logistic, as unary silu's fast path, over a
          // length padded to whole packets: every value takes the packet
          // code, whatever its place in the row.
          const int64_t padded = (len + 15) / 16 * 16;
          for (int64_t i = 0; i < len; ++i) in[i] = float(gate[i]);
          for (int64_t i = len; i < padded; ++i) in[i] = 0.0f;
          Eigen::Map<const Eigen::ArrayXf> a(in, padded);
          Eigen::Map<Eigen::ArrayXf> s(res, padded);
          apply_fast(UnaryOp::silu, a, s);
          for (int64_t i = 0; i < len; ++i) o[i] = T(C(up[i]) * C(T(res[i])));
        } else {
          for (int64_t i = 0; i < len; ++i) {
            const C g = C(gate[i]);
            o[i] = T(C(up[i]) * C(T(g * sigmoid_f(g))));
          }
        }
      }
    });
  };
  for_float_dtype(x.dtype(), "silu_and_mul", run);
}

void CpuBackend::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  visit_dtype(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    strided_loop<4>(out.shape(), {&cond, &a, &b, &out},
                    [&](const std::array<char*, 4>& p, const std::array<int64_t, 4>& s, int64_t n) {
      for (int64_t i = 0; i < n; ++i)
        store<T>(p[3] + i * s[3], load<bool>(p[0] + i * s[0]) ? load<T>(p[1] + i * s[1]) : load<T>(p[2] + i * s[2]));
    });
  });
}

}  // namespace areno::cpu
