#include "serve/regex.h"

#include <algorithm>
#include <cctype>
#include <deque>
#include <limits>
#include <map>
#include <stdexcept>
#include <tuple>
#include <utility>

#include <fmt/format.h>

namespace areno::serve {

namespace {

constexpr uint32_t kMaxCp = 0x10FFFF;
constexpr uint32_t kInfinite = std::numeric_limits<uint32_t>::max();

// Code point ranges, inclusive.
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

Ranges normalize(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [a, b] : r) {
    if (!out.empty() && a <= out.back().second + 1) out.back().second = std::max(out.back().second, b);
    else out.emplace_back(a, b);
  }
  return out;
}

Ranges negate(const Ranges& in) {
  const Ranges r = normalize(in);
  Ranges out;
  uint32_t next = 0;
  for (const auto& [a, b] : r) {
    if (a > next) out.emplace_back(next, a - 1);
    next = b + 1;
  }
  if (next <= kMaxCp) out.emplace_back(next, kMaxCp);
  return out;
}

// Without the surrogates, which UTF-8 cannot encode.
Ranges without_surrogates(const Ranges& in) {
  Ranges out;
  for (auto [a, b] : normalize(in)) {
    if (b < 0xD800 || a > 0xDFFF) {
      out.emplace_back(a, b);
      continue;
    }
    if (a < 0xD800) out.emplace_back(a, 0xD7FF);
    if (b > 0xDFFF) out.emplace_back(0xE000, b);
  }
  return out;
}

int encode_utf8(uint32_t cp, uint8_t* out) {
  if (cp < 0x80) return out[0] = uint8_t(cp), 1;
  if (cp < 0x800) return out[0] = uint8_t(0xC0 | cp >> 6), out[1] = uint8_t(0x80 | (cp & 0x3F)), 2;
  if (cp < 0x10000)
    return out[0] = uint8_t(0xE0 | cp >> 12), out[1] = uint8_t(0x80 | (cp >> 6 & 0x3F)),
           out[2] = uint8_t(0x80 | (cp & 0x3F)), 3;
  out[0] = uint8_t(0xF0 | cp >> 18), out[1] = uint8_t(0x80 | (cp >> 12 & 0x3F));
  out[2] = uint8_t(0x80 | (cp >> 6 & 0x3F)), out[3] = uint8_t(0x80 | (cp & 0x3F));
  return 4;
}

// A range of code points (no surrogates) as sequences of byte ranges, each
// sequence one UTF-8 length whose every byte position spans a range: split
// first where the encoded length changes, then where a continuation byte
// would not span its whole 80-BF (so the product of the ranges is exact).
using ByteSeq = std::vector<std::pair<uint8_t, uint8_t>>;
void utf8_sequences(uint32_t lo, uint32_t hi, std::vector<ByteSeq>& out) {
  std::vector<std::pair<uint32_t, uint32_t>> todo{{lo, hi}};
  while (!todo.empty()) {
    auto [a, b] = todo.back();
    todo.pop_back();
    for (bool split = true; split;) {
      split = false;
      for (uint32_t m : {0x7Fu, 0x7FFu, 0xFFFFu})
        if (a <= m && m < b) {
          todo.emplace_back(m + 1, b);
          b = m;
        }
      if (b < 0x80) break;
      for (int i = 1; i < 4 && !split; ++i) {
        const uint32_t m = (1u << (6 * i)) - 1;
        if ((a & ~m) == (b & ~m)) continue;
        if ((a & m) != 0) {
          todo.emplace_back((a | m) + 1, b);
          b = a | m;
          split = true;
        } else if ((b & m) != m) {
          todo.emplace_back(b & ~m, b);
          b = (b & ~m) - 1;
          split = true;
        }
      }
    }
    uint8_t ea[4], eb[4];
    const int n = encode_utf8(a, ea);
    encode_utf8(b, eb);
    ByteSeq s;
    for (int i = 0; i < n; ++i) s.emplace_back(ea[i], eb[i]);
    out.push_back(std::move(s));
  }
}

// Thompson automaton: a fragment is the states [begin, size) at the time it
// is the newest (its own states point only among themselves; its `end` has
// no edge out yet), so a repeat copies that range.
struct Edge {
  uint8_t lo, hi;
  int32_t to;
};
struct NState {
  std::vector<int32_t> eps;
  std::vector<Edge> edges;
};
struct Frag {
  int32_t start, end, begin;
  bool repeated = false;
};

class Parser {
 public:
  Parser(std::string_view pattern, bool json_string, bool search) : json_string_(json_string), search_(search) {
    if (pattern.size() > Regex::kMaxPatternBytes)
      throw std::invalid_argument(
          fmt::format("the pattern has {} bytes, over the limit of {}", pattern.size(), Regex::kMaxPatternBytes));
    // Code points, with the byte offset of each for the messages.
    for (size_t i = 0; i < pattern.size();) {
      const uint8_t c = uint8_t(pattern[i]);
      const int n = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
      if (n == 0 || i + size_t(n) > pattern.size())
        throw std::invalid_argument(fmt::format("the pattern is not valid UTF-8 (at byte {})", i));
      uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
      for (int k = 1; k < n; ++k) {
        const uint8_t d = uint8_t(pattern[i + size_t(k)]);
        if ((d & 0xC0) != 0x80) throw std::invalid_argument(fmt::format("the pattern is not valid UTF-8 (at byte {})", i));
        cp = cp << 6 | (d & 0x3F);
      }
      static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
      if (cp < kMin[n] || cp > kMaxCp || (cp >= 0xD800 && cp <= 0xDFFF))
        throw std::invalid_argument(fmt::format("the pattern is not valid UTF-8 (at byte {})", i));
      cps_.push_back(cp);
      offs_.push_back(i);
      i += size_t(n);
    }
    offs_.push_back(pattern.size());
  }

