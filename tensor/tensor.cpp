#include "tensor/tensor.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include "tensor/autograd.h"
#include "tensor/backend.h"
#include "tensor/ops.h"

namespace areno {

Tensor make_tensor(std::shared_ptr<Storage> storage, int64_t offset, Shape shape, Shape strides,
                   DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->device = storage->device();
  impl->storage = std::move(storage);
  impl->offset = offset;
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

int64_t Tensor::size(int64_t d) const { return impl_->shape[wrap_dim(d, dim())]; }
int64_t Tensor::stride(int64_t d) const { return impl_->strides[wrap_dim(d, dim())]; }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (impl_->shape[i] == 1) continue;
    if (impl_->strides[i] != expected) return false;
    expected *= impl_->shape[i];
  }
  return true;
}

void* Tensor::data_ptr() const {
  return static_cast<char*>(impl_->storage->data()) + impl_->offset * int64_t(element_size());
}

template <typename T>
T* Tensor::data() const {
  if (dtype() != dtype_of<T>::value)
    throw std::invalid_argument(fmt::format("data<{}>() on a {} tensor",
                                            dtype_name(dtype_of<T>::value), dtype_name(dtype())));
  if (!device().is_cpu())
    throw std::invalid_argument("data<T>() needs a CPU tensor, this one is on " + device().str());
  return static_cast<T*>(data_ptr());
}
template float* Tensor::data<float>() const;
template double* Tensor::data<double>() const;
template BFloat16* Tensor::data<BFloat16>() const;
template Half* Tensor::data<Half>() const;
template int32_t* Tensor::data<int32_t>() const;
template int64_t* Tensor::data<int64_t>() const;
template bool* Tensor::data<bool>() const;

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return fmt::format("Tensor{} {} {}", shape_str(shape()), dtype_name(dtype()), device().str());
}

// ---------------------------------------------------------------- views

static Tensor make_view(const Tensor& base, int64_t offset, Shape shape, Shape strides) {
  return make_tensor(base.storage(), offset, std::move(shape), std::move(strides), base.dtype());
}

