// Reductions and cumsum over x contig viewed as [outer, n, inner].
// inner == 1 (the last dim) reduces each row with one block; otherwise a
// block covers 32 adjacent columns (coalesced) and splits n across 8 warps.
#include <limits>

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

namespace areno::cuda {
namespace {

template <typename A>
struct RState {
  A v;
  int64_t i;  // index of v along n (for argmax/argmin); INT64_MAX when empty
};

template <typename A>
__device__ __forceinline__ bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) return v != v;
  else return false;
}

__device__ __forceinline__ bool is_sum(ReduceOp op) { return op == ReduceOp::sum || op == ReduceOp::sum_squares; }

// Element k of x as the reduction takes it: squared for sum_squares.
template <typename T>
__device__ __forceinline__ acc_t<T> load_for(ReduceOp op, const T* p, int64_t k) {
  const acc_t<T> v = load_acc(p, k);
  return op == ReduceOp::sum_squares ? v * v : v;
}

template <typename A>
__device__ __forceinline__ RState<A> identity(ReduceOp op) {
  if (is_sum(op)) return {A(0), std::numeric_limits<int64_t>::max()};
  bool want_max = op == ReduceOp::max || op == ReduceOp::argmax;
  if constexpr (std::is_floating_point_v<A>)
    return {want_max ? A(-INFINITY) : A(INFINITY), std::numeric_limits<int64_t>::max()};
  else
    return {want_max ? std::numeric_limits<A>::lowest() : std::numeric_limits<A>::max(),
            std::numeric_limits<int64_t>::max()};
}

// max/min propagate NaN (the first NaN wins, as torch); ties keep the lower index.
template <typename A>
__device__ __forceinline__ RState<A> combine(ReduceOp op, RState<A> a, RState<A> b) {
  if (is_sum(op)) return {a.v + b.v, 0};
  if (is_nan(a.v)) return (is_nan(b.v) && b.i < a.i) ? b : a;
  if (is_nan(b.v)) return b;
  bool want_max = op == ReduceOp::max || op == ReduceOp::argmax;
  bool b_better = want_max ? b.v > a.v : b.v < a.v;
  if (b_better || (b.v == a.v && b.i < a.i)) return b;
  return a;
}

template <typename A>
__device__ __forceinline__ RState<A> warp_combine(ReduceOp op, RState<A> s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    RState<A> t{__shfl_xor_sync(0xffffffffu, s.v, o), __shfl_xor_sync(0xffffffffu, s.i, o)};
    s = combine(op, s, t);
  }
  return s;
}

template <typename A>
__device__ __forceinline__ void write_result(ReduceOp op, void* out, DType out_dtype, int64_t o,
                                             RState<A> s) {
  if (op == ReduceOp::argmax || op == ReduceOp::argmin) store_as(out_dtype, out, o, s.i);
  else store_as(out_dtype, out, o, s.v);
}

// Combines one state per thread over the block; thread 0 gets the result.
template <typename A>
__device__ __forceinline__ RState<A> block_combine(ReduceOp op, RState<A> s) {
  __shared__ A sv[32];
  __shared__ int64_t si[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  s = warp_combine(op, s);
  __syncthreads();  // the shared slots may still be read by a previous call
  if (lane == 0) {
    sv[warp] = s.v;
    si[warp] = s.i;
  }
  __syncthreads();
  if (warp == 0) {
    s = lane < nwarps ? RState<A>{sv[lane], si[lane]} : identity<A>(op);
    s = warp_combine(op, s);
  }
  return s;
}

// inner == 1: one block per row.
template <typename T>
__global__ void reduce_rows_kernel(ReduceOp op, const T* x, int64_t rows, int64_t n, void* out,
                                   DType out_dtype) {
  using A = acc_t<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = x + r * n;
    RState<A> s = identity<A>(op);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) s = combine(op, s, RState<A>{load_for(op, row, k), k});
    s = block_combine(op, s);
    if (threadIdx.x == 0) write_result(op, out, out_dtype, r, s);
  }
}