  // The automaton of the whole pattern; the accepting state is its end.
  Frag parse() {
    struct Ctx {
      std::vector<std::vector<Frag>> alts;
      int32_t begin;
      size_t open;  // the '(' (for the message when it is not closed)
    };
    std::vector<Ctx> stack;
    stack.push_back({{{}}, 0, 0});
    const size_t n = cps_.size();
    for (size_t i = 0; i < n;) {
      const uint32_t c = cps_[i];
      std::vector<Frag>& seq = stack.back().alts.back();
      if (c == '^') {
        if (i != 0) fail(i, "'^' is supported only at the start");
        anchored_start_ = true;
        ++i;
      } else if (c == '$') {
        if (i + 1 != n) fail(i, "'$' is supported only at the end");
        anchored_end_ = true;
        ++i;
      } else if (c == '(') {
        size_t j = i + 1;
        if (j < n && cps_[j] == '?') {
          const uint32_t k = j + 1 < n ? cps_[j + 1] : 0;
          if (k == ':') {
            j += 2;
          } else if (k == 'P' || k == '<') {
            size_t p = j + 2;  // the name, after '(?<' or '(?P<'
            if (k == 'P') {
              if (p >= n || cps_[p] != '<') fail(i, "'(?P' is supported only as a named group '(?P<name>...)'");
              ++p;
            } else if (p < n && (cps_[p] == '=' || cps_[p] == '!')) {
              fail(i, "lookbehind is not supported");
            }
            size_t q = p;
            while (q < n && (cps_[q] == '_' || (cps_[q] < 0x80 && std::isalnum(int(cps_[q]))))) ++q;
            if (q == p || q >= n || cps_[q] != '>') fail(i, "a named group needs '<name>' of letters, digits or '_'");
            j = q + 1;
          } else if (k == '=' || k == '!') {
            fail(i, "lookahead is not supported");
          } else {
            fail(i, "inline flags and other '(?' groups are not supported (only '(?:', '(?P<name>' and '(?<name>')");
          }
        }
        stack.push_back({{{}}, int32_t(st_.size()), i});
        i = j;
      } else if (c == ')') {
        if (stack.size() == 1) fail(i, "unbalanced ')'");
        Frag f = close(stack.back());
        stack.pop_back();
        stack.back().alts.back().push_back(f);
        ++i;
      } else if (c == '|') {
        if (stack.size() == 1) top_alternation_ = true;
        stack.back().alts.emplace_back();
        ++i;
      } else if (uint32_t lo, hi; quantifier(i, lo, hi)) {
        if (seq.empty()) fail(i, "nothing to repeat");
        if (seq.back().repeated) fail(i, "multiple repeat");
        seq.back() = repeat(seq.back(), lo, hi, i);
        if (i < n && (cps_[i] == '?' || cps_[i] == '+')) ++i;  // lazy / possessive: the same language
        if (uint32_t a, b; i < n && quantifier_at(i, a, b)) fail(i, "multiple repeat");
      } else if (c == '[') {
        seq.push_back(set(klass(i)));
      } else if (c == '.') {
        seq.push_back(set(negate({{'\n', '\n'}})));
        ++i;
      } else if (c == '\\') {
        Ranges r;
        const uint32_t cp = escape(i, false, r);
        seq.push_back(cp == kInfinite ? set(r) : literal(cp));
      } else {
        seq.push_back(literal(c));
        ++i;
      }
    }
    if (stack.size() > 1) fail(stack.back().open, "missing ')'");
    Frag f = close(stack.back());
    if (!search_) return f;
    if ((anchored_start_ || anchored_end_) && top_alternation_)
      fail(0, "'^' or '$' beside a top-level '|' anchors one alternative only: group the alternatives, as '^(a|b)$'");
    // A search: any text before and after the match, unless anchored.
    auto any_text = [&] { return repeat(set({{0, kMaxCp}}), 0, kInfinite, 0); };
    if (!anchored_start_) {
      const Frag pre = any_text();
      link(pre.end, f.start);
      f.start = pre.start;
    }
    if (!anchored_end_) {
      const Frag post = any_text();
      link(f.end, post.start);
      f.end = post.end;
    }
    return f;
  }

