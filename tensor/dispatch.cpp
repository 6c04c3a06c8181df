// The one place where a device picks its kernels (and so its memory): the
// backends themselves are defined in kernels/, which link into the library.
#include "tensor/backend.h"

namespace areno {

Backend& profiled_backend(Device device);  // tensor/profile_backend.cpp

Backend& backend(Device device) {
  if (op_profile_enabled()) return profiled_backend(device);  // ARENO_PROFILE_OPS=1
  return device.is_cuda() ? cuda_backend() : cpu_backend();
}

}  // namespace areno
