// JSON Schema constrained decoding (serve/json_schema.h, serve/grammar.h):
// the compiler's refusals (each names the path and keyword), the language of
// a schema byte by byte over the real tokenizer, the shortest completion of
// mid-way states and its length from the tables, the mask's exact rule at a
// schema state, and random walks through the mask that always end within
// max_tokens in an instance a validator written here from the JSON Schema
// rules accepts, with the properties in the schema's order.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/grammar.h"
#include "serve/json_schema.h"
#include "serve/openai.h"
#include "tests/serve/grammar_tokens.h"

using namespace areno;
using namespace areno::serve;
using namespace areno::serve::testing;
using ojson = nlohmann::ordered_json;

namespace {

// One byte per token: every prefix of the text is a state.
std::vector<int64_t> byte_ids(const std::string& s) {
  std::vector<int64_t> out;
  for (unsigned char c : s) out.push_back(bytes()->byte_token(c));
  return out;
}

size_t code_points(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

// A validator for the subset, written from the JSON Schema rules (recursive:
// test code on fixed schemas). Also checks that an object's keys come in the
// schema's order.
bool valid(const ojson& v, const ojson& s, const ojson& root, std::string& why, const std::string& at = "$") {
  auto fail = [&](const std::string& w) {
    why = at + ": " + w;
    return false;
  };
  if (s.is_boolean()) return s.get<bool>() || fail("false schema");
  if (s.contains("$ref")) return valid(v, root.at(ojson::json_pointer(s["$ref"].get<std::string>().substr(1))), root, why, at);
  if (s.contains("allOf")) return valid(v, s["allOf"][0], root, why, at);
  for (const char* k : {"anyOf", "oneOf"})
    if (s.contains(k)) {
      int matches = 0;
      std::string w;
      for (const ojson& a : s[k]) matches += valid(v, a, root, w, at);
      return matches == 1 || fail(fmt::format("{} of {} match", matches, k));
    }
  if (s.contains("const")) return v == s["const"] || fail("not the const");
  if (s.contains("enum")) {
    for (const ojson& e : s["enum"])
      if (e == v) return true;
    return fail("not in the enum");
  }
  if (s.contains("type") && s["type"].is_array()) {
    for (const ojson& t : s["type"]) {
      ojson one = s;
      one["type"] = t;
      std::string w;
      if (valid(v, one, root, w, at)) return true;
    }
    return fail("no type of the list");
  }
  std::string type = s.value("type", "");
  if (type.empty()) {
    if (s.contains("properties") || s.contains("additionalProperties")) type = "object";
    else if (s.contains("items") || s.contains("prefixItems")) type = "array";
    else return true;
  }
  if (type == "null") return v.is_null() || fail("not null");
  if (type == "boolean") return v.is_boolean() || fail("not a boolean");
  if (type == "number" || type == "integer") {
    if (!v.is_number()) return fail("not a number");
    if (type == "integer" && !v.is_number_integer()) return fail("not an integer");
    const double x = v.get<double>();
    if ((s.contains("minimum") && x < s["minimum"].get<double>()) || (s.contains("maximum") && x > s["maximum"].get<double>()) ||
        (s.contains("exclusiveMinimum") && x <= s["exclusiveMinimum"].get<double>()) ||
        (s.contains("exclusiveMaximum") && x >= s["exclusiveMaximum"].get<double>()))
      return fail("out of range");
    if (s.contains("multipleOf")) {
      const double q = x / s["multipleOf"].get<double>();
      if (std::fabs(q - std::round(q)) > 1e-9 * std::max(1.0, std::fabs(q))) return fail("not a multiple");
    }
    return true;
  }
  if (type == "string") {
    if (!v.is_string()) return fail("not a string");
    const size_t n = code_points(v.get<std::string>());
    if (s.contains("minLength") && n < s["minLength"].get<size_t>()) return fail("too short");
    if (s.contains("maxLength") && n > s["maxLength"].get<size_t>()) return fail("too long");
    const std::string& t = v.get_ref<const std::string&>();
    if (s.contains("pattern") && !std::regex_search(t, std::regex(s["pattern"].get<std::string>(), std::regex::ECMAScript)))
      return fail("no match of the pattern");
    if (s.contains("format")) {
      const std::string f = s["format"];
      int y, mo, d;
      unsigned a[4];
      char tail;
      if (f == "date" && !(std::sscanf(t.c_str(), "%4d-%2d-%2d%c", &y, &mo, &d, &tail) == 3 && t.size() == 10 && mo >= 1 &&
                           mo <= 12 && d >= 1 && d <= 31))
        return fail("not a date");
      if (f == "uuid" && !(t.size() == 36 && t[8] == '-' && t[13] == '-' && t[18] == '-' && t[23] == '-' &&
                           std::count_if(t.begin(), t.end(), [](char c) { return std::isxdigit(uint8_t(c)); }) == 32))
        return fail("not a uuid");
      if (f == "email" && !(t.find('@') != std::string::npos && t.find('@') > 0 && t.find('.', t.find('@')) != std::string::npos &&
                            t.back() != '.'))
        return fail("not an email address");
      if (f == "ipv4" && !(std::sscanf(t.c_str(), "%u.%u.%u.%u%c", &a[0], &a[1], &a[2], &a[3], &tail) == 4 &&
                           *std::max_element(a, a + 4) <= 255))
        return fail("not an IPv4 address");
    }
    return true;
  }
  if (type == "array") {
    if (!v.is_array()) return fail("not an array");
    if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return fail("too few items");
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return fail("too many items");
    const size_t prefix = s.contains("prefixItems") ? s["prefixItems"].size() : 0;
    for (size_t i = 0; i < v.size(); ++i) {
      const ojson& item = i < prefix ? s["prefixItems"][i] : s.value("items", ojson(true));
      if (!valid(v[i], item, root, why, fmt::format("{}[{}]", at, i))) return false;
    }
    return true;
  }
  if (!v.is_object()) return fail("not an object");
  const ojson props = s.value("properties", ojson::object());
  for (const ojson& r : s.value("required", ojson::array()))
    if (!v.contains(r.get<std::string>())) return fail("missing " + r.get<std::string>());
  std::vector<std::string> order;
  for (auto it = props.begin(); it != props.end(); ++it) order.push_back(it.key());
  size_t last = 0;
  for (auto it = v.begin(); it != v.end(); ++it) {
    const auto p = std::find(order.begin(), order.end(), it.key());
    if (p != order.end()) {
      if (size_t(p - order.begin()) < last) return fail("keys out of the schema's order");
      last = size_t(p - order.begin()) + 1;
      if (!valid(it.value(), props[it.key()], root, why, at + "." + it.key())) return false;
    } else if (s.contains("additionalProperties") && !(s["additionalProperties"].is_boolean())) {
      if (!valid(it.value(), s["additionalProperties"], root, why, at + "." + it.key())) return false;
    } else if (!props.empty() || (s.contains("additionalProperties") && s["additionalProperties"] == false)) {
      return fail("unexpected key " + it.key());
    }
  }
  return true;
}

// A Pydantic-like schema: $defs and $ref, an enum, Optional (anyOf with
// null), arrays with bounds, bounded strings, integer, number, boolean, a map.
const ojson& person_schema() {
  static const ojson s = ojson::parse(R"({
    "title": "Person",
    "type": "object",
    "properties": {
      "name": {"type": "string", "minLength": 2, "maxLength": 8, "description": "first name"},
      "age": {"type": "integer"},
      "mood": {"enum": ["happy", "sad", 3, null]},
      "email": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null},
      "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
      "address": {"$ref": "#/$defs/Address"},
      "score": {"type": ["number", "null"]},
      "extra": {"type": "object", "additionalProperties": {"type": "boolean"}}
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": false,
    "$defs": {
      "Address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                  "required": ["city"]}
    }
  })");
  return s;
}

// Logits of the whole vocabulary drawn from a standard normal.
std::vector<float> normal_logits(std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> logits(static_cast<size_t>(kVocab));
  for (float& x : logits) x = nd(rng);
  return logits;
}

// The mask's rule (check_mask) after each prefix, with the completion's
// token count plus each of `extra` tokens left: exact, and something allowed.
void check_masks(const OutputGrammar& g, const std::vector<std::string>& prefixes, std::initializer_list<int64_t> extra,
                 const std::vector<float>& logits) {
  for (const std::string& prefix : prefixes) {
    CAPTURE(prefix);
    check_masks_after(g, ids(prefix), extra, logits);
  }
}

// `walks` masked walks with max_tokens the shortest output's count plus
// `step` more each time (the characters of `favoured` raised): each ends in
// <|end|> within max_tokens, every step's completion fits the tokens left,
// and the output is an instance of `schema` by the validator above.
void walks_valid(const OutputGrammar& g, const ojson& schema, int walks, int64_t step, std::mt19937& rng,
                 const std::string& favoured) {
  for (int walk = 0; walk < walks; ++walk) {
    const std::string t = checked_walk(g, g.min_tokens() + int64_t(walk) * step, rng, favoured);
    CAPTURE(t);
    std::string why;
    CHECK_MESSAGE(valid(ojson::parse(t), schema, schema, why), why);
  }
}

}  // namespace