  std::vector<NState> st_;

 private:
  [[noreturn]] void fail(size_t i, std::string_view what) const {
    throw std::invalid_argument(fmt::format("{} (at byte {} of the pattern)", what, offs_[std::min(i, offs_.size() - 1)]));
  }

  int32_t add() {
    if (st_.size() >= Regex::kMaxNfaStates)
      throw std::invalid_argument(
          fmt::format("the pattern needs more than {} automaton states (its repeats expanded)", Regex::kMaxNfaStates));
    st_.emplace_back();
    return int32_t(st_.size() - 1);
  }

  Frag literal(uint32_t cp) {
    if (json_string_ && needs_escape(cp)) return set({});  // never matched: no edge
    uint8_t b[4];
    const int n = encode_utf8(cp, b);
    const int32_t s = add();
    int32_t cur = s;
    for (int k = 0; k < n; ++k) {
      const int32_t to = add();
      st_[size_t(cur)].edges.push_back({b[k], b[k], to});
      cur = to;
    }
    return {s, cur, s};
  }

  Frag set(const Ranges& r) {
    const int32_t s = add(), e = add();
    std::vector<ByteSeq> seqs;
    Ranges usable = without_surrogates(r);
    if (json_string_) {  // without the controls, '"' and '\\'
      Ranges keep;
      for (const auto& [a, b] : negate({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}}))
        for (const auto& [c, d] : usable)
          if (std::max(a, c) <= std::min(b, d)) keep.emplace_back(std::max(a, c), std::min(b, d));
      usable = keep;
    }
    for (const auto& [a, b] : usable) utf8_sequences(a, b, seqs);
    // Built from each sequence's end, sharing the states of equal suffixes
    // ("two more continuation bytes, then the end"): `.` takes 7 states
    // between its bytes instead of 18, and a DFA state of a repeat of it
    // as many fewer.
    std::map<std::tuple<uint8_t, uint8_t, int32_t>, int32_t> suffix;
    for (const ByteSeq& q : seqs) {
      int32_t to = e;
      for (size_t k = q.size(); k-- > 1;) {
        const auto key = std::make_tuple(q[k].first, q[k].second, to);
        auto it = suffix.find(key);
        if (it == suffix.end()) {
          const int32_t m = add();
          st_[size_t(m)].edges.push_back({q[k].first, q[k].second, to});
          it = suffix.emplace(key, m).first;
        }
        to = it->second;
      }
      st_[size_t(s)].edges.push_back({q[0].first, q[0].second, to});
    }
    return {s, e, s};
  }

  Frag empty() {
    const int32_t s = add();
    return {s, s, s};
  }

  void link(int32_t from, int32_t to) { st_[size_t(from)].eps.push_back(to); }

  // Alternatives of concatenations, as at a ')' or the end.
  Frag close(const auto& ctx) {
    std::vector<Frag> parts;
    for (const std::vector<Frag>& seq : ctx.alts) {
      if (seq.empty()) {
        parts.push_back(empty());
        continue;
      }
      for (size_t k = 0; k + 1 < seq.size(); ++k) link(seq[k].end, seq[k + 1].start);
      parts.push_back({seq.front().start, seq.back().end, seq.front().begin});
    }
    if (parts.size() == 1) return {parts[0].start, parts[0].end, ctx.begin};
    const int32_t s = add(), e = add();
    for (const Frag& p : parts) link(s, p.start), link(p.end, e);
    return {s, e, ctx.begin};
  }

