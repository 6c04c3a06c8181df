// Constrained decoding (serve/grammar.h): the forced tool call's and the JSON
// object's languages byte by byte over the Phi-4 tokenizer's real tokens,
// the shortest completion of mid-way states, the mask's rule (an id is
// allowed exactly when it keeps the output a prefix and finishable in the
// tokens left), and random walks through the mask that always end in a
// complete output the tool-call parser (or a JSON parser) accepts.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/grammar.h"
#include "serve/json_schema.h"
#include "serve/regex.h"
#include "serve/openai.h"
#include "tests/serve/grammar_tokens.h"

using namespace areno;
using namespace areno::serve;
using namespace areno::serve::testing;
using nlohmann::json;

namespace {

const std::string kCall = "<|tool_call|>[{\"name\": \"";

json tools_named(const std::vector<std::string>& names) {
  json t = json::array();
  for (const std::string& n : names) t.push_back({{"type", "function"}, {"function", {{"name", n}}}});
  return t;
}

}  // namespace

TEST_CASE("serve/grammar the tool call: its language, shortest completions, names") {
  const auto g = OutputGrammar::tool_call(bytes(), {"add", "add_more", "sub"});
  const std::string shortest = kCall + "add\", \"arguments\": {}}]<|/tool_call|><|end|>";
  CHECK(text(g->completion({})) == shortest);
  CHECK(g->min_tokens() == int64_t(g->completion({}).size()));
  // Whole calls, any JSON inside the arguments.
  for (const std::string& args :
       {std::string("{}"), std::string("{\"a\": 2, \"b\": 3}"), std::string("{ \"x\" : [true, false, null, -0.5e+3, 0, 12.25E-1] }"),
        std::string("{\"s\": \"q\\\"\\\\ \\u00e9 \xc3\xa9\", \"o\": {\"p\": [[], {}]}}")}) {
    for (const std::string name : {"add", "add_more", "sub"}) {
      const std::string call = kCall + name + "\", \"arguments\": " + args + "}]<|/tool_call|><|end|>";
      CAPTURE(call);
      const std::vector<int64_t> v = ids(call);
      CHECK(g->accepts(v));
      CHECK(g->completion(v).empty());
      // The parser the server answers with takes it.
      const ToolCallParse p = parse_tool_calls(text(v), tools_named({"add", "add_more", "sub"}));
      REQUIRE(p.found);
      CHECK(p.tool_calls[0]["function"]["name"] == name);
      CHECK(json::parse(p.tool_calls[0]["function"]["arguments"].get<std::string>()) == json::parse(args));
    }
  }
  // Prefixes outside the language.
  for (const std::string& bad :
       {std::string("hello"), std::string("<|end|>"), kCall + "mul", kCall + "add\", \"arguments\": [",
        kCall + "add\", \"arguments\": {\"a\" 1", kCall + "add\", \"arguments\": {,", kCall + "add\", \"arguments\": {\"a\": 01",
        kCall + "add\", \"arguments\": {\"a\": tru ", kCall + "add\", \"arguments\": {\"a\": 1,}",
        kCall + "add\", \"arguments\": {\"a\": \"\x01", kCall + "add\", \"arguments\": {\"a\": \"\\x",
        kCall + "add\", \"arguments\": {\"a\": 1.}", kCall + "add\", \"arguments\": {\"a\": -}",
        kCall + "add\", \"arguments\": {}}]<|end|>", kCall + "add\", \"arguments\": {}}] "}) {
    CAPTURE(bad);
    CHECK_FALSE(g->accepts(ids(bad)));
  }
  // Shortest completions of states half way.
  struct Mid {
    std::string prefix, rest;
  };
  const std::string tail = "}]<|/tool_call|><|end|>";
  for (const Mid& m : {Mid{kCall + "ad", "d\", \"arguments\": {}" + tail}, Mid{kCall + "add_", "more\", \"arguments\": {}" + tail},
                       Mid{kCall + "add\", \"arguments\": {\"a\": \"xy", "\"}" + tail},
                       Mid{kCall + "add\", \"arguments\": {\"k", "\":0}" + tail},
                       Mid{kCall + "add\", \"arguments\": {\"k\"", ":0}" + tail},
                       Mid{kCall + "add\", \"arguments\": {\"a\": 1.", "0}" + tail},
                       Mid{kCall + "add\", \"arguments\": {\"a\": 1e+", "0}" + tail},
                       Mid{kCall + "add\", \"arguments\": {\"a\": 17", "}" + tail},
                       Mid{kCall + "add\", \"arguments\": {\"a\": [1, {\"b\": tr", "ue}]}" + tail},
                       Mid{kCall + "add\", \"arguments\": {\"a\": \"\\u00", "00\"}" + tail},
                       Mid{kCall + "add\", \"arguments\": {\"a\": [", "]}" + tail},
                       Mid{kCall + "add\", \"arguments\": {\"a\": 1, ", "\"\":0}" + tail},
                       Mid{kCall + "add\", \"arguments\": {\"a\": [1, ", "0]}" + tail}}) {
    CAPTURE(m.prefix);
    const std::vector<int64_t> v = ids(m.prefix);
    REQUIRE(g->accepts(v));
    const std::vector<int64_t> c = g->completion(v);
    CHECK(text(c) == m.rest);
    std::vector<int64_t> whole = v;
    whole.insert(whole.end(), c.begin(), c.end());
    CHECK(g->accepts(whole));
    CHECK(g->completion(whole).empty());
  }
  // Nesting stops at kMaxDepth.
  std::string deep = kCall + "add\", \"arguments\": ";
  for (int i = 0; i < OutputGrammar::kMaxDepth; ++i) deep += i % 2 ? "[" : "{\"k\": ";
  CHECK(g->accepts(ids(deep)));
  CHECK_FALSE(g->accepts(ids(deep + "[")));
  CHECK_THROWS_AS(OutputGrammar::tool_call(bytes(), {}), std::invalid_argument);
  CHECK_THROWS_AS(OutputGrammar::tool_call(bytes(), std::vector<std::string>(65, "f")), std::invalid_argument);
  CHECK_THROWS_AS(OutputGrammar::tool_call(bytes(), {std::string(257, 'f')}), std::invalid_argument);
  // max_tokens counts tokens: the 256-byte name costs its fewest tokens, not 256.
  const auto longname = OutputGrammar::tool_call(bytes(), {std::string(256, 'f')});
  CHECK(text(longname->completion({})) == kCall + std::string(256, 'f') + "\", \"arguments\": {}}]<|/tool_call|><|end|>");
  CHECK(longname->min_tokens() == int64_t(longname->completion({}).size()));
  CHECK(longname->min_tokens() ==
        3 + bytes()->spell("[{\"name\": \"" + std::string(256, 'f') + "\", \"arguments\": {}}]"));
  CHECK(longname->min_tokens() < 60);  // 37 - 3 + 256 bytes
  // A name with a quote is written escaped.
  const auto q = OutputGrammar::tool_call(bytes(), {"say\"hi"});
  CHECK(text(q->completion({})) == kCall + "say\\\"hi\", \"arguments\": {}}]<|/tool_call|><|end|>");
}

