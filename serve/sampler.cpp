// The sampler (sampler.h): parameter bounds and the choice of one token.
#include "serve/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>

#include <fmt/format.h>

#include "kernels/cpu/vec_exp.h"
#include "serve/constraint.h"
#include "models/phi4mm/text.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"

namespace areno::serve {

bool Bound::contains(double x) const { return (lo_open ? x > lo : x >= lo) && x <= hi; }

std::string Bound::range() const { return fmt::format("{}{}, {}]", lo_open ? "(" : "[", lo, hi); }

void validate(const SamplingParams& p, int64_t vocab_size) {
  auto bad = [](const char* field, const std::string& why) {
    throw std::invalid_argument(fmt::format("{}: {}", field, why));
  };
  auto check = [&](const Bound& b, double x) {
    if (!b.contains(x)) bad(b.name, fmt::format("must be in {} (got {})", b.range(), x));
  };
  if (p.n < 1) bad("n", "must be at least 1");
  check(bounds::temperature, p.temperature);
  check(bounds::top_p, p.top_p);
  if (p.top_k < bounds::kMinTopK) bad("top_k", fmt::format("must be -1 (off), 0 (off) or >= 1 (got {})", p.top_k));
  check(bounds::min_p, p.min_p);
  check(bounds::presence_penalty, p.presence_penalty);
  check(bounds::frequency_penalty, p.frequency_penalty);
  check(bounds::repetition_penalty, p.repetition_penalty);
  if (p.max_tokens < 0) bad("max_tokens", "must be at least 0");
  if (p.min_tokens < 0 || p.min_tokens > p.max_tokens) bad("min_tokens", "must be in [0, max_tokens]");
  if (p.logprobs > bounds::kMaxLogprobs || p.logprobs < -1)
    bad("logprobs", fmt::format("must be in [0, {}]", bounds::kMaxLogprobs));
  if (p.prompt_logprobs > bounds::kMaxLogprobs || p.prompt_logprobs < -1)
    bad("prompt_logprobs", fmt::format("must be in [0, {}]", bounds::kMaxLogprobs));
  for (auto& s : p.stop)
    if (s.empty()) bad("stop", "stop strings must not be empty");
  for (int64_t id : p.stop_token_ids)
    if (id < 0 || id >= vocab_size) bad("stop_token_ids", fmt::format("id {} is outside [0, {})", id, vocab_size));
  for (auto& [id, b] : p.logit_bias) {
    if (id < 0 || id >= vocab_size) bad("logit_bias", fmt::format("id {} is outside [0, {})", id, vocab_size));
    check(bounds::logit_bias, b);
  }
  if (!p.allowed_token_ids.empty()) {
    bool any = false;
    for (int64_t id : p.allowed_token_ids) {
      if (id < 0 || id >= vocab_size) bad("allowed_token_ids", fmt::format("id {} is outside [0, {})", id, vocab_size));
      any = any || !(phi4mm::is_unused_id(tok::TokenId(id)) || phi4mm::is_media_token(id));
    }
    if (!any) bad("allowed_token_ids", "holds only ids that are never drawn (media placeholders, unused ids)");
  }
  if (int64_t(p.bad_words.size()) > bounds::kMaxBadWords)
    bad("bad_words", fmt::format("at most {} words (got {})", bounds::kMaxBadWords, p.bad_words.size()));
  for (const std::string& w : p.bad_words)
    if (!has_non_blank(w) || int64_t(w.size()) > bounds::kMaxBadWordBytes)
      bad("bad_words", fmt::format("each word must have a non-blank character and at most {} bytes",
                                   bounds::kMaxBadWordBytes));
  for (const std::vector<int64_t>& seq : p.bad_words_ids)
    for (int64_t id : seq)
      if (id < 0 || id >= vocab_size) bad("bad_words", fmt::format("id {} is outside [0, {})", id, vocab_size));
}

std::vector<std::vector<int64_t>> encode_bad_words(const std::vector<std::string>& words,
                                                   const std::function<std::vector<int64_t>(const std::string&)>& encode) {
  std::vector<std::vector<int64_t>> out;
  for (const std::string& w : words) {
    const std::string word = w.substr(std::min(w.size(), w.find_first_not_of(" \t\n\r\f\v")));
    std::vector<int64_t> plain = encode(word);
    if (plain.empty()) continue;
    std::vector<int64_t> spaced = encode(" " + word);
    out.push_back(std::move(plain));
    // The spaced form too when it starts with another id and has as many.
    if (!spaced.empty() && spaced[0] != out.back()[0] && spaced.size() == out.back().size()) out.push_back(std::move(spaced));
  }
  return out;
}

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace

// The uniform number of generated token `step` of sample `sample`: a pure
// function of its arguments, so batching and preemption cannot change it.
double uniform01(uint64_t seed, int64_t sample, int64_t step) {
  uint64_t h = splitmix64(seed ^ splitmix64(uint64_t(sample) * 0xD1B54A32D192ED03ull ^ splitmix64(uint64_t(step))));
  return double(h >> 11) * 0x1.0p-53;
}

namespace {

// Ids the sampler never produces: unused/padding rows and the media placeholders.
const std::vector<uint8_t>& banned_ids(int64_t V) {
  static const std::vector<uint8_t> ban = [V] {
    std::vector<uint8_t> b(static_cast<size_t>(V));
    for (int64_t id = 0; id < V; ++id) b[size_t(id)] = phi4mm::is_unused_id(tok::TokenId(id)) || phi4mm::is_media_token(id);
    return b;
  }();
  if (int64_t(ban.size()) != V) throw std::logic_error("banned_ids: one vocabulary size per process");
  return ban;
}

using cpu::exp_nonpositive;
using cpu::F8;

// banned_ids as a list: the few ids to set to -inf.
const std::vector<int64_t>& banned_list(int64_t V) {
  const std::vector<uint8_t>& ban = banned_ids(V);
  static const std::vector<int64_t> list = [&ban] {
    std::vector<int64_t> l;
    for (size_t id = 0; id < ban.size(); ++id)
      if (ban[id]) l.push_back(int64_t(id));
    return l;
  }();
  return list;
}

typedef double D4 __attribute__((vector_size(32)));

// 8 lanes (F8) throughout: below AVX-512, GCC 12 lowers 16-lane selects and
// conversions nearly lane by lane (a 16-lane exp pass over the row took 4-5
// times as long on an AVX2 Zen 3).

// The largest entry (NaN ignored, as std::max over the row).
float row_max(const float* w, int64_t n) {
  F8 m = F8{} + kNegInf;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    F8 v;
    std::memcpy(&v, w + i, sizeof v);
    m = v > m ? v : m;
  }
  float mx = kNegInf;
  for (int l = 0; l < 8; ++l) mx = std::max(mx, m[l]);
  for (; i < n; ++i) mx = std::max(mx, w[i]);
  return mx;
}

// The 8 lanes' exp_nonpositive((w - mx) * inv), -inf entries as 0.
inline F8 exp_lanes(const float* w, float mx, float inv) {
  F8 v;
  std::memcpy(&v, w, sizeof v);
  const F8 e = exp_nonpositive((v - mx) * inv);
  return v == kNegInf ? F8{} : e;
}

inline double exp_one(float w, float mx, float inv) {
  return w == kNegInf ? 0.0 : double(exp_nonpositive((w - mx) * inv));
}

// exp_nonpositive((w - mx) * inv) over the row, banned entries (-inf) as 0,
// into pr as doubles when pr is given (the filtered draw sorts them), and
// their sum over 4 f64 lanes reduced in a fixed order.
double exp_row(const float* w, int64_t n, float mx, float inv, double* pr) {
  D4 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const F8 e = exp_lanes(w + i, mx, inv);
    const D4 lo = __builtin_convertvector(__builtin_shufflevector(e, e, 0, 1, 2, 3), D4),
             hi = __builtin_convertvector(__builtin_shufflevector(e, e, 4, 5, 6, 7), D4);
    if (pr) {
      std::memcpy(pr + i, &lo, sizeof lo);
      std::memcpy(pr + i + 4, &hi, sizeof hi);
    }
    acc += lo;
    acc += hi;
  }
  double total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  for (; i < n; ++i) {
    const double e = exp_one(w[i], mx, inv);
    if (pr) pr[i] = e;
    total += e;
  }
  return total;
}

