#include "train/loss.h"

#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "tensor/autograd.h"
#include "tensor/backend.h"
#include "tensor/ops.h"

namespace areno::train {

namespace {

struct Chunk {
  int64_t begin, rows;
  Tensor targets;  // [rows, 1] i64 on the device
};

// The chunk's logits in f32: [rows, V].
Tensor chunk_logits(const Tensor& h, const Tensor& weight, const Chunk& c) {
  return linear(h.narrow(0, c.begin, c.rows), weight).to(DType::f32);
}

}  // namespace

Tensor chunked_cross_entropy_sum(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                 int64_t chunk_rows) {
  if (!hidden.defined() || hidden.dim() != 2 || !weight.defined() || weight.dim() != 2 ||
      hidden.size(1) != weight.size(1))
    throw std::invalid_argument("cross-entropy: hidden must be [T, H] and weight [V, H]");
  if (!targets.defined() || targets.dim() != 1 || targets.size(0) != hidden.size(0) ||
      !is_integral(targets.dtype()))
    throw std::invalid_argument(fmt::format("cross-entropy: targets must be [{}] integers", hidden.size(0)));
  if (chunk_rows < 1) throw std::invalid_argument("cross-entropy: chunk_rows must be at least 1");
  const int64_t V = weight.size(0);
  const Device dev = hidden.device();

  // Only the rows with a target take part.
  std::vector<int64_t> rows, wanted;
  const std::vector<int64_t> tg = targets.to(Device::cpu(), DType::i64).to_vector<int64_t>();
  for (size_t t = 0; t < tg.size(); ++t) {
    if (tg[t] < 0) continue;
    if (tg[t] >= V)
      throw std::invalid_argument(fmt::format("cross-entropy: target {} at row {} is outside the vocabulary of {}",
                                              tg[t], t, V));
    rows.push_back(int64_t(t));
    wanted.push_back(tg[t]);
  }
  const int64_t N = int64_t(rows.size());
  if (N == 0) return zeros({}, TensorOptions(DType::f32, dev));
  const TensorOptions i64(DType::i64, dev);
  Tensor h = index_select(hidden, 0, from_vector(rows, {N}, i64));  // records its own backward
  Tensor all_targets = from_vector(wanted, {N, 1}, i64);

  std::vector<Chunk> chunks;
  Tensor total;
  {
    NoGradGuard ng;
    for (int64_t b = 0; b < N; b += chunk_rows) {
      Chunk c{b, std::min(chunk_rows, N - b), Tensor()};
      c.targets = all_targets.narrow(0, b, c.rows);
      // log_softmax in place in the chunk's own logits buffer: one row kernel
      // (max, exp-sum, subtract) instead of four passes and two more
      // [rows, V] temporaries.
      Tensor lp = chunk_logits(h, weight, c);
      backend(dev).softmax(lp, lp, /*log=*/true);
      Tensor part = neg(sum(gather(lp, 1, c.targets)));
      total = total.defined() ? add(total, part) : part;
      chunks.push_back(std::move(c));
    }
  }
  if (!needs_grad({h, weight})) return total;
  Tensor hd = h.detach(), wd = weight.detach();
  record(total, "chunked_cross_entropy", {h, weight}, [hd, wd, chunks](const Tensor& g) {
    // d/dlogits = softmax - onehot(target), times the incoming gradient.
    std::vector<Tensor> gh;
    Tensor gw;
    const Tensor gf = g.to(DType::f32);
    for (const Chunk& c : chunks) {
      // p = softmax(logits) - onehot(target), in the recomputed logits'
      // buffer; the incoming gradient scales the small operands instead of p.
      Tensor p = chunk_logits(hd, wd, c);
      backend(p.device()).softmax(p, p, /*log=*/false);
      backend(p.device()).scatter(p, 1, c.targets, full({c.rows, 1}, -1.0, TensorOptions(DType::f32, p.device())),
                                  /*accumulate=*/true);
      // The rows' gradient in the weight's dtype; the weight's in f32 (a bf16
      // sum over chunks would lose the small contributions), accumulated in
      // place over the chunks.
      gh.push_back(mul(matmul(p.to(wd.dtype()), wd), gf));
      Tensor hc = mul(hd.narrow(0, c.begin, c.rows).to(DType::f32), gf).contiguous();
      if (!gw.defined()) gw = matmul(p.t(), hc);
      else backend(p.device()).matmul(p.t().unsqueeze(0), hc.unsqueeze(0), gw.unsqueeze(0), 1.0, 1.0);
    }
    return std::vector<Tensor>{gh.size() == 1 ? gh[0] : cat(gh, 0), gw};
  });
  return total;
}

}  // namespace areno::train
