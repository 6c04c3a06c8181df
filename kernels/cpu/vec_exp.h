#pragma once
// exp of non-positive floats, one at a time or 16 lanes at a time through GCC
// vector types (the same operations per lane on every ISA; GCC lowers them to
// AVX-512, AVX2 or SSE), for the row passes GCC leaves unvectorised with libm
// or that Eigen runs as separate passes: the attention's softmax
// (kernels/cpu/attention.cpp) and the sampler's (serve/sampler.cpp); and
// bf16 rounding on 16 lanes (the attention, the AMX GEMM's output).
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

// Every helper here taking or returning a 64-byte vector is always_inline:
// below AVX-512 such a value passes in memory, with AVX-512 in a register, so
// an out-of-line call from a function compiled for another target (the
// AVX-512 kernels in a build for an AVX2 machine) would mismatch. Inlined,
// there is no call and no ABI, hence no -Wpsabi note.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace areno::cpu {

typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));
typedef uint16_t H16 __attribute__((vector_size(32)));
// 8 lanes (one AVX register; two SSE ones): for loops whose selects and
// conversions GCC spills to the stack at 16 lanes below AVX-512.
typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef uint32_t U8 __attribute__((vector_size(32)));
typedef uint16_t H8 __attribute__((vector_size(16)));

// float_to_bf16_bits (tensor/dtype.h) on 16 (U16) or 8 (U8) lanes of float bits.
template <typename U>
__attribute__((always_inline)) inline U bf16_bits_rne(U u) {
  const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded;
}

// sizeof(V) / 4 bf16 values (their bits at p) widened exactly to the f32
// lanes of V (8 or 16 lanes).
template <typename V>
__attribute__((always_inline)) inline V widen_bf16_lanes(const void* p) {
  static_assert(sizeof(V) == 64 || sizeof(V) == 32, "8 or 16 f32 lanes");
  using H = std::conditional_t<sizeof(V) == 64, H16, H8>;
  using U = std::conditional_t<sizeof(V) == 64, U16, U8>;
  H h;
  std::memcpy(&h, p, sizeof h);
  const U u = __builtin_convertvector(h, U) << 16;
  V v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// 2^r for integral r (a float, or 8 or 16 lanes) through the exponent bits.
inline float pow2_of(float r) { return std::bit_cast<float>((int32_t(r) + 127) << 23); }
template <typename V>
__attribute__((always_inline)) inline V pow2_of(V r) {
  typedef int32_t I __attribute__((vector_size(sizeof(V))));
  const I bits = (__builtin_convertvector(r, I) + 127) << 23;
  V out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// exp(x) for x <= 0, for one float or 16 lanes: 2^t with t = x log2(e) split
// into an integer (rounded to nearest even with the 1.5 * 2^23 constant,
// |t| < 2^22) and a fraction in [-0.5, 0.5], a degree-6 Taylor polynomial for
// 2^f (relative error about 1e-7). x below -87 gives 2^-125.5 (close to 0;
// callers mask what must be exactly 0). NaN stays NaN.
template <typename V>
__attribute__((always_inline)) inline V exp_nonpositive(V x) {
  x = x < -87.0f ? V{} - 87.0f : x;
  const V t = x * 1.4426950408889634f;
  const V r = (t + 12582912.0f) - 12582912.0f;
  const V f = (t - r) * 0.6931471805599453f;  // ln(2^(t-r)) in [-0.347, 0.347]
  V p = V{} + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  return p * pow2_of(r);
}

// The two reductions of a softmax row (kernels/cpu/rows.cpp: 16-lane vectors
// with AVX-512, else 8):
// the largest value (NaN ignored) and the sum of exp(x - max) (exp_nonpositive,
// summed in f64 lanes: in f32 the lane holding the largest term (~1) drops the
// tail's terms below its rounding step, so a confident row over a 200064-entry
// vocabulary lost about 1 % of its tail mass, log-probabilities too high by
// ~6e-5). The log-softmax of training and the sampler's log-probabilities
// both take it.
struct RowExpSum {
  float max;
  double sum;
};
RowExpSum row_exp_sum(const float* x, int64_t n);

}  // namespace areno::cpu