TEST_CASE("serve/grammar mask: allowed exactly when the output stays a prefix that fits the tokens left") {
  const auto g = OutputGrammar::tool_call(bytes(), {"add"});
  const std::vector<int64_t> prefix = ids(kCall + "add\", \"arguments\": {\"a\": \"x");
  const int64_t need = int64_t(g->completion(prefix).size());
  CHECK(text(g->completion(prefix)) == "\"}}]<|/tool_call|><|end|>");
  CHECK(need == 2 + bytes()->spell("\"}}]"));
  CHECK(need < 6);  // its bytes
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> logits(static_cast<size_t>(kVocab));
  for (float& x : logits) x = nd(rng);
  for (int64_t remaining : {need, need + 1, need + 3, int64_t(1000)}) {
    CAPTURE(remaining);
    std::vector<float> w;
    const auto [allowed, wrong] = check_mask(*g, prefix, remaining, logits, w);
    CHECK(wrong == 0);
    // At the limit only tokens that close the string fit (the quote alone,
    // or text and the quote: `("`, `."`): a letter does not.
    const int64_t letter = bytes()->byte_token(uint8_t('y'));
    if (remaining == need) {
      CHECK(std::isfinite(w[size_t(g->completion(prefix)[0])]));
      CHECK(!std::isfinite(w[size_t(letter)]));
      CHECK(allowed < 1000);
    } else {
      CHECK(std::isfinite(w[size_t(letter)]));
      CHECK(allowed > 1000);  // any string text
    }
  }
  // Every allowed id masked away (penalties, min_tokens): the completion's first token, at 0.
  std::vector<float> none(size_t(kVocab), -std::numeric_limits<float>::infinity());
  g->mask(prefix, 100, none.data(), kVocab);
  CHECK(none[size_t(g->completion(prefix)[0])] == 0.0f);
  int64_t finite = 0;
  for (float x : none) finite += std::isfinite(x);
  CHECK(finite == 1);
  // Finished: nothing is masked.
  const std::vector<int64_t> done = ids(kCall + "add\", \"arguments\": {}}]<|/tool_call|><|end|>");
  std::vector<float> w = logits;
  g->mask(done, 10, w.data(), kVocab);
  CHECK(w == logits);
  CHECK_THROWS_AS(g->mask(ids("hello"), 10, w.data(), kVocab), std::logic_error);
}

