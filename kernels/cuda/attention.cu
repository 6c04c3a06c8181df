// Fused flash-style attention on tensor cores (Backend::attention_train and
// attention_backward, tensor/backend.h) for bf16 operands with head dims 32,
// 64 and 128 (Phi-4-mini's decoder: 128; the Conformer: 64) and at least 16
// queries; other inputs return false and the caller composes the op.
//
// The products are mma.sync m16n8k16 (bf16 in, f32 sums) on fragments loaded
// from shared memory with ldmatrix, in the register layouts of the PTX ISA,
// so the scores stay in registers: the softmax runs on the accumulators and
// the probabilities become the next product's A operand without a trip
// through memory (FlashAttention-2's scheme). A block is 4 warps, 16 rows
// each; key (or query) tiles stream through shared memory, the next one
// loading (cp.async) while the current one is used. Exponentials are exp2 of
// scores times scale * log2(e).
//   forward  (grid: 64-query tiles x (batch, query head)): S = Q K^T, running
//            max m and sum l per row, P rounded to bf16, O = alpha O + P V;
//            out = O / l in bf16, lse = m + log l.
//   backward (recomputed from lse, no score matrix in memory), two kernels
//            and no atomics, so the bits do not depend on scheduling:
//            dK/dV (grid: 64-key tiles x (batch, KV head); every query head of
//            the GQA group and every 32-query tile that sees the keys, in order):
//              P^T = exp(scale K Q^T - lse), dV += P^T dO, dP^T = V dO^T,
//              dS^T = P^T (dP^T - delta), dK += scale dS^T Q;
//            dQ (grid: 64-query tiles x (batch, query head)):
//              P, dP = dO V^T, dS = P (dP - delta), dQ += scale dS K;
//            delta = rowsum(dO * O) first, one warp per row.
// A query row with no visible key (causal, more queries than keys) gets NaN
// out and lse, as the composed op, and no gradient.
#include <cstdlib>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/elementwise.cuh"

namespace areno::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = kWarps * 16;  // rows a block owns: queries (forward, dQ) or keys (dK/dV)
constexpr int kTile = 64;           // keys per streamed tile (forward, dQ)
constexpr int kQTile = 32;          // queries per streamed tile (dK/dV)
constexpr float kLog2e = 1.4426950408889634f;

// A [rows][D] bf16 tile in shared memory, rows D + 8 apart: ldmatrix's eight
// 16-byte row reads then fall in distinct banks.
template <int D> constexpr int kLd = D + 8;
template <int D> constexpr size_t tile_bytes(int rows) { return size_t(rows) * kLd<D> * sizeof(bf16); }

// ---- PTX wrappers -----------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c (16x8 f32) += a (16x16 bf16, row) b (16x8 bf16, col).
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void cp_async16(bf16* s, const bf16* g, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s)), "l"(g),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- fragments of the warp's 16 rows ----------------------------------------
// m16n8k16 layouts (PTX ISA): with g = lane / 4 and t = lane % 4, an A
// fragment holds rows g and g + 8, columns 2t, 2t + 1 (regs 0, 1) and 2t + 8,
// 2t + 9 (regs 2, 3); a B fragment column g, rows 2t, 2t + 1 and 2t + 8,
// 2t + 9; an accumulator rows g (c[0], c[1]) and g + 8 (c[2], c[3]), columns
// 2t, 2t + 1.

// A fragment of rows [r0, r0 + 16), columns [c0, c0 + 16) of a tile.
template <int D>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* s, int r0, int c0) {
  const int l = threadIdx.x & 31, m = l >> 3, i = l & 7;
  ldsm_x4(a, s + (r0 + (m & 1) * 8 + i) * kLd<D> + c0 + (m >> 1) * 8);
}