  Frag clone(const Frag& f, size_t size) {
    const int32_t base = int32_t(st_.size());
    const int32_t off = base - f.begin;
    for (size_t k = 0; k < size; ++k) {
      add();
      NState c = st_[size_t(f.begin) + k];
      for (int32_t& t : c.eps) t += off;
      for (Edge& e : c.edges) e.to += off;
      st_[size_t(base) + k] = std::move(c);
    }
    return {f.start + off, f.end + off, base};
  }

  // f{lo,hi} (hi kInfinite: no bound).
  Frag repeat(const Frag& f, uint32_t lo, uint32_t hi, size_t at) {
    if (hi == 0) {
      const int32_t s = add();
      return {s, s, f.begin, true};
    }
    const size_t size = st_.size() - size_t(f.begin);
    const size_t copies = hi == kInfinite ? std::max<uint32_t>(lo, 1) : hi;
    if (st_.size() + (copies - 1) * size + 2 * copies + 2 > Regex::kMaxNfaStates)
      fail(at, fmt::format("the repeat needs more than {} automaton states", Regex::kMaxNfaStates));
    std::vector<Frag> inst{f};
    for (size_t k = 1; k < copies; ++k) inst.push_back(clone(f, size));
    std::vector<Frag> parts;
    for (uint32_t k = 0; k < lo; ++k) parts.push_back(inst[k]);
    if (hi == kInfinite) {
      if (lo == 0) {  // x*
        const int32_t s = add(), e = add();
        link(s, f.start), link(s, e), link(f.end, f.start), link(f.end, e);
        parts.push_back({s, e, f.begin});
      } else {  // the last mandatory copy loops: x{lo,}
        link(parts.back().end, parts.back().start);
      }
    } else if (hi > lo) {
      // The optional copies as x(x(x)?)?: before each, a way straight to
      // the end, so the states a DFA state holds stay few (x?x?x? would
      // hold every later skip: O(n) each, O(n^2) to build).
      const int32_t e = add();
      std::vector<int32_t> before;
      for (size_t k = lo; k < hi; ++k) {
        before.push_back(add());
        link(before.back(), inst[k].start), link(before.back(), e);
      }
      for (size_t k = lo; k < hi; ++k) link(inst[k].end, k + 1 < hi ? before[k + 1 - lo] : e);
      parts.push_back({before[0], e, f.begin});
    }
    for (size_t k = 0; k + 1 < parts.size(); ++k) link(parts[k].end, parts[k + 1].start);
    return {parts.front().start, parts.back().end, f.begin, true};
  }

  // A quantifier at i: * + ? {n} {n,} {n,m}; advances i past it. A '{' that
  // does not begin one is a literal (as in Python and ECMAScript).
  bool quantifier_at(size_t i, uint32_t& lo, uint32_t& hi) const {
    size_t j = i;
    return parse_quantifier(j, lo, hi);
  }
  bool quantifier(size_t& i, uint32_t& lo, uint32_t& hi) const { return parse_quantifier(i, lo, hi); }
  bool parse_quantifier(size_t& i, uint32_t& lo, uint32_t& hi) const {
    const size_t n = cps_.size();
    switch (cps_[i]) {
      case '*': lo = 0, hi = kInfinite, ++i; return true;
      case '+': lo = 1, hi = kInfinite, ++i; return true;
      case '?': lo = 0, hi = 1, ++i; return true;
      case '{': break;
      default: return false;
    }
    size_t j = i + 1;
    if (j < n && cps_[j] == ',') fail(i, "'{,n}' is read differently by Python and ECMAScript: write '{0,n}' (or '\\{' for a brace)");
    auto number = [&](uint32_t& v) {
      const size_t from = j;
      uint64_t x = 0;
      while (j < n && cps_[j] >= '0' && cps_[j] <= '9') x = std::min<uint64_t>(x * 10 + (cps_[j++] - '0'), 1u << 30);
      v = uint32_t(x);
      return j > from;
    };
    if (!number(lo)) return false;
    hi = lo;
    if (j < n && cps_[j] == ',') {
      ++j;
      if (!number(hi)) hi = kInfinite;
    }
    if (j >= n || cps_[j] != '}') return false;
    if (lo > Regex::kMaxRepeat || (hi != kInfinite && hi > Regex::kMaxRepeat))
      fail(i, fmt::format("a repeat count over {}", Regex::kMaxRepeat));
    if (hi < lo) fail(i, "a repeat's minimum is above its maximum");
    i = j + 1;
    return true;
  }

