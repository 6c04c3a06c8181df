#pragma once
// cuBLAS and cuBLASLt, opened with dlopen on first use instead of linked.
// Linking them cost every areno process 0.2 s and about 217 MB of resident
// memory at start (libcublasLt's static initializers run and touch that much
// whether or not a GPU is ever used: `areno --version`, CPU serving, each
// test executable); the CUDA runtime and NCCL stay linked (4 MB). The
// functions the backend calls are members of CublasLib, resolved by their
// exported names; nothing else in kernels/cuda/ may call cuBLAS directly (the
// link would fail: the libraries are not on the link line).
#include <cublasLt.h>
#include <cublas_v2.h>

namespace areno::cuda {

// cublasGemmStridedBatchedEx has a C++ overload taking the legacy
// cudaDataType compute type; this is the exported one.
using CublasGemmStridedBatchedExFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int,
                                                        int, int, const void*, const void*, cudaDataType, int,
                                                        long long int, const void*, cudaDataType, int, long long int,
                                                        const void*, void*, cudaDataType, int, long long int, int,
                                                        cublasComputeType_t, cublasGemmAlgo_t);

// X(member, symbol, pointer type): the symbol after macro expansion is the
// exported name (cublasCreate is cublasCreate_v2).
#define ARENO_CUBLAS_FUNCTIONS(X)                                                    \
  X(Create, cublasCreate, decltype(&::cublasCreate))                                 \
  X(SetStream, cublasSetStream, decltype(&::cublasSetStream))                        \
  X(SetWorkspace, cublasSetWorkspace, decltype(&::cublasSetWorkspace))               \
  X(SetMathMode, cublasSetMathMode, decltype(&::cublasSetMathMode))                  \
  X(GetProperty, cublasGetProperty, decltype(&::cublasGetProperty))                  \
  X(GetStatusString, cublasGetStatusString, decltype(&::cublasGetStatusString))      \
  X(DgemmStridedBatched, cublasDgemmStridedBatched, decltype(&::cublasDgemmStridedBatched)) \
  X(GemmStridedBatchedEx, cublasGemmStridedBatchedEx, CublasGemmStridedBatchedExFn)

#define ARENO_CUBLASLT_FUNCTIONS(X)                                                                    \
  X(LtCreate, cublasLtCreate, decltype(&::cublasLtCreate))                                             \
  X(LtMatmul, cublasLtMatmul, decltype(&::cublasLtMatmul))                                             \
  X(LtMatmulAlgoGetHeuristic, cublasLtMatmulAlgoGetHeuristic, decltype(&::cublasLtMatmulAlgoGetHeuristic)) \
  X(LtMatmulDescCreate, cublasLtMatmulDescCreate, decltype(&::cublasLtMatmulDescCreate))             \
  X(LtMatmulDescDestroy, cublasLtMatmulDescDestroy, decltype(&::cublasLtMatmulDescDestroy))          \
  X(LtMatmulDescSetAttribute, cublasLtMatmulDescSetAttribute, decltype(&::cublasLtMatmulDescSetAttribute)) \
  X(LtMatmulPreferenceCreate, cublasLtMatmulPreferenceCreate, decltype(&::cublasLtMatmulPreferenceCreate)) \
  X(LtMatmulPreferenceDestroy, cublasLtMatmulPreferenceDestroy, decltype(&::cublasLtMatmulPreferenceDestroy)) \
  X(LtMatmulPreferenceSetAttribute, cublasLtMatmulPreferenceSetAttribute,                             \
    decltype(&::cublasLtMatmulPreferenceSetAttribute))                                                 \
  X(LtMatrixLayoutCreate, cublasLtMatrixLayoutCreate, decltype(&::cublasLtMatrixLayoutCreate))       \
  X(LtMatrixLayoutDestroy, cublasLtMatrixLayoutDestroy, decltype(&::cublasLtMatrixLayoutDestroy))    \
  X(LtMatrixLayoutSetAttribute, cublasLtMatrixLayoutSetAttribute, decltype(&::cublasLtMatrixLayoutSetAttribute))

struct CublasLib {
#define ARENO_CUBLAS_MEMBER(member, symbol, type) type member = nullptr;
  ARENO_CUBLAS_FUNCTIONS(ARENO_CUBLAS_MEMBER)
  ARENO_CUBLASLT_FUNCTIONS(ARENO_CUBLAS_MEMBER)
#undef ARENO_CUBLAS_MEMBER
};

// Opens libcublas and libcublasLt (this build's major version: by soname,
// then in the toolkit's lib64) on the first call, thread-safe; every later
// call returns the same table. Throws std::runtime_error naming the library
// and the loader's message when one cannot be opened or lacks a function
// (the next call tries again).
const CublasLib& cublas_lib();

}  // namespace areno::cuda
