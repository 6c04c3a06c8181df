// Reductions over the middle dim of [outer, n, inner] and cumulative sums.
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/vec_exp.h"

namespace areno::cpu {

namespace {
// Accumulator type: f32 sums in double (cheap, and stable for long rows).
template <typename C> struct acc_of { using type = C; };
template <> struct acc_of<float> { using type = double; };

// The first index of the largest (want_max) or smallest value of x[b, e),
// the first NaN if there is one: the scalar loop's answer, in two
// vectorisable passes (the extreme and whether a NaN is present, then the
// first index holding it).
struct Extreme {
  float v;
  int64_t j;
};
// kLanes values from x as f32 lanes (bf16 widened exactly): 16 with
// AVX-512, else 8 (GCC 12 lowers 16-lane selects nearly lane by lane below
// AVX-512: this pass over 200064 floats took 0.57 ms at 16 lanes and 0.044
// ms at 8 on an AVX2 Zen 3).
#ifdef __AVX512F__
constexpr int kLanes = 16;
typedef F16 FL;
typedef I16 IL;
#else
constexpr int kLanes = 8;
typedef F8 FL;
typedef I8 IL;
#endif
inline FL load_lanes(const float* x) {
  FL v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
inline FL load_lanes(const BFloat16* x) { return widen_bf16_lanes<FL>(x); }
template <typename T>
Extreme extreme_of(const T* x, int64_t b, int64_t e, bool want_max) {
  float m = float(x[b]);
  bool nan = false;
  int64_t j = b;
  if (e - b >= kLanes) {  // lanes (GCC vector types), then across the lanes
    FL ml = load_lanes(x + b);
    IL nanl = {};
    for (; j + kLanes <= e; j += kLanes) {
      const FL v = load_lanes(x + j);
      nanl |= v != v;
      ml = want_max ? (v > ml ? v : ml) : (v < ml ? v : ml);
    }
    for (int l = 0; l < kLanes; ++l) {
      nan = nan || nanl[l] != 0;
      m = want_max ? (ml[l] > m ? ml[l] : m) : (ml[l] < m ? ml[l] : m);
    }
  }
  for (; j < e; ++j) {
    const float v = float(x[j]);
    nan = nan || v != v;
    m = want_max ? (v > m ? v : m) : (v < m ? v : m);
  }
  for (int64_t j = b; j < e; ++j) {
    const float v = float(x[j]);
    if (nan ? v != v : v == m) return {v, j};
  }
  return {m, b};  // not reached
}

// Rows long enough to split across threads: the argmax of the sampler's one
// row of 200064 logits ran on one thread while the other waited.
constexpr int64_t kSplitRow = 1 << 15;

// f32 / bf16 max / min / argmax / argmin over contiguous rows (inner == 1): each row
// in chunks, one per thread for long rows, the chunks' answers combined in
// order (a later chunk wins only with a NaN or a strictly better value, as
// the scalar loop).
template <typename T>
void extreme_rows(ReduceOp op, const T* x, int64_t rows, int64_t n, const Tensor& out) {
  const bool want_max = op == ReduceOp::max || op == ReduceOp::argmax;
  const bool index = op == ReduceOp::argmax || op == ReduceOp::argmin;
  const int64_t parts = rows < num_threads() && n >= kSplitRow ? num_threads() : 1;
  std::vector<Extreme> found(size_t(rows * parts));
  parallel_for(rows * parts, n / parts, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t r = t / parts, p = t % parts;
      found[size_t(t)] = extreme_of(x + r * n, n * p / parts, n * (p + 1) / parts, want_max);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    Extreme best = found[size_t(r * parts)];
    for (int64_t p = 1; p < parts && best.v == best.v; ++p) {
      const Extreme c = found[size_t(r * parts + p)];
      if (c.v != c.v || (want_max ? c.v > best.v : c.v < best.v)) best = c;
    }
    if (index) static_cast<int64_t*>(out.data_ptr())[r] = best.j;
    else static_cast<T*>(out.data_ptr())[r] = x[r * n + best.j];
  }
}
// Sums. A contiguous row (inner == 1) is summed in blocks of kSumBlock
// values, each block in kSumLanes interleaved partial sums added in lane
// order, the blocks' sums then added in block order: one order whatever the
// thread count (long rows split their blocks across threads), and no chain of
// dependent adds (one running sum held a 51 M-value gradient's norm to about
// 80 ms on one thread). With inner > 1 each output is still one running sum
// over n in order (the bits of the plain loop), but a stretch of outputs is
// carried together so that every read is contiguous.
constexpr int64_t kSumBlock = 8192;
constexpr int kSumLanes = 16;

template <typename A, typename T, typename Val>
A sum_block(const T* x, int64_t n, Val val) {
  A acc[kSumLanes] = {};
  int64_t j = 0;
  for (; j + kSumLanes <= n; j += kSumLanes)
    for (int l = 0; l < kSumLanes; ++l) acc[l] += A(val(x[j + l]));
  for (int l = 0; j < n; ++j, ++l) acc[l] += A(val(x[j]));
  A s = 0;
  for (int l = 0; l < kSumLanes; ++l) s += acc[l];
  return s;
}

template <typename A, typename T, typename Val, typename Store>
void sum_rows(const T* x, int64_t rows, int64_t n, Val val, Store store) {
  const int64_t blocks = (n + kSumBlock - 1) / kSumBlock;
  if (blocks <= 1) {  // each row one block: no partial sums kept (rows may be many)
    parallel_for(rows, std::max<int64_t>(n, 1), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) store(r, sum_block<A>(x + r * n, n, val));
    });
    return;
  }
  std::vector<A> part(size_t(rows * blocks));  // at most 2 per kSumBlock values
  parallel_for(rows * blocks, std::min(n, kSumBlock), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t r = t / blocks, b = (t % blocks) * kSumBlock;
      part[size_t(t)] = sum_block<A>(x + r * n + b, std::min(kSumBlock, n - b), val);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    A s = part[size_t(r * blocks)];
    for (int64_t b = 1; b < blocks; ++b) s += part[size_t(r * blocks + b)];
    store(r, s);
  }
}

template <typename A, typename T, typename Val, typename Store>
void sum_columns(const T* x, int64_t outer, int64_t n, int64_t inner, Val val, Store store) {
  constexpr int64_t kStretch = 256;
  const int64_t stretches = (inner + kStretch - 1) / kStretch;
  parallel_for(outer * stretches, n * std::min(inner, kStretch), [&](int64_t lo, int64_t hi) {
    A acc[kStretch];
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t o = t / stretches, i0 = (t % stretches) * kStretch, w = std::min(kStretch, inner - i0);
      for (int64_t i = 0; i < w; ++i) acc[i] = 0;
      const T* base = x + o * n * inner + i0;
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < w; ++i) acc[i] += A(val(base[j * inner + i]));
      for (int64_t i = 0; i < w; ++i) store(o * inner + i0 + i, acc[i]);
    }
  });
}

}  // namespace