TEST_CASE("serve/json_schema compile: what it refuses, by path and keyword") {
  struct Bad {
    const char* schema;
    const char* says;
  };
  for (const Bad& b : {
           Bad{R"J({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}})J", "'pattern': lookahead"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "string", "format": "uri"}}})", "#/properties/a: 'format' 'uri' is not supported"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a|b$"}}})", "top-level '|'"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a\"$"}}})", "JSON escapes"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 40000}}})",
               "'pattern' with 'minLength' / 'maxLength': the pattern within the length bounds needs more than"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{5}$", "maxLength": 3}}})",
               "matches no string within the length bounds"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "string", "pattern": "x", "format": "date"}}})", "together"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "string", "pattern": 5}}})", "must be a string"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 4}}})", "#/properties/a: the range holds no integer"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "integer", "minimum": 4.5, "maximum": 4.9}}})", "holds no integer"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "number", "minimum": 1e17}}})", "holds no number of at most 16"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "number", "exclusiveMaximum": -9999999999999999.9999999999999999}}})", "holds no number"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "integer", "minimum": "0", "maximum": 4}}})", "'minimum' must be a finite number"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "number", "minimum": 0, "exclusiveMinimum": true}}})", "'exclusiveMinimum' must be a finite number"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "string", "minimum": 0}}})", "'minimum' does not apply to type 'string'"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "number", "not": {"const": 1}}}})", "'not'"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0}}})", "#/properties/a: 'multipleOf' must be a number greater than 0"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": -2}}})", "greater than 0"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": "3"}}})", "greater than 0"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 1e13}}})", "'multipleOf' 10000000000000.0 needs a divisor above 10^12"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 6}}})",
               "#/properties/a: 'multipleOf': no number it matches is such a multiple"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 99991}}})",
               "'multipleOf': the multiples need more than 32767 automaton states"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": true}}})", "#/properties/a: the keyword 'uniqueItems' is not supported"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "array", "prefixItems": {}}}})", "'prefixItems' must be an array"},
           Bad{R"({"type": "object", "properties": {"a": {"prefixItems": [{}, {}], "items": false, "minItems": 3}}})",
               "'minItems' 3 exceeds the 2 'prefixItems'"},
           Bad{R"({"type": "object", "properties": {"a": {"prefixItems": [{"type": "string"}, {"type": "nul"}]}}})",
               "#/properties/a/prefixItems/1: unknown type"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "string", "properties": {}}}})", "does not apply"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "strin"}}})", "unknown type"},
           Bad{R"({"type": "object", "properties": {"a": {"$ref": "http://x/y.json"}}})", "only references inside"},
           Bad{R"({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}})", "does not resolve"},
           Bad{R"({"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}}, "$defs": {"b": {"$ref": "#/$defs/b"}}})",
               "refers to itself"},
           Bad{R"({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"enum": ["x"]}]}}})",
               "begin with '\"'"},
           Bad{R"({"type": "object", "properties": {"a": {"anyOf": [{"type": "object"}, {"type": "object"}]}}})",
               "first character"},
           Bad{R"({"type": "array"})", "root must be an object"},
           Bad{R"({"anyOf": [{"type": "object"}, {"type": "null"}]})", "root must be an object"},
           Bad{R"({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]})", "no finite instance"},
           Bad{R"({"type": "object", "properties": {"a": {}}, "additionalProperties": true})", "beside 'properties'"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}}})",
               "exceeds"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "array", "maxItems": 70000}}})", "0 to 65535"},
           Bad{R"({"type": "object", "properties": {"a": false}})", "no instance"},
           Bad{R"({"type": "object", "required": ["a"]})", "not in 'properties'"},
           Bad{R"({"type": "object", "properties": {"a": {"allOf": [{}, {}]}}})", "exactly one"},
           Bad{R"({"type": "object", "properties": {"a": {"type": "string", "anyOf": [{}]}}})", "beside 'anyOf'"},
           Bad{R"({"type": "object", "properties": {"a": 3}})", "must be an object or a boolean"},
       }) {
    CAPTURE(b.schema);
    try {
      JsonSchema::compile(ojson::parse(b.schema));
      FAIL("compiled");
    } catch (const std::invalid_argument& e) {
      CHECK_MESSAGE(std::string(e.what()).find(b.says) != std::string::npos, std::string(e.what()));
    }
  }
  // 63 optional properties in a row are the most; a required one resets the run.
  ojson many = {{"type", "object"}, {"properties", ojson::object()}};
  for (int i = 0; i < 64; ++i) many["properties"][fmt::format("p{}", i)] = {{"type", "integer"}};
  CHECK_THROWS_WITH_AS(JsonSchema::compile(many), doctest::Contains("optional properties in a row"), std::invalid_argument);
  many["required"] = {"p40"};
  CHECK_NOTHROW(JsonSchema::compile(many));
  // Deep required nesting past kMaxDepth has no output.
  ojson deep = {{"type", "object"}};
  for (int i = 0; i < JsonSchema::kMaxDepth; ++i)
    deep = {{"type", "object"}, {"properties", {{"a", deep}}}, {"required", {"a"}}};
  CHECK_THROWS_WITH_AS(JsonSchema::compile(deep), doctest::Contains("deeper than"), std::invalid_argument);
  // Annotations are ignored; `{}` and `true` are any value; a type list is a union.
  const auto s = JsonSchema::compile(ojson::parse(
      R"({"type": "object", "title": "t", "$schema": "x", "properties": {"a": {}, "b": true, "c": {"type": ["integer", "number", "string"]}}})"));
  CHECK(s->node(s->root()).keys.size() == 3);
}

