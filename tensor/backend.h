#pragma once
// The kernel table one device type implements: kernels/cpu/ (CpuBackend) and
// kernels/cuda/ (CudaBackend, or the stub in a build without CUDA) define it,
// tensor/ never includes them. The op files (tensor/ops_*.cpp) check
// arguments, allocate outputs and call these; kernels never allocate
// user-visible tensors. Layout contracts are stated per entry: "contig" means
// Tensor::is_contiguous() holds. Mixed dtypes never reach a kernel except
// where stated (copy casts; comparisons write bool; index tensors are i64).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace areno {

enum class UnaryOp : uint8_t {
  neg, exp, log, sqrt, rsqrt, abs, sin, cos, square, reciprocal,
  relu, silu, sigmoid, tanh, gelu, gelu_tanh,
  logical_not,  // out is bool
  affine,       // x * p0 + p1
  pow_scalar,   // x ^ p0
  clamp,        // min(max(x, p0), p1); NaN stays NaN
};

enum class BinaryOp : uint8_t {
  add,  // a + alpha * b
  sub,  // a - alpha * b
  mul, div, pow, maximum, minimum,
  eq, ne, lt, le, gt, ge,  // out is bool
  logical_and, logical_or, // inputs and out bool
  // backward of activations: a is the forward input x (or output y), b is dy
  relu_backward,       // a = x
  silu_backward,       // a = x
  sigmoid_backward,    // a = y
  tanh_backward,       // a = y
  gelu_backward,       // a = x
  gelu_tanh_backward,  // a = x
};

// arg*: out i64; sum_squares: the sum of x² (float dtypes), each x squared
// in the compute type and accumulated as sum's values are.
enum class ReduceOp : uint8_t { sum, max, min, argmax, argmin, sum_squares };

enum class RandomKind : uint8_t { uniform, normal };

struct ConvGeom {  // 2-D geometry; 1-D convolutions use H = KH = 1
  int64_t n, c, h, w;    // input [n, c, h, w]
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
  int64_t ho, wo;        // output spatial size
};

struct PoolGeom {
  int64_t n, c, h, w, kh, kw, sh, sw, ph, pw, ho, wo;
};

struct AdamWArgs {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based, for bias correction
};

class Backend {
 public:
  virtual ~Backend() = default;

  // ---- memory ----
  // Fresh, uninitialised memory: 64-byte aligned on the CPU (large blocks are
  // cached, kernels/cpu/allocator.cpp), the caching allocator on CUDA.
  virtual std::shared_ptr<Storage> allocate(size_t nbytes, Device device) = 0;
  // Zeroed memory committed as it is first written (lazy_zeros in
  // tensor/tensor.h), or null where the backend has none (the caller fills).
  virtual std::shared_ptr<Storage> allocate_lazy_zeroed(size_t, Device) { return nullptr; }
  // dst[...] = cast(src[...]); same shape (src may be a broadcast view with
  // zero strides), any strides and dtypes. One side may be on the CPU when the
  // other is on this backend's device.
  virtual void copy(const Tensor& src, const Tensor& dst) = 0;
  virtual void fill(const Tensor& dst, double value) = 0;       // any strides
  virtual void arange(const Tensor& dst, double start, double step) = 0;  // 1-D contig
  // dst contig floating; Philox4x32-10 stream (seed, offset): uniform in [a, b)
  // or normal with mean a and std b.
  virtual void random(const Tensor& dst, RandomKind kind, double a, double b, uint64_t seed,
                      uint64_t offset) = 0;
  virtual void synchronize(Device device) = 0;

