// Context-free grammars for constrained decoding (serve/cfg.h): the language
// against std::regex on random grammars that are also regular expressions,
// and against hand-written recognizers on languages that are not (nested
// brackets, arithmetic); every refusal with its message and byte; and the
// mask over the real tokenizer: the rule at tight budgets, and random walks
// that always end in a sentence within max_tokens.
#include <doctest/doctest.h>

#include <random>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "serve/cfg.h"
#include "serve/grammar.h"
#include "tests/serve/grammar_tokens.h"

using namespace areno;
using namespace areno::serve;
using namespace areno::serve::testing;

namespace {

std::string refusal(const std::string& grammar) {
  try {
    Cfg::compile(bytes(), grammar);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(compiled)";
}

// One random expression over a, b, c and 1, written both as GBNF and as an
// ECMAScript regular expression.
struct Both {
  std::string gbnf, regex;
};
Both random_expr(std::mt19937& rng, int depth) {
  auto pick = [&](int n) { return int(rng() % uint32_t(n)); };
  Both out;
  const int items = 1 + pick(3);
  for (int i = 0; i < items; ++i) {
    Both atom;
    switch (depth > 2 ? pick(4) : pick(6)) {
      case 0: {
        const char c = "abc1"[pick(4)];
        atom = {fmt::format("\"{}\"", c), std::string(1, c)};
        break;
      }
      case 1: {
        const int k = pick(4);
        atom = {std::vector<std::string>{"[ab]", "[^a]", "[a-c]", "[0-9]"}[size_t(k)],
                std::vector<std::string>{"[ab]", "[^a]", "[a-c]", "[0-9]"}[size_t(k)]};
        break;
      }
      case 2: {
        const std::string s{"abc"[pick(3)], "abc"[pick(3)]};
        atom = {"\"" + s + "\"", "(?:" + s + ")"};
        break;
      }
      case 3: atom = {"x", "(?:a1|b)"}; break;  // a rule
      case 4: {
        const Both in = random_expr(rng, depth + 1);
        atom = {"(" + in.gbnf + ")", "(?:" + in.regex + ")"};
        break;
      }
      default: {
        const Both l = random_expr(rng, depth + 1), r = random_expr(rng, depth + 1);
        atom = {"(" + l.gbnf + " | " + r.gbnf + ")", "(?:" + l.regex + "|" + r.regex + ")"};
        break;
      }
    }
    if (pick(2)) {
      const std::string q = std::vector<std::string>{"*", "+", "?", "{2}", "{0,2}", "{1,}", "{1,3}"}[size_t(pick(7))];
      atom.gbnf += q, atom.regex += q;
    }
    out.gbnf += (i ? " " : "") + atom.gbnf;
    out.regex += atom.regex;
  }
  return out;
}

// Balanced brackets of two kinds, at most `depth` deep.
bool balanced(const std::string& s) {
  std::string open;
  for (char c : s) {
    if (c == '(' || c == '[') open += c;
    else if (c == ')' || c == ']') {
      if (open.empty() || open.back() != (c == ')' ? '(' : '[')) return false;
      open.pop_back();
    } else return false;
  }
  return open.empty();
}

}  // namespace

TEST_CASE("serve/cfg the language equals std::regex's on random regular grammars and strings") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> len(0, 7), ch(0, 3);
  int grammars = 0, left_recursive = 0, agree = 0;
  for (int t = 0; t < 300; ++t) {
    const Both e = random_expr(rng, 0);
    const std::string grammar = "root ::= " + e.gbnf + "\nx ::= \"a1\" | \"b\"\n";
    CAPTURE(grammar);
    std::shared_ptr<const Cfg> g;
    try {
      g = Cfg::compile(bytes(), grammar);
    } catch (const std::invalid_argument& err) {
      // A repetition of something that can be empty is refused (left recursion).
      CHECK(std::string(err.what()).find("left-recursive") != std::string::npos);
      ++left_recursive;
      continue;
    }
    ++grammars;
    const std::regex re(e.regex);
    for (int s = 0; s < 60; ++s) {
      std::string text;
      for (int i = len(rng); i-- > 0;) text += "abc1"[ch(rng)];
      CAPTURE(text);
      const bool want = std::regex_match(text, re);
      CHECK(g->matches(text) == want);
      agree += g->matches(text) == want;
    }
  }
  CHECK(grammars > 200);
  CHECK(agree == grammars * 60);
  CHECK(left_recursive > 0);
}

