#pragma once
// Blocked GEMM on AVX2 + FMA for a weight stored [N, K] (nn.Linear's layout),
// f32, bf16 or int8, for CPUs where neither AMX tiles nor oneDNN's bf16 GEMM run
// (AVX2-only machines such as AMD Zen 3, and AVX-512 ones without AMX;
// issue 16 "GEMM/GEMV"):
//
//   out[m * ldo + n] = alpha * sum_k x[m * x_rs + k * x_cs] * w[n * ldw + k] (+ beta * out) (+ bias[n])
//
// rounded once to O. Before, a bf16 product past the skinny rows widened the
// whole weight and x to fresh f32 matrices and ran Eigen (and the bias was a
// second rounding). Here each thread owns whole 16-column panels of the
// weight (its own slice of w, streamed once per block of rows) and copies a
// [256 k x 128 n] block of it at a time, widened to f32 and transposed, into
// an L2-resident buffer; a 6 x 16 register tile (12 accumulators) multiplies
// rows of x (widened to f32 once per call when bf16, copied row-major when
// f32 with x_cs != 1) by it, broadcasting x. At the avx512 level and above
// (cpu_isa()) two adjacent panels go through a 6 x 32 tile of 16-lane
// vectors instead (12 accumulators, half the instructions), the same sums:
// the kernel also takes bf16 on AVX-512 CPUs without AMX, where it ran
// faster than oneDNN (gemm_dnnl.h).
// Each output sums its products in k order in one f32 accumulator, partial
// sums kept in f32 between k blocks, so a result does not depend on M, on
// the row's position or on the thread count. The caller checks
// cpu_isa() >= CpuIsa::avx2. X, O: float or BFloat16; W: float, BFloat16 or int8_t
// (int8 with no bias); bias has W's type.
// w_k_major: the right operand is stored [K, N] row-major instead (element
// (n, k) at w[k * ldw + n]; autograd's x W, attention's P V), packed the same
// way without the transpose.
// scale[N] (not null): each finished sum times scale[n] before alpha, as
// gemm_skinny_int8 applies an int8 weight's per-row scales (W = int8_t:
// the int8 values widened exactly in the packing, tensor/quantized.h):
//   out[m * ldo + n] = alpha * (scale[n] * sum_k x[m, k] * w[n, k]) (+ beta * out)
#include <cstdint>

#include "tensor/dtype.h"

namespace areno::cpu {

template <typename X, typename W, typename O>
void gemm_packed_avx2(int64_t M, int64_t N, int64_t K, const X* x, int64_t x_rs, int64_t x_cs, const W* w,
                      int64_t ldw, O* out, int64_t ldo, float alpha, float beta, const W* bias = nullptr,
                      bool w_k_major = false, const float* scale = nullptr);

}  // namespace areno::cpu
