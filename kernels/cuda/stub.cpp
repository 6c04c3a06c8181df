// Built when CUDA is off: every CUDA entry point says how to get one, and the
// runtime queries report an empty CUDA world (as MLX's no_gpu backend does).
#include <stdexcept>
#include <string>
#include <vector>

#include "tensor/backend.h"

namespace areno {

Backend& cuda_backend() {
  throw std::runtime_error(
      "areno was built without CUDA: rebuild with -Dcuda=enabled (needs nvcc in /usr/local/cuda) "
      "to use device cuda:N");
}

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
std::vector<CudaDeviceInfo> cuda_devices() { return {}; }
size_t cuda_peak_allocated_bytes(int) { return 0; }
std::string cuda_runtime_version() { return ""; }
std::string cublas_version() { return ""; }
std::string nccl_version() { return ""; }

}  // namespace areno