TEST_CASE("serve/json_schema the language of a schema, byte by byte") {
  const auto g = OutputGrammar::json_schema(bytes(), JsonSchema::compile(person_schema()));
  CHECK(text(g->completion({})) == R"({"name":"aa","age":0,"tags":[""],"address":{"city":""}}<|end|>)");
  CHECK(g->min_tokens() == int64_t(g->completion({}).size()));
  for (const std::string& good : std::vector<std::string>{
           R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "Oslo"}})",
           R"({"name":"Émile","age":-12,"mood":"happy","email":null,"tags":["x","yz","ẞ"],"address":{"city":"","zip":7},"score":1.5e3,"extra":{"a":true,"b":false}})",
           R"({ "name" : "\u00e9\"x" , "age" : 0, "mood": 3, "email": "a@b", "tags": ["\n"], "address": {"city": "x"}, "score": null, "extra": {} })",
           R"({"name":"12345678","age":1,"mood":null,"tags":["a","b","c"],"address":{"city":"c"}})",
           // Pretty-printed: newlines then indentation; 16 digits.
           "{\n  \"name\": \"Al\",\n\n\t\"age\": 1234567890123456,\n  \"tags\": [\n    \"a\"\n  ],"
           "\n  \"address\": {\"city\": \"x\"}, \"score\": -0.1234567890123456e-99\n}",
       }) {
    CAPTURE(good);
    std::string why;
    REQUIRE(valid(ojson::parse(good), person_schema(), person_schema(), why));
    const std::vector<int64_t> v = ids(good + "<|end|>");
    CHECK(g->accepts(v));
    CHECK(g->completion(v).empty());
  }
  for (const std::string& bad : std::vector<std::string>{
           R"({"age": 3)",                                  // a required property skipped
           R"({"name": "Al"})",                             // closed before the required ones
           R"({"name": "Al", "age": 3, "tags": ["a"], "address": {})",
           R"({})",
           R"({"name": "A")",                               // minLength 2
           R"({"name": "123456789)",                        // maxLength 8
           R"({"name": "Al", "age": 3.5)",                  // integer
           R"({"name": "Al", "age": 3e2)",
           R"({"name": "Al", "age": 3, "mood": "hap ")",    // not in the enum
           R"({"name": "Al", "age": 3, "mood": 4)",
           R"({"name": "Al", "age": 3, "tags": [])",        // minItems 1
           R"({"name": "Al", "age": 3, "tags": ["a", "b", "c", )",  // maxItems 3
           R"({"name": "Al", "age": 3, "tags": ["abcd)",   // items' maxLength 3
           R"({"name": "Al", "tags": )",                    // age is required before tags
           R"({"age": 3, "name": )",                        // out of the schema's order
           R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "x"}, "zzz)",  // no additional ones
           R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"zip": 1)",           // city required
           R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "x"}, "extra": {"a": 1)",  // map of booleans
           R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "x"}, "score": "1")",
           R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "x"}})",  // then only <|end|>
           // Whitespace is bounded: one space, or up to two newlines then up to 20 spaces or tabs.
           R"({"name":  )", "{\"name\":\n\n\n", "{\"name\": \n", "{\"name\":\n \n", "{\"name\":\r",
           "{\"name\":\t", "{\"name\":\n" + std::string(21, ' '),
           // Digits are bounded: 16 before and after the point, 2 in the exponent.
           R"({"name": "Al", "age": 12345678901234567)", R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "x"}, "score": 1e100)",
           R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "x"}, "score": 0.12345678901234567)",
           // Strings are well-formed UTF-8 with no lone surrogate escapes.
           "{\"name\": \"a\xff", "{\"name\": \"a\xc0\x80", "{\"name\": \"a\xed\xa0\x80", R"({"name": "\ud800)",
           R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "x"}})",
       }) {
    CAPTURE(bad);
    CHECK_FALSE(g->accepts(byte_ids(bad + (bad.back() == '}' ? std::string(" ") : std::string()))));
  }
  // Shortest completions half way, and their lengths from the tables.
  struct Mid {
    std::string prefix, rest;
  };
  for (const Mid& m : {
           Mid{R"({"na)", R"(me":"aa","age":0,"tags":[""],"address":{"city":""}})"},
           Mid{R"({"name": "Al", )", R"("age":0,"tags":[""],"address":{"city":""}})"},
           Mid{R"({"name": "Al", "age": 3, )", R"("tags":[""],"address":{"city":""}})"},
           Mid{R"({"name": "Al", "age": 3, "m)", R"(ood":3,"tags":[""],"address":{"city":""}})"},
           Mid{R"({"name": "Al", "age": 3, "mood": "h)", R"(appy","tags":[""],"address":{"city":""}})"},
           Mid{R"({"name": "Al", "age": 3, "e)", R"(mail":"","tags":[""],"address":{"city":""}})"},
           Mid{R"({"name": "Al", "age": 3, "tags": ["a", )", R"(""],"address":{"city":""}})"},
           Mid{R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "x", )", R"("zip":0}})"},
           Mid{R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "x"}, "extra": {"k)", R"(":true}})"},
           Mid{R"({"name": "Al", "age": 3, "tags": ["a"], "address": {"city": "x"}, "extra": {)", R"(}})"},
           Mid{R"({"name": "A)", R"(a","age":0,"tags":[""],"address":{"city":""}})"},
           Mid{R"({"name": "\u00)", R"(00a","age":0,"tags":[""],"address":{"city":""}})"},
       }) {
    CAPTURE(m.prefix);
    const std::vector<int64_t> v = ids(m.prefix);
    REQUIRE(g->accepts(v));
    const std::vector<int64_t> c = g->completion(v);
    CHECK(text(c) == m.rest + "<|end|>");
    CHECK(g->completion_length(v) == int64_t(c.size()));
    std::vector<int64_t> whole = v;
    whole.insert(whole.end(), c.begin(), c.end());
    CHECK(g->accepts(whole));
    CHECK(g->completion(whole).empty());
  }
  // Every byte prefix of a long instance: the tables' length is the completion's.
  const std::string inst =
      R"({"name":"Zoë \"Z\"","age":41,"mood":"sad","email":"z@x","tags":["a","\t"],"address":{"city":"Rome","zip":1},"score":-0.5,"extra":{"on":true}})";
  const std::vector<int64_t> all = byte_ids(inst);
  for (size_t i = 0; i <= all.size(); ++i) {
    const std::span<const int64_t> p(all.data(), i);
    CAPTURE(inst.substr(0, i));
    REQUIRE(g->accepts(p));
    CHECK(g->completion_length(p) == int64_t(g->completion(p).size()));
  }
}

