// Batched GEMM on Eigen (and the int8-weight linear at the end). 16-bit operands are widened to f32 per matrix.
// GCC 12 reports false "(may be) used uninitialized" inside its AVX-512
// intrinsics once Eigen's packet code is inlined here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/Core>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"
#include "kernels/cpu/gemm_dnnl.h"
#include "kernels/cpu/gemm_packed.h"
#include "kernels/cpu/gemm_skinny.h"

namespace areno::cpu {

namespace {

template <typename C>
using RowMat = Eigen::Matrix<C, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename C>
using ColMat = Eigen::Matrix<C, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

// One [r, c] operand: pointer, row-major or not, outer stride.
struct MatRef {
  int64_t r, c, outer;
  bool row_major;
};

MatRef describe(const Tensor& t) {
  MatRef m{t.size(1), t.size(2), 0, true};
  if (t.stride(2) == 1 || m.c == 1) {
    m.row_major = true;
    m.outer = m.r == 1 ? m.c : t.stride(1);
  } else {
    m.row_major = false;
    m.outer = m.c == 1 ? m.r : t.stride(2);
  }
  m.outer = std::max<int64_t>(m.outer, 1);
  return m;
}

template <typename C, typename F>
void with_map(const C* p, const MatRef& m, F&& f) {
  using Outer = Eigen::OuterStride<>;
  if (m.row_major)
    f(Eigen::Map<const RowMat<C>, 0, Outer>(p, m.r, m.c, Outer(m.outer)));
  else
    f(Eigen::Map<const ColMat<C>, 0, Outer>(p, m.r, m.c, Outer(m.outer)));
}

// out [ma.r, mb.c] row-major with row stride `ldo` (0: mb.c).
template <typename C>
void gemm_one(const C* a, const MatRef& ma, const C* b, const MatRef& mb, C* out, C alpha, C beta, int64_t ldo = 0) {
  Eigen::Map<RowMat<C>, 0, Eigen::OuterStride<>> o(out, ma.r, mb.c, Eigen::OuterStride<>(ldo > 0 ? ldo : mb.c));
  with_map(a, ma, [&](const auto& A) {
    with_map(b, mb, [&](const auto& B) {
      if (beta == C(0)) {
        o.noalias() = alpha * (A * B);
      } else {
        o *= beta;
        o.noalias() += alpha * (A * B);
      }
    });
  });
}

// Widens a 16-bit [r, c] matrix with the given layout to a dense row-major f32 buffer.
template <typename T>
void widen(const T* p, const MatRef& m, std::vector<float>& buf) {
  buf.resize(size_t(m.r * m.c));
  for (int64_t i = 0; i < m.r; ++i)
    for (int64_t j = 0; j < m.c; ++j)
      buf[size_t(i * m.c + j)] = float(m.row_major ? p[i * m.outer + j] : p[j * m.outer + i]);
}

// A few rows of `a` times column-major `b` (the decode shape: activations
// times a transposed weight): dot products straight from b's columns, without
// widening (16-bit) or repacking (Eigen) all of b.
template <typename T>
void gemm_small_m(const T* a, const MatRef& ma, const T* b, const MatRef& mb, T* out, float alpha, float beta) {
  int64_t M = ma.r, K = ma.c, N = mb.c;
  std::vector<float> wa;
  widen(a, ma, wa);
  parallel_for(N, M * K, [&](int64_t lo, int64_t hi) {
    constexpr int L = 16;
    for (int64_t n = lo; n < hi; ++n) {
      const T* col = b + n * mb.outer;
      for (int64_t m = 0; m < M; ++m) {
        const float* ar = wa.data() + m * K;
        float acc[L] = {};
        int64_t k = 0;
        for (; k + L <= K; k += L)
          for (int j = 0; j < L; ++j) acc[j] += ar[k + j] * float(col[k + j]);
        float sum = 0;
        for (int j = 0; j < L; ++j) sum += acc[j];
        for (; k < K; ++k) sum += ar[k] * float(col[k]);
        T& o = out[m * N + n];
        o = T(beta == 0.0f ? alpha * sum : alpha * sum + beta * float(o));
      }
    }
  });
}

// A few rows of `a` (at most skinny_row_limit) times column-major `b` (a
// weight [N, K] stored row-major, seen transposed): gemm_skinny reads b in
// place in its dtype. a is used in place when it is row-major (unit column
// stride); bf16 a goes to gemm_skinny_bf16 as bf16.
template <typename T>
void skinny(const T* a, const MatRef& ma, const T* b, const MatRef& mb, T* out, float alpha, float beta) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    // bf16 times bf16: native bf16 dot products where the CPU has them.
    std::vector<BFloat16> ca;
    const BFloat16* x = a;
    int64_t ldx = ma.outer;
    if (!ma.row_major) {
      ca.resize(size_t(ma.r * ma.c));
      for (int64_t i = 0; i < ma.r; ++i)
        for (int64_t k = 0; k < ma.c; ++k) ca[size_t(i * ma.c + k)] = a[k * ma.outer + i];
      x = ca.data(), ldx = ma.c;
    }
    gemm_skinny_bf16<T>(ma.r, mb.c, ma.c, x, ldx, b, mb.outer, out, mb.c, alpha, beta);
    return;
  }
  std::vector<float> wa;
  const float* x = nullptr;
  int64_t ldx = ma.c;
  if constexpr (std::is_same_v<T, float>) {
    if (ma.row_major) x = a, ldx = ma.outer;
  }
  if (x == nullptr) {
    widen(a, ma, wa);
    x = wa.data();
  }
  gemm_skinny<T, T>(ma.r, mb.c, ma.c, x, ldx, b, mb.outer, out, mb.c, alpha, beta);
}

