// Indexing kernels: index_select / index_add over [outer, n, inner] views,
// gather / scatter along a dim, and masked_scatter through a prefix scan.
// Moves are raw bits (one kernel per element size); adds use atomics.
#include <cub/device/device_scan.cuh>

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

namespace areno::cuda {
namespace {

void check_index(const Tensor& index, const char* op) {
  if (index.dtype() != DType::i64)
    throw std::invalid_argument(std::string("cuda ") + op + ": index must be i64, got " + index.str());
  require_contiguous(index, op, "index");
}

void check_3d(const Tensor& t, const char* op, const char* name) {
  if (t.dim() != 3)
    throw std::invalid_argument(std::string("cuda ") + op + ": " + name + " must be an [outer, n, inner] view, got " +
                                t.str());
  require_contiguous(t, op, name);
}

// out += v, atomically; bool accumulation is logical or.
template <typename T>
__device__ __forceinline__ void atomic_add_value(T* p, T v) {
  if constexpr (std::is_same_v<T, bool>) {
    if (v) *p = true;  // concurrent writers all store true
  } else if constexpr (std::is_same_v<T, int64_t>) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
  } else {
    atomicAdd(p, v);  // float, double, int, __half (sm_70+), __nv_bfloat16 (sm_80+)
  }
}

template <typename B>
__global__ void index_select_kernel(const B* x, const int64_t* index, B* out, int64_t outer,
                                    int64_t n, int64_t m, int64_t inner) {
  ARENO_GRID_STRIDE_LOOP(i, outer * m * inner) {
    int64_t k = i % inner, r = i / inner;
    int64_t j = r % m, o = r / m;
    out[i] = x[(o * n + index[j]) * inner + k];
  }
}

template <typename T>
__global__ void index_add_kernel(T* out, const int64_t* index, const T* src, int64_t outer,
                                 int64_t n, int64_t m, int64_t inner) {
  ARENO_GRID_STRIDE_LOOP(i, outer * m * inner) {
    int64_t k = i % inner, r = i / inner;
    int64_t j = r % m, o = r / m;
    atomic_add_value(out + (o * n + index[j]) * inner + k, src[i]);
  }
}

// Shape of the index tensor and strides of the indexed tensor.
struct DimMap {
  int nd;
  int dim;
  int64_t shape[kMaxDims];
  int64_t strides[kMaxDims];

  // Offset of the element with linear index i's coordinates, `at` along dim.
  __device__ __forceinline__ int64_t offset(int64_t i, int64_t at) const {
    int64_t off = 0;
    for (int d = nd - 1; d >= 0; --d) {
      int64_t c = i % shape[d];
      i /= shape[d];
      off += (d == dim ? at : c) * strides[d];
    }
    return off;
  }
};

DimMap make_dim_map(const Tensor& index, const Tensor& target, int64_t dim, const char* op) {
  if (index.dim() > kMaxDims || target.dim() != index.dim())
    throw std::invalid_argument(std::string("cuda ") + op + ": index " + index.str() + " and " +
                                target.str() + " must have one rank, at most 8");
  DimMap m;
  m.nd = int(index.dim());
  m.dim = int(dim);
  for (int d = 0; d < m.nd; ++d) {
    m.shape[d] = index.size(d);
    m.strides[d] = target.stride(d);
  }
  if (m.nd == 0) {  // a scalar: one element at offset 0
    m.nd = 1;
    m.dim = 0;
    m.shape[0] = 1;
    m.strides[0] = 0;
  }
  return m;
}

template <typename B>
__global__ void gather_kernel(const B* x, const int64_t* index, B* out, int64_t total, DimMap map) {
  ARENO_GRID_STRIDE_LOOP(i, total) out[i] = x[map.offset(i, index[i])];
}

template <typename T>
__global__ void scatter_add_kernel(T* out, const int64_t* index, const T* src, int64_t total,
                                   DimMap map) {
  ARENO_GRID_STRIDE_LOOP(i, total) atomic_add_value(out + map.offset(i, index[i]), src[i]);
}

// Plain scatter with duplicate targets: the last source element wins (as
// the CPU's serial loop). Pass 1 records the largest source index per target.
__global__ void scatter_claim_kernel(const int64_t* index, int64_t total, DimMap map,
                                     unsigned long long* winner) {
  ARENO_GRID_STRIDE_LOOP(i, total) atomicMax(winner + map.offset(i, index[i]), (unsigned long long)(i + 1));
}

template <typename B>
__global__ void scatter_write_kernel(B* out, const int64_t* index, const B* src, int64_t total,
                                     DimMap map, const unsigned long long* winner) {
  ARENO_GRID_STRIDE_LOOP(i, total) {
    int64_t o = map.offset(i, index[i]);
    if (winner[o] == (unsigned long long)(i + 1)) out[o] = src[i];
  }
}

__global__ void mask_to_int_kernel(const bool* mask, int64_t* flags, int64_t n) {
  ARENO_GRID_STRIDE_LOOP(i, n) flags[i] = mask[i] ? 1 : 0;
}

template <typename B>
__global__ void masked_scatter_kernel(B* out, const bool* mask, const int64_t* pos, const B* src,
                                      int64_t n, int64_t src_n) {
  ARENO_GRID_STRIDE_LOOP(i, n) {
    if (mask[i] && pos[i] < src_n) out[i] = src[pos[i]];
  }
}

}  // namespace
}  // namespace areno::cuda

