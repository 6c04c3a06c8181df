#include "serve/cfg.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <queue>
#include <stdexcept>
#include <unordered_map>

#include <fmt/format.h>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "models/phi4mm/tokenizer/utf8.h"
#include "serve/grammar.h"

namespace areno::serve {

namespace {

constexpr int64_t kInf = int64_t(1) << 50;
constexpr uint32_t kNoCp = 0xffffffffu;
constexpr uint32_t kMaxCp = 0x10FFFF;
// A completion longer than this counts a token per byte (as serve/grammar.cpp does).
constexpr int64_t kSpellMaxBytes = 4096;
// Frames visited while closing one step: bounds what an ambiguous grammar costs.
constexpr size_t kMaxCloseWork = size_t(1) << 18;

int64_t sat_add(int64_t a, int64_t b) { return std::min(a + b, kInf); }

int utf8_bytes(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

bool name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
         c == '.';
}

using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

// Sorted, merged, without the surrogates (no UTF-8 text holds them).
Ranges normalized(Ranges r) {
  Ranges cut;
  for (auto [lo, hi] : r) {
    if (lo <= 0xD7FF) cut.push_back({lo, std::min<uint32_t>(hi, 0xD7FF)});
    if (hi >= 0xE000) cut.push_back({std::max<uint32_t>(lo, 0xE000), hi});
  }
  std::sort(cut.begin(), cut.end());
  Ranges out;
  for (auto [lo, hi] : cut) {
    if (!out.empty() && lo <= out.back().second + 1) out.back().second = std::max(out.back().second, hi);
    else out.push_back({lo, hi});
  }
  return out;
}

Ranges complement(const Ranges& r) {
  Ranges out;
  uint32_t next = 0;
  for (auto [lo, hi] : r) {
    if (lo > next) out.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= kMaxCp) out.push_back({next, kMaxCp});
  return normalized(std::move(out));
}

}  // namespace

// The parse stacks after the output so far: each a run [n, bottom .. top] in
// `flat` (its offset in `starts`), the top a terminal still to read, the
// frames below the positions to return to. `accept`: root is complete (the
// empty stack). A code point in progress (`need` bytes to come, its bits so
// far in `cp`, the next byte in [lo, hi]) keeps only the stacks whose top can
// still take it.
struct Cfg::State {
  std::vector<uint32_t> flat;
  std::vector<uint32_t> starts;
  bool accept = false;
  bool finished = false;  // the end token came
  bool cut = false;       // stacks were left out (kMaxStacks, kMaxCloseWork): not part of the state's identity
  uint8_t need = 0;
  uint8_t len = 0;  // the code point's bytes in all
  uint32_t cp = 0;
  unsigned char lo = 0x80, hi = 0xBF;

  size_t size() const { return starts.size(); }
  std::span<const uint32_t> stack(size_t k) const { return {flat.data() + starts[k] + 1, flat[starts[k]]}; }
  bool dead() const { return starts.empty() && !accept; }
  void clear() {
    flat.clear(), starts.clear();
    accept = finished = cut = false;
    need = len = 0, cp = 0, lo = 0x80, hi = 0xBF;
  }
  void add(std::span<const uint32_t> s) {
    starts.push_back(uint32_t(flat.size()));
    flat.push_back(uint32_t(s.size()));
    flat.insert(flat.end(), s.begin(), s.end());
  }
  // The code points the one in progress may still become (no overlong
  // form: at least the least code point of its length).
  std::pair<uint32_t, uint32_t> interval() const {
    const uint32_t shift = 6u * need;
    const uint32_t least = len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
    return {std::max(cp << shift, least), std::min((cp << shift) | ((1u << shift) - 1u), kMaxCp)};
  }
};

namespace {

// A state's identity: its stacks and the code point in progress (not `cut`).
std::string state_key(const Cfg::State& s) {
  std::string k(reinterpret_cast<const char*>(s.flat.data()), s.flat.size() * sizeof(uint32_t));
  const uint32_t tail[] = {uint32_t(s.accept), s.need, s.len, s.cp, s.lo, s.hi};
  k.append(reinterpret_cast<const char*>(tail), sizeof tail);
  return k;
}

}  // namespace

bool Cfg::Class::contains(uint32_t c) const {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), std::pair<uint32_t, uint32_t>(c, kNoCp));
  return it != ranges.begin() && std::prev(it)->second >= c;
}

uint32_t Cfg::Class::first_in(uint32_t lo, uint32_t hi) const {
  for (auto [a, b] : ranges)
    if (b >= lo && a <= hi) return std::max(a, lo);
  return kNoCp;
}

// ---- the parser ------------------------------------------------------------

class Cfg::Parser {
 public:
  Parser(Cfg& g, std::string_view src) : g_(g), src_(src) {}