// Whether a product past the skinny rows (any layout of x, the right
// operand a transposed weight or stored [K, N]) runs on gemm_packed_avx2:
// bf16 where neither AMX nor oneDNN runs (oneDNN is off by default without
// AMX, gemm_dnnl.h), f32 where this build's Eigen has no AVX-512 kernels (an
// AVX2 machine, or -Dnative=false). On Zen 3, 2 threads, 512 rows of
// `small`'s shapes: f32 140-173 GFLOP/s against Eigen's 82-110; bf16 135-168
// against 45-92 widening both operands per call; on a Xeon with AVX512-BF16
// and no AMX, with the kernel's AVX-512 micro-kernel, bf16 242-280 against
// oneDNN's 163-171 (docs/perf.md).
bool packed_level(DType dt) {
  const CpuIsa isa = cpu_isa();
  if (isa < CpuIsa::avx2) return false;
  if (dt == DType::bf16) return isa < CpuIsa::amx && !dnnl_enabled();
#ifdef __AVX512F__
  return false;
#else
  return dt == DType::f32;
#endif
}

// Rows from which gemm_packed_avx2 beats gemm_skinny (which reads the weight
// in place, where the packed kernel copies it once per call): on Zen 3 the
// 200064-row head at 16 rows ran 90-98 GFLOP/s skinny against 80-90 packed,
// at 24 rows 79-96 against 96-101, a 1536 x 256 layer at 16 rows 76-79
// against 106-137. With the AVX-512 micro-kernel (bf16 on a Xeon without
// AMX, `small` decode steps of B rows, tokens/s skinny / packed): B = 10
// 808 / 570, 12 817 / 776, 16 806 / 884, 32 866 / 1160.
int64_t packed_min_rows() { return cpu_isa() >= CpuIsa::avx512 ? 14 : 17; }

// Rows up to which a bf16 (or any) product with a transposed weight goes to
// gemm_skinny: kAmxMaxRows for bf16 at the amx level (gemm_amx_bf16),
// packed_min_rows() - 1 where the packed kernel takes over.
int64_t skinny_row_limit(DType dt) {
  if (dt == DType::bf16 && cpu_isa() >= CpuIsa::amx) return kAmxMaxRows;
  return packed_level(dt) ? packed_min_rows() - 1 : kSkinnyMaxRows;
}

