#include "train/rl/rollout.h"

#include <stdexcept>

#include <fmt/format.h>

#include "tensor/autograd.h"

namespace areno::train::rl {

namespace {

serve::SamplingParams sampling_params(const RolloutOptions& o) {
  serve::SamplingParams p;
  p.n = o.n_samples;
  p.temperature = o.greedy ? 0.0 : o.temperature;
  p.top_k = o.top_k;
  p.top_p = o.top_p;
  p.max_tokens = o.max_new_tokens;
  p.logprobs = 0;  // the sampled token's log-probability, no alternatives
  p.skip_special_tokens = false;
  return p;
}

}  // namespace

Rollout::Rollout(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::shared_ptr<const tok::Tokenizer> tokenizer,
                 RolloutOptions options)
    : model_(std::move(model)), tok_(std::move(tokenizer)), options_(std::move(options)) {
  if (!model_ || !tok_) throw std::invalid_argument("rollout: model and tokenizer are required");
  if (options_.n_samples < 1) throw std::invalid_argument("--n-samples: must be at least 1");
  if (options_.max_new_tokens < 1) throw std::invalid_argument("--max-new-tokens: must be at least 1");
  if (options_.max_context_len < 0) throw std::invalid_argument("--max-context-len: must be 0 (the model's) or more");
  serve::validate(sampling_params(options_), model_->config().text.vocab_size);
}

std::vector<RolloutSample> Rollout::run(const std::vector<Prompt>& prompts) {
  NoGradGuard ng;
  if (!engine_) engine_ = std::make_unique<serve::Engine>(model_, tok_, options_.engine);
  const uint64_t run = runs_++;
  std::vector<serve::Request> requests;
  requests.reserve(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    serve::Request r;
    r.prompt = prompts[i].ids;
    r.media = prompts[i].media;
    r.adapter = prompts[i].adapter;
    r.params = sampling_params(options_);
    r.params.seed = splitmix64(options_.seed ^ splitmix64(run * 0x10000000ull + i));
    r.max_context = options_.max_context_len;
    requests.push_back(std::move(r));
  }
  std::vector<std::vector<serve::Completion>> done;
  try {
    done = serve::generate(*engine_, std::move(requests));
  } catch (...) {
    engine_.reset();  // a failed run leaves no state behind
    throw;
  }
  last_stats_ = engine_->stats();
  if (last_stats_.kv_blocks_used != 0 || last_stats_.running != 0 || last_stats_.waiting != 0)
    throw std::logic_error(fmt::format("rollout: the engine still holds {} of {} KV blocks ({} running, {} waiting) "
                                       "after the rollout", last_stats_.kv_blocks_used, last_stats_.kv_blocks_total,
                                       last_stats_.running, last_stats_.waiting));
  if (options_.drop_rollout_state) engine_.reset();

  std::vector<RolloutSample> out;
  out.reserve(prompts.size() * size_t(options_.n_samples));
  for (size_t i = 0; i < done.size(); ++i)
    for (size_t j = 0; j < done[i].size(); ++j) {
      serve::Completion& c = done[i][j];
      if (c.logprobs.size() != c.tokens.size())
        throw std::logic_error(fmt::format("rollout: prompt {} sample {}: {} tokens but {} log-probabilities", i, j,
                                           c.tokens.size(), c.logprobs.size()));
      out.push_back({int64_t(i), int64_t(j), std::move(c.tokens), std::move(c.logprobs), c.finish, {}, {}});
    }
  return out;
}

std::vector<Sequence> sequences_of(const std::vector<RolloutSample>& samples) {
  std::vector<Sequence> seqs;
  seqs.reserve(samples.size());
  for (const RolloutSample& s : samples) seqs.push_back({s.prompt, s.tokens, s.trainable});
  return seqs;
}

}  // namespace areno::train::rl