TEST_CASE("serve/json_schema mask: allowed exactly when the output stays an instance's prefix that fits") {
  const auto g = OutputGrammar::json_schema(bytes(), JsonSchema::compile(person_schema()));
  std::mt19937 rng(5);
  const std::vector<float> logits = normal_logits(rng);
  check_masks(*g,
              {R"({"name": "Al", "age": 3, )", R"({"name": "A)", R"({"name": "Al", "age": 3, "mood": )", R"({"name": "Al)"},
              {0, 6}, logits);
}

TEST_CASE("serve/json_schema random walks end in an instance within max_tokens") {
  const ojson tree = ojson::parse(R"({
    "type": "object",
    "properties": {"label": {"type": "string", "maxLength": 4}, "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
                   "n": {"type": "integer"}, "kind": {"enum": ["leaf", "node", {"x": [1, 2]}]}},
    "required": ["label", "kind"]
  })");
  std::mt19937 rng(11);
  int walks = 0;
  for (const ojson* schema : {&person_schema(), &tree}) {
    const auto g = OutputGrammar::json_schema(bytes(), JsonSchema::compile(*schema));
    for (int walk = 0; walk < 5; ++walk) {
      const int64_t max_tokens = g->min_tokens() + int64_t(walk) * 15;
      // Favour structure, so walks nest and take optional parts; odd walks also try to close early.
      const std::vector<int64_t> out =
          masked_walk(*g, max_tokens, rng, "{[\",:0tnlk", walk % 2 ? "}]" : "", [&](const std::vector<int64_t>& o) {
            CHECK(g->completion_length(o) <= max_tokens - int64_t(o.size()));
          });
      const std::string s = text(out);
      CAPTURE(s);
      REQUIRE(out.back() == phi4mm::kEnd);
      CHECK(int64_t(out.size()) <= max_tokens);
      std::string why;
      CHECK_MESSAGE(valid(ojson::parse(s.substr(0, s.size() - 7)), *schema, *schema, why), why);
      ++walks;
    }
  }
  CHECK(walks == 10);
}

TEST_CASE("serve/json_schema a forced call's arguments follow the chosen tool's parameters") {
  const auto add = JsonSchema::compile(ojson::parse(
      R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]})"));
  const auto none = JsonSchema::compile(ojson::parse(R"({"type": "object", "properties": {}})"));
  const auto g = OutputGrammar::tool_call(bytes(), {"add", "now_please"}, {add, none});
  const std::string call = "<|tool_call|>[{\"name\": \"";
  const std::string end = "}]<|/tool_call|><|end|>";
  // The shortest call weighs the name with its arguments: the longer name wins.
  CHECK(text(g->completion({})) == call + "now_please\", \"arguments\": {}" + end);
  CHECK(g->accepts(ids(call + "add\", \"arguments\": {\"a\": 2, \"b\": -3}" + end)));
  CHECK_FALSE(g->accepts(ids(call + "add\", \"arguments\": {}")));
  CHECK_FALSE(g->accepts(ids(call + "add\", \"arguments\": {\"a\": 2.5")));
  CHECK_FALSE(g->accepts(ids(call + "now_please\", \"arguments\": {\"")));
  CHECK(text(g->completion(ids(call + "add\", \"arguments\": {\"a\": 2"))) == ",\"b\":0}" + end);
  CHECK(g->completion_length(ids(call + "a")) == int64_t(g->completion(ids(call + "a")).size()));
}