// bf16 rows in blocks of kRowBlock rows: at the amx level with a transposed
// weight and row-major x every block runs on gemm_amx_bf16 (the weight read
// in place, no repacking: `full`'s gate_up from DRAM at 133 rows 6.9 ms
// against oneDNN's 9.3-10.7, at 256 rows 11.6 against 13.5; docs/perf.md),
// otherwise on oneDNN, whose own blocking of the whole M ran slower on row
// counts that are not a multiple of its tiles (gate_up at 1848 rows: 1179
// GFLOP/s, at 2048: 1798, at 256: 1840). beta (0 or 1) adds out, and
// bias[N] (when not null; beta 0) the bias, to the f32 sums before the
// rounding. Below AVX-512 (no AMX, and oneDNN refuses bf16) the whole M
// runs on gemm_packed_avx2 instead. False (nothing written) when none of them
// runs. (Column chunks
// of the weight sized to stay in L3 across the row blocks were tried, and
// ran slower.)
constexpr int64_t kRowBlock = 256;

bool bf16_row_blocks(int64_t M, int64_t N, const BFloat16* a, const MatRef& ma, const BFloat16* b, const MatRef& mb,
                     BFloat16* out, float beta, const BFloat16* bias = nullptr) {
  const int64_t K = ma.c;
  const int64_t a_rs = ma.row_major ? ma.outer : 1, a_cs = ma.row_major ? 1 : ma.outer;
  const int64_t b_rs = mb.row_major ? mb.outer : 1, b_cs = mb.row_major ? 1 : mb.outer;
  const bool amx = !mb.row_major && ma.row_major && cpu_isa() >= CpuIsa::amx;
  if (packed_level(DType::bf16)) {
    // Neither AMX nor oneDNN's bf16 runs here (AVX2-only CPUs): the packed
    // AVX2 kernel, the right operand widened a cache-sized block at a time.
    gemm_packed_avx2<BFloat16, BFloat16, BFloat16>(M, N, K, a, a_rs, a_cs, b, mb.outer, out, N, 1.0f, beta, bias,
                                                   mb.row_major);
    return true;
  }
  for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - r0);
    BFloat16* o = out + r0 * N;
    if (amx) {
      // (the bias joins the f32 sums in the write-out, as out does with beta = 1)
      gemm_amx_bf16<BFloat16>(rows, N, K, a + r0 * a_rs, ma.outer, b, mb.outer, o, N, 1.0f, beta, bias);
      continue;
    }
    if (!dnnl_gemm_bf16(rows, N, K, a + r0 * a_rs, a_rs, a_cs, b, b_rs, b_cs, o, N, beta, bias)) {
      if (r0 == 0) return false;
      // The first block ran with the same strides: a later one failing is oneDNN's fault.
      throw std::runtime_error("matmul: oneDNN refused a row block it had run before");
    }
  }
  return true;
}

}  // namespace

// bf16 operands, f32 out (the loss's head-weight gradient in bf16 training):
// oneDNN's native bf16 products, out = alpha a b + beta out from the
// unrounded f32 sums, where it runs (dnnl_enabled: AMX CPUs by default);
// otherwise false and the caller widens both operands to f32.
bool CpuBackend::matmul_f32_out(const Tensor& a, const Tensor& b, const Tensor& out, double alpha, double beta) {
  if (out.dtype() != DType::f32 || a.dtype() != DType::bf16 || b.dtype() != DType::bf16 || !dnnl_enabled())
    return false;
  if (a.dim() != 3 || b.dim() != 3 || out.dim() != 3 || !out.is_contiguous() || a.size(0) != out.size(0) ||
      b.size(0) != out.size(0) || a.size(1) != out.size(1) || b.size(2) != out.size(2) || a.size(2) != b.size(1))
    throw std::invalid_argument("cpu matmul_f32_out: shapes " + a.str() + " @ " + b.str() + " -> " + out.str() +
                                " do not agree");
  const int64_t batch = out.size(0), M = out.size(1), N = out.size(2), K = a.size(2);
  if (M == 0 || N == 0 || K == 0) return false;
  const BFloat16* ap = static_cast<const BFloat16*>(a.data_ptr());
  const BFloat16* bp = static_cast<const BFloat16*>(b.data_ptr());
  float* op = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < batch; ++i) {
    if (dnnl_gemm_bf16(M, N, K, ap + i * a.stride(0), a.stride(1), a.stride(2), bp + i * b.stride(0), b.stride(1),
                       b.stride(2), op + i * M * N, N, float(beta), float(alpha)))
      continue;
    if (i == 0) return false;  // nothing written: the caller's path runs
    throw std::runtime_error("cpu matmul_f32_out: oneDNN refused a later product of the same shapes");
  }
  count_flops(2.0 * double(batch) * double(M) * double(N) * double(K));
  return true;
}

