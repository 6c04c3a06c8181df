// bf16 x bf16 GEMM on AMX tiles with the weights read in place (see
// gemm_skinny.h, gemm_amx_bf16).
//
// The weight [N, K] is row-major in K, which is the layout AMX wants for the
// *left* operand of TDPBF16PS, so the product is computed transposed:
//   C^T[n, m] = sum_k w[n, k] x[m, k]
// A tiles are 16 weight rows x 32 k loaded straight from the weight memory
// (stride ldw), B tiles are 16 k-pairs x 16 activation rows from x packed
// once per call in the pair-interleaved ("VNNI") layout, C tiles 16 x 16 f32.
//
// Up to kAmxInPlaceRows rows of x (gemm_amx_inplace): a thread takes whole
// panels of 32 weight rows (two A tiles) and, for each 32 rows of x (two B
// tiles), runs the four products over all of K, the A tiles loaded straight
// from the weight memory. Weight rows past N and k past K come from a
// zero-padded copy (the tail of a row is never read past its end).
//
// More rows (gemm_amx_blocked): the same panels and the same products in the
// same order (so the same bits), blocked over k for the caches. For each
// chunk of kChunk k-blocks the 32 x kChunk*32 piece of the weight panel is
// copied into a 64-byte-aligned buffer (it stays in L1 while every 32 rows of
// x run over it; a last pair of 16-row blocks with at most 16 rows runs on
// one B tile, half the products), a group of panels takes turns on each
// chunk of x (which stays in L2 across them), the four C tiles of each 32
// rows of x are kept in memory between chunks, and the weight lines of an
// item a few items ahead are prefetched a few at a time between the tile
// products, so the weight stream from DRAM overlaps the arithmetic. After
// the last chunk each pair's C tiles, still in L1, are transposed in
// registers into the rows of out.
#include <cpuid.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/gemm_skinny.h"
#include "kernels/cpu/vec_exp.h"

namespace areno::cpu {

bool amx_usable() {
  if (!ARENO_AMX_ISA) return false;
  // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 22 AMX-BF16 (clang 14's
  // __builtin_cpu_supports knows no AMX names).
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 22 & 1)) return false;
  // Linux hands out the tile data state only on request (arch_prctl
  // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once per process.
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

#if ARENO_AMX_ISA
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx2,fma")
// GCC 12 flags the self-initialised `__Y` inside its own AVX-512 intrinsics
// (_mm512_undefined_*) as maybe uninitialised under a target pragma.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

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
  // GCC 12 does not count ldtilecfg as a read of c: out of line (as
  // amx_configure_tiles) it dropped the stores above, and the load faulted.
  asm volatile("" : : "r"(&c) : "memory");
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
// and columns that exist; with `bias` (its columns'), alpha v + bias[n]
// rounded once, as store_out with out holding the bias and beta = 1.
template <typename O>
void write_tile(const float* c, int64_t rows_n, int64_t rows_m, O* out, int64_t ldo, float alpha, float beta,
                const BFloat16* bias) {
  for (int64_t j = 0; j < rows_m; ++j)
    for (int64_t i = 0; i < rows_n; ++i) {
      if (bias) out[j * ldo + i] = O(alpha * c[i * kTile + j] + float(bias[i]));
      else store_out(out + j * ldo + i, c[i * kTile + j], alpha, beta);
    }
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

// 16 x 16 f32 transposed in registers (four rounds of unpack / shuffle).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int h = 0; h < 2; ++h) {
      const __m512d a = _mm512_castps_pd(t[i + h]), b = _mm512_castps_pd(t[i + h + 2]);
      r[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int i = 0; i < 8; ++i) {
    const int a = (i / 4) * 8 + (i % 4), b = a + 4;
    t[a] = _mm512_shuffle_f32x4(r[a], r[b], 0x88);
    t[b] = _mm512_shuffle_f32x4(r[a], r[b], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// x rows [16 mb, 16 mb + 16) packed as B tiles, [blocks][16 k-pairs][16 rows]
// (32-bit pairs), zeros past M and K: each 16 x 32 piece loaded (masked at
// the k tail, never past a row's end) and transposed as 32-bit words.
void pack_x_block(int64_t mb, int64_t M, int64_t K, int64_t blocks, const BFloat16* x, int64_t ldx, uint32_t* dst) {
  const int64_t rows = std::clamp<int64_t>(M - mb * kTile, 0, kTile);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t k0 = kb * kKBlock;
    const __mmask32 mk = K - k0 >= kKBlock ? ~0u : (1u << (K - k0)) - 1;
    __m512 r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < rows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mk, x + (mb * kTile + i) * ldx + k0))
                      : _mm512_setzero_ps();
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_store_ps(reinterpret_cast<float*>(dst + kb * 256 + i * 16), r[i]);
  }
}


