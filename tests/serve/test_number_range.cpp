// Numeric ranges as patterns (serve/number_range.h): the automaton of each
// generated pattern accepts exactly the written numbers inside the range,
// checked against exact integer arithmetic (values scaled by 10^18 in
// __int128) on random bounds (inclusive and exclusive, negative, with more
// digits than the grid holds, in exponent form, beyond 16 integer digits)
// and on candidates at and around the bounds; malformed texts never match.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "serve/number_range.h"
#include "serve/regex.h"

using namespace areno::serve;

namespace {

using i128 = __int128;
constexpr int kScale = 18;  // the test's grid: two digits finer than the pattern's 16

i128 pow10(int n) {
  i128 r = 1;
  while (n-- > 0) r *= 10;
  return r;
}

std::string digits(i128 v) {  // v >= 0
  std::string s;
  do s += char('0' + int(v % 10)), v /= 10;
  while (v > 0);
  return std::string(s.rbegin(), s.rend());
}

// v / 10^scale as a plain JSON number: no trailing zeros in the fraction.
std::string plain(i128 v, int scale) {
  const bool neg = v < 0;
  const i128 a = neg ? -v : v;
  std::string ip = digits(a / pow10(scale)), fp = digits(a % pow10(scale));
  fp.insert(0, size_t(scale) - fp.size(), '0');
  while (!fp.empty() && fp.back() == '0') fp.pop_back();
  return fmt::format("{}{}{}{}", neg && a != 0 ? "-" : "", ip, fp.empty() ? "" : ".", fp);
}

// The same value in exponent form: d.ddd e±x.
std::string exponent(i128 v, int scale) {
  const bool neg = v < 0;
  const i128 a = neg ? -v : v;
  if (a == 0) return "0e0";
  std::string d = digits(a);
  const int e = int(d.size()) - 1 - scale;
  while (d.size() > 1 && d.back() == '0') d.pop_back();
  return fmt::format("{}{}{}{}e{}", neg ? "-" : "", d.substr(0, 1), d.size() > 1 ? "." : "", d.substr(1), e);
}

struct Bound {
  i128 v;  // scaled by 10^kScale
  bool exclusive;
  std::string text;
};

bool inside(i128 x, const std::vector<Bound>& lower, const std::vector<Bound>& upper) {
  for (const Bound& b : lower)
    if (b.exclusive ? x <= b.v : x < b.v) return false;
  for (const Bound& b : upper)
    if (b.exclusive ? x >= b.v : x > b.v) return false;
  return true;
}

std::vector<NumberBound> texts(const std::vector<Bound>& bs) {
  std::vector<NumberBound> out;
  for (const Bound& b : bs) out.push_back({b.text, b.exclusive});
  return out;
}

}  // namespace

TEST_CASE("serve/number_range: the pattern's language is the range's written numbers (random bounds, exact arithmetic)") {
  std::mt19937_64 rng(7);
  auto pick = [&](uint64_t n) { return int64_t(rng() % n); };
  // A random value of up to `id` integer and `fd` fraction digits (test grid).
  auto value = [&](int id, int fd) {
    i128 v = 0;
    for (int i = 0; i < id; ++i) v = v * 10 + pick(10);
    for (int i = 0; i < kScale; ++i) v = v * 10 + (i < fd ? pick(10) : 0);
    return pick(3) == 0 ? -v : v;
  };
  const i128 ulp16 = pow10(kScale - 16), max16 = pow10(16 + kScale) - ulp16;
  int cases = 0, matched = 0;
  size_t longest = 0, most_states = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const bool integer = trial % 3 == 0;
    std::vector<Bound> lower, upper;
    const int nb = 1 + int(pick(3));
    for (int k = 0; k < nb; ++k) {
      const int shape = int(pick(8));
      i128 v = shape == 0   ? value(int(pick(3)), 0)                       // small integers
               : shape == 1 ? value(1 + int(pick(16)), int(pick(19)))      // up to 18 fraction digits
               : shape == 2 ? value(int(pick(2)), int(pick(4)))            // near zero
               : shape == 3 ? (pick(2) ? max16 : -max16) + (pick(3) - 1) * ulp16  // at the largest
               : shape == 4 ? (pick(2) ? 1 : -1) * pow10(17 + kScale)     // beyond 16 digits
                            : value(int(pick(4)), int(pick(3)));
      const bool excl = pick(2) == 0;
      const std::string text = pick(4) == 0 ? exponent(v, kScale) : plain(v, kScale);
      (pick(2) ? lower : upper).push_back(Bound{v, excl, text});
    }
    std::string pattern;
    try {
      pattern = number_range_pattern(texts(lower), texts(upper), integer);
    } catch (const std::invalid_argument& e) {
      // Refused only when no written number of the grid lies inside.
      CAPTURE(e.what());
      bool any = false;
      for (const Bound& b : lower)
        for (i128 d = -2; d <= 2 && !any; ++d) {
          i128 x = b.v / (integer ? pow10(kScale) : ulp16) * (integer ? pow10(kScale) : ulp16) + d * (integer ? pow10(kScale) : ulp16);
          any = x >= -max16 && x <= max16 && inside(x, lower, upper);
        }
      for (i128 x : {i128(0), max16, -max16}) any = any || inside(integer ? x / pow10(kScale) * pow10(kScale) : x, lower, upper);
      CHECK_FALSE(any);
      continue;
    }
    CAPTURE(pattern);
    CHECK(pattern.size() <= Regex::kMaxPatternBytes);
    const auto rx = Regex::compile(pattern);
    longest = std::max(longest, pattern.size()), most_states = std::max(most_states, rx->states());
    // Candidates: around every bound, at zero and the ends, and random ones.
    std::vector<i128> cand = {0, max16, -max16};
    const i128 step = integer ? pow10(kScale) : ulp16;
    for (const std::vector<Bound>* bs : {&lower, &upper})
      for (const Bound& b : *bs)
        for (i128 d = -3; d <= 3; ++d) cand.push_back(b.v / step * step + d * step);
    for (int r = 0; r < 40; ++r) cand.push_back(value(int(pick(17)), integer ? 0 : int(pick(17))) / step * step);
    for (i128 x : cand) {
      x = x / step * step;
      if (x > max16 || x < -max16) continue;
      const std::string t = plain(x, kScale);
      CAPTURE(t);
      const bool want = inside(x, lower, upper);
      CHECK(rx->matches(t) == want);
      ++cases, matched += want;
      if (!integer && t.find('.') == std::string::npos) CHECK(rx->matches(t + ".0") == want);   // trailing zeros written
      if (!integer && t.find('.') != std::string::npos && t.size() - t.find('.') <= 16) CHECK(rx->matches(t + "0") == want);
      if (integer) CHECK_FALSE(rx->matches(t + ".0"));
      CHECK_FALSE(rx->matches(t + "e0"));
      CHECK_FALSE(rx->matches("0" + t));
      if (x == 0) CHECK_FALSE(rx->matches("-0"));
    }
  }
  MESSAGE(fmt::format("{} candidates, {} inside; patterns up to {} bytes, {} states", cases, matched, longest, most_states));
  CHECK(matched > cases / 5);
  CHECK(matched < cases);
}