void CpuBackend::matmul(const Tensor& a, const Tensor& b, const Tensor& out, double alpha,
                        double beta) {
  int64_t batch = out.size(0), M = out.size(1), N = out.size(2);
  count_flops(2.0 * double(batch) * double(M) * double(N) * double(a.size(2)));
  MatRef ma = describe(a), mb = describe(b);
  // A few rows times a weight stored [N, K] (b seen transposed): gemm_skinny's shape.
  const bool skinny_shape = !mb.row_major && M <= skinny_row_limit(out.dtype());
  // f32 past the skinny rows on gemm_packed_avx2 (bf16 gets there through bf16_row_blocks).
  const bool packed_f32 =
      out.dtype() == DType::f32 && !skinny_shape && M >= packed_min_rows() && packed_level(DType::f32);
  int64_t sa = a.stride(0), sb = b.stride(0);
  auto dispatch = [&](auto tag) {
    using T = decltype(tag);
    const T* ap = static_cast<const T*>(a.data_ptr());
    const T* bp = static_cast<const T*>(b.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    auto one = [&](int64_t i) {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, BFloat16>) {
        // Decode shape (a few rows times a transposed weight): the weight read
        // in place, where Eigen would repack (and 16-bit paths widen) all of b per call.
        if (skinny_shape) {
          skinny<T>(ap + i * sa, ma, bp + i * sb, mb, op + i * M * N, float(alpha), float(beta));
          return;
        }
      }
      if constexpr (std::is_same_v<T, float>) {
        if (packed_f32) {
          gemm_packed_avx2<float, float, float>(M, N, ma.c, ap + i * sa, ma.row_major ? ma.outer : 1,
                                                ma.row_major ? 1 : ma.outer, bp + i * sb, mb.outer, op + i * M * N,
                                                N, float(alpha), float(beta), nullptr, mb.row_major);
          return;
        }
      }
      if constexpr (std::is_same_v<T, BFloat16>) {
        // Native bf16 products (AMX / AVX512-BF16) instead of widening both operands.
        if (alpha == 1.0 && (beta == 0.0 || beta == 1.0) &&
            bf16_row_blocks(M, N, ap + i * sa, ma, bp + i * sb, mb, op + i * M * N, float(beta)))
          return;
      }
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        gemm_one<T>(ap + i * sa, ma, bp + i * sb, mb, op + i * M * N, T(alpha), T(beta));
      } else if (M <= 16 && !mb.row_major) {  // f16 weights (no skinny kernel for them yet)
        gemm_small_m<T>(ap + i * sa, ma, bp + i * sb, mb, op + i * M * N, float(alpha), float(beta));
      } else {
        std::vector<float> wa, wb, wo(size_t(M * N));
        widen(ap + i * sa, ma, wa);
        widen(bp + i * sb, mb, wb);
        MatRef ra{ma.r, ma.c, ma.c, true}, rb{mb.r, mb.c, mb.c, true};
        T* o = op + i * M * N;
        if (beta != 0)
          for (int64_t j = 0; j < M * N; ++j) wo[size_t(j)] = float(o[j]);
        gemm_one<float>(wa.data(), ra, wb.data(), rb, wo.data(), float(alpha), float(beta));
        for (int64_t j = 0; j < M * N; ++j) o[j] = T(wo[size_t(j)]);
      }
    };
    if (batch == 1 && (skinny_shape || packed_f32)) {
      one(0);  // the skinny and packed kernels split the weight rows across threads themselves
    } else if (batch == 1) {
      // Split the rows of one large GEMM across threads, each running Eigen
      // single-threaded on its block: faster than Eigen's own parallel GEMM here.
      int64_t parts = std::min<int64_t>(num_threads(), M / 64);
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        if (parts > 1 && M * N * a.size(2) >= (int64_t(1) << 21)) {
#pragma omp parallel for num_threads(int(parts)) schedule(static)
          for (int64_t p = 0; p < parts; ++p) {
            int64_t r0 = M * p / parts, r1 = M * (p + 1) / parts;
            MatRef sub = ma;
            sub.r = r1 - r0;
            const T* a0 = ap + r0 * (ma.row_major ? ma.outer : 1);
            gemm_one<T>(a0, sub, bp, mb, op + r0 * N, T(alpha), T(beta));
          }
          return;
        }
        // Few rows, many columns with b not a transposed weight (the skinny
        // kernel takes those above): split the columns, each thread packing
        // only its part of b.
        const int64_t threads = num_threads();
        if (parts < 2 && threads > 1 && N >= 1024 * threads && M * N * a.size(2) >= (int64_t(1) << 21)) {
#pragma omp parallel for num_threads(int(threads)) schedule(static)
          for (int64_t p = 0; p < threads; ++p) {
            int64_t c0 = N * p / threads, c1 = N * (p + 1) / threads;
            MatRef sub = mb;
            sub.c = c1 - c0;
            const T* b0 = bp + c0 * (mb.row_major ? 1 : mb.outer);
            gemm_one<T>(ap, ma, b0, sub, op + c0, T(alpha), T(beta), N);
          }
          return;
        }
      }
      one(0);
    } else {
      parallel_for(batch, M * N * a.size(2), [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) one(i);
      });
    }
  };
  switch (out.dtype()) {
    case DType::f32: return dispatch(float{});
    case DType::f64: return dispatch(double{});
    case DType::bf16: return dispatch(BFloat16{});
    case DType::f16: return dispatch(Half{});
    default: throw std::invalid_argument("matmul needs floating-point tensors");
  }
}

