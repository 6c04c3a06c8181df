#pragma once
// The sampler: what a request may ask of the next-token choice
// (SamplingParams), the one table of bounds every entry point checks them
// against (the HTTP layer, the CLI flags, the engine), and the choice itself.
//
// A token is picked from one row of logits: banned ids (unused rows, media
// placeholders) masked, logit_bias added, repetition / presence / frequency
// penalties applied, stop tokens masked before min_tokens; then greedy
// (temperature 0, ties to the lowest id) or a draw from softmax(l / T)
// filtered by top_k, top_p and min_p. The draw uses uniform01(seed, sample,
// step), a pure function of its arguments, so a seeded request gives the same
// tokens alone, in any batch and after preemption. Log-probabilities are those
// of the raw model distribution (log_softmax of the logits before
// temperature, penalties or filtering), as vLLM reports.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace areno::serve {

class OutputConstraint;  // serve/constraint.h

struct SamplingParams {
  int64_t n = 1;                 // samples sharing the prompt
  double temperature = 1.0;      // 0 = greedy (ties: lowest id)
  double top_p = 1.0;            // (0, 1]
  int64_t top_k = -1;            // <= 0: off
  double min_p = 0.0;            // [0, 1]: drop tokens below min_p * max prob
  double presence_penalty = 0.0;   // OpenAI semantics over generated tokens
  double frequency_penalty = 0.0;
  double repetition_penalty = 1.0; // vLLM semantics over prompt + generated tokens
  std::vector<std::pair<int64_t, double>> logit_bias;  // token id -> bias added to the logit
  std::optional<uint64_t> seed;  // none: drawn from the engine's generator at submit
  int64_t max_tokens = 16;       // generated tokens (stop token included)
  int64_t min_tokens = 0;        // stop tokens are masked before this many
  std::vector<std::string> stop;        // stop strings, matched on the decoded text
  std::vector<int64_t> stop_token_ids;  // in addition to the eos ids (unless ignore_eos)
  bool ignore_eos = false;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;      // in the decoded text
  int64_t logprobs = -1;         // -1: none; k >= 0: logprob of each token and the top k
  int64_t prompt_logprobs = -1;  // -1: none; k >= 0: logprobs of the prompt tokens (echo)
  // vLLM's allowed_token_ids: when not empty, only these ids may be drawn.
  std::vector<int64_t> allowed_token_ids;
  // vLLM's bad_words, and their ids (Engine::submit encodes them, as vLLM:
  // the word and, when it tokenizes to as many ids with another first id,
  // " " + the word): a sequence's last id is masked when the generated tokens
  // end with the rest of it (a one-id sequence: always). Where the rules leave
  // no id to draw, the bad words give way for that token.
  std::vector<std::string> bad_words;
  std::vector<std::vector<int64_t>> bad_words_ids;
  // Constrained decoding (a forced tool call, a JSON object): only ids that
  // keep the output in the grammar's language and finishable within
  // max_tokens are drawn; applied after every other rule, and it wins over
  // them when they leave no allowed id (serve/constraint.h).
  std::shared_ptr<const OutputConstraint> grammar;
};

// The range of one numeric parameter: [lo, hi], or (lo, hi] when lo_open.
struct Bound {
  const char* name;
  double lo, hi;
  bool lo_open = false;
  bool contains(double x) const;  // false for NaN
  std::string range() const;      // "[0, 2]", "(0, 1]"
};

// The bounds table: the one place a sampling parameter's range is written.
namespace bounds {
inline constexpr Bound temperature{"temperature", 0, 2};
inline constexpr Bound top_p{"top_p", 0, 1, true};
inline constexpr Bound min_p{"min_p", 0, 1};
inline constexpr Bound presence_penalty{"presence_penalty", -2, 2};
inline constexpr Bound frequency_penalty{"frequency_penalty", -2, 2};
inline constexpr Bound repetition_penalty{"repetition_penalty", 0, 2, true};
inline constexpr Bound logit_bias{"logit_bias", -100, 100};
inline constexpr int64_t kMaxLogprobs = 20;  // logprobs / prompt_logprobs: -1 (none) or [0, 20]
inline constexpr int64_t kMinTopK = -1;      // top_k: -1 or 0 (off), or >= 1
inline constexpr int64_t kMaxBadWords = 256;        // bad_words: strings per request
inline constexpr int64_t kMaxBadWordBytes = 256;    // bytes per bad word
}  // namespace bounds

// Validates every field against the table; throws std::invalid_argument
// naming the field ("temperature: must be in [0, 2] (got 5)").
void validate(const SamplingParams& p, int64_t vocab_size);

// A bad word is checked for a character other than ASCII blanks (vLLM strips
// the leading ones; an all-blank word encodes to nothing).
inline bool has_non_blank(std::string_view s) { return s.find_first_not_of(" \t\n\r\f\v") != std::string_view::npos; }

// vLLM's encoding of bad_words into id sequences (see SamplingParams).
std::vector<std::vector<int64_t>> encode_bad_words(const std::vector<std::string>& words,
                                                   const std::function<std::vector<int64_t>(const std::string&)>& encode);

struct TokenLogprob {
  int64_t token = 0;
  float logprob = 0;
  std::vector<std::pair<int64_t, float>> top;  // best first
  int64_t rank = 0;  // 1 + the ids with a larger logit (vLLM's rank); 0: not computed
};

// What the choice of a sequence's next token depends on besides the logits.
struct SequenceView {
  std::span<const int64_t> tokens;                       // prompt + generated
  const std::unordered_map<int64_t, int64_t>* counts;    // generated token counts (penalties)
  int64_t generated = 0;
  int64_t sample = 0;    // index among the request's n samples
  uint64_t seed = 0;     // the request's seed
};

struct Picked {
  int64_t token = 0;
  std::optional<TokenLogprob> logprob;  // when p.logprobs >= 0
};

// Picks the next token from `row` (vocab_size logits). `stop_ids` are masked
// before min_tokens. Thread-safe (scratch is per thread).
Picked pick_token(const SamplingParams& p, const SequenceView& s, const float* row, int64_t vocab_size,
                  std::span<const int64_t> stop_ids);

// log-sum-exp of a row, and a token's logprob with the row's top k (prompt logprobs).
double log_sum_exp(const float* row, int64_t n);
TokenLogprob make_logprob(const float* row, int64_t n, double lse, int64_t token, int64_t k, bool with_rank = false);

// The uniform number of generated token `step` of sample `sample`.
double uniform01(uint64_t seed, int64_t sample, int64_t step);

}  // namespace areno::serve
