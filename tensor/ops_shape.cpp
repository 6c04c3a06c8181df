#include "tensor/ops_util.h"

namespace areno {
using namespace detail;

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  if (xs.empty()) throw std::invalid_argument("cat of an empty list");
  const Tensor& ref = xs[0];
  dim = wrap_dim(dim, std::max<int64_t>(ref.dim(), 1));
  DType t = ref.dtype();
  int64_t total = 0;
  for (auto& x : xs) {
    check_same_device(ref, x, "cat");
    if (x.dim() != ref.dim())
      throw std::invalid_argument(fmt::format("cat: {} and {} differ in rank", ref.str(), x.str()));
    for (int64_t i = 0; i < x.dim(); ++i)
      if (i != dim && x.size(i) != ref.size(i))
        throw std::invalid_argument(fmt::format("cat along {}: {} and {} differ in dim {}", dim, ref.str(), x.str(), i));
    t = promote_types(t, x.dtype());
    total += x.size(dim);
  }
  Shape s = ref.shape();
  s[dim] = total;
  Tensor out = empty(s, TensorOptions(t, ref.device()));
  std::vector<int64_t> sizes;
  int64_t off = 0;
  for (auto& x : xs) {
    if (x.size(dim)) out.detach().narrow(dim, off, x.size(dim)).copy_(x);
    off += x.size(dim);
    sizes.push_back(x.size(dim));
  }
  if (needs_grad(xs))
    record(out, "cat", xs, [dim, sizes](const Tensor& g) { return split_sizes(g, sizes, dim); });
  return out;
}

Tensor stack(const std::vector<Tensor>& xs, int64_t dim) {
  if (xs.empty()) throw std::invalid_argument("stack of an empty list");
  dim = wrap_dim(dim, xs[0].dim() + 1);
  std::vector<Tensor> us;
  for (auto& x : xs) {
    if (x.shape() != xs[0].shape())
      throw std::invalid_argument(fmt::format("stack: {} and {} differ in shape", xs[0].str(), x.str()));
    us.push_back(x.unsqueeze(dim));
  }
  return cat(us, dim);
}

std::vector<Tensor> split_sizes(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  dim = wrap_dim(dim, std::max<int64_t>(x.dim(), 1));
  int64_t total = 0;
  for (auto s : sizes) total += s;
  if (total != x.size(dim))
    throw std::invalid_argument(fmt::format("split sizes add up to {} but dim {} of {} has {}", total, dim,
                                            x.str(), x.size(dim)));
  std::vector<Tensor> out;
  int64_t off = 0;
  for (auto s : sizes) {
    out.push_back(x.narrow(dim, off, s));
    off += s;
  }
  return out;
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  if (split_size <= 0) throw std::invalid_argument("split size must be positive");
  int64_t n = x.size(dim);
  std::vector<int64_t> sizes;
  for (int64_t o = 0; o < n; o += split_size) sizes.push_back(std::min(split_size, n - o));
  return split_sizes(x, sizes, dim);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  if (chunks <= 0) throw std::invalid_argument("chunk count must be positive");
  int64_t n = x.size(dim);
  return split(x, std::max<int64_t>((n + chunks - 1) / chunks, 1), dim);
}

Tensor pad(const Tensor& x, const std::vector<int64_t>& pads, double value) {
  if (pads.size() % 2 || int64_t(pads.size()) / 2 > x.dim())
    throw std::invalid_argument(fmt::format("pad: {} values for a {}-d tensor", pads.size(), x.dim()));
  Shape s = x.shape();
  Tensor src = x;  // negative pads crop
  std::vector<int64_t> off(x.dim(), 0);
  for (size_t i = 0; i < pads.size() / 2; ++i) {
    int64_t d = x.dim() - 1 - int64_t(i);
    int64_t before = pads[2 * i], after = pads[2 * i + 1];
    if (before < 0) {
      src = src.narrow(d, -before, src.size(d) + before);
      before = 0;
    }
    if (after < 0) {
      src = src.narrow(d, 0, src.size(d) + after);
      after = 0;
    }
    off[d] = before;
    s[d] = src.size(d) + before + after;
  }
  Tensor out = full(s, value, TensorOptions(x.dtype(), x.device()));
  Tensor dst = out.detach();
  for (int64_t d = 0; d < x.dim(); ++d) dst = dst.narrow(d, off[d], src.size(d));
  if (dst.numel()) dst.copy_(src.detach());
  if (needs_grad({src}))
    record(out, "pad", {src}, [off, src](const Tensor& g) {
      Tensor r = g;
      for (int64_t d = 0; d < g.dim(); ++d) r = r.narrow(d, off[d], src.size(d));
      return std::vector<Tensor>{r};
    });
  return out;
}

}  // namespace areno