// Few long rows (a sum over everything): `splits` blocks per row write
// partial states, then one block per row combines them.
template <typename T>
__global__ void reduce_rows_partial_kernel(ReduceOp op, const T* x, int64_t rows, int64_t n,
                                           int64_t splits, int64_t chunk, acc_t<T>* pv, int64_t* pi) {
  using A = acc_t<T>;
  for (int64_t b = blockIdx.x; b < rows * splits; b += gridDim.x) {
    int64_t r = b / splits, k0 = (b % splits) * chunk, k1 = min(n, k0 + chunk);
    const T* row = x + r * n;
    RState<A> s = identity<A>(op);
    for (int64_t k = k0 + threadIdx.x; k < k1; k += blockDim.x) s = combine(op, s, RState<A>{load_for(op, row, k), k});
    s = block_combine(op, s);
    if (threadIdx.x == 0) {
      pv[b] = s.v;
      pi[b] = s.i;
    }
  }
}

template <typename A>
__global__ void reduce_partials_kernel(ReduceOp op, const A* pv, const int64_t* pi, int64_t rows,
                                       int64_t splits, void* out, DType out_dtype) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    RState<A> s = identity<A>(op);
    for (int64_t k = threadIdx.x; k < splits; k += blockDim.x) s = combine(op, s, RState<A>{pv[r * splits + k], pi[r * splits + k]});
    s = block_combine(op, s);
    if (threadIdx.x == 0) write_result(op, out, out_dtype, r, s);
  }
}

constexpr int kColWarps = 8;

// inner > 1: blockDim (32, 8); x-threads take adjacent columns, y-threads split n.
template <typename T>
__global__ void reduce_cols_kernel(ReduceOp op, const T* x, int64_t outer, int64_t n,
                                   int64_t inner, void* out, DType out_dtype) {
  using A = acc_t<T>;
  __shared__ A sv[kColWarps][32];
  __shared__ int64_t si[kColWarps][32];
  int64_t col_blocks = ceil_div(inner, 32);
  for (int64_t b = blockIdx.x; b < outer * col_blocks; b += gridDim.x) {
    int64_t o = b / col_blocks;
    int64_t j = (b % col_blocks) * 32 + threadIdx.x;
    RState<A> s = identity<A>(op);
    if (j < inner) {
      const T* base = x + o * n * inner + j;
      for (int64_t k = threadIdx.y; k < n; k += kColWarps)
        s = combine(op, s, RState<A>{load_for(op, base, k * inner), k});
    }
    __syncthreads();
    sv[threadIdx.y][threadIdx.x] = s.v;
    si[threadIdx.y][threadIdx.x] = s.i;
    __syncthreads();
    if (threadIdx.y == 0 && j < inner) {
      for (int y = 1; y < kColWarps; ++y) s = combine(op, s, RState<A>{sv[y][threadIdx.x], si[y][threadIdx.x]});
      write_result(op, out, out_dtype, o * inner + j, s);
    }
  }
}

// ---- cumsum ----

// Inclusive scan of one value per thread over the block; `shared` holds 32.
template <typename A>
__device__ __forceinline__ A block_inclusive_scan(A v, A* shared, A* total) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    A t = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += t;
  }
  __syncthreads();
  if (lane == 31) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    A w = lane < nwarps ? shared[lane] : A(0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      A t = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += t;
    }
    if (lane < nwarps) shared[lane] = w;  // inclusive prefix of warp totals
  }
  __syncthreads();
  if (warp > 0) v += shared[warp - 1];
  *total = shared[nwarps - 1];
  return v;
}

template <typename T>
__global__ void cumsum_rows_kernel(const T* x, int64_t rows, int64_t n, void* out, DType out_dtype) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    A carry = A(0);
    for (int64_t start = 0; start < n; start += blockDim.x) {
      int64_t k = start + threadIdx.x;
      A v = k < n ? load_acc(x, r * n + k) : A(0);
      A total;
      v = block_inclusive_scan(v, shared, &total);
      if (k < n) store_as(out_dtype, out, r * n + k, carry + v);
      carry += total;
    }
  }
}

template <typename T>
__global__ void cumsum_cols_kernel(const T* x, int64_t outer, int64_t n, int64_t inner, void* out,
                                   DType out_dtype) {
  using A = acc_t<T>;
  ARENO_GRID_STRIDE_LOOP(t, outer * inner) {
    int64_t o = t / inner, j = t % inner;
    int64_t base = o * n * inner + j;
    A acc = A(0);
    for (int64_t k = 0; k < n; ++k) {
      acc += load_acc(x, base + k * inner);
      store_as(out_dtype, out, base + k * inner, acc);
    }
  }
}

}  // namespace
}  // namespace areno::cuda

