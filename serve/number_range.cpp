#include "serve/number_range.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

namespace areno::serve {

namespace {

constexpr size_t kIntDigits = 16, kFracDigits = 16;

// A value on the grid of the numbers the grammar writes: a sign and the
// magnitude as kIntDigits + scale digits (scale: kFracDigits for a number, 0
// for an integer). Zero is never negative.
struct Grid {
  bool neg = false;
  std::string m;
};

bool all_of(std::string_view s, size_t from, char c) {
  return std::all_of(s.begin() + std::ptrdiff_t(std::min(from, s.size())), s.end(), [c](char x) { return x == c; });
}

// m + 1 in its last digit; false when it was all nines (no larger magnitude).
bool inc(std::string& m) {
  for (size_t i = m.size(); i-- > 0;) {
    if (m[i] != '9') return ++m[i], true;
    m[i] = '0';
  }
  return false;
}

void dec(std::string& m) {  // m > 0
  for (size_t i = m.size(); i-- > 0;) {
    if (m[i] != '0') return void(--m[i]);
    m[i] = '9';
  }
}

int cmp(const Grid& a, const Grid& b) {
  if (a.neg != b.neg) return a.neg ? -1 : 1;
  const int c = a.m.compare(b.m);
  return a.neg ? -c : c;
}

// A bound's JSON text on the grid: its magnitude truncated to the grid's
// digits, whether digits were dropped (the true magnitude is larger), and
// whether its integer part has more than kIntDigits digits.
struct Parsed {
  Grid g;
  bool inexact = false, huge = false;
};

Parsed parse(std::string_view t, size_t scale) {
  auto bad = [&]() -> Parsed { throw std::invalid_argument(fmt::format("'{}' is not a JSON number", t)); };
  auto digit = [&](size_t i) { return i < t.size() && t[i] >= '0' && t[i] <= '9'; };
  Parsed p;
  size_t i = 0;
  if (i < t.size() && t[i] == '-') p.g.neg = true, ++i;
  std::string digits;  // the integer part's, then the fraction's
  int64_t point = 0;   // digits before the point
  if (!digit(i)) return bad();
  if (t[i] == '0') digits += '0', ++i, point = 1;
  else
    while (digit(i)) digits += t[i++], ++point;
  if (i < t.size() && t[i] == '.') {
    if (!digit(++i)) return bad();
    while (digit(i)) digits += t[i++];
  }
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    bool eneg = false;
    if (++i < t.size() && (t[i] == '+' || t[i] == '-')) eneg = t[i++] == '-';
    if (!digit(i)) return bad();
    int64_t e = 0;
    while (digit(i)) e = std::min<int64_t>(e * 10 + (t[i++] - '0'), 1000000);
    point += eneg ? -e : e;
  }
  if (i != t.size()) return bad();
  size_t lead = 0;
  while (lead < digits.size() && digits[lead] == '0') ++lead, --point;
  digits.erase(0, lead);
  while (!digits.empty() && digits.back() == '0') digits.pop_back();
  const size_t W = kIntDigits + scale;
  p.g.m.assign(W, '0');
  if (digits.empty()) {
    p.g.neg = false;
    return p;
  }
  if (point > int64_t(kIntDigits)) {
    p.huge = true;
    return p;
  }
  // Digit k lands at kIntDigits - point + k (not below 0: point <= kIntDigits).
  for (size_t k = 0; k < digits.size(); ++k) {
    const int64_t pos = int64_t(kIntDigits) - point + int64_t(k);
    if (pos < int64_t(W)) p.g.m[size_t(pos)] = digits[k];
    else if (digits[k] != '0') p.inexact = true;
  }
  return p;
}

// The next grid value up (false past the largest) and down.
bool up(Grid& g) {
  if (g.neg) {
    dec(g.m);
    if (all_of(g.m, 0, '0')) g.neg = false;
    return true;
  }
  return inc(g.m);
}
bool down(Grid& g) {
  if (!g.neg && all_of(g.m, 0, '0')) {
    g.neg = true, g.m.back() = '1';
    return true;
  }
  if (!g.neg) return dec(g.m), true;
  return inc(g.m);
}

// The least grid value a bound admits from below (nullopt: it bounds nothing
// here; `empty`: nothing the grammar writes is above it).
std::optional<Grid> lowest(const NumberBound& b, size_t scale, bool& empty) {
  const Parsed p = parse(b.text, scale);
  if (p.huge) {
    if (!p.g.neg) empty = true;
    return std::nullopt;
  }
  Grid g = p.g;
  bool ok = true;
  if (p.inexact && !g.neg) ok = up(g);  // the ceiling (a negative's is its truncation)
  if (b.exclusive && !p.inexact) ok = ok && up(g);
  if (!ok) empty = true;
  if (all_of(g.m, 0, '0')) g.neg = false;  // -1e-20 truncated
  return g;
}

// The greatest grid value a bound admits from above.
std::optional<Grid> highest(const NumberBound& b, size_t scale, bool& empty) {
  const Parsed p = parse(b.text, scale);
  if (p.huge) {
    if (p.g.neg) empty = true;
    return std::nullopt;
  }
  Grid g = p.g;
  bool ok = true;
  if (p.inexact && g.neg) ok = inc(g.m);  // the floor of a negative: one step further out
  if (b.exclusive && !p.inexact) ok = ok && down(g);
  if (!ok) empty = true;
  return g;
}

std::string digit_class(char a, char b) { return a == b ? std::string(1, a) : fmt::format("[{}-{}]", a, b); }

std::string repeat(std::string_view atom, size_t lo, size_t hi) {
  if (hi == 0) return "";
  if (lo == hi) return lo == 1 ? std::string(atom) : fmt::format("{}{{{}}}", atom, lo);
  if (lo == 0 && hi == 1) return fmt::format("{}?", atom);
  return fmt::format("{}{{{},{}}}", atom, lo, hi);
}

// Alternatives as one atom: a group when there are several, or when the
// whole may be left out.
std::string group(const std::vector<std::string>& alts, bool optional) {
  std::string body;
  for (const std::string& a : alts) body += (body.empty() ? "" : "|") + a;
  if (body.empty()) return "";
  if (alts.size() == 1 && !optional) return body;
  return "(?:" + body + ")" + (optional ? "?" : "");
}

// Digit strings of lo's length (all digits written) from lo to hi, from
// position i on, where the digits before i equal lo's (tl) and hi's (th).
// The depth is at most the string's length (16): no recursion on client data.
std::string fixed(std::string_view lo, std::string_view hi, size_t i, bool tl, bool th) {
  const size_t n = lo.size();
  if (i == n) return "";
  tl = tl && !all_of(lo, i, '0');
  th = th && !all_of(hi, i, '9');
  if (!tl && !th) return repeat("\\d", n - i, n - i);
  const char dl = tl ? lo[i] : '0', dh = th ? hi[i] : '9';
  if (dl == dh) return std::string(1, dl) + fixed(lo, hi, i + 1, tl, th);
  std::vector<std::string> alts;
  char fa = dl, fb = dh;
  if (tl && !all_of(lo, i + 1, '0')) alts.push_back(dl + fixed(lo, hi, i + 1, true, false)), ++fa;
  if (th && !all_of(hi, i + 1, '9')) --fb;
  if (fa <= fb) alts.push_back(digit_class(fa, fb) + repeat("\\d", n - i - 1, n - i - 1));
  if (fb < dh) alts.push_back(dh + fixed(lo, hi, i + 1, false, true));
  return group(alts, false);
}

// A fraction's written digits (1 to kFracDigits, trailing zeros implied) from
// position i on whose value, padded with zeros, lies in [lo, hi] (strings of
// kFracDigits digits), the digits before i equal to lo's (tl) and hi's (th).
std::string fraction(std::string_view lo, std::string_view hi, size_t i, bool tl, bool th) {
  const size_t n = lo.size();
  if (i == n) return "";
  const size_t least = i == 0 ? 1 : 0;  // at least one digit after the point
  tl = tl && !all_of(lo, i, '0');
  th = th && !all_of(hi, i, '9');
  if (!tl && !th) return repeat("\\d", least, n - i);
  if (!tl && all_of(hi, i, '0')) return repeat("0", least, n - i);
  const bool may_end = i > 0 && !tl;
  const char dl = tl ? lo[i] : '0', dh = th ? hi[i] : '9';
  std::vector<std::string> alts;
  if (dl == dh) {
    alts.push_back(dl + fraction(lo, hi, i + 1, tl, th));
  } else {
    char fa = dl, fb = dh;
    if (tl && !all_of(lo, i + 1, '0')) alts.push_back(dl + fraction(lo, hi, i + 1, true, false)), ++fa;
    if (th && !all_of(hi, i + 1, '9')) --fb;
    if (fa <= fb) alts.push_back(digit_class(fa, fb) + repeat("\\d", 0, n - i - 1));
    if (fb < dh) alts.push_back(dh + fraction(lo, hi, i + 1, false, true));
  }
  return group(alts, may_end);
}

std::string canonical(std::string_view digits) {
  const size_t nz = digits.find_first_not_of('0');
  return nz == std::string_view::npos ? "0" : std::string(digits.substr(nz));
}

// Integer parts (kIntDigits-digit strings a <= b) as written: no leading zeros.
std::string integers(std::string_view a, std::string_view b) {
  const std::string A = canonical(a), B = canonical(b);
  if (A.size() == B.size()) return fixed(A, B, 0, true, true);
  std::vector<std::string> alts = {fixed(A, std::string(A.size(), '9'), 0, true, true)};
  if (B.size() - A.size() >= 2) alts.push_back(fmt::format("[1-9]{}", repeat("\\d", A.size(), B.size() - 2)));
  alts.push_back(fixed(fmt::format("1{}", std::string(B.size() - 1, '0')), B, 0, true, true));
  return group(alts, false);
}

// Magnitudes from a to b (grid strings, a <= b) as written, without a sign.
std::string magnitudes(const std::string& a, const std::string& b, size_t scale) {
  if (scale == 0) return integers(a, b);
  const std::string ai = a.substr(0, kIntDigits), af = a.substr(kIntDigits);
  const std::string bi = b.substr(0, kIntDigits), bf = b.substr(kIntDigits);
  const std::string zeros(kFracDigits, '0'), nines(kFracDigits, '9');
  auto frac = [&](const std::string& lo, const std::string& hi) {
    const std::string f = fraction(lo, hi, 0, true, true);
    return all_of(lo, 0, '0') ? fmt::format("(?:\\.{})?", f) : fmt::format("\\.{}", f);
  };
  if (ai == bi) return canonical(ai) + frac(af, bf);
  // Whole integer parts with any fraction between; the ends' own fractions.
  std::string lo_int = ai, hi_int = bi;
  std::vector<std::string> alts;
  if (!all_of(af, 0, '0')) alts.push_back(canonical(ai) + frac(af, nines)), inc(lo_int);
  if (!all_of(bf, 0, '9')) dec(hi_int);
  if (lo_int <= hi_int) alts.push_back(integers(lo_int, hi_int) + frac(zeros, nines));
  if (hi_int < bi) alts.push_back(canonical(bi) + frac(zeros, bf));
  return group(alts, false);
}

}  // namespace

