// Batched GEMM through cuBLASLt (f32, bf16, f16 with f32 accumulation) and
// cuBLAS (f64, and the fallback when cuBLASLt offers no algorithm).
//
// cuBLAS is column-major; our out [B, M, N] is row-major, which is the
// column-major N x M matrix out^T = b^T a^T. So cuBLAS's "A" is our b and its
// "B" is our a, and a row-major operand is a column-major one transposed.
#include <cstdio>
#include <numeric>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/elementwise.cuh"

namespace areno::cuda {
namespace {

// One operand [B, R, C] as cuBLAS sees it.
struct Operand {
  const void* data = nullptr;
  Tensor keep;             // a contiguous copy when the layout was not BLAS-compatible
  cublasOperation_t op = CUBLAS_OP_N;
  int64_t rows = 0, cols = 0;  // of the column-major stored matrix
  int64_t ld = 0;
  int64_t batch_stride = 0;
};

// The column-major view of a [B, R, C] operand whose cuBLAS role needs the
// transposed shape C x R: row-major storage is C x R column-major (no transpose).
Operand as_cublas(const Tensor& t, cudaStream_t stream) {
  int64_t R = t.size(1), C = t.size(2);
  int64_t sr = t.stride(1), sc = t.stride(2);
  Operand o;
  o.batch_stride = t.size(0) == 1 ? 0 : t.stride(0);
  if (sc == 1 && (R == 1 || sr >= std::max<int64_t>(C, 1))) {  // row-major
    o.op = CUBLAS_OP_N;
    o.rows = C;
    o.cols = R;
    o.ld = R == 1 ? std::max<int64_t>(C, 1) : sr;
    o.data = t.data_ptr();
    return o;
  }
  if (sr == 1 && (C == 1 || sc >= std::max<int64_t>(R, 1))) {  // column-major
    o.op = CUBLAS_OP_T;
    o.rows = R;
    o.cols = C;
    o.ld = C == 1 ? std::max<int64_t>(R, 1) : sc;
    o.data = t.data_ptr();
    return o;
  }
  // Outside the contract (e.g. a strided slice): pack it.
  o.keep = device_empty(t.shape(), t.dtype(), t.device().index);
  device_copy(t, o.keep, stream);
  o.op = CUBLAS_OP_N;
  o.rows = C;
  o.cols = R;
  o.ld = std::max<int64_t>(C, 1);
  o.batch_stride = t.size(0) == 1 ? 0 : R * C;
  o.data = o.keep.data_ptr();
  return o;
}

// Largest power of two (<= 256) dividing the address and every stride in bytes:
// cuBLASLt picks vectorised kernels only when told the operands allow them.
uint32_t alignment(const void* p, std::initializer_list<int64_t> strides_bytes) {
  uint64_t a = reinterpret_cast<uint64_t>(p) | 256;
  for (int64_t s : strides_bytes)
    if (s != 0) a |= uint64_t(s);
  return uint32_t(a & (~a + 1));
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::f64: return CUDA_R_64F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: break;
  }
  throw std::invalid_argument("cuda matmul: unsupported dtype " + std::string(dtype_name(t)) +
                              " (expected f32, f64, bf16 or f16)");
}

int to_int(int64_t v, const char* what) {
  if (v > std::numeric_limits<int>::max())
    throw std::invalid_argument(std::string("cuda matmul: ") + what + " = " + std::to_string(v) +
                                " exceeds cuBLAS's 32-bit limit");
  return int(v);
}

struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDescs() {
    if (pref) cublas_lib().LtMatmulPreferenceDestroy(pref);
    if (c) cublas_lib().LtMatrixLayoutDestroy(c);
    if (b) cublas_lib().LtMatrixLayoutDestroy(b);
    if (a) cublas_lib().LtMatrixLayoutDestroy(a);
    if (op) cublas_lib().LtMatmulDescDestroy(op);
  }
};

