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

}  // namespace

CrossEntropyRows cross_entropy_rows_composed(Tensor logits, const Tensor& targets, bool want_grad) {
  const int64_t n = logits.size(0);
  Backend& be = backend(logits.device());
  // log_softmax in place, then p = exp(log p) - onehot(target) in place.
  logits = logits.to(DType::f32).contiguous();
  be.softmax(logits, logits, /*log=*/true);
  const Tensor nll = neg(gather(logits, 1, targets).reshape({n}));
  if (!want_grad) return {nll, Tensor()};
  be.unary(UnaryOp::exp, logits, logits, 0, 0);
  be.scatter(logits, 1, targets, full({n, 1}, -1.0, TensorOptions(DType::f32, logits.device())), /*accumulate=*/true);
  return {nll, logits};
}

CrossEntropyRows cross_entropy_rows(Tensor logits, const Tensor& targets, bool want_grad) {
  const int64_t n = logits.size(0);
  Tensor nll = empty({n}, TensorOptions(DType::f32, logits.device()));
  const Tensor t = targets.reshape({n});
  if (logits.dtype() != DType::bf16 || !cross_entropy_rows_layout_ok(logits, t, nll)) logits = logits.to(DType::f32);
  if (backend(logits.device()).cross_entropy_rows(logits, t, nll)) return {nll, logits};
  return cross_entropy_rows_composed(logits, targets, want_grad);
}

void add_head_weight_grad(Tensor& acc, const Tensor& dlogits, const Tensor& rows, DType weight_dtype) {
  const Device dev = dlogits.device();
  Backend& be = backend(dev);
  if (weight_dtype == DType::bf16 || weight_dtype == DType::f16) {
    const Tensor lpw = dlogits.to(weight_dtype), hw = rows.to(weight_dtype).contiguous();
    const Tensor into = acc.defined() ? acc : empty({lpw.size(1), hw.size(1)}, TensorOptions(DType::f32, dev));
    if (be.matmul_f32_out(lpw.t().unsqueeze(0), hw.unsqueeze(0), into.unsqueeze(0), 1.0, acc.defined() ? 1.0 : 0.0)) {
      acc = into;
      return;
    }
  }
  const Tensor hc = rows.to(DType::f32).contiguous(), lpf = dlogits.to(DType::f32);
  if (!acc.defined()) acc = matmul(lpf.t(), hc);
  else be.matmul(lpf.t().unsqueeze(0), hc.unsqueeze(0), acc.unsqueeze(0), 1.0, 1.0);
}

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

  // One pass over the chunks. With a tape, each chunk's gradient is taken
  // while its logits are at hand: d/dlogits = softmax - onehot(target), in
  // the log-softmax's own buffer, and its two products (to the rows and to
  // the weight) run here, so the backward only scales them by the incoming
  // gradient. Three head products per chunk instead of four (the backward
  // recomputed the logits), and no logits kept.
  const bool grad = needs_grad({h, weight});
  // Only the products someone needs (a frozen head, as in LoRA-only runs,
  // skips the weight's).
  const bool grad_h = grad && h.requires_grad(), grad_w = grad && weight.requires_grad();
  Tensor total, gh_all, gw;
  std::vector<Tensor> gh;
  {
    NoGradGuard ng;
    const Tensor wd = weight.detach(), hd = h.detach();
    for (int64_t b = 0; b < N; b += chunk_rows) {
      Chunk c{b, std::min(chunk_rows, N - b), Tensor()};
      c.targets = all_targets.narrow(0, b, c.rows);
      // The chunk's logits [rows, V] in the weight's dtype.
      Tensor lp = linear(hd.narrow(0, c.begin, c.rows), wd);
      // Each row's loss, and d/dlogits = softmax - onehot(target) in the
      // logits' buffer. bf16 logits stay bf16 (the row kernel widens each row
      // and rounds d/dlogits once, which the products below use anyway): no
      // f32 copy of the chunk and no cast back.
      const CrossEntropyRows ce = cross_entropy_rows(lp, c.targets, grad);
      total = total.defined() ? add(total, sum(ce.nll)) : sum(ce.nll);
      if (!grad) continue;
      lp = ce.grad;
      // The rows' gradient in the weight's dtype; the weight's in f32,
      // accumulated in place over the chunks.
      if (grad_h) gh.push_back(matmul(lp.to(wd.dtype()), wd));
      if (grad_w) add_head_weight_grad(gw, lp, hd.narrow(0, c.begin, c.rows), wd.dtype());
    }
    if (grad_h) gh_all = gh.size() == 1 ? gh[0] : cat(gh, 0);
  }
  if (!grad) return total;
  record(total, "chunked_cross_entropy", {h, weight}, [gh_all, gw](const Tensor& g) {
    // The incoming gradient (1 / the step's target tokens in SFT) scales both.
    const Tensor gf = g.to(DType::f32);
    return std::vector<Tensor>{gh_all.defined() ? mul(gh_all, gf) : Tensor(), gw.defined() ? mul(gw, gf) : Tensor()};
  });
  return total;
}

}  // namespace areno::train