  // ---- elementwise: operands have out's shape (broadcast views allowed), any strides ----
  virtual void unary(UnaryOp op, const Tensor& x, const Tensor& out, double p0, double p1) = 0;
  // a and b share one dtype; out has it too except for comparisons (bool).
  virtual void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out,
                      double alpha) = 0;
  // cond bool; a, b, out share one dtype.
  virtual void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) = 0;

  // ---- reductions: x contig viewed as [outer, n, inner], out contig [outer, inner] ----
  // sum accumulates in f32 (f64 for f64, i64 for integers).
  virtual void reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t n, int64_t inner,
                      const Tensor& out) = 0;
  virtual void cumsum(const Tensor& x, int64_t outer, int64_t n, int64_t inner,
                      const Tensor& out) = 0;

  // ---- rows: x contig [m, n], operations along n ----
  virtual void softmax(const Tensor& x, const Tensor& out, bool log) = 0;
  // dx = softmax'(y) dy (log: dy - exp(y) * sum(dy))
  virtual void softmax_backward(const Tensor& y, const Tensor& dy, const Tensor& dx, bool log) = 0;
  // Attention's probabilities in one pass: out = softmax(scale * x) along n,
  // computed in f32 (f64 for f64), one rounding to out (x's dtype, contig).
  // tq > 0 makes it causal over runs of tq rows (the queries of one head): row
  // r, query i = r % tq, sees columns j <= i + n - tq and gets 0 at the others;
  // a row that sees no column, or whose visible values hold a NaN or +inf or
  // are all -inf, is all NaN (as softmax over the masked scores gives).
  virtual void scaled_softmax(const Tensor& x, const Tensor& out, double scale, int64_t tq) = 0;
  // Its backward: dx = scale * y * (dy - sum(dy * y)), y its output; all of y's dtype, contig.
  virtual void scaled_softmax_backward(const Tensor& y, const Tensor& dy, const Tensor& dx, double scale) = 0;
  // Cross-entropy rows with their gradient, in one kernel (optional): logits
  // [R, V] f32 or bf16 contiguous, targets [R] i64 contiguous (each in [0, V)),
  // loss [R] f32: loss[r] = logsumexp(logits[r]) - logits[r][targets[r]], and
  // the logits overwritten with softmax(logits[r]) - onehot(targets[r]) (bf16:
  // computed in f32, so the bits of widening, the f32 kernel, then a cast to
  // bf16; no f32 copy of the logits). Returns
  // false when the backend has no kernel for it (the caller composes it).
  // cross_entropy_rows_layout_ok (below) says whether the operands have that
  // layout; a backend checks it before its kernel.
  virtual bool cross_entropy_rows(const Tensor& logits, const Tensor& targets, const Tensor& loss) {
    (void)logits, (void)targets, (void)loss;
    return false;
  }
  // The first k of each row in sorted order; values [m, k] (x's dtype), indices [m, k] i64.
  // Ties keep the lower index first (a stable sort).
  virtual void sort(const Tensor& x, int64_t k, bool descending, const Tensor& values,
                    const Tensor& indices) = 0;
  // weight, bias [n] (bias may be undefined); mean, rstd [m] f32 (f64 for f64 input).
  virtual void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                          const Tensor& y, const Tensor& mean, const Tensor& rstd) = 0;
  // dweight / dbias may be undefined; when defined they are overwritten.
  virtual void layer_norm_backward(const Tensor& x, const Tensor& weight, const Tensor& mean,
                                   const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                                   const Tensor& dweight, const Tensor& dbias) = 0;
  // y = x * rsqrt(mean(x^2) + eps) * weight, computed in f32 (f64 for f64).
  virtual void rms_norm(const Tensor& x, const Tensor& weight, double eps, const Tensor& y,
                        const Tensor& rstd) = 0;
  virtual void rms_norm_backward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                 const Tensor& dy, const Tensor& dx, const Tensor& dweight) = 0;
  // The residual add and the next RMSNorm in one pass (vLLM's
  // fused_add_rms_norm): a, b [m, n] contig, sum = a + b rounded to the dtype,
  // then y and rstd as rms_norm(sum, weight, eps) gives them (the same bits).
  virtual void add_rms_norm(const Tensor& a, const Tensor& b, const Tensor& weight, double eps, const Tensor& sum,
                            const Tensor& y, const Tensor& rstd) = 0;
  // SwiGLU of a packed gate | up input (Phi-3's MLP, vLLM's SiluAndMul): x
  // [m, 2n] with unit stride along its rows (row stride x.stride(0)), out [m, n]
  // contig: out = up * silu(gate), silu rounded to the dtype before the
  // product, so the bits are those of mul(up, silu(gate)) on this backend.
  virtual void silu_and_mul(const Tensor& x, const Tensor& out) = 0;
  // Rotary embedding over the first r = cos.size(1) dims of every head: x [t,
  // h, d] with each token's h x d values contiguous (row stride x.stride(0)),
  // cos, sin [t, r] contig in x's dtype (r even, <= d), out [t, h, d] contig.
  // Forward: out[:r] = x[:r] * cos + rotate_half(x[:r]) * sin, rotate_half(v)
  // = [-v2, v1], each product and the sum rounded to the dtype (the composed
  // op's bits), out[r:] = x[r:]. transpose: the adjoint map (dy to dx),
  // dx1 = dy1 cos1 + dy2 sin2, dx2 = dy2 cos2 - dy1 sin1, dx[r:] = dy[r:].
  virtual void rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& out, bool transpose) = 0;

  // ---- matmul: a [B, M, K], b [B, K, N], out [B, M, N] contig, one dtype ----
  // For a and b the last two dims are row-major (stride 1 on the last dim) or
  // column-major (stride 1 on the middle dim); the batch stride may be 0.
  // out = alpha * a @ b + beta * out; bf16/f16 accumulate in f32.
  virtual void matmul(const Tensor& a, const Tensor& b, const Tensor& out, double alpha,
                      double beta) = 0;
  // As matmul with a and b bf16 (or both f16) and out f32: the products summed
  // in f32 straight into out, never rounded to a and b's dtype (a weight
  // gradient accumulated over several products, as the loss's head gradient
  // in bf16 training). Optional: returns false when the backend has no kernel
  // for it (the caller widens a and b and runs matmul in f32).
  virtual bool matmul_f32_out(const Tensor& a, const Tensor& b, const Tensor& out, double alpha, double beta) {
    (void)a, (void)b, (void)out, (void)alpha, (void)beta;
    return false;
  }

  // ---- weight-only int8 linear (optional; tensor/quantized.h) ----
  // x [M, K] contig (f32 or bf16), w [N, K] int8 row-major with scales [N]
  // f32 (host memory), out [M, N] contig in x's dtype: out = x (scales * w)^T,
  // accumulated in f32. Returns false when the backend has no kernel for it.
  virtual bool linear_int8(const Tensor& x, const int8_t* w, const float* scales, const Tensor& out) {
    (void)x, (void)w, (void)scales, (void)out;
    return false;
  }

  // ---- linear with its bias in one rounding (optional; inference) ----
  // x [M, K] contig, w [N, K] contig, bias [N] contig, out [M, N] contig, all
  // bf16: out = x w^T + bias with the bias added to the f32 sums before the one
  // rounding to bf16 (as PyTorch's addmm; the composed matmul + add rounds
  // twice). Returns false (out unspecified) when the backend has no kernel for
  // it; no autograd.
  virtual bool linear_bias(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out) {
    (void)x, (void)w, (void)bias, (void)out;
    return false;
  }
  // out1 = x w1^T and out2 = x w2^T (x [m, k], w1 [n1, k], w2 [n2, k], all
  // contiguous, one dtype) from one pass over x, each with the bits the
  // matmul op gives it alone. Returns false (outs unspecified) when the
  // backend has no such kernel for these operands; no autograd.
  virtual bool linear_pair(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& out1,
                           const Tensor& out2) {
    (void)x, (void)w1, (void)w2, (void)out1, (void)out2;
    return false;
  }

  // ---- fused attention for inference (optional) ----
  // q [B, HQ, TQ, D], k/v [B, HKV, TK, D] (last dim contiguous), out [B, HQ, TQ, D]
  // contiguous: softmax(scale * q k^T, causal: query i sees keys j <= i + TK - TQ) v.
  // Returns false when the backend has no kernel for these inputs (the caller
  // then composes the op); no autograd.
  virtual bool attention_inference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                   double scale, bool causal) {
    (void)q, (void)k, (void)v, (void)out, (void)scale, (void)causal;
    return false;
  }

  // ---- fused attention with a backward (optional) ----
  // As attention_inference (the same values bit for bit where both run, so a
  // checkpointed forward and its recomputation agree), and lse [B, HQ, TQ] f32
  // contiguous: each query row's log-sum-exp of its scaled visible scores
  // (NaN for a row with no visible key). Returns false when the backend has
  // no kernel for these inputs; the caller then composes the op.
  virtual bool attention_train(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                               const Tensor& lse, double scale, bool causal) {
    (void)q, (void)k, (void)v, (void)out, (void)lse, (void)scale, (void)causal;
    return false;
  }
  // The gradients of attention_train's output: from q, k, v, its out and lse
  // and dout [B, HQ, TQ, D] (any strides), writes dq [B, HQ, TQ, D] and dk, dv
  // [B, HKV, TK, D] (contiguous; GQA heads summed per KV head). Runs wherever
  // attention_train returned true for the same q, k, v.
  virtual bool attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                  const Tensor& dv, double scale, bool causal) {
    (void)q, (void)k, (void)v, (void)out, (void)lse, (void)dout, (void)dq, (void)dk, (void)dv, (void)scale,
        (void)causal;
    return false;
  }

  // ---- indexing; index tensors are i64 contig; values are checked by the caller ----
  // x contig [outer, n, inner], index [m], out contig [outer, m, inner]
  virtual void index_select(const Tensor& x, const Tensor& index, const Tensor& out) = 0;
  // out [outer, n, inner] += src [outer, m, inner] at rows index[m] (duplicates add)
  virtual void index_add(const Tensor& out, const Tensor& index, const Tensor& src) = 0;
  // x contig, index and out contig with one shape: out[..i..] = x[..index[..i..]..] along dim
  virtual void gather(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out) = 0;
  // out contig; index, src contig with one shape; accumulate adds, else writes.
  virtual void scatter(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src,
                       bool accumulate) = 0;
  // out contig (already holding x), mask bool contig of out's shape, src contig:
  // the k-th true position of mask takes src.flat[k].
  virtual void masked_scatter(const Tensor& out, const Tensor& mask, const Tensor& src) = 0;

  // ---- convolution and pooling ----
  // x contig [n, c, h, w] -> cols contig [n, c*kh*kw, ho*wo] (zero padding)
  virtual void im2col(const Tensor& x, const ConvGeom& g, const Tensor& cols) = 0;
  // dx contig [n, c, h, w] (zeroed by the caller) += fold(cols)
  virtual void col2im(const Tensor& cols, const ConvGeom& g, const Tensor& dx) = 0;
  // Depthwise convolution, channels last: x contig [b, h, w, c], w contig [c,
  // kh, kw], bias contig [c] or undefined, out contig [b, ho, wo, c] with ho =
  // (h - kh) / sh + 1, wo likewise: out = sum over taps (row-major) of
  // x * w, then + bias, accumulated in f32 (f64 for f64) with no fused
  // multiply-add, rounded once (tensor/ops.h, depthwise_conv2d_nhwc).
  virtual void depthwise_conv2d_nhwc(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out,
                                     int64_t sh, int64_t sw) = 0;
  // count_include_pad = true, as torch's default
  virtual void avg_pool2d(const Tensor& x, const PoolGeom& g, const Tensor& out) = 0;
  virtual void avg_pool2d_backward(const Tensor& dy, const PoolGeom& g, const Tensor& dx) = 0;

  // ---- optimizer ----
  // In place on contig tensors of one shape. param may be bf16/f16 with an f32
  // master copy (then master is updated and param = round(master)); m, v f32.
  virtual void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                          const Tensor& v, const Tensor& master, const AdamWArgs& args) = 0;
};

