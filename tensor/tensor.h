#pragma once
// Tensor: a cheap-to-copy handle to (storage, offset, shape, strides, dtype,
// device) plus autograd state. Copies share the same tensor (as in PyTorch);
// views share storage with new shape/strides.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/shape.h"
#include "tensor/storage.h"

namespace areno {

struct Node;  // tensor/autograd.h

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  int64_t offset = 0;  // in elements
  Shape shape;
  Shape strides;  // in elements
  DType dtype = DType::f32;
  Device device;
  // autograd
  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;  // accumulated gradient of a leaf
  std::shared_ptr<Node> grad_fn;     // the op that produced this tensor, if recorded
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl_->shape; }
  const Shape& strides() const { return impl_->strides; }
  int64_t dim() const { return int64_t(impl_->shape.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t stride(int64_t d) const;
  int64_t offset() const { return impl_->offset; }
  int64_t numel() const { return shape_numel(impl_->shape); }
  DType dtype() const { return impl_->dtype; }
  Device device() const { return impl_->device; }
  size_t element_size() const { return dtype_size(impl_->dtype); }
  size_t nbytes() const { return size_t(numel()) * element_size(); }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return impl_->storage; }
  // Address of element 0 (storage base + offset).
  void* data_ptr() const;
  // Typed pointer; checks the dtype and that the tensor lives on the CPU.
  template <typename T> T* data() const;
  std::string str() const;  // "Tensor[2, 3] f32 cpu"

  // ---- views (no copy; differentiable) ----
  Tensor view(Shape shape) const;     // requires compatible strides; one -1 allowed
  Tensor reshape(Shape shape) const;  // view when possible, else a copy
  Tensor permute(std::vector<int64_t> dims) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const { return transpose(-2, -1); }
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor expand(Shape shape) const;  // -1 keeps a size; new leading dims allowed
  Tensor squeeze(int64_t dim) const;
  Tensor squeeze() const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten(int64_t start = 0, int64_t end = -1) const;
  Tensor unflatten(int64_t dim, Shape sizes) const;

  // ---- copies ----
  Tensor contiguous() const;  // this tensor when already contiguous
  Tensor clone() const;
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;
  Tensor to(Device device, DType dtype) const;
  // In-place, not recorded by autograd: copy (with broadcast and cast) / fill.
  Tensor& copy_(const Tensor& src);
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }

  // ---- autograd ----
  bool requires_grad() const { return impl_->requires_grad; }
  Tensor& set_requires_grad(bool r = true);
  bool is_leaf() const { return impl_->grad_fn == nullptr; }
  Tensor grad() const { return Tensor(impl_->grad); }
  void set_grad(const Tensor& g) { impl_->grad = g.impl_; }
  void zero_grad() { impl_->grad.reset(); }
  const std::shared_ptr<Node>& grad_fn() const { return impl_->grad_fn; }
  // Back-propagates from this tensor; `grad` defaults to ones for a scalar.
  void backward(const Tensor& grad = Tensor()) const;
  Tensor detach() const;  // shares storage, no history

  // ---- host access ----
  double item() const;  // single-element tensors
  template <typename T> std::vector<T> to_vector() const;  // any device, converts

  const std::shared_ptr<TensorImpl>& impl() const { return impl_; }
  bool same(const Tensor& o) const { return impl_ == o.impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// A tensor over `storage` with explicit geometry (the building block of views).
Tensor make_tensor(std::shared_ptr<Storage> storage, int64_t offset, Shape shape,
                   Shape strides, DType dtype);

// ---- creation ----
struct TensorOptions {
  DType dtype = DType::f32;
  Device device = Device::cpu();
  TensorOptions() = default;
  TensorOptions(DType t) : dtype(t) {}
  TensorOptions(Device d) : device(d) {}
  TensorOptions(DType t, Device d) : dtype(t), device(d) {}
};

Tensor empty(Shape shape, TensorOptions opts = {});
Tensor zeros(Shape shape, TensorOptions opts = {});
// Zeros for a long-lived large buffer (the KV cache): on the CPU its pages are
// mapped from the kernel, zero until written and committed only then (no pass
// over them, no memory held before use); elsewhere, and for small sizes, as
// zeros(). Not for per-step buffers: each call maps fresh pages.
Tensor lazy_zeros(Shape shape, TensorOptions opts = {});
Tensor ones(Shape shape, TensorOptions opts = {});
Tensor full(Shape shape, double value, TensorOptions opts = {});
Tensor scalar_tensor(double value, TensorOptions opts = {});
Tensor arange(double start, double end, double step = 1.0, TensorOptions opts = DType::i64);
Tensor arange(int64_t n, TensorOptions opts = DType::i64);
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);
// Copies host values into a new tensor (converted to opts.dtype).
template <typename T>
Tensor from_vector(const std::vector<T>& values, Shape shape, TensorOptions opts = dtype_of<T>::value);
template <typename T>
Tensor tensor(std::initializer_list<T> values, TensorOptions opts = dtype_of<T>::value) {
  return from_vector(std::vector<T>(values), Shape{int64_t(values.size())}, opts);
}

// Counter-based random numbers (Philox4x32-10). The same (seed, offset) gives
// the same stream; each draw advances the offset by the numbers it used.
class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_state(uint64_t seed, uint64_t offset) {
    seed_ = seed;
    offset_ = offset;
  }
  // Reserves `n` numbers and returns the offset of the first.
  uint64_t advance(uint64_t n) {
    uint64_t o = offset_;
    offset_ += (n + 3) / 4 * 4;
    return o;
  }

 private:
  uint64_t seed_;
  uint64_t offset_ = 0;
};

// SplitMix64: the one integer mixer for seeds derived from other seeds
// (sampling streams, dropout masks, data order).
constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

Tensor rand_uniform(Shape shape, Generator& gen, double low = 0.0, double high = 1.0,
                    TensorOptions opts = {});
Tensor rand_normal(Shape shape, Generator& gen, double mean = 0.0, double std = 1.0,
                   TensorOptions opts = {});

}  // namespace areno