// bf16 linear with its bias in one rounding: rows up to the skinny limit
// through gemm_skinny_bf16 on an output filled with the bias (beta = 1: the
// bias joins the f32 sum before the rounding), more rows through
// bf16_row_blocks with oneDNN's bias argument.
bool CpuBackend::linear_bias(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out) {
  if (x.dtype() != DType::bf16 || w.dtype() != DType::bf16 || bias.dtype() != DType::bf16 ||
      out.dtype() != DType::bf16 || !x.is_contiguous() || !w.is_contiguous() || !bias.is_contiguous() ||
      !out.is_contiguous())
    return false;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  count_flops(2.0 * double(M) * double(N) * double(K));
  const BFloat16* xp = static_cast<const BFloat16*>(x.data_ptr());
  const BFloat16* wp = static_cast<const BFloat16*>(w.data_ptr());
  const BFloat16* bp = static_cast<const BFloat16*>(bias.data_ptr());
  BFloat16* op = static_cast<BFloat16*>(out.data_ptr());
  if (M <= skinny_row_limit(DType::bf16)) {
    for (int64_t m = 0; m < M; ++m) std::copy(bp, bp + N, op + m * N);
    gemm_skinny_bf16<BFloat16>(M, N, K, xp, K, wp, K, op, N, 1.0f, 1.0f);
    return true;
  }
  // x [M, K] row-major; the weight seen as [K, N] column-major.
  return bf16_row_blocks(M, N, xp, MatRef{M, K, K, true}, wp, MatRef{K, N, K, false}, op, 0.0f, bp);
}