  void run() {
    skip_ws();
    if (pos_ >= src_.size()) fail(0, "the grammar is empty (it needs a rule 'root ::= ...')");
    while (pos_ < src_.size()) {
      const size_t at = pos_;
      const std::string name = read_name();
      if (name.empty()) fail(at, fmt::format("expected a rule name, found {}", shown(at)));
      skip_ws();
      if (src_.substr(pos_, 3) != "::=") fail(pos_, fmt::format("expected '::=' after the rule name '{}'", name));
      pos_ += 3;
      const uint32_t r = ref(name, at);
      if (g_.rules_[r].defined) fail(at, fmt::format("the rule '{}' is defined twice", name));
      g_.rules_[r].defined = true;
      g_.rules_[r].origin = at;
      body(r);
      skip_ws();
    }
    for (const Rule& r : g_.rules_)
      if (!r.defined)
        fail(r.origin, fmt::format("the rule '{}' is used but never defined", r.name));
    auto it = names_.find("root");
    if (it == names_.end()) fail(0, "the grammar has no rule 'root' (its start)");
    g_.root_ = it->second;
  }

 private:
  using Seq = std::vector<Elem>;
  struct Frame {
    uint32_t rule;
    size_t open;  // the '(' (or the rule's name)
    std::vector<Seq> alts;
  };

  [[noreturn]] void fail(size_t at, const std::string& what) const {
    throw std::invalid_argument(fmt::format("{} (at byte {})", what, at));
  }
  std::string shown(size_t at) const {
    if (at >= src_.size()) return "the end of the grammar";
    const unsigned char c = uint8_t(src_[at]);
    return c >= 0x20 && c < 0x7f ? fmt::format("'{}'", char(c)) : fmt::format("byte 0x{:02x}", c);
  }