  // An escape at i (a backslash); advances i. A class escape (\d ...) sets
  // `r` and returns kInfinite; otherwise the code point it stands for.
  uint32_t escape(size_t& i, bool in_class, Ranges& r) {
    const size_t at = i;
    if (i + 1 >= cps_.size()) fail(at, "a trailing backslash");
    const uint32_t c = cps_[i + 1];
    i += 2;
    auto hex = [&](int digits) {
      uint32_t v = 0;
      for (int k = 0; k < digits; ++k, ++i) {
        if (i >= cps_.size() || cps_[i] >= 0x80 || !std::isxdigit(int(cps_[i])))
          fail(at, fmt::format("'\\{}' needs {} hex digits", char(c), digits));
        const uint32_t d = cps_[i];
        v = v * 16 + (d <= '9' ? d - '0' : (d | 0x20) - 'a' + 10);
      }
      return v;
    };
    switch (c) {
      case 'd': r = {{'0', '9'}}; return kInfinite;
      case 'D': r = negate({{'0', '9'}}); return kInfinite;
      case 'w': r = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}; return kInfinite;
      case 'W': r = negate({{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}); return kInfinite;
      case 's': r = {{'\t', '\r'}, {' ', ' '}}; return kInfinite;
      case 'S': r = negate({{'\t', '\r'}, {' ', ' '}}); return kInfinite;
      case 'n': return '\n';
      case 't': return '\t';
      case 'r': return '\r';
      case 'f': return '\f';
      case 'v': return '\v';
      case '0':
        if (i < cps_.size() && cps_[i] >= '0' && cps_[i] <= '7') fail(at, "octal escapes are not supported (use \\xHH)");
        return 0;
      case 'x': return hex(2);
      case 'u': {
        const uint32_t v = hex(4);
        if (v >= 0xD800 && v <= 0xDFFF) fail(at, "'\\u' of a surrogate is not a character");
        return v;
      }
      case 'b':
        if (in_class) return '\b';
        fail(at, "word boundaries ('\\b') are not supported");
      case 'B': fail(at, "word boundaries ('\\B') are not supported");
      case 'A':
      case 'Z':
      case 'z':
      case 'G': fail(at, fmt::format("the anchor '\\{}' is not supported (the whole output is matched)", char(c)));
      case 'p':
      case 'P': fail(at, "Unicode property classes ('\\p{...}') are not supported");
      case 'k': fail(at, "backreferences are not supported");
      default: break;
    }
    if (c >= '1' && c <= '9') fail(at, "backreferences are not supported");
    if (c < 0x80 && std::isalnum(int(c))) fail(at, fmt::format("unknown escape '\\{}'", char(c)));
    return c;  // escaped punctuation or any other character: itself
  }

  // A class at i ('['); advances i past its ']'.
  Ranges klass(size_t& i) {
    const size_t at = i, n = cps_.size();
    ++i;
    const bool neg = i < n && cps_[i] == '^';
    if (neg) ++i;
    Ranges r;
    // One member: a code point (returned) or a class escape (into r).
    auto member = [&](Ranges& sub) -> uint32_t {
      if (cps_[i] == '\\') return escape(i, true, sub);
      if (cps_[i] == '[' && i + 1 < n && (cps_[i + 1] == ':' || cps_[i + 1] == '=' || cps_[i + 1] == '.'))
        fail(i, "POSIX classes ('[:alpha:]') are not supported (use ranges or \\d \\w \\s)");
      return cps_[i++];
    };
    for (bool first = true;; first = false) {
      if (i >= n) fail(at, "missing ']'");
      if (cps_[i] == ']' && !first) {
        ++i;
        break;
      }
      Ranges sub;
      const uint32_t lo = member(sub);
      if (lo == kInfinite) {
        if (i + 1 < n && cps_[i] == '-' && cps_[i + 1] != ']') fail(i, "a class escape cannot bound a range");
        r.insert(r.end(), sub.begin(), sub.end());
        continue;
      }
      if (i + 1 < n && cps_[i] == '-' && cps_[i + 1] != ']') {
        ++i;
        const uint32_t hi = member(sub);
        if (hi == kInfinite) fail(i, "a class escape cannot bound a range");
        if (hi < lo) fail(i, "a range's end is below its start");
        r.emplace_back(lo, hi);
      } else {
        r.emplace_back(lo, lo);
      }
    }
    return neg ? negate(r) : normalize(r);
  }

  static bool needs_escape(uint32_t cp) { return cp < 0x20 || cp == '"' || cp == '\\'; }

  bool json_string_, search_;
  bool anchored_start_ = false, anchored_end_ = false, top_alternation_ = false;
  std::vector<uint32_t> cps_;
  std::vector<size_t> offs_;
};

}  // namespace