// Two bf16 weights on one x at the amx level past the in-place rows, in the
// row blocks bf16_row_blocks takes (gemm_amx_bf16_pair: the bits of two
// matmul calls, whose bf16 products past the skinny rows run on the same
// kernel). A last block of at most kAmxInPlaceRows rows takes two calls.
bool CpuBackend::linear_pair(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& out1,
                             const Tensor& out2) {
  const int64_t M = x.size(0), K = x.size(1), N1 = w1.size(0), N2 = w2.size(0);
  if (x.dtype() != DType::bf16 || cpu_isa() < CpuIsa::amx || M <= kAmxInPlaceRows) return false;
  count_flops(2.0 * double(M) * double(N1 + N2) * double(K));
  const BFloat16* xp = static_cast<const BFloat16*>(x.data_ptr());
  const BFloat16* w1p = static_cast<const BFloat16*>(w1.data_ptr());
  const BFloat16* w2p = static_cast<const BFloat16*>(w2.data_ptr());
  BFloat16* o1 = static_cast<BFloat16*>(out1.data_ptr());
  BFloat16* o2 = static_cast<BFloat16*>(out2.data_ptr());
  for (int64_t r0 = 0; r0 < M; r0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - r0);
    if (gemm_amx_bf16_pair(rows, N1, K, xp + r0 * K, K, w1p, K, o1 + r0 * N1, N1, w2p, K, N2, o2 + r0 * N2, N2))
      continue;
    gemm_amx_bf16<BFloat16>(rows, N1, K, xp + r0 * K, K, w1p, K, o1 + r0 * N1, N1, 1.0f, 0.0f);
    gemm_amx_bf16<BFloat16>(rows, N2, K, xp + r0 * K, K, w2p, K, o2 + r0 * N2, N2, 1.0f, 0.0f);
  }
  return true;
}

}  // namespace areno::cpu

// ---- weight-only int8 (tensor/quantized.h) ----

namespace areno::cpu {

namespace {

// Rows [n0, n0 + count) of an int8 weight as T: scales[n] * w[n, k] (rounded once for bf16).
template <typename T>
void dequantize_rows(const int8_t* w, const float* scales, int64_t K, int64_t n0, int64_t count, T* buf) {
  for (int64_t r = 0; r < count; ++r) {
    const int8_t* src = w + (n0 + r) * K;
    const float s = scales[n0 + r];
    T* dst = buf + r * K;
    for (int64_t k = 0; k < K; ++k) dst[k] = T(s * float(src[k]));
  }
}

// Weight rows per dequantized block: about `bytes` of T, a multiple of 16, at least 16.
int64_t block_rows(int64_t K, size_t elem, size_t bytes) {
  return std::max<int64_t>(16, int64_t(bytes / (elem * size_t(K))) / 16 * 16);
}

// More than kSkinnyMaxRows rows in f32 (bf16 activations widened, output
// rounded per block): each thread dequantizes blocks of its own weight rows
// into a buffer of its own and multiplies all rows of x by them (Eigen, one
// thread each), writing its columns of out.
template <typename O>
void int8_prefill_f32(int64_t M, int64_t N, int64_t K, const float* x, const int8_t* w, const float* scales, O* out) {
  const int64_t threads = num_threads();
  int64_t nb = block_rows(K, sizeof(float), size_t(1) << 20);
  nb = std::min(nb, ((N + threads - 1) / threads + 15) / 16 * 16);  // every thread gets blocks
  const int64_t blocks = (N + nb - 1) / nb;
  parallel_for(blocks, M * K * nb, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(size_t(nb * K)), ob;
    if constexpr (!std::is_same_v<O, float>) ob.resize(size_t(M * nb));
    const MatRef ma{M, K, K, true};
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * nb, count = std::min(nb, N - n0);
      dequantize_rows(w, scales, K, n0, count, buf.data());
      const MatRef mb{K, count, K, false};  // the block [count, K] seen as [K, count]
      if constexpr (std::is_same_v<O, float>) {
        gemm_one<float>(x, ma, buf.data(), mb, out + n0, 1.0f, 0.0f, N);
      } else {
        gemm_one<float>(x, ma, buf.data(), mb, ob.data(), 1.0f, 0.0f, count);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t j = 0; j < count; ++j) out[m * N + n0 + j] = O(ob[size_t(m * count + j)]);
      }
    }
  });
}

