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
#include "serve/grammar.h"
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
using cpu::F16;

// exp_nonpositive over n entries of w (relative to mx, times inv) into pr as
// doubles, banned entries (-inf) as 0, and the sum of pr: 16 lanes at a time,
// the sum over 8 lanes reduced in a fixed order.
double exp_row(const float* w, int64_t n, float mx, float inv, double* pr) {
  typedef double D8 __attribute__((vector_size(64)));
  typedef float F8 __attribute__((vector_size(32)));
  D8 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    F16 w16;
    std::memcpy(&w16, w + i, sizeof w16);
    F16 e = exp_nonpositive((w16 - mx) * inv);
    e = w16 == kNegInf ? F16{} : e;
    F8 lo, hi;
    std::memcpy(&lo, &e, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&e) + sizeof lo, sizeof hi);
    const D8 dlo = __builtin_convertvector(lo, D8), dhi = __builtin_convertvector(hi, D8);
    std::memcpy(pr + i, &dlo, sizeof dlo);
    std::memcpy(pr + i + 8, &dhi, sizeof dhi);
    acc += dlo;
    acc += dhi;
  }
  double total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) {
    pr[i] = w[i] == kNegInf ? 0.0 : double(exp_nonpositive((w[i] - mx) * inv));
    total += pr[i];
  }
  return total;
}

}  // namespace

// log-sum-exp of a row (finite entries).
double log_sum_exp(const float* x, int64_t n) {
  float mx = kNegInf;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  if (mx == kNegInf) return double(kNegInf);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(double(x[i]) - double(mx));
  return double(mx) + std::log(s);
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

TokenLogprob make_logprob(const float* row, int64_t n, double lse, int64_t token, int64_t k) {
  TokenLogprob t;
  t.token = token;
  t.logprob = float(double(row[token]) - lse);
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
  // Processed logits.
  const std::vector<uint8_t>& ban = banned_ids(V);
  for (int64_t id = 0; id < V; ++id) work[size_t(id)] = ban[size_t(id)] ? kNegInf : row[id];
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
  if (s.generated < p.min_tokens)
    for (int64_t id : stop_ids) work[size_t(id)] = kNegInf;
  if (p.grammar)
    p.grammar->mask(s.tokens.last(size_t(s.generated)), p.max_tokens - s.generated, work.data(), V);

  int64_t token = 0;
  if (p.temperature == 0) {
    float best = kNegInf;
    for (int64_t id = 0; id < V; ++id)
      if (work[size_t(id)] > best) best = work[size_t(id)], token = id;
  } else {
    float mx = kNegInf;
    for (float x : work) mx = std::max(mx, x);
    const double inv_t = 1.0 / p.temperature;
    std::vector<double>& prob = probs;
    prob.resize(size_t(V));
    const float inv_tf = float(inv_t);
    const float* w = work.data();
    double* pr = prob.data();
    const double total = exp_row(w, V, mx, inv_tf, pr);
    for (double& x : prob) x /= total;
    const double u = uniform01(seed, s.sample, s.generated);
    const bool filter = p.top_k > 0 || p.top_p < 1 || p.min_p > 0;
    if (!filter) {
      double acc = 0;
      token = -1;
      for (int64_t id = 0; id < V; ++id) {
        if (prob[size_t(id)] == 0) continue;
        acc += prob[size_t(id)];
        token = id;
        if (u < acc) break;
      }
    } else {
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