  void skip_ws() {
    while (pos_ < src_.size()) {
      const char c = src_[pos_];
      if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
        ++pos_;
      } else if (c == '#') {
        while (pos_ < src_.size() && src_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }
  std::string read_name() {
    const size_t a = pos_;
    while (pos_ < src_.size() && name_char(src_[pos_])) ++pos_;
    return std::string(src_.substr(a, pos_ - a));
  }
  // Whether a new rule (`name ::=`) begins at pos_.
  bool rule_start() {
    const size_t save = pos_;
    const bool named = !read_name().empty();
    skip_ws();
    const bool yes = named && src_.substr(pos_, 3) == "::=";
    pos_ = save;
    return yes;
  }

  uint32_t new_rule(std::string name, size_t origin) {
    if (g_.rules_.size() >= kMaxRules) fail(origin, fmt::format("the grammar has more than {} rules (groups and repetitions count)", kMaxRules));
    g_.rules_.push_back(Rule{std::move(name), origin, {}, true});
    return uint32_t(g_.rules_.size() - 1);
  }
  uint32_t ref(const std::string& name, size_t at) {
    auto it = names_.find(name);
    if (it != names_.end()) return it->second;
    const uint32_t r = new_rule(name, at);
    g_.rules_[r].defined = false;
    names_.emplace(name, r);
    return r;
  }
  void count(size_t n, size_t at) {
    elements_ += n;
    if (elements_ > kMaxElements)
      fail(at, fmt::format("the grammar has more than {} elements once its repetitions are written out", kMaxElements));
  }
  void define(uint32_t r, const std::vector<Seq>& alts) {
    for (const Seq& s : alts) {
      g_.rules_[r].alts.push_back(uint32_t(g_.elems_.size()));
      g_.elems_.insert(g_.elems_.end(), s.begin(), s.end());
      g_.elems_.push_back(Elem{kEnd, 0});
    }
  }
  uint32_t term(Ranges r, size_t at) {
    Class c;
    c.ranges = normalized(std::move(r));
    if (c.ranges.empty()) fail(at, "the character class matches no character");
    // A completion writes a lower-case letter, else a digit, else printable
    // ASCII, else the least code point (the fewest bytes in each case).
    auto first = [&](uint32_t lo, uint32_t hi) { return c.first_in(lo, hi); };
    for (auto [lo, hi] : {std::pair<uint32_t, uint32_t>{'a', 'z'}, {'0', '9'}, {0x20, 0x7e}, {0, kMaxCp}})
      if ((c.pick = first(lo, hi)) != kNoCp) break;
    g_.classes_.push_back(std::move(c));
    return uint32_t(g_.classes_.size() - 1);
  }
  std::string label(uint32_t rule, const char* what, size_t at) const {
    return fmt::format("the {} at byte {} in rule '{}'", what, at, g_.rules_[rule].name);
  }

  // One code point of a literal or class, escapes read.
  uint32_t read_char(size_t end_hint) {
    const size_t at = pos_;
    if (pos_ >= src_.size()) fail(end_hint, "the literal or class is not closed");
    unsigned char c = uint8_t(src_[pos_]);
    if (c == '\\') {
      if (++pos_ >= src_.size()) fail(at, "an escape is cut off at the end of the grammar");
      const char e = src_[pos_++];
      switch (e) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case '0': return 0;
        case '\\': case '"': case '\'': case '[': case ']': case '-': case '/': case '^': return uint32_t(uint8_t(e));
        case 'x': return hex(2, at);
        case 'u': return hex(4, at);
        case 'U': return hex(8, at);
        default: fail(at, fmt::format("unknown escape '\\{}'", e));
      }
    }
    unsigned char lo, hi;
    const int follow = utf8_lead(c, lo, hi);
    if (follow < 0) fail(at, "the grammar is not valid UTF-8");
    uint32_t cp = follow == 0 ? c : c & (follow == 1 ? 0x1F : follow == 2 ? 0x0F : 0x07);
    ++pos_;
    for (int k = 0; k < follow; ++k, ++pos_) {
      if (pos_ >= src_.size()) fail(at, "the grammar is not valid UTF-8");
      const unsigned char b = uint8_t(src_[pos_]);
      if (b < (k == 0 ? lo : 0x80) || b > (k == 0 ? hi : 0xBF)) fail(at, "the grammar is not valid UTF-8");
      cp = cp << 6 | (b & 0x3F);
    }
    return cp;
  }
  uint32_t hex(int digits, size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i, ++pos_) {
      if (pos_ >= src_.size() || !std::isxdigit(uint8_t(src_[pos_])))
        fail(at, fmt::format("the escape needs {} hex digits", digits));
      const char h = src_[pos_];
      v = v * 16 + uint32_t(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
    }
    if (v > kMaxCp || (v >= 0xD800 && v <= 0xDFFF)) fail(at, fmt::format("U+{:X} is not a character", v));
    return v;
  }

  // The repetition after an item, if any, applied to `x` (the item's one
  // symbol) and appended to `seq`.
  void quantified(Elem x, Seq& seq, uint32_t owner, size_t item_at) {
    skip_inline();
    const size_t at = pos_;
    const char q = pos_ < src_.size() ? src_[pos_] : '\0';
    auto star = [&] {
      const uint32_t r = new_rule(label(owner, "repetition", at), at);
      count(3, at);
      define(r, {Seq{x, Elem{kRule, r}}, Seq{}});
      return Elem{kRule, r};
    };
    auto optional_chain = [&](uint32_t k) {  // up to k more of x
      Elem tail{kEnd, 0};
      for (uint32_t i = 0; i < k; ++i) {
        const uint32_t r = new_rule(label(owner, "repetition", at), at);
        Seq one{x};
        if (tail.kind != kEnd) one.push_back(tail);
        count(one.size() + 2, at);
        define(r, {one, Seq{}});
        tail = Elem{kRule, r};
      }
      return tail;
    };
    if (q == '*') {
      ++pos_;
      seq.push_back(star());
    } else if (q == '+') {
      ++pos_;
      count(1, at);
      seq.push_back(x);
      seq.push_back(star());
    } else if (q == '?') {
      ++pos_;
      seq.push_back(optional_chain(1));
    } else if (q == '{') {
      ++pos_;
      const uint32_t m = number(at);
      uint32_t n = m;
      bool unbounded = false;
      skip_inline();
      if (pos_ < src_.size() && src_[pos_] == ',') {
        ++pos_;
        skip_inline();
        if (pos_ < src_.size() && src_[pos_] == '}') unbounded = true;
        else n = number(at);
      }
      skip_inline();
      if (pos_ >= src_.size() || src_[pos_] != '}') fail(at, "a repetition {m,n} is not closed by '}'");
      ++pos_;
      if (n < m) fail(at, fmt::format("the repetition {{{},{}}} has its maximum below its minimum", m, n));
      count(m, at);
      seq.insert(seq.end(), m, x);
      if (unbounded) seq.push_back(star());
      else if (n > m) seq.push_back(optional_chain(n - m));
    } else {
      count(1, item_at);
      seq.push_back(x);
    }
  }
  void skip_inline() {
    while (pos_ < src_.size() && (src_[pos_] == ' ' || src_[pos_] == '\t')) ++pos_;
  }
  uint32_t number(size_t at) {
    skip_inline();
    uint64_t v = 0;
    const size_t a = pos_;
    while (pos_ < src_.size() && src_[pos_] >= '0' && src_[pos_] <= '9' && v <= kMaxRepeat)
      v = v * 10 + uint64_t(src_[pos_++] - '0');
    if (pos_ == a) fail(at, "a repetition {m,n} needs numbers");
    if (v > kMaxRepeat) fail(at, fmt::format("a repetition count is above {}", kMaxRepeat));
    return uint32_t(v);
  }

  // The alternatives of rule r, groups nested on an explicit stack.
  void body(uint32_t r) {
    std::vector<Frame> frames;
    frames.push_back(Frame{r, pos_, {Seq{}}});
    while (true) {
      skip_ws();
      const size_t at = pos_;
      if (pos_ >= src_.size()) break;
      const char c = src_[pos_];
      Frame& f = frames.back();
      if (c == '|') {
        ++pos_;
        f.alts.emplace_back();
      } else if (c == '(') {
        ++pos_;
        frames.push_back(Frame{new_rule(label(r, "group", at), at), at, {Seq{}}});
      } else if (c == ')') {
        if (frames.size() == 1) fail(at, "')' closes no group");
        ++pos_;
        Frame done = std::move(frames.back());
        frames.pop_back();
        count(done.alts.size(), done.open);
        define(done.rule, done.alts);
        quantified(Elem{kRule, done.rule}, frames.back().alts.back(), r, done.open);
      } else if (c == '"') {
        ++pos_;
        Seq lit;
        while (pos_ < src_.size() && src_[pos_] != '"') {
          const uint32_t cp = read_char(at);
          lit.push_back(Elem{kTerm, term({{cp, cp}}, at)});
        }
        if (pos_ >= src_.size()) fail(at, "the literal is not closed by '\"'");
        ++pos_;
        Seq& seq = f.alts.back();
        if (lit.size() == 1) {
          quantified(lit[0], seq, r, at);
        } else {
          skip_inline();
          const bool rep = pos_ < src_.size() && (src_[pos_] == '*' || src_[pos_] == '+' || src_[pos_] == '?' || src_[pos_] == '{');
          if (!rep || lit.empty()) {
            count(lit.size(), at);
            seq.insert(seq.end(), lit.begin(), lit.end());
            if (rep) fail(pos_, "a repetition of the empty literal \"\"");
          } else {
            const uint32_t g = new_rule(label(r, "literal", at), at);
            count(lit.size() + 1, at);
            define(g, {lit});
            quantified(Elem{kRule, g}, seq, r, at);
          }
        }
      } else if (c == '[') {
        ++pos_;
        const bool negated = pos_ < src_.size() && src_[pos_] == '^';
        if (negated) ++pos_;
        Ranges ranges;
        while (pos_ < src_.size() && src_[pos_] != ']') {
          const uint32_t lo = read_char(at);
          uint32_t hi = lo;
          if (pos_ + 1 < src_.size() && src_[pos_] == '-' && src_[pos_ + 1] != ']') {
            ++pos_;
            hi = read_char(at);
            if (hi < lo) fail(at, fmt::format("the range U+{:04X}-U+{:04X} is reversed", lo, hi));
          }
          ranges.push_back({lo, hi});
        }
        if (pos_ >= src_.size()) fail(at, "the character class is not closed by ']'");
        ++pos_;
        quantified(Elem{kTerm, term(negated ? complement(normalized(ranges)) : ranges, at)}, f.alts.back(), r, at);
      } else if (c == '.') {
        ++pos_;
        quantified(Elem{kTerm, term({{0, kMaxCp}}, at)}, f.alts.back(), r, at);
      } else if (name_char(c)) {
        if (rule_start()) {
          if (frames.size() > 1) fail(frames.back().open, "the group '(' is not closed");
          break;
        }
        const std::string name = read_name();
        quantified(Elem{kRule, ref(name, at)}, f.alts.back(), r, at);
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        fail(at, fmt::format("the repetition '{}' follows nothing it could repeat", c));
      } else if (c == '/' || c == '%' || c == ':' || c == '\'') {
        fail(at, fmt::format("{} is not GBNF (Lark grammars are not read: write rules as 'name ::= ...', "
                             "literals in double quotes)", shown(at)));
      } else {
        fail(at, fmt::format("unexpected {}", shown(at)));
      }
    }
    if (frames.size() > 1) fail(frames.back().open, "the group '(' is not closed");
    count(frames[0].alts.size(), frames[0].open);
    define(r, frames[0].alts);
  }

  Cfg& g_;
  std::string_view src_;
  size_t pos_ = 0;
  size_t elements_ = 0;
  std::unordered_map<std::string, uint32_t> names_;
};

// ---- analysis ----------------------------------------------------------------

void Cfg::analyse() {
  const size_t R = rules_.size(), E = elems_.size();
  // The shortest sentence of every rule, by Knuth's generalization of
  // Dijkstra: an alternative's length is known once all its rules are.
  std::vector<uint32_t> alt_rule, alt_waiting;
  std::vector<int64_t> alt_sum;
  std::vector<std::vector<uint32_t>> uses(R);  // rule -> alternatives holding it (once per occurrence)
  for (uint32_t r = 0; r < R; ++r)
    for (uint32_t a0 : rules_[r].alts) {
      const uint32_t a = uint32_t(alt_rule.size());
      alt_rule.push_back(r), alt_waiting.push_back(0), alt_sum.push_back(0);
      for (uint32_t p = a0; elems_[p].kind != kEnd; ++p) {
        if (elems_[p].kind == kTerm) {
          alt_sum[a] += utf8_bytes(classes_[elems_[p].id].pick);
        } else {
          ++alt_waiting[a];
          uses[elems_[p].id].push_back(a);
        }
      }
    }
  rule_bytes_.assign(R, kInf);
  std::vector<uint32_t> rule_alt(R, 0);  // per rule: the alternative its shortest sentence takes
  std::vector<uint8_t> done(R, 0);
  std::vector<uint32_t> order;  // rules as their lengths became final
  using Item = std::pair<int64_t, uint32_t>;
  std::priority_queue<Item, std::vector<Item>, std::greater<>> queue;
  std::vector<uint32_t> first_alt(R, 0);
  for (uint32_t a = 0, r = 0; r < R; a += uint32_t(rules_[r].alts.size()), ++r) first_alt[r] = a;
  auto offer = [&](uint32_t a) {
    const uint32_t r = alt_rule[a];
    if (!done[r] && alt_sum[a] < rule_bytes_[r]) {
      rule_bytes_[r] = alt_sum[a], rule_alt[r] = a - first_alt[r];
      queue.push({alt_sum[a], r});
    }
  };
  for (uint32_t a = 0; a < alt_rule.size(); ++a)
    if (alt_waiting[a] == 0) offer(a);
  while (!queue.empty()) {
    const auto [len, r] = queue.top();
    queue.pop();
    if (done[r] || len != rule_bytes_[r]) continue;
    done[r] = 1;
    order.push_back(r);
    for (uint32_t a : uses[r]) {
      alt_sum[a] = sat_add(alt_sum[a], len);
      if (--alt_waiting[a] == 0) offer(a);
    }
  }
  // Left recursion: a rule reaching itself through the first symbols of its
  // alternatives, past rules that can be empty. Depth-first on a work list.
  std::vector<std::vector<uint32_t>> left(R);
  for (uint32_t r = 0; r < R; ++r)
    for (uint32_t a0 : rules_[r].alts)
      for (uint32_t p = a0; elems_[p].kind == kRule; ++p) {
        left[r].push_back(elems_[p].id);
        if (rule_bytes_[elems_[p].id] != 0) break;
      }
  std::vector<uint8_t> color(R, 0);  // 0 new, 1 on the path, 2 finished
  for (uint32_t s = 0; s < R; ++s) {
    if (color[s]) continue;
    std::vector<std::pair<uint32_t, size_t>> path{{s, 0}};
    color[s] = 1;
    while (!path.empty()) {
      auto& [r, i] = path.back();
      if (i == left[r].size()) {
        color[r] = 2;
        path.pop_back();
        continue;
      }
      const uint32_t t = left[r][i++];
      if (color[t] == 1)
        throw std::invalid_argument(fmt::format(
            "the rule '{}' is left-recursive: it can reach itself before reading a character (at byte {}; "
            "write the repetition with '*' or '+', of something that cannot be empty)",
            rules_[t].name, rules_[t].origin));
      if (!color[t]) color[t] = 1, path.push_back({t, 0});
    }
  }
  // Every rule root reaches must be able to finish.
  std::vector<uint8_t> seen(R, 0);
  std::vector<uint32_t> todo{root_};
  seen[root_] = 1;
  while (!todo.empty()) {
    const uint32_t r = todo.back();
    todo.pop_back();
    if (rule_bytes_[r] >= kInf)
      throw std::invalid_argument(fmt::format(
          "the rule '{}' can never finish (each of its alternatives needs itself again; at byte {})", rules_[r].name,
          rules_[r].origin));
    for (uint32_t a0 : rules_[r].alts)
      for (uint32_t p = a0; elems_[p].kind != kEnd; ++p)
        if (elems_[p].kind == kRule && !seen[elems_[p].id]) seen[elems_[p].id] = 1, todo.push_back(elems_[p].id);
  }
  int64_t total = 0;
  for (uint32_t r = 0; r < R; ++r)
    if (seen[r]) total = sat_add(total, rule_bytes_[r]);
  if (total > int64_t(kMaxShortestBytes))
    throw std::invalid_argument(fmt::format("the shortest sentences of the grammar's rules take more than {} bytes together",
                                            kMaxShortestBytes));
  // Those sentences, in the order their lengths became final (each uses
  // only rules before it).
  shortest_.assign(R, {});
  for (uint32_t r : order) {
    if (!seen[r]) continue;
    std::string& s = shortest_[r];
    for (uint32_t p = rules_[r].alts[rule_alt[r]]; elems_[p].kind != kEnd; ++p) {
      if (elems_[p].kind == kTerm) tok::append_utf8(s, classes_[elems_[p].id].pick);
      else s += shortest_[elems_[p].id];
    }
  }
  rest_.assign(E, 0);
  for (size_t p = E; p-- > 0;) {
    const Elem& e = elems_[p];
    if (e.kind == kEnd) continue;
    rest_[p] = sat_add(e.kind == kTerm ? utf8_bytes(classes_[e.id].pick) : rule_bytes_[e.id], rest_[p + 1]);
  }
}

std::shared_ptr<const Cfg> Cfg::compile(std::shared_ptr<const TokenBytes> bytes, std::string_view grammar) {
  if (grammar.size() > kMaxGrammarBytes)
    throw std::invalid_argument(fmt::format("the grammar has {} bytes (at most {})", grammar.size(), kMaxGrammarBytes));
  // A completion may write any byte a sentence can hold: each must be a token.
  for (int c = 0; c < 256; ++c)
    if (bytes->byte_token(uint8_t(c)) < 0)
      throw std::invalid_argument(fmt::format("the vocabulary has no token of the byte 0x{:02x}", c));
  std::shared_ptr<Cfg> g(new Cfg());
  g->bytes_ = std::move(bytes);
  Parser(*g, grammar).run();
  g->analyse();
  State st;
  g->start(st);
  if (st.dead())
    throw std::invalid_argument(fmt::format("the rule 'root' nests deeper than {} rules before its first character", kMaxDepth));
  if (st.cut)
    throw std::invalid_argument(fmt::format(
        "the grammar opens more than {} ways to read its first character (merge alternatives that begin alike)",
        kMaxStacks));
  // The shortest sentence must itself be readable within the stacks'
  // bounds, or even the first completion could not be followed (a sentence
  // that long would not fit any max_tokens a request can give anyway).
  if (g->rule_bytes_[g->root_] > int64_t(kMaxRootBytes))
    throw std::invalid_argument(fmt::format("the shortest sentence of 'root' has {} bytes (at most {})",
                                            g->rule_bytes_[g->root_], kMaxRootBytes));
  if (!g->matches(g->shortest_[g->root_]))
    throw std::invalid_argument(fmt::format(
        "the shortest sentence of 'root' nests deeper than {} rules (or opens more than {} readings at once)", kMaxDepth,
        kMaxStacks));
  g->min_tokens_ = g->completion_tokens(st, nullptr);
  return g;
}

// ---- the parse stacks ----------------------------------------------------------

void Cfg::close(std::vector<uint32_t>& s0, State& out, size_t& work_left) const {
  std::vector<std::vector<uint32_t>> work;
  work.push_back(std::move(s0));
  while (!work.empty()) {
    std::vector<uint32_t> s = std::move(work.back());
    work.pop_back();
    while (true) {
      if (work_left == 0) {
        out.cut = true;
        return;
      }
      --work_left;
      if (s.empty()) {
        out.accept = true;
        break;
      }
      const uint32_t p = s.back();
      const Elem e = elems_[p];
      if (e.kind == kEnd) {
        s.pop_back();
        continue;
      }
      if (e.kind == kTerm) {
        out.add(s);
        break;
      }
      s.pop_back();
      if (elems_[p + 1].kind != kEnd) s.push_back(p + 1);  // no frame to return to the end of an alternative
      if (s.size() >= kMaxDepth) break;                    // nested too deep: not written
      const Rule& r = rules_[e.id];
      for (size_t a = r.alts.size(); a-- > 1;) {
        std::vector<uint32_t> c = s;
        c.push_back(r.alts[a]);
        work.push_back(std::move(c));
      }
      s.push_back(r.alts[0]);
    }
  }
}

void Cfg::start(State& st) const {
  st.clear();
  std::vector<uint32_t> s;
  size_t work_left = kMaxCloseWork;
  // root as a rule call from an empty stack: each alternative.
  for (uint32_t a : rules_[root_].alts) {
    s.assign(1, a);
    close(s, st, work_left);
  }
  normalize(st);
}

// Duplicate stacks go; of more than kMaxStacks, those with the shortest
// completions stay (ties: in order).
void Cfg::normalize(State& st) const {
  if (st.size() < 2) return;
  std::vector<uint32_t> idx(st.size());
  for (uint32_t k = 0; k < idx.size(); ++k) idx[k] = k;
  auto less = [&](uint32_t a, uint32_t b) {
    const auto x = st.stack(a), y = st.stack(b);
    return std::lexicographical_compare(x.begin(), x.end(), y.begin(), y.end());
  };
  std::sort(idx.begin(), idx.end(), less);
  idx.erase(std::unique(idx.begin(), idx.end(),
                        [&](uint32_t a, uint32_t b) {
                          const auto x = st.stack(a), y = st.stack(b);
                          return std::equal(x.begin(), x.end(), y.begin(), y.end());
                        }),
            idx.end());
  if (idx.size() > kMaxStacks) {
    std::vector<int64_t> cost(st.size());
    for (uint32_t k : idx) cost[k] = stack_bytes(st, k);
    std::stable_sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return cost[a] < cost[b]; });
    idx.resize(kMaxStacks);
    std::sort(idx.begin(), idx.end(), less);
    st.cut = true;
  }
  if (idx.size() == st.size()) return;
  State out;
  for (uint32_t k : idx) out.add(st.stack(k));
  st.flat.swap(out.flat);
  st.starts.swap(out.starts);
}

