#pragma once
// What the sampler asks of a constrained output (serve/sampler.h): the ids
// that may come next, and the fewest tokens a complete output takes. The
// fixed-shape grammars (tool calls, JSON, choices, regular expressions:
// serve/grammar.h) and context-free grammars (serve/cfg.h) answer it.
#include <cstdint>
#include <span>

namespace areno::serve {

class OutputConstraint {
 public:
  virtual ~OutputConstraint() = default;
  // Sets work[id] to -inf for every id (of V) not allowed after `generated`,
  // with `remaining` tokens left including this one; an allowed id leaves an
  // output that can still be completed in the tokens left. When no finite id
  // is left (penalties, logit_bias or min_tokens masked every allowed one),
  // the first token of the shortest completion gets 0 and every other -inf.
  // A finished output (its last token generated) leaves work as it is.
  // Throws std::logic_error when `generated` is not a prefix of the language.
  virtual void mask(std::span<const int64_t> generated, int64_t remaining, float* work, int64_t V) const = 0;
  // The tokens the shortest complete output needs, counted as the mask
  // counts: max_tokens below it cannot give a complete output (the HTTP
  // layer refuses such a request).
  virtual int64_t min_tokens() const = 0;
  // The tokens the completion after `generated` takes, as the mask counts
  // them (benchmarks, tests). Throws like mask.
  virtual int64_t completion_length(std::span<const int64_t> generated) const = 0;
};

}  // namespace areno::serve
