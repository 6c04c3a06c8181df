// cublas_lib(): cuBLAS and cuBLASLt opened on first use (kernels/cuda/cublas_lib.h).
#include "kernels/cuda/cublas_lib.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>

#include "areno_build_config.h"

#define ARENO_CUBLAS_STR2(x) #x
#define ARENO_CUBLAS_STR(x) ARENO_CUBLAS_STR2(x)

namespace areno::cuda {
namespace {

// This build's major version by soname (the loader's search: the program's
// runpath, LD_LIBRARY_PATH, ld.so.cache), then in the toolkit it was built with.
void* open_library(const std::string& stem) {
  const std::string soname = stem + ".so." ARENO_CUBLAS_STR(CUBLAS_VER_MAJOR);
  std::string first_error;
  for (const std::string& path : {soname, std::string(ARENO_CUDA_LIBDIR) + "/" + soname}) {
    if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
    const char* e = dlerror();
    if (first_error.empty()) first_error = e ? e : "unknown error";
  }
  throw std::runtime_error("cannot load " + soname + " (cuBLAS " ARENO_CUBLAS_STR(CUBLAS_VER_MAJOR) +
                           ".x, which products on cuda devices need): " + first_error);
}

template <typename Fn>
void resolve(void* handle, const char* library, const char* name, Fn& out) {
  dlerror();
  void* p = dlsym(handle, name);
  if (p == nullptr) {
    const char* e = dlerror();
    throw std::runtime_error(std::string(library) + " has no function " + name + ": " + (e ? e : "null symbol"));
  }
  out = reinterpret_cast<Fn>(p);
}

CublasLib load() {
  CublasLib lib;
  void* blas = open_library("libcublas");
  void* lt = open_library("libcublasLt");
#define ARENO_RESOLVE_BLAS(member, symbol, type) resolve(blas, "libcublas", ARENO_CUBLAS_STR(symbol), lib.member);
#define ARENO_RESOLVE_LT(member, symbol, type) resolve(lt, "libcublasLt", ARENO_CUBLAS_STR(symbol), lib.member);
  ARENO_CUBLAS_FUNCTIONS(ARENO_RESOLVE_BLAS)
  ARENO_CUBLASLT_FUNCTIONS(ARENO_RESOLVE_LT)
#undef ARENO_RESOLVE_BLAS
#undef ARENO_RESOLVE_LT
  return lib;
}

}  // namespace

const CublasLib& cublas_lib() {
  static std::atomic<const CublasLib*> ready{nullptr};
  if (const CublasLib* p = ready.load(std::memory_order_acquire)) return *p;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (const CublasLib* p = ready.load(std::memory_order_relaxed)) return *p;
  static CublasLib lib;
  lib = load();  // a throw leaves `ready` null: the next call tries again
  ready.store(&lib, std::memory_order_release);
  return lib;
}

}  // namespace areno::cuda