void Cfg::step_cp(const State& in, uint32_t cp, State& out, size_t* spent) const {
  out.clear();
  std::vector<uint32_t> s;
  size_t work_left = kMaxCloseWork;
  for (size_t k = 0; k < in.size(); ++k) {
    const auto st = in.stack(k);
    if (!classes_[elems_[st.back()].id].contains(cp)) continue;
    s.assign(st.begin(), st.end());
    s.back() += 1;
    close(s, out, work_left);
  }
  if (spent) *spent += kMaxCloseWork - work_left;
  normalize(out);
}

bool Cfg::step_byte(const State& in, unsigned char c, State& out, size_t* spent) const {
  if (in.finished) return false;
  uint32_t cp;
  int need;
  if (in.need == 0) {
    unsigned char lo, hi;
    need = utf8_lead(c, lo, hi);
    if (need < 0) return false;
    cp = need == 0 ? c : c & (need == 1 ? 0x1Fu : need == 2 ? 0x0Fu : 0x07u);
    if (need > 0) out.lo = lo, out.hi = hi;
  } else {
    if (c < in.lo || c > in.hi) return false;
    cp = in.cp << 6 | (c & 0x3Fu);
    need = in.need - 1;
    out.lo = 0x80, out.hi = 0xBF;
  }
  if (need == 0) {
    step_cp(in, cp, out, spent);
    return !out.dead();
  }
  // A code point in progress: the stacks whose top may still take it.
  const unsigned char lo = out.lo, hi = out.hi;
  out.clear();
  out.need = uint8_t(need), out.len = in.need ? in.len : uint8_t(need + 1), out.cp = cp, out.lo = lo, out.hi = hi;
  const auto [a, b] = out.interval();
  for (size_t k = 0; k < in.size(); ++k) {
    const auto st = in.stack(k);
    if (classes_[elems_[st.back()].id].first_in(a, b) != kNoCp) out.add(st);
  }
  return !out.dead();
}