TEST_CASE("serve/grammar random walks through the mask end in a complete call or object within max_tokens") {
  const json tools = tools_named({"get_weather", "add"});
  const auto call = OutputGrammar::tool_call(bytes(), {"get_weather", "add"});
  const auto object = OutputGrammar::json_object(bytes());
  CHECK(text(object->completion({})) == "{}<|end|>");
  std::mt19937 rng(7);
  int complete = 0;
  for (int walk = 0; walk < 6; ++walk) {
    const bool is_call = walk % 2 == 0;
    const auto& g = is_call ? call : object;
    const int64_t max_tokens = g->min_tokens() + int64_t(walk) * 7;
    // Favour the characters that open structure, so walks nest.
    const std::vector<int64_t> out = masked_walk(*g, max_tokens, rng, "{[\"0tn,:", "", [](const std::vector<int64_t>&) {});
    CAPTURE(walk);
    CAPTURE(text(out));
    REQUIRE(out.back() == phi4mm::kEnd);
    CHECK(int64_t(out.size()) <= max_tokens);
    CHECK(g->completion(out).empty());
    const std::string s = text(out);
    if (is_call) {
      const ToolCallParse p = parse_tool_calls(s.substr(0, s.size() - 7), tools);
      REQUIRE(p.found);
      CHECK(json::parse(p.tool_calls[0]["function"]["arguments"].get<std::string>()).is_object());
    } else {
      CHECK(json::parse(s.substr(0, s.size() - 7)).is_object());
    }
    ++complete;
  }
  CHECK(complete == 6);
}