TEST_CASE("serve/json_schema the API: response_format json_schema and forced tools' parameters") {
  using nlohmann::json;
  const std::string body = R"({"messages": [{"role": "user", "content": "hi"}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "r", "strict": true,
      "schema": {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}, "required": ["z", "a"]}}}})";
  ApiRequest r = parse_chat_request(json::parse(body), ApiLimits{});
  CHECK(r.schema_field == "response_format.json_schema.schema");
  CHECK(r.constraint_field == "response_format");
  compile_output_schemas(parse_ordered_json_bounded(body, 64), r);
  REQUIRE(r.output_schema);
  // Written order, not sorted order.
  CHECK(r.output_schema->node(r.output_schema->root()).minimal == R"({"z":0,"a":""})");
  auto refused = [](const std::string& b, const std::string& param, const std::string& says) {
    CAPTURE(b);
    try {
      ApiRequest x = parse_chat_request(json::parse(b), ApiLimits{});
      compile_output_schemas(parse_ordered_json_bounded(b, 64), x);
      FAIL("accepted");
    } catch (const ApiError& e) {
      CHECK(e.status == 400);
      CHECK(e.param == param);
      CHECK_MESSAGE(std::string(e.what()).find(says) != std::string::npos, e.what());
    }
  };
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  refused("{" + msgs + R"(, "response_format": {"type": "json_schema"}})", "response_format.json_schema", "needs");
  refused("{" + msgs + R"(, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}})",
          "response_format.json_schema.name", "1 to 64");
  refused("{" + msgs + R"(, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})",
          "response_format.json_schema.schema", "must be a JSON schema");
  refused("{" + msgs +
              R"(, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"p": {"type": "string", "pattern": "a{,2}"}}}}}})",
          "response_format.json_schema.schema", "'pattern'");
  refused("{" + msgs + R"(, "response_format": {"type": "xml"}})", "response_format", "not supported");
  const std::string tools =
      R"("tools": [{"type": "function", "function": {"name": "f"}},
                   {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {"x": {"type": "number", "not": {"const": 3}}}}}}])";
  // A schema outside the subset: a 400 for a strict function, any object otherwise.
  const std::string strict_tools =
      R"("tools": [{"type": "function", "function": {"name": "f"}},
                   {"type": "function", "function": {"name": "g", "strict": true, "parameters": {"type": "object", "properties": {"x": {"type": "number", "not": {"const": 3}}}}}}])";
  refused("{" + msgs + ", " + strict_tools + R"(, "tool_choice": "required"})", "tools[1].function.parameters", "'not'");
  const std::string loose = "{" + msgs + ", " + tools + R"(, "tool_choice": "required"})";
  ApiRequest l = parse_chat_request(json::parse(loose), ApiLimits{});
  compile_output_schemas(parse_ordered_json_bounded(loose, 64), l);
  REQUIRE(l.forced_schemas.size() == 2);
  CHECK(l.forced_schemas[0] != nullptr);
  CHECK(l.forced_schemas[1] == nullptr);
  // Named: only that tool's schema is compiled; no parameters means no arguments.
  const std::string named = "{" + msgs + ", " + tools + R"(, "tool_choice": {"type": "function", "function": {"name": "f"}}})";
  ApiRequest n = parse_chat_request(json::parse(named), ApiLimits{});
  compile_output_schemas(parse_ordered_json_bounded(named, 64), n);
  REQUIRE(n.forced_schemas.size() == 1);
  CHECK(n.forced_schemas[0]->node(n.forced_schemas[0]->root()).minimal == "{}");
  CHECK(n.forced_schemas[0]->node(n.forced_schemas[0]->root()).kind == JsonSchema::Node::object);
  refused("{" + msgs + ", " + tools +
              R"(, "tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})",
          "tool_choice", "both constrain the output");
  // A request's forced tools together compile at most kMaxRequestNodes nodes.
  {
    json big = {{"type", "object"}, {"properties", json::object()}, {"required", json::array()}};
    for (int i = 0; i < 1000; ++i) {
      big["properties"][fmt::format("p{}", i)] = {{"type", "integer"}};
      big["required"].push_back(fmt::format("p{}", i));
    }
    json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"tool_choice", "required"}, {"tools", json::array()}};
    for (int t = 0; t < 17; ++t)
      body["tools"].push_back({{"type", "function"}, {"function", {{"name", fmt::format("f{}", t)}, {"parameters", big}}}});
    refused(body.dump(), "tools[16].function.parameters", "more than 16384 nodes together");
    body["tools"].erase(16);
    ApiRequest ok = parse_chat_request(body, ApiLimits{});
    compile_output_schemas(parse_ordered_json_bounded(body.dump(), 64), ok);
    CHECK(ok.forced_schemas.size() == 16);
  }
  // vLLM's fields: guided_json (an object or its JSON text), guided_choice,
  // structured_outputs; regular expressions and grammars refused by name.
  const std::string guided = "{" + msgs + R"(, "guided_json": "{\"type\": \"object\", \"properties\": {\"b\": {\"type\": \"integer\"}, \"a\": {\"type\": \"null\"}}, \"required\": [\"b\", \"a\"]}"})";
  ApiRequest gj = parse_chat_request(json::parse(guided), ApiLimits{});
  compile_output_schemas(parse_ordered_json_bounded(guided, 64), gj);
  CHECK(gj.constraint_field == "guided_json");
  CHECK(gj.output_schema->node(gj.output_schema->root()).minimal == R"({"b":0,"a":null})");
  const std::string so = R"({"prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}})";
  ApiRequest sc = parse_completion_request(json::parse(so), ApiLimits{});
  CHECK(sc.choices == std::vector<std::string>{"yes", "no"});
  CHECK(sc.constraint_field == "structured_outputs");
  const std::string sr = R"({"prompt": "x", "structured_outputs": {"regex": "a+"}})";
  ApiRequest rx = parse_completion_request(json::parse(sr), ApiLimits{});
  CHECK((rx.has_regex && rx.regex == "a+"));
  CHECK(rx.constraint_field == "structured_outputs");
  ApiRequest gr = parse_chat_request(json::parse("{" + msgs + R"(, "guided_regex": ""})"), ApiLimits{});
  CHECK((gr.has_regex && gr.regex.empty() && gr.constraint_field == "guided_regex"));
  ApiRequest gg = parse_chat_request(json::parse("{" + msgs + R"(, "guided_grammar": "root ::= x"})"), ApiLimits{});
  CHECK((gg.has_grammar && gg.grammar == "root ::= x" && gg.constraint_field == "guided_grammar"));
  ApiRequest sg = parse_completion_request(json::parse(R"({"prompt": "x", "structured_outputs": {"grammar": "root ::= \"a\""}})"), ApiLimits{});
  CHECK((sg.has_grammar && sg.grammar == "root ::= \"a\"" && sg.constraint_field == "structured_outputs"));
  refused("{" + msgs + R"(, "guided_grammar": 5})", "guided_grammar", "must be a string");
  refused("{" + msgs + R"(, "guided_grammar": ")" + std::string(65537, 'a') + R"("})", "guided_grammar", "at most 65536 bytes");
  refused("{" + msgs + R"(, "guided_grammar": "root ::= x", "guided_regex": "a"})", "guided_regex", "both constrain");
  refused("{" + msgs + R"(, "structured_outputs": {"grammar": "root ::= x", "regex": "a"}})", "structured_outputs", "one of");
  refused("{" + msgs + R"(, "guided_whitespace_pattern": " "})", "guided_whitespace_pattern", "not supported");
  // llama.cpp's names for the same constraints.
  ApiRequest lg = parse_completion_request(json::parse(R"({"prompt": "x", "grammar": "root ::= \"a\""})"), ApiLimits{});
  CHECK((lg.has_grammar && lg.grammar == "root ::= \"a\"" && lg.constraint_field == "grammar"));
  ApiRequest ls = parse_chat_request(json::parse("{" + msgs + R"(, "json_schema": {"type": "object"}})"), ApiLimits{});
  CHECK((ls.schema_field == "json_schema" && ls.constraint_field == "json_schema"));
  refused("{" + msgs + R"(, "json_schema": "{}"})", "json_schema", "must be a JSON schema");
  refused("{" + msgs + R"(, "grammar": "root ::= x", "guided_choice": ["a"]})", "grammar", "both constrain");
  refused("{" + msgs + R"(, "guided_regex": 5})", "guided_regex", "must be a string");
  refused("{" + msgs + R"(, "guided_regex": ")" + std::string(4097, 'a') + R"("})", "guided_regex", "at most 4096 bytes");
  refused("{" + msgs + R"(, "guided_regex": "a", "guided_choice": ["a"]})", "guided_choice", "both constrain");
  refused("{" + msgs + R"(, "structured_outputs": {"regex": "a", "choice": ["a"]}})", "structured_outputs", "one of");
  refused("{" + msgs + R"(, "guided_choice": []})", "guided_choice", "1 to 64 strings");
  refused("{" + msgs + R"(, "guided_choice": ["a", ""]})", "guided_choice", "1 to 256 bytes");
  refused("{" + msgs + R"(, "guided_json": "{\"type\": \"object\", \"properties\": {\"p\": {\"format\": \"x\"}}}"})", "guided_json", "'format'");
  refused("{" + msgs + R"(, "guided_json": "{not json"})", "guided_json", "malformed JSON");
  refused("{" + msgs + R"(, "guided_json": {"type": "object"}, "guided_choice": ["a"]})", "guided_choice", "both constrain");
  refused("{" + msgs + R"(, "guided_choice": ["a"], "response_format": {"type": "json_object"}})", "response_format", "both constrain");
  refused("{" + msgs + R"(, "structured_outputs": {"json": {"type": "object"}, "choice": ["a"]}})", "structured_outputs", "one of");
}