// bf16 with more than kSkinnyMaxRows rows through oneDNN: blocks of weight
// rows dequantized to bf16 (all threads), then oneDNN's native bf16 GEMM on
// each (all threads). False when oneDNN ran nothing (off, or refused).
bool int8_prefill_dnnl(int64_t M, int64_t N, int64_t K, const BFloat16* x, const int8_t* w, const float* scales,
                       BFloat16* out) {
  if (!dnnl_enabled()) return false;
  const int64_t nb = std::min(N, block_rows(K, sizeof(BFloat16), size_t(8) << 20));
  std::vector<BFloat16> buf(size_t(nb * K));
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t count = std::min(nb, N - n0);
    parallel_for(count, K, [&](int64_t lo, int64_t hi) {
      dequantize_rows(w, scales, K, n0 + lo, hi - lo, buf.data() + lo * K);
    });
    if (!dnnl_gemm_bf16(M, count, K, x, K, 1, buf.data(), 1, K, out + n0, N)) {
      if (n0 == 0) return false;
      throw std::runtime_error("linear (int8): oneDNN refused a block after accepting the first");
    }
  }
  return true;
}

}  // namespace

bool CpuBackend::linear_int8(const Tensor& x, const int8_t* w, const float* scales, const Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const DType dt = x.dtype();
  if ((dt != DType::f32 && dt != DType::bf16) || out.dtype() != dt) return false;
  if (dt == DType::bf16 && M > kSkinnyMaxRows &&
      int8_prefill_dnnl(M, N, K, static_cast<const BFloat16*>(x.data_ptr()), w, scales,
                        static_cast<BFloat16*>(out.data_ptr())))
    return true;
  // Where f32 products run on gemm_packed_avx2 (AVX2 machines), int8 ones
  // from the same rows do too: the int8 values widened in its packing, each
  // finished sum times its row's scale (gemm_skinny_int8's formula), x read
  // as it is (bf16 widened by the kernel). On Zen 3, `small` from bf16 at 32
  // decode rows 542-553 -> 848-943 tokens/s against gemm_skinny_int8, and
  // the 512-row GEMMs 84 -> 110-170 GFLOP/s against dequantized blocks on
  // Eigen (docs/perf.md).
  if (M >= packed_min_rows() && packed_level(DType::f32)) {
    if (dt == DType::f32)
      gemm_packed_avx2<float, int8_t, float>(M, N, K, static_cast<const float*>(x.data_ptr()), K, 1, w, K,
                                             static_cast<float*>(out.data_ptr()), N, 1.0f, 0.0f, nullptr, false,
                                             scales);
    else
      gemm_packed_avx2<BFloat16, int8_t, BFloat16>(M, N, K, static_cast<const BFloat16*>(x.data_ptr()), K, 1, w, K,
                                                   static_cast<BFloat16*>(out.data_ptr()), N, 1.0f, 0.0f, nullptr,
                                                   false, scales);
    return true;
  }
  // Activations as f32 rows (bf16 ones widened once: M x K, against N x K weights).
  std::vector<float> widened;
  const float* xf = static_cast<const float*>(x.data_ptr());
  if (dt == DType::bf16) {
    widen(static_cast<const BFloat16*>(x.data_ptr()), MatRef{M, K, K, true}, widened);
    xf = widened.data();
  }
  auto run = [&](auto* o) {
    using O = std::remove_pointer_t<decltype(o)>;
    if (M <= kSkinnyMaxRows) gemm_skinny_int8<O>(M, N, K, xf, K, w, K, scales, o, N, 1.0f, 0.0f);
    else int8_prefill_f32<O>(M, N, K, xf, w, scales, o);
  };
  if (dt == DType::f32) run(static_cast<float*>(out.data_ptr()));
  else run(static_cast<BFloat16*>(out.data_ptr()));
  return true;
}

}  // namespace areno::cpu