TEST_CASE("serve/grammar tool_choice auto: free text until <|tool_call|>, then a call that parses; none begun without room") {
  const json tools = tools_named({"get_weather", "add"});
  const auto call = OutputGrammar::tool_call(bytes(), {"get_weather", "add"});
  const AutoToolCall g(call);
  CHECK(g.min_tokens() == 1);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::vector<float> logits(static_cast<size_t>(kVocab));
  for (float& x : logits) x = nd(rng);
  const float inf = std::numeric_limits<float>::infinity();
  // Before the marker, with room for a call: nothing is masked.
  const std::vector<int64_t> said = ids("Let me check. ");
  std::vector<float> w = logits;
  g.mask(said, call->min_tokens(), w.data(), kVocab);
  CHECK(w == logits);
  CHECK(g.completion_length(said) == 0);
  // One token short of the shortest call: only the marker is masked ...
  w = logits;
  g.mask(said, call->min_tokens() - 1, w.data(), kVocab);
  int64_t changed = 0;
  for (int64_t id = 0; id < kVocab; ++id) changed += w[size_t(id)] != logits[size_t(id)];
  CHECK(changed == 1);
  CHECK(w[size_t(phi4mm::kToolCall)] == -inf);
  // ... unless it is the only id left.
  std::vector<float> only(static_cast<size_t>(kVocab), -inf);
  only[size_t(phi4mm::kToolCall)] = 0;
  g.mask(said, 1, only.data(), kVocab);
  CHECK(only[size_t(phi4mm::kToolCall)] == 0);
  // From the marker on: the call grammar's mask of the output from the marker.
  std::vector<int64_t> begun = said;
  begun.push_back(phi4mm::kToolCall);
  for (int64_t id : ids("[{\"name\": \"ad")) begun.push_back(id);
  const std::span<const int64_t> from(begun.data() + said.size(), begun.size() - said.size());
  for (int64_t left : {int64_t(12), int64_t(40)}) {
    w = logits;
    g.mask(begun, left, w.data(), kVocab);
    std::vector<float> want = logits;
    call->mask(from, left, want.data(), kVocab);
    CHECK(w == want);
  }
  CHECK(g.completion_length(begun) == call->completion_length(from));
  CHECK_THROWS_AS(g.mask(std::vector<int64_t>{phi4mm::kToolCall, ids("x")[0]}, 40, w.data(), kVocab), std::logic_error);
  // Walks that begin a call after some text always end in one that parses.
  for (int walk = 0; walk < 4; ++walk) {
    std::vector<int64_t> out = ids("Sure. ");
    out.push_back(phi4mm::kToolCall);
    const int64_t max_tokens = int64_t(out.size()) + call->min_tokens() + 10 * walk;
    while (int64_t(out.size()) < max_tokens && out.back() != phi4mm::kEnd) {
      for (float& x : w) x = 3.0f * nd(rng);
      for (char c : std::string("{[\"0tn,:")) w[size_t(bytes()->byte_token(uint8_t(c)))] += 6.0f;
      g.mask(out, max_tokens - int64_t(out.size()), w.data(), kVocab);
      out.push_back(int64_t(std::max_element(w.begin(), w.end()) - w.begin()));
    }
    const std::string t = text(out);
    CAPTURE(t);
    REQUIRE(out.back() == phi4mm::kEnd);
    const ToolCallParse p = parse_tool_calls(t.substr(0, t.size() - 7), tools);
    REQUIRE(p.found);
    CHECK(json::parse(p.tool_calls[0]["function"]["arguments"].get<std::string>()).is_object());
  }
}

namespace {

// The fewest tokens spelling `t`, by brute force over every substring.
int64_t brute_spell(const std::string& t) {
  static const std::unordered_set<std::string> vocab = [] {
    std::unordered_set<std::string> v;
    for (int64_t id = 0; id < bytes()->size(); ++id)
      if (!bytes()->special(id) && !bytes()->bytes(id).empty()) v.insert(std::string(bytes()->bytes(id)));
    return v;
  }();
  std::vector<int64_t> best(t.size() + 1, std::numeric_limits<int64_t>::max() / 4);
  best[t.size()] = 0;
  for (size_t i = t.size(); i-- > 0;)
    for (size_t j = i + 1; j <= t.size(); ++j)
      if (vocab.count(t.substr(i, j - i))) best[i] = std::min(best[i], 1 + best[j]);
  return best[0];
}

}  // namespace

TEST_CASE("serve/grammar TokenBytes::spell: the fewest tokens, as a brute-force count finds") {
  std::mt19937 rng(4);
  std::string random_text;
  for (int i = 0; i < 80; ++i) random_text += char(0x20 + rng() % 95);
  for (const std::string& t :
       {std::string("\"}}]"), std::string(R"({"name":"aa","age":0,"tags":[""]})"), std::string(256, 'f'),
        std::string("positive"), std::string("\xc3\xa9"), std::string(" way"), std::string("Zo\xc3\xab \\\"Z\\\" \xe6\x97\xa5\xe6\x9c\xac"),
        std::string("\n\n\t\t  "), random_text, std::string("a")}) {
    CAPTURE(t);
    std::vector<int64_t> out;
    const int64_t n = bytes()->spell(t, &out);
    CHECK(n == brute_spell(t));
    CHECK(int64_t(out.size()) == n);
    std::string back;
    for (int64_t id : out) {
      CHECK_FALSE(bytes()->special(id));
      back += bytes()->bytes(id);
    }
    CHECK(back == t);
  }
  CHECK(bytes()->spell("") == 0);
  CHECK(bytes()->spell(std::string(256, 'f')) < 40);
}