TEST_CASE("serve/json_schema a choice among strings (guided_choice)") {
  const auto g = OutputGrammar::choice(bytes(), {"yes", "yes!", "no way", "é"});
  CHECK(text(g->completion({})) == "é<|end|>");  // two bytes, the shortest
  for (const std::string ok : {"yes", "yes!", "no way", "é"}) {
    CAPTURE(ok);
    CHECK(g->accepts(ids(ok + "<|end|>")));
    CHECK(g->completion(ids(ok + "<|end|>")).empty());
  }
  CHECK(text(g->completion(ids("yes"))) == "<|end|>");
  CHECK(text(g->completion(ids("no"))) == " way<|end|>");
  CHECK(g->completion_length(ids("no")) == int64_t(g->completion(ids("no")).size()));
  for (const std::string bad : {"ye<|end|>", "yes!!", "maybe", "no way<|end|>x", "<|end|>"}) {
    CAPTURE(bad);
    CHECK_FALSE(g->accepts(ids(bad)));
  }
  CHECK_THROWS_AS(OutputGrammar::choice(bytes(), {}), std::invalid_argument);
  CHECK_THROWS_AS(OutputGrammar::choice(bytes(), {""}), std::invalid_argument);
  // Walks end in one of the strings.
  std::mt19937 rng(2);
  for (int walk = 0; walk < 4; ++walk) {
    const std::vector<int64_t> out = masked_walk(*g, g->min_tokens() + walk, rng, "yn", "", [](const std::vector<int64_t>&) {});
    const std::string s = text(out);
    CAPTURE(s);
    CHECK((s == "yes<|end|>" || s == "yes!<|end|>" || s == "no way<|end|>" || s == "é<|end|>"));
  }
}

TEST_CASE("serve/json_schema pattern and format: strings a regular expression describes, written unescaped") {
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {
      "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
      "tag": {"type": "string", "pattern": "x\\d"},
      "day": {"type": "string", "format": "date"},
      "id": {"type": "string", "format": "uuid"},
      "mail": {"type": "string", "format": "email"},
      "ip": {"anyOf": [{"type": "string", "format": "ipv4"}, {"type": "null"}]},
      "when": {"type": "string", "format": "date-time"}},
    "required": ["code", "tag", "day", "id", "mail", "ip"]})");
  const auto g = OutputGrammar::json_schema(bytes(), JsonSchema::compile(schema));
  CHECK(text(g->completion({})) ==
        R"({"code":"AA-000","tag":"x0","day":"0000-01-01","id":"aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa","mail":"a@a.aa","ip":null}<|end|>)");
  CHECK(g->min_tokens() == int64_t(g->completion({}).size()));
  const std::string good =
      R"({"code": "AB-123", "tag": "see x1 here", "day": "2026-12-05", "id": "123e4567-E89B-12d3-a456-426614174000", "mail": "ada.l+x@example.co.uk", "ip": "192.168.0.255", "when": "2026-12-05T03:04:05.25+01:00"})";
  CHECK(g->accepts(ids(good + "<|end|>")));
  for (const std::string& bad :
       {std::string(R"({"code": "ab)"), std::string(R"({"code": "AB-1234)"), std::string(R"({"code": "AB-123", "tag": "abc")"),
        std::string(R"({"code": "AB-123", "tag": "x1\n)"), std::string(R"({"code": "AB-123", "tag": "x1", "day": "2026-13)"),
        std::string(R"({"code": "AB-123", "tag": "x1", "day": "2026-12-05", "id": "123e4567-")"),
        std::string(R"({"code": "AB-123", "tag": "x1", "day": "2026-12-05", "id": "123e4567-e89b-12d3-a456-426614174000", "mail": "a@b")"),
        std::string(R"({"code": "AB-123", "tag": "x1", "day": "2026-12-05", "id": "123e4567-e89b-12d3-a456-426614174000", "mail": "a@b.cc", "ip": "256)")}) {
    CAPTURE(bad);
    CHECK_FALSE(g->accepts(ids(bad)));
  }
  // Half-way states: the rest of the pattern's shortest match, then the rest.
  CHECK(text(g->completion(ids(R"({"code": "A)"))) ==
        R"(A-000","tag":"x0","day":"0000-01-01","id":"aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa","mail":"a@a.aa","ip":null}<|end|>)");
  CHECK(text(g->completion(ids(R"({"code": "AB-123", "tag": "yy)"))).substr(0, 4) == R"(x0",)");
  // The mask at the tightest budget inside a pattern, and walks that end in
  // instances a validator with std::regex accepts.
  std::mt19937 rng(21);
  const std::vector<float> logits = normal_logits(rng);
  check_masks(*g, {R"({"code": "A)", R"({"code": "AB-123", "tag": "x1", "day": "2026-1)"}, {0}, logits);
  walks_valid(*g, schema, 4, 12, rng, "0123456789-.@\"");
  // Strings of one pattern node side by side (array items): a token that
  // closes one and opens the next is not the same string's state.
  const ojson items = ojson::parse(R"({"type": "object", "properties": {"xs": {"type": "array",
      "items": {"type": "string", "pattern": "^a{1,3}$"}, "minItems": 3}}, "required": ["xs"]})");
  const auto gi = OutputGrammar::json_schema(bytes(), JsonSchema::compile(items));
  CHECK(text(gi->completion({})) == R"({"xs":["a","a","a"]}<|end|>)");
  check_masks(*gi, {R"({"xs": ["a)", R"({"xs": ["aa", "a)"}, {0}, logits);
  walks_valid(*gi, items, 3, 1, rng, "a\",");
  // Each distinct pattern compiles once; all of one schema share a work bound.
  ojson many = ojson::parse(R"({"type": "object", "properties": {}})");
  // (About half the work bound each: 10251 automaton states.)
  for (int i = 0; i < 40; ++i) many["properties"][fmt::format("p{}", i)] = {{"type", "string"}, {"pattern", "^\\w{0,200}(\\d{0,50})$"}};
  CHECK_NOTHROW(JsonSchema::compile(many));  // one pattern, forty times
  for (int i = 0; i < 40; ++i) many["properties"][fmt::format("p{}", i)]["pattern"] = fmt::format("^\\w{{0,200}}(\\d{{0,50}}){}$", i);
  try {
    JsonSchema::compile(many);
    FAIL("forty costly patterns compiled");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("too complex") != std::string::npos);
  }
}

TEST_CASE("serve/json_schema integer ranges: minimum / maximum and their exclusive forms, one-sided or both, any width") {
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {
      "age": {"type": "integer", "minimum": 0, "maximum": 120},
      "score": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
      "level": {"type": ["integer", "null"], "minimum": 10.5, "maximum": 12},
      "count": {"type": "integer", "minimum": 0},
      "rank": {"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"type": "null"}]},
      "year": {"type": "integer", "minimum": 1900},
      "debt": {"type": "integer", "maximum": -10}},
    "required": ["age", "score", "level", "count", "rank", "year", "debt"]})");
  const auto g = OutputGrammar::json_schema(bytes(), JsonSchema::compile(schema));
  CHECK(text(g->completion({})) ==
        R"({"age":0,"score":0,"level":11,"count":0,"rank":1,"year":1900,"debt":-10}<|end|>)");  // 11 is shorter than null
  const std::string tail = R"(, "year": 2024, "debt": -123456789012})";
  CHECK(g->accepts(ids(R"({"age": 120, "score": -2, "level": 11, "count": 0, "rank": 10)" + tail + "<|end|>")));
  CHECK(g->accepts(ids(R"({"age": 120, "score": -2, "level": 11, "count": 123456, "rank": null)" + tail + "<|end|>")));
  for (const std::string& bad : {std::string(R"({"age": 121)"), std::string(R"({"age": -1)"), std::string(R"({"age": 1.5)"),
                                 std::string(R"({"age": 7, "score": 3)"), std::string(R"({"age": 7, "score": -3)"),
                                 std::string(R"({"age": 7, "score": 0, "level": 10,)"), std::string(R"({"age": 7, "score": 0, "level": 13)"),
                                 std::string(R"({"age": 7, "score": 0, "level": 12, "count": -)"),
                                 std::string(R"({"age": 7, "score": 0, "level": 12, "count": 1, "rank": 0)"),
                                 std::string(R"({"age": 7, "score": 0, "level": 12, "count": 1, "rank": -)"),
                                 std::string(R"({"age": 7, "score": 0, "level": 12, "count": 1, "rank": 1, "year": 1899,)"),
                                 std::string(R"({"age": 7, "score": 0, "level": 12, "count": 1, "rank": 1, "year": 12345678901234567)"),
                                 std::string(R"({"age": 7, "score": 0, "level": 12, "count": 1, "rank": 1, "year": 2000, "debt": -9})"),
                                 std::string(R"({"age": 7, "score": 0, "level": 12, "count": 1, "rank": 1, "year": 2000, "debt": 0)")}) {
    CAPTURE(bad);
    CHECK_FALSE(g->accepts(ids(bad)));
  }
  std::mt19937 rng(31);
  walks_valid(*g, schema, 4, 6, rng, "0123456789-");
}

TEST_CASE("serve/json_schema number ranges: Pydantic's confloat, PositiveFloat and one-sided bounds, no exponent") {
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {
      "p": {"type": "number", "minimum": 0, "maximum": 1},
      "t": {"type": "number", "exclusiveMinimum": 0},
      "d": {"type": "number", "minimum": -0.5, "exclusiveMaximum": 0.25},
      "n": {"type": ["number", "null"], "maximum": -1e-05},
      "m": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "number", "exclusiveMaximum": 0}]}},
    "required": ["p", "t", "d", "n", "m"]})");
  const auto g = OutputGrammar::json_schema(bytes(), JsonSchema::compile(schema));
  CHECK(text(g->completion({})) == R"({"p":0,"t":1,"d":0,"n":-1,"m":0}<|end|>)");  // -1 is shorter than null
  CHECK(g->accepts(ids(R"({"p": 0.75, "t": 0.0001, "d": -0.5, "n": -0.00001, "m": -0.5}<|end|>)")));
  CHECK(g->accepts(ids(R"({"p": 1.0, "t": 12.5, "d": 0.2499999999999999, "n": -3, "m": 17}<|end|>)")));
  for (const std::string& bad : {std::string(R"({"p": 1.01)"), std::string(R"({"p": -0.1)"), std::string(R"({"p": 1e0)"),
                                 std::string(R"({"p": 0.5, "t": 0,)"), std::string(R"({"p": 0.5, "t": 0.0,)"),
                                 std::string(R"({"p": 0.5, "t": -1)"), std::string(R"({"p": 0.5, "t": 1, "d": 0.25,)"),
                                 std::string(R"({"p": 0.5, "t": 1, "d": -0.51)"),
                                 std::string(R"({"p": 0.5, "t": 1, "d": 0, "n": -0.000001,)"),
                                 std::string(R"({"p": 0.5, "t": 1, "d": 0, "n": 0)"),
                                 std::string(R"({"p": 0.5, "t": 1, "d": 0, "n": null, "m": 1.5)")}) {
    CAPTURE(bad);
    CHECK_FALSE(g->accepts(ids(bad)));
  }
  std::mt19937 rng(37);
  // The mask's exact rule inside ranged numbers, at the tightest budgets.
  const std::vector<float> logits = normal_logits(rng);
  check_masks(*g, {R"({"p": )", R"({"p": 0.)", R"({"p": 1)", R"({"p": 0.5, "t": 0.000)", R"({"p": 0.5, "t": 1, "d": -0.4)",
                   R"({"p": 0.5, "t": 1, "d": 0.2, "n": -)", R"({"p": 0.5, "t": 1, "d": 0.2, "n": -0.0000)"},
              {0, 1, 3}, logits);
  walks_valid(*g, schema, 6, 8, rng, "0123456789-.");
}

