// Sort and top-k along the rows of a contiguous [m, n]: one stable index sort
// per row (as kernels/cuda/sort.cu).
#include <algorithm>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"

namespace areno::cpu {

void CpuBackend::sort(const Tensor& x, int64_t k, bool descending, const Tensor& values,
                      const Tensor& indices) {
  int64_t m = x.size(0), n = x.size(1);
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = std::conditional_t<std::is_same_v<T, bool>, int, compute_t<T>>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    T* vp = static_cast<T*>(values.data_ptr());
    int64_t* ip = static_cast<int64_t*>(indices.data_ptr());
    parallel_for(m, n * 8, [&](int64_t lo, int64_t hi) {
      std::vector<int64_t> idx(n);
      for (int64_t i = lo; i < hi; ++i) {
        const T* r = xp + i * n;
        std::iota(idx.begin(), idx.end(), 0);
        // NaN sorts as the largest value, as in torch.
        auto key = [&](int64_t j) { return C(r[j]); };
        auto less = [&](int64_t a, int64_t b) {
          C va = key(a), vb = key(b);
          bool na = va != va, nb = vb != vb;
          if (descending) {
            if (na != nb) return na;
            if (va != vb && !na) return va > vb;
          } else {
            if (na != nb) return nb;
            if (va != vb && !na) return va < vb;
          }
          return a < b;
        };
        if (k < n) {
          std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), less);
        } else {
          std::sort(idx.begin(), idx.end(), less);
        }
        for (int64_t j = 0; j < k; ++j) {
          vp[i * k + j] = r[idx[j]];
          ip[i * k + j] = idx[j];
        }
      }
    });
  });
}

}  // namespace areno::cpu