cublasLtMatrixLayout_t make_layout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld,
                                   int batch, int64_t batch_stride) {
  cublasLtMatrixLayout_t l = nullptr;
  ARENO_CUBLAS_CHECK(cublas_lib().LtMatrixLayoutCreate(&l, t, uint64_t(rows), uint64_t(cols), ld));
  ARENO_CUBLAS_CHECK(cublas_lib().LtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                                      sizeof(batch)));
  ARENO_CUBLAS_CHECK(cublas_lib().LtMatrixLayoutSetAttribute(
      l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride, sizeof(batch_stride)));
  return l;
}

// cuBLASLt for f32 / bf16 / f16; false when it has no algorithm for this case.
bool lt_matmul(DeviceContext& ctx, cudaDataType_t type, cudaDataType_t out_type, const Operand& A,
               const Operand& B, void* out, int64_t N, int64_t M, int64_t K, int batch, size_t esize,
               size_t out_esize, float alpha, float beta) {
  LtDescs d;
  ARENO_CUBLAS_CHECK(cublas_lib().LtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  ARENO_CUBLAS_CHECK(cublas_lib().LtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &A.op, sizeof(A.op)));
  ARENO_CUBLAS_CHECK(cublas_lib().LtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &B.op, sizeof(B.op)));
  d.a = make_layout(type, A.rows, A.cols, A.ld, batch, A.batch_stride);
  d.b = make_layout(type, B.rows, B.cols, B.ld, batch, B.batch_stride);
  d.c = make_layout(out_type, N, M, N, batch, N * M);

  uint32_t align_a = alignment(A.data, {A.ld * int64_t(esize), A.batch_stride * int64_t(esize)});
  uint32_t align_b = alignment(B.data, {B.ld * int64_t(esize), B.batch_stride * int64_t(esize)});
  uint32_t align_c = alignment(out, {N * int64_t(out_esize), N * M * int64_t(out_esize)});

  char key[256];
  std::snprintf(key, sizeof key, "%d>%d|%d%d|%lld,%lld,%lld|%lld,%lld|%lld,%lld|%d|%u,%u,%u|%d", int(type), int(out_type),
                int(A.op), int(B.op), (long long)N, (long long)M, (long long)K, (long long)A.ld,
                (long long)B.ld, (long long)A.batch_stride, (long long)B.batch_stride, batch, align_a,
                align_b, align_c, beta != 0.0f);
  cublasLtMatmulAlgo_t algo;
  bool have = false;
  {
    std::lock_guard<std::mutex> lock(ctx.mutex);
    auto it = ctx.lt_algos.find(key);
    if (it != ctx.lt_algos.end()) {
      algo = it->second;
      have = true;
    }
  }
  if (!have) {
    ARENO_CUBLAS_CHECK(cublas_lib().LtMatmulPreferenceCreate(&d.pref));
    uint64_t ws = ctx.workspace_bytes;
    ARENO_CUBLAS_CHECK(cublas_lib().LtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    ARENO_CUBLAS_CHECK(cublas_lib().LtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
    ARENO_CUBLAS_CHECK(cublas_lib().LtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
    ARENO_CUBLAS_CHECK(cublas_lib().LtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
    ARENO_CUBLAS_CHECK(cublas_lib().LtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c)));
    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    cublasStatus_t s = cublas_lib().LtMatmulAlgoGetHeuristic(ctx.cublaslt, d.op, d.a, d.b, d.c, d.c, d.pref,
                                                      1, &result, &count);
    if (s != CUBLAS_STATUS_SUCCESS || count == 0) return false;
    algo = result.algo;
    std::lock_guard<std::mutex> lock(ctx.mutex);
    ctx.lt_algos.emplace(key, algo);
  }
  cublasStatus_t s = cublas_lib().LtMatmul(ctx.cublaslt, d.op, &alpha, A.data, d.a, B.data, d.b, &beta, out,
                                    d.c, out, d.c, &algo, ctx.workspace, ctx.workspace_bytes,
                                    ctx.stream);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  ARENO_CUBLAS_CHECK(s);
  return true;
}

}  // namespace
}  // namespace areno::cuda

