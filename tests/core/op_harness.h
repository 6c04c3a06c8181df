#pragma once
// Helpers of the table-driven op tests (ggml's test-backend-ops idea): input
// specifications with views, deterministic host-side random values (std::
// generators, independent of our own RNG kernels), host copies of tensors and
// the normalised error bound per dtype.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace areno::testing {

// How an input's values are drawn. For integer test dtypes the floating kinds
// draw small integers instead (normal: [-5, 5], positive: [1, 5]).
enum class Kind {
  normal,    // N(0, 1)
  positive,  // U(0.5, 2): log, sqrt, pow bases
  unit,      // U(-0.9, 0.9)
  wide,      // U(-100, 100): casts
  few,       // one of {-1, 0, 1, 2}: comparisons see equal values
  index,     // i64 in [0, hi)
  perm,      // i64 [m, n]: each column holds distinct values in [0, hi) (scatter without races)
  boolean,   // bool, p = 0.5
};

// How the input tensor is laid out. The logical shape is always In::shape.
enum class View {
  contig,
  transposed,  // allocated with the last two dims swapped, then transposed back
  strided,     // allocated with the last dim doubled, then sliced with step 2
  sliced,      // the first half of the last dim of one twice as wide (rows a stride apart: the gate of gate_up)
  expanded,    // allocated with dim 0 of size 1, then expanded
};

struct In {
  Shape shape;
  Kind kind = Kind::normal;
  View view = View::contig;
  int64_t hi = 0;  // index/perm upper bound
  In(Shape s) : shape(std::move(s)) {}
  In(std::initializer_list<int64_t> s) : shape(s) {}
  In(Shape s, Kind k, View v = View::contig, int64_t h = 0)
      : shape(std::move(s)), kind(k), view(v), hi(h) {}
};
inline In pos(Shape s) { return In(std::move(s), Kind::positive); }
inline In unit(Shape s) { return In(std::move(s), Kind::unit); }
inline In wide(Shape s) { return In(std::move(s), Kind::wide); }
inline In few(Shape s) { return In(std::move(s), Kind::few); }
inline In idx(Shape s, int64_t hi) { return In(std::move(s), Kind::index, View::contig, hi); }
inline In perm(Shape s, int64_t hi) { return In(std::move(s), Kind::perm, View::contig, hi); }
inline In mask(Shape s) { return In(std::move(s), Kind::boolean); }
inline In tr(Shape s) { return In(std::move(s), Kind::normal, View::transposed); }
inline In step2(Shape s) { return In(std::move(s), Kind::normal, View::strided); }
inline In bcast(Shape s) { return In(std::move(s), Kind::normal, View::expanded); }
inline In half_rows(Shape s) { return In(std::move(s), Kind::normal, View::sliced); }

inline std::string view_name(View v) {
  switch (v) {
    case View::contig: return "";
    case View::transposed: return "T";
    case View::strided: return "step2";
    case View::sliced: return "half";
    case View::expanded: return "expanded";
  }
  return "?";
}

inline std::string describe(const std::vector<In>& ins) {
  std::string s;
  for (size_t i = 0; i < ins.size(); ++i) {
    if (i) s += ", ";
    s += shape_str(ins[i].shape);
    if (ins[i].view != View::contig) {  // appended piecewise: GCC 12 warns (-Wrestrict) on "(" + str
      s += '(';
      s += view_name(ins[i].view);
      s += ')';
    }
  }
  return s;
}