TEST_CASE("serve/json_schema multipleOf: integers and decimals, alone or in a range, exact in decimal") {
  // Every integer text from -120 to 120 against exact arithmetic.
  struct Multiple {
    std::string m;
    int lo, hi;
    bool ranged;
  };
  for (const Multiple& c : {Multiple{"3", -120, 120, false}, Multiple{"7", -50, 60, true}, Multiple{"12", 0, 120, true},
                            Multiple{"2.5", -120, 120, false}}) {
    const std::string& m = c.m;
    const int lo = c.lo, hi = c.hi;
    const bool ranged = c.ranged;
    CAPTURE(m);
    const std::string range = ranged ? fmt::format(", \"minimum\": {}, \"maximum\": {}", lo, hi) : "";
    const auto g = OutputGrammar::json_schema(
        bytes(), JsonSchema::compile(ojson::parse(R"({"type": "object", "properties": {"x": {"type": "integer", "multipleOf": )" + m +
                                                  range + R"(}}, "required": ["x"]})")));
    const int step = m == "2.5" ? 5 : std::stoi(m);
    int yes = 0;
    for (int x = -120; x <= 120; ++x) {
      CAPTURE(x);
      const bool want = x % step == 0 && x >= lo && x <= hi;
      CHECK(g->accepts(ids(fmt::format("{{\"x\": {}}}<|end|>", x))) == want);
      yes += want;
    }
    CHECK(yes > 5);
    CHECK_FALSE(g->accepts(ids("{\"x\": -0}<|end|>")));
  }
  // Decimals: multiples of 0.25 in [0, 3], written with 1 to 4 fraction digits.
  const ojson quarter = ojson::parse(R"({"type": "object", "properties": {
      "q": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 3},
      "t": {"type": "number", "multipleOf": 0.1},
      "f": {"type": "number", "multipleOf": 1e-20}},
    "required": ["q", "t", "f"]})");
  const auto g = OutputGrammar::json_schema(bytes(), JsonSchema::compile(quarter));
  CHECK(text(g->completion({})) == R"({"q":0,"t":0,"f":0}<|end|>)");
  int checked = 0;
  for (int v = -50; v <= 350; ++v)  // v / 100
    for (int digits : {2, 3, 4}) {
      std::string t = fmt::format("{}{}.{:02d}", v < 0 ? "-" : "", std::abs(v) / 100, std::abs(v) % 100) + std::string(size_t(digits - 2), '0');
      CAPTURE(t);
      const bool want = v % 25 == 0 && v >= 0 && v <= 300;
      CHECK(g->accepts(ids("{\"q\": " + t + ",")) == want);
      ++checked;
    }
  CHECK(checked == 1203);
  for (const char* t : {"1.251", "0.2500001", "1e0", "3.25", "-0.25"}) {
    CAPTURE(t);
    CHECK_FALSE(g->accepts(ids(std::string("{\"q\": ") + t + ",")));
  }
  for (const char* t : {"0.3", "-0.3", "12", "-7.10", "0.1000000000000000"}) {
    CAPTURE(t);
    CHECK(g->accepts(ids(std::string("{\"q\": 1, \"t\": ") + t + ", \"f\": 1}<|end|>")));
  }
  for (const char* t : {"0.35", "-0", "-0.0", "1e1", "0.01"}) {
    CAPTURE(t);
    CHECK_FALSE(g->accepts(ids(std::string("{\"q\": 1, \"t\": ") + t + ",")));
  }
  // 1e-20 is finer than the 16 fraction digits the grammar writes: any such number.
  CHECK(g->accepts(ids("{\"q\": 1, \"t\": 1, \"f\": -0.0000000000000001}<|end|>")));
  // The shortest multiple of 7 from 10 is 14; the mask's exact rule inside the number.
  const ojson seven = ojson::parse(R"({"type": "object", "properties": {"s": {"type": "integer", "multipleOf": 7, "minimum": 10}}, "required": ["s"]})");
  const auto g7 = OutputGrammar::json_schema(bytes(), JsonSchema::compile(seven));
  CHECK(text(g7->completion({})) == R"({"s":14}<|end|>)");
  CHECK(text(g7->completion(ids(R"({"s": 3)"))) == R"(5}<|end|>)");  // 35
  std::mt19937 rng(41);
  const std::vector<float> logits = normal_logits(rng);
  check_masks(*g7, {R"({"s": )", R"({"s": 1)", R"({"s": 10)"}, {0, 1, 3}, logits);
  check_masks(*g, {R"({"q": 2.)", R"({"q": 1, "t": -0.)"}, {0, 2}, logits);
  walks_valid(*g7, seven, 4, 6, rng, "0123456789");
  walks_valid(*g, quarter, 6, 8, rng, "0123456789-.");
}

