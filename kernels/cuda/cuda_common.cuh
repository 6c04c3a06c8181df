#pragma once
// Shared device-side pieces of the CUDA kernels: dtype dispatch to CUDA's
// types, value casts through the compute type (f32 for 16-bit floats), the
// N-d strided offset calculator behind every elementwise kernel, launch
// helpers and warp/block reductions.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "tensor/tensor.h"

namespace areno::cuda {

using bf16 = __nv_bfloat16;
using f16 = __half;

template <typename T> struct TypeTag { using type = T; };

// Calls f(TypeTag<T>{}) with the device type of a dtype.
template <typename F>
decltype(auto) visit_cuda_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(TypeTag<float>{});
    case DType::f64: return f(TypeTag<double>{});
    case DType::bf16: return f(TypeTag<bf16>{});
    case DType::f16: return f(TypeTag<f16>{});
    case DType::i32: return f(TypeTag<int32_t>{});
    case DType::i64: return f(TypeTag<int64_t>{});
    case DType::boolean: return f(TypeTag<bool>{});
  }
  throw std::invalid_argument("cuda: unknown dtype");
}

// Floating dtypes only; `what` names the op in the error.
template <typename F>
decltype(auto) visit_floating(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::f32: return f(TypeTag<float>{});
    case DType::f64: return f(TypeTag<double>{});
    case DType::bf16: return f(TypeTag<bf16>{});
    case DType::f16: return f(TypeTag<f16>{});
    default: break;
  }
  throw std::invalid_argument(std::string("cuda ") + what + ": expected a floating dtype (f32, f64, bf16, f16), got " +
                              std::string(dtype_name(t)));
}

// Same-size raw bits: copies, where, gathers and fills move bits, not values.
template <typename F>
decltype(auto) visit_bits(size_t element_size, F&& f) {
  switch (element_size) {
    case 1: return f(TypeTag<uint8_t>{});
    case 2: return f(TypeTag<uint16_t>{});
    case 4: return f(TypeTag<uint32_t>{});
    case 8: return f(TypeTag<uint64_t>{});
  }
  throw std::invalid_argument("cuda: unsupported element size " + std::to_string(element_size));
}

// The type arithmetic runs in: f32 for the 16-bit floats, i64 for integers.
template <typename T> struct AccType { using type = T; };
template <> struct AccType<bf16> { using type = float; };
template <> struct AccType<f16> { using type = float; };
template <> struct AccType<int32_t> { using type = int64_t; };
template <> struct AccType<bool> { using type = int64_t; };
template <typename T> using acc_t = typename AccType<T>::type;

template <typename T>
inline constexpr bool is_half_v = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

// Value conversion with C++ semantics, 16-bit floats through f32 (RNE).
template <typename D, typename S>
__device__ __forceinline__ D cast_value(S s) {
  if constexpr (std::is_same_v<D, S>) {
    return s;
  } else if constexpr (std::is_same_v<S, bf16>) {
    return cast_value<D>(__bfloat162float(s));
  } else if constexpr (std::is_same_v<S, f16>) {
    return cast_value<D>(__half2float(s));
  } else if constexpr (std::is_same_v<D, bf16>) {
    return __float2bfloat16(static_cast<float>(s));
  } else if constexpr (std::is_same_v<D, f16>) {
    return __float2half(static_cast<float>(s));
  } else if constexpr (std::is_same_v<D, bool>) {
    return s != S(0);
  } else {
    return static_cast<D>(s);
  }
}

template <typename T>
__device__ __forceinline__ acc_t<T> load_acc(const T* p, int64_t i) {
  return cast_value<acc_t<T>>(p[i]);
}

// Writes `v` as dtype `t` (runtime switch: for outputs whose dtype the
// contract leaves open, e.g. a sum into i64; one switch per output element).
template <typename A>
__device__ __forceinline__ void store_as(DType t, void* p, int64_t i, A v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = cast_value<float>(v); break;
    case DType::f64: static_cast<double*>(p)[i] = cast_value<double>(v); break;
    case DType::bf16: static_cast<bf16*>(p)[i] = cast_value<bf16>(v); break;
    case DType::f16: static_cast<f16*>(p)[i] = cast_value<f16>(v); break;
    case DType::i32: static_cast<int32_t*>(p)[i] = cast_value<int32_t>(v); break;
    case DType::i64: static_cast<int64_t*>(p)[i] = cast_value<int64_t>(v); break;
    case DType::boolean: static_cast<bool*>(p)[i] = cast_value<bool>(v); break;
  }
}

template <typename A>
__device__ __forceinline__ A load_as(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::f32: return cast_value<A>(static_cast<const float*>(p)[i]);
    case DType::f64: return cast_value<A>(static_cast<const double*>(p)[i]);
    case DType::bf16: return cast_value<A>(static_cast<const bf16*>(p)[i]);
    case DType::f16: return cast_value<A>(static_cast<const f16*>(p)[i]);
    case DType::i32: return cast_value<A>(static_cast<const int32_t*>(p)[i]);
    case DType::i64: return cast_value<A>(static_cast<const int64_t*>(p)[i]);
    case DType::boolean: return cast_value<A>(static_cast<const bool*>(p)[i]);
  }
  return A(0);
}

// ---- N-d strided offsets ----------------------------------------------------

