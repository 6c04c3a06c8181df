// The CUDA backend object, its memory entry points and synchronization; the
// kernels live in the topic files beside this one.
#include "kernels/cuda/cuda_backend.h"

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/cuda_context.h"

namespace areno {

Backend& cuda_backend() {
  static CudaBackend backend;
  return backend;
}

std::shared_ptr<Storage> CudaBackend::allocate(size_t nbytes, Device device) {
  if (!device.is_cuda())
    throw std::invalid_argument("cuda allocate: device " + device.str() + " is not a CUDA device");
  return cuda::allocate_storage(nbytes, device.index);
}

void CudaBackend::synchronize(Device device) {
  if (!device.is_cuda())
    throw std::invalid_argument("cuda synchronize: device " + device.str() + " is not a CUDA device");
  cuda::DeviceContext& ctx = cuda::device_context(device.index);
  cuda::DeviceGuard guard(device.index);
  ARENO_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
}

}  // namespace areno
