#include "tensor/ops_util.h"

namespace areno {
using namespace detail;

namespace {

Tensor as_index(const Tensor& index, const char* op) {
  if (!is_integral(index.dtype()))
    throw std::invalid_argument(fmt::format("{}: index must be an integer tensor, got {}", op, index.str()));
  return index.detach().to(DType::i64).contiguous();
}

// Throws unless every index lies in [0, n).
void check_range(const Tensor& idx, int64_t n, const char* op) {
  if (idx.numel() == 0) return;
  if (idx.device().is_cpu() && idx.is_contiguous() && idx.dtype() == DType::i64) {
    // On the host, one pass over the values (the device path below is four
    // ops and two scalar reads, which a decode step paid per index op).
    const int64_t* p = static_cast<const int64_t*>(idx.data_ptr());
    for (int64_t i = 0; i < idx.numel(); ++i)
      if (p[i] < 0 || p[i] >= n)
        throw std::out_of_range(fmt::format("{}: index {} out of range for a dimension of size {}", op, p[i], n));
    return;
  }
  NoGradGuard ng;
  int64_t lo = int64_t(argmin(idx.reshape({-1}), 0).item()), hi = int64_t(argmax(idx.reshape({-1}), 0).item());
  auto flat = idx.reshape({-1});
  int64_t vlo = int64_t(flat.select(0, lo).item()), vhi = int64_t(flat.select(0, hi).item());
  if (vlo < 0 || vhi >= n)
    throw std::out_of_range(fmt::format("{}: index {} out of range for a dimension of size {}", op,
                                        vlo < 0 ? vlo : vhi, n));
}

struct Split3 {
  int64_t outer = 1, n = 1, inner = 1;
};
Split3 split3(const Shape& s, int64_t dim) {
  Split3 r;
  for (int64_t i = 0; i < dim; ++i) r.outer *= s[i];
  r.n = s.empty() ? 1 : s[dim];
  for (int64_t i = dim + 1; i < int64_t(s.size()); ++i) r.inner *= s[i];
  return r;
}

}  // namespace

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  dim = wrap_dim(dim, std::max<int64_t>(x.dim(), 1));
  if (index.dim() > 1) throw std::invalid_argument("index_select: index must be 1-D, got " + index.str());
  check_same_device(x, index, "index_select");
  Tensor idx = as_index(index, "index_select").reshape({-1});
  Split3 s = split3(x.shape(), dim);
  check_range(idx, s.n, "index_select");
  Shape out_shape = x.shape();
  if (!out_shape.empty()) out_shape[dim] = idx.numel();
  Tensor out = empty(out_shape, TensorOptions(x.dtype(), x.device()));
  if (out.numel())
    backend(x.device()).index_select(x.detach().contiguous().reshape({s.outer, s.n, s.inner}), idx,
                                     out.view({s.outer, idx.numel(), s.inner}));
  if (needs_grad({x})) {
    Shape in_shape = x.shape();
    record(out, "index_select", {x}, [in_shape, dim, idx](const Tensor& g) {
      Tensor z = zeros(in_shape, TensorOptions(g.dtype(), g.device()));
      return std::vector<Tensor>{index_add(z, dim, idx, g)};
    });
  }
  return out;
}

Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  dim = wrap_dim(dim, std::max<int64_t>(x.dim(), 1));
  check_same_device(x, index, "index_add");
  check_same_device(x, src, "index_add");
  Tensor idx = as_index(index, "index_add").reshape({-1});
  Split3 s = split3(x.shape(), dim);
  check_range(idx, s.n, "index_add");
  Shape src_shape = x.shape();
  if (!src_shape.empty()) src_shape[dim] = idx.numel();
  if (src.shape() != src_shape)
    throw std::invalid_argument(fmt::format("index_add: src {} should have shape {}", src.str(),
                                            shape_str(src_shape)));
  Tensor out = x.detach().clone();
  if (idx.numel() && out.numel())
    backend(x.device()).index_add(out.view({s.outer, s.n, s.inner}), idx,
                                  src.detach().to(x.dtype()).contiguous().view({s.outer, idx.numel(), s.inner}));
  if (needs_grad({x, src}))
    record(out, "index_add", {x, src}, [dim, idx](const Tensor& g) {
      return std::vector<Tensor>{g, index_select(g, dim, idx)};
    });
  return out;
}

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  if (weight.dim() != 2) throw std::invalid_argument("embedding: weight must be [V, C], got " + weight.str());
  Shape out_shape = ids.shape();
  out_shape.push_back(weight.size(1));
  return index_select(weight, 0, ids.reshape({-1})).reshape(out_shape);
}