TEST_CASE("serve/number_range: examples, the shortest numbers, and refusals") {
  auto pat = [](std::vector<NumberBound> lo, std::vector<NumberBound> hi, bool integer) {
    return Regex::compile(number_range_pattern(lo, hi, integer));
  };
  const auto age = pat({{"0", false}}, {{"120", false}}, true);
  for (const char* t : {"0", "7", "99", "100", "119", "120"}) CHECK(age->matches(t));
  for (const char* t : {"-1", "121", "007", "1.5", "200", "-0"}) CHECK_FALSE(age->matches(t));
  CHECK(age->shortest(age->start()) == "0");
  const auto prob = pat({{"0", false}}, {{"1", false}}, false);  // confloat(ge=0, le=1)
  for (const char* t : {"0", "0.5", "1", "1.0", "1.0000000000000000", "0.0000000000000001"}) CHECK(prob->matches(t));
  for (const char* t : {"1.0000000000000001", "-0.5", "2", "1.", ".5", "0.00000000000000001"}) CHECK_FALSE(prob->matches(t));
  const auto pos = pat({{"0", true}}, {}, false);  // PositiveFloat
  for (const char* t : {"0.1", "3", "9999999999999999.9999999999999999"}) CHECK(pos->matches(t));
  for (const char* t : {"0", "0.0", "-1", "10000000000000000"}) CHECK_FALSE(pos->matches(t));
  CHECK(pos->shortest(pos->start()).size() == 1);
  const auto neg = pat({}, {{"-2.5", true}}, false);
  for (const char* t : {"-2.6", "-3", "-2.5000000000000001"}) CHECK(neg->matches(t));
  for (const char* t : {"-2.5", "-2.50", "-2", "0"}) CHECK_FALSE(neg->matches(t));
  CHECK(neg->shortest(neg->start()) == "-3");
  // 1e-05 as a double's text; a bound with more digits than the grid.
  const auto tiny = pat({{"1e-05", false}}, {{"0.00010000000000000000001", false}}, false);
  for (const char* t : {"0.00001", "0.0001", "0.00005"}) CHECK(tiny->matches(t));
  for (const char* t : {"0.0000099", "0.0001000000000001", "0"}) CHECK_FALSE(tiny->matches(t));
  // Both ends at every digit of the grid: the largest patterns.
  const std::string wide = number_range_pattern(std::vector<NumberBound>{{"-1234567890123456.1234567890123456", true}},
                                                std::vector<NumberBound>{{"9876543210987654.9876543210987654", true}}, false);
  CHECK(wide.size() < Regex::kMaxPatternBytes);
  const auto w = Regex::compile(wide);
  MESSAGE(fmt::format("the widest two-sided range: {} bytes, {} states", wide.size(), w->states()));
  CHECK(w->matches("-1234567890123456.1234567890123455"));
  CHECK_FALSE(w->matches("-1234567890123456.1234567890123456"));
  CHECK(w->matches("9876543210987654.9876543210987653"));
  CHECK_FALSE(w->matches("9876543210987654.98765432109876539"));  // 17 fraction digits
  CHECK_FALSE(w->matches("9876543210987654.9876543210987654"));
  for (const auto& t : {std::tuple{"5", "4", true}, std::tuple{"0.5", "0.7", true}, std::tuple{"1e20", "2e20", false}}) {
    const char* lo = std::get<0>(t);  // no structured bindings: clang 14 cannot capture them
    CAPTURE(lo);
    CHECK_THROWS_WITH_AS(number_range_pattern(std::vector<NumberBound>{{lo, false}}, std::vector<NumberBound>{{std::get<1>(t), false}},
                                              std::get<2>(t)),
                         doctest::Contains("holds no"), std::invalid_argument);
  }
  CHECK_THROWS_WITH_AS(number_range_pattern(std::vector<NumberBound>{{"1x", false}}, {}, true), doctest::Contains("not a JSON number"),
                       std::invalid_argument);
}
