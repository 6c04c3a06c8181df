#include "nn/layers.h"

#include <cmath>
#include <stdexcept>

namespace areno {

namespace {

void check_positive(const char* layer, const char* field, int64_t v) {
  if (v <= 0)
    throw std::invalid_argument(std::string(layer) + ": " + field + " must be positive, got " +
                                std::to_string(v));
}

// torch's kaiming_uniform_(a=sqrt(5)) and its bias init both reduce to
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
Tensor uniform_fan_in(Shape shape, int64_t fan_in, Generator& gen, const TensorOptions& opts) {
  double bound = 1.0 / std::sqrt(double(fan_in));
  return rand_uniform(std::move(shape), gen, -bound, bound, opts);
}

void check_groups(const char* layer, int64_t in, int64_t out, int64_t groups) {
  check_positive(layer, "groups", groups);
  if (in % groups != 0 || out % groups != 0)
    throw std::invalid_argument(std::string(layer) + ": in_channels (" + std::to_string(in) +
                                ") and out_channels (" + std::to_string(out) +
                                ") must both be divisible by groups (" + std::to_string(groups) +
                                ")");
}

}  // namespace

// ---- Linear ----
Linear::Linear(const LinearOptions& opts, Generator& gen) : Module("Linear"), options(opts) {
  check_positive("Linear", "in_features", opts.in_features());
  check_positive("Linear", "out_features", opts.out_features());
  const auto& to = opts.tensor_options();
  weight = register_parameter(
      "weight", uniform_fan_in({opts.out_features(), opts.in_features()}, opts.in_features(), gen, to));
  if (opts.bias())
    bias = register_parameter("bias",
                              uniform_fan_in({opts.out_features()}, opts.in_features(), gen, to));
}

Tensor Linear::forward(const Tensor& x) const { return linear(x, weight, bias); }

// ---- Embedding ----
Embedding::Embedding(const EmbeddingOptions& opts, Generator& gen)
    : Module("Embedding"), options(opts) {
  check_positive("Embedding", "num_embeddings", opts.num_embeddings());
  check_positive("Embedding", "embedding_dim", opts.embedding_dim());
  weight = register_parameter("weight",
                              rand_normal({opts.num_embeddings(), opts.embedding_dim()}, gen, 0.0,
                                          1.0, opts.tensor_options()));
}

Tensor Embedding::forward(const Tensor& ids) const { return embedding(weight, ids); }

// ---- norms ----
RMSNorm::RMSNorm(const RMSNormOptions& opts) : Module("RMSNorm"), options(opts) {
  check_positive("RMSNorm", "dim", opts.dim());
  weight = register_parameter("weight", ones({opts.dim()}, opts.tensor_options()));
}

Tensor RMSNorm::forward(const Tensor& x) const { return rms_norm(x, weight, options.eps()); }

LayerNorm::LayerNorm(const LayerNormOptions& opts) : Module("LayerNorm"), options(opts) {
  check_positive("LayerNorm", "dim", opts.dim());
  if (opts.elementwise_affine()) {
    weight = register_parameter("weight", ones({opts.dim()}, opts.tensor_options()));
    if (opts.bias()) bias = register_parameter("bias", zeros({opts.dim()}, opts.tensor_options()));
  }
}

Tensor LayerNorm::forward(const Tensor& x) const {
  // The op needs a weight; without affine parameters it is a constant one.
  if (!weight.defined())
    return layer_norm(x, ones({options.dim()}, TensorOptions(x.dtype(), x.device())), Tensor(),
                      options.eps());
  return layer_norm(x, weight, bias, options.eps());
}

// ---- convolutions ----
Conv1d::Conv1d(const Conv1dOptions& opts, Generator& gen) : Module("Conv1d"), options(opts) {
  check_positive("Conv1d", "in_channels", opts.in_channels());
  check_positive("Conv1d", "out_channels", opts.out_channels());
  check_positive("Conv1d", "kernel_size", opts.kernel_size());
  check_positive("Conv1d", "stride", opts.stride());
  check_positive("Conv1d", "dilation", opts.dilation());
  check_groups("Conv1d", opts.in_channels(), opts.out_channels(), opts.groups());
  int64_t cin_g = opts.in_channels() / opts.groups();
  int64_t fan_in = cin_g * opts.kernel_size();
  const auto& to = opts.tensor_options();
  weight = register_parameter(
      "weight", uniform_fan_in({opts.out_channels(), cin_g, opts.kernel_size()}, fan_in, gen, to));
  if (opts.bias())
    bias = register_parameter("bias", uniform_fan_in({opts.out_channels()}, fan_in, gen, to));
}

Tensor Conv1d::forward(const Tensor& x) const {
  return conv1d(x, weight, bias, options.stride(), options.padding(), options.dilation(),
                options.groups());
}

Conv2d::Conv2d(const Conv2dOptions& opts, Generator& gen) : Module("Conv2d"), options(opts) {
  check_positive("Conv2d", "in_channels", opts.in_channels());
  check_positive("Conv2d", "out_channels", opts.out_channels());
  check_positive("Conv2d", "kernel_size (height)", opts.kernel_size().first);
  check_positive("Conv2d", "kernel_size (width)", opts.kernel_size().second);
  check_positive("Conv2d", "stride (height)", opts.stride().first);
  check_positive("Conv2d", "stride (width)", opts.stride().second);
  check_positive("Conv2d", "dilation (height)", opts.dilation().first);
  check_positive("Conv2d", "dilation (width)", opts.dilation().second);
  check_groups("Conv2d", opts.in_channels(), opts.out_channels(), opts.groups());
  int64_t cin_g = opts.in_channels() / opts.groups();
  auto [kh, kw] = opts.kernel_size();
  int64_t fan_in = cin_g * kh * kw;
  const auto& to = opts.tensor_options();
  weight = register_parameter(
      "weight", uniform_fan_in({opts.out_channels(), cin_g, kh, kw}, fan_in, gen, to));
  if (opts.bias())
    bias = register_parameter("bias", uniform_fan_in({opts.out_channels()}, fan_in, gen, to));
}

Tensor Conv2d::forward(const Tensor& x) const {
  return conv2d(x, weight, bias, options.stride(), options.padding(), options.dilation(),
                options.groups());
}

// ---- dropout and activations ----
Dropout::Dropout(const DropoutOptions& opts)
    : Module("Dropout"), options(opts), generator(opts.seed()) {
  if (!(opts.p() >= 0.0 && opts.p() <= 1.0))
    throw std::invalid_argument("Dropout: p must be in [0, 1], got " + std::to_string(opts.p()));
}

Tensor Dropout::forward(const Tensor& x) { return dropout(x, options.p(), is_training(), generator); }

Tensor Dropout::forward(const Tensor& x, Generator& gen) const {
  return dropout(x, options.p(), is_training(), gen);
}

GELU::GELU(const std::string& approximate) : Module("GELU") {
  if (approximate != "none" && approximate != "tanh")
    throw std::invalid_argument("GELU: approximate must be \"none\" or \"tanh\", got \"" +
                                approximate + "\"");
  tanh_approximation = approximate == "tanh";
}

Tensor GELU::forward(const Tensor& x) const { return tanh_approximation ? gelu_tanh(x) : gelu(x); }

Tensor GLU::forward(const Tensor& x) const {
  int64_t d = wrap_dim(dim, x.dim());
  if (x.size(d) % 2 != 0)
    throw std::invalid_argument("GLU: dim " + std::to_string(dim) + " of input " +
                                shape_str(x.shape()) + " must have an even size");
  auto halves = chunk(x, 2, d);
  return mul(halves[0], sigmoid(halves[1]));
}

// ---- attention ----
ScaledDotProductAttention::ScaledDotProductAttention(const ScaledDotProductAttentionOptions& opts)
    : Module("ScaledDotProductAttention"), options(opts) {}

Tensor ScaledDotProductAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& bias,
                                          const Tensor& key_padding_mask) const {
  AttentionOptions a;
  a.causal = options.causal();
  a.scale = options.scale();
  a.bias = bias;
  a.key_padding_mask = key_padding_mask;
  return scaled_dot_product_attention(q, k, v, a);
}

}  // namespace areno
