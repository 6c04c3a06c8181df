// Reductions over the middle dim of [outer, n, inner] and cumulative sums.
#include <limits>
#include <type_traits>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"

namespace areno::cpu {

namespace {
// Accumulator type: f32 sums in double (cheap, and stable for long rows).
template <typename C> struct acc_of { using type = C; };
template <> struct acc_of<float> { using type = double; };
}  // namespace

void CpuBackend::reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t n, int64_t inner,
                        const Tensor& out) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = std::conditional_t<std::is_same_v<T, bool>, int64_t, compute_t<T>>;
    using A = typename acc_of<C>::type;
    const T* xp = static_cast<const T*>(x.data_ptr());
    auto val = [](T v) { return C(std::is_same_v<T, BFloat16> || std::is_same_v<T, Half> ? C(float(v)) : C(v)); };
    parallel_for(outer * inner, n, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        int64_t o = r / inner, i = r % inner;
        const T* row = xp + o * n * inner + i;
        if (op == ReduceOp::sum) {
          A acc = 0;
          if (inner == 1) {
            for (int64_t j = 0; j < n; ++j) acc += A(val(row[j]));
          } else {
            for (int64_t j = 0; j < n; ++j) acc += A(val(row[j * inner]));
          }
          visit_dtype(out.dtype(), [&](auto otag) {
            using O = decltype(otag);
            if constexpr (std::is_same_v<O, BFloat16> || std::is_same_v<O, Half>)
              static_cast<O*>(out.data_ptr())[r] = O(float(acc));
            else
              static_cast<O*>(out.data_ptr())[r] = O(acc);
          });
          continue;
        }
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
