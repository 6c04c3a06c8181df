// The one place where a device picks its kernels (and so its memory): the
// backends themselves are defined in kernels/, which link into the library.
#include "tensor/backend.h"

namespace areno {

Backend& profiled_backend(Device device);  // tensor/profile_backend.cpp

bool cross_entropy_rows_layout_ok(const Tensor& logits, const Tensor& targets, const Tensor& loss) {
  return (logits.dtype() == DType::f32 || logits.dtype() == DType::bf16) && logits.dim() == 2 && logits.is_contiguous() && targets.dtype() == DType::i64 &&
         targets.is_contiguous() && targets.numel() == logits.size(0) && loss.dtype() == DType::f32 &&
         loss.is_contiguous() && loss.numel() == logits.size(0) && targets.device() == logits.device() &&
         loss.device() == logits.device();
}

Backend& backend(Device device) {
  if (op_profile_enabled()) return profiled_backend(device);  // ARENO_PROFILE_OPS=1
  return device.is_cuda() ? cuda_backend() : cpu_backend();
}

}  // namespace areno
