// A regular expression as a client sends it (guided_regex,
// structured_outputs.regex, or on odd-sized inputs a JSON Schema `pattern`,
// the JSON string form): the pattern compiler under its bounds, the
// automaton's own consistency, then a short greedy walk through the output
// grammar's mask at its tightest budget over logits drawn from the input.
// Findings beyond crashes: a shortest continuation that is not a match or
// whose length is not the state's distance, a token count that does not
// fit the tokens left, a walk that does not end in <|end|> within
// max_tokens, or an output the automaton does not match.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

#include "serve/grammar.h"
#include "serve/regex.h"
#include "tests/fuzz/fuzz_common.h"
#include "tests/fuzz/fuzz_grammar_walk.h"

using namespace areno;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 8192) return 0;
  const std::string pattern(reinterpret_cast<const char*>(data), size);
  std::shared_ptr<const serve::Regex> re;
  try {
    serve::Regex::Options o;  // odd sizes: as a JSON Schema `pattern`
    o.json_string = o.search = size % 2 == 1;
    re = serve::Regex::compile(pattern, o);
  } catch (const std::invalid_argument&) {
    return 0;
  }
  // Every state's shortest continuation: its distance long, and a match.
  for (int32_t s = 0; s < int32_t(re->states()) && s < 256; ++s) {
    if (re->distance(s) > (int64_t(1) << 40)) continue;  // unreachable from the start
    const std::string rest = re->shortest(s);
    if (int64_t(rest.size()) != re->distance(s)) std::abort();
    int32_t t = s;
    for (unsigned char c : rest)
      if ((t = re->next(t, c)) == serve::Regex::kDead) std::abort();
    if (!re->accepting(t)) std::abort();
  }
  if (!re->matches(re->shortest(re->start()))) std::abort();
  const auto g = serve::OutputGrammar::regex(fuzz::vocab_bytes(), re);
  if (g->min_tokens() > 24) return 0;  // a long shortest match: the walk would be long, not wrong
  if (!re->matches(fuzz::tight_walk(*g, data, size, ""))) std::abort();
  return 0;
}