template <typename O>
void gemm_amx_inplace(int64_t M, int64_t N, int64_t K, const BFloat16* x, int64_t ldx, const BFloat16* w, int64_t ldw,
                      O* out, int64_t ldo, float alpha, float beta, const BFloat16* bias) {
  const int64_t blocks = (K + kKBlock - 1) / kKBlock, K32 = blocks * kKBlock, full = K / kKBlock;
  const int64_t mblocks = (M + kTile - 1) / kTile;
  // x packed per 16 rows as B tiles: [K32 / 2 pairs][16 rows][2], zeros past M and K.
  uint32_t* xp = thread_scratch<uint32_t>(ScratchSlot::amx_packed_x, mblocks * blocks * 256);
  for (int64_t mb = 0; mb < mblocks; ++mb) pack_x_block(mb, M, K, blocks, x, ldx, xp + mb * blocks * 256);
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
        const uint16_t* b0 = reinterpret_cast<const uint16_t*>(xp + mb * blocks * 256);
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
                       alpha, beta, bias ? bias + n0 + a * kTile : nullptr);
          }
      }
    }
    _tile_release();
  });
}

// out[0..16) (the lanes in `mask`) = alpha v (+ beta out), rounded once to O,
// as store_out does per element (the two products rounded before the sum);
// with `bias` (16 columns'), alpha v + bias instead (write_tile's rule).
template <typename O>
inline void store_row16(O* o, __m512 v, __mmask16 mask, float alpha, float beta, const BFloat16* bias) {
  v = _mm512_mul_ps(v, _mm512_set1_ps(alpha));
  // The lanes in `mask` of 16 bf16 values widened (exactly) to f32, zeros elsewhere.
  auto widen = [mask](const BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
  };
  if (bias) {
    v = _mm512_add_ps(v, widen(bias));
    beta = 0.0f;
  }
  if constexpr (std::is_same_v<O, float>) {
    if (beta != 0.0f) v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, o), _mm512_set1_ps(beta)));
    _mm512_mask_storeu_ps(o, mask, v);
  } else {
    if (beta != 0.0f) v = _mm512_add_ps(v, _mm512_mul_ps(widen(o), _mm512_set1_ps(beta)));
    U16 u;
    std::memcpy(&u, &v, sizeof u);
    const U16 b = bf16_bits_rne(u);
    __m512i bi;
    std::memcpy(&bi, &b, sizeof bi);
    _mm256_mask_storeu_epi16(o, mask, _mm512_cvtepi32_epi16(bi));
  }
}

// See the top. kChunk: k-blocks per chunk; kGroup: weight panels that take
// turns on each chunk of x (the x chunk stays in L2 across them; their C tiles
// are all kept); kAhead: work items (panel, chunk) ahead the weight prefetch
// runs; kToL1: prefetch into L1 (else L2). Measured on `full`'s shapes from
// DRAM, 2 threads (docs/perf.md): 4 / 1 / 4 / L2 best up to 160 rows, 8 / 4 /
// 2 / L1 above (down_proj, K = 8192, at 256 rows: 6.6 ms against 9.3 with
// one panel per group, whose x chunks came from L3).
//
// second (when w2 is not null): a second weight [N2, K] (row stride ldw2) on
// the same x, out2 [M, N2] (row stride ldo2) = x w2ᵀ rounded once, no bias or
// beta: its panels follow the first weight's in the threads' split, so both
// products share one packing of x and its trips through the caches, each
// output with the bits it has alone.
template <typename O>
struct SecondWeight {
  const BFloat16* w = nullptr;
  int64_t ldw = 0, n = 0;
  O* out = nullptr;
  int64_t ldo = 0;
};

// 32-row weight panels of a product and its second weight: the threads' split.
template <typename O>
int64_t panel_count(int64_t N, const SecondWeight<O>& second) {
  return (N + kPanel - 1) / kPanel + (second.w ? (second.n + kPanel - 1) / kPanel : 0);
}

