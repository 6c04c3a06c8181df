// A context-free grammar as a client sends it (guided_grammar,
// structured_outputs.grammar): the GBNF compiler under its bounds, then the
// grammar's own consistency and a short greedy walk through its mask at its
// tightest budget over logits drawn from the input (a grammar past the
// mask's work bound is refused, as the server fails its request). Findings beyond
// crashes: a shortest sentence that the grammar does not match, a token
// count that does not fit the tokens left, a walk that does not end in
// <|end|> within max_tokens, or an output that is not a sentence.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

#include "serve/cfg.h"
#include "tests/fuzz/fuzz_common.h"
#include "tests/fuzz/fuzz_grammar_walk.h"

using namespace areno;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 8192) return 0;
  const std::string grammar(reinterpret_cast<const char*>(data), size);
  std::shared_ptr<const serve::Cfg> g;
  try {
    g = serve::Cfg::compile(fuzz::vocab_bytes(), grammar);
  } catch (const std::invalid_argument&) {
    return 0;
  }
  // The shortest sentence, as the completion from nothing spells it.
  const std::vector<int64_t> shortest = g->completion({});
  if (shortest.empty() || shortest.back() != phi4mm::kEnd || int64_t(shortest.size()) != g->min_tokens()) std::abort();
  std::string text;
  for (size_t i = 0; i + 1 < shortest.size(); ++i) text += fuzz::vocab_bytes()->bytes(shortest[i]);
  if (!g->matches(text) || !g->accepts(shortest)) std::abort();
  if (g->min_tokens() > 24) return 0;  // a long shortest sentence: the walk would be long, not wrong
  std::string out;
  try {
    out = fuzz::tight_walk(*g, data, size, "([{\"0a, ");
  } catch (const std::runtime_error& e) {
    // A grammar too ambiguous for one token's work bound fails its request
    // (Cfg::kMaxMaskWork): refused, not a finding. Anything else is.
    if (std::string(e.what()).find("parse steps") == std::string::npos) throw;
    return 0;
  }
  if (!g->matches(out)) std::abort();
  return 0;
}