TEST_CASE("serve/json_schema prefixItems: tuples (Pydantic's tuple[int, str]), then items or none") {
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {
      "pair": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 1}, {"type": "string"}], "minItems": 2, "maxItems": 2},
      "more": {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["x", "yz"]}], "items": {"type": "integer"}, "minItems": 3},
      "closed": {"type": "array", "prefixItems": [{"type": "null"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}], "items": false},
      "nest": {"type": "array", "prefixItems": [{"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}], "minItems": 1}},
    "required": ["pair", "more", "closed", "nest"]})");
  const auto g = OutputGrammar::json_schema(bytes(), JsonSchema::compile(schema));
  CHECK(text(g->completion({})) == R"({"pair":[1,""],"more":[true,"x",0],"closed":[],"nest":[{"k":0}]}<|end|>)");
  CHECK(g->accepts(ids(R"({"pair": [12, "a"], "more": [true, "yz", 3, 4, 5], "closed": [null, ["q"]], "nest": [{"k": 1}, 2, "w"]}<|end|>)")));
  CHECK(g->accepts(ids(R"({"pair": [1, ""], "more": [false, "x", -1], "closed": [null], "nest": [{"k": 1}]}<|end|>)")));
  const std::string ok = R"({"pair": [1, ""], "more": [false, "x", 1], )";
  for (const std::string& bad : {std::string(R"({"pair": [0)"), std::string(R"({"pair": ["a")"), std::string(R"({"pair": [1])"),
                                 std::string(R"({"pair": [1, "a",)"), std::string(R"({"pair": [1, "a"], "more": ["x")"),
                                 std::string(R"({"pair": [1, "a"], "more": [true, "x"])"),
                                 std::string(R"({"pair": [1, "a"], "more": [true, "y")"),
                                 std::string(R"({"pair": [1, "a"], "more": [true, "x", "z")"), ok + R"("closed": [1)",
                                 ok + R"("closed": [null, []])", ok + R"("closed": [null, ["a"],)", ok + R"("closed": [], "nest": [])",
                                 ok + R"("closed": [], "nest": [{}])"}) {
    CAPTURE(bad);
    CHECK_FALSE(g->accepts(ids(bad)));
  }
  std::mt19937 rng(41);
  const std::vector<float> logits = normal_logits(rng);
  check_masks(*g, {R"({"pair": [)", R"({"pair": [3, )", R"({"pair": [3, "a)", R"({"pair": [3, "a"], "more": [true)",
                   R"({"pair": [3, "a"], "more": [true, "y)", ok + R"("closed": [null, [)", ok + R"("closed": [], "nest": [{"k)"},
              {0, 1, 3}, logits);
  walks_valid(*g, schema, 6, 10, rng, "[]0123456789,");
}

TEST_CASE("serve/json_schema minLength / maxLength beside a pattern or a format: code points counted with the automaton") {
  const ojson schema = ojson::parse(R"({"type": "object", "properties": {
      "id": {"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 5},
      "note": {"type": "string", "pattern": "x", "minLength": 4},
      "mail": {"type": "string", "format": "email", "maxLength": 12},
      "word": {"type": "string", "pattern": "^[^0-9]*$", "minLength": 2, "maxLength": 2}},
    "required": ["id", "note", "mail", "word"]})");
  const auto g = OutputGrammar::json_schema(bytes(), JsonSchema::compile(schema));
  CHECK(text(g->completion({})) == R"({"id":"aaa","note":"aaax","mail":"a@a.aa","word":"aa"}<|end|>)");
  CHECK(g->accepts(ids("{\"id\": \"abcde\", \"note\": \"x and\", \"mail\": \"ab@cd.org\", \"word\": \"\xc3\xa9\xe6\x97\xa5\"}<|end|>")));
  const std::string ok = R"({"id": "abc", "note": "x...", )";
  for (const std::string& bad : {std::string(R"({"id": "ab")"), std::string(R"({"id": "abcdef)"), std::string(R"({"id": "aB)"),
                                 std::string(R"({"id": "abc", "note": "xyz")"), std::string(R"({"id": "abc", "note": "abcd")"),
                                 ok + R"("mail": "abcdef@gh.ijk)", ok + R"("mail": "a@b.cd", "word": "a")",
                                 ok + "\"mail\": \"a@b.cd\", \"word\": \"\xc3\xa9\xc3\xa9\xc3\xa9"}) {
    CAPTURE(bad);
    CHECK_FALSE(g->accepts(ids(bad)));
  }
  std::mt19937 rng(43);
  const std::vector<float> logits = normal_logits(rng);
  check_masks(*g, {R"({"id": "a)", R"({"id": "abcd)", R"({"id": "abc", "note": "xy)", ok + R"("mail": "abc@d)",
                   ok + R"("mail": "a@b.cd", "word": ")"},
              {0, 1, 3}, logits);
  walks_valid(*g, schema, 6, 10, rng, "abcx@.");
}