template <typename O, int kChunk, int kGroup, int kAhead, bool kToL1>
void gemm_amx_blocked(int64_t M, int64_t N, int64_t K, const BFloat16* x, int64_t ldx, const BFloat16* w,
                      int64_t ldw, O* out, int64_t ldo, float alpha, float beta, const BFloat16* bias,
                      const SecondWeight<O>& second = {}, int64_t supers = 1) {
  const int64_t blocks = (K + kKBlock - 1) / kKBlock, chunks = (blocks + kChunk - 1) / kChunk;
  // Chunks per super-chunk of k (see gemm_amx_blocked_for); with one, the C
  // tiles of a group's panels only.
  const int64_t schunks = (chunks + std::max<int64_t>(supers, 1) - 1) / std::max<int64_t>(supers, 1);
  supers = (chunks + schunks - 1) / schunks;  // (none empty)
  const int64_t mpairs = (M + kPanel - 1) / kPanel, mblocks = 2 * mpairs;
  uint32_t* xp = thread_scratch<uint32_t>(ScratchSlot::amx_packed_x, mblocks * blocks * 256);
  const int64_t panels1 = (N + kPanel - 1) / kPanel;
  const int64_t panels = panel_count(N, second);
  // Panel q's weight rows, output columns, bias and beta.
  struct Panel {
    const uint16_t* w;  // its first row
    int64_t ldw, rows;  // rows that exist (<= kPanel)
    O* out;             // its first column
    int64_t ldo;
    const BFloat16* bias;
    float beta;
  };
  auto panel = [&](int64_t q) {
    if (q < panels1)
      return Panel{reinterpret_cast<const uint16_t*>(w + q * kPanel * ldw), ldw, std::min(kPanel, N - q * kPanel),
                   out + q * kPanel, ldo, bias ? bias + q * kPanel : nullptr, beta};
    const int64_t r = (q - panels1) * kPanel;
    return Panel{reinterpret_cast<const uint16_t*>(second.w + r * second.ldw), second.ldw,
                 std::min(kPanel, second.n - r), second.out + r, second.ldo, nullptr, 0.0f};
  };
  const int parts = int(std::clamp<int64_t>(num_threads(), 1, panels));
#pragma omp parallel num_threads(parts)
  {
#pragma omp for schedule(static)
    for (int64_t mb = 0; mb < (M + kTile - 1) / kTile; ++mb)  // an empty last block is never read
      pack_x_block(mb, M, K, blocks, x, ldx, xp + mb * blocks * 256);
    const int nt = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t p0 = panels * me / nt, p1 = panels * (me + 1) / nt;
    configure();
    // [k-block][A tile 0, 1][16 rows][32] and [panel][m pair][C tile 0-3][16][16]
    uint16_t* abuf = thread_scratch<uint16_t>(ScratchSlot::amx_weight_chunk, kChunk * 2 * 512);
    // (one chunk: only the pair in hand, written out at once)
    const int64_t cpanels = supers > 1 ? p1 - p0 : kGroup;  // panels whose C tiles are kept
    float* cbuf = thread_scratch<float>(ScratchSlot::amx_c_tiles, chunks > 1 ? cpanels * mpairs * 4 * 256 : 1024);
    // The finished C tiles of panel p, pair mp (at c), into out: tile (a, b)
    // holds weight rows 16 a + i of the panel and x rows 32 mp + 16 b + j.
    auto write_pair = [&](const Panel& p, int64_t mp, const float* c) {
      for (int a = 0; a < 2; ++a) {
        const int64_t nn = a * kTile;
        if (nn >= p.rows) continue;
        const __mmask16 nmask = p.rows - nn >= kTile ? __mmask16(0xffff) : __mmask16((1u << (p.rows - nn)) - 1);
        for (int b = 0; b < 2; ++b) {
          const int64_t m0 = mp * kPanel + b * kTile;
          if (m0 >= M) continue;
          __m512 r[16];
          for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + (a * 2 + b) * 256 + i * 16);
          transpose16(r);
          for (int64_t j = 0; j < std::min<int64_t>(kTile, M - m0); ++j)
            store_row16(p.out + (m0 + j) * p.ldo + nn, r[j], nmask, alpha, p.beta, p.bias ? p.bias + nn : nullptr);
        }
      }
    };
    // This thread's work items in order: groups of panels, then chunks, then
    // the group's panels.
    auto group_size = [&](int64_t g) { return std::min<int64_t>(kGroup, p1 - g); };
    auto super_end = [&](int64_t su) { return std::min(chunks, (su + 1) * schunks); };
    for (int64_t su = 0; su < supers; ++su)
    for (int64_t g0 = p0; g0 < p1; g0 += kGroup) {
      const int64_t gn = group_size(g0);
      for (int64_t ch = su * schunks; ch < super_end(su); ++ch) {
        const int64_t c0 = ch * kChunk, nk = std::min<int64_t>(kChunk, blocks - c0);
        for (int64_t q = 0; q < gn; ++q) {
          const Panel pq = panel(g0 + q);
          // The weight piece: 64 bytes per (row, k-block), masked at the k tail, zeros past N.
          for (int t = 0; t < 2; ++t)
            for (int i = 0; i < kTile; ++i) {
              const int64_t n = t * kTile + i;
              const uint16_t* src = pq.w + n * pq.ldw + c0 * kKBlock;
              for (int64_t kb = 0; kb < nk; ++kb) {
                uint16_t* d = abuf + ((kb * 2 + t) * kTile + i) * kKBlock;
                const int64_t k0 = (c0 + kb) * kKBlock;
                if (n >= pq.rows) _mm512_store_si512(d, _mm512_setzero_si512());
                else if (k0 + kKBlock <= K) _mm512_store_si512(d, _mm512_loadu_si512(src + kb * kKBlock));
                else _mm512_store_si512(d, _mm512_maskz_loadu_epi16((1u << (K - k0)) - 1, src + kb * kKBlock));
              }
            }
          // The item kAhead ahead in this thread's order, its lines spread over the products.
          // (pf_row, pf_line: the next line to ask for; counters, not a
          // division per line, which cost more than the tile products.)
          const uint16_t* pf = nullptr;
          int64_t pf_lines = 0, pf_done = 0, pf_per = 0, pf_nk = 1, pf_row = 0, pf_line = 0, pf_ld = 0;
          {
            int64_t sn = su, g = g0, c = ch, qq = q + kAhead;
            while (sn < supers && qq >= group_size(g)) {
              qq -= group_size(g);
              if (++c == super_end(sn)) {
                c = sn * schunks, g += kGroup;
                if (g >= p1) g = p0, c = ++sn * schunks;
              }
            }
            if (sn < supers) {
              const Panel pp = panel(g + qq);
              pf = pp.w + c * kChunk * kKBlock;
              pf_ld = pp.ldw;
              pf_nk = std::min<int64_t>(kChunk, blocks - c * kChunk);
              pf_lines = pp.rows * pf_nk;
              pf_per = (pf_lines + mpairs * nk - 1) / (mpairs * nk);
            }
          }
          // The products of one pair of x blocks over this chunk; with one B
          // tile (the last pair when it has at most 16 rows) half of them.
          auto run_pair = [&]<bool kTwoB>(int64_t mp) {
            float* cp = chunks == 1 ? cbuf : cbuf + ((supers > 1 ? g0 - p0 + q : q) * mpairs + mp) * 1024;
            if (chunks == 1) {
              // A one-chunk product (all of k in one pass: the write-out is
              // most of its work) asks for the output lines this pair's
              // write-out reads (beta) and writes, with prefetchw, while its
              // tiles run. The rows are a row stride apart (32 KB for
              // gate_up's 16384 columns), too far apart for the hardware
              // prefetcher, and each read or first write missed to DRAM: the
              // vision LoRA's B product (1848 x 16384, K = 256, beta = 1) in
              // 256-row blocks took 25-30 ms without and 13 with, 64 such
              // calls in the image prompt's prefill 1.07 -> 0.86 s. Past one
              // chunk it slowed the large GEMMs (SigLIP's tower 5.4 -> 5.8 s).
              const int64_t m_end = std::min<int64_t>(M, (mp + 1) * kPanel);
              for (int64_t m = mp * kPanel; m < m_end; ++m) {
                const char* line = reinterpret_cast<const char*>(pq.out + m * pq.ldo);
                _mm_prefetch(line, _MM_HINT_ET0);
                _mm_prefetch(line + pq.rows * int64_t(sizeof(O)) - 1, _MM_HINT_ET0);
              }
            }
            if (ch == 0) {
              _tile_zero(0);
              _tile_zero(2);
              if constexpr (kTwoB) {
                _tile_zero(1);
                _tile_zero(3);
              }
            } else {
              _tile_loadd(0, cp, 64);
              _tile_loadd(2, cp + 512, 64);
              if constexpr (kTwoB) {
                _tile_loadd(1, cp + 256, 64);
                _tile_loadd(3, cp + 768, 64);
              }
            }
            const uint32_t* b0 = xp + ((2 * mp) * blocks + c0) * 256;
            const uint32_t* b1 = b0 + blocks * 256;
            for (int64_t kb = 0; kb < nk; ++kb) {
              for (int64_t e = 0; e < pf_per && pf_done < pf_lines; ++e, ++pf_done) {
                const char* line = reinterpret_cast<const char*>(pf + pf_row * pf_ld + pf_line * kKBlock);
                if constexpr (kToL1) _mm_prefetch(line, _MM_HINT_T0);
                else _mm_prefetch(line, _MM_HINT_T1);
                if (++pf_line == pf_nk) pf_line = 0, ++pf_row;
              }
              const uint16_t* a = abuf + kb * 2 * 512;
              _tile_loadd(4, a, 64);
              _tile_loadd(5, a + 512, 64);
              _tile_loadd(6, b0 + kb * 256, 64);
              if constexpr (kTwoB) _tile_loadd(7, b1 + kb * 256, 64);
              _tile_dpbf16ps(0, 4, 6);
              if constexpr (kTwoB) _tile_dpbf16ps(1, 4, 7);
              _tile_dpbf16ps(2, 5, 6);
              if constexpr (kTwoB) _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, cp, 64);
            _tile_stored(2, cp + 512, 64);
            if constexpr (kTwoB) {
              _tile_stored(1, cp + 256, 64);
              _tile_stored(3, cp + 768, 64);
            }
            if (ch == chunks - 1) write_pair(pq, mp, cp);  // while its tiles are in L1
          };
          for (int64_t mp = 0; mp < mpairs; ++mp) {
            if (M - mp * kPanel > kTile) run_pair.template operator()<true>(mp);
            else run_pair.template operator()<false>(mp);
          }
        }
      }
    }
    _tile_release();
  }
}