namespace areno {

using namespace cuda;

void CudaBackend::index_select(const Tensor& x, const Tensor& index, const Tensor& out) {
  check_3d(x, "index_select", "x");
  check_3d(out, "index_select", "out");
  check_index(index, "index_select");
  int64_t outer = x.size(0), n = x.size(1), inner = x.size(2), m = index.numel();
  if (out.size(0) != outer || out.size(1) != m || out.size(2) != inner || out.dtype() != x.dtype())
    throw std::invalid_argument("cuda index_select: out " + out.str() + " does not match x " +
                                x.str() + " and " + std::to_string(m) + " indices");
  int64_t total = outer * m * inner;
  if (total == 0) return;
  Launch l(out);
  visit_bits(x.element_size(), [&](auto tag) {
    using B = typename decltype(tag)::type;
    index_select_kernel<B><<<grid_for(total), kBlock, 0, l.stream>>>(
        ptr<const B>(x), ptr<const int64_t>(index), ptr<B>(out), outer, n, m, inner);
    ARENO_LAUNCH_CHECK("index_select_kernel");
  });
}

void CudaBackend::index_add(const Tensor& out, const Tensor& index, const Tensor& src) {
  check_3d(out, "index_add", "out");
  check_3d(src, "index_add", "src");
  check_index(index, "index_add");
  int64_t outer = out.size(0), n = out.size(1), inner = out.size(2), m = index.numel();
  if (src.size(0) != outer || src.size(1) != m || src.size(2) != inner || src.dtype() != out.dtype())
    throw std::invalid_argument("cuda index_add: src " + src.str() + " does not match out " +
                                out.str() + " and " + std::to_string(m) + " indices");
  int64_t total = outer * m * inner;
  if (total == 0) return;
  Launch l(out);
  visit_cuda_dtype(out.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    index_add_kernel<T><<<grid_for(total), kBlock, 0, l.stream>>>(
        ptr<T>(out), ptr<const int64_t>(index), ptr<const T>(src), outer, n, m, inner);
    ARENO_LAUNCH_CHECK("index_add_kernel");
  });
}

void CudaBackend::gather(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out) {
  require_contiguous(x, "gather", "x");
  require_contiguous(out, "gather", "out");
  check_index(index, "gather");
  if (out.shape() != index.shape() || out.dtype() != x.dtype())
    throw std::invalid_argument("cuda gather: out " + out.str() + " must have index's shape " +
                                shape_str(index.shape()) + " and x's dtype");
  int64_t total = index.numel();
  if (total == 0) return;
  DimMap map = make_dim_map(index, x, dim, "gather");
  Launch l(out);
  visit_bits(x.element_size(), [&](auto tag) {
    using B = typename decltype(tag)::type;
    gather_kernel<B><<<grid_for(total), kBlock, 0, l.stream>>>(ptr<const B>(x), ptr<const int64_t>(index),
                                                               ptr<B>(out), total, map);
    ARENO_LAUNCH_CHECK("gather_kernel");
  });
}