// B fragments for two 8-column output tiles from a tile stored [n][k] (rows
// n0.., k from k0: the "K^T" operand): b[0], b[1] for columns n0..n0+7,
// b[2], b[3] for n0+8..n0+15.
template <int D>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const bf16* s, int n0, int k0) {
  const int l = threadIdx.x & 31, m = l >> 3, i = l & 7;
  ldsm_x4(b, s + (n0 + (m >> 1) * 8 + i) * kLd<D> + k0 + (m & 1) * 8);
}

// The same from a tile stored [k][n] (the "V" operand), transposed on load.
template <int D>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const bf16* s, int k0, int n0) {
  const int l = threadIdx.x & 31, m = l >> 3, i = l & 7;
  ldsm_x4_t(b, s + (k0 + (m & 1) * 8 + i) * kLd<D> + n0 + (m >> 1) * 8);
}

// Accumulators of the warp's 16 rows set to 0.
template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// acc[N / 8] (16 x N) = A (16 x D, from registers) B^T, B a tile stored [N][D].
template <int D, int N>
__device__ __forceinline__ void product_abt(float (&acc)[N / 8][4], const uint32_t (&a)[D / 16][4], const bf16* b) {
  zero(acc);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t f[4];
      load_b_nk<D>(f, b, np * 16, kk * 16);
      mma(acc[2 * np], a[kk], f[0], f[1]);
      mma(acc[2 * np + 1], a[kk], f[2], f[3]);
    }
}

// The same with A read from a tile (rows [r0, r0 + 16)).
template <int D, int N>
__device__ __forceinline__ void product_abt_s(float (&acc)[N / 8][4], const bf16* a, int r0, const bf16* b) {
  zero(acc);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t fa[4];
    load_a<D>(fa, a, r0, kk * 16);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t f[4];
      load_b_nk<D>(f, b, np * 16, kk * 16);
      mma(acc[2 * np], fa, f[0], f[1]);
      mma(acc[2 * np + 1], fa, f[2], f[3]);
    }
  }
}

// out[D / 8] (16 x D) += P (16 x K, accumulator layout, rounded to bf16 here)
// M, M a tile stored [K][D].
template <int D, int K>
__device__ __forceinline__ void product_pm(float (&out)[D / 8][4], const float (&p)[K / 8][4], const bf16* m) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const uint32_t a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                           pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                           pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t f[4];
      load_b_kn<D>(f, m, kk * 16, dp * 16);
      mma(out[2 * dp], a, f[0], f[1]);
      mma(out[2 * dp + 1], a, f[2], f[3]);
    }
  }
}

// ---- tiles from global memory -----------------------------------------------

// One [B, H, T, D] operand: base pointer and element strides (last dim 1).
struct Operand {
  const bf16* p;
  int64_t sb, sh, st;
};

// rows x D elements from global (row stride st) into a shared tile; rows at
// or past `valid` are zero. cp.async 16-byte copies when the rows are 16-byte
// aligned (the caller waits), else plain loads.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, int64_t st, int64_t valid, bool vec) {
  if (vec) {
    constexpr int per_row = D / 8;
    for (int i = threadIdx.x; i < ROWS * per_row; i += kThreads) {
      const int r = i / per_row, c = (i % per_row) * 8;
      const bool in = r < valid;
      cp_async16(s + r * kLd<D> + c, in ? g + r * st + c : g, in);
    }
  } else {
    for (int i = threadIdx.x; i < ROWS * D; i += kThreads) {
      const int r = i / D, c = i % D;
      s[r * kLd<D> + c] = r < valid ? g[r * st + c] : __float2bfloat16(0.0f);
    }
  }
}

__device__ __forceinline__ bool aligned16(const Operand& o) {
  return reinterpret_cast<uintptr_t>(o.p) % 16 == 0 && o.sb % 8 == 0 && o.sh % 8 == 0 && o.st % 8 == 0;
}

