#pragma once
// What the sampler asks of a constrained output (serve/sampler.h): the ids
// that may come next, and the fewest tokens a complete output takes. The
// fixed-shape grammars (tool calls, JSON, choices, regular expressions:
// serve/grammar.h) and context-free grammars (serve/cfg.h) answer it.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

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

// Puts `e` into a least-recently-used cache of `capacity` entries (each
// with a `used` stamp).
template <typename Entry>
void lru_put(std::vector<Entry>& entries, Entry e, size_t capacity) {
  if (entries.size() < capacity) {
    entries.push_back(std::move(e));
    return;
  }
  *std::min_element(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.used < b.used; }) =
      std::move(e);
}

// The parse states after the last few outputs replayed (one per sample of a
// request): a decode step replays only the tokens after the longest of them
// that its output starts with, not the whole output again. Least recently
// used out first; shared by the threads that pick tokens.
template <typename State>
class ReplayCache {
 public:
  static constexpr size_t kEntries = 8;
  // The length of the longest output kept that `generated` starts with (0:
  // none); its state goes to `st`.
  size_t find(std::span<const int64_t> generated, State& st) {
    std::lock_guard<std::mutex> lock(mutex_);
    Entry* base = nullptr;
    size_t from = 0;
    for (Entry& e : entries_)
      if (e.tokens.size() > from && e.tokens.size() <= generated.size() &&
          std::equal(e.tokens.begin(), e.tokens.end(), generated.begin()))
        base = &e, from = e.tokens.size();
    if (base) st = base->state, base->used = ++clock_;
    return from;
  }
  void put(std::span<const int64_t> generated, const State& st) {
    std::lock_guard<std::mutex> lock(mutex_);
    lru_put(entries_, Entry{std::vector<int64_t>(generated.begin(), generated.end()), st, ++clock_}, kEntries);
  }

 private:
  struct Entry {
    std::vector<int64_t> tokens;
    State state;
    uint64_t used = 0;
  };
  std::mutex mutex_;
  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
};

// The ids a constraint allows after a parse state, kept per state (as
// xgrammar keeps token masks per grammar state): with `fit_from` tokens left
// or more (this one included) every one of them also fits, so the mask is
// those ids, whatever the logits. The last kEntries states, least recently
// used out first; shared by the threads that pick tokens.
class MaskCache {
 public:
  static constexpr size_t kEntries = 16;
  // The allowed ids (a bit per id) after the state `key` when `remaining`
  // tokens left make them all fit; false when no entry does.
  bool find(const std::string& key, int64_t remaining, std::vector<uint64_t>& allowed) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Entry& e : entries_)
      if (e.key == key && remaining >= e.fit_from) {
        e.used = ++clock_;
        allowed = e.allowed;
        return true;
      }
    return false;
  }
  void put(std::string key, std::vector<uint64_t> allowed, int64_t fit_from) {
    std::lock_guard<std::mutex> lock(mutex_);
    lru_put(entries_, Entry{std::move(key), std::move(allowed), fit_from, ++clock_}, kEntries);
  }

 private:
  struct Entry {
    std::string key;
    std::vector<uint64_t> allowed;  // a bit per id
    int64_t fit_from = 0;           // remaining tokens (this one included) from which all fit
    uint64_t used = 0;
  };
  std::mutex mutex_;
  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
};

}  // namespace areno::serve