Cfg::Cfg() : replayed_(std::make_unique<ReplayCache<State>>()), masks_(std::make_unique<MaskCache>()) {}
Cfg::~Cfg() = default;

bool Cfg::replay(std::span<const int64_t> generated, State& st) const {
  const size_t from = replayed_->find(generated, st);
  if (from == 0) start(st);
  if (from == generated.size()) return true;
  State next;
  for (int64_t id : generated.subspan(from)) {
    if (st.finished || id < 0 || id >= bytes_->size()) return false;
    if (bytes_->special(id)) {
      if (id != phi4mm::kEnd || !st.accept || st.need) return false;
      st.finished = true;
      continue;
    }
    if (bytes_->bytes(id).empty()) return false;  // an id with no text is never drawn
    for (unsigned char c : bytes_->bytes(id)) {
      if (!step_byte(st, c, next)) return false;
      std::swap(st, next);
    }
  }
  replayed_->put(generated, st);
  return true;
}

bool Cfg::matches(std::string_view text) const {
  State st, next;
  start(st);
  for (unsigned char c : text) {
    if (!step_byte(st, c, next)) return false;
    std::swap(st, next);
  }
  return st.accept && st.need == 0;
}

// ---- completions -----------------------------------------------------------------

int64_t Cfg::stack_bytes(const State& st, size_t k) const {
  const auto s = st.stack(k);
  const uint32_t top = s.back();
  int64_t n = st.need ? sat_add(st.need, rest_[top + 1]) : rest_[top];
  for (size_t i = s.size() - 1; i-- > 0;) n = sat_add(n, rest_[s[i]]);
  return n;
}