struct Params {
  Operand q, k, v, dout;
  const bf16* out;  // [B, HQ, TQ, D] contiguous
  bf16* out_w;
  float* lse;    // [B, HQ, TQ]
  float* delta;  // [B, HQ, TQ]
  float* dq;     // [B, HQ, TQ, D] f32
  float* dk;     // [B, HKV, TK, D] f32
  float* dv;
  int64_t B, HQ, HKV, TQ, TK;
  float scale;
  bool causal;
};

// Keys [0, end) visible to query i: all TK, or up to i + TK - TQ when causal.
__device__ __forceinline__ int64_t visible_end(const Params& p, int64_t i) {
  if (i >= p.TQ) return 0;
  return p.causal ? max(int64_t(0), min(p.TK, i + p.TK - p.TQ + 1)) : p.TK;
}

// Double-buffered tiles: `issue(i)` starts loading tile i into buffer i % 2
// (one cp.async group). Before tile `it` is used, tile it + 1 starts loading
// and tile it is waited for, block-wide.
template <typename Issue>
__device__ __forceinline__ void tile_ready(int it, int ntiles, Issue&& issue) {
  if (it + 1 < ntiles) {
    issue(it + 1);
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
}

// K and V tile `it` (keys [it * kTile, (it + 1) * kTile) of one KV head) into
// buffer it % 2 of Ks and Vs: the forward's and dQ's `issue`.
template <int D>
__device__ __forceinline__ void load_kv_tile(int it, bf16* Ks, bf16* Vs, const bf16* kbase, const bf16* vbase,
                                             const Params& p, bool vec) {
  constexpr int kTileElems = kTile * kLd<D>;
  const int64_t k0 = int64_t(it) * kTile;
  load_tile<D, kTile>(Ks + (it & 1) * kTileElems, kbase + k0 * p.k.st, p.k.st, p.TK - k0, vec);
  load_tile<D, kTile>(Vs + (it & 1) * kTileElems, vbase + k0 * p.v.st, p.v.st, p.TK - k0, vec);
}

// The scores S = Q K^T of the warp's 16 query rows against K tile `it` (in
// Kc): waits for the tile (tile_ready: the next one starts loading) and
// takes the warp's Q fragments from Qs on the first tile.
template <int D, typename Issue>
__device__ __forceinline__ void tile_scores(int it, int ntiles, Issue&& issue, const bf16* Qs, const bf16* Kc,
                                            uint32_t (&qf)[D / 16][4], float (&s)[kTile / 8][4]) {
  tile_ready(it, ntiles, issue);
  if (it == 0) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) load_a<D>(qf[kk], Qs, (threadIdx.x >> 5) * 16, kk * 16);
  }
  product_abt<D, kTile>(s, qf, Kc);
}

// ---- forward ----------------------------------------------------------------

