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

}  // namespace areno::train
