#pragma once
// The training forward's log-probabilities of sampled tokens (issue 15,
// "Rollout"): one packed varlen forward of the policy over (prompt, completion)
// sequences, the same PackedBatch path as SFT (train/sft.cpp), then the tied
// head a chunk of rows at a time, so the [tokens, vocab] logits of the batch
// never exist at once.
//
// Distribution: log_softmax of the raw logits (temperature 1, no top-k/top-p,
// no penalties). That is what the engine reports with a token
// (serve/sampler.h: "Log-probabilities are those of the raw model
// distribution ... as vLLM reports"), whatever temperature the rollout
// sampled at, so the rollout's and the trainer's numbers are like for like.
//
// Output layout: the [N, T] log-probabilities + [N, T] 0/1 mask of
// train/rl/objectives.h, N sequences, T the longest completion, f32 (the
// logits are reduced in f32, as the SFT loss does).
#include <cstdint>
#include <vector>

#include "models/phi4mm/processor/media.h"
#include "models/phi4mm/text.h"
#include "tensor/tensor.h"
#include "train/loss.h"

namespace areno::train::rl {

// A prompt as the model sees it: expanded ids (media placeholders repeated),
// its media in order of appearance, its adapter (train/dataset.h's SftRow
// prompt part).
struct Prompt {
  std::vector<int64_t> ids;
  std::vector<phi4mm::Media> media;
  phi4mm::Adapter adapter = phi4mm::Adapter::none;
};

// One sampled completion of prompts[prompt]. `trainable` (empty: every
// token) marks the completion tokens the objective sees: an agent's row
// (train/rl/agent.h) continues past its first answer with tool results and
// later prompts, which are context, not actions.
struct Sequence {
  int64_t prompt = 0;
  std::vector<int64_t> completion;
  std::vector<uint8_t> trainable;  // empty or one 0/1 per completion token
};

struct TokenLogp {
  Tensor logp;  // [N, T] f32: log p(completion[t] | prompt, completion[:t]) on trainable tokens; 0 elsewhere
  Tensor mask;  // [N, T] f32: 1 on trainable completion tokens, 0 on context and padding
};

struct PolicyLogpOptions {
  int64_t chunk_rows = kDefaultLossChunkRows;  // head rows per chunk
  bool recompute_layers = false;               // activation checkpointing (PackedBatch)
  uint64_t dropout_seed = 0;                   // for parts in training mode
};

// One packed forward over every sequence (prompt + completion, the last
// completion token not fed), each with its prompt's adapter and media rows
// (each prompt's towers run once, however many sequences share it). The
// result records its backward to the model's parameters that require grad.
// token_logp(response_hidden(...)).
// Throws std::invalid_argument for a prompt index out of range, an empty
// prompt, a token outside the vocabulary, or a `trainable` of the wrong length.
TokenLogp policy_logp(const phi4mm::Phi4MMForCausalLM& model, const std::vector<Prompt>& prompts,
                      const std::vector<Sequence>& sequences, const PolicyLogpOptions& options = {});

// The packed forward of policy_logp up to the final norm, for heads on the
// same hidden states (the LM head's log-probabilities, PPO's value head):
// every packed row's hidden state and, per trainable completion token k
// (Sequence::trainable; context tokens are fed, not listed), the row that
// predicts it, the token and its cell n * T + t of the [N, T] layout.
struct ResponseHidden {
  Tensor hidden;                 // [L, H] model dtype: every packed row (prompt + completion[:-1])
  std::vector<int64_t> rows;     // [K] the row before each trainable completion token
  std::vector<int64_t> targets;  // [K] the completion token
  std::vector<int64_t> cells;    // [K] n * T + t
  int64_t N = 0, T = 0;
  Tensor mask;                   // [N, T] f32 (as TokenLogp::mask)

  // [K] per-token values (any float dtype) -> [N, T] f32, 0 on context and padding; differentiable.
  Tensor to_cells(const Tensor& per_token) const;
  // hidden's K response rows, [K, H] (differentiable as hidden).
  Tensor response_rows() const;
};

// Same checks as policy_logp.
ResponseHidden response_hidden(const phi4mm::Phi4MMForCausalLM& model, const std::vector<Prompt>& prompts,
                               const std::vector<Sequence>& sequences, const PolicyLogpOptions& options = {});

// The tied head's log-probabilities of rh's tokens (chunked_target_logp), in the [N, T] layout.
TokenLogp token_logp(const ResponseHidden& rh, const phi4mm::Phi4MMForCausalLM& model,
                     int64_t chunk_rows = kDefaultLossChunkRows);

// log softmax(hidden[rows[k]] · weightᵀ)[targets[k]] for each pair k: [K]
// f32. The chunked head of train/loss.h's chunked_cross_entropy_sum with a
// per-pair result (a per-pair incoming gradient in backward); each chunk's
// logits are recomputed in backward instead of kept. Throws
// std::invalid_argument for a row outside [0, T) or a target outside [0, V).
Tensor chunked_target_logp(const Tensor& hidden, const Tensor& weight, const std::vector<int64_t>& rows,
                           const std::vector<int64_t>& targets, int64_t chunk_rows = kDefaultLossChunkRows);

}  // namespace areno::train::rl