template <int D>
__global__ void __launch_bounds__(kThreads) attention_fwd_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Ks = reinterpret_cast<bf16*>(smem + tile_bytes<D>(kRows));                    // 2 buffers
  bf16* Vs = reinterpret_cast<bf16*>(smem + tile_bytes<D>(kRows) + 2 * tile_bytes<D>(kTile));  // 2 buffers
  constexpr int kTileElems = kTile * kLd<D>;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t bh = blockIdx.y, b = bh / p.HQ, h = bh % p.HQ, kvh = h / (p.HQ / p.HKV);
  const int64_t q0 = int64_t(blockIdx.x) * kRows;
  const bool vec = aligned16(p.q) && aligned16(p.k) && aligned16(p.v);
  const bf16* kbase = p.k.p + b * p.k.sb + kvh * p.k.sh;
  const bf16* vbase = p.v.p + b * p.v.sb + kvh * p.v.sh;
  const int64_t kend = visible_end(p, min(p.TQ, q0 + kRows) - 1);  // keys any row of the block sees
  const int ntiles = int((kend + kTile - 1) / kTile);

  auto issue = [&](int it) { load_kv_tile<D>(it, Ks, Vs, kbase, vbase, p, vec); };
  load_tile<D, kRows>(Qs, p.q.p + b * p.q.sb + h * p.q.sh + q0 * p.q.st, p.q.st, p.TQ - q0, vec);
  if (ntiles > 0) issue(0);
  cp_async_commit();

  // Row state for rows g and g + 8 of the warp (each lane holds a quarter of
  // the columns; the sums are reduced across the 4 lanes at the end).
  const int64_t row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  const int64_t vis[2] = {visible_end(p, row[0]), visible_end(p, row[1])};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[D / 8][4];
  zero(o);
  uint32_t qf[D / 16][4];
  const float sc = p.scale * kLog2e;

  for (int it = 0; it < ntiles; ++it) {
    const int64_t k0 = int64_t(it) * kTile;
    const bf16* Kc = Ks + (it & 1) * kTileElems;
    const bf16* Vc = Vs + (it & 1) * kTileElems;
    float s[kTile / 8][4];
    tile_scores<D>(it, ntiles, issue, Qs, Kc, qf, s);
    // Scale (log2 units), mask, row max.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = e >> 1;
        const int64_t j = k0 + n * 8 + 2 * t + (e & 1);
        s[n][e] = j < vis[rr] ? s[n][e] * sc : -INFINITY;
        mx[rr] = fmaxf(mx[rr], s[n][e]);
      }
    float alpha[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
      const float mnew = fmaxf(m[rr], mx[rr]);
      alpha[rr] = mnew == -INFINITY ? 1.0f : exp2f(m[rr] - mnew);
      m[rr] = mnew;
      l[rr] *= alpha[rr];
    }
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = e >> 1;
        const float pe = s[n][e] == -INFINITY ? 0.0f : exp2f(s[n][e] - m[rr]);
        s[n][e] = pe;
        l[rr] += pe;
      }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= alpha[0], o[n][1] *= alpha[0];
      o[n][2] *= alpha[1], o[n][3] *= alpha[1];
    }
    product_pm<D, kTile>(o, s, Vc);
    __syncthreads();  // this tile's buffers are reloaded in the next iteration's tile_ready
  }
  if (ntiles == 0) {
    cp_async_wait<0>();
    __syncthreads();
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    if (row[rr] >= p.TQ) continue;
    const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : NAN;
    bf16* orow = p.out_w + (bh * p.TQ + row[rr]) * D + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(orow + n * 8) = pack_bf16(o[n][2 * rr] * inv, o[n][2 * rr + 1] * inv);
    if (t == 0) p.lse[bh * p.TQ + row[rr]] = l[rr] > 0.0f ? (m[rr] + log2f(l[rr])) / kLog2e : NAN;
  }
}

// ---- backward ---------------------------------------------------------------

// delta[row] = sum_d dO[row, d] * O[row, d], one warp per row.
template <int D>
__global__ void attention_delta_kernel(Params p) {
  const int64_t rows = p.B * p.HQ * p.TQ;
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const int64_t i = r % p.TQ, bh = r / p.TQ, b = bh / p.HQ, h = bh % p.HQ;
  const bf16* gr = p.dout.p + b * p.dout.sb + h * p.dout.sh + i * p.dout.st;
  const bf16* o = p.out + r * D;
  float s = 0.0f;
  for (int d = lane; d < D; d += 32) s += __bfloat162float(gr[d]) * __bfloat162float(o[d]);
  s = warp_sum(s);
  if (lane == 0) p.delta[r] = s;
}

// Writes a warp's 16 x D f32 accumulator rows (times mul) to rows [row0,
// row0 + 16) of a contiguous [rows, D] f32 matrix, skipping rows at or past
// `valid`.
template <int D>
__device__ __forceinline__ void store_f32(const float (&acc)[D / 8][4], float* out, int64_t row0, int64_t valid,
                                          float mul) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t r = row0 + g + 8 * rr;
    if (r >= valid) continue;
    float* orow = out + r * D + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<float2*>(orow + n * 8) = make_float2(acc[n][2 * rr] * mul, acc[n][2 * rr + 1] * mul);
  }
}

