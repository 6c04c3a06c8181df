// Constrained decoding's cost per token: the mask over the Phi-4 vocabulary
// (200064 ids) at typical states of a forced tool call, a JSON object, a JSON
// schema, a regular expression (serve/grammar.h) and GBNF grammars
// (serve/cfg.h). Each state's mask runs --reps
// times on one thread over fixed random logits, with 1000 tokens left or
// (the "tight" states) exactly the completion's count, where candidates
// whose completion has more bytes than tokens left are spelled in tokens;
// prints one JSON line per state with the first, best and median
// milliseconds and how many ids stay allowed. Then three decodes of 2000
// tokens (a JSON string, a GBNF JSON string, a regex's free text), masked at
// every step as the output grows: the mean of the last 100 steps.
//
// usage: bench_grammar [--reps N]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/cfg.h"
#include "serve/grammar.h"
#include "serve/json_schema.h"
#include "serve/regex.h"

using namespace areno;
using namespace areno::serve;

int main(int argc, char** argv) {
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else {
      fmt::print(stderr, "usage: bench_grammar [--reps N]\n");
      return 2;
    }
  }
  constexpr int64_t kVocab = 200064;
  tok::Tokenizer tokenizer = phi4mm::make_tokenizer();
  tokenizer.set_padded_vocab_size(size_t(kVocab));
  const auto bytes = std::make_shared<const TokenBytes>(tokenizer, kVocab);
  const auto schema = JsonSchema::compile(nlohmann::ordered_json::parse(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
      "mood": {"enum": ["happy", "sad", "neutral"]}, "tags": {"type": "array", "items": {"type": "string"}},
      "meta": {"type": "object"}}, "required": ["name", "age"]})"));
  const auto person = OutputGrammar::json_schema(bytes, schema);
  const auto object = OutputGrammar::json_object(bytes);
  const auto add = OutputGrammar::tool_call(
      bytes, {"add", "get_weather"},
      {JsonSchema::compile(nlohmann::ordered_json::parse(
           R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})")),
       nullptr});
  const auto phone = OutputGrammar::regex(bytes, Regex::compile("\\(\\d{3}\\) \\d{3}-\\d{4}"));
  const auto line = OutputGrammar::regex(bytes, Regex::compile("[A-Z][^\\n]{0,200}\\."));
  const auto long_line = OutputGrammar::regex(bytes, Regex::compile("[A-Z][^\\n]*\\."));
  // GBNF: JSON as llama.cpp's grammars/json.gbnf writes it, and arithmetic.
  const auto json = Cfg::compile(bytes, R"G(root ::= object
value ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9]{1,2})? ws
ws ::= | " " | "\n" [ \t]{0,20}
)G");
  const auto arith = Cfg::compile(bytes, R"G(root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")" | "-" factor
)G");
  auto ids = [&](const std::string& text) {
    std::vector<int64_t> out;
    for (const tok::Segment& s : tokenizer.split_added_tokens(text)) {
      if (s.token >= 0) {
        out.push_back(s.token);
        continue;
      }
      for (tok::TokenId t : tokenizer.encode_ordinary(std::string_view(text).substr(s.begin, s.end - s.begin)))
        out.push_back(t);
    }
    return out;
  };
  struct Case {
    const char* name;
    const OutputConstraint* g;
    std::string prefix;
    bool tight = false;
  };
  const std::string call = "<|tool_call|>[{\"name\": \"";
  const std::vector<Case> cases = {
      {"schema: start", person.get(), ""},
      {"schema: after a comma (key)", person.get(), R"({"name": "x", )"},
      {"schema: value", person.get(), R"({"name": )"},
      {"schema: bounded string", person.get(), R"({"name": "ab)"},
      {"schema: integer", person.get(), R"({"name": "ab", "age": 1)"},
      {"schema: free string in a map", person.get(), R"({"name": "ab", "age": 1, "meta": {"k": "v)"},
      {"json_object: string", object.get(), R"({"k": "v)"},
      {"json_object: value", object.get(), R"({"k": )"},
      {"tool call: name", add.get(), call},
      {"tool call: argument value", add.get(), call + R"(add", "arguments": {"a": )"},
      {"tight: schema: bounded string", person.get(), R"({"name": "ab)", true},
      {"tight: schema: integer", person.get(), R"({"name": "ab", "age": 1)", true},
      {"tight: json_object: string", object.get(), R"({"k": "v)", true},
      {"tight: tool call: name", add.get(), call, true},
      {"regex: digits", phone.get(), "(55", false},
      {"regex: free text (any but newline)", line.get(), "Hello, wor", false},
      {"tight: regex: free text", line.get(), "Hello, wor", true},
      {"gbnf json: start", json.get(), ""},
      {"gbnf json: value", json.get(), R"({"k": )"},
      {"gbnf json: string", json.get(), R"({"k": "v)"},
      {"gbnf json: nested number", json.get(), R"({"a": {"b": [1, 2, {"c": 12)"},
      {"tight: gbnf json: string", json.get(), R"({"k": "v)", true},
      {"gbnf arithmetic: nested", arith.get(), "((1+2)*(3-"},
  };
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> logits(static_cast<size_t>(kVocab)), w;
  for (float& x : logits) x = nd(rng);
  for (const Case& c : cases) {
    const std::vector<int64_t> prefix = ids(c.prefix);
    const int64_t remaining = c.tight ? c.g->completion_length(prefix) : 1000;
    std::vector<double> ms;
    for (int r = 0; r < reps; ++r) {
      w = logits;
      const auto t0 = std::chrono::steady_clock::now();
      c.g->mask(prefix, remaining, w.data(), kVocab);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    const double first = ms.front();  // a grammar that keeps masks per state (Cfg) computes only this one
    std::sort(ms.begin(), ms.end());
    int64_t allowed = 0;
    for (float x : w) allowed += std::isfinite(x);
    fmt::print("{{\"state\": \"{}\", \"first_ms\": {:.3f}, \"best_ms\": {:.3f}, \"median_ms\": {:.3f}, \"allowed\": {}}}\n",
               c.name, first, ms.front(), ms[ms.size() / 2], allowed);
  }
  // Decoding: the output grows a token per step, as the engine asks. A long
  // answer (a JSON string of 2000 tokens, then a regex's free text) masked
  // at every step; the mean of the last 100 steps, where replaying the whole
  // output each step would cost the most.
  struct Walk {
    const char* name;
    const OutputConstraint* g;
    std::string head;  // then " word" tokens
  };
  for (const Walk& wk : {Walk{"decode: json_object string, steps 1900-2000", object.get(), R"({"k": ")"},
                         Walk{"decode: gbnf json string, steps 1900-2000", json.get(), R"({"k": ")"},
                         Walk{"decode: regex free text, steps 1900-2000", long_line.get(), "Hello"}}) {
    std::vector<int64_t> out = ids(wk.head);
    const std::vector<int64_t> word = ids(" word");
    double total = 0;
    int64_t timed = 0;
    for (int64_t step = 0; step < 2000; ++step) {
      w = logits;
      const auto t0 = std::chrono::steady_clock::now();
      wk.g->mask(out, 4000, w.data(), kVocab);
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (step >= 1900) total += t, ++timed;
      out.push_back(word[0]);
    }
    fmt::print("{{\"state\": \"{}\", \"mean_ms\": {:.3f}, \"tokens\": {}}}\n", wk.name, total / double(timed),
               out.size());
  }
  return 0;
}
