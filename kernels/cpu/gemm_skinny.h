#pragma once
// Skinny GEMM: a few rows of activations times a weight stored [N, K]
// row-major (the decode and small-batch shape of every linear layer and of
// the 200064-row vocabulary head), issue 16 "GEMM/GEMV".
//
//   out[m * ldo + n] = alpha * sum_k x[m * ldx + k] * w[n * ldw + k]  (+ beta * out)
//
// The weights are read in place in their stored dtype (f32, bf16 or int8, widened
// in registers; no per-call copy, widening or packing of w), each thread
// streaming its own contiguous slice of the N rows; activations are f32 and
// accumulation is f32, in a fixed order per output (a result does not depend
// on the thread count). Tiles of up to 4 x 4 outputs share each load.
//
// Dispatch by CPU features at run time: avx512bf16 (AVX-512 with
// AVX512-BF16: gemm_skinny_bf16's native bf16 dot products; the other kernels
// run their avx512 code there), avx512 (AVX-512F/BW/VL), avx2 (AVX2 + FMA) or
// generic (plain loops). ARENO_CPU_ISA=generic|avx2|avx512|avx512bf16 lowers
// the level (never above what the CPU runs), so tests and benchmarks
// can check every level the machine has.
#include <cstdint>

#include "tensor/dtype.h"

namespace areno::cpu {

enum class CpuIsa : int { generic = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3 };

// The highest level this CPU runs.
CpuIsa cpu_isa_supported();
// The level in use: cpu_isa_supported(), lowered by ARENO_CPU_ISA (read on
// first use; an unknown name throws std::invalid_argument naming it) or by
// set_cpu_isa.
CpuIsa cpu_isa();
// Forces a level for tests; clamped to cpu_isa_supported(). Returns the level set.
CpuIsa set_cpu_isa(CpuIsa isa);
const char* cpu_isa_name(CpuIsa isa);

// Rows of x above this go to the blocked GEMM (Eigen) instead.
constexpr int64_t kSkinnyMaxRows = 32;

// See the top. W is float or BFloat16, O is float or BFloat16. Runs on the
// OpenMP threads (split over N) unless called inside a parallel region.
template <typename W, typename O>
void gemm_skinny(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const W* w, int64_t ldw, O* out,
                 int64_t ldo, float alpha, float beta);

// bf16 activations times bf16 weights (the decode shape of a bf16 model):
// at the avx512bf16 level the pairs of bf16 products go straight into f32
// accumulators (vdpbf16ps: each product exact, as widening both would give,
// summed in another order; bf16 denormals, below 1.2e-38, count as zero);
// below it x is widened to f32 and gemm_skinny runs. O is float or BFloat16.
template <typename O>
void gemm_skinny_bf16(int64_t M, int64_t N, int64_t K, const BFloat16* x, int64_t ldx, const BFloat16* w,
                      int64_t ldw, O* out, int64_t ldo, float alpha, float beta);

// Weight-only int8 (tensor/quantized.h): w holds int8 values and row n of the
// weight is scales[n] * w[n, :]. The int8 values are widened to f32 in
// registers and the row's scale multiplies the finished dot product:
//   out[m * ldo + n] = alpha * scales[n] * sum_k x[m * ldx + k] * w[n * ldw + k]  (+ beta * out)
// O is float or BFloat16; same tiles, threads and dispatch as gemm_skinny.
template <typename O>
void gemm_skinny_int8(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const int8_t* w, int64_t ldw,
                      const float* scales, O* out, int64_t ldo, float alpha, float beta);

}  // namespace areno::cpu
