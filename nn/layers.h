#pragma once
// Layers built on the differentiable ops of tensor/ops.h. Parameter names and
// shapes follow torch.nn, so checkpoint names map one to one:
//   Linear     weight [out, in], bias [out]
//   Embedding  weight [num, dim]
//   RMSNorm    weight [dim]
//   LayerNorm  weight [dim], bias [dim]
//   Conv1d     weight [out, in/groups, k], bias [out]
//   Conv2d     weight [out, in/groups, kh, kw], bias [out]
// Random initialisation takes an explicit Generator so that a model is the
// same for the same seed on every device. It matches torch's distributions
// (not its random stream): kaiming-uniform with a = sqrt(5), i.e.
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases of Linear/Conv,
// N(0, 1) for Embedding, ones/zeros for norms.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nn/module.h"
#include "tensor/ops.h"

namespace areno {

// A chained setter and getter on an options struct, as libtorch's TORCH_ARG:
//   LinearOptions(16, 32).bias(false)
#define ARENO_ARG(T, name)                  \
 public:                                    \
  auto& name(const T& v) {                  \
    name##_ = v;                            \
    return *this;                           \
  }                                         \
  const T& name() const { return name##_; } \
                                            \
 private:                                   \
  T name##_

// ---- Linear ----
struct LinearOptions {
  LinearOptions(int64_t in, int64_t out) : in_features_(in), out_features_(out) {}
  ARENO_ARG(int64_t, in_features);
  ARENO_ARG(int64_t, out_features);
  ARENO_ARG(bool, bias) = true;
  ARENO_ARG(TensorOptions, tensor_options) = {};
};

class Linear : public Module {
 public:
  Linear(const LinearOptions& opts, Generator& gen);
  // x: [..., in] -> [..., out]
  Tensor forward(const Tensor& x) const;
  Tensor operator()(const Tensor& x) const { return forward(x); }

  LinearOptions options;
  Tensor weight;  // [out, in]
  Tensor bias;    // [out] or undefined
};

// ---- Embedding ----
struct EmbeddingOptions {
  EmbeddingOptions(int64_t num, int64_t dim) : num_embeddings_(num), embedding_dim_(dim) {}
  ARENO_ARG(int64_t, num_embeddings);
  ARENO_ARG(int64_t, embedding_dim);
  ARENO_ARG(TensorOptions, tensor_options) = {};
};

class Embedding : public Module {
 public:
  Embedding(const EmbeddingOptions& opts, Generator& gen);
  // ids: any shape, i32/i64 -> [..., dim]
  Tensor forward(const Tensor& ids) const;
  Tensor operator()(const Tensor& ids) const { return forward(ids); }

  EmbeddingOptions options;
  Tensor weight;  // [num, dim]
};

// ---- norms ----
struct RMSNormOptions {
  explicit RMSNormOptions(int64_t dim) : dim_(dim) {}
  ARENO_ARG(int64_t, dim);
  ARENO_ARG(double, eps) = 1e-6;
  ARENO_ARG(TensorOptions, tensor_options) = {};
};

class RMSNorm : public Module {
 public:
  explicit RMSNorm(const RMSNormOptions& opts);
  // x: [..., dim]
  Tensor forward(const Tensor& x) const;
  Tensor operator()(const Tensor& x) const { return forward(x); }

  RMSNormOptions options;
  Tensor weight;  // [dim], ones
};

struct LayerNormOptions {
  explicit LayerNormOptions(int64_t dim) : dim_(dim) {}
  ARENO_ARG(int64_t, dim);
  ARENO_ARG(double, eps) = 1e-5;
  ARENO_ARG(bool, elementwise_affine) = true;  // false: no weight, no bias
  ARENO_ARG(bool, bias) = true;
  ARENO_ARG(TensorOptions, tensor_options) = {};
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(const LayerNormOptions& opts);
  // x: [..., dim]
  Tensor forward(const Tensor& x) const;
  Tensor operator()(const Tensor& x) const { return forward(x); }

  LayerNormOptions options;
  Tensor weight;  // [dim] ones, or undefined without affine
  Tensor bias;    // [dim] zeros, or undefined
};

// ---- convolutions ----
struct Conv1dOptions {
  Conv1dOptions(int64_t in, int64_t out, int64_t kernel)
      : in_channels_(in), out_channels_(out), kernel_size_(kernel) {}
  ARENO_ARG(int64_t, in_channels);
  ARENO_ARG(int64_t, out_channels);
  ARENO_ARG(int64_t, kernel_size);
  ARENO_ARG(int64_t, stride) = 1;
  ARENO_ARG(int64_t, padding) = 0;
  ARENO_ARG(int64_t, dilation) = 1;
  ARENO_ARG(int64_t, groups) = 1;
  ARENO_ARG(bool, bias) = true;
  ARENO_ARG(TensorOptions, tensor_options) = {};
};

class Conv1d : public Module {
 public:
  Conv1d(const Conv1dOptions& opts, Generator& gen);
  // x: [N, Cin, L] -> [N, Cout, Lout]
  Tensor forward(const Tensor& x) const;
  Tensor operator()(const Tensor& x) const { return forward(x); }

  Conv1dOptions options;
  Tensor weight;  // [Cout, Cin/groups, K]
  Tensor bias;    // [Cout] or undefined
};

using IntPair = std::pair<int64_t, int64_t>;

// Spatial arguments are (height, width) pairs; a single number means both.
struct Conv2dOptions {
  Conv2dOptions(int64_t in, int64_t out, int64_t kernel)
      : in_channels_(in), out_channels_(out), kernel_size_{kernel, kernel} {}
  Conv2dOptions(int64_t in, int64_t out, IntPair kernel)
      : in_channels_(in), out_channels_(out), kernel_size_(kernel) {}
  ARENO_ARG(int64_t, in_channels);
  ARENO_ARG(int64_t, out_channels);
  ARENO_ARG(IntPair, kernel_size);
  ARENO_ARG(IntPair, stride) = {1, 1};
  ARENO_ARG(IntPair, padding) = {0, 0};
  ARENO_ARG(IntPair, dilation) = {1, 1};
  ARENO_ARG(int64_t, groups) = 1;
  ARENO_ARG(bool, bias) = true;
  ARENO_ARG(TensorOptions, tensor_options) = {};

 public:
  Conv2dOptions& stride(int64_t s) { return stride(IntPair{s, s}); }
  Conv2dOptions& padding(int64_t p) { return padding(IntPair{p, p}); }
  Conv2dOptions& dilation(int64_t d) { return dilation(IntPair{d, d}); }
};

class Conv2d : public Module {
 public:
  Conv2d(const Conv2dOptions& opts, Generator& gen);
  // x: [N, Cin, H, W] -> [N, Cout, Ho, Wo]
  Tensor forward(const Tensor& x) const;
  Tensor operator()(const Tensor& x) const { return forward(x); }

  Conv2dOptions options;
  Tensor weight;  // [Cout, Cin/groups, KH, KW]
  Tensor bias;    // [Cout] or undefined
};

// ---- dropout and activations (no parameters) ----
// Owns its Generator (seeded from the options) so that a model's dropout
// masks are reproducible; forward(x, gen) uses a caller's generator instead.
// Identity in eval mode.
struct DropoutOptions {
  explicit DropoutOptions(double p = 0.5) : p_(p) {}
  ARENO_ARG(double, p);
  ARENO_ARG(uint64_t, seed) = 0;
};

class Dropout : public Module {
 public:
  explicit Dropout(const DropoutOptions& opts = DropoutOptions());
  Tensor forward(const Tensor& x);
  Tensor forward(const Tensor& x, Generator& gen) const;
  Tensor operator()(const Tensor& x) { return forward(x); }

  DropoutOptions options;
  Generator generator;
};

class GELU : public Module {
 public:
  // "none" (exact, erf) or "tanh", as torch.nn.GELU(approximate=...).
  explicit GELU(const std::string& approximate = "none");
  Tensor forward(const Tensor& x) const;
  Tensor operator()(const Tensor& x) const { return forward(x); }

  bool tanh_approximation;
};

class SiLU : public Module {
 public:
  SiLU() : Module("SiLU") {}
  Tensor forward(const Tensor& x) const { return silu(x); }
  Tensor operator()(const Tensor& x) const { return forward(x); }
};

// Splits `dim` in half into (a, b) and returns a * sigmoid(b), as torch.nn.GLU.
class GLU : public Module {
 public:
  explicit GLU(int64_t dim = -1) : Module("GLU"), dim(dim) {}
  Tensor forward(const Tensor& x) const;
  Tensor operator()(const Tensor& x) const { return forward(x); }

  int64_t dim;
};

// ---- attention ----
// The attention core as a module: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D]
// (Hq % Hkv == 0 for grouped-query attention) -> [B, Hq, Tq, D]. Projections
// belong to the model, which knows its head layout.
struct ScaledDotProductAttentionOptions {
  ARENO_ARG(bool, causal) = false;
  ARENO_ARG(double, scale) = 0.0;  // 0: 1/sqrt(D)
};

class ScaledDotProductAttention : public Module {
 public:
  explicit ScaledDotProductAttention(
      const ScaledDotProductAttentionOptions& opts = ScaledDotProductAttentionOptions());
  // bias: additive, broadcastable to [B, Hq, Tq, Tk]; key_padding_mask: [B, Tk]
  // bool, true = masked out. Either may be undefined.
  Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias = Tensor(),
                 const Tensor& key_padding_mask = Tensor()) const;

  ScaledDotProductAttentionOptions options;
};

// ---- containers ----
// Children named "0", "1", ... so that names read "layers.3.mlp.weight".
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  template <typename M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> m) {
    items_.push_back(m);
    return register_module(std::to_string(items_.size() - 1), std::move(m));
  }
  size_t size() const { return items_.size(); }
  // The i-th module as M; throws when i is out of range or the module is not an M.
  template <typename M = Module>
  std::shared_ptr<M> at(size_t i) const {
    if (i >= items_.size())
      throw std::out_of_range("ModuleList::at(" + std::to_string(i) + "): the list has " +
                              std::to_string(items_.size()) + " modules");
    auto m = std::dynamic_pointer_cast<M>(items_[i]);
    if (!m)
      throw std::invalid_argument("ModuleList::at(" + std::to_string(i) + "): the module is a " +
                                  items_[i]->type_name() + ", not the requested type");
    return m;
  }

 private:
  std::vector<std::shared_ptr<Module>> items_;
};

}  // namespace areno
