#pragma once
// The SFT loss (issue 14, "Loop"): token cross-entropy over target rows only,
// through the tied head, a chunk of rows at a time, so the [tokens, vocab] f32
// logits of a micro-batch never exist at once. With a tape, each chunk's
// gradient products (to the rows and to the weight) are taken while its logits
// are in memory, so no logits are kept or recomputed and the backward only
// scales them: meant for a loss whose backward follows (the SFT step), as the
// forward then costs three head GEMMs per chunk instead of one.
#include <cstdint>

#include "tensor/tensor.h"

namespace areno::train {

// Rows per chunk when the caller does not say: 1024 rows of a 200064-wide
// vocabulary are 0.8 GB of f32 logits.
inline constexpr int64_t kDefaultLossChunkRows = 1024;

// Sum over the rows t with targets[t] >= 0 of -log softmax(hidden[t] · weightᵀ)[targets[t]],
// as an f32 scalar that records its backward (to hidden and weight).
//   hidden  [T, H] (the final-norm hidden states, any float dtype)
//   weight  [V, H] (the tied embedding)
//   targets [T] integer, -1 (any negative) = no loss at that row
// The logits are computed in the weight's dtype and reduced in f32, as
// torch's F.cross_entropy(logits.float(), ...). Throws std::invalid_argument
// for shapes that do not match or a target outside [0, V).
Tensor chunked_cross_entropy_sum(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                 int64_t chunk_rows = kDefaultLossChunkRows);

// One chunk's cross-entropy rows, no autograd: logits [n, V] (fresh, owned
// by the caller: overwritten), targets [n, 1] i64 in [0, V), on one device.
// Returns each row's -log softmax(logits)[target] (nll, [n] f32) and, with
// `want_grad` (always where the backend's row kernel runs), softmax - onehot
// (grad, [n, V]) in the logits' own buffer. The backend's row kernel
// (Backend::cross_entropy_rows) takes f32 and bf16 logits in place, f32 math;
// other dtypes, or a backend without it, widen to f32 and compose
// log_softmax, gather, exp and a scatter of -1.
struct CrossEntropyRows {
  Tensor nll, grad;
};
CrossEntropyRows cross_entropy_rows(Tensor logits, const Tensor& targets, bool want_grad);
// The composed form cross_entropy_rows falls back on (a backend without the
// row kernel), callable directly so that it is tested: logits widened to f32
// (an f32 [n, V] is overwritten), log_softmax, gather, exp, scatter of -1.
CrossEntropyRows cross_entropy_rows_composed(Tensor logits, const Tensor& targets, bool want_grad);

// acc (+)= dlogitsᵀ · rows: one chunk's share of the tied head weight's
// gradient, [V, H] in f32 (a bf16 sum over chunks would lose the small
// contributions); acc undefined on the first chunk, then accumulated in place.
// dlogits [n, V] (f32 or bf16, cross_entropy_rows' grad, possibly scaled),
// rows [n, H]. For a bf16 (f16) weight the product runs on both operands
// rounded to its dtype with f32 sums where the backend has that kernel
// (Backend::matmul_f32_out: CUDA's tensor cores, oneDNN's AMX tiles; as
// autocast's bf16 head gradient), else both widen to f32 (a bf16 d/dlogits
// from the row kernel is already rounded, as PyTorch's gradient of bf16
// logits is). Shared by the SFT loss and RL's log-probabilities.
void add_head_weight_grad(Tensor& acc, const Tensor& dlogits, const Tensor& rows, DType weight_dtype);

}  // namespace areno::train