// The blocked kernel's settings for M rows (M > kAmxInPlaceRows).
template <typename O>
void gemm_amx_blocked_for(int64_t M, int64_t N, int64_t K, const BFloat16* x, int64_t ldx, const BFloat16* w,
                          int64_t ldw, O* out, int64_t ldo, float alpha, float beta, const BFloat16* bias,
                          const SecondWeight<O>& second = {}) {
  // Rows up to which the blocked kernel takes chunks of 4 k-blocks, one panel per group (above: 8, groups of 4).
  constexpr int64_t kSmallChunkRows = 160;
  // Packed x past this many bytes (half of a core's L2 here) outgrows L2 when
  // every panel runs over all of it: groups of 2 panels then share each chunk
  // of x. `full`'s down_proj (K = 8192) at 133 rows, 2.6 MB of packed x: 5.1-6.4 ms
  // against 6.3-7.9 one panel at a time; K = 3072 (1 MB) gained nothing.
  constexpr int64_t kXGroupBytes = int64_t(1) << 20;
  const int64_t packed_x_bytes = (M + kPanel - 1) / kPanel * kPanel * ((K + kKBlock - 1) / kKBlock * kKBlock) * 2;
  // Up to this many k-blocks (K <= 512) at up to kSmallChunkRows rows, all of
  // k in one chunk (no C tile trips; the weight piece, 32 x 512 bf16, still in
  // L1): the speech LoRA's B (K = 320) at 133 rows, 1.07-1.10 ms against
  // 1.21-1.27 in chunks of 4 or 8; from K = 1024 on chunks of 4 win again.
  constexpr int64_t kOneChunkBlocks = 16;
  // Past kXGroupBytes of packed x, when the C tiles of all of a thread's
  // panels fit in this many bytes: k in super-chunks of at most kSuperXBytes
  // of packed x, each run by every panel of the thread in turn (that x stays
  // in L2; the C tiles wait in memory between super-chunks; the same k order
  // per output, so the same bits). down_proj (K = 8192, N = 3072 + the LoRA's
  // 320) at 133 rows: 4.8-5.2 ms in 2 against 6.4-6.5 in groups of 2 panels;
  // at 256 rows 7.7 in 4 against 8.9 (and gate_up, 264 panels a thread,
  // 7.5 -> 10.3 ms: its C tiles outgrow L2).
  constexpr int64_t kSuperCBytes = int64_t(2) << 20, kSuperXBytes = int64_t(5) << 18;
  const int64_t panels = panel_count(N, second);
  const int64_t threads = std::clamp<int64_t>(num_threads(), 1, panels);  // (gemm_amx_blocked's parts)
  const int64_t c_bytes = (panels + threads - 1) / threads * ((M + kPanel - 1) / kPanel) * 4 * 1024;
  if (M <= kSmallChunkRows && (K + kKBlock - 1) / kKBlock <= kOneChunkBlocks)
    gemm_amx_blocked<O, kOneChunkBlocks, 1, 4, false>(M, N, K, x, ldx, w, ldw, out, ldo, alpha, beta, bias, second);
  else if (packed_x_bytes > kXGroupBytes && c_bytes <= kSuperCBytes)
    gemm_amx_blocked<O, 4, 1, 4, false>(M, N, K, x, ldx, w, ldw, out, ldo, alpha, beta, bias, second,
                                        (packed_x_bytes + kSuperXBytes - 1) / kSuperXBytes);
  else if (M <= kSmallChunkRows && packed_x_bytes > kXGroupBytes)
    gemm_amx_blocked<O, 4, 2, 4, false>(M, N, K, x, ldx, w, ldw, out, ldo, alpha, beta, bias, second);
  else if (M <= kSmallChunkRows)
    gemm_amx_blocked<O, 4, 1, 4, false>(M, N, K, x, ldx, w, ldw, out, ldo, alpha, beta, bias, second);
  else gemm_amx_blocked<O, 8, 4, 2, true>(M, N, K, x, ldx, w, ldw, out, ldo, alpha, beta, bias, second);
}

}  // namespace

