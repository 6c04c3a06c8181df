// Random tensors from a Generator's Philox stream (kernels/*/random.*) and dropout.
#include "tensor/ops_util.h"

namespace areno {
using namespace detail;

static Tensor random_tensor(Shape shape, Generator& gen, RandomKind kind, double a, double b,
                            TensorOptions opts) {
  if (!is_floating(opts.dtype))
    throw std::invalid_argument("random tensors must be floating point");
  Tensor t = empty(std::move(shape), opts);
  uint64_t n = uint64_t(t.numel());
  uint64_t off = gen.advance(n);
  if (n) backend(opts.device).random(t, kind, a, b, gen.seed(), off);
  return t;
}
Tensor rand_uniform(Shape shape, Generator& gen, double low, double high, TensorOptions opts) {
  return random_tensor(std::move(shape), gen, RandomKind::uniform, low, high, opts);
}
Tensor rand_normal(Shape shape, Generator& gen, double mean, double std, TensorOptions opts) {
  return random_tensor(std::move(shape), gen, RandomKind::normal, mean, std, opts);
}

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  if (p < 0 || p >= 1) {
    if (p == 1 && training) return mul(x, 0.0);
    if (p < 0 || p > 1) throw std::invalid_argument("dropout probability must be in [0, 1)");
  }
  if (!training || p == 0) return x;
  Tensor u = rand_uniform(x.shape(), gen, 0.0, 1.0, TensorOptions(DType::f32, x.device()));
  Tensor keep = ge(u, full({}, p, TensorOptions(DType::f32, x.device())));
  return mul(x, mul(keep.to(x.dtype()), 1.0 / (1.0 - p)));
}

}  // namespace areno
