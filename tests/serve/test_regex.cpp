// Regular expressions for constrained decoding (serve/regex.h): the
// automaton's language against std::regex (ECMAScript) on random patterns
// and strings, UTF-8 classes and the any-character over multi-byte text,
// shortest continuations, every refused construct with its message; and the
// output grammar over it: the mask's rule at tight budgets and random walks
// over the real tokenizer that always end in a match within max_tokens.
#include <doctest/doctest.h>

#include <random>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include "serve/grammar.h"
#include "serve/regex.h"
#include "tests/serve/grammar_tokens.h"

using namespace areno;
using namespace areno::serve;
using namespace areno::serve::testing;

namespace {

// A random pattern over a, b, c and 1 in the syntax both readings share.
std::string random_pattern(std::mt19937& rng, int depth) {
  auto pick = [&](int n) { return int(rng() % uint32_t(n)); };
  std::string out;
  const int items = 1 + pick(3);
  for (int i = 0; i < items; ++i) {
    std::string atom;
    switch (depth > 2 ? pick(5) : pick(7)) {
      case 0: atom = std::string(1, "abc1"[pick(4)]); break;
      case 1: atom = "."; break;
      case 2: atom = std::vector<std::string>{"[ab]", "[^a]", "[a-c]", "\\d", "\\w", "[^\\d\\n]"}[size_t(pick(6))]; break;
      case 3: atom = std::string(1, "abc"[pick(3)]) + std::string(1, "abc"[pick(3)]); break;
      case 4: atom = "\\."; break;
      case 5: atom = "(" + random_pattern(rng, depth + 1) + ")"; break;
      default: atom = "(?:" + random_pattern(rng, depth + 1) + "|" + random_pattern(rng, depth + 1) + ")"; break;
    }
    if (pick(2)) atom += std::vector<std::string>{"*", "+", "?", "{2}", "{0,2}", "{1,}", "*?"}[size_t(pick(7))];
    out += atom;
  }
  if (pick(5) == 0) out += "|" + random_pattern(rng, depth + 1);
  return out;
}

std::string refusal_with(const std::string& pattern, const Regex::Options& o) {
  try {
    Regex::compile(pattern, o);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(compiled)";
}

std::string refusal(const std::string& pattern) { return refusal_with(pattern, Regex::Options{}); }

}  // namespace

TEST_CASE("serve/regex the language equals std::regex's on random patterns and strings") {
  std::mt19937 rng(17);
  int compared = 0, matched = 0, refused = 0;
  for (int p = 0; p < 300; ++p) {
    const std::string pattern = random_pattern(rng, 0);
    CAPTURE(pattern);
    std::shared_ptr<const Regex> re;
    try {
      re = Regex::compile(pattern);
    } catch (const std::invalid_argument& e) {  // a nest of repeats past the build bound: refused, not wrong
      CHECK(std::string(e.what()).find("too complex") != std::string::npos);
      ++refused;
      continue;
    }
    const std::regex oracle(pattern, std::regex::ECMAScript);
    for (int s = 0; s < 60; ++s) {
      std::string text;
      const int len = int(rng() % 8);
      for (int i = 0; i < len; ++i) text += "abc1.\n"[rng() % 6];
      CAPTURE(text);
      const bool want = std::regex_match(text, oracle);
      CHECK(re->matches(text) == want);
      matched += want;
      ++compared;
    }
    // Its shortest match is one.
    const std::string shortest = re->shortest(re->start());
    CHECK(int64_t(shortest.size()) == re->distance(re->start()));
    CHECK(std::regex_match(shortest, oracle));
  }
  CHECK(refused < 10);
  CHECK(compared == (300 - refused) * 60);
  CHECK(matched > 1000);  // the strings exercise both answers
}

TEST_CASE("serve/regex with_length: the language limited to a number of code points, against matches and a count") {
  std::mt19937 rng(23);
  const std::vector<std::string> alphabet = {"a", "b", "1", ".", "\xc3\xa9", "\xe6\x97\xa5"};  // é, 日: 2 and 3 bytes
  auto code_points = [](const std::string& t) {
    int64_t n = 0;
    for (unsigned char c : t) n += (c & 0xC0) != 0x80;
    return n;
  };
  int compared = 0, inside = 0;
  for (int p = 0; p < 120; ++p) {
    const std::string pattern = p % 4 == 0 ? ".*" : p % 4 == 1 ? "[^b]+b?" : random_pattern(rng, 0);
    std::shared_ptr<const Regex> re;
    try {
      re = Regex::compile(pattern);
    } catch (const std::invalid_argument&) {
      continue;
    }
    const uint32_t lo = uint32_t(rng() % 4), hi = rng() % 3 == 0 ? Regex::kNoMaxLength : lo + uint32_t(rng() % 4);
    CAPTURE(pattern);
    CAPTURE(lo);
    CAPTURE(hi);
    std::shared_ptr<const Regex> lim;
    try {
      lim = re->with_length(lo, hi);
    } catch (const std::invalid_argument& e) {  // no match of the pattern within the lengths
      CHECK(std::string(e.what()).find("within the length bounds") != std::string::npos);
      for (int s = 0; s < 200; ++s) {
        std::string text;
        for (int i = 0, n = int(rng() % 7); i < n; ++i) text += alphabet[rng() % alphabet.size()];
        const int64_t n = code_points(text);
        CHECK_FALSE((re->matches(text) && n >= lo && (hi == Regex::kNoMaxLength || n <= hi)));
      }
      continue;
    }
    for (int s = 0; s < 80; ++s) {
      std::string text;
      for (int i = 0, n = int(rng() % 8); i < n; ++i) text += alphabet[rng() % alphabet.size()];
      CAPTURE(text);
      const int64_t n = code_points(text);
      const bool want = re->matches(text) && n >= lo && (hi == Regex::kNoMaxLength || n <= hi);
      CHECK(lim->matches(text) == want);
      ++compared, inside += want;
    }
    // The shortest match is a match of both, and no shorter one exists in bytes.
    const std::string sh = lim->shortest(lim->start());
    CHECK(re->matches(sh));
    CHECK(code_points(sh) >= lo);
  }
  CHECK(compared > 5000);
  CHECK(inside > 300);
}

TEST_CASE("serve/regex UTF-8: classes of code points, the any-character over multi-byte text, shortest continuations") {
  const auto dot = Regex::compile(".");
  for (const std::string ok : {"a", "\xc3\xa9", "\xe6\x97\xa5", "\xf0\x9f\x98\x80", "\xef\xbf\xbf", "\xf4\x8f\xbf\xbf"}) {
    CAPTURE(ok);
    CHECK(dot->matches(ok));
  }
  for (const std::string bad : {"", "\n", "ab", "\xe6\x97", "\xc3", "\xed\xa0\x80", "\xc0\xaf", "\xf4\x90\x80\x80", "\xff"}) {
    CAPTURE(bad);
    CHECK_FALSE(dot->matches(bad));
  }
  const auto cyr = Regex::compile("[\\u0400-\\u04FF]+ [^\\x00-\\x7F]{2}");
  CHECK(cyr->matches("\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 \xe6\x97\xa5\xe6\x9c\xac"));  // Привет 日本
  CHECK_FALSE(cyr->matches("Privet \xe6\x97\xa5\xe6\x9c\xac"));
  CHECK_FALSE(cyr->matches("\xd0\x9f ab"));
  const auto accents = Regex::compile("caf\xc3\xa9+|[\xc3\xa0-\xc3\xbf]{2}");  // café+ | [à-ÿ]{2}
  CHECK(accents->matches("caf\xc3\xa9\xc3\xa9"));
  CHECK(accents->matches("\xc3\xa0\xc3\xbf"));
  CHECK_FALSE(accents->matches("caf\xc3"));
  CHECK_FALSE(accents->matches("\xc3\xa0"));
  // Shortest continuations: whole matches, one byte closer per step.
  struct Case {
    const char* pattern;
    const char* shortest;
  };
  for (const Case& c : {Case{"\\d{3}-\\d{4}", "000-0000"}, Case{"[A-Z][a-z]+", "Aa"}, Case{"(yes|no)", "no"},
                        Case{"^(19|20)\\d\\d-(0[1-9]|1[0-2])-\\d{2}$", "1900-01-00"}, Case{"[a-z]+@[a-z]+\\.(com|org)", "a@a.com"},
                        Case{"\\{\"k\": \\d\\}", "{\"k\": 0}"}, Case{"{\"k\": [a-z]?}", "{\"k\": }"}, Case{"", ""},
                        Case{"a|", ""}}) {
    CAPTURE(c.pattern);
    const auto re = Regex::compile(c.pattern);
    CHECK(re->shortest(re->start()) == c.shortest);
    CHECK(re->matches(c.shortest));
    for (int32_t s = 0; s < int32_t(re->states()); ++s) {
      const std::string rest = re->shortest(s);
      CHECK(int64_t(rest.size()) == re->distance(s));
      int32_t t = s;
      for (unsigned char b : rest) {
        const int32_t u = re->next(t, b);
        REQUIRE(u != Regex::kDead);
        CHECK(re->distance(u) == re->distance(t) - 1);
        t = u;
      }
      CHECK(re->accepting(t));
    }
  }
  // A state that can no longer match is never entered.
  const auto ab = Regex::compile("ab");
  CHECK(ab->next(ab->start(), 'b') == Regex::kDead);
  CHECK(ab->next(ab->next(ab->start(), 'a'), 'b') != Regex::kDead);
}

TEST_CASE("serve/regex refusals name the construct; the bounds hold") {
  struct Bad {
    std::string pattern, message;
  };
  for (const Bad& b : {Bad{"(?=a)b", "lookahead"}, Bad{"(?!a)b", "lookahead"}, Bad{"(?<=a)b", "lookbehind"},
                       Bad{"(?<!a)b", "lookbehind"}, Bad{"(a)\\1", "backreferences"}, Bad{"(?P<x>a)(?P=x)", "(?P"},
                       Bad{"\\bword", "word boundaries"}, Bad{"(?i)abc", "inline flags"}, Bad{"[[:alpha:]]", "POSIX"},
                       Bad{"a^b", "'^'"}, Bad{"a$b", "'$'"}, Bad{"(ab", "missing ')'"}, Bad{"ab)", "unbalanced ')'"},
                       Bad{"*a", "nothing to repeat"}, Bad{"a|+", "nothing to repeat"}, Bad{"a**", "multiple repeat"},
                       Bad{"a{2}{3}", "multiple repeat"}, Bad{"a{1001}", "over 1000"}, Bad{"a{3,2}", "above its maximum"},
                       Bad{"(a{1000}){1000}", "automaton states"}, Bad{"[z-a]", "below its start"},
                       Bad{"[\\d-z]", "class escape"}, Bad{"\\p{L}", "Unicode property"}, Bad{"a{,3}", "{0,n}"},
                       Bad{"\\q", "unknown escape"}, Bad{"[^\\s\\S]", "matches no string"}, Bad{"a\\", "trailing backslash"},
                       Bad{"\\x4", "hex digits"}, Bad{"\\uD800", "surrogate"}, Bad{"\\012", "octal"}, Bad{"[ab", "missing ']'"},
                       Bad{std::string(4097, 'a'), "over the limit of 4096"}, Bad{"a\xff", "not valid UTF-8"},
                       Bad{"(a|b)*a(a|b){15}", "more than 32767 automaton states"}, Bad{"(.{0,50}){20}", "too complex"}}) {
    CAPTURE(b.pattern.substr(0, 40));
    const std::string why = refusal(b.pattern);
    CAPTURE(why);
    CHECK(why.find(b.message) != std::string::npos);
  }
  // What does compile: named groups, lazy and possessive suffixes, a literal
  // brace, escaped punctuation, anchors at the ends, the empty pattern.
  for (const std::string ok : {"(?P<year>\\d{4})-(?<m>\\d\\d)", "a+?b*+", "{x}", "\\{\\}\\[\\]\\(\\)\\.\\*\\$\\^\\|\\\\",
                               "^abc$", "", "(a|b)*a(a|b){12}", ".{0,1000}", "[]a]", "[^]a]", "[a-]", "[\\b]", "\\t\\n\\r\\f\\v\\0"}) {
    CAPTURE(ok);
    CHECK(refusal(ok) == "(compiled)");
  }
  CHECK(Regex::compile("(?P<year>\\d{4})-(?<m>\\d\\d)")->matches("2026-12"));
  CHECK(Regex::compile("\\{\\}\\[\\]\\(\\)\\.\\*\\$\\^\\|\\\\")->matches("{}[]().*$^|\\"));
  CHECK(Regex::compile("[]a]+")->matches("]a]"));
  CHECK(Regex::compile("[a-]+")->matches("-a"));
  CHECK(Regex::compile("")->matches(""));
  CHECK_FALSE(Regex::compile("")->matches("a"));
}

TEST_CASE("serve/regex the output grammar: a whole match, then <|end|>, within max_tokens") {
  const auto phone = OutputGrammar::regex(bytes(), Regex::compile("\\d{3}-\\d{4}"));
  CHECK(text(phone->completion({})) == "000-0000<|end|>");
  CHECK(phone->min_tokens() == 1 + bytes()->spell("000-0000"));
  CHECK(phone->accepts(ids("555-1234<|end|>")));
  CHECK(phone->completion(ids("555-1234<|end|>")).empty());
  CHECK(text(phone->completion(ids("55"))) == "0-0000<|end|>");
  for (const std::string bad : {"55a", "555-12345", "555-123<|end|>", "<|end|>", "555-1234<|end|>x"}) {
    CAPTURE(bad);
    CHECK_FALSE(phone->accepts(ids(bad)));
  }
  // The mask's rule at the tightest budgets and above.
  std::mt19937 rng(12);
  std::vector<float> logits(static_cast<size_t>(kVocab));
  std::normal_distribution<float> nd;
  for (float& x : logits) x = nd(rng);
  const auto words = OutputGrammar::regex(bytes(), Regex::compile("[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,3}\\."));
  for (const auto& [g, prefix] : {std::pair{phone.get(), std::string("")}, std::pair{phone.get(), std::string("55")},
                                  std::pair{words.get(), std::string("Hello Wor")}}) {
    const auto& prefix_ = prefix;  // clang 14 cannot capture a structured binding
    CAPTURE(prefix_);
    check_masks_after(*g, ids(prefix), {0, 5}, logits);
  }
  // Random walks end in a match within max_tokens, down to the minimum.
  int walks = 0;
  for (const std::string& pattern :
       {std::string("\\d{3}-\\d{4}"), std::string("(yes|no|maybe)"), std::string("[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,3}\\."),
        std::string(".{5,40}"), std::string("\\{\"a\": \\d+, \"b\": \"[^\"]*\"\\}"),
        std::string("(\xe6\x97\xa5\xe6\x9c\xac|\xe4\xb8\xad\xe5\x9b\xbd)\xe8\xaa\x9e?"), std::string("[a-z ]*")}) {
    const auto re = Regex::compile(pattern);
    const auto g = OutputGrammar::regex(bytes(), re);
    for (int extra : {0, 3, 20}) {
      CAPTURE(pattern);
      CHECK(re->matches(checked_walk(*g, g->min_tokens() + extra, rng, "0123456789yn ")));
      ++walks;
    }
  }
  CHECK(walks == 21);
}

TEST_CASE("serve/regex as a JSON Schema pattern: a search unless anchored, over text JSON need not escape") {
  Regex::Options o;
  o.json_string = o.search = true;
  const auto x = Regex::compile("x\\d", o);
  CHECK(x->matches("see x1 here"));
  CHECK(x->matches("x9"));
  CHECK_FALSE(x->matches("x"));
  CHECK_FALSE(x->matches("see xa"));
  CHECK(x->shortest(x->start()) == "x0");
  const auto anchored = Regex::compile("^[A-Z]{2}-\\d{3}$", o);
  CHECK(anchored->matches("AB-123"));
  CHECK_FALSE(anchored->matches(" AB-123"));
  CHECK_FALSE(anchored->matches("AB-1234"));
  const auto head = Regex::compile("^ab", o);
  CHECK(head->matches("abc"));
  CHECK_FALSE(head->matches("cab"));
  // No character JSON escapes: not '"', '\' or a control, even where the
  // pattern would take it.
  const auto any = Regex::compile("^[^x]+$", o);
  CHECK(any->matches("ab \xc3\xa9"));
  for (const std::string& bad : {std::string("a\"b"), std::string("a\\b"), std::string("a\nb"), std::string("a\0b", 3), std::string("a\x1f")}) {
    CAPTURE(bad);
    CHECK_FALSE(any->matches(bad));
  }
  CHECK(refusal_with("^a\"$", o).find("JSON escapes") != std::string::npos);
  CHECK(refusal_with("^a|b$", o).find("top-level '|'") != std::string::npos);
  CHECK(refusal_with("^(a|b)$", o) == "(compiled)");
  // A shared work bound: the second costly pattern finds it spent.
  int64_t left = Regex::kMaxBuildWork;
  o.work_left = &left;
  CHECK_NOTHROW(Regex::compile("^\\w{0,200}(\\d{0,50})$", o));
  CHECK(left < Regex::kMaxBuildWork * 5 / 8);  // about half of it
  CHECK(refusal_with("^\\w{0,200}(\\d{0,50})b$", o).find("together") != std::string::npos);
  CHECK(refusal_with("^a+$", o) == "(compiled)");  // a cheap one still fits
}