// Strides for viewing `t` as `shape` without a copy, or empty when impossible
// (PyTorch's computeStride algorithm).
static std::optional<Shape> view_strides(const Tensor& t, const Shape& shape) {
  const Shape& old_shape = t.shape();
  const Shape& old_strides = t.strides();
  Shape new_strides(shape.size());
  if (t.numel() == 0 || old_shape.empty()) return contiguous_strides(shape);
  int64_t view_d = int64_t(shape.size()) - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t tensor_d = int64_t(old_shape.size()) - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= old_shape[tensor_d];
    if (tensor_d == 0 ||
        (old_shape[tensor_d - 1] != 1 &&
         old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        new_strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (tensor_d > 0) {
        chunk_base_stride = old_strides[tensor_d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}

static Shape infer_shape(Shape shape, int64_t numel, const Tensor& t) {
  int64_t infer = -1, known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0) throw std::invalid_argument("only one dimension can be -1 in a view");
      infer = int64_t(i);
    } else if (shape[i] < 0) {
      throw std::invalid_argument("negative size in view shape " + shape_str(shape));
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel % known != 0)
      throw std::invalid_argument("cannot view " + t.str() + " as " + shape_str(shape));
    shape[infer] = numel / known;
  } else if (known != numel) {
    throw std::invalid_argument("cannot view " + t.str() + " as " + shape_str(shape) +
                                ": element counts differ");
  }
  return shape;
}

// Records a view's backward: reshape the gradient back to the input's shape.
static Tensor record_reshape_like(Tensor out, const Tensor& in, const char* name) {
  if (needs_grad({in})) {
    Shape in_shape = in.shape();
    record(out, name, {in}, [in_shape](const Tensor& g) {
      return std::vector<Tensor>{g.reshape(in_shape)};
    });
  }
  return out;
}

Tensor Tensor::view(Shape shape) const {
  shape = infer_shape(std::move(shape), numel(), *this);
  auto st = view_strides(*this, shape);
  if (!st)
    throw std::invalid_argument("view of " + str() + " as " + shape_str(shape) +
                                " needs a copy; use reshape()");
  return record_reshape_like(make_view(*this, offset(), shape, *st), *this, "view");
}

Tensor Tensor::reshape(Shape shape) const {
  shape = infer_shape(std::move(shape), numel(), *this);
  if (auto st = view_strides(*this, shape))
    return record_reshape_like(make_view(*this, offset(), shape, *st), *this, "reshape");
  return contiguous().view(shape);
}

Tensor Tensor::permute(std::vector<int64_t> dims) const {
  if (int64_t(dims.size()) != dim())
    throw std::invalid_argument(fmt::format("permute of a {}-d tensor got {} dims", dim(), dims.size()));
  Shape sh(dims.size()), st(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    dims[i] = wrap_dim(dims[i], dim());
    if (seen[dims[i]]) throw std::invalid_argument("permute got a repeated dim");
    seen[dims[i]] = true;
    sh[i] = shape()[dims[i]];
    st[i] = strides()[dims[i]];
  }
  Tensor out = make_view(*this, offset(), sh, st);
  if (needs_grad({*this})) {
    std::vector<int64_t> inv(dims.size());
    for (size_t i = 0; i < dims.size(); ++i) inv[dims[i]] = int64_t(i);
    record(out, "permute", {*this}, [inv](const Tensor& g) {
      return std::vector<Tensor>{g.permute(inv)};
    });
  }
  return out;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  std::vector<int64_t> p(dim());
  std::iota(p.begin(), p.end(), 0);
  std::swap(p[wrap_dim(d0, dim())], p[wrap_dim(d1, dim())]);
  return permute(p);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  d = wrap_dim(d, dim());
  int64_t n = shape()[d];
  if (step <= 0) throw std::invalid_argument("slice step must be positive");
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape sh = shape(), st = strides();
  sh[d] = (end - start + step - 1) / step;
  st[d] *= step;
  Tensor out = make_view(*this, offset() + start * strides()[d], sh, st);
  if (needs_grad({*this})) {
    Shape in_shape = shape();
    record(out, "slice", {*this}, [in_shape, d, start, end, step](const Tensor& g) {
      Tensor gi = zeros(in_shape, TensorOptions(g.dtype(), g.device()));
      gi.slice(d, start, end, step).copy_(g);
      return std::vector<Tensor>{gi};
    });
  }
  return out;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = wrap_dim(d, dim());
  if (start < 0) start += shape()[d];
  if (start < 0 || length < 0 || start + length > shape()[d])
    throw std::out_of_range(fmt::format("narrow({}, {}, {}) out of range for {}", d, start, length,
                                        str()));
  return slice(d, start, start + length);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_dim(d, dim());
  int64_t n = shape()[d];
  if (index < -n || index >= n)
    throw std::out_of_range(fmt::format("select index {} out of range for dim {} of {}", index, d,
                                        str()));
  if (index < 0) index += n;
  return narrow(d, index, 1).squeeze(d);
}

Tensor Tensor::expand(Shape shape) const {
  if (int64_t(shape.size()) < dim())
    throw std::invalid_argument("expand to " + shape_str(shape) + " has fewer dims than " + str());
  size_t lead = shape.size() - size_t(dim());
  Shape st(shape.size(), 0);
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i < lead) {
      if (shape[i] < 0) throw std::invalid_argument("expand: -1 not allowed in a new leading dim");
      continue;
    }
    int64_t cur = this->shape()[i - lead];
    if (shape[i] == -1) shape[i] = cur;
    if (cur == shape[i]) {
      st[i] = strides()[i - lead];
    } else if (cur == 1) {
      st[i] = 0;
    } else {
      throw std::invalid_argument("cannot expand " + str() + " to " + shape_str(shape));
    }
  }
  Tensor out = make_view(*this, offset(), shape, st);
  if (needs_grad({*this})) {
    Shape in_shape = this->shape();
    record(out, "expand", {*this}, [in_shape](const Tensor& g) {
      return std::vector<Tensor>{sum_to(g, in_shape)};
    });
  }
  return out;
}

