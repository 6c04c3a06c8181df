#pragma once
// The op API. Every function here checks its arguments, allocates its output,
// runs the kernel of the inputs' device (tensor/dispatch.cpp) and, when grad
// mode is on and an input requires grad, records its backward on the tape.
#include <optional>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace areno {

// ---- elementwise ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor pow(const Tensor& a, double exponent);
Tensor add_scaled(const Tensor& a, const Tensor& b, double alpha);  // a + alpha*b

Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_or(const Tensor& a, const Tensor& b);
Tensor logical_not(const Tensor& a);
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor sin(const Tensor& x);
Tensor cos(const Tensor& x);
Tensor square(const Tensor& x);
Tensor reciprocal(const Tensor& x);
Tensor clamp(const Tensor& x, std::optional<double> lo, std::optional<double> hi);
Tensor relu(const Tensor& x);
Tensor silu(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor gelu(const Tensor& x);       // exact (erf)
Tensor gelu_tanh(const Tensor& x);  // tanh approximation
// SwiGLU of a packed gate | up last dim (Phi-3's MLP, vLLM's SiluAndMul):
// x [..., 2n] -> up * silu(gate) [..., n], silu rounded to x's dtype before
// the product (the rounding points of mul(up, silu(gate))), in one pass.
Tensor silu_and_mul(const Tensor& x);
Tensor cast(const Tensor& x, DType dtype);

// ---- reductions (dims may be negative; empty dims = all) ----
Tensor sum(const Tensor& x, std::vector<int64_t> dims = {}, bool keepdim = false);
// The sum of x² over every element as an f32 scalar (f64 for f64) in one
// pass, for any float dtype (16-bit values widened, then squared in f32): the
// bits of sum(square(x.to(f32))) with no copies. Gradient norms.
Tensor sum_squares(const Tensor& x);
Tensor mean(const Tensor& x, std::vector<int64_t> dims = {}, bool keepdim = false);
Tensor max(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor min(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor max(const Tensor& x);  // over all elements
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);  // i64
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor var(const Tensor& x, std::vector<int64_t> dims = {}, int64_t correction = 1,
           bool keepdim = false);
// Sums `x` down to `shape` (the inverse of broadcasting).
Tensor sum_to(const Tensor& x, const Shape& shape);

Tensor softmax(const Tensor& x, int64_t dim = -1);
Tensor log_softmax(const Tensor& x, int64_t dim = -1);
// softmax(scale * x) over the last dim in one pass (f32 accumulation, f64 for
// f64; the result in x's dtype). causal: row i of the last-but-one dim (TQ
// rows) sees the columns j <= i + TK - TQ and is 0 at the others (attention's
// mask with a cached history). The composed attention's probabilities.
Tensor scaled_softmax(const Tensor& x, double scale, bool causal);
Tensor cumsum(const Tensor& x, int64_t dim);
// Values and i64 indices of the k largest (or smallest) along `dim`, sorted.
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true);
std::pair<Tensor, Tensor> sort(const Tensor& x, int64_t dim = -1, bool descending = false);

// ---- linear algebra ----
// a: [..., M, K], b: [..., K, N] (leading dims broadcast) -> [..., M, N].
// 1-D operands are treated as in torch.matmul. bf16/f16 accumulate in f32.
Tensor matmul(const Tensor& a, const Tensor& b);
// x: [..., in], weight: [out, in], bias: [out] -> [..., out]
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());
// y += alpha·x·weightᵀ in place, for inference: x [M, in], weight [out, in], y
// [M, out] contiguous (a row range of a larger y too), one floating dtype and
// device. The product's f32 sums join y before its one rounding (linear then
// add rounds twice). Refused (std::invalid_argument) when any operand records
// autograd history.
void linear_add_(const Tensor& y, const Tensor& x, const Tensor& weight, double alpha = 1.0);
// y + alpha·x·weightᵀ with autograd, in one GEMM over y's storage (beta = 1):
// the product's f32 sums join y before its one rounding, and no [M, out] pass
// of an add. Shapes and dtypes as linear_add_. y is consumed: the result
// takes its storage, so y must be the caller's own fresh value that no
// recorded backward reads (a linear's output is; a leaf that requires grad is
// refused). Gradients: y's is the incoming one, x's alpha·g·weight, weight's
// alpha·gᵀ·x. (A LoRA's B product added to its base output in training.)
Tensor linear_accumulate(const Tensor& y, const Tensor& x, const Tensor& weight, double alpha = 1.0);
// x·weightᵀ + alpha·(x·aᵀ)·bᵀ with autograd: a LoRA linear whose adapter
// covers every row, as one op. Forward: the bits of linear(x, weight) then
// linear_accumulate(·, linear(x, a), b, alpha). Backward: x's gradient is one
// sum, g·weight with (alpha·g·b)·a accumulated into it by the second GEMM
// (beta = 1), where the tape would round two products and add them; a's is
// (alpha·g·b)ᵀ·x, b's alpha·gᵀ·(x·aᵀ), weight's gᵀ·x. x [M, in], weight
// [out, in], a [r, in], b [out, r]: one floating dtype and device.
Tensor lora_linear(const Tensor& x, const Tensor& weight, const Tensor& a, const Tensor& b, double alpha = 1.0);
// {linear(x, w1), linear(x, w2)} (no biases), the same values, from one pass
// over x where the backend has a kernel for it (bf16 on AMX: a LoRA's x·Aᵀ
// beside its base product); two linear calls otherwise (and with autograd).
std::pair<Tensor, Tensor> linear_pair(const Tensor& x, const Tensor& w1, const Tensor& w2);