std::string Cfg::stack_text(const State& st, size_t k) const {
  const auto s = st.stack(k);
  std::string out;
  auto rest = [&](uint32_t p) {
    for (; elems_[p].kind != kEnd; ++p) {
      if (elems_[p].kind == kTerm) tok::append_utf8(out, classes_[elems_[p].id].pick);
      else out += shortest_[elems_[p].id];
    }
  };
  uint32_t top = s.back();
  if (st.need) {
    const auto [a, b] = st.interval();
    std::string cp;
    tok::append_utf8(cp, classes_[elems_[top].id].first_in(a, b));
    out += cp.substr(cp.size() - st.need);
    ++top;
  }
  rest(top);
  for (size_t i = s.size() - 1; i-- > 0;) rest(s[i]);
  return out;
}

struct Cfg::SpellCache {
  std::unordered_map<std::string, int64_t> tokens;
};

int64_t Cfg::completion_tokens(const State& st, SpellCache* cache, size_t* best) const {
  if (st.finished) return 0;
  if (st.accept && st.need == 0) {
    if (best) *best = size_t(-1);
    return 1;
  }
  int64_t least = kInf, least_bytes = kInf;
  for (size_t k = 0; k < st.size(); ++k) {
    const int64_t b = stack_bytes(st, k);
    if (b >= kInf) continue;
    int64_t n = b;
    if (b <= kSpellMaxBytes) {
      const std::string text = stack_text(st, k);
      if (!cache) {
        n = bytes_->spell(text);
      } else if (auto it = cache->tokens.find(text); it != cache->tokens.end()) {
        n = it->second;
      } else {
        n = bytes_->spell(text);
        cache->tokens.emplace(text, n);
      }
    }
    if (n + 1 < least || (n + 1 == least && b < least_bytes)) {
      least = n + 1, least_bytes = b;
      if (best) *best = k;
    }
  }
  return least;
}