Tensor Tensor::squeeze(int64_t d) const {
  d = wrap_dim(d, dim());
  if (shape()[d] != 1) return *this;
  Shape sh = shape(), st = strides();
  sh.erase(sh.begin() + d);
  st.erase(st.begin() + d);
  return record_reshape_like(make_view(*this, offset(), sh, st), *this, "squeeze");
}

Tensor Tensor::squeeze() const {
  Shape sh, st;
  for (int64_t i = 0; i < dim(); ++i)
    if (shape()[i] != 1) {
      sh.push_back(shape()[i]);
      st.push_back(strides()[i]);
    }
  return record_reshape_like(make_view(*this, offset(), sh, st), *this, "squeeze");
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1);
  Shape sh = shape(), st = strides();
  int64_t s = d < dim() ? strides()[d] * shape()[d] : 1;
  sh.insert(sh.begin() + d, 1);
  st.insert(st.begin() + d, s);
  return record_reshape_like(make_view(*this, offset(), sh, st), *this, "unsqueeze");
}

Tensor Tensor::flatten(int64_t start, int64_t end) const {
  if (dim() == 0) return reshape({1});
  start = wrap_dim(start, dim());
  end = wrap_dim(end, dim());
  Shape sh;
  for (int64_t i = 0; i < start; ++i) sh.push_back(shape()[i]);
  int64_t m = 1;
  for (int64_t i = start; i <= end; ++i) m *= shape()[i];
  sh.push_back(m);
  for (int64_t i = end + 1; i < dim(); ++i) sh.push_back(shape()[i]);
  return reshape(sh);
}

Tensor Tensor::unflatten(int64_t d, Shape sizes) const {
  d = wrap_dim(d, dim());
  Shape sh(shape().begin(), shape().begin() + d);
  sh.insert(sh.end(), sizes.begin(), sizes.end());
  sh.insert(sh.end(), shape().begin() + d + 1, shape().end());
  return view(sh);
}

// ---------------------------------------------------------------- copies

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), TensorOptions(dtype(), device()));
  out.copy_(*this);
  if (needs_grad({*this}))
    record(out, "clone", {*this}, [](const Tensor& g) { return std::vector<Tensor>{g}; });
  return out;
}

Tensor Tensor::to(Device d, DType t) const {
  if (d == device() && t == dtype()) return *this;
  Tensor out = empty(shape(), TensorOptions(t, d));
  out.copy_(*this);
  if (needs_grad({*this})) {
    Device src_dev = device();
    DType src_t = dtype();
    record(out, "to", {*this}, [src_dev, src_t](const Tensor& g) {
      return std::vector<Tensor>{g.to(src_dev, src_t)};
    });
  }
  return out;
}
Tensor Tensor::to(Device d) const { return to(d, dtype()); }
Tensor Tensor::to(DType t) const { return to(device(), t); }

Tensor& Tensor::copy_(const Tensor& src) {
  Tensor s = src;
  if (s.shape() != shape()) s = src.detach().expand(shape());
  if (s.numel() == 0) return *this;
  // A CUDA backend handles copies where either side is on its device.
  Device d = device().is_cuda() ? device() : s.device();
  NoGradGuard ng;
  backend(d).copy(s, *this);
  return *this;
}

Tensor& Tensor::fill_(double value) {
  if (numel() == 0) return *this;
  backend(device()).fill(*this, value);
  return *this;
}

// ---------------------------------------------------------------- autograd

Tensor& Tensor::set_requires_grad(bool r) {
  if (r && !is_floating(dtype()))
    throw std::invalid_argument("only floating-point tensors can require grad, not " + str());
  if (!is_leaf())
    throw std::invalid_argument("set_requires_grad on a non-leaf tensor; use detach() first");
  impl_->requires_grad = r;
  return *this;
}

void Tensor::backward(const Tensor& grad) const { run_backward(*this, grad); }

Tensor Tensor::detach() const {
  return make_tensor(storage(), offset(), shape(), strides(), dtype());
}

