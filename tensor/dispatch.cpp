// The one place where a device picks its kernels (and so its memory): the
// backends themselves are defined in kernels/, which link into the library.
#include "tensor/backend.h"

namespace areno {

Backend& backend(Device device) {
  return device.is_cuda() ? cuda_backend() : cpu_backend();
}

}  // namespace areno
