#pragma once
// The one elementwise kernel: a grid-stride loop over the output's elements
// that hands each functor the element offsets of its N operands (operand 0
// is the output). Unary, binary, where, copy, cast and fill are functors.
#include "kernels/cuda/cuda_common.cuh"

namespace areno::cuda {

template <int N, typename F>
__global__ void elementwise_kernel(int64_t n, OffsetCalc<N> oc, F f) {
  ARENO_GRID_STRIDE_LOOP(i, n) {
    int64_t off[N];
    oc.get(i, off);
    f(off);
  }
}

template <int N, typename F>
void launch_elementwise(cudaStream_t stream, const Shape& shape,
                        const std::array<const Tensor*, N>& operands, const F& f) {
  int64_t n = shape_numel(shape);
  if (n == 0) return;
  OffsetCalc<N> oc = make_offset_calc<N>(shape, operands);
  elementwise_kernel<N, F><<<grid_for(n), kBlock, 0, stream>>>(n, oc, f);
  ARENO_LAUNCH_CHECK("elementwise_kernel");
}

// Contiguous temporaries for staging and workspaces.
Tensor device_empty(const Shape& shape, DType dtype, int device);
Tensor host_empty(const Shape& shape, DType dtype);

// Same-device copy with cast (src may broadcast), enqueued on the device's stream.
void device_copy(const Tensor& src, const Tensor& dst, cudaStream_t stream);

}  // namespace areno::cuda
