// A JSON schema as a client sends it (response_format json_schema, a tool's
// parameters): bounded ordered parsing, the schema compiler, then a short
// greedy walk through the grammar's mask over logits drawn from the input.
// Findings beyond crashes: a logic_error (the compiler's or the grammar's
// own consistency checks), a completion whose token count differs from its
// spelled tokens or no longer fits the tokens left (max_tokens is the
// shortest output's count plus 0 to 3), a walk that does not end in <|end|>
// within max_tokens, or an output that does not parse as JSON.
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/grammar.h"
#include "serve/json_schema.h"
#include "serve/openai.h"
#include "tests/fuzz/fuzz_common.h"
#include "tests/fuzz/fuzz_grammar_walk.h"

using namespace areno;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto& bytes = fuzz::vocab_bytes();
  if (size > (1 << 16)) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::shared_ptr<const serve::OutputGrammar> g;
  try {
    const nlohmann::ordered_json j = serve::parse_ordered_json_bounded(text, serve::kDefaultMaxJsonDepth);
    g = serve::OutputGrammar::json_schema(bytes, serve::JsonSchema::compile(j));
  } catch (const serve::ApiError&) {
    return 0;
  } catch (const std::invalid_argument&) {
    return 0;
  }
  if (g->min_tokens() > 256) return 0;  // a long shortest instance: the walk would be long, not wrong
  if (!nlohmann::json::accept(fuzz::tight_walk(*g, data, size, "{}[]\",:0-tfn \n"))) std::abort();
  return 0;
}