inline uint64_t hash_str(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

inline DType input_dtype(const In& in, DType test_dtype) {
  if (in.kind == Kind::index || in.kind == Kind::perm) return DType::i64;
  if (in.kind == Kind::boolean) return DType::boolean;
  return test_dtype;
}

// Host values for `shape` drawn as `kind` for a tensor of dtype `dt`.
inline std::vector<double> draw(const Shape& shape, Kind kind, int64_t hi, DType dt,
                                std::mt19937_64& rng) {
  int64_t n = shape_numel(shape);
  std::vector<double> v(size_t(n), 0.0);
  bool integral = is_integral(dt);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto uni = [&](double a, double b) { return std::uniform_real_distribution<double>(a, b)(rng); };
  auto irange = [&](int64_t a, int64_t b) {  // [a, b]
    return double(std::uniform_int_distribution<int64_t>(a, b)(rng));
  };
  if (kind == Kind::perm) {
    // shape [m, n]: column j holds m distinct values of [0, hi).
    int64_t m = shape.at(0), cols = n / std::max<int64_t>(m, 1);
    for (int64_t j = 0; j < cols; ++j) {
      std::vector<int64_t> p(static_cast<size_t>(hi));
      for (int64_t i = 0; i < hi; ++i) p[size_t(i)] = i;
      std::shuffle(p.begin(), p.end(), rng);
      for (int64_t i = 0; i < m; ++i) v[size_t(i * cols + j)] = double(p[size_t(i)]);
    }
    return v;
  }
  for (auto& x : v) {
    switch (kind) {
      case Kind::normal: x = integral ? irange(-5, 5) : normal(rng); break;
      case Kind::positive: x = integral ? irange(1, 5) : uni(0.5, 2.0); break;
      case Kind::unit: x = integral ? irange(-1, 1) : uni(-0.9, 0.9); break;
      case Kind::wide: x = integral ? irange(-100, 100) : uni(-100.0, 100.0); break;
      case Kind::few: x = irange(-1, 2); break;
      case Kind::index: x = irange(0, hi - 1); break;
      case Kind::boolean: x = irange(0, 1); break;
      case Kind::perm: break;
    }
  }
  return v;
}

// Makes the input on `device` with the layout `in.view`. The values depend only
// on `seed`, so every dtype and device sees the same numbers (up to rounding).
inline Tensor make_input(const In& in, DType test_dtype, Device device, uint64_t seed) {
  DType dt = input_dtype(in, test_dtype);
  Shape alloc = in.shape;
  int64_t nd = int64_t(alloc.size());
  if (in.view == View::transposed && nd >= 2) std::swap(alloc[size_t(nd - 1)], alloc[size_t(nd - 2)]);
  if ((in.view == View::strided || in.view == View::sliced) && nd >= 1) alloc[size_t(nd - 1)] *= 2;
  if (in.view == View::expanded && nd >= 1) alloc[0] = 1;
  std::mt19937_64 rng(seed);
  auto vals = draw(alloc, in.kind, in.hi, dt, rng);
  Tensor t = from_vector<double>(vals, alloc, TensorOptions(dt)).to(device);
  switch (in.view) {
    case View::contig: return t;
    case View::transposed: return nd >= 2 ? t.transpose(-1, -2) : t;
    case View::strided: return nd >= 1 ? t.slice(-1, 0, alloc[size_t(nd - 1)], 2) : t;
    case View::sliced: return nd >= 1 ? t.narrow(-1, 0, in.shape[size_t(nd - 1)]) : t;
    case View::expanded: return nd >= 1 ? t.expand(in.shape) : t;
  }
  return t;
}

// The reference's copy of an input: same values, f64 (indices and masks keep
// their dtype), contiguous, on the CPU.
inline Tensor reference_input(const Tensor& t, const In& in) {
  DType dt = input_dtype(in, DType::f64);
  return t.to(Device::cpu(), dt).contiguous();
}

// Host copy in logical (row-major) order.
struct Host {
  Shape shape;
  std::vector<double> v;
  int64_t numel() const { return int64_t(v.size()); }
  double operator[](int64_t i) const { return v[size_t(i)]; }
};
inline Host host(const Tensor& t) { return Host{t.shape(), t.to_vector<double>()}; }

// Error bound per dtype, relative to |ref| + rms(ref) (so values near zero are
// judged against the output's typical magnitude, as ggml's normalised error).
inline double dtype_tolerance(DType dt) {
  switch (dt) {
    case DType::f64: return 1e-12;
    case DType::f32: return 1e-5;
    case DType::bf16: return 1e-2;
    case DType::f16: return 2e-3;
    default: return 0.0;  // integers and bool are exact
  }
}

// The coarser of two dtypes' tolerances (input precision vs output precision).
inline double coarser_tolerance(DType a, DType b) {
  if (!is_floating(a) && !is_floating(b)) return 0.0;
  if (!is_floating(a)) return dtype_tolerance(b);
  if (!is_floating(b)) return dtype_tolerance(a);
  return std::max(dtype_tolerance(a), dtype_tolerance(b));
}

struct Mismatch {
  bool ok = true;
  std::string message;
};

// Compares `out` (any device/dtype) with the f64 reference `ref`.
inline Mismatch compare(const Tensor& out, const Tensor& ref, double tol) {
  Mismatch r;
  if (out.shape() != ref.shape()) {
    r.ok = false;
    r.message = "shape " + shape_str(out.shape()) + ", expected " + shape_str(ref.shape());
    return r;
  }
  Host o = host(out), e = host(ref);
  double ss = 0;
  int64_t finite = 0;
  for (double x : e.v)
    if (std::isfinite(x)) ss += x * x, ++finite;
  double rms = finite ? std::sqrt(ss / double(finite)) : 0.0;
  double scale = std::max(rms, 1e-6);
  double worst = 0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < e.numel(); ++i) {
    double a = o[i], b = e[i];
    if (std::isnan(b) || std::isnan(a)) {
      if (std::isnan(a) && std::isnan(b)) continue;
      worst = INFINITY, worst_i = i;
      break;
    }
    if (std::isinf(b) || std::isinf(a)) {
      if (a == b) continue;
      worst = INFINITY, worst_i = i;
      break;
    }
    double err = std::abs(a - b) / (std::abs(b) + scale);
    if (err > worst) worst = err, worst_i = i;
  }
  if (worst > tol || (tol == 0.0 && worst > 0.0)) {
    std::ostringstream m;
    m.precision(9);
    m << "element " << worst_i << ": got " << o[worst_i] << ", expected " << e[worst_i]
      << " (normalised error " << worst << " > bound " << tol << ", rms(ref) " << rms << ")";
    r.ok = false;
    r.message = m.str();
  }
  return r;
}

}  // namespace areno::testing
