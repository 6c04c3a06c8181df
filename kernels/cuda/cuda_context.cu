// Device contexts, error reporting and the CUDA runtime queries of backend.h.
#include "kernels/cuda/cuda_context.h"

#include <nccl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensor/backend.h"

namespace areno::cuda {

void throw_cuda_error(const char* what, const char* detail, const char* call, const char* file,
                      int line) {
  throw std::runtime_error(std::string(what) + " error: " + detail + " in " + call + " at " +
                           file + ":" + std::to_string(line));
}

const char* curand_status_string(curandStatus_t s) {
  switch (s) {
    case CURAND_STATUS_SUCCESS: return "success";
    case CURAND_STATUS_VERSION_MISMATCH: return "header/library version mismatch";
    case CURAND_STATUS_NOT_INITIALIZED: return "generator not initialized";
    case CURAND_STATUS_ALLOCATION_FAILED: return "memory allocation failed";
    case CURAND_STATUS_TYPE_ERROR: return "generator type error";
    case CURAND_STATUS_OUT_OF_RANGE: return "argument out of range";
    case CURAND_STATUS_LENGTH_NOT_MULTIPLE: return "length not a multiple of the dimension";
    case CURAND_STATUS_DOUBLE_PRECISION_REQUIRED: return "GPU lacks double precision";
    case CURAND_STATUS_LAUNCH_FAILURE: return "kernel launch failure";
    case CURAND_STATUS_PREEXISTING_FAILURE: return "preexisting failure";
    case CURAND_STATUS_INITIALIZATION_FAILED: return "initialization failed";
    case CURAND_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case CURAND_STATUS_INTERNAL_ERROR: return "internal error";
    default: return "unknown cuRAND status";
  }
}

namespace {

// Hopper's cuBLAS guidance: 32 MiB of workspace lets every GEMM algorithm run.
constexpr size_t kWorkspaceBytes = size_t(32) << 20;

struct Contexts {
  std::mutex mutex;
  std::vector<std::unique_ptr<DeviceContext>> by_device;
};

// Never destroyed: storages freed during static destruction may still need a
// context, and tearing down CUDA objects after the driver unloads fails.
Contexts& contexts() {
  static Contexts* c = new Contexts();
  return *c;
}

}  // namespace

DeviceContext& device_context(int index) {
  Contexts& cs = contexts();
  std::lock_guard<std::mutex> lock(cs.mutex);
  if (cs.by_device.empty()) {
    int n = cuda_device_count();
    cs.by_device.resize(size_t(n));
  }
  if (index < 0 || size_t(index) >= cs.by_device.size())
    throw std::runtime_error("cuda:" + std::to_string(index) + " is not available (" +
                             std::to_string(cs.by_device.size()) + " CUDA device(s) visible)");
  auto& slot = cs.by_device[size_t(index)];
  if (!slot) {
    auto ctx = std::make_unique<DeviceContext>();
    ctx->device = index;
    int previous = 0;
    ARENO_CUDA_CHECK(cudaGetDevice(&previous));
    ARENO_CUDA_CHECK(cudaSetDevice(index));
    ARENO_CUDA_CHECK(cudaDeviceGetAttribute(&ctx->sm_count, cudaDevAttrMultiProcessorCount, index));
    ARENO_CUDA_CHECK(cudaDeviceGetAttribute(&ctx->sm_major, cudaDevAttrComputeCapabilityMajor, index));
    ARENO_CUDA_CHECK(cudaDeviceGetAttribute(&ctx->sm_minor, cudaDevAttrComputeCapabilityMinor, index));
    ARENO_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking));
    ARENO_CUDA_CHECK(cudaSetDevice(previous));
    slot = std::move(ctx);
  }
  return *slot;
}

void DeviceContext::ensure_blas() {
  std::lock_guard<std::mutex> lock(mutex);
  if (cublaslt) return;
  const CublasLib& lib = cublas_lib();  // a missing cuBLAS fails here, before the workspace is allocated
  DeviceGuard guard(device);
  ARENO_CUDA_CHECK(cudaMalloc(&workspace, kWorkspaceBytes));
  workspace_bytes = kWorkspaceBytes;
  ARENO_CUBLAS_CHECK(lib.Create(&cublas));
  ARENO_CUBLAS_CHECK(lib.SetStream(cublas, stream));
  ARENO_CUBLAS_CHECK(lib.SetWorkspace(cublas, workspace, workspace_bytes));
  // f32 GEMMs stay exact f32 (no TF32), as torch's default.
  ARENO_CUBLAS_CHECK(lib.SetMathMode(cublas, CUBLAS_DEFAULT_MATH));
  ARENO_CUBLAS_CHECK(lib.LtCreate(&cublaslt));
}

DeviceGuard::DeviceGuard(int index) {
  ARENO_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != index) ARENO_CUDA_CHECK(cudaSetDevice(index));
  else previous_ = -1;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);  // no throw from a destructor
}

}  // namespace areno::cuda

namespace areno {

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    // No driver or no GPU: report none and clear the sticky error state.
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::vector<CudaDeviceInfo> cuda_devices() {
  std::vector<CudaDeviceInfo> out;
  int n = cuda_device_count();
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    ARENO_CUDA_CHECK(cudaGetDeviceProperties(&prop, i));
    CudaDeviceInfo info;
    info.index = i;
    info.name = prop.name;
    info.total_bytes = prop.totalGlobalMem;
    info.free_bytes = 0;
    info.sm_major = prop.major;
    info.sm_minor = prop.minor;
    {
      cuda::DeviceGuard guard(i);
      size_t free_b = 0, total_b = 0;
      ARENO_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
      info.free_bytes = free_b;
      info.total_bytes = total_b;
    }
    out.push_back(info);
  }
  return out;
}

std::string cuda_runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return "";
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

std::string cublas_version() {
  const cuda::CublasLib* lib = nullptr;
  try {
    lib = &cuda::cublas_lib();
  } catch (const std::exception& e) {
    return std::string("not loadable: ") + e.what();
  }
  int major = 0, minor = 0, patch = 0;
  if (lib->GetProperty(MAJOR_VERSION, &major) != CUBLAS_STATUS_SUCCESS ||
      lib->GetProperty(MINOR_VERSION, &minor) != CUBLAS_STATUS_SUCCESS ||
      lib->GetProperty(PATCH_LEVEL, &patch) != CUBLAS_STATUS_SUCCESS)
    return "";
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "";
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string((v % 10000) / 100) + "." +
         std::to_string(v % 100);
}

}  // namespace areno
