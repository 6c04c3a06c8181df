#pragma once
// The constrained-decoding harnesses' shared part (fuzz_json_schema,
// fuzz_regex, fuzz_cfg): the Phi-4 vocabulary's bytes, and a greedy walk through an
// output grammar's mask at a tight budget over logits drawn from the input.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/grammar.h"

namespace areno::fuzz {

inline constexpr int64_t kVocab = 200064;

inline const std::shared_ptr<const serve::TokenBytes>& vocab_bytes() {
  static const tok::Tokenizer tokenizer = [] {
    tok::Tokenizer t = phi4mm::make_tokenizer();
    t.set_padded_vocab_size(size_t(kVocab));
    return t;
  }();
  static const auto bytes = std::make_shared<const serve::TokenBytes>(tokenizer, kVocab);
  return bytes;
}

}  // namespace areno::fuzz

// The vocabulary's bytes once, before the first input (each harness that
// includes this header): building them under ASan on a busy machine took
// longer than one input's timeout (10 s).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  areno::fuzz::vocab_bytes();
  return 0;
}

namespace areno::fuzz {

// Walks `g` greedily with max_tokens its shortest output's token count plus
// size % 4, the characters of `favoured` raised at random; aborts when a
// completion's count differs from its spelled tokens or no longer fits the
// tokens left, or when the walk does not end in <|end|> within max_tokens.
// Returns the output's text before <|end|>.
template <typename G>  // serve::OutputGrammar, serve::Cfg
std::string tight_walk(const G& g, const uint8_t* data, size_t size,
                              std::string_view favoured) {
  const serve::TokenBytes& bytes = *vocab_bytes();
  uint64_t x = 0x9E3779B97F4A7C15ull ^ size;
  for (size_t i = 0; i < size; ++i) x = (x ^ data[i]) * 0x100000001B3ull;
  auto next = [&] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return float(x >> 40) / float(1 << 24);
  };
  std::vector<float> logits(size_t(kVocab), 0.0f);
  std::vector<int64_t> out;
  const int64_t max_tokens = g.min_tokens() + int64_t(size % 4);
  while (int64_t(out.size()) < max_tokens && (out.empty() || out.back() != phi4mm::kEnd)) {
    for (float& l : logits) l = next();
    for (char c : favoured) logits[size_t(bytes.byte_token(uint8_t(c)))] += 2.0f * next();
    g.mask(out, max_tokens - int64_t(out.size()), logits.data(), kVocab);
    int64_t best = 0;
    for (int64_t id = 1; id < kVocab; ++id)
      if (logits[size_t(id)] > logits[size_t(best)]) best = id;
    out.push_back(best);
    const int64_t left = g.completion_length(out);
    if (left != int64_t(g.completion(out).size()) || left > max_tokens - int64_t(out.size())) std::abort();
  }
  if (out.back() != phi4mm::kEnd) std::abort();
  std::string text;
  for (size_t i = 0; i + 1 < out.size(); ++i) text += bytes.bytes(out[i]);
  return text;
}

}  // namespace areno::fuzz