TEST_CASE("serve/cfg languages beyond regular ones: brackets, arithmetic, nesting") {
  const auto brackets = Cfg::compile(bytes(), R"G(
    # balanced brackets of two kinds
    root ::= item*
    item ::= "(" root ")" | "[" root "]"
  )G");
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> len(0, 10), ch(0, 3);
  int yes = 0;
  for (int t = 0; t < 4000; ++t) {
    std::string s;
    for (int i = len(rng); i-- > 0;) s += "()[]"[ch(rng)];
    CAPTURE(s);
    CHECK(brackets->matches(s) == balanced(s));
    yes += balanced(s);
  }
  CHECK(yes > 50);
  CHECK(brackets->matches("([()[]])[]"));
  CHECK(brackets->matches(""));
  CHECK_FALSE(brackets->matches("(]"));
  // Arithmetic with precedence; left recursion written as repetition.
  const auto arith = Cfg::compile(bytes(), R"G(root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")" | "-" factor)G");
  for (const char* s : {"1", "1+2*3", "(1+2)*3", "--4", "((((7))))", "12/(3-4)*-5"}) CHECK(arith->matches(s));
  for (const char* s : {"", "1+", "(1", "1)", "1**2", "+1", "()"}) CHECK_FALSE(arith->matches(s));
  // Multi-byte text, classes of code points, escapes.
  const auto words = Cfg::compile(bytes(), "root ::= [\\u3040-\\u309F]{2} \"\\u00e9\\x41\\n\" [^\\x00-\\x7f]? \"\\\"\"");
  CHECK(words->matches("\xe3\x81\x82\xe3\x81\x84\xc3\xa9" "A\n\""));
  CHECK(words->matches("\xe3\x81\x82\xe3\x81\x84\xc3\xa9" "A\n\xf0\x9f\x98\x80\""));
  CHECK_FALSE(words->matches("\xe3\x81\x82\xe3\x82\xa2\xc3\xa9" "A\n\""));  // katakana is outside
  CHECK_FALSE(words->matches("\xe3\x81\x82\xe3\x81\x84\xc3\xa9" "A\nz\""));
  // Rules span lines until the next `name ::=`; names take - _ and .
  const auto lines = Cfg::compile(bytes(), "root ::= a-b\n  | c_d.e\na-b ::= \"x\"\n  \"y\"\nc_d.e ::= \"z\"{2,}");
  for (const char* s : {"xy", "zz", "zzzz"}) CHECK(lines->matches(s));
  for (const char* s : {"x", "z", "xyz"}) CHECK_FALSE(lines->matches(s));
  // Nesting deeper than kMaxDepth is not written: the language stops there.
  const auto deep = Cfg::compile(bytes(), "root ::= \"(\" root \")\" | \"x\"");
  CHECK(deep->matches(std::string(100, '(') + "x" + std::string(100, ')')));
  CHECK_FALSE(deep->matches(std::string(Cfg::kMaxDepth + 10, '(') + "x" + std::string(Cfg::kMaxDepth + 10, ')')));
}

