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
// Dispatch by CPU features at run time: amx (AVX512-BF16 and AMX-TILE +
// AMX-BF16 with the kernel's permission: gemm_skinny_bf16 on AMX tiles, see
// gemm_amx_bf16), avx512bf16 (AVX-512 with AVX512-BF16: gemm_skinny_bf16's
// native bf16 dot products; the other kernels run their avx512 code there and
// at amx), avx512 (AVX-512F/BW/VL), avx2 (AVX2 + FMA) or generic (plain
// loops). ARENO_CPU_ISA=generic|avx2|avx512|avx512bf16|amx lowers
// the level (never above what the CPU runs), so tests and benchmarks
// can check every level the machine has.
#include <cstdint>

#include "tensor/dtype.h"

namespace areno::cpu {

enum class CpuIsa : int { generic = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3, amx = 4 };

// GCC builds the AVX-512 and AMX code (GCC target pragmas) on any -march.
// Clang ignores those pragmas, so below an AVX-512 -march it cannot build that
// code (the fuzzing build, scripts/fuzz.sh, on such a machine): there it is
// left out and the levels stop at AVX2.
#if !defined(__clang__) || defined(__AVX512F__)
#define ARENO_WIDE_ISA 1
#else
#define ARENO_WIDE_ISA 0
#endif
// The AMX code likewise: clang builds it only where -march enables AMX
// (clang 14's -march=native on an AMX Xeon does not); without it the levels
// stop at avx512bf16.
#if ARENO_WIDE_ISA && (!defined(__clang__) || (defined(__AMX_TILE__) && defined(__AMX_BF16__)))
#define ARENO_AMX_ISA 1
#else
#define ARENO_AMX_ISA 0
#endif

// The highest level this CPU runs.
CpuIsa cpu_isa_supported();
// The level in use: cpu_isa_supported(), lowered by ARENO_CPU_ISA (read on
// first use; an unknown name throws std::invalid_argument naming it) or by
// set_cpu_isa.
CpuIsa cpu_isa();
// Forces a level for tests; clamped to cpu_isa_supported(). Returns the level set.
CpuIsa set_cpu_isa(CpuIsa isa);
const char* cpu_isa_name(CpuIsa isa);

// *p = alpha v (+ beta *p), rounded once to O: how every kernel here writes
// a finished f32 dot product.
template <typename O>
inline void store_out(O* p, float v, float alpha, float beta) {
  *p = O(beta == 0.0f ? alpha * v : alpha * v + beta * float(*p));
}

// Rows of x above this go to the blocked GEMM (Eigen) instead.
constexpr int64_t kSkinnyMaxRows = 32;

// See the top. W is float or BFloat16, O is float or BFloat16. Runs on the
// OpenMP threads (split over N) unless called inside a parallel region.
template <typename W, typename O>
void gemm_skinny(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const W* w, int64_t ldw, O* out,
                 int64_t ldo, float alpha, float beta);

// bf16 activations times bf16 weights (the decode shape of a bf16 model):
// at the amx level gemm_amx_bf16 for at least kAmxMinRows rows; at the
// avx512bf16 level (and amx with fewer rows) the pairs of bf16 products go
// straight into f32 accumulators (vdpbf16ps: each product exact, as widening
// both would give, summed in another order; bf16 denormals, below 1.2e-38,
// count as zero); below it x is widened to f32 and gemm_skinny runs. At the
// avx512bf16 level from kPairsMinRows rows the same sums, pair by pair in
// vdpbf16ps's order and so with its bits (denormals aside), run on f32 FMAs:
// each load of 32 weights split into its even and odd k by a shift and a mask
// (on a Xeon without AMX two f32 FMAs issue per cycle where vdpbf16ps takes
// two cycles; one row, where the weight stream is all, stays on vdpbf16ps,
// whose 8-row tile streamed `small`'s head faster). O is float or BFloat16.
template <typename O>
void gemm_skinny_bf16(int64_t M, int64_t N, int64_t K, const BFloat16* x, int64_t ldx, const BFloat16* w,
                      int64_t ldw, O* out, int64_t ldo, float alpha, float beta);
constexpr int64_t kPairsMinRows = 4;

// Rows of x from which gemm_skinny_bf16 takes AMX tiles at the amx level
// (one row streams faster through vdpbf16ps: `small`'s decode step 2.5 ms
// there against 3.5 ms on tiles), and up to which the matmul op sends bf16
// linear layers there instead of oneDNN (measured on `full`'s decoder shapes,
// 2 threads: the tiles were 1.5-5x faster than oneDNN from 2 to 32 rows, even
// at 48-64 and behind from 128 rows on; docs/perf.md).
constexpr int64_t kAmxMinRows = 2, kAmxMaxRows = 64;

// Whether this CPU and kernel run AMX bf16 tiles (asks Linux for the tile
// state the first time; detection calls it once).
bool amx_usable();

// bf16 x bf16 on AMX tiles (gemm_amx.cpp), any M, same contract as
// gemm_skinny_bf16. Up to kAmxInPlaceRows rows the weight rows are loaded into
// tiles in place (16 rows x 32 k each, no copy except a zero-padded one for
// the last partial k-block and for rows past N); above, the weight is copied
// a chunk of k at a time into an L1 buffer while the next chunks are
// prefetched, with the same products in the same order. x is packed once per
// call in the pair-interleaved layout AMX takes, each output sums exact bf16
// products in f32 (in the tiles' order, the same at every M; bf16 denormals
// count as zero), and a thread's share is whole 32-row panels of the weight,
// so the result does not depend on the thread count or on M. bias[N] (when
// not null, beta 0): out = alpha x wᵀ + bias rounded once, the bits of out
// filled with the bias and beta = 1, without the fill. Only at the amx level
// (the caller checks).
constexpr int64_t kAmxInPlaceRows = 32;
template <typename O>
void gemm_amx_bf16(int64_t M, int64_t N, int64_t K, const BFloat16* x, int64_t ldx, const BFloat16* w, int64_t ldw,
                   O* out, int64_t ldo, float alpha, float beta, const BFloat16* bias = nullptr);
// Two weights on the same x: out = x wᵀ [M, N] and out2 = x w2ᵀ [M, N2] (row
// strides ldw2, ldo2), each rounded once with the bits of its own
// gemm_amx_bf16 call, from one packing of x with the panels of both in one
// threads' split (a LoRA's x Aᵀ beside its base product). Past
// kAmxInPlaceRows rows at the amx level; false (nothing written) otherwise.
bool gemm_amx_bf16_pair(int64_t M, int64_t N, int64_t K, const BFloat16* x, int64_t ldx, const BFloat16* w,
                        int64_t ldw, BFloat16* out, int64_t ldo, const BFloat16* w2, int64_t ldw2, int64_t N2,
                        BFloat16* out2, int64_t ldo2);

// AMX building blocks for other kernels (attention.cpp), at the amx level
// only: this thread's tile configuration, all 8 tiles 16 rows x 64 bytes; and
// rows [16 mb, 16 mb + 16) of x [M, K] (row stride ldx) packed as B tiles,
// [blocks][16 k-pairs][16 rows] 32-bit pairs, zeros past M and K (the
// right operand of a product with x's rows as its columns).
void amx_configure_tiles();
void amx_pack_rows(int64_t mb, int64_t M, int64_t K, int64_t blocks, const BFloat16* x, int64_t ldx, uint32_t* dst);

// Weight-only int8 (tensor/quantized.h): w holds int8 values and row n of the
// weight is scales[n] * w[n, :]. The int8 values are widened to f32 in
// registers and the row's scale multiplies the finished dot product:
//   out[m * ldo + n] = alpha * scales[n] * sum_k x[m * ldx + k] * w[n * ldw + k]  (+ beta * out)
// O is float or BFloat16; same tiles, threads and dispatch as gemm_skinny.
template <typename O>
void gemm_skinny_int8(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const int8_t* w, int64_t ldw,
                      const float* scales, O* out, int64_t ldo, float alpha, float beta);

}  // namespace areno::cpu
