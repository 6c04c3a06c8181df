#pragma once
// What the CPU kernels share: the thread split, the strided loop and the
// compute types (as kernels/cuda/cuda_common.cuh for the CUDA kernels).
#include <omp.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace areno::cpu {

// Work below this many elements runs on one thread.
constexpr int64_t kParallelGrain = 32768;

inline int num_threads() { return omp_get_max_threads(); }

// FLOPs (2 per multiply-add) the matmul and fused attention kernels ran since
// the process started, all threads: benchmarks read it before and after a
// stage for its FLOP rate (bench/model/bench_ttft). One relaxed add per call.
inline std::atomic<uint64_t>& flops_counted() {
  static std::atomic<uint64_t> n{0};
  return n;
}
inline void count_flops(double f) { flops_counted().fetch_add(uint64_t(f), std::memory_order_relaxed); }

// Per-thread scratch that only grows, 64-byte aligned, one block per slot:
// GEMM kernels need their packed operands and partial sums on every call,
// and fresh blocks of a few MB each call cost page faults and zeroing (glibc
// maps them anew). A pointer stays valid until the same thread asks for the
// same slot again.
enum class ScratchSlot {
  amx_packed_x, amx_weight_chunk, amx_c_tiles, packed_x, packed_b, packed_c, attn_scores, attn_probs, attn_rows, count
};
template <typename T>
T* thread_scratch(ScratchSlot which, int64_t n) {
  struct Block {
    void* p = nullptr;
    size_t size = 0;
    ~Block() { std::free(p); }
  };
  thread_local Block blocks[int(ScratchSlot::count)];
  Block& b = blocks[int(which)];
  const size_t want = size_t((n * int64_t(sizeof(T)) + 63) / 64 * 64);
  if (b.size < want) {
    std::free(b.p);
    b.p = std::aligned_alloc(64, want);
    if (b.p == nullptr) throw std::bad_alloc();
    b.size = want;
  }
  return static_cast<T*>(b.p);
}

// Splits [0, n) into one range per thread (or one range for small n) and
// calls f(begin, end) on each, in parallel.
template <typename F>
void parallel_for(int64_t n, int64_t cost_per_item, F&& f) {
  int64_t work = n * std::max<int64_t>(cost_per_item, 1);
  int nt = num_threads();
  if (work < kParallelGrain || nt <= 1 || n <= 1) {
    if (n > 0) f(int64_t(0), n);
    return;
  }
  int parts = int(std::min<int64_t>(nt, n));
#pragma omp parallel for num_threads(parts) schedule(static)
  for (int p = 0; p < parts; ++p) {
    int64_t b = n * p / parts, e = n * (p + 1) / parts;
    if (b < e) f(b, e);
  }
}

// Iterates over a shape with N operands of possibly different strides,
// calling inner(ptrs, byte_strides, count) on runs along the last coalesced dim.
template <size_t N, typename F>
void strided_loop(const Shape& shape, const std::array<const Tensor*, N>& ts, F&& inner) {
  std::vector<int64_t> sz;
  std::vector<std::array<int64_t, N>> st;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    std::array<int64_t, N> s;
    for (size_t k = 0; k < N; ++k) s[k] = ts[k]->strides()[d] * int64_t(ts[k]->element_size());
    sz.push_back(shape[d]);
    st.push_back(s);
  }
  // Merge dim i into i+1 when contiguous for every operand.
  for (int64_t i = int64_t(sz.size()) - 2; i >= 0; --i) {
    bool ok = true;
    for (size_t k = 0; k < N; ++k) ok = ok && st[i][k] == st[i + 1][k] * sz[i + 1];
    if (ok) {
      sz[i + 1] *= sz[i];
      sz.erase(sz.begin() + i);
      st.erase(st.begin() + i);
    }
  }
  if (sz.empty()) {
    sz.push_back(1);
    st.push_back({});
  }
  int64_t nd = int64_t(sz.size());
  int64_t inner_n = sz.back();
  int64_t total = 1;
  for (auto s : sz) total *= s;
  std::array<char*, N> base;
  for (size_t k = 0; k < N; ++k) base[k] = static_cast<char*>(ts[k]->data_ptr());
  std::array<int64_t, N> inner_st = st.back();

  parallel_for(total, 1, [&](int64_t lo, int64_t hi) {
    int64_t pos = lo;
    std::vector<int64_t> idx(nd, 0);
    int64_t o = lo / inner_n, i = lo % inner_n;
    for (int64_t d = nd - 2; d >= 0; --d) {
      idx[d] = o % sz[d];
      o /= sz[d];
    }
    while (pos < hi) {
      std::array<char*, N> p;
      for (size_t k = 0; k < N; ++k) {
        int64_t off = i * inner_st[k];
        for (int64_t d = 0; d < nd - 1; ++d) off += idx[d] * st[d][k];
        p[k] = base[k] + off;
      }
      int64_t run = std::min(inner_n - i, hi - pos);
      inner(p, inner_st, run);
      pos += run;
      i = 0;
      for (int64_t d = nd - 2; d >= 0; --d) {
        if (++idx[d] < sz[d]) break;
        idx[d] = 0;
      }
    }
  });
}

// Calls f with a value of the storage type of a floating dtype (f32, f64,
// bf16, f16); other dtypes throw "<op> needs a floating-point tensor".
template <typename F>
void for_float_dtype(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(BFloat16{});
    case DType::f16: return f(Half{});
    default: throw std::invalid_argument(std::string(op) + " needs a floating-point tensor");
  }
}

// Converts between storage type T and its compute type.
template <typename T> struct compute_of { using type = T; };
template <> struct compute_of<BFloat16> { using type = float; };
template <> struct compute_of<Half> { using type = float; };
template <> struct compute_of<int32_t> { using type = int64_t; };
template <typename T> using compute_t = typename compute_of<T>::type;

// Row data as f32 (or f64) scratch: used by row kernels for 16-bit inputs.
template <typename T, typename C>
inline void load_row(const T* src, C* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = C(float(src[i]));
}
template <typename C>
inline void load_row(const double* src, C* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = C(src[i]);
}
template <typename T, typename C>
inline void store_row(const C* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = T(src[i]);
}

}  // namespace areno::cpu