TEST_CASE("serve/cfg refusals name what is wrong and the byte") {
  CHECK(refusal("root ::= x") == "the rule 'x' is used but never defined (at byte 9)");
  CHECK(refusal("a ::= \"x\"") == "the grammar has no rule 'root' (its start) (at byte 0)");
  CHECK(refusal("root ::= \"a\"\nroot ::= \"b\"") == "the rule 'root' is defined twice (at byte 13)");
  CHECK(refusal("") == "the grammar is empty (it needs a rule 'root ::= ...') (at byte 0)");
  CHECK(refusal("root ::= root \"x\" | \"y\"").find("the rule 'root' is left-recursive") == 0);
  CHECK(refusal("root ::= (\"x\"?)*").find("left-recursive") != std::string::npos);
  CHECK(refusal("root ::= a\na ::= b \"x\"\nb ::= \"\" | a").find("left-recursive") != std::string::npos);
  CHECK(refusal("root ::= \"a\" root") == "the rule 'root' can never finish (each of its alternatives needs itself again; at byte 0)");
  CHECK(refusal("root ::= (\"a\"") == "the group '(' is not closed (at byte 9)");
  CHECK(refusal("root ::= \"a\")") == "')' closes no group (at byte 12)");
  CHECK(refusal("root ::= \"abc") == "the literal is not closed by '\"' (at byte 9)");
  CHECK(refusal("root ::= [a-") == "the character class is not closed by ']' (at byte 9)");
  CHECK(refusal("root ::= \"a\\") == "an escape is cut off at the end of the grammar (at byte 11)");
  CHECK(refusal("root: \"a\"") == "expected '::=' after the rule name 'root' (at byte 4)");
  CHECK(refusal("root ::= /[a-z]+/").find("'/' is not GBNF") == 0);
  CHECK(refusal("root ::= \"\\q\"") == "unknown escape '\\q' (at byte 10)");
  CHECK(refusal("root ::= [z-a]") == "the range U+007A-U+0061 is reversed (at byte 9)");
  CHECK(refusal("root ::= [^\\x00-\\U0010FFFF]") == "the character class matches no character (at byte 9)");
  CHECK(refusal("root ::= \"\\uD800\"") == "U+D800 is not a character (at byte 10)");
  CHECK(refusal("root ::= \"a\"{1001}") == "a repetition count is above 1000 (at byte 12)");
  CHECK(refusal("root ::= \"a\"{3,2}") == "the repetition {3,2} has its maximum below its minimum (at byte 12)");
  CHECK(refusal("root ::= * \"a\"") == "the repetition '*' follows nothing it could repeat (at byte 9)");
  CHECK(refusal("root ::= \"\"*") == "a repetition of the empty literal \"\" (at byte 11)");
  CHECK(refusal("root ::= \"\xff\"") == "the grammar is not valid UTF-8 (at byte 10)");
  CHECK(refusal("root ::= \"a\" @") == "unexpected '@' (at byte 13)");
  // The bounds.
  CHECK(refusal(std::string(Cfg::kMaxGrammarBytes + 1, ' ')).find("at most 65536") != std::string::npos);
  std::string wide = "root ::=";
  for (int i = 0; i < 66; ++i) wide += " \"x\"{1000}";
  CHECK(refusal(wide) == "the grammar has more than 65536 elements once its repetitions are written out (at byte 662)");
  std::string many = "root ::= \"x\"";
  for (size_t i = 0; i < Cfg::kMaxRules; ++i) many += " (\"y\")";
  CHECK(refusal(many).find("the grammar has more than 4096 rules") == 0);
  std::string chain = "root ::= r0\n";
  for (int i = 0; i < 30; ++i) chain += fmt::format("r{} ::= r{} r{}\n", i, i + 1, i + 1);
  chain += "r30 ::= \"x\"\n";
  CHECK(refusal(chain).find("the shortest sentences of the grammar's rules take more than 1048576 bytes") == 0);
  // Alternatives open at once: a word list of kMaxStacks words compiles and
  // keeps every word; one more is refused rather than shortened.
  auto words = [](size_t n) {
    std::string g = "root ::= w0";
    for (size_t i = 1; i < n; ++i) g += fmt::format(" | w{}", i);
    for (size_t i = 0; i < n; ++i) g += fmt::format("\nw{} ::= \"{}{}\"", i, char('a' + i % 26), i);
    return g;
  };
  const auto list = Cfg::compile(bytes(), words(Cfg::kMaxStacks));
  for (size_t i : {size_t(0), size_t(517), Cfg::kMaxStacks - 1}) CHECK(list->matches(fmt::format("{}{}", char('a' + i % 26), i)));
  CHECK_FALSE(list->matches("a1"));
  CHECK(refusal(words(Cfg::kMaxStacks + 1)).find("the grammar opens more than 1024 ways to read its first character") == 0);
  CHECK(refusal("root ::= a{100}\na ::= \"x\"{700}") == "the shortest sentence of 'root' has 70000 bytes (at most 65536)");
  // A shortest sentence that nests deeper than the stacks may: refused, not
  // left to fail mid-output.
  std::string nest = "root ::= r0\n";
  for (size_t i = 0; i < Cfg::kMaxDepth + 10; ++i) nest += fmt::format("r{} ::= \"a\" r{} \"b\"\n", i, i + 1);
  nest += fmt::format("r{} ::= \"x\"\n", Cfg::kMaxDepth + 10);
  CHECK(refusal(nest).find("the shortest sentence of 'root' nests deeper than 128 rules") == 0);
  // What compiles.
  CHECK(refusal("root ::= \"\"") == "(compiled)");
  CHECK(refusal("root ::= \"a\" | # comment\n  \"b\" # another\n") == "(compiled)");
}

