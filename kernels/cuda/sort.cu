// Row-wise stable sort / top-k: values are mapped to unsigned keys whose
// order is the value order (NaN largest, -0 == +0), bit-flipped for
// descending, and sorted with cub's segmented radix sort (stable, so ties
// keep the lower index first). Two key widths (u32, u64) keep cub's
// instantiations at two. Rows up to the 200064-entry vocabulary are fine.
#include <cub/device/device_segmented_radix_sort.cuh>

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

namespace areno::cuda {
namespace {

template <typename T> struct SortKey { using type = uint32_t; };
template <> struct SortKey<double> { using type = uint64_t; };
template <> struct SortKey<int64_t> { using type = uint64_t; };

template <typename T>
__device__ __forceinline__ typename SortKey<T>::type order_key(T v) {
  if constexpr (std::is_same_v<T, double>) {
    if (v != v) v = __longlong_as_double(0x7ff8000000000000ll);  // one NaN, above +inf
    if (v == 0.0) v = 0.0;                                        // -0 sorts as +0
    uint64_t u = uint64_t(__double_as_longlong(v));
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
  } else if constexpr (std::is_same_v<T, int64_t>) {
    return uint64_t(v) ^ 0x8000000000000000ull;
  } else if constexpr (std::is_same_v<T, int32_t>) {
    return uint32_t(v) ^ 0x80000000u;
  } else if constexpr (std::is_same_v<T, bool>) {
    return v ? 1u : 0u;
  } else {  // f32, bf16, f16 (exact in f32)
    float f = cast_value<float>(v);
    if (f != f) f = __int_as_float(0x7fc00000);
    if (f == 0.0f) f = 0.0f;
    uint32_t u = uint32_t(__float_as_int(f));
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
}

template <typename T>
__global__ void make_keys_kernel(const T* x, int64_t total, int64_t n, bool descending,
                                 typename SortKey<T>::type* keys, int32_t* idx) {
  using K = typename SortKey<T>::type;
  ARENO_GRID_STRIDE_LOOP(i, total) {
    K key = order_key(x[i]);
    keys[i] = descending ? K(~key) : key;
    idx[i] = int32_t(i % n);
  }
}

__global__ void segment_offsets_kernel(int32_t* offsets, int64_t m, int64_t n) {
  ARENO_GRID_STRIDE_LOOP(r, m + 1) offsets[r] = int32_t(r * n);
}

template <typename B>
__global__ void take_topk_kernel(const B* x, const int32_t* sorted_idx, int64_t m, int64_t n,
                                 int64_t k, B* values, int64_t* indices) {
  ARENO_GRID_STRIDE_LOOP(i, m * k) {
    int64_t r = i / k, j = i % k;
    int32_t c = sorted_idx[r * n + j];
    values[i] = x[r * n + c];
    indices[i] = c;
  }
}

template <typename K>
void segmented_sort(const Launch& l, int device, const K* keys_in, K* keys_out,
                    const int32_t* idx_in, int32_t* idx_out, int64_t total, int64_t m,
                    const int32_t* offsets) {
  size_t temp_bytes = 0;
  ARENO_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairs(
      nullptr, temp_bytes, keys_in, keys_out, idx_in, idx_out, int(total), int(m), offsets,
      offsets + 1, 0, int(sizeof(K) * 8), l.stream));
  auto temp = allocate_scratch(temp_bytes, device);
  ARENO_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairs(
      temp.get(), temp_bytes, keys_in, keys_out, idx_in, idx_out, int(total), int(m), offsets,
      offsets + 1, 0, int(sizeof(K) * 8), l.stream));
}

}  // namespace
}  // namespace areno::cuda

namespace areno {

using namespace cuda;

void CudaBackend::sort(const Tensor& x, int64_t k, bool descending, const Tensor& values,
                       const Tensor& indices) {
  require_contiguous(x, "sort", "x");
  require_contiguous(values, "sort", "values");
  require_contiguous(indices, "sort", "indices");
  int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  int64_t m = n == 0 ? 0 : x.numel() / n;
  if (k < 0 || k > n)
    throw std::invalid_argument("cuda sort: k = " + std::to_string(k) + " outside [0, " +
                                std::to_string(n) + "]");
  if (values.numel() != m * k || indices.numel() != m * k || values.dtype() != x.dtype() ||
      indices.dtype() != DType::i64)
    throw std::invalid_argument("cuda sort: values " + values.str() + " / indices " + indices.str() +
                                " must be [" + std::to_string(m) + ", " + std::to_string(k) +
                                "] of x's dtype / i64");
  if (m * k == 0) return;
  int64_t total = m * n;
  if (total > int64_t(std::numeric_limits<int32_t>::max()))
    throw std::invalid_argument("cuda sort: " + x.str() + " has more than 2^31 elements");
  Launch l(x);
  int device = x.device().index;
  auto idx_in = allocate_scratch(size_t(total) * 4, device);
  auto idx_out = allocate_scratch(size_t(total) * 4, device);
  auto offsets = allocate_scratch(size_t(m + 1) * 4, device);
  segment_offsets_kernel<<<grid_for(m + 1), kBlock, 0, l.stream>>>(static_cast<int32_t*>(offsets.get()), m, n);
  ARENO_LAUNCH_CHECK("segment_offsets_kernel");
  visit_cuda_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using K = typename SortKey<T>::type;
    auto keys_in = allocate_scratch(size_t(total) * sizeof(K), device);
    auto keys_out = allocate_scratch(size_t(total) * sizeof(K), device);
    make_keys_kernel<T><<<grid_for(total), kBlock, 0, l.stream>>>(
        ptr<const T>(x), total, n, descending, static_cast<K*>(keys_in.get()),
        static_cast<int32_t*>(idx_in.get()));
    ARENO_LAUNCH_CHECK("make_keys_kernel");
    segmented_sort<K>(l, device, static_cast<const K*>(keys_in.get()), static_cast<K*>(keys_out.get()),
                      static_cast<const int32_t*>(idx_in.get()), static_cast<int32_t*>(idx_out.get()),
                      total, m, static_cast<const int32_t*>(offsets.get()));
  });
  visit_bits(x.element_size(), [&](auto tag) {
    using B = typename decltype(tag)::type;
    take_topk_kernel<B><<<grid_for(m * k), kBlock, 0, l.stream>>>(
        ptr<const B>(x), static_cast<const int32_t*>(idx_out.get()), m, n, k, ptr<B>(values),
        ptr<int64_t>(indices));
    ARENO_LAUNCH_CHECK("take_topk_kernel");
  });
}

}  // namespace areno