std::shared_ptr<const Regex> Regex::compile(std::string_view pattern, const Options& options) {
  const bool json_string = options.json_string;
  const int64_t work_limit = options.work_left ? std::min(kMaxBuildWork, *options.work_left) : kMaxBuildWork;
  Parser p(pattern, json_string, options.search);
  const Frag f = p.parse();
  const std::vector<NState>& st = p.st_;
  const int32_t accept = f.end;
  // Byte classes: bytes no edge tells apart move alike.
  bool edge_at[257] = {};
  edge_at[0] = true;
  for (const NState& s : st)
    for (const Edge& e : s.edges) edge_at[e.lo] = edge_at[e.hi + 1] = true;
  uint8_t class_of[256];
  std::vector<uint8_t> reps;
  for (int b = 0; b < 256; ++b) {
    if (edge_at[b]) reps.push_back(uint8_t(b));
    class_of[b] = uint8_t(reps.size() - 1);
  }
  // Subset construction, breadth first, with the work bounded.
  int64_t work = 0;
  std::vector<uint32_t> mark(st.size(), 0);
  uint32_t stamp = 0;
  auto closure = [&](std::vector<int32_t> set) {
    ++stamp;
    std::vector<int32_t> todo = set, out;
    for (int32_t s : set) mark[size_t(s)] = stamp;
    while (!todo.empty()) {
      const int32_t s = todo.back();
      todo.pop_back();
      out.push_back(s);
      for (int32_t t : st[size_t(s)].eps)
        if (mark[size_t(t)] != stamp) mark[size_t(t)] = stamp, todo.push_back(t);
    }
    work += int64_t(out.size());
    if (work > work_limit)
      throw std::invalid_argument(work_limit < kMaxBuildWork
                                      ? "the patterns are too complex to compile together (their automata's work bound)"
                                      : "the pattern is too complex to compile (its automaton's work bound)");
    std::sort(out.begin(), out.end());
    return out;
  };
  std::map<std::vector<int32_t>, int32_t> ids;
  std::vector<std::vector<int32_t>> sets;
  std::vector<std::vector<int32_t>> trans;  // per DFA state, per byte class
  sets.push_back(closure({f.start}));
  ids.emplace(sets[0], 0);
  for (size_t d = 0; d < sets.size(); ++d) {
    std::vector<int32_t> row(reps.size(), kDead);
    for (size_t k = 0; k < reps.size(); ++k) {
      const uint8_t b = reps[k];
      std::vector<int32_t> moved;
      ++stamp;
      for (int32_t s : sets[d])
        for (const Edge& e : st[size_t(s)].edges)
          if (e.lo <= b && b <= e.hi && mark[size_t(e.to)] != stamp) mark[size_t(e.to)] = stamp, moved.push_back(e.to);
      work += int64_t(sets[d].size());
      if (moved.empty()) continue;
      std::vector<int32_t> next = closure(std::move(moved));
      auto it = ids.find(next);
      if (it == ids.end()) {
        if (sets.size() >= kMaxDfaStates)
          throw std::invalid_argument(fmt::format("the pattern needs more than {} automaton states", kMaxDfaStates));
        it = ids.emplace(next, int32_t(sets.size())).first;
        sets.push_back(std::move(next));
      }
      row[k] = it->second;
    }
    trans.push_back(std::move(row));
  }
  std::vector<uint8_t> accepting(sets.size());
  for (size_t d = 0; d < sets.size(); ++d) accepting[d] = std::binary_search(sets[d].begin(), sets[d].end(), accept);
  auto re = from_table(trans, accepting, class_of, reps.size(),
                       json_string ? "the pattern matches no string without characters JSON escapes (controls, "
                                     "'\"', '\\')"
                                   : "the pattern matches no string");
  if (options.work_left) *options.work_left -= work;
  return re;
}