TEST_CASE("serve/grammar every token of a completion takes one off its count, so a tight max_tokens still finishes") {
  // Options whose fewest tokens do not follow their bytes: the shortest
  // output in tokens is the longer word.
  const std::string word = "international", odd = "qzxv";
  REQUIRE(bytes()->spell(word) == 1);
  REQUIRE(bytes()->spell(odd) >= 2);
  const auto choice = OutputGrammar::choice(bytes(), {odd, word, odd + odd});
  CHECK(choice->min_tokens() == 2);
  CHECK(text(choice->completion({})) == "international<|end|>");
  // A vLLM-style classification: max_tokens 2 is enough for one-token labels.
  const auto labels = OutputGrammar::choice(bytes(), {"positive", "negative", "neutral"});
  const int64_t label_tokens =
      1 + std::min({bytes()->spell("positive"), bytes()->spell("negative"), bytes()->spell("neutral")});
  CHECK(labels->min_tokens() == label_tokens);
  CHECK(label_tokens < 8);  // the bytes of the shortest
  const auto call = OutputGrammar::tool_call(bytes(), {"get_weather", "add"});
  const auto object = OutputGrammar::json_object(bytes());
  // Along each completion, every prefix's count is the rest's length.
  struct At {
    const OutputGrammar* g;
    std::string prefix;
  };
  for (const At& at : {At{call.get(), ""}, At{call.get(), kCall + "get"}, At{call.get(), kCall + "add\", \"arguments\": {\"k"},
                       At{call.get(), kCall + "get_weather\", \"arguments\": {\"a\": [1, {\"b\": tr"},
                       At{object.get(), "{\"x\": \"abc"}, At{choice.get(), ""}, At{choice.get(), "q"}, At{labels.get(), "neg"}}) {
    CAPTURE(at.prefix);
    const std::vector<int64_t> v = ids(at.prefix);
    REQUIRE(at.g->accepts(v));
    const std::vector<int64_t> c = at.g->completion(v);
    std::vector<int64_t> w = v;
    for (size_t k = 0; k <= c.size(); ++k) {
      CHECK(at.g->completion_length(w) == int64_t(c.size() - k));
      if (k < c.size()) w.push_back(c[k]);
    }
    CHECK(at.g->accepts(w));
  }
  // Walks with max_tokens at the minimum and just above it always finish.
  std::mt19937 rng(9);
  int walks = 0;
  for (const OutputGrammar* g : {choice.get(), labels.get(), call.get(), object.get()})
    for (int extra = 0; extra < 3; ++extra) {
      const int64_t max_tokens = g->min_tokens() + extra;
      const std::vector<int64_t> out = masked_walk(*g, max_tokens, rng, "{[\"0tn,:pq", "", [&](const std::vector<int64_t>& o) {
        CHECK(g->completion_length(o) <= max_tokens - int64_t(o.size()));
      });
      CAPTURE(text(out));
      REQUIRE(out.back() == phi4mm::kEnd);
      CHECK(int64_t(out.size()) <= max_tokens);
      CHECK(g->completion(out).empty());
      ++walks;
    }
  CHECK(walks == 12);
  // The mask at the tightest budget lets exactly the fitting ids through.
  std::vector<float> logits(static_cast<size_t>(kVocab));
  std::normal_distribution<float> nd;
  for (float& x : logits) x = nd(rng);
  for (const At& at : {At{labels.get(), ""}, At{labels.get(), "pos"}, At{object.get(), "{\"x\": \"abc"},
                       At{call.get(), kCall + "add\", \"arguments\": {\"k\": 12"}}) {
    CAPTURE(at.prefix);
    const std::vector<int64_t> v = ids(at.prefix);
    const int64_t need = at.g->completion_length(v);
    for (int64_t remaining : {need, need + 1}) {
      CAPTURE(remaining);
      std::vector<float> w;
      const MaskCheck m = check_mask(*at.g, v, remaining, logits, w);
      CHECK(m.wrong == 0);
      CHECK(m.allowed > 0);
    }
  }
}

