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

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/grammar.h"
#include "serve/json_schema.h"
#include "serve/openai.h"
#include "tests/fuzz/fuzz_common.h"

using namespace areno;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr int64_t kVocab = 200064;
  static const tok::Tokenizer tokenizer = [] {
    tok::Tokenizer t = phi4mm::make_tokenizer();
    t.set_padded_vocab_size(size_t(kVocab));
    return t;
  }();
  static const auto bytes = std::make_shared<const serve::TokenBytes>(tokenizer, kVocab);
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
  uint64_t x = 0x9E3779B97F4A7C15ull ^ size;
  for (size_t i = 0; i < size; ++i) x = (x ^ data[i]) * 0x100000001B3ull;
  auto next = [&] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return float(x >> 40) / float(1 << 24);
  };
  std::vector<float> logits(size_t(kVocab), 0.0f);
  std::vector<int64_t> out;
  const int64_t max_tokens = g->min_tokens() + int64_t(size % 4);
  while (int64_t(out.size()) < max_tokens && (out.empty() || out.back() != phi4mm::kEnd)) {
    for (float& l : logits) l = next();
    for (char c : std::string("{}[]\",:0-tfn \n")) logits[size_t(bytes->byte_token(uint8_t(c)))] += 2.0f * next();
    g->mask(out, max_tokens - int64_t(out.size()), logits.data(), kVocab);
    int64_t best = 0;
    for (int64_t id = 1; id < kVocab; ++id)
      if (logits[size_t(id)] > logits[size_t(best)]) best = id;
    out.push_back(best);
    const int64_t left = g->completion_length(out);
    if (left != int64_t(g->completion(out).size()) || left > max_tokens - int64_t(out.size())) std::abort();
  }
  if (out.back() != phi4mm::kEnd) std::abort();
  std::string json_text;
  for (size_t i = 0; i + 1 < out.size(); ++i) json_text += bytes->bytes(out[i]);
  if (!nlohmann::json::accept(json_text)) std::abort();
  return 0;
}
