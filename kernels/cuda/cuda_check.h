#pragma once
// Error checks for every CUDA, cuBLAS and cuRAND call: a failure throws
// std::runtime_error naming the call, the file and the line, so a failing
// kernel on a remote GPU is diagnosable from the log alone.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <curand.h>

#include "kernels/cuda/cublas_lib.h"

namespace areno::cuda {

[[noreturn]] void throw_cuda_error(const char* what, const char* detail, const char* call,
                                   const char* file, int line);

inline void check_cuda(cudaError_t e, const char* call, const char* file, int line) {
  if (e != cudaSuccess) throw_cuda_error("CUDA", cudaGetErrorString(e), call, file, line);
}
inline void check_cublas(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) throw_cuda_error("cuBLAS", cublas_lib().GetStatusString(s), call, file, line);
}
const char* curand_status_string(curandStatus_t s);
inline void check_curand(curandStatus_t s, const char* call, const char* file, int line) {
  if (s != CURAND_STATUS_SUCCESS) throw_cuda_error("cuRAND", curand_status_string(s), call, file, line);
}

}  // namespace areno::cuda

#define ARENO_CUDA_CHECK(call) ::areno::cuda::check_cuda((call), #call, __FILE__, __LINE__)
#define ARENO_CUBLAS_CHECK(call) ::areno::cuda::check_cublas((call), #call, __FILE__, __LINE__)
#define ARENO_CURAND_CHECK(call) ::areno::cuda::check_curand((call), #call, __FILE__, __LINE__)
// After every kernel launch: catches bad launch configurations at once (and,
// asynchronously, faults of earlier kernels).
#define ARENO_LAUNCH_CHECK(kernel) \
  ::areno::cuda::check_cuda(cudaGetLastError(), "launch of " kernel, __FILE__, __LINE__)
