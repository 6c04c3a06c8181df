// Philox4x32-10 counter-based random numbers: element i of a draw at offset o
// uses counter (o + i) / 4, lane (o + i) % 4, key = seed. Normals use
// Box-Muller on consecutive lane pairs.
#include <cmath>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"

namespace areno::cpu {

namespace {

struct Philox {
  static std::array<uint32_t, 4> block(uint64_t counter, uint64_t seed) {
    uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
    for (int r = 0; r < 10; ++r) {
      uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
      uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n1 = uint32_t(p1);
      uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1, n3 = uint32_t(p0);
      c0 = n0; c1 = n1; c2 = n2; c3 = n3;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    return {c0, c1, c2, c3};
  }
};

inline double to_unit(uint32_t u) { return double(u >> 8) * (1.0 / 16777216.0); }  // [0, 1)

}  // namespace

void CpuBackend::random(const Tensor& dst, RandomKind kind, double a, double b, uint64_t seed,
                        uint64_t offset) {
  int64_t n = dst.numel();
  visit_dtype(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(dst.data_ptr());
    // Work in whole blocks of 4 so that pairs never straddle threads.
    int64_t first = int64_t(offset / 4), nblocks = (int64_t(offset % 4) + n + 3) / 4;
    int64_t lane0 = int64_t(offset % 4);
    parallel_for(nblocks, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t blk = lo; blk < hi; ++blk) {
        auto r = Philox::block(uint64_t(first + blk), seed);
        double v[4];
        if (kind == RandomKind::uniform) {
          for (int k = 0; k < 4; ++k) v[k] = a + (b - a) * to_unit(r[k]);
        } else {
          for (int k = 0; k < 4; k += 2) {
            double u1 = (double(r[k] >> 8) + 1.0) * (1.0 / 16777217.0);  // (0, 1]
            double u2 = to_unit(r[k + 1]);
            double rad = std::sqrt(-2.0 * std::log(u1));
            v[k] = a + b * rad * std::cos(2 * M_PI * u2);
            v[k + 1] = a + b * rad * std::sin(2 * M_PI * u2);
          }
        }
        for (int k = 0; k < 4; ++k) {
          int64_t i = blk * 4 + k - lane0;
          if (i >= 0 && i < n) {
            if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) p[i] = T(float(v[k]));
            else p[i] = T(v[k]);
          }
        }
      }
    });
  });
}

}  // namespace areno::cpu
