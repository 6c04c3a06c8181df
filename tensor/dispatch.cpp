// The one place where a device picks its kernels and its memory.
#include <cstdlib>
#include <new>
#include <stdexcept>

#include "kernels/backend.h"

namespace areno {

Backend& backend(Device device) {
  return device.is_cuda() ? cuda_backend() : cpu_backend();
}

std::shared_ptr<Storage> Storage::allocate(size_t nbytes, Device device) {
  if (device.is_cuda()) return cuda_backend().allocate(nbytes, device);
  size_t rounded = (std::max<size_t>(nbytes, 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (!p) throw std::bad_alloc();
  return std::make_shared<Storage>(p, nbytes, device, [](void* q) { std::free(q); });
}

std::shared_ptr<Storage> Storage::wrap(void* data, size_t nbytes, Device device,
                                       std::shared_ptr<void> owner) {
  return std::make_shared<Storage>(data, nbytes, device, [owner](void*) mutable { owner.reset(); });
}

}  // namespace areno