void CudaBackend::scatter(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src,
                          bool accumulate) {
  require_contiguous(out, "scatter", "out");
  require_contiguous(src, "scatter", "src");
  check_index(index, "scatter");
  if (src.shape() != index.shape() || src.dtype() != out.dtype())
    throw std::invalid_argument("cuda scatter: src " + src.str() + " must have index's shape " +
                                shape_str(index.shape()) + " and out's dtype");
  int64_t total = index.numel();
  if (total == 0) return;
  DimMap map = make_dim_map(index, out, dim, "scatter");
  Launch l(out);
  if (accumulate) {
    visit_cuda_dtype(out.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      scatter_add_kernel<T><<<grid_for(total), kBlock, 0, l.stream>>>(
          ptr<T>(out), ptr<const int64_t>(index), ptr<const T>(src), total, map);
      ARENO_LAUNCH_CHECK("scatter_add_kernel");
    });
    return;
  }
  auto winner = allocate_scratch(size_t(out.numel()) * sizeof(unsigned long long), out.device().index);
  auto* w = static_cast<unsigned long long*>(winner.get());
  ARENO_CUDA_CHECK(cudaMemsetAsync(w, 0, size_t(out.numel()) * sizeof(unsigned long long), l.stream));
  scatter_claim_kernel<<<grid_for(total), kBlock, 0, l.stream>>>(ptr<const int64_t>(index), total, map, w);
  ARENO_LAUNCH_CHECK("scatter_claim_kernel");
  visit_bits(out.element_size(), [&](auto tag) {
    using B = typename decltype(tag)::type;
    scatter_write_kernel<B><<<grid_for(total), kBlock, 0, l.stream>>>(
        ptr<B>(out), ptr<const int64_t>(index), ptr<const B>(src), total, map, w);
    ARENO_LAUNCH_CHECK("scatter_write_kernel");
  });
}

void CudaBackend::masked_scatter(const Tensor& out, const Tensor& mask, const Tensor& src) {
  require_contiguous(out, "masked_scatter", "out");
  require_contiguous(mask, "masked_scatter", "mask");
  require_contiguous(src, "masked_scatter", "src");
  if (mask.dtype() != DType::boolean || mask.shape() != out.shape())
    throw std::invalid_argument("cuda masked_scatter: mask " + mask.str() +
                                " must be bool with out's shape " + shape_str(out.shape()));
  if (src.dtype() != out.dtype())
    throw std::invalid_argument("cuda masked_scatter: src " + src.str() + " must have out's dtype");
  int64_t n = out.numel();
  if (n == 0) return;
  Launch l(out);
  int device = out.device().index;
  auto flags = allocate_scratch(size_t(n) * sizeof(int64_t), device);
  auto pos = allocate_scratch(size_t(n) * sizeof(int64_t), device);
  auto* fp = static_cast<int64_t*>(flags.get());
  auto* pp = static_cast<int64_t*>(pos.get());
  mask_to_int_kernel<<<grid_for(n), kBlock, 0, l.stream>>>(ptr<const bool>(mask), fp, n);
  ARENO_LAUNCH_CHECK("mask_to_int_kernel");
  size_t temp_bytes = 0;
  ARENO_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, fp, pp, n, l.stream));
  auto temp = allocate_scratch(temp_bytes, device);
  ARENO_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp.get(), temp_bytes, fp, pp, n, l.stream));
  visit_bits(out.element_size(), [&](auto tag) {
    using B = typename decltype(tag)::type;
    masked_scatter_kernel<B><<<grid_for(n), kBlock, 0, l.stream>>>(
        ptr<B>(out), ptr<const bool>(mask), pp, ptr<const B>(src), n, src.numel());
    ARENO_LAUNCH_CHECK("masked_scatter_kernel");
  });
}

}  // namespace areno