double Tensor::item() const {
  if (numel() != 1)
    throw std::invalid_argument("item() needs a single-element tensor, got " + str());
  return to_vector<double>()[0];
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  Tensor c = detach().to(Device::cpu(), dtype_of<T>::value).contiguous();
  const T* p = c.data<T>();
  return std::vector<T>(p, p + c.numel());
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<BFloat16> Tensor::to_vector<BFloat16>() const;
template std::vector<Half> Tensor::to_vector<Half>() const;

template <>
std::vector<bool> Tensor::to_vector<bool>() const {
  Tensor c = detach().to(Device::cpu(), DType::boolean).contiguous();
  const bool* p = c.data<bool>();
  return std::vector<bool>(p, p + c.numel());
}

// ---------------------------------------------------------------- creation

namespace {
// The bytes a new contiguous tensor of `shape` needs; a negative size is an error.
size_t creation_bytes(const Shape& shape, DType dtype) {
  for (auto d : shape)
    if (d < 0) throw std::invalid_argument("negative size in shape " + shape_str(shape));
  return size_t(shape_numel(shape)) * dtype_size(dtype);
}
}  // namespace

Tensor empty(Shape shape, TensorOptions opts) {
  auto storage = backend(opts.device).allocate(creation_bytes(shape, opts.dtype), opts.device);
  Shape st = contiguous_strides(shape);
  return make_tensor(std::move(storage), 0, std::move(shape), std::move(st), opts.dtype);
}

Tensor full(Shape shape, double value, TensorOptions opts) {
  Tensor t = empty(std::move(shape), opts);
  t.fill_(value);
  return t;
}
Tensor zeros(Shape shape, TensorOptions opts) { return full(std::move(shape), 0.0, opts); }
Tensor lazy_zeros(Shape shape, TensorOptions opts) {
  auto storage =
      backend(opts.device).allocate_lazy_zeroed(creation_bytes(shape, opts.dtype), opts.device);
  if (!storage) return zeros(std::move(shape), opts);
  Shape st = contiguous_strides(shape);
  return make_tensor(std::move(storage), 0, std::move(shape), std::move(st), opts.dtype);
}
Tensor ones(Shape shape, TensorOptions opts) { return full(std::move(shape), 1.0, opts); }
Tensor scalar_tensor(double value, TensorOptions opts) { return full({}, value, opts); }
Tensor empty_like(const Tensor& t) { return empty(t.shape(), TensorOptions(t.dtype(), t.device())); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), TensorOptions(t.dtype(), t.device())); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), TensorOptions(t.dtype(), t.device())); }
Tensor full_like(const Tensor& t, double v) {
  return full(t.shape(), v, TensorOptions(t.dtype(), t.device()));
}

Tensor arange(double start, double end, double step, TensorOptions opts) {
  if (step == 0) throw std::invalid_argument("arange step must be non-zero");
  double n = std::ceil((end - start) / step);
  Tensor t = empty({int64_t(std::max(0.0, n))}, opts);
  if (t.numel() > 0) backend(opts.device).arange(t, start, step);
  return t;
}
Tensor arange(int64_t n, TensorOptions opts) { return arange(0.0, double(n), 1.0, opts); }

template <typename T>
Tensor from_vector(const std::vector<T>& values, Shape shape, TensorOptions opts) {
  if (shape_numel(shape) != int64_t(values.size()))
    throw std::invalid_argument(fmt::format("from_vector: {} values for shape {}", values.size(),
                                            shape_str(shape)));
  Tensor host = empty(shape, TensorOptions(dtype_of<T>::value, Device::cpu()));
  std::copy(values.begin(), values.end(), host.data<T>());
  return host.to(opts.device, opts.dtype);
}
template Tensor from_vector(const std::vector<float>&, Shape, TensorOptions);
template Tensor from_vector(const std::vector<double>&, Shape, TensorOptions);
template Tensor from_vector(const std::vector<int32_t>&, Shape, TensorOptions);
template Tensor from_vector(const std::vector<int64_t>&, Shape, TensorOptions);
template Tensor from_vector(const std::vector<BFloat16>&, Shape, TensorOptions);
template Tensor from_vector(const std::vector<Half>&, Shape, TensorOptions);
template <>
Tensor from_vector(const std::vector<bool>& values, Shape shape, TensorOptions opts) {
  std::vector<int32_t> v(values.begin(), values.end());
  return from_vector(v, std::move(shape), opts);
}

}  // namespace areno
