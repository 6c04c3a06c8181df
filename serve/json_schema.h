#pragma once
// JSON Schema for constrained decoding: a request's `response_format`
// json_schema, or a forced tool call's `parameters`, compiled into a graph of
// value nodes that OutputGrammar (serve/grammar.h) walks byte by byte.
//
// The subset (what structured-output clients send: OpenAI strict schemas,
// Pydantic's output), with xgrammar's strict-mode rules, which vLLM uses:
// - `type` (one name or a list), `enum`, `const`, `anyOf` / `oneOf`, `allOf`
//   of one schema, `$ref` to "#" or a JSON pointer below it (`$defs`,
//   `definitions`; recursive schemas allowed);
// - object: `properties` (written in the schema's order; a property not in
//   `required` may be left out), `required`, `additionalProperties` (false or
//   absent: only the listed properties; true or a schema with no
//   `properties`: any keys, each value of that schema);
// - array: `items` (a schema, or false: no items but the prefix's),
//   `prefixItems` (Pydantic's tuples), `minItems`, `maxItems`; string: `minLength`, `maxLength`
//   (code points; beside a pattern too: Regex::with_length), `pattern`
//   (serve/regex.h's syntax, read as JSON Schema
//   reads it: a match anywhere unless '^' / '$' anchor it) or `format`
//   (date, time, date-time, uuid, email, ipv4, hostname: each a pattern
//   here), written without escapes; integer: no fraction or exponent;
//   number and integer: `minimum` / `maximum` and their exclusive forms, on
//   either side or both (the texts inside the range as a pattern,
//   serve/number_range.h: a ranged number is written without exponent),
//   and `multipleOf` (exact in decimal, alone or beside a range:
//   Regex::with_multiple);
// - annotations (title, description, default, examples, ...) are ignored.
// Anything else (uniqueItems, not, other formats, ...) is refused by
// name with the path where it stands, never ignored: a constraint the output
// would not keep must not be accepted silently. The alternatives of a union
// must differ in their first character (string | null, object | array, ...).
// The schema is read as an ordered_json so that properties keep the order
// the client wrote them in. The root must be an object. Compiling walks the schema with an explicit
// work list (no recursion on client data) and bounds every count.
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace areno::serve {

class Regex;

class JsonSchema {
 public:
  static constexpr uint32_t kNone = 0xffffffffu;
  static constexpr int kMaxDepth = 16;                // nested containers of an output
  static constexpr size_t kMaxNodes = 4096;
  static constexpr size_t kMaxProperties = 1024;      // one object
  static constexpr size_t kMaxOptionalRun = 63;       // optional properties in a row
  static constexpr size_t kMaxEnum = 1024;            // values of one enum
  static constexpr size_t kMaxEnumTotal = 16384;      // values of all enums
  static constexpr size_t kMaxKeyBytes = 256;         // a property name, escaped
  static constexpr size_t kMaxEnumBytes = 1024;       // one enum value's JSON text
  static constexpr uint32_t kMaxCount = 65535;        // minItems, maxItems, minLength, maxLength
  static constexpr size_t kMaxMinimalBytes = 1 << 20; // all nodes' shortest instances together
  // All the schemas of one request together (the forced tools' parameters):
  // bounds the memory a request can make the server build.
  static constexpr size_t kMaxRequestNodes = 16384;
  // Patterns and formats of one schema: their automata's states together.
  static constexpr size_t kMaxPatternStates = 65536;

  struct Node {
    enum Kind : uint8_t { object, map, array, string, number, integer, enumeration, union_ } kind = object;
    // object: the properties in order (names escaped, without quotes), each
    // one's value node and whether it is required. map: values[0] is every
    // value's node. array: values[1..] are the `prefixItems`' nodes (the
    // first items, in order) and values[0] the node of the items after them.
    // union: values are the alternatives (none of them a union).
    std::vector<std::string> keys;
    std::vector<uint32_t> values;
    std::vector<uint8_t> required;
    uint32_t min_count = 0, max_count = kMaxCount;  // array items; string code points
    bool limited = false;                           // string: a length bound applies
    // string: its `pattern` or `format`; number, integer: its range's
    // pattern (the automaton's state is the grammar's State::lo while the
    // string or the number is written).
    std::shared_ptr<const Regex> pattern;
    std::vector<std::string> texts;                 // enumeration: JSON texts, sorted
    uint32_t first_table = kNone;                   // union: its row of JsonSchema::first
    // Derived: the shortest instance (its text; the grammar counts it in the
    // fewest tokens that spell it) and the containers it nests.
    std::string minimal;
    int32_t min_depth = 0;
    // object, per index i (size keys + 1): of the required properties at i
    // and after, the bytes of `"key":value` (shortest values, no commas),
    // their count, the deepest nesting one needs, and the first one's index
    // (keys.size() when none).
    // array, per position i up to the required prefix items' end: their
    // shortest values' bytes from i on (no commas) and deepest nesting.
    std::vector<int64_t> req_bytes;
    std::vector<int32_t> req_count, req_depth;
    std::vector<uint32_t> next_required;
    int64_t item_bytes = 0;   // array: the shortest item after the prefix (when one is required)
    int32_t item_depth = 0;
    // array: the node of the item at position i.
    uint32_t item(uint32_t i) const { return i + 1 < values.size() ? values[i + 1] : values[0]; }
    // array: the shortest items' bytes (no commas) and deepest nesting from
    // position i to min_count.
    int64_t items_bytes(uint32_t i) const;
    int32_t items_depth(uint32_t i) const;
    // enumeration: a sparse table of the texts' lengths for range minima.
    std::vector<std::vector<uint32_t>> shortest;
    uint32_t shortest_in(uint32_t lo, uint32_t hi) const;  // index of a shortest text in [lo, hi)
  };

  // Throws std::invalid_argument naming the path and keyword it refuses.
  static std::shared_ptr<const JsonSchema> compile(const nlohmann::ordered_json& schema);
  // Any JSON object (response_format json_object).
  static std::shared_ptr<const JsonSchema> any_object();

  const Node& node(uint32_t i) const { return nodes_[i]; }
  // A union's alternative that byte c begins, or kNone.
  uint32_t first(const Node& u, unsigned char c) const { return firsts_[u.first_table][c]; }
  uint32_t root() const { return root_; }
  size_t size() const { return nodes_.size(); }

 private:
  std::vector<Node> nodes_;
  std::vector<std::array<uint32_t, 256>> firsts_;  // one row per union
  uint32_t root_ = 0;
  friend class SchemaCompiler;
};

}  // namespace areno::serve