static void check_gather_shapes(const Tensor& x, int64_t dim, const Tensor& index, const char* op) {
  if (index.dim() != x.dim())
    throw std::invalid_argument(fmt::format("{}: index {} must have as many dims as {}", op, index.str(), x.str()));
  for (int64_t i = 0; i < x.dim(); ++i)
    if (i != dim && index.size(i) > x.size(i))
      throw std::invalid_argument(fmt::format("{}: index {} larger than {} in dim {}", op, index.str(), x.str(), i));
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  dim = wrap_dim(dim, std::max<int64_t>(x.dim(), 1));
  check_same_device(x, index, "gather");
  check_gather_shapes(x, dim, index, "gather");
  Tensor idx = as_index(index, "gather");
  check_range(idx, x.dim() ? x.size(dim) : 1, "gather");
  Tensor out = empty(idx.shape(), TensorOptions(x.dtype(), x.device()));
  if (out.numel()) backend(x.device()).gather(x.detach().contiguous(), dim, idx, out);
  if (needs_grad({x})) {
    Shape in_shape = x.shape();
    record(out, "gather", {x}, [in_shape, dim, idx](const Tensor& g) {
      Tensor z = zeros(in_shape, TensorOptions(g.dtype(), g.device()));
      return std::vector<Tensor>{scatter_add(z, dim, idx, g)};
    });
  }
  return out;
}

static Tensor scatter_impl(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
                           bool accumulate) {
  const char* op = accumulate ? "scatter_add" : "scatter";
  dim = wrap_dim(dim, std::max<int64_t>(x.dim(), 1));
  check_same_device(x, index, op);
  check_same_device(x, src, op);
  check_gather_shapes(x, dim, index, op);
  for (int64_t i = 0; i < index.dim(); ++i)
    if (index.size(i) > src.size(i))
      throw std::invalid_argument(fmt::format("{}: index {} larger than src {}", op, index.str(), src.str()));
  Tensor idx = as_index(index, op);
  check_range(idx, x.dim() ? x.size(dim) : 1, op);
  // src restricted to the index's extent
  Tensor s = src.detach();
  for (int64_t i = 0; i < s.dim(); ++i) s = s.narrow(i, 0, idx.size(i));
  Tensor out = x.detach().clone();
  if (idx.numel()) backend(x.device()).scatter(out, dim, idx, s.to(x.dtype()).contiguous(), accumulate);
  if (needs_grad({x, src})) {
    Shape src_shape = src.shape();
    record(out, op, {x, src}, [dim, idx, accumulate, src_shape](const Tensor& g) {
      Tensor gx = accumulate ? g : scatter(g, dim, idx, zeros(idx.shape(), TensorOptions(g.dtype(), g.device())));
      Tensor gs = gather(g, dim, idx);
      if (gs.shape() != src_shape) {
        std::vector<int64_t> pads;
        for (int64_t i = int64_t(src_shape.size()) - 1; i >= 0; --i) {
          pads.push_back(0);
          pads.push_back(src_shape[i] - gs.size(i));
        }
        gs = pad(gs, pads);
      }
      return std::vector<Tensor>{gx, gs};
    });
  }
  return out;
}
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  return scatter_impl(x, dim, index, src, true);
}
Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  return scatter_impl(x, dim, index, src, false);
}

Tensor masked_scatter(const Tensor& x, const Tensor& mask, const Tensor& src) {
  check_same_device(x, mask, "masked_scatter");
  check_same_device(x, src, "masked_scatter");
  if (mask.dtype() != DType::boolean)
    throw std::invalid_argument("masked_scatter: mask must be bool, got " + mask.str());
  Tensor m = mask.detach().expand(x.shape()).contiguous();
  int64_t count = int64_t(sum(m).item());
  if (count > src.numel())
    throw std::invalid_argument(fmt::format("masked_scatter: mask selects {} elements but src {} has {}",
                                            count, src.str(), src.numel()));
  Tensor out = x.detach().clone();
  if (count) backend(x.device()).masked_scatter(out, m, src.detach().to(x.dtype()).contiguous());
  if (needs_grad({x, src})) {
    Shape src_shape = src.shape();
    record(out, "masked_scatter", {x, src}, [m, src_shape](const Tensor& g) {
      Tensor gx = where(m, zeros({}, TensorOptions(g.dtype(), g.device())), g);
      // Position k of the mask's true elements came from src.flat[k].
      int64_t ns = shape_numel(src_shape);
      Tensor pos = sub(cumsum(m.reshape({-1}), 0), ones({}, TensorOptions(DType::i64, g.device())));
      Tensor slot = where(m.reshape({-1}), pos, full({}, double(ns), TensorOptions(DType::i64, g.device())));
      Tensor acc = zeros({ns + 1}, TensorOptions(g.dtype(), g.device()));
      Tensor gs = scatter_add(acc, 0, slot, g.reshape({-1})).narrow(0, 0, ns).reshape(src_shape);
      return std::vector<Tensor>{gx, gs};
    });
  }
  return out;
}

}  // namespace areno