bool Cfg::accepts(std::span<const int64_t> generated) const {
  State st;
  return replay(generated, st);
}

int64_t Cfg::completion_length(std::span<const int64_t> generated) const {
  State st;
  if (!replay(generated, st)) throw std::logic_error("grammar: the output is not a prefix of the language");
  return completion_tokens(st, nullptr);
}

std::vector<int64_t> Cfg::completion(std::span<const int64_t> generated) const {
  State st;
  if (!replay(generated, st)) throw std::logic_error("grammar: the output is not a prefix of the language");
  std::vector<int64_t> out;
  if (st.finished) return out;
  size_t k = size_t(-1);
  if (completion_tokens(st, nullptr, &k) >= kInf) return out;
  if (k != size_t(-1)) {
    const std::string text = stack_text(st, k);
    if (int64_t(text.size()) <= kSpellMaxBytes) bytes_->spell(text, &out);
    else
      for (unsigned char c : text) out.push_back(bytes_->byte_token(c));
  }
  out.push_back(phi4mm::kEnd);
  return out;
}

void Cfg::mask(std::span<const int64_t> generated, int64_t remaining, float* work, int64_t V) const {
  State st;
  if (!replay(generated, st)) throw std::logic_error("grammar: the output is not a prefix of the language");
  if (st.finished) return;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t budget = remaining - 1;  // tokens after this one
  const int64_t n = std::min(V, bytes_->size());
  const std::string st_key = state_key(st);
  auto apply = [&](const std::vector<uint64_t>& allowed) {
    bool any = false;
    for (int64_t id = 0; id < n; ++id) {
      if (!(allowed[size_t(id) >> 6] >> (id & 63) & 1) || std::isnan(work[id])) work[id] = kNegInf;
      else any |= work[id] != kNegInf;
    }
    std::fill(work + n, work + V, kNegInf);
    return any;
  };
  // No allowed id has a finite logit: the first token of the shortest
  // completion, when the language takes it (it may not where the stacks'
  // bounds cut that path), else the first id the language takes.
  auto force = [&](const std::vector<uint64_t>& live) {
    auto takes = [&](int64_t id) { return id >= 0 && id < n && (live[size_t(id) >> 6] >> (id & 63) & 1); };
    const std::vector<int64_t> c = completion(generated);
    int64_t id = c.empty() ? -1 : c[0];
    for (int64_t k = 0; !takes(id) && k < n; ++k) id = k;
    if (!takes(id)) throw std::runtime_error("grammar: no token can continue the output within the grammar's bounds");
    std::fill(work, work + V, kNegInf);
    work[id] = 0.0f;
  };
  if (std::vector<uint64_t> allowed; masks_->find(st_key, remaining, allowed)) {
    if (!apply(allowed)) force(allowed);
    return;
  }
  SpellCache cache;
  // A state fits when its completion's bytes and the end token do (each byte
  // is a token), else when its fewest tokens do.
  int64_t worst = 1;  // the most bytes (and the end token) a reachable state's completion has
  auto fits = [&](const State& s) {
    int64_t b = s.accept && s.need == 0 ? 0 : kInf;
    for (size_t k = 0; k < s.size(); ++k) b = std::min(b, stack_bytes(s, k));
    worst = std::max(worst, b + 1);
    if (b + 1 <= budget) return true;
    return completion_tokens(s, &cache) <= budget;
  };
  // The states met while walking the ids, each kept once with its steps by
  // byte and whether it fits: a small automaton built on the fly (inside a
  // free string most ids lead back to one state).
  std::vector<State> states{st};
  std::unordered_map<std::string, int32_t> index;
  // Steps by (state, byte): a dense table for the first kDense states, a map
  // past them (a grammar that makes each id's bytes a new state).
  constexpr size_t kDense = 1024;
  constexpr int32_t kUnknown = -2;
  std::vector<int32_t> table(256, kUnknown);
  std::unordered_map<uint64_t, int32_t> next;  // -1: dead
  std::vector<int8_t> fit{-1};
  index.emplace(st_key, 0);
  State scratch;
  size_t spent = 0;
  auto step = [&](int32_t from, unsigned char c) {
    const bool dense = size_t(from) < kDense;
    const uint64_t k = uint64_t(from) << 8 | c;
    if (dense) {
      if (table[k] != kUnknown) return table[k];
    } else if (auto it = next.find(k); it != next.end()) {
      return it->second;
    }
    int32_t to = -1;
    const bool alive = step_byte(states[size_t(from)], c, scratch, &spent);
    if (spent > kMaxMaskWork)
      throw std::runtime_error(fmt::format("grammar: the mask of one token needs more than {} parse steps (an ambiguous "
                                           "grammar)",
                                           kMaxMaskWork));
    if (alive) {
      auto [it, added] = index.emplace(state_key(scratch), int32_t(states.size()));
      if (added) {
        states.push_back(scratch), fit.push_back(-1);
        if (states.size() <= kDense) table.resize(states.size() * 256, kUnknown);
      }
      to = it->second;
    }
    if (dense) table[k] = to;
    else next.emplace(k, to);
    return to;
  };
  // The ids in the order of their bytes, so that ids sharing a prefix share
  // the states after it: path[d] is the state after the first d bytes of the
  // previous id, known up to `have`; a prefix that dies at dead_at kills
  // every id that shares it. Memory is read in order; only the verdicts are
  // written by id, in the pass after.
  // live: the ids the language allows (cached for the state); ok: those that also fit.
  std::vector<uint64_t> live(size_t(n + 63) / 64, 0), ok(live.size(), 0);
  std::vector<int32_t> path(1, 0);
  size_t have = 0, dead_at = size_t(-1);
  for (size_t i = 0; i < bytes_->ordered_size(); ++i) {
    const std::string_view b = bytes_->ordered_bytes(i);
    const size_t l = std::min<size_t>(bytes_->ordered_shared(i), have);
    if (dead_at <= l) {
      have = l;
      continue;
    }
    dead_at = size_t(-1);
    if (path.size() < b.size() + 1) path.resize(b.size() + 1);
    for (size_t d = l; d < b.size(); ++d)
      if ((path[d + 1] = step(path[d], uint8_t(b[d]))) < 0) {
        dead_at = d + 1;
        break;
      }
    have = dead_at == size_t(-1) ? b.size() : dead_at;
    const int32_t id = bytes_->ordered_id(i);
    if (dead_at != size_t(-1) || id >= n) continue;
    const int32_t t = path[b.size()];
    if (fit[size_t(t)] < 0) fit[size_t(t)] = fits(states[size_t(t)]);
    live[size_t(id) >> 6] |= uint64_t(1) << (id & 63);
    if (fit[size_t(t)]) ok[size_t(id) >> 6] |= uint64_t(1) << (id & 63);
  }
  if (phi4mm::kEnd < n && st.accept && st.need == 0) {
    live[size_t(phi4mm::kEnd) >> 6] |= uint64_t(1) << (phi4mm::kEnd & 63);
    ok[size_t(phi4mm::kEnd) >> 6] |= uint64_t(1) << (phi4mm::kEnd & 63);
  }
  masks_->put(st_key, live, worst + 1);
  if (!apply(ok)) force(live);
}

}  // namespace areno::serve