// The draw without filters: the first id whose running sum of
// exp((w - mx) * inv) passes target = u * total, the sums taken 8 ids at a
// time and only the group that crosses walked id by id; ids of weight 0 are
// never drawn. -1 when rounding leaves the target past the last sum.
int64_t draw(const float* w, int64_t n, float mx, float inv, double target) {
  double acc = 0;
  int64_t i = 0;
  auto walk = [&](const float* e, int64_t base, int64_t len) -> int64_t {
    for (int64_t l = 0; l < len; ++l) {
      if (e[l] == 0) continue;
      acc += double(e[l]);
      if (target < acc) return base + l;
    }
    return -1;
  };
  for (; i + 8 <= n; i += 8) {
    const F8 e = exp_lanes(w + i, mx, inv);
    const D4 d = __builtin_convertvector(__builtin_shufflevector(e, e, 0, 1, 2, 3), D4) +
                 __builtin_convertvector(__builtin_shufflevector(e, e, 4, 5, 6, 7), D4);
    const double gs = (d[0] + d[1]) + (d[2] + d[3]);
    if (acc + gs <= target) {
      acc += gs;
      continue;
    }
    float ev[8];
    std::memcpy(ev, &e, sizeof ev);
    if (const int64_t t = walk(ev, i, 8); t >= 0) return t;
  }
  float ev[8];
  for (int64_t l = 0; i + l < n; ++l) ev[l] = float(exp_one(w[i + l], mx, inv));
  return walk(ev, i, n - i);
}

}  // namespace

