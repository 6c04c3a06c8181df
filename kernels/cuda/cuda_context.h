#pragma once
// Per-device state owned by the CUDA backend: one non-default stream (all of
// areno's work on a device is ordered on it, which is what makes the caching
// allocator's reuse safe), cuBLAS/cuBLASLt handles with their workspace, and
// a cache of cuBLASLt algorithms keyed by GEMM geometry.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "kernels/cuda/cuda_check.h"

namespace areno::cuda {

struct DeviceContext {
  int device = 0;
  int sm_count = 0;
  int sm_major = 0, sm_minor = 0;
  cudaStream_t stream = nullptr;

  // Created on first use (matmul).
  cublasHandle_t cublas = nullptr;
  cublasLtHandle_t cublaslt = nullptr;
  void* workspace = nullptr;  // shared by cuBLAS and cuBLASLt: both run on `stream`
  size_t workspace_bytes = 0;
  std::unordered_map<std::string, cublasLtMatmulAlgo_t> lt_algos;  // key: GEMM geometry
  std::mutex mutex;  // guards the lazy handles and the algorithm cache

  void ensure_blas();
};

// The context of device `index` (created on first use; valid until exit).
// Throws std::runtime_error when the index is not a visible device.
DeviceContext& device_context(int index);

// Makes `index` the current device for the lifetime of the guard.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace areno::cuda
