#include <algorithm>
#include <numeric>

#include "tensor/ops_util.h"

namespace areno {
using namespace detail;

namespace {

std::vector<int64_t> normalise_dims(std::vector<int64_t> dims, int64_t ndim) {
  if (dims.empty()) {
    dims.resize(ndim);
    std::iota(dims.begin(), dims.end(), 0);
  }
  for (auto& d : dims) d = wrap_dim(d, std::max<int64_t>(ndim, 1));
  std::sort(dims.begin(), dims.end());
  if (std::adjacent_find(dims.begin(), dims.end()) != dims.end())
    throw std::invalid_argument("reduction dims repeat");
  if (ndim == 0) dims.clear();
  return dims;
}

Shape reduced_shape(const Shape& s, const std::vector<int64_t>& dims, bool keepdim) {
  Shape out;
  for (int64_t i = 0; i < int64_t(s.size()); ++i) {
    bool r = std::find(dims.begin(), dims.end(), i) != dims.end();
    if (!r) out.push_back(s[i]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

// Reduces x over sorted dims; the result has keepdim shape.
Tensor reduce_raw(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, DType out_t) {
  Shape keep_shape = reduced_shape(x.shape(), dims, true);
  Tensor out = empty(keep_shape, TensorOptions(out_t, x.device()));
  Tensor xd = x.detach();
  int64_t outer = 1, n = 1, inner = 1;
  bool range = !dims.empty() && dims.back() - dims.front() + 1 == int64_t(dims.size());
  if (range && xd.is_contiguous()) {
    for (int64_t i = 0; i < dims.front(); ++i) outer *= xd.size(i);
    for (auto d : dims) n *= xd.size(d);
    for (int64_t i = dims.back() + 1; i < xd.dim(); ++i) inner *= xd.size(i);
  } else {
    std::vector<int64_t> perm;
    for (int64_t i = 0; i < xd.dim(); ++i)
      if (std::find(dims.begin(), dims.end(), i) == dims.end()) perm.push_back(i);
    for (auto d : dims) perm.push_back(d);
    for (auto d : dims) n *= xd.size(d);
    xd = xd.permute(perm).contiguous();
    outer = n == 0 ? shape_numel(keep_shape) : xd.numel() / std::max<int64_t>(n, 1);
  }
  if (out.numel() == 0) return out;
  if (n == 0) {
    if (op != ReduceOp::sum && op != ReduceOp::sum_squares)
      throw std::invalid_argument("max/min/argmax/argmin over an empty dimension");
    out.fill_(0);
    return out;
  }
  backend(x.device()).reduce(op, xd, outer, n, inner, out);
  return out;
}

DType sum_dtype(DType t) { return (t == DType::boolean || t == DType::i32) ? DType::i64 : t; }

}  // namespace

Tensor sum(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  dims = normalise_dims(dims, x.dim());
  Tensor r = reduce_raw(ReduceOp::sum, x, dims, sum_dtype(x.dtype()));
  Tensor out = keepdim ? r : r.detach().reshape(reduced_shape(x.shape(), dims, false));
  if (needs_grad({x})) {
    Shape in_shape = x.shape(), keep = r.shape();
    record(out, "sum", {x}, [in_shape, keep](const Tensor& g) {
      return std::vector<Tensor>{g.reshape(keep).expand(in_shape)};
    });
  }
  return out;
}

Tensor sum_squares(const Tensor& x) {
  check_floating(x, "sum_squares");
  const DType out_t = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const Tensor r = reduce_raw(ReduceOp::sum_squares, x, normalise_dims({}, x.dim()), out_t);
  Tensor out = r.detach().reshape({});
  if (needs_grad({x})) {
    const Tensor xd = x.detach();
    record(out, "sum_squares", {x}, [xd](const Tensor& g) {
      return std::vector<Tensor>{mul(xd, mul(g, 2.0).to(xd.dtype()))};
    });
  }
  return out;
}

Tensor mean(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  dims = normalise_dims(dims, x.dim());
  int64_t n = 1;
  for (auto d : dims) n *= x.size(d);
  if (x.dtype() == DType::bf16 || x.dtype() == DType::f16)  // accumulate in f32, round once
    return mean(x.to(DType::f32), dims, keepdim).to(x.dtype());
  Tensor xf = is_floating(x.dtype()) ? x : x.to(DType::f32);
  return mul(sum(xf, dims, keepdim), 1.0 / double(std::max<int64_t>(n, 1)));
}

Tensor var(const Tensor& x, std::vector<int64_t> dims, int64_t correction, bool keepdim) {
  dims = normalise_dims(dims, x.dim());
  int64_t n = 1;
  for (auto d : dims) n *= x.size(d);
  // 16-bit inputs are reduced in f32 (their squares overflow f16) and rounded once.
  bool narrow = x.dtype() == DType::bf16 || x.dtype() == DType::f16;
  Tensor xf = (is_floating(x.dtype()) && !narrow) ? x : x.to(DType::f32);
  Tensor centred = sub(xf, mean(xf, dims, true));
  Tensor v = mul(sum(square(centred), dims, keepdim), 1.0 / double(std::max<int64_t>(n - correction, 0)));
  return narrow ? v.to(x.dtype()) : v;
}

static Tensor minmax_dim(ReduceOp op, const Tensor& x, int64_t dim, bool keepdim) {
  std::vector<int64_t> dims = normalise_dims({dim}, x.dim());
  ReduceOp arg_op = op == ReduceOp::max ? ReduceOp::argmax : ReduceOp::argmin;
  Tensor r = reduce_raw(op, x, dims, x.dtype());
  Tensor out = keepdim ? r : r.detach().reshape(reduced_shape(x.shape(), dims, false));
  if (needs_grad({x})) {
    Tensor idx = reduce_raw(arg_op, x, dims, DType::i64);  // keepdim shape
    Shape in_shape = x.shape();
    int64_t d = dims.empty() ? 0 : dims[0];
    Shape keep = r.shape();
    record(out, "max", {x}, [in_shape, idx, d, keep](const Tensor& g) {
      Tensor z = zeros(in_shape, TensorOptions(g.dtype(), g.device()));
      if (in_shape.empty()) return std::vector<Tensor>{g.reshape({})};
      return std::vector<Tensor>{scatter(z, d, idx, g.reshape(keep))};
    });
  }
  return out;
}
Tensor max(const Tensor& x, int64_t dim, bool keepdim) { return minmax_dim(ReduceOp::max, x, dim, keepdim); }
Tensor min(const Tensor& x, int64_t dim, bool keepdim) { return minmax_dim(ReduceOp::min, x, dim, keepdim); }
Tensor max(const Tensor& x) { return max(x.reshape({-1}), 0, false); }

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  auto dims = normalise_dims({dim}, x.dim());
  Tensor r = reduce_raw(ReduceOp::argmax, x, dims, DType::i64);
  return keepdim ? r : r.reshape(reduced_shape(x.shape(), dims, false));
}
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim) {
  auto dims = normalise_dims({dim}, x.dim());
  Tensor r = reduce_raw(ReduceOp::argmin, x, dims, DType::i64);
  return keepdim ? r : r.reshape(reduced_shape(x.shape(), dims, false));
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  int64_t lead = x.dim() - int64_t(shape.size());
  if (lead < 0) throw std::invalid_argument("sum_to: cannot sum " + x.str() + " to " + shape_str(shape));
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (i < lead) {
      dims.push_back(i);
    } else if (shape[i - lead] == 1 && x.size(i) != 1) {
      dims.push_back(i);
    } else if (shape[i - lead] != x.size(i)) {
      throw std::invalid_argument("sum_to: cannot sum " + x.str() + " to " + shape_str(shape));
    }
  }
  if (dims.empty()) return x.reshape(shape);
  return sum(x, dims, true).reshape(shape);
}

Tensor cumsum(const Tensor& x, int64_t dim) {
  dim = wrap_dim(dim, std::max<int64_t>(x.dim(), 1));
  Tensor xc = x.detach().contiguous();
  if (xc.dtype() == DType::boolean || xc.dtype() == DType::i32) xc = xc.to(DType::i64);
  Tensor out = empty_like(xc);
  if (x.dim() > 0 && out.numel()) {
    int64_t outer = 1, inner = 1;
    for (int64_t i = 0; i < dim; ++i) outer *= x.size(i);
    for (int64_t i = dim + 1; i < x.dim(); ++i) inner *= x.size(i);
    backend(x.device()).cumsum(xc, outer, x.size(dim), inner, out);
  } else if (out.numel()) {
    out.copy_(xc);
  }
  if (needs_grad({x}))
    record(out, "cumsum", {x}, [dim, x](const Tensor& g) {
      if (x.dim() == 0) return std::vector<Tensor>{g};
      // reverse cumsum: flip, cumsum, flip (flip via index_select)
      int64_t n = g.size(dim);
      Tensor rev = arange(double(n - 1), -1.0, -1.0, TensorOptions(DType::i64, g.device()));
      Tensor gf = index_select(g, dim, rev);
      return std::vector<Tensor>{index_select(cumsum(gf, dim), dim, rev)};
    });
  return out;
}

}  // namespace areno