// dK and dV of 64 keys of one (batch, KV head).
template <int D>
__global__ void __launch_bounds__(kThreads) attention_dkv_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Ks = reinterpret_cast<bf16*>(smem);
  bf16* Vs = reinterpret_cast<bf16*>(smem + tile_bytes<D>(kRows));
  bf16* Qs = reinterpret_cast<bf16*>(smem + 2 * tile_bytes<D>(kRows));                              // 2 buffers
  bf16* Gs = reinterpret_cast<bf16*>(smem + 2 * tile_bytes<D>(kRows) + 2 * tile_bytes<D>(kQTile));  // dO, 2 buffers
  float* Ls = reinterpret_cast<float*>(smem + 2 * tile_bytes<D>(kRows) + 4 * tile_bytes<D>(kQTile));  // lse * log2e
  float* Es = Ls + 2 * kQTile;                                                                        // delta
  constexpr int kTileElems = kQTile * kLd<D>;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t bkv = blockIdx.y, b = bkv / p.HKV, kvh = bkv % p.HKV, G = p.HQ / p.HKV;
  const int64_t k0 = int64_t(blockIdx.x) * kRows;
  const bool vec = aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.dout);
  load_tile<D, kRows>(Ks, p.k.p + b * p.k.sb + kvh * p.k.sh + k0 * p.k.st, p.k.st, p.TK - k0, vec);
  load_tile<D, kRows>(Vs, p.v.p + b * p.v.sb + kvh * p.v.sh + k0 * p.v.st, p.v.st, p.TK - k0, vec);

  // Query i sees key j when j <= i + TK - TQ (causal): the first query tile
  // that sees any of these keys; the tiles run over (head of the group, tile).
  const int64_t shift = p.TK - p.TQ;
  const int64_t qfirst = p.causal ? max(int64_t(0), k0 - shift) / kQTile * kQTile : 0;
  const int per_head = qfirst < p.TQ ? int((p.TQ - qfirst + kQTile - 1) / kQTile) : 0;
  const int ntiles = int(G) * per_head;
  auto issue = [&](int it) {
    const int64_t h = kvh * G + it / per_head, q0 = qfirst + int64_t(it % per_head) * kQTile;
    const int buf = it & 1;
    load_tile<D, kQTile>(Qs + buf * kTileElems, p.q.p + b * p.q.sb + h * p.q.sh + q0 * p.q.st, p.q.st, p.TQ - q0,
                         vec);
    load_tile<D, kQTile>(Gs + buf * kTileElems, p.dout.p + b * p.dout.sb + h * p.dout.sh + q0 * p.dout.st,
                         p.dout.st, p.TQ - q0, vec);
    const int64_t base = (b * p.HQ + h) * p.TQ;
    for (int i = threadIdx.x; i < kQTile; i += kThreads) {
      const bool in = q0 + i < p.TQ;
      Ls[buf * kQTile + i] = in ? p.lse[base + q0 + i] * kLog2e : NAN;
      Es[buf * kQTile + i] = in ? p.delta[base + q0 + i] : 0.0f;
    }
  };
  if (ntiles > 0) issue(0);
  cp_async_commit();

  const int64_t kj[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};  // this lane's key rows
  float dv[D / 8][4], dk[D / 8][4];
  zero(dv);
  zero(dk);
  const float sc = p.scale * kLog2e;

  for (int it = 0; it < ntiles; ++it) {
    const int64_t q0 = qfirst + int64_t(it % per_head) * kQTile;
    const int buf = it & 1;
    tile_ready(it, ntiles, issue);
    const bf16* Qc = Qs + buf * kTileElems;
    const bf16* Gc = Gs + buf * kTileElems;
    const float* Lc = Ls + buf * kQTile;
    const float* Ec = Es + buf * kQTile;
    // P^T (16 keys x 32 queries).
    float s[kQTile / 8][4];
    product_abt_s<D, kQTile>(s, Ks, warp * 16, Qc);
#pragma unroll
    for (int n = 0; n < kQTile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ic = n * 8 + 2 * t + (e & 1);
        const int64_t i = q0 + ic, j = kj[e >> 1];
        const float lse2 = Lc[ic];
        const bool seen = j < p.TK && i < p.TQ && (!p.causal || j <= i + shift) && lse2 == lse2;
        s[n][e] = seen ? exp2f(s[n][e] * sc - lse2) : 0.0f;
      }
    product_pm<D, kQTile>(dv, s, Gc);  // dV += P^T dO
    // dP^T (16 keys x 32 queries) = V dO^T, then dS^T = P^T (dP^T - delta).
    float dp[kQTile / 8][4];
    product_abt_s<D, kQTile>(dp, Vs, warp * 16, Gc);
#pragma unroll
    for (int n = 0; n < kQTile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - Ec[n * 8 + 2 * t + (e & 1)]);
    product_pm<D, kQTile>(dk, dp, Qc);  // dK += dS^T Q (times scale below)
    __syncthreads();
  }
  if (ntiles == 0) cp_async_wait<0>();
  const int64_t row0 = bkv * p.TK + k0 + warp * 16, valid = bkv * p.TK + p.TK;
  store_f32<D>(dv, p.dv, row0, valid, 1.0f);
  store_f32<D>(dk, p.dk, row0, valid, p.scale);
}

