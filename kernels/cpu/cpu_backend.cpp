// The CPU backend object and synchronization; memory is in allocator.cpp and
// the kernels in the topic files beside this one (as kernels/cuda/cuda_backend.cu).
#include "kernels/cpu/cpu_backend.h"

#include <omp.h>

namespace areno {

Backend& cpu_backend() {
  static cpu::CpuBackend backend;
  return backend;
}

void release_cpu_threads() { omp_pause_resource_all(omp_pause_hard); }

}  // namespace areno

namespace areno::cpu {

// CPU kernels finish before they return.
void CpuBackend::synchronize(Device) {}

}  // namespace areno::cpu