template <typename O>
void gemm_amx_bf16(int64_t M, int64_t N, int64_t K, const BFloat16* x, int64_t ldx, const BFloat16* w, int64_t ldw,
                   O* out, int64_t ldo, float alpha, float beta, const BFloat16* bias) {
  if (M <= 0 || N <= 0) return;
  if (M <= kAmxInPlaceRows) gemm_amx_inplace(M, N, K, x, ldx, w, ldw, out, ldo, alpha, beta, bias);
  else gemm_amx_blocked_for(M, N, K, x, ldx, w, ldw, out, ldo, alpha, beta, bias);
}

bool gemm_amx_bf16_pair(int64_t M, int64_t N, int64_t K, const BFloat16* x, int64_t ldx, const BFloat16* w,
                        int64_t ldw, BFloat16* out, int64_t ldo, const BFloat16* w2, int64_t ldw2, int64_t N2,
                        BFloat16* out2, int64_t ldo2) {
  if (M <= kAmxInPlaceRows || N <= 0 || N2 <= 0) return false;
  gemm_amx_blocked_for<BFloat16>(M, N, K, x, ldx, w, ldw, out, ldo, 1.0f, 0.0f, nullptr,
                                 SecondWeight<BFloat16>{w2, ldw2, N2, out2, ldo2});
  return true;
}