TEST_CASE("serve/grammar a completion over 4096 bytes counts a token per byte until it is short enough to spell") {
  const auto g = OutputGrammar::json_schema(
      bytes(), JsonSchema::compile(nlohmann::ordered_json::parse(
                   R"({"type": "object", "properties": {"s": {"type": "string", "minLength": 4200}}, "required": ["s"]})")));
  CHECK(g->min_tokens() == 4209);  // {"s":" 4200 a "} <|end|>
  std::vector<int64_t> v;
  for (char c : std::string("{\"s\":\"")) v.push_back(bytes()->byte_token(uint8_t(c)));
  const std::vector<int64_t> c = g->completion(v);
  CHECK(c.size() == 4203);
  CHECK(c[0] == bytes()->byte_token('a'));
  // Each completion's first token: the count falls by one per token while
  // counted in bytes, and to the spelled count once at most 4096 are left.
  int64_t left = g->completion_length(v);
  CHECK(left == 4203);
  int64_t as = 0;
  for (int k = 0; k < 120; ++k) {
    const std::vector<int64_t> ck = g->completion(v);
    CHECK(int64_t(ck.size()) == left);
    v.push_back(ck[0]);
    as += int64_t(bytes()->bytes(ck[0]).size());
    const int64_t now = g->completion_length(v);
    if (k != 106) CHECK(now == left - 1);
    else CHECK(now < left - 1000);  // 4096 units left: spelled
    left = now;
  }
  CHECK(as > 120);
  CHECK(text(g->completion(v)) == std::string(size_t(4200 - as), 'a') + "\"}<|end|>");
}

TEST_CASE("serve/grammar the state caches: a state met again, or an output that extends another, masks as a fresh grammar") {
  // Each grammar keeps the masks of the states it met (per state, with the
  // budget from which all their ids fit) and the states after the outputs it
  // masked. One grammar object masks two outputs' prefixes interleaved, then
  // shorter ones again; a new object (empty caches) must give the same mask
  // at every prefix, over logits with masked and NaN entries, at a loose and
  // the tightest budgets.
  struct G {
    const char* name;
    std::function<std::shared_ptr<const OutputGrammar>()> make;
    std::string favoured;
  };
  const std::string schema = R"({"type": "object", "properties": {"name": {"type": "string", "minLength": 2,
      "maxLength": 12}, "n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["name", "n"]})";
  const std::vector<G> grammars = {
      {"json_object", [] { return OutputGrammar::json_object(bytes()); }, "{\"a:, "},
      {"json_schema", [&] { return OutputGrammar::json_schema(bytes(), JsonSchema::compile(nlohmann::ordered_json::parse(schema))); }, "\"ab1[,"},
      {"regex", [] { return OutputGrammar::regex(bytes(), Regex::compile("[A-Z][^\\n]*\\.")); }, "Ab c"},
      {"tool_call", [] { return OutputGrammar::tool_call(bytes(), {"add", "get_weather"}); }, "{\"a1,"},
  };
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> logits(static_cast<size_t>(kVocab));
  for (float& x : logits) x = 3.0f * nd(rng);
  for (int64_t id = 0; id < kVocab; id += 97) logits[size_t(id)] = -std::numeric_limits<float>::infinity();
  for (int64_t id = 13; id < kVocab; id += 389) logits[size_t(id)] = std::numeric_limits<float>::quiet_NaN();
  for (const G& gr : grammars) {
    CAPTURE(gr.name);
    const auto walker = gr.make();
    std::vector<std::vector<int64_t>> outs;
    for (int w = 0; w < 2; ++w)
      outs.push_back(masked_walk(*walker, walker->min_tokens() + 12, rng, gr.favoured, "", [](const std::vector<int64_t>&) {}));
    std::vector<std::vector<int64_t>> prefixes;
    for (size_t k = 0; k < std::max(outs[0].size(), outs[1].size()); ++k)
      for (const auto& o : outs)
        if (k < o.size()) prefixes.emplace_back(o.begin(), o.begin() + int64_t(k));
    for (size_t k = 0; k < outs[0].size(); k += 3) prefixes.emplace_back(outs[0].begin(), outs[0].begin() + int64_t(k));
    const auto shared = gr.make();
    int64_t checked = 0;
    for (const auto& p : prefixes) {
      CAPTURE(text(p));
      const int64_t need = walker->completion_length(p);
      for (int64_t remaining : {need, need + 1, int64_t(1000), int64_t(1000)}) {
        std::vector<float> a = logits, b = logits;
        shared->mask(p, remaining, a.data(), kVocab);
        gr.make()->mask(p, remaining, b.data(), kVocab);
        int64_t differ = 0;
        for (int64_t id = 0; id < kVocab; ++id)
          differ += std::memcmp(&a[size_t(id)], &b[size_t(id)], sizeof(float)) != 0;
        CHECK(differ == 0);
        ++checked;
      }
    }
    CHECK(checked >= 40);
  }
}
