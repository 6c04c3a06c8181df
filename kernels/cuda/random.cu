// Philox4x32-10 random numbers with the CPU kernel's scheme (kernels/cpu/random.cpp):
// element i of a draw at offset o uses counter (o + i) / 4, lane (o + i) % 4,
// key = seed; uniform = (u >> 8) * 2^-24 scaled to [a, b); normals by
// Box-Muller on lane pairs (0, 1) and (2, 3). Math runs in f64 so the
// device draws match the CPU's (up to libm's last-bit differences).
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

namespace areno::cuda {
namespace {

__device__ __forceinline__ uint4 philox4x32_10(uint64_t counter, uint64_t seed) {
  uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

__device__ __forceinline__ double to_unit(uint32_t u) { return double(u >> 8) * (1.0 / 16777216.0); }

// One thread per Philox block of 4 numbers.
template <typename T>
__global__ void random_kernel(T* out, int64_t n, RandomKind kind, double a, double b, uint64_t seed,
                              uint64_t first, int64_t lane0, int64_t nblocks) {
  ARENO_GRID_STRIDE_LOOP(blk, nblocks) {
    uint4 r4 = philox4x32_10(first + uint64_t(blk), seed);
    uint32_t r[4] = {r4.x, r4.y, r4.z, r4.w};
    double v[4];
    if (kind == RandomKind::uniform) {
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = __dadd_rn(a, __dmul_rn(b - a, to_unit(r[k])));  // no FMA: as the CPU
    } else {
      constexpr double kTwoPi = 6.283185307179586476925286766559;
#pragma unroll
      for (int k = 0; k < 4; k += 2) {
        double u1 = (double(r[k] >> 8) + 1.0) * (1.0 / 16777217.0);  // (0, 1]: log is finite
        double u2 = to_unit(r[k + 1]);
        double rad = sqrt(-2.0 * log(u1));
        double br = __dmul_rn(b, rad);
        v[k] = __dadd_rn(a, __dmul_rn(br, cos(kTwoPi * u2)));
        v[k + 1] = __dadd_rn(a, __dmul_rn(br, sin(kTwoPi * u2)));
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      int64_t i = blk * 4 + k - lane0;
      if (i >= 0 && i < n) {
        if constexpr (is_half_v<T>) out[i] = cast_value<T>(float(v[k]));
        else out[i] = cast_value<T>(v[k]);
      }
    }
  }
}

}  // namespace
}  // namespace areno::cuda

namespace areno {

using namespace cuda;

void CudaBackend::random(const Tensor& dst, RandomKind kind, double a, double b, uint64_t seed,
                         uint64_t offset) {
  require_contiguous(dst, "random", "dst");
  int64_t n = dst.numel();
  if (n == 0) return;
  Launch l(dst);
  uint64_t first = offset / 4;
  int64_t lane0 = int64_t(offset % 4);
  int64_t nblocks = (lane0 + n + 3) / 4;
  visit_floating(dst.dtype(), "random", [&](auto tag) {
    using T = typename decltype(tag)::type;
    random_kernel<T><<<grid_for(nblocks), kBlock, 0, l.stream>>>(ptr<T>(dst), n, kind, a, b, seed,
                                                                 first, lane0, nblocks);
    ARENO_LAUNCH_CHECK("random_kernel");
  });
}

}  // namespace areno
