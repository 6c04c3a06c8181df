// Indexing kernels: index_select / index_add over [outer, n, inner], gather,
// scatter and masked_scatter.
#include <cstring>
#include <type_traits>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"

namespace areno::cpu {

namespace {
template <typename T> inline T add_vals(T a, T b) {
  if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) return T(float(a) + float(b));
  else if constexpr (std::is_same_v<T, bool>) return a || b;
  else return T(a + b);
}

// Offset in a contiguous tensor of shape `shape` of the element whose
// coordinates are those of linear index `lin` in `ishape`, with dim `dim` replaced by `at`.
inline int64_t remap(int64_t lin, const Shape& ishape, const Shape& strides, int64_t dim, int64_t at) {
  int64_t off = 0;
  for (int64_t d = int64_t(ishape.size()) - 1; d >= 0; --d) {
    int64_t c = lin % ishape[d];
    lin /= ishape[d];
    off += (d == dim ? at : c) * strides[d];
  }
  return off;
}
}  // namespace

void CpuBackend::index_select(const Tensor& x, const Tensor& index, const Tensor& out) {
  int64_t outer = x.size(0), n = x.size(1), inner = x.size(2), m = index.numel();
  const int64_t* ip = static_cast<const int64_t*>(index.data_ptr());
  size_t es = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  parallel_for(outer * m, inner, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      int64_t o = r / m, j = r % m;
      std::memcpy(op + size_t((o * m + j) * inner) * es, xp + size_t((o * n + ip[j]) * inner) * es,
                  size_t(inner) * es);
    }
  });
}

void CpuBackend::index_add(const Tensor& out, const Tensor& index, const Tensor& src) {
  int64_t outer = out.size(0), n = out.size(1), inner = out.size(2), m = index.numel();
  const int64_t* ip = static_cast<const int64_t*>(index.data_ptr());
  visit_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* op = static_cast<T*>(out.data_ptr());
    const T* sp = static_cast<const T*>(src.data_ptr());
    // Parallel over the inner dim keeps duplicate indices race-free.
    parallel_for(inner, outer * m, [&](int64_t lo, int64_t hi) {
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t j = 0; j < m; ++j) {
          T* dst = op + (o * n + ip[j]) * inner;
          const T* s = sp + (o * m + j) * inner;
          for (int64_t k = lo; k < hi; ++k) dst[k] = add_vals(dst[k], s[k]);
        }
    });
  });
}

void CpuBackend::gather(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out) {
  const int64_t* ip = static_cast<const int64_t*>(index.data_ptr());
  Shape xs = x.strides(), ishape = index.shape();
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    parallel_for(index.numel(), 4, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) op[i] = xp[remap(i, ishape, xs, dim, ip[i])];
    });
  });
}

void CpuBackend::scatter(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src,
                         bool accumulate) {
  const int64_t* ip = static_cast<const int64_t*>(index.data_ptr());
  Shape os = out.strides(), ishape = index.shape();
  visit_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* op = static_cast<T*>(out.data_ptr());
    const T* sp = static_cast<const T*>(src.data_ptr());
    // Serial: duplicate targets must add (or overwrite) in a defined order.
    for (int64_t i = 0; i < index.numel(); ++i) {
      int64_t o = remap(i, ishape, os, dim, ip[i]);
      op[o] = accumulate ? add_vals(op[o], sp[i]) : sp[i];
    }
  });
}

void CpuBackend::masked_scatter(const Tensor& out, const Tensor& mask, const Tensor& src) {
  const bool* mp = static_cast<const bool*>(mask.data_ptr());
  size_t es = out.element_size();
  char* op = static_cast<char*>(out.data_ptr());
  const char* sp = static_cast<const char*>(src.data_ptr());
  int64_t k = 0;
  for (int64_t i = 0; i < out.numel(); ++i)
    if (mp[i]) std::memcpy(op + size_t(i) * es, sp + size_t(k++) * es, es);
}

}  // namespace areno::cpu