void amx_configure_tiles() { configure(); }

void amx_pack_rows(int64_t mb, int64_t M, int64_t K, int64_t blocks, const BFloat16* x, int64_t ldx, uint32_t* dst) {
  pack_x_block(mb, M, K, blocks, x, ldx, dst);
}

#pragma GCC diagnostic pop
#pragma GCC pop_options
#else
void amx_configure_tiles() { throw std::logic_error("amx_configure_tiles: this build has no AMX code"); }
void amx_pack_rows(int64_t, int64_t, int64_t, int64_t, const BFloat16*, int64_t, uint32_t*) {
  throw std::logic_error("amx_pack_rows: this build has no AMX code");
}
template <typename O>
void gemm_amx_bf16(int64_t, int64_t, int64_t, const BFloat16*, int64_t, const BFloat16*, int64_t, O*, int64_t, float,
                   float, const BFloat16*) {
  throw std::logic_error("gemm_amx_bf16: this build has no AMX code (amx_usable() is false)");
}
bool gemm_amx_bf16_pair(int64_t, int64_t, int64_t, const BFloat16*, int64_t, const BFloat16*, int64_t, BFloat16*,
                        int64_t, const BFloat16*, int64_t, int64_t, BFloat16*, int64_t) {
  return false;
}
#endif  // ARENO_AMX_ISA

template void gemm_amx_bf16<float>(int64_t, int64_t, int64_t, const BFloat16*, int64_t, const BFloat16*, int64_t,
                                   float*, int64_t, float, float, const BFloat16*);
template void gemm_amx_bf16<BFloat16>(int64_t, int64_t, int64_t, const BFloat16*, int64_t, const BFloat16*, int64_t,
                                      BFloat16*, int64_t, float, float, const BFloat16*);

}  // namespace areno::cpu