// log-sum-exp of a row: the training forward's log-softmax reductions
// (cpu::row_exp_sum), so rollout and training log-probabilities sum alike.
double log_sum_exp(const float* x, int64_t n) {
  const auto [mx, sum] = cpu::row_exp_sum(x, n);
  if (mx == kNegInf) return double(kNegInf);
  return double(mx) + std::log(sum);
}

namespace {

// The k largest entries of x (ties: lower id first), best first.
std::vector<int64_t> top_ids(const float* x, int64_t n, int64_t k) {
  k = std::min(k, n);
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [x](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  idx.resize(size_t(k));
  return idx;
}

}  // namespace

TokenLogprob make_logprob(const float* row, int64_t n, double lse, int64_t token, int64_t k, bool with_rank) {
  TokenLogprob t;
  t.token = token;
  t.logprob = float(double(row[token]) - lse);
  if (with_rank) {
    const float x = row[token];
    int64_t above = 0;
    for (int64_t i = 0; i < n; ++i) above += row[i] > x ? 1 : 0;
    t.rank = above + 1;
  }
  if (k > 0)
    for (int64_t id : top_ids(row, n, k)) t.top.emplace_back(id, float(double(row[id]) - lse));
  return t;
}


Picked pick_token(const SamplingParams& p, const SequenceView& s, const float* row, int64_t V,
                  std::span<const int64_t> stop_ids) {
  thread_local std::vector<float> work;
  thread_local std::vector<double> probs;
  const uint64_t seed = s.seed;
  work.resize(size_t(V));
  // Processed logits: the row with its banned ids (a short list) at -inf.
  std::memcpy(work.data(), row, size_t(V) * sizeof(float));
  for (int64_t id : banned_list(V)) work[size_t(id)] = kNegInf;
  for (auto& [id, bias] : p.logit_bias) work[size_t(id)] += float(bias);
  if (p.repetition_penalty != 1.0) {
    std::vector<uint8_t> seen(static_cast<size_t>(V), 0);
    for (int64_t t : s.tokens) seen[size_t(t)] = 1;
    for (int64_t id = 0; id < V; ++id)
      if (seen[size_t(id)]) {
        float& l = work[size_t(id)];
        l = l > 0 ? float(l / p.repetition_penalty) : float(l * p.repetition_penalty);
      }
  }
  if (p.presence_penalty != 0 || p.frequency_penalty != 0)
    for (auto& [id, c] : *s.counts)
      work[size_t(id)] -= float(p.frequency_penalty * double(c) + p.presence_penalty);
  if (!p.allowed_token_ids.empty()) {
    // Every id but the allowed ones at -inf; the allowed keep their values.
    thread_local std::vector<float> keep;
    keep.clear();
    for (int64_t id : p.allowed_token_ids) keep.push_back(work[size_t(id)]);
    std::fill(work.begin(), work.end(), kNegInf);
    for (size_t i = 0; i < keep.size(); ++i) work[size_t(p.allowed_token_ids[i])] = keep[i];
  }
  if (s.generated < p.min_tokens)
    for (int64_t id : stop_ids) work[size_t(id)] = kNegInf;
  if (!p.bad_words_ids.empty()) {
    const std::span<const int64_t> gen = s.tokens.last(size_t(s.generated));
    thread_local std::vector<std::pair<int64_t, float>> masked;
    masked.clear();
    for (const std::vector<int64_t>& seq : p.bad_words_ids) {
      const size_t k = seq.size() - 1;  // the ids the generated tokens must end with
      if (k > gen.size() || !std::equal(seq.begin(), seq.end() - 1, gen.end() - int64_t(k))) continue;
      float& l = work[size_t(seq.back())];
      if (l != kNegInf) masked.emplace_back(seq.back(), l), l = kNegInf;
    }
    // Where they leave no id to draw (and no grammar decides), they give way.
    if (!masked.empty() && !p.grammar && row_max(work.data(), V) == kNegInf)
      for (const auto& [id, l] : masked) work[size_t(id)] = l;
  }
  if (p.grammar)
    p.grammar->mask(s.tokens.last(size_t(s.generated)), p.max_tokens - s.generated, work.data(), V);

  int64_t token = 0;
  const float* w = work.data();
  const float mx = row_max(w, V);
  // The first id holding the largest value (greedy: ties to the lowest id).
  auto argmax = [&] {
    if (mx == kNegInf) return int64_t(0);
    int64_t id = 0;
    while (w[id] != mx) ++id;
    return id;
  };
  const bool filter = p.top_k > 0 || p.top_p < 1 || p.min_p > 0;
  if (p.temperature == 0 || mx == kNegInf) {
    token = argmax();
  } else if (!filter) {
    // A draw from softmax(w / T): target = u * sum, no probability array.
    const float inv_tf = float(1.0 / p.temperature);
    const double total = exp_row(w, V, mx, inv_tf, nullptr);
    const double u = uniform01(seed, s.sample, s.generated);
    token = draw(w, V, mx, inv_tf, u * total);
    if (token < 0) {  // rounding: the last id of non-zero weight
      token = V - 1;
      while (token > 0 && w[token] == kNegInf) --token;
    }
  } else {
    const double inv_t = 1.0 / p.temperature;
    std::vector<double>& prob = probs;
    prob.resize(size_t(V));
    const float inv_tf = float(inv_t);
    double* pr = prob.data();
    const double total = exp_row(w, V, mx, inv_tf, pr);
    for (double& x : prob) x /= total;
    const double u = uniform01(seed, s.sample, s.generated);
    {
      // Candidates best first; keep top_k, then the smallest prefix reaching top_p, then min_p.
      auto better = [&](int64_t a, int64_t b) {
        return prob[size_t(a)] > prob[size_t(b)] || (prob[size_t(a)] == prob[size_t(b)] && a < b);
      };
      // Only tokens with a non-zero probability are candidates.
      std::vector<int64_t> idx;
      for (int64_t id = 0; id < V; ++id)
        if (prob[size_t(id)] > 0) idx.push_back(id);
      const int64_t n = int64_t(idx.size());
      int64_t k = p.top_k > 0 ? std::min(p.top_k, n) : n;
      int64_t sorted = std::min<int64_t>(k, 1024);
      std::nth_element(idx.begin(), idx.begin() + (sorted - 1), idx.end(), better);
      std::sort(idx.begin(), idx.begin() + sorted, better);
      double cum = 0;
      for (int64_t i = 0; i < sorted; ++i) cum += prob[size_t(idx[size_t(i)])];
      if (sorted < k && cum < p.top_p) {
        std::sort(idx.begin(), idx.end(), better);
        sorted = k;
      }
      int64_t keep = 0;
      cum = 0;
      const double floor = p.min_p * prob[size_t(idx[0])];
      for (int64_t i = 0; i < sorted; ++i) {
        const double pr = prob[size_t(idx[size_t(i)])];
        if (pr <= 0 || pr < floor) break;
        cum += pr;
        ++keep;
        if (cum >= p.top_p) break;
      }
      keep = std::max<int64_t>(keep, 1);
      double acc = 0;
      token = idx[0];
      for (int64_t i = 0; i < keep; ++i) {
        acc += prob[size_t(idx[size_t(i)])];
        token = idx[size_t(i)];
        if (u * cum < acc) break;
      }
    }
    if (token < 0) token = 0;
  }
  Picked out;
  out.token = token;
  if (p.logprobs >= 0) out.logprob = make_logprob(row, V, log_sum_exp(row, V), token, p.logprobs);
  return out;
}


}  // namespace areno::serve
