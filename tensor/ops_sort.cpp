// Sort and top-k along one dimension (kernels/cpu/sort.cpp, kernels/cuda/sort.cu).
#include <fmt/format.h>

#include "tensor/ops_util.h"

namespace areno {
using namespace detail;

std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim, bool largest) {
  RowsView rv = to_rows(x, dim);
  int64_t n = rv.rows.size(1);
  if (k < 0 || k > n)
    throw std::invalid_argument(fmt::format("topk: k = {} but dimension has {} elements", k, n));
  Tensor vals = empty({rv.rows.size(0), k}, TensorOptions(x.dtype(), x.device()));
  Tensor idx = empty({rv.rows.size(0), k}, TensorOptions(DType::i64, x.device()));
  if (vals.numel()) backend(x.device()).sort(rv.rows, k, largest, vals, idx);
  Tensor v = from_rows(vals, rv), i = from_rows(idx, rv).contiguous();
  if (x.dim() == 0) {
    v = v.reshape({});
    i = i.reshape({});
  }
  if (needs_grad({x})) {
    int64_t d = rv.dim;
    Shape in_shape = x.shape();
    record(v, "topk", {x}, [in_shape, i, d](const Tensor& g) {
      Tensor z = zeros(in_shape, TensorOptions(g.dtype(), g.device()));
      if (in_shape.empty()) return std::vector<Tensor>{g};
      return std::vector<Tensor>{scatter_add(z, d, i, g)};
    });
  }
  return {v, i};
}

std::pair<Tensor, Tensor> sort(const Tensor& x, int64_t dim, bool descending) {
  int64_t n = x.dim() == 0 ? 1 : x.size(dim);
  return topk(x, n, dim, descending);
}

}  // namespace areno
