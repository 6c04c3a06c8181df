#include "train/rl/policy_logp.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "models/phi4mm/model.h"
#include "tensor/autograd.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "train/loss.h"

namespace areno::train::rl {

Tensor chunked_target_logp(const Tensor& hidden, const Tensor& weight, const std::vector<int64_t>& rows,
                           const std::vector<int64_t>& targets, int64_t chunk_rows) {
  if (!hidden.defined() || hidden.dim() != 2 || !weight.defined() || weight.dim() != 2 ||
      hidden.size(1) != weight.size(1) || rows.size() != targets.size() || chunk_rows < 1)
    throw std::invalid_argument("target logp: hidden must be [T, H], weight [V, H], one target per row, chunk_rows >= 1");
  const int64_t T = hidden.size(0), V = weight.size(0), K = int64_t(rows.size());
  for (int64_t k = 0; k < K; ++k)
    if (rows[size_t(k)] < 0 || rows[size_t(k)] >= T || targets[size_t(k)] < 0 || targets[size_t(k)] >= V)
      throw std::invalid_argument(fmt::format("target logp: pair {} (row {}, target {}) is outside [0, {}) x [0, {})",
                                              k, rows[size_t(k)], targets[size_t(k)], T, V));
  const Device dev = hidden.device();
  const TensorOptions i64(DType::i64, dev), f32(DType::f32, dev);
  if (K == 0) return zeros({0}, f32);
  Tensor h = index_select(hidden, 0, from_vector(rows, {K}, i64));  // records its own backward
  const Tensor all_targets = from_vector(targets, {K, 1}, i64);
  // Chunk [b, b + n)'s cross-entropy rows (train/loss.h): -log p(target)
  // and softmax - onehot, the logits in their own dtype (bf16 stays bf16).
  auto chunk_rows_of = [](const Tensor& hs, const Tensor& w, const Tensor& tg, int64_t b, int64_t n, bool want_grad) {
    return cross_entropy_rows(linear(hs.narrow(0, b, n), w), tg.narrow(0, b, n), want_grad);
  };

  std::vector<Tensor> parts;
  {
    NoGradGuard ng;
    for (int64_t b = 0; b < K; b += chunk_rows) {
      const int64_t n = std::min(chunk_rows, K - b);
      parts.push_back(neg(chunk_rows_of(h, weight, all_targets, b, n, false).nll));
    }
  }
  Tensor out = parts.size() == 1 ? parts[0] : cat(parts, 0);
  if (!needs_grad({h, weight})) return out;
  Tensor hd = h.detach(), wd = weight.detach();
  // Only the products someone needs (a frozen head, as in LoRA-only runs,
  // skips the weight's).
  const bool grad_h = h.requires_grad(), grad_w = weight.requires_grad();
  record(out, "chunked_target_logp", {h, weight},
         [hd, wd, all_targets, chunk_rows, chunk_rows_of, grad_h, grad_w](const Tensor& g) {
    // d logp_t / d logits_t = onehot(target_t) - softmax_t; with the incoming
    // g_t that is (softmax_t - onehot_t) * (-g_t): the column -g scales the
    // small operands (rows of h, rows of the result), not the [n, V] one.
    const int64_t K = hd.size(0);
    const Tensor ng = neg(g.to(DType::f32)).reshape({K, 1});
    std::vector<Tensor> gh;
    Tensor gw;
    for (int64_t b = 0; b < K; b += chunk_rows) {
      const int64_t n = std::min(chunk_rows, K - b);
      const Tensor p = chunk_rows_of(hd, wd, all_targets, b, n, true).grad;
      const Tensor col = ng.narrow(0, b, n);
      if (grad_h) gh.push_back(mul(matmul(p.to(wd.dtype()), wd), col.to(wd.dtype())));
      // The weight's: the rows scaled by the column (in f32, then in the
      // weight's dtype for a bf16 weight's product).
      if (grad_w) add_head_weight_grad(gw, p, mul(hd.narrow(0, b, n).to(DType::f32), col), wd.dtype());
    }
    return std::vector<Tensor>{gh.empty() ? Tensor() : gh.size() == 1 ? gh[0] : cat(gh, 0), gw};
  });
  return out;
}

ResponseHidden response_hidden(const phi4mm::Phi4MMForCausalLM& model, const std::vector<Prompt>& prompts,
                               const std::vector<Sequence>& sequences, const PolicyLogpOptions& options) {
  const int64_t N = int64_t(sequences.size());
  int64_t T = 0;
  for (const Sequence& s : sequences) {
    if (s.prompt < 0 || s.prompt >= int64_t(prompts.size()))
      throw std::invalid_argument(fmt::format("policy_logp: sequence refers to prompt {} of {}", s.prompt,
                                              prompts.size()));
    if (prompts[size_t(s.prompt)].ids.empty())
      throw std::invalid_argument(fmt::format("policy_logp: prompt {} is empty", s.prompt));
    if (!s.trainable.empty() && s.trainable.size() != s.completion.size())
      throw std::invalid_argument(fmt::format("policy_logp: {} trainable flags for {} completion tokens",
                                              s.trainable.size(), s.completion.size()));
    T = std::max(T, int64_t(s.completion.size()));
  }
  const Device dev = model.model->embed_tokens->weight.device();
  const TensorOptions f32(DType::f32, dev);
  ResponseHidden out;
  out.N = N;
  out.T = T;
  std::vector<float> mask(size_t(N * T), 0.0f);
  if (T == 0) {
    out.mask = zeros({N, T}, f32);
    return out;
  }

  // Each prompt's media rows once (its towers run once for all its samples).
  std::vector<Tensor> prompt_media(prompts.size());
  for (size_t p = 0; p < prompts.size(); ++p)
    if (!prompts[p].media.empty()) prompt_media[p] = phi4mm::media_rows(model, prompts[p].media);

  // Pack prompt + completion[:-1]; the row before completion token t targets it.
  std::vector<int64_t> ids;
  phi4mm::PackedBatch pb;
  pb.cu_seqlens = {0};
  std::vector<Tensor> media;
  for (int64_t n = 0; n < N; ++n) {
    const Sequence& s = sequences[size_t(n)];
    if (s.completion.empty()) continue;
    const Prompt& p = prompts[size_t(s.prompt)];
    ids.insert(ids.end(), p.ids.begin(), p.ids.end());
    ids.insert(ids.end(), s.completion.begin(), s.completion.end() - 1);
    const int64_t first = int64_t(ids.size() - s.completion.size());  // the prompt's last row
    for (size_t t = 0; t < s.completion.size(); ++t) {
      if (!s.trainable.empty() && !s.trainable[t]) continue;  // context: fed, not scored
      out.rows.push_back(first + int64_t(t));
      out.targets.push_back(s.completion[t]);
      out.cells.push_back(n * T + int64_t(t));
      mask[size_t(n * T) + t] = 1.0f;
    }
    pb.cu_seqlens.push_back(int64_t(ids.size()));
    pb.adapters.push_back(p.adapter);
    if (prompt_media[size_t(s.prompt)].defined()) media.push_back(prompt_media[size_t(s.prompt)]);
  }
  const int64_t L = int64_t(ids.size());
  const int64_t V = model.config().text.vocab_size;
  for (const std::vector<int64_t>* v : {&ids, &out.targets})
    for (int64_t id : *v)
      if (id < 0 || id >= V)
        throw std::invalid_argument(fmt::format("policy_logp: token id {} is outside [0, {})", id, V));
  pb.token_ids = from_vector(ids, {L});
  if (!media.empty()) pb.media_rows = media.size() == 1 ? media[0] : cat(media, 0);
  pb.recompute_layers = options.recompute_layers;
  pb.dropout_seed = options.dropout_seed;
  out.hidden = model.hidden_states(pb);
  out.mask = from_vector(mask, {N, T}, f32);
  return out;
}

Tensor ResponseHidden::to_cells(const Tensor& per_token) const {
  const Device dev = mask.device();
  const TensorOptions f32(DType::f32, dev);
  if (cells.empty()) return zeros({N, T}, f32);
  const int64_t K = int64_t(cells.size());
  return index_add(zeros({N * T}, f32), 0, from_vector(cells, {K}, TensorOptions(DType::i64, dev)),
                   per_token.to(DType::f32))
      .reshape({N, T});
}

Tensor ResponseHidden::response_rows() const {
  return index_select(hidden, 0, from_vector(rows, {int64_t(rows.size())}, TensorOptions(DType::i64, hidden.device())));
}

TokenLogp token_logp(const ResponseHidden& rh, const phi4mm::Phi4MMForCausalLM& model, int64_t chunk_rows) {
  if (rh.cells.empty()) return {rh.to_cells(Tensor()), rh.mask};
  const Tensor lp = chunked_target_logp(rh.hidden, model.model->embed_tokens->weight, rh.rows, rh.targets, chunk_rows);
  return {rh.to_cells(lp), rh.mask};
}

TokenLogp policy_logp(const phi4mm::Phi4MMForCausalLM& model, const std::vector<Prompt>& prompts,
                      const std::vector<Sequence>& sequences, const PolicyLogpOptions& options) {
  return token_logp(response_hidden(model, prompts, sequences, options), model, options.chunk_rows);
}

}  // namespace areno::train::rl
