#pragma once
// bf16 GEMM through oneDNN's matmul primitive (Debian's libdnnl, optional at
// build time: ARENO_HAVE_DNNL), issue 16 "GEMM/GEMV": on CPUs with AMX or
// AVX512-BF16 it multiplies bf16 operands natively (products exact in f32,
// f32 accumulation) where the Eigen path widens both whole matrices to f32
// on every call. Used by matmul for bf16 with more rows than the skinny
// kernel takes (prefill, towers, training) where the AMX kernels do not run
// them (on by default only where the CPU has AMX, below); the operands are
// read in place with their strides, nothing is packed or cached outside
// oneDNN's own primitive cache.
#include <cstdint>

#include "tensor/dtype.h"

namespace areno::cpu {

// Whether this build has oneDNN, it runs bf16 matmuls on this CPU (AMX,
// AVX512-BF16 or AVX512 core; Debian's oneDNN 2.6 refuses bf16 on AVX2-only
// CPUs such as Zen 3, checked once by creating a tiny primitive), and it is
// on: by default where the CPU has AMX (without it the packed kernel and
// Eigen ran faster, gemm_dnnl.cpp), ARENO_DNNL=1 turns it on elsewhere and
// ARENO_DNNL=0 off (read on first use), set_dnnl_enabled for tests. Returns
// the state set (false without oneDNN or on such a CPU).
bool dnnl_enabled();
bool set_dnnl_enabled(bool on);

// out[M, N] (row stride ldo, bf16) = a[M, K] b[K, N] (+ beta out, + bias[N]
// when not null: both added to the f32 sums before the one rounding) with
// element (i, j) of a at a[i * a_rs + j * a_cs] and of b at
// b[i * b_rs + j * b_cs]. Returns false (nothing written) when oneDNN is off
// or refuses the shapes.
bool dnnl_gemm_bf16(int64_t M, int64_t N, int64_t K, const BFloat16* a, int64_t a_rs, int64_t a_cs,
                    const BFloat16* b, int64_t b_rs, int64_t b_cs, BFloat16* out, int64_t ldo, float beta = 0.0f,
                    const BFloat16* bias = nullptr);
// The same with an f32 result: out = alpha a b + beta out from the f32 sums,
// never rounded to bf16.
bool dnnl_gemm_bf16(int64_t M, int64_t N, int64_t K, const BFloat16* a, int64_t a_rs, int64_t a_cs,
                    const BFloat16* b, int64_t b_rs, int64_t b_cs, float* out, int64_t ldo, float beta = 0.0f,
                    float alpha = 1.0f);

}  // namespace areno::cpu