std::shared_ptr<Regex> Regex::from_table(const std::vector<std::vector<int32_t>>& trans,
                                         const std::vector<uint8_t>& accepting, const uint8_t* class_of, size_t C,
                                         const char* matches_nothing) {
  auto re = std::shared_ptr<Regex>(new Regex());
  const size_t D = trans.size();
  re->classes_ = C;
  std::copy(class_of, class_of + 256, std::begin(re->class_of_));
  re->next_.resize(D * C);
  for (size_t d = 0; d < D; ++d)
    for (size_t k = 0; k < C; ++k) re->next_[d * C + k] = int16_t(trans[d][k]);
  // Shortest continuations: breadth first backwards from the accepting states.
  constexpr int64_t kFar = std::numeric_limits<int64_t>::max();
  re->dist_.assign(D, kFar);
  std::vector<std::vector<int32_t>> into(D);
  for (size_t d = 0; d < D; ++d)
    for (int32_t t : trans[d])
      if (t != kDead) into[size_t(t)].push_back(int32_t(d));
  std::deque<int32_t> q;
  for (size_t d = 0; d < D; ++d)
    if (accepting[d]) re->dist_[d] = 0, q.push_back(int32_t(d));
  while (!q.empty()) {
    const int32_t t = q.front();
    q.pop_front();
    for (int32_t d : into[size_t(t)])
      if (re->dist_[size_t(d)] == kFar) re->dist_[size_t(d)] = re->dist_[size_t(t)] + 1, q.push_back(d);
  }
  if (re->dist_[0] == kFar) throw std::invalid_argument(matches_nothing);
  // No move into a state that cannot reach a match.
  for (int16_t& t : re->next_)
    if (t != kDead && re->dist_[size_t(t)] == kFar) t = int16_t(kDead);
  // Toward the nearest match: the first byte, in this order, that gets one
  // step closer: lower-case letters, digits, upper case, other printable
  // ASCII, then the rest.
  std::vector<uint8_t> order;
  for (int b = 'a'; b <= 'z'; ++b) order.push_back(uint8_t(b));
  for (int b = '0'; b <= '9'; ++b) order.push_back(uint8_t(b));
  for (int b = 'A'; b <= 'Z'; ++b) order.push_back(uint8_t(b));
  for (int b = 0x20; b < 0x7F; ++b)
    if (!std::isalnum(b)) order.push_back(uint8_t(b));
  for (int b = 0x80; b < 0x100; ++b) order.push_back(uint8_t(b));
  for (int b = 0; b < 0x20; ++b) order.push_back(uint8_t(b));
  order.push_back(0x7F);
  re->toward_.assign(D, 0);
  for (size_t d = 0; d < D; ++d) {
    if (re->dist_[d] == 0 || re->dist_[d] == kFar) continue;
    for (uint8_t b : order) {
      const int32_t t = re->next(int32_t(d), b);
      if (t != kDead && re->dist_[size_t(t)] == re->dist_[d] - 1) {
        re->toward_[d] = b;
        break;
      }
    }
  }
  return re;
}

std::shared_ptr<const Regex> Regex::with_length(uint32_t min_cp, uint32_t max_cp, int64_t* work_left) const {
  // Byte classes split where a byte starts a code point (ASCII, lead bytes)
  // or continues one: (class, starts) pairs.
  uint8_t class_of[256];
  std::vector<uint8_t> reps;
  std::map<std::pair<uint8_t, bool>, uint8_t> ids;
  for (int b = 0; b < 256; ++b) {
    const auto key = std::make_pair(class_of_[b], (b & 0xC0) != 0x80);
    auto it = ids.find(key);
    if (it == ids.end()) it = ids.emplace(key, uint8_t(reps.size())).first, reps.push_back(uint8_t(b));
    class_of[b] = it->second;
  }
  // States (automaton state, code points so far), the count held at min_cp
  // once reached when the length has no upper bound.
  const bool open = max_cp == kNoMaxLength;
  const uint32_t cap = open ? min_cp : max_cp;
  std::map<std::pair<int32_t, uint32_t>, int32_t> index = {{{start(), 0}, 0}};
  std::vector<std::pair<int32_t, uint32_t>> states = {{start(), 0}};
  std::vector<std::vector<int32_t>> trans;
  int64_t work = 0;
  const int64_t limit = work_left ? std::min(kMaxBuildWork, *work_left) : kMaxBuildWork;
  for (size_t d = 0; d < states.size(); ++d) {
    const auto [s, k] = states[d];
    std::vector<int32_t> row(reps.size(), kDead);
    for (size_t c = 0; c < reps.size(); ++c) {
      const int32_t t = next(s, reps[c]);
      if (t == kDead) continue;
      uint32_t nk = k + ((reps[c] & 0xC0) != 0x80);
      if (nk > cap) {
        if (!open) continue;
        nk = cap;
      }
      auto it = index.find({t, nk});
      if (it == index.end()) {
        if (states.size() >= kMaxDfaStates)
          throw std::invalid_argument(fmt::format("the pattern within the length bounds needs more than {} automaton "
                                                  "states",
                                                  kMaxDfaStates));
        it = index.emplace(std::make_pair(t, nk), int32_t(states.size())).first;
        states.emplace_back(t, nk);
      }
      row[c] = it->second;
    }
    work += int64_t(reps.size());
    if (work > limit) throw std::invalid_argument("the pattern within the length bounds is too complex to compile");
    trans.push_back(std::move(row));
  }
  std::vector<uint8_t> accepts(states.size());
  for (size_t d = 0; d < states.size(); ++d) accepts[d] = accepting(states[d].first) && states[d].second >= min_cp;
  auto re = from_table(trans, accepts, class_of, reps.size(), "the pattern matches no string within the length bounds");
  if (work_left) *work_left -= work;
  return re;
}