std::string number_range_pattern(std::span<const NumberBound> lower, std::span<const NumberBound> upper, bool integer) {
  const size_t scale = integer ? 0 : kFracDigits, W = kIntDigits + scale;
  Grid lo{true, std::string(W, '9')}, hi{false, std::string(W, '9')};
  bool empty = false;
  for (const NumberBound& b : lower)
    if (const std::optional<Grid> g = lowest(b, scale, empty); g && cmp(*g, lo) > 0) lo = *g;
  for (const NumberBound& b : upper)
    if (const std::optional<Grid> g = highest(b, scale, empty); g && cmp(*g, hi) < 0) hi = *g;
  if (empty || cmp(lo, hi) > 0)
    throw std::invalid_argument(fmt::format("the range holds no {} of at most {} integer digits", integer ? "integer" : "number",
                                            kIntDigits));
  std::vector<std::string> alts;
  if (!hi.neg) alts.push_back(magnitudes(lo.neg ? std::string(W, '0') : lo.m, hi.m, scale));
  if (lo.neg) {  // never "-0": the negative magnitudes start at the grid's first step
    std::string least(W, '0');
    least.back() = '1';
    alts.push_back(fmt::format("-{}", magnitudes(hi.neg ? hi.m : least, lo.m, scale)));
  }
  return group(alts, false);
}

}  // namespace areno::serve