// ---- indexing ----
Tensor embedding(const Tensor& weight, const Tensor& ids);  // weight[V, C], ids any int shape
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
// out = x with out[index[i][j]][j] += src[i][j] along dim (torch.scatter_add)
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
// out = x with out[index...] = src[...] along dim (torch.scatter; later writes win)
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
// out[i] = x[i] + sum over j with index[j] == i of src[j] along dim (torch.index_add)
Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
// Positions where mask (broadcast to x) is true take consecutive elements of src.
Tensor masked_scatter(const Tensor& x, const Tensor& mask, const Tensor& src);
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);

// ---- shape ----
Tensor cat(const std::vector<Tensor>& xs, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& xs, int64_t dim = 0);
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim = 0);
std::vector<Tensor> split_sizes(const Tensor& x, const std::vector<int64_t>& sizes,
                                int64_t dim = 0);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
// pads: (before, after) pairs from the last dim backwards, as torch.nn.functional.pad.
Tensor pad(const Tensor& x, const std::vector<int64_t>& pads, double value = 0.0);

// ---- neural network ----
// x: [N, Cin, L], w: [Cout, Cin/groups, K] -> [N, Cout, Lout]
Tensor conv1d(const Tensor& x, const Tensor& w, const Tensor& bias = Tensor(), int64_t stride = 1,
              int64_t padding = 0, int64_t dilation = 1, int64_t groups = 1);
// x: [N, Cin, H, W], w: [Cout, Cin/groups, KH, KW] -> [N, Cout, Ho, Wo]
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias = Tensor(),
              std::pair<int64_t, int64_t> stride = {1, 1}, std::pair<int64_t, int64_t> padding = {0, 0},
              std::pair<int64_t, int64_t> dilation = {1, 1}, int64_t groups = 1);
// Depthwise 2-D convolution, channels last, no padding (the caller pads):
// x [B, H, W, C], w [C, KH, KW], bias [C] or undefined, stride (sh, sw) ->
// [B, (H - KH) / sh + 1, (W - KW) / sw + 1, C] with
//   y[b, i, j, c] = sum over taps (a, e) in order of x[b, i sh + a, j sw + e, c] w[c, a, e], then + bias[c],
// summed in f32 (f64 for f64) and rounded once to x's dtype: for f32 the bits
// of the composed mul / add per tap, for 16-bit types one rounding where the
// composed ops round every product and sum. (torch: conv2d with groups = C on
// the NCHW view.) Differentiable in all three.
Tensor depthwise_conv2d_nhwc(const Tensor& x, const Tensor& w, const Tensor& bias,
                             std::pair<int64_t, int64_t> stride = {1, 1});
// x: [N, C, H, W]; count_include_pad semantics of torch (default true).
Tensor avg_pool2d(const Tensor& x, std::pair<int64_t, int64_t> kernel,
                  std::pair<int64_t, int64_t> stride = {0, 0},
                  std::pair<int64_t, int64_t> padding = {0, 0});
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);
// {a + b, rms_norm(a + b, weight, eps)} in one pass where no gradient is
// needed (the decoder's residual add and the next norm; the bits of the two
// ops), composed otherwise. a and b of one shape, dtype and device.
std::pair<Tensor, Tensor> add_rms_norm(const Tensor& a, const Tensor& b, const Tensor& weight, double eps);
// Rotary position embedding in one pass: x [T, H, D], cos and sin [T, R] or
// [T, 1, R] (R even, <= D; rotated per head over the first R dims, the rest
// kept): x*cos + rotate_half(x)*sin with rotate_half(v) = [-v2, v1], each
// product and the sum rounded to x's dtype (the composed ops' rounding
// points). Differentiable in x; cos and sin are tables (no gradient).
Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin);
// logits: [N, C], target: [N] int; mean over targets != ignore_index.
// Computed and returned in f32 for f32/bf16/f16 logits (f64 for f64): unlike
// torch, a 16-bit model's loss is not rounded to 16 bits.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100,
                     const std::string& reduction = "mean");
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen);

// q: [B, Hq, Tq, D], k/v: [B, Hkv, Tk, D] with Hq % Hkv == 0 (GQA).
// bias: additive, broadcastable to [B, Hq, Tq, Tk]; key_padding_mask: [B, Tk] bool,
// true = masked out. causal aligns the last query with the last key.
struct AttentionOptions {
  bool causal = false;
  double scale = 0.0;  // 0: 1/sqrt(D)
  Tensor bias;
  Tensor key_padding_mask;
};
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionOptions& opts = {});

// ---- operators ----
inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& a) { return neg(a); }
inline Tensor operator+(const Tensor& a, double b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, double b) { return add(a, -b); }
inline Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, double b) { return mul(a, 1.0 / b); }
inline Tensor operator+(double a, const Tensor& b) { return add(b, a); }
inline Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
inline Tensor operator-(double a, const Tensor& b) { return add(neg(b), a); }

// ---- helpers for tests and tools ----
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8);
// max |a-b| over elements (both converted to f64 on the CPU)
double max_abs_diff(const Tensor& a, const Tensor& b);

}  // namespace areno