std::shared_ptr<const Regex> Regex::with_multiple(uint64_t divisor, uint32_t scale, int64_t* work_left) const {
  if (divisor == 0) throw std::invalid_argument("a multiple of 0");
  // Byte classes: this automaton's, with '-', '.' and each digit apart.
  uint8_t class_of[256];
  std::vector<uint8_t> reps;
  std::map<std::pair<uint8_t, int>, uint8_t> ids;
  for (int b = 0; b < 256; ++b) {
    const bool numeric = (b >= '0' && b <= '9') || b == '-' || b == '.';
    const auto key = std::make_pair(class_of_[b], numeric ? b : -1);
    auto it = ids.find(key);
    if (it == ids.end()) it = ids.emplace(key, uint8_t(reps.size())).first, reps.push_back(uint8_t(b));
    class_of[b] = it->second;
  }
  // A state: this automaton's, the remainder of (the digits so far as an
  // integer) mod divisor, the fraction digits read (-1: in the integer part;
  // at most scale, past which only zeros come), and whether a '-' still
  // waits for a digit other than 0.
  struct Key {
    int32_t s;
    uint64_t r;
    int32_t frac;
    bool neg_zero;
    auto operator<=>(const Key&) const = default;
  };
  std::map<Key, int32_t> index = {{Key{start(), 0, -1, false}, 0}};
  std::vector<Key> states = {{start(), 0, -1, false}};
  std::vector<std::vector<int32_t>> trans;
  int64_t work = 0;
  const int64_t limit = work_left ? std::min(kMaxBuildWork, *work_left) : kMaxBuildWork;
  for (size_t d = 0; d < states.size(); ++d) {
    const Key k = states[d];
    std::vector<int32_t> row(reps.size(), kDead);
    for (size_t c = 0; c < reps.size(); ++c) {
      const unsigned char b = reps[c];
      const int32_t t = next(k.s, b);
      if (t == kDead) continue;
      Key n{t, k.r, k.frac, k.neg_zero};
      if (b == '-') {
        n.neg_zero = true;
      } else if (b == '.') {
        if (k.frac >= 0) continue;
        n.frac = 0;
      } else if (b >= '0' && b <= '9') {
        const uint64_t digit = b - '0';
        if (digit) n.neg_zero = false;
        if (k.frac >= int32_t(scale)) {
          if (digit) continue;  // past the scale only zeros keep the value a multiple
        } else {
          n.r = (k.r * 10 + digit) % divisor;
          if (k.frac >= 0) ++n.frac;
        }
      } else {
        continue;  // not a number's byte
      }
      auto it = index.find(n);
      if (it == index.end()) {
        if (states.size() >= kMaxDfaStates)
          throw std::invalid_argument(fmt::format("the multiples need more than {} automaton states", kMaxDfaStates));
        it = index.emplace(n, int32_t(states.size())).first;
        states.push_back(n);
      }
      row[c] = it->second;
    }
    work += int64_t(reps.size());
    if (work > limit) throw std::invalid_argument("the multiples are too complex to compile");
    trans.push_back(std::move(row));
  }
  std::vector<uint8_t> accepts(states.size());
  for (size_t d = 0; d < states.size(); ++d) {
    const Key& k = states[d];
    // Pad the fraction to the scale with zeros: r x 10^(scale - digits read).
    uint64_t r = k.r;
    for (int32_t i = std::max(k.frac, 0); i < int32_t(scale); ++i) r = r * 10 % divisor;
    accepts[d] = accepting(k.s) && r == 0 && !k.neg_zero;
  }
  auto re = from_table(trans, accepts, class_of, reps.size(), "no number it matches is such a multiple");
  if (work_left) *work_left -= work;
  return re;
}

std::string Regex::shortest(int32_t s) const {
  std::string out;
  while (dist_[size_t(s)] > 0) {
    const uint8_t b = toward_[size_t(s)];
    out += char(b);
    s = next(s, b);
  }
  return out;
}

bool Regex::matches(std::string_view text) const {
  int32_t s = start();
  for (unsigned char c : text)
    if ((s = next(s, c)) == kDead) return false;
  return accepting(s);
}

}  // namespace areno::serve