// dQ of 64 queries of one (batch, query head).
template <int D>
__global__ void __launch_bounds__(kThreads) attention_dq_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Gs = reinterpret_cast<bf16*>(smem + tile_bytes<D>(kRows));
  bf16* Ks = reinterpret_cast<bf16*>(smem + 2 * tile_bytes<D>(kRows));                             // 2 buffers
  bf16* Vs = reinterpret_cast<bf16*>(smem + 2 * tile_bytes<D>(kRows) + 2 * tile_bytes<D>(kTile));  // 2 buffers
  constexpr int kTileElems = kTile * kLd<D>;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t bh = blockIdx.y, b = bh / p.HQ, h = bh % p.HQ, kvh = h / (p.HQ / p.HKV);
  const int64_t q0 = int64_t(blockIdx.x) * kRows;
  const bool vec = aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.dout);
  const bf16* kbase = p.k.p + b * p.k.sb + kvh * p.k.sh;
  const bf16* vbase = p.v.p + b * p.v.sb + kvh * p.v.sh;
  const int64_t kend = visible_end(p, min(p.TQ, q0 + kRows) - 1);
  const int ntiles = int((kend + kTile - 1) / kTile);
  load_tile<D, kRows>(Qs, p.q.p + b * p.q.sb + h * p.q.sh + q0 * p.q.st, p.q.st, p.TQ - q0, vec);
  load_tile<D, kRows>(Gs, p.dout.p + b * p.dout.sb + h * p.dout.sh + q0 * p.dout.st, p.dout.st, p.TQ - q0, vec);
  auto issue = [&](int it) { load_kv_tile<D>(it, Ks, Vs, kbase, vbase, p, vec); };
  if (ntiles > 0) issue(0);
  cp_async_commit();

  const int64_t row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  int64_t vis[2];
  float lse2[2], delta[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    vis[rr] = visible_end(p, row[rr]);
    const bool in = row[rr] < p.TQ;
    lse2[rr] = in ? p.lse[bh * p.TQ + row[rr]] * kLog2e : NAN;
    delta[rr] = in ? p.delta[bh * p.TQ + row[rr]] : 0.0f;
    if (lse2[rr] != lse2[rr]) vis[rr] = 0;  // no visible key: no gradient
  }
  float dq[D / 8][4];
  zero(dq);
  uint32_t qf[D / 16][4];
  const float sc = p.scale * kLog2e;

  for (int it = 0; it < ntiles; ++it) {
    const int64_t k0 = int64_t(it) * kTile;
    const bf16* Kc = Ks + (it & 1) * kTileElems;
    const bf16* Vc = Vs + (it & 1) * kTileElems;
    float s[kTile / 8][4];
    tile_scores<D>(it, ntiles, issue, Qs, Kc, qf, s);
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = e >> 1;
        const int64_t j = k0 + n * 8 + 2 * t + (e & 1);
        s[n][e] = j < vis[rr] ? exp2f(s[n][e] * sc - lse2[rr]) : 0.0f;
      }
    float dp[kTile / 8][4];
    product_abt_s<D, kTile>(dp, Gs, warp * 16, Vc);  // dP = dO V^T
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - delta[e >> 1]);
    product_pm<D, kTile>(dq, dp, Kc);  // dQ += dS K
    __syncthreads();
  }
  if (ntiles == 0) cp_async_wait<0>();
  store_f32<D>(dq, p.dq, bh * p.TQ + q0 + warp * 16, bh * p.TQ + p.TQ, p.scale);
}