namespace areno {

using namespace cuda;

namespace {

// The checks of matmul and matmul_f32_out: shapes, one device, out contiguous.
void check_matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  if (a.dim() != 3 || b.dim() != 3 || out.dim() != 3)
    throw std::invalid_argument("cuda matmul: expected a [B, M, K], b [B, K, N], out [B, M, N]; got " +
                                a.str() + ", " + b.str() + ", " + out.str());
  require_contiguous(out, "matmul", "out");
  int64_t Bn = out.size(0), M = out.size(1), N = out.size(2), K = a.size(2);
  if (a.size(0) != Bn || a.size(1) != M || b.size(0) != Bn || b.size(1) != K || b.size(2) != N)
    throw std::invalid_argument("cuda matmul: shapes " + a.str() + " @ " + b.str() + " -> " +
                                out.str() + " do not agree");
  if (a.device() != out.device() || b.device() != out.device())
    throw std::invalid_argument("cuda matmul: a, b and out must be on one device");
}

// The product of matmul and matmul_f32_out (checked): a and b of one
// dtype, out of theirs or (bf16 / f16 operands) f32; cuBLASLt, else cuBLAS.
void run_gemm(CudaBackend& be, const Tensor& a, const Tensor& b, const Tensor& out, double alpha, double beta) {
  const int64_t Bn = out.size(0), M = out.size(1), N = out.size(2), K = a.size(2);
  if (Bn * M * N == 0) return;
  Launch l(out);
  if (K == 0) {  // empty sum: out = beta * out
    if (beta == 0.0) ARENO_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, out.nbytes(), l.stream));
    else be.unary(UnaryOp::affine, out, out, beta, 0.0);
    return;
  }
  l.ctx.ensure_blas();
  const cudaDataType_t type = cuda_type(a.dtype()), out_type = cuda_type(out.dtype());
  Operand A = as_cublas(b, l.stream);  // cuBLAS's A: our b, N x K after op
  Operand B = as_cublas(a, l.stream);  // cuBLAS's B: our a, K x M after op
  int batch = to_int(Bn, "batch");
  int n = to_int(N, "N"), m = to_int(M, "M"), k = to_int(K, "K");
  int lda = to_int(A.ld, "lda"), ldb = to_int(B.ld, "ldb");

  if (out.dtype() == DType::f64) {
    ARENO_CUBLAS_CHECK(cuda::cublas_lib().DgemmStridedBatched(
        l.ctx.cublas, A.op, B.op, n, m, k, &alpha, static_cast<const double*>(A.data), lda,
        A.batch_stride, static_cast<const double*>(B.data), ldb, B.batch_stride, &beta,
        ptr<double>(out), n, N * M, batch));
    return;
  }
  float alpha_f = float(alpha), beta_f = float(beta);
  if (lt_matmul(l.ctx, type, out_type, A, B, out.data_ptr(), N, M, K, batch, a.element_size(),
                out.element_size(), alpha_f, beta_f))
    return;
  ARENO_CUBLAS_CHECK(cuda::cublas_lib().GemmStridedBatchedEx(
      l.ctx.cublas, A.op, B.op, n, m, k, &alpha_f, A.data, type, lda, A.batch_stride, B.data, type,
      ldb, B.batch_stride, &beta_f, out.data_ptr(), out_type, n, N * M, batch, CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void CudaBackend::matmul(const Tensor& a, const Tensor& b, const Tensor& out, double alpha,
                         double beta) {
  check_matmul(a, b, out);
  if (a.dtype() != out.dtype() || b.dtype() != out.dtype())
    throw std::invalid_argument("cuda matmul: a, b and out must share a dtype");
  cuda_type(out.dtype());  // refuses other dtypes
  run_gemm(*this, a, b, out, alpha, beta);
}

// bf16 (f16) operands, f32 out: cuBLASLt's C/D in f32 with f32 compute, or
// cublasGemmStridedBatchedEx with the same types.
bool CudaBackend::matmul_f32_out(const Tensor& a, const Tensor& b, const Tensor& out, double alpha, double beta) {
  if (out.dtype() != DType::f32 || a.dtype() != b.dtype() || (a.dtype() != DType::bf16 && a.dtype() != DType::f16))
    return false;
  check_matmul(a, b, out);
  run_gemm(*this, a, b, out, alpha, beta);
  return true;
}

}  // namespace areno