constexpr int kMaxDims = 8;

// Maps a linear index over a shape to element offsets in N operands. Dims are
// stored innermost first and coalesced on the host, so contiguous operands
// collapse to one dim and take the division-free path.
template <int N>
struct OffsetCalc {
  int ndim = 1;
  bool index32 = true;  // the linear index fits in 32 bits: cheaper division
  int64_t sizes[kMaxDims];
  int64_t strides[N][kMaxDims];

  __device__ __forceinline__ void get(int64_t i, int64_t (&off)[N]) const {
    if (ndim == 1) {
#pragma unroll
      for (int a = 0; a < N; ++a) off[a] = i * strides[a][0];
      return;
    }
#pragma unroll
    for (int a = 0; a < N; ++a) off[a] = 0;
    if (index32) {
      uint32_t r = uint32_t(i);
      for (int d = 0; d < ndim; ++d) {
        uint32_t s = uint32_t(sizes[d]);
        uint32_t q = r / s;
        int64_t c = int64_t(r - q * s);
#pragma unroll
        for (int a = 0; a < N; ++a) off[a] += c * strides[a][d];
        r = q;
      }
    } else {
      for (int d = 0; d < ndim; ++d) {
        int64_t q = i / sizes[d];
        int64_t c = i - q * sizes[d];
#pragma unroll
        for (int a = 0; a < N; ++a) off[a] += c * strides[a][d];
        i = q;
      }
    }
  }
};

// All operands have `shape` (broadcast views have stride 0 where they repeat).
template <int N>
OffsetCalc<N> make_offset_calc(const Shape& shape, const std::array<const Tensor*, N>& ts) {
  OffsetCalc<N> oc;
  for (int a = 0; a < N; ++a) {
    if (ts[a]->shape() != shape)
      throw std::invalid_argument("cuda elementwise: operand shape " + shape_str(ts[a]->shape()) +
                                  " differs from the output shape " + shape_str(shape));
  }
  int nd = 0;
  for (int64_t d = int64_t(shape.size()) - 1; d >= 0; --d) {  // innermost first
    int64_t size = shape[size_t(d)];
    if (size == 1) continue;
    if (nd > 0) {
      bool merge = true;
      for (int a = 0; a < N; ++a)
        merge = merge && ts[a]->strides()[size_t(d)] == oc.strides[a][nd - 1] * oc.sizes[nd - 1];
      if (merge) {
        oc.sizes[nd - 1] *= size;
        continue;
      }
    }
    if (nd == kMaxDims)
      throw std::invalid_argument("cuda elementwise: more than 8 non-mergeable dims in shape " +
                                  shape_str(shape));
    oc.sizes[nd] = size;
    for (int a = 0; a < N; ++a) oc.strides[a][nd] = ts[a]->strides()[size_t(d)];
    ++nd;
  }
  if (nd == 0) {  // a single element
    oc.sizes[0] = 1;
    for (int a = 0; a < N; ++a) oc.strides[a][0] = 0;
    nd = 1;
  }
  oc.ndim = nd;
  oc.index32 = shape_numel(shape) <= int64_t(std::numeric_limits<uint32_t>::max());
  return oc;
}

// ---- launch helpers ---------------------------------------------------------

constexpr int kBlock = 256;

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over n items.
inline unsigned grid_for(int64_t n, int block = kBlock) {
  return unsigned(std::min<int64_t>(ceil_div(n, block), int64_t(1) << 20));
}

#define ARENO_GRID_STRIDE_LOOP(i, n)                                                    \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);             \
       i += int64_t(blockDim.x) * gridDim.x)

// Selects the tensor's device and exposes its stream for the launches that follow.
struct Launch {
  DeviceGuard guard;
  DeviceContext& ctx;
  cudaStream_t stream;
  explicit Launch(const Tensor& t)
      : guard(device_index(t)), ctx(device_context(device_index(t))), stream(ctx.stream) {}

  static int device_index(const Tensor& t) {
    if (!t.device().is_cuda())
      throw std::invalid_argument("cuda backend: tensor " + t.str() + " is not on a CUDA device");
    return t.device().index;
  }
};

// Checks the layout contract of backend.h where a kernel relies on it.
inline void require_contiguous(const Tensor& t, const char* op, const char* name) {
  if (t.defined() && !t.is_contiguous())
    throw std::invalid_argument(std::string("cuda ") + op + ": " + name + " " + t.str() +
                                " must be contiguous");
}

// Typed device pointer to element 0.
template <typename T> T* ptr(const Tensor& t) { return static_cast<T*>(t.data_ptr()); }

// ---- warp and block reductions ----------------------------------------------

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename A>
__device__ __forceinline__ A warp_max(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result. `shared` holds 32 values; the call synchronizes the block.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* shared) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < nwarps ? shared[lane] : A(0);
  return warp_sum(v);
}

template <typename A>
__device__ __forceinline__ A block_max(A v, A* shared) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < nwarps ? shared[lane] : A(-INFINITY);
  return warp_max(v);
}

// Threads per block for a row of n elements: a multiple of 32, at most `max`.
inline int row_block(int64_t n, int max = 1024) {
  int64_t b = 32;
  while (b < n && b < max) b *= 2;
  return int(b);
}

}  // namespace areno::cuda
