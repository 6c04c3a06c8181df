#pragma once
// Weight-only int8 (issue 16, `--quantize int8`): a weight matrix [N, K] kept
// as int8 values with one f32 scale per row (per output channel, symmetric):
//   scale[n] = max_k |W[n, k]| / 127,  q[n, k] = round(W[n, k] / scale[n])  (in [-127, 127])
// so row n reads back as scale[n] * q[n, :]. Activations stay f32 (or bf16,
// widened); the kernels widen the int8 values in registers and apply the
// row's scale to each finished dot product (kernels/cpu/gemm_skinny.h).
//
// A weight format, not a dtype: the model's linear layers hold either a
// Tensor or an Int8Weight and call linear() on whichever they hold (one
// forward). Host memory, CPU kernels only (other backends refuse it by name).
// Inference only: the weights are not trainable, and an input that records
// autograd history is refused.
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace areno {

struct Int8Weight {
  int64_t rows = 0, cols = 0;  // N, K
  DType dtype = DType::f32;    // the dtype of the weights it stands for: embedding() returns it
  std::vector<int8_t> values;  // [rows, cols] row-major
  std::vector<float> scales;   // [rows]
  size_t nbytes() const { return values.size() + scales.size() * sizeof(float); }
};

// Quantizes w ([N, K], f32 / bf16 / f16, CPU, any strides; read row by row,
// never widened whole) for a model computing in `dtype`. A NaN or infinite
// weight throws std::invalid_argument naming its row.
Int8Weight quantize_int8(const Tensor& w, DType dtype);
// The weight as the kernels see it: scales[n] * values[n, k], f32 [N, K] (tests).
Tensor dequantize(const Int8Weight& w);

// x [..., K] (f32 or bf16, CPU) -> [..., N] in x's dtype: x · Wᵀ with W the
// dequantized weight, f32 accumulation.
Tensor linear(const Tensor& x, const Int8Weight& w);
// Rows `ids` (any shape, integer) of the dequantized weight: [..., K] in
// w.dtype (a tied embedding read from the quantized head).
Tensor embedding(const Int8Weight& w, const Tensor& ids);

}  // namespace areno