// ---- host side --------------------------------------------------------------

template <int D> constexpr size_t kFwdSmem = tile_bytes<D>(kRows) + 4 * tile_bytes<D>(kTile);
template <int D>
constexpr size_t kDkvSmem = 2 * tile_bytes<D>(kRows) + 4 * tile_bytes<D>(kQTile) + 4 * kQTile * sizeof(float);
template <int D> constexpr size_t kDqSmem = 2 * tile_bytes<D>(kRows) + 4 * tile_bytes<D>(kTile);

Operand operand(const Tensor& t) {
  return {static_cast<const bf16*>(t.data_ptr()), t.stride(0), t.stride(1), t.stride(2)};
}

// bf16 q, k, v on one CUDA device, last dims contiguous, head dim 32, 64 or
// 128, at least 16 queries (decode's few queries keep the composed op: a
// 64-row tile per head would leave most of the GPU idle), grid dims within
// CUDA's limits.
bool fused_supported(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.size(2) < 16) return false;
  for (const Tensor* t : {&q, &k, &v})
    if (t->dtype() != DType::bf16 || !t->device().is_cuda() || t->device() != q.device() || t->stride(3) != 1)
      return false;
  const int64_t D = q.size(3);
  if ((D != 32 && D != 64 && D != 128) || k.size(3) != D || v.size(3) != D) return false;
  if (q.size(0) * q.size(1) > 65535 || q.size(0) * k.size(1) > 65535) return false;
  return true;
}

Params params(const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool causal) {
  Params p{};
  p.q = operand(q);
  p.k = operand(k);
  p.v = operand(v);
  p.B = q.size(0), p.HQ = q.size(1), p.HKV = k.size(1), p.TQ = q.size(2), p.TK = k.size(2);
  p.scale = float(scale);
  p.causal = causal;
  return p;
}

// Opts a kernel into more than 48 KiB of dynamic shared memory, then launches it.
template <typename K>
void launch(K kernel, dim3 grid, size_t bytes, cudaStream_t stream, const Params& p, const char* name) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
             "cudaFuncSetAttribute", __FILE__, __LINE__);
  kernel<<<grid, kThreads, bytes, stream>>>(p);
  check_cuda(cudaGetLastError(), name, __FILE__, __LINE__);
}

template <int D>
void forward(const Params& p, cudaStream_t stream) {
  const dim3 grid(unsigned(ceil_div(p.TQ, kRows)), unsigned(p.B * p.HQ));
  launch(attention_fwd_kernel<D>, grid, kFwdSmem<D>, stream, p, "launch of attention_fwd_kernel");
}