void CpuBackend::reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t n, int64_t inner,
                        const Tensor& out) {
  if (inner == 1 && n > 0 && op != ReduceOp::sum && op != ReduceOp::sum_squares) {
    if (x.dtype() == DType::f32) return extreme_rows(op, static_cast<const float*>(x.data_ptr()), outer, n, out);
    if (x.dtype() == DType::bf16) return extreme_rows(op, static_cast<const BFloat16*>(x.data_ptr()), outer, n, out);
  }
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = std::conditional_t<std::is_same_v<T, bool>, int64_t, compute_t<T>>;
    using A = typename acc_of<C>::type;
    const T* xp = static_cast<const T*>(x.data_ptr());
    auto val = [](T v) { return C(std::is_same_v<T, BFloat16> || std::is_same_v<T, Half> ? C(float(v)) : C(v)); };
    if (op == ReduceOp::sum || op == ReduceOp::sum_squares) {
      visit_dtype(out.dtype(), [&](auto otag) {
        using O = decltype(otag);
        O* op_ = static_cast<O*>(out.data_ptr());
        auto store = [op_](int64_t r, A acc) {
          if constexpr (std::is_same_v<O, BFloat16> || std::is_same_v<O, Half>) op_[r] = O(float(acc));
          else op_[r] = O(acc);
        };
        auto run = [&](auto v) {
          if (inner == 1) sum_rows<A>(xp, outer, n, v, store);
          else sum_columns<A>(xp, outer, n, inner, v, store);
        };
        // x squared in the compute type (f32 for f32 and the 16-bit types), then summed as sum's values are.
        if (op == ReduceOp::sum) run(val);
        else run([&](T v) { const C c = val(v); return C(c * c); });
      });
      return;
    }
    parallel_for(outer * inner, n, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        int64_t o = r / inner, i = r % inner;
        const T* row = xp + o * n * inner + i;
        bool want_max = op == ReduceOp::max || op == ReduceOp::argmax;
        C best = val(row[0]);
        int64_t best_j = 0;
        for (int64_t j = 1; j < n; ++j) {
          C v = val(row[j * inner]);
          if (best != best) break;  // NaN wins, first occurrence
          if (v != v || (want_max ? v > best : v < best)) {
            best = v;
            best_j = j;
          }
        }
        if (op == ReduceOp::argmax || op == ReduceOp::argmin)
          static_cast<int64_t*>(out.data_ptr())[r] = best_j;
        else
          static_cast<T*>(out.data_ptr())[r] = row[best_j * inner];
      }
    });
  });
}

void CpuBackend::cumsum(const Tensor& x, int64_t outer, int64_t n, int64_t inner,
                        const Tensor& out) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, bool>) {
      throw std::invalid_argument("cumsum of bool: cast first");
    } else {
      using C = compute_t<T>;
      using A = typename acc_of<C>::type;
      const T* xp = static_cast<const T*>(x.data_ptr());
      T* op = static_cast<T*>(out.data_ptr());
      parallel_for(outer * inner, n, [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
          int64_t o = r / inner, i = r % inner;
          A acc = 0;
          for (int64_t j = 0; j < n; ++j) {
            int64_t k = o * n * inner + j * inner + i;
            if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
              acc += A(float(xp[k]));
              op[k] = T(float(acc));
            } else {
              acc += A(xp[k]);
              op[k] = T(acc);
            }
          }
        }
      });
    }
  });
}

}  // namespace areno::cpu
