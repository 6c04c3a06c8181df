#pragma once
// The constrained-decoding tests' view of the Phi-4 tokenizer: its full
// padded vocabulary, the bytes of every id, text to ids (control tokens by
// id) and back.
#include <doctest/doctest.h>

#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/grammar.h"

namespace areno::serve::testing {

inline constexpr int64_t kVocab = 200064;

inline const tok::Tokenizer& tokenizer() {
  static const tok::Tokenizer t = [] {
    tok::Tokenizer x = phi4mm::make_tokenizer();
    x.set_padded_vocab_size(size_t(kVocab));
    return x;
  }();
  return t;
}

inline std::shared_ptr<const TokenBytes> bytes() {
  static const auto b = std::make_shared<const TokenBytes>(tokenizer(), kVocab);
  return b;
}

// Text to ids: the control tokens by id, the rest as ordinary text.
inline std::vector<int64_t> ids(const std::string& text) {
  std::vector<int64_t> out;
  for (const tok::Segment& s : tokenizer().split_added_tokens(text)) {
    if (s.token >= 0) {
      out.push_back(s.token);
      continue;
    }
    for (tok::TokenId t : tokenizer().encode_ordinary(std::string_view(text).substr(s.begin, s.end - s.begin)))
      out.push_back(t);
  }
  return out;
}

inline std::string text(const std::vector<int64_t>& v) {
  return tokenizer().decode(std::vector<tok::TokenId>(v.begin(), v.end()), /*skip_special_tokens=*/false);
}

// Masks a copy of `logits` after `prefix` with `remaining` tokens left (into
// `w`) and replays every id: it must keep its logit exactly when the output
// with it stays in the language and its shortest completion (counted by
// emitting it) fits the tokens left after it, and be -inf otherwise.
struct MaskCheck {
  int64_t allowed = 0, wrong = 0;
};
template <typename G>  // OutputGrammar, Cfg
MaskCheck check_mask(const G& g, const std::vector<int64_t>& prefix, int64_t remaining,
                            const std::vector<float>& logits, std::vector<float>& w) {
  w = logits;
  g.mask(prefix, remaining, w.data(), kVocab);
  MaskCheck r;
  std::vector<int64_t> v = prefix;
  v.push_back(0);
  for (int64_t id = 0; id < kVocab; ++id) {
    v.back() = id;
    const bool ok = g.accepts(v) && int64_t(g.completion(v).size()) <= remaining - 1;
    r.wrong += ok ? w[size_t(id)] != logits[size_t(id)] : w[size_t(id)] != -std::numeric_limits<float>::infinity();
    r.allowed += ok;
  }
  return r;
}

// A greedy walk through the mask over random logits (normal, scale 3), the
// characters of `favoured` raised by 6 and those of `closers` by 7, until
// <|end|> or max_tokens; `each(out)` after every token.
template <typename G, typename F>
std::vector<int64_t> masked_walk(const G& g, int64_t max_tokens, std::mt19937& rng, const std::string& favoured,
                                 const std::string& closers, F&& each) {
  std::normal_distribution<float> nd;
  std::vector<float> w(static_cast<size_t>(kVocab));
  std::vector<int64_t> out;
  while (int64_t(out.size()) < max_tokens && (out.empty() || out.back() != phi4mm::kEnd)) {
    for (float& x : w) x = 3.0f * nd(rng);
    for (char c : favoured) w[size_t(bytes()->byte_token(uint8_t(c)))] += 6.0f;
    for (char c : closers) w[size_t(bytes()->byte_token(uint8_t(c)))] += 7.0f;
    g.mask(out, max_tokens - int64_t(out.size()), w.data(), kVocab);
    int64_t best = 0;
    for (int64_t id = 1; id < kVocab; ++id)
      if (w[size_t(id)] > w[size_t(best)]) best = id;
    out.push_back(best);
    each(out);
  }
  return out;
}

// check_mask after `v` with the completion's token count plus each of
// `extra` tokens left: exact, and something allowed.
template <typename G>
void check_masks_after(const G& g, const std::vector<int64_t>& v, std::initializer_list<int64_t> extra,
                       const std::vector<float>& logits) {
  const int64_t need = g.completion_length(v);
  for (int64_t e : extra) {
    CAPTURE(need + e);
    std::vector<float> w;
    const MaskCheck m = check_mask(g, v, need + e, logits, w);
    CHECK(m.wrong == 0);
    CHECK(m.allowed > 0);
  }
}

// A masked walk (above) with `max_tokens`: every step's completion fits the
// tokens left, and it ends in <|end|> within max_tokens. Returns the text
// before <|end|>.
template <typename G>
std::string checked_walk(const G& g, int64_t max_tokens, std::mt19937& rng, const std::string& favoured) {
  const std::vector<int64_t> out = masked_walk(g, max_tokens, rng, favoured, "", [&](const std::vector<int64_t>& o) {
    CHECK(g.completion_length(o) <= max_tokens - int64_t(o.size()));
  });
  const std::string t = text(out);
  CAPTURE(t);
  REQUIRE(out.back() == phi4mm::kEnd);
  CHECK(int64_t(out.size()) <= max_tokens);
  return t.substr(0, t.size() - 7);
}

}  // namespace areno::serve::testing