template <int D>
void backward(const Params& p, cudaStream_t stream) {
  const int64_t rows = p.B * p.HQ * p.TQ;
  attention_delta_kernel<D><<<unsigned(ceil_div(rows, 8)), 256, 0, stream>>>(p);
  ARENO_LAUNCH_CHECK("attention_delta_kernel");
  const dim3 gkv(unsigned(ceil_div(p.TK, kRows)), unsigned(p.B * p.HKV));
  launch(attention_dkv_kernel<D>, gkv, kDkvSmem<D>, stream, p, "launch of attention_dkv_kernel");
  const dim3 gq(unsigned(ceil_div(p.TQ, kRows)), unsigned(p.B * p.HQ));
  launch(attention_dq_kernel<D>, gq, kDqSmem<D>, stream, p, "launch of attention_dq_kernel");
}

template <typename F>
void with_head_dim(int64_t d, F&& f) {
  if (d == 32) f(std::integral_constant<int, 32>{});
  else if (d == 64) f(std::integral_constant<int, 64>{});
  else f(std::integral_constant<int, 128>{});
}

// ARENO_CUDA_FUSED_ATTENTION=0 turns the kernels off (the composed op runs):
// read at every call, so one benchmark run can compare the two.
bool fused_enabled() {
  const char* e = std::getenv("ARENO_CUDA_FUSED_ATTENTION");
  return !(e && e[0] == '0');
}

}  // namespace
}  // namespace areno::cuda

namespace areno {

using namespace cuda;

bool CudaBackend::attention_train(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& lse, double scale, bool causal) {
  if (!fused_enabled() || !fused_supported(q, k, v)) return false;
  if (out.dtype() != DType::bf16 || !out.is_contiguous() || out.device() != q.device() ||
      lse.dtype() != DType::f32 || !lse.is_contiguous() || lse.numel() != q.size(0) * q.size(1) * q.size(2))
    return false;
  Params p = params(q, k, v, scale, causal);
  if (p.B * p.HQ * p.TQ == 0) return true;
  p.out_w = static_cast<bf16*>(out.data_ptr());
  p.lse = static_cast<float*>(lse.data_ptr());
  Launch l(q);
  with_head_dim(q.size(3), [&](auto d) { forward<decltype(d)::value>(p, l.stream); });
  return true;
}

bool CudaBackend::attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                     const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                     const Tensor& dv, double scale, bool causal) {
  if (!fused_enabled() || !fused_supported(q, k, v)) return false;
  for (const Tensor* t : {&dq, &dk, &dv})
    if (t->dtype() != DType::f32 || !t->is_contiguous()) return false;
  if (out.dtype() != DType::bf16 || !out.is_contiguous() || lse.dtype() != DType::f32 || !lse.is_contiguous())
    return false;
  Params p = params(q, k, v, scale, causal);
  if (p.B * p.HQ * p.TQ == 0) return true;  // fused_supported: TQ >= 16, so this is B * HQ == 0
  Launch l(q);
  // dO as bf16 with a contiguous last dim (the gradient usually is: a view of the next op's).
  Tensor g = dout;
  if (g.dtype() != DType::bf16 || g.stride(3) != 1) {
    g = device_empty(dout.shape(), DType::bf16, q.device().index);
    device_copy(dout, g, l.stream);
  }
  Tensor delta = device_empty({p.B * p.HQ * p.TQ}, DType::f32, q.device().index);
  p.dout = operand(g);
  p.out = static_cast<const bf16*>(out.data_ptr());
  p.lse = static_cast<float*>(lse.data_ptr());
  p.delta = static_cast<float*>(delta.data_ptr());
  p.dq = static_cast<float*>(dq.data_ptr());
  p.dk = static_cast<float*>(dk.data_ptr());
  p.dv = static_cast<float*>(dv.data_ptr());
  with_head_dim(q.size(3), [&](auto d) { backward<decltype(d)::value>(p, l.stream); });
  return true;
}

}  // namespace areno
