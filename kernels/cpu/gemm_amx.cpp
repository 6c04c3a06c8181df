// bf16 x bf16 GEMM on AMX tiles with the weights read in place (see
// gemm_skinny.h, gemm_amx_bf16).
//
// The weight [N, K] is row-major in K, which is the layout AMX wants for the
// *left* operand of TDPBF16PS, so the product is computed transposed:
//   C^T[n, m] = sum_k w[n, k] x[m, k]
// A tiles are 16 weight rows x 32 k loaded straight from the weight memory
// (stride ldw), B tiles are 16 k-pairs x 16 activation rows from x packed
// once per call in the pair-interleaved ("VNNI") layout, C tiles 16 x 16 f32.
// A thread takes whole panels of 32 weight rows (two A tiles) and, for each
// 32 rows of x (two B tiles), runs the four products over all of K. Weight
// rows past N and k past K come from a zero-padded copy (the tail of a row
// is never read past its end).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/gemm_skinny.h"

namespace areno::cpu {

bool amx_usable() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
  // Linux hands out the tile data state only on request (arch_prctl
  // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once per process.
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx2,fma")

namespace {

constexpr int64_t kTile = 16;   // rows of every tile; a C tile is 16 x 16 f32
constexpr int64_t kKBlock = 32; // bf16 values of k per A row (64 bytes)
constexpr int64_t kPanel = 2 * kTile;
// Bytes ahead on each weight row a software prefetch asks for (0: none). The
// hardware prefetcher does better here: `full`'s 12-token prefill took
// 0.281 s without, 0.313 s at 2 KiB and 0.326 s at 8 KiB ahead.
constexpr int64_t kPrefetch = 0;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (A0 B0, A0 B1, A1 B0, A1 B1); 4-5: A; 6-7: B. All 16 x 64 bytes.
void configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = kTile;
  _tile_loadconfig(&c);
}

// One A tile's source for k-block kb: in place (rows of w, stride ldw) for
// whole blocks, the zero-padded copy `tail` for the last partial block, or
// all of it from `staged` (rows past N, stride K32).
struct ASource {
  const BFloat16* rows = nullptr;  // in place
  int64_t ld = 0;
  const BFloat16* tail = nullptr;  // [16][32], the last partial k-block
  int64_t full_blocks = 0;
  // Also asks for the rows kPrefetch bytes further on when in place.
  const BFloat16* at(int64_t kb, int64_t& stride_bytes) const {
    if (kb < full_blocks) {
      stride_bytes = ld * 2;
      const BFloat16* p = rows + kb * kKBlock;
      if constexpr (kPrefetch > 0)
        for (int64_t i = 0; i < kTile; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(p) + i * stride_bytes + kPrefetch, _MM_HINT_T0);
      return p;
    }
    stride_bytes = kKBlock * 2;
    return tail;
  }
};

// C tile `c` (16 weight rows x 16 x rows, f32) into out[m, n] for the rows
// and columns that exist.
template <typename O>
void write_tile(const float* c, int64_t rows_n, int64_t rows_m, O* out, int64_t ldo, float alpha, float beta) {
  for (int64_t j = 0; j < rows_m; ++j)
    for (int64_t i = 0; i < rows_n; ++i) store_out(out + j * ldo + i, c[i * kTile + j], alpha, beta);
}

// The four (or fewer) products of one 32-row weight panel and one 32-row
// block of x over all k-blocks. NA: A tiles (1-2), NB: B tiles (1-2).
template <int NA, int NB>
void panel_block(int64_t blocks, const ASource& a0, const ASource& a1, const uint16_t* b0, const uint16_t* b1,
                 float* c) {
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (NA == 2) _tile_zero(2);
  if constexpr (NA == 2 && NB == 2) _tile_zero(3);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    int64_t s0 = 0, s1 = 0;
    const BFloat16* p0 = a0.at(kb, s0);
    _tile_loadd(4, p0, s0);
    if constexpr (NA == 2) {
      const BFloat16* p1 = a1.at(kb, s1);
      _tile_loadd(5, p1, s1);
    }
    _tile_loadd(6, b0 + kb * kTile * kKBlock, 64);
    if constexpr (NB == 2) _tile_loadd(7, b1 + kb * kTile * kKBlock, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NA == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NA == 2 && NB == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  if constexpr (NB == 2) _tile_stored(1, c + 256, 64);
  if constexpr (NA == 2) _tile_stored(2, c + 512, 64);
  if constexpr (NA == 2 && NB == 2) _tile_stored(3, c + 768, 64);
}

}  // namespace

template <typename O>
void gemm_amx_bf16(int64_t M, int64_t N, int64_t K, const BFloat16* x, int64_t ldx, const BFloat16* w, int64_t ldw,
                   O* out, int64_t ldo, float alpha, float beta) {
  if (M <= 0 || N <= 0) return;
  const int64_t blocks = (K + kKBlock - 1) / kKBlock, K32 = blocks * kKBlock, full = K / kKBlock;
  const int64_t mblocks = (M + kTile - 1) / kTile;
  // x packed per 16 rows as B tiles: [K32 / 2 pairs][16 rows][2], zeros past M and K.
  std::vector<uint16_t> xp(size_t(mblocks * K32 * kTile), 0);
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* dst = xp.data() + (m / kTile) * K32 * kTile + (m % kTile) * 2;
    const BFloat16* src = x + m * ldx;
    for (int64_t k = 0; k < K; ++k) std::memcpy(dst + (k / 2) * 2 * kTile + (k & 1), src + k, 2);
  }
  const int64_t panels = (N + kPanel - 1) / kPanel;
  parallel_for(panels, M * K * kPanel, [&](int64_t q0, int64_t q1) {
    configure();
    alignas(64) float c[4 * kTile * kTile];
    // Zero-padded copies: the last partial k-block of each A tile, and whole
    // A tiles whose rows run past N.
    std::vector<BFloat16> tails(size_t(2 * kTile * kKBlock)), staged;
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t n0 = q * kPanel, rows = std::min(kPanel, N - n0);
      ASource src[2];
      for (int t = 0; t < 2; ++t) {
        const int64_t r0 = n0 + t * kTile, have = std::clamp<int64_t>(N - r0, 0, kTile);
        ASource& s = src[t];
        BFloat16* tail = tails.data() + t * kTile * kKBlock;
        if (have == kTile) {
          s.rows = w + r0 * ldw, s.ld = ldw, s.full_blocks = full, s.tail = tail;
          if (full < blocks) {
            std::fill(tail, tail + kTile * kKBlock, BFloat16{});
            for (int64_t i = 0; i < kTile; ++i)
              std::copy(w + (r0 + i) * ldw + full * kKBlock, w + (r0 + i) * ldw + K, tail + i * kKBlock);
          }
        } else if (have > 0) {  // rows past N: the whole tile from a zero-padded copy
          staged.assign(size_t(kTile * K32), BFloat16{});
          for (int64_t i = 0; i < have; ++i) std::copy(w + (r0 + i) * ldw, w + (r0 + i) * ldw + K, staged.data() + i * K32);
          s.rows = staged.data(), s.ld = K32, s.full_blocks = blocks;
        }
      }
      for (int64_t mb = 0; mb < mblocks; mb += 2) {
        const uint16_t* b0 = xp.data() + mb * K32 * kTile;
        const uint16_t* b1 = b0 + K32 * kTile;
        const bool two_b = mb + 1 < mblocks, two_a = rows > kTile;
        if (two_a && two_b) panel_block<2, 2>(blocks, src[0], src[1], b0, b1, c);
        else if (two_a) panel_block<2, 1>(blocks, src[0], src[1], b0, b1, c);
        else if (two_b) panel_block<1, 2>(blocks, src[0], src[1], b0, b1, c);
        else panel_block<1, 1>(blocks, src[0], src[1], b0, b1, c);
        const int64_t m0 = mb * kTile;
        for (int a = 0; a < (two_a ? 2 : 1); ++a)
          for (int b = 0; b < (two_b ? 2 : 1); ++b) {
            const int64_t mr = std::min(kTile, M - m0 - b * kTile), nr = std::min(kTile, rows - a * kTile);
            write_tile(c + (a * 2 + b) * kTile * kTile, nr, mr, out + (m0 + b * kTile) * ldo + n0 + a * kTile, ldo,
                       alpha, beta);
          }
      }
    }
    _tile_release();
  });
}

#pragma GCC pop_options

template void gemm_amx_bf16<float>(int64_t, int64_t, int64_t, const BFloat16*, int64_t, const BFloat16*, int64_t,
                                   float*, int64_t, float, float);
template void gemm_amx_bf16<BFloat16>(int64_t, int64_t, int64_t, const BFloat16*, int64_t, const BFloat16*, int64_t,
                                      BFloat16*, int64_t, float, float);

}  // namespace areno::cpu