// Backend::cross_entropy_rows's operands: logits f32 or bf16 [R, V], targets i64 [R],
// loss f32 [R], all contiguous and on one device (tensor/dispatch.cpp).
bool cross_entropy_rows_layout_ok(const Tensor& logits, const Tensor& targets, const Tensor& loss);

// The backend of a device type (tensor/dispatch.cpp). CUDA without a CUDA
// build throws std::runtime_error("areno was built without CUDA ...").
Backend& backend(Device device);
// ARENO_PROFILE_OPS=1 (tensor/profile_backend.cpp): backend() hands out a
// wrapper that times and counts every call (synchronizing the device after
// each) and prints a table to stderr at exit. Reset drops what was counted so
// far (a benchmark calls it after its warm-up); print writes the table so far
// under a heading (a benchmark's per-stage tables) and resets. All are no-ops
// when off.
bool op_profile_enabled();
void op_profile_reset();
void op_profile_print(const std::string& heading);
// Defined by the kernels: the tensor library links against them.
Backend& cpu_backend();   // kernels/cpu/cpu_backend.cpp
Backend& cuda_backend();  // kernels/cuda/cuda_backend.cu (or kernels/cuda/stub.cpp)
// Frees the calling thread's idle CPU worker threads (its OpenMP team; the
// next op on this thread makes a new one). A thread that is done running ops
// while another keeps computing calls it: parked teams beside a working one
// give libgomp more threads than cores, and it then throttles every team's
// spin-wait, so each parallel region sleeps and wakes its workers
// (docs/perf.md, serving under load). kernels/cpu/cpu_backend.cpp.
void release_cpu_threads();

// CUDA runtime queries, for `areno env` and tests (kernels/cuda/cuda_context.cu;
// the stub reports 0 devices).
struct CudaDeviceInfo {
  int index;
  std::string name;
  size_t total_bytes, free_bytes;
  int sm_major, sm_minor;
};
bool cuda_compiled();
int cuda_device_count();  // 0 when none or not compiled
std::vector<CudaDeviceInfo> cuda_devices();
// The caching allocator's high-water mark of bytes handed out on cuda:index
// (0 when not compiled); what `--device cuda` benchmarks report as peak
// device memory (cached free blocks not counted).
size_t cuda_peak_allocated_bytes(int index);
std::string cuda_runtime_version();  // "" when not compiled
std::string cublas_version();
std::string nccl_version();

}  // namespace areno