TEST_CASE("serve/cfg a crafted ambiguous grammar: one mask's work is bounded and fails the request, never holds the engine") {
  // Every letter opens two readings (closed by the same letter, or not), so
  // each prefix of letters is a new state of up to kMaxStacks stacks: over
  // the vocabulary's letter tokens, hundreds of millions of frames.
  std::string g = "root ::= e\ne ::= \".\"";
  for (char c = 'a'; c <= 'z'; ++c) g += fmt::format(" | \"{0}\" e \"{0}\" | \"{0}\" e", c);
  const auto cfg = Cfg::compile(bytes(), g);
  CHECK(cfg->matches("ab.ba"));
  CHECK(cfg->matches("abc.b"));
  CHECK_FALSE(cfg->matches("ab.ab"));
  std::vector<float> w(static_cast<size_t>(kVocab), 0.0f);
  CHECK_THROWS_WITH_AS(cfg->mask({}, 100, w.data(), kVocab), doctest::Contains("parse steps"), std::runtime_error);
}

TEST_CASE("serve/cfg the mask: a sentence, then <|end|>, within max_tokens") {
  const std::string json_grammar = R"G(root ::= object
value ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}"
array ::= "[" ws ( value ("," ws value)* )? "]"
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\""
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9]{1,2})?
ws ::= | " " | "\n" [ \t]{0,20}
)G";
  const auto json = Cfg::compile(bytes(), json_grammar);
  CHECK(text(json->completion({})) == "{}<|end|>");
  CHECK(json->min_tokens() == 2);
  CHECK(json->accepts(ids("{\"a\": [1, true, {\"b\": null}]}<|end|>")));
  CHECK(json->completion(ids("{\"a\": [1, true, {\"b\": null}]}<|end|>")).empty());
  CHECK(text(json->completion(ids("{\"ab\": [1, {\"c"))) == "\":0}]}<|end|>");
  for (const std::string bad : {"[1]", "{\"a\" 1}", "{}x", "{}<|end|>{}", "<|end|>", "{\"a\": tru<|end|>"}) {
    CAPTURE(bad);
    CHECK_FALSE(json->accepts(ids(bad)));
  }
  const auto list = Cfg::compile(bytes(), "root ::= \"[\" item (\", \" item){0,3} \"]\"\nitem ::= [a-z]+ | \"(\" item \")\"");
  // Ambiguous: the same text splits into words in many ways (several stacks at once).
  const auto words = Cfg::compile(bytes(), "root ::= w{1,8} \".\"\nw ::= [a-z] | [a-z] [a-z] | [a-z] [a-z] [a-z]");
  CHECK(words->matches("abcdefghijklmnopqrstuvwx."));
  CHECK_FALSE(words->matches("abcdefghijklmnopqrstuvwxy."));
  // The mask's rule at the tightest budgets and above, over every id.
  std::mt19937 rng(12);
  std::vector<float> logits(static_cast<size_t>(kVocab));
  std::normal_distribution<float> nd;
  for (float& x : logits) x = nd(rng);
  // Inside a code point: the first two bytes of U+65E5 as byte tokens.
  std::vector<int64_t> split = ids("{\"k\": \"");
  split.push_back(bytes()->byte_token(0xe6));
  split.push_back(bytes()->byte_token(0x97));
  for (const auto& [g, v] : {std::pair{json.get(), ids("")}, std::pair{json.get(), ids("{\"key\": [12")}, std::pair{json.get(), split},
                             std::pair{list.get(), ids("[ab, ((c")}, std::pair{words.get(), ids("abcdefghijklmnopq")}}) {
    const std::string shown = text(v);  // not text(v) in CAPTURE: clang 14 cannot capture a structured binding
    CAPTURE(shown);
    REQUIRE(g->accepts(v));
    CHECK(g->completion_length(v) == int64_t(g->completion(v).size()));
    check_masks_after(*g, v, {0, 4}, logits);
  }
  // Random walks end in a sentence within max_tokens, down to the minimum.
  int walks = 0;
  for (const auto& [g, favoured] : {std::pair{json.get(), std::string("{[\"0tn,:")}, std::pair{list.get(), std::string("(ab, ")},
                                    std::pair{words.get(), std::string("abc")}}) {
    for (int extra : {0, 3, 12, 40}) {
      CHECK(g->matches(checked_walk(*g, g->min_tokens() + extra, rng, favoured)));
      ++walks;
    }
  }
  CHECK(walks == 12);
}