namespace areno {

using namespace cuda;

void CudaBackend::reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t n, int64_t inner,
                         const Tensor& out) {
  require_contiguous(x, "reduce", "x");
  require_contiguous(out, "reduce", "out");
  if (x.numel() != outer * n * inner || out.numel() != outer * inner)
    throw std::invalid_argument("cuda reduce: x " + x.str() + " / out " + out.str() +
                                " do not match [outer, n, inner] = [" + std::to_string(outer) +
                                ", " + std::to_string(n) + ", " + std::to_string(inner) + "]");
  if ((op == ReduceOp::argmax || op == ReduceOp::argmin) && out.dtype() != DType::i64)
    throw std::invalid_argument("cuda reduce: argmax/argmin write i64, got " + out.str());
  if (outer * inner == 0) return;
  Launch l(out);
  visit_cuda_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    constexpr int64_t kChunk = 32768;  // elements per block when rows are split
    if (inner == 1 && outer < 2 * int64_t(l.ctx.sm_count) && n > 2 * kChunk) {
      int64_t splits = ceil_div(n, kChunk);
      auto pv = allocate_scratch(size_t(outer * splits) * sizeof(A), out.device().index);
      auto pi = allocate_scratch(size_t(outer * splits) * sizeof(int64_t), out.device().index);
      unsigned grid = unsigned(std::min<int64_t>(outer * splits, 1 << 20));
      reduce_rows_partial_kernel<T><<<grid, 256, 0, l.stream>>>(op, ptr<const T>(x), outer, n, splits,
                                                               kChunk, static_cast<A*>(pv.get()),
                                                               static_cast<int64_t*>(pi.get()));
      ARENO_LAUNCH_CHECK("reduce_rows_partial_kernel");
      reduce_partials_kernel<A><<<unsigned(outer), row_block(splits, 256), 0, l.stream>>>(
          op, static_cast<const A*>(pv.get()), static_cast<const int64_t*>(pi.get()), outer, splits,
          out.data_ptr(), out.dtype());
      ARENO_LAUNCH_CHECK("reduce_partials_kernel");
    } else if (inner == 1) {
      int block = row_block(n, 256);
      unsigned grid = unsigned(std::min<int64_t>(outer, 1 << 20));
      reduce_rows_kernel<T><<<grid, block, 0, l.stream>>>(op, ptr<const T>(x), outer, n,
                                                           out.data_ptr(), out.dtype());
      ARENO_LAUNCH_CHECK("reduce_rows_kernel");
    } else {
      int64_t blocks = outer * ceil_div(inner, 32);
      unsigned grid = unsigned(std::min<int64_t>(blocks, 1 << 20));
      reduce_cols_kernel<T><<<grid, dim3(32, kColWarps), 0, l.stream>>>(
          op, ptr<const T>(x), outer, n, inner, out.data_ptr(), out.dtype());
      ARENO_LAUNCH_CHECK("reduce_cols_kernel");
    }
  });
}

void CudaBackend::cumsum(const Tensor& x, int64_t outer, int64_t n, int64_t inner,
                         const Tensor& out) {
  require_contiguous(x, "cumsum", "x");
  require_contiguous(out, "cumsum", "out");
  if (x.numel() != outer * n * inner || out.numel() != x.numel())
    throw std::invalid_argument("cuda cumsum: x " + x.str() + " / out " + out.str() +
                                " do not match [outer, n, inner]");
  if (x.numel() == 0) return;
  Launch l(out);
  visit_cuda_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (inner == 1) {
      int block = row_block(n, 1024);
      unsigned grid = unsigned(std::min<int64_t>(outer, 1 << 20));
      cumsum_rows_kernel<T><<<grid, block, 0, l.stream>>>(ptr<const T>(x), outer, n, out.data_ptr(),
                                                           out.dtype());
      ARENO_LAUNCH_CHECK("cumsum_rows_kernel");
    } else {
      cumsum_cols_kernel<T><<<grid_for(outer * inner), kBlock, 0, l.stream>>>(
          ptr<const T>(x), outer, n, inner, out.data_ptr(), out.dtype());
      ARENO_LAUNCH_CHECK("cumsum_cols_kernel");
    }
  });
}

}  // namespace areno
