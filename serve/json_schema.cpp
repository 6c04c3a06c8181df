#include "serve/json_schema.h"

#include "serve/number_range.h"
#include "serve/regex.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace areno::serve {

using json = nlohmann::ordered_json;

namespace {

constexpr int64_t kInf = int64_t(1) << 40;

bool annotation(std::string_view k) {
  static constexpr std::string_view kAnnotations[] = {"title",    "description", "default",  "examples", "$schema",
                                                      "$id",      "$comment",    "$defs",    "definitions",
                                                      "deprecated", "readOnly",  "writeOnly"};
  return std::find(std::begin(kAnnotations), std::end(kAnnotations), k) != std::end(kAnnotations);
}

// The keywords each type takes; "" for those of no type in particular.
std::string_view keyword_type(std::string_view k) {
  if (k == "properties" || k == "required" || k == "additionalProperties") return "object";
  if (k == "items" || k == "prefixItems" || k == "minItems" || k == "maxItems") return "array";
  if (k == "minLength" || k == "maxLength" || k == "pattern" || k == "format") return "string";
  if (k == "minimum" || k == "maximum" || k == "exclusiveMinimum" || k == "exclusiveMaximum" || k == "multipleOf")
    return "number";  // integers too
  if (k == "type" || k == "enum" || k == "const" || k == "anyOf" || k == "oneOf" || k == "allOf" || k == "$ref")
    return "";
  return "?";
}

std::string escaped(const std::string& s) {
  const std::string q = json(s).dump();
  return q.substr(1, q.size() - 2);
}

std::string child(const std::string& path, std::string_view key) {
  std::string k(key);
  // JSON pointer escapes: ~ as ~0, / as ~1.
  std::string e;
  for (char c : k) e += c == '~' ? std::string("~0") : c == '/' ? std::string("~1") : std::string(1, c);
  return path + "/" + e;
}

}  // namespace

int64_t JsonSchema::Node::items_bytes(uint32_t i) const {
  const uint32_t R = uint32_t(req_bytes.size()) - 1, after = std::max(i, R);
  return (i < R ? req_bytes[i] : 0) + (min_count > after ? int64_t(min_count - after) * item_bytes : 0);
}

int32_t JsonSchema::Node::items_depth(uint32_t i) const {
  const uint32_t R = uint32_t(req_depth.size()) - 1;
  return std::max(i < R ? req_depth[i] : 0, min_count > std::max(i, R) ? item_depth : 0);
}

uint32_t JsonSchema::Node::shortest_in(uint32_t lo, uint32_t hi) const {
  uint32_t level = 0;
  while ((uint32_t(2) << level) <= hi - lo) ++level;
  const uint32_t a = shortest[level][lo], b = shortest[level][hi - (uint32_t(1) << level)];
  return texts[b].size() < texts[a].size() ? b : a;
}

class SchemaCompiler {
 public:
  explicit SchemaCompiler(const json& root) : root_json_(root) {}

  std::shared_ptr<const JsonSchema> run() {
    out_.root_ = fresh(root_json_, "#");
    refs_["#"] = out_.root_;
    while (!work_.empty()) {
      Work w = work_.back();
      work_.pop_back();
      process(w);
    }
    finish();
    return std::make_shared<const JsonSchema>(std::move(out_));
  }

  std::shared_ptr<const JsonSchema> any_object() {
    out_.root_ = any_object_node();
    finish();
    return std::make_shared<const JsonSchema>(std::move(out_));
  }

 private:
  using Node = JsonSchema::Node;
  struct Work {
    const json* s;
    std::string path;
    uint32_t id;
    std::string only_type;  // one type of a `type` list
  };

  [[noreturn]] static void refuse(const std::string& path, const std::string& what) {
    throw std::invalid_argument(fmt::format("the schema at {}: {}", path, what));
  }

  uint32_t alloc(const std::string& path) {
    if (out_.nodes_.size() >= JsonSchema::kMaxNodes)
      refuse(path, fmt::format("the schema needs more than {} nodes", JsonSchema::kMaxNodes));
    out_.nodes_.emplace_back();
    alias_.push_back(JsonSchema::kNone);
    return uint32_t(out_.nodes_.size() - 1);
  }
  uint32_t fresh(const json& s, const std::string& path, std::string only_type = "") {
    const uint32_t id = alloc(path);
    work_.push_back(Work{&s, path, id, std::move(only_type)});
    return id;
  }
  uint32_t ref_node(const std::string& ref, const std::string& path) {
    if (ref.empty() || ref[0] != '#')
      refuse(path, fmt::format("'$ref' '{}' is not supported (only references inside the schema, starting with '#')", ref));
    if (auto it = refs_.find(ref); it != refs_.end()) return it->second;
    const json* target = nullptr;
    try {
      target = &root_json_.at(json::json_pointer(ref.substr(1)));
    } catch (const json::exception&) {
      refuse(path, fmt::format("'$ref' '{}' does not resolve", ref));
    }
    const uint32_t id = fresh(*target, ref);
    refs_[ref] = id;
    return id;
  }

  uint32_t any_value_node() {
    if (any_value_ != JsonSchema::kNone) return any_value_;
    any_value_ = alloc("#");
    const uint32_t obj = alloc("#"), arr = alloc("#"), str = alloc("#"), num = alloc("#"), lit = alloc("#");
    out_.nodes_[obj].kind = Node::map;
    out_.nodes_[obj].values = {any_value_};
    out_.nodes_[arr].kind = Node::array;
    out_.nodes_[arr].values = {any_value_};
    out_.nodes_[str].kind = Node::string;
    out_.nodes_[num].kind = Node::number;
    out_.nodes_[lit].kind = Node::enumeration;
    out_.nodes_[lit].texts = {"false", "null", "true"};  // sorted
    Node& u = out_.nodes_[any_value_];
    u.kind = Node::union_;
    u.values = {obj, arr, str, num, lit};
    any_object_ = obj;
    return any_value_;
  }
  uint32_t any_object_node() {
    any_value_node();
    return any_object_;
  }

  void process(const Work& w) {
    const json& s = *w.s;
    const std::string& path = w.path;
    if (s.is_boolean()) {
      if (!s.get<bool>()) refuse(path, "the schema 'false' has no instance");
      alias_[w.id] = any_value_node();
      return;
    }
    if (!s.is_object()) refuse(path, fmt::format("a schema must be an object or a boolean (got {})", s.type_name()));
    // What stands beside the keywords: unknown ones are refused.
    std::vector<std::string_view> structural;
    for (auto it = s.begin(); it != s.end(); ++it) {
      const std::string_view k = it.key();
      if (annotation(k)) continue;
      if (keyword_type(k) == "?")
        refuse(path, fmt::format("the keyword '{}' is not supported (supported: type, enum, const, anyOf, oneOf, allOf, "
                                 "$ref, properties, required, additionalProperties, items, prefixItems, minItems, "
                                 "maxItems, minLength, maxLength, pattern, format, minimum, maximum, "
                                 "exclusiveMinimum, exclusiveMaximum)",
                                 k));
      structural.push_back(k);
    }
    auto alone = [&](std::string_view k) {
      for (std::string_view o : structural)
        if (o != k)
          refuse(path, fmt::format("'{}' beside '{}' is not supported", o, k));
    };
    if (w.only_type.empty()) {
      if (s.contains("$ref")) {
        alone("$ref");
        if (!s["$ref"].is_string()) refuse(path, "'$ref' must be a string");
        alias_[w.id] = ref_node(s["$ref"].get<std::string>(), path);
        return;
      }
      if (s.contains("allOf")) {
        alone("allOf");
        const json& a = s["allOf"];
        if (!a.is_array() || a.size() != 1) refuse(path, "'allOf' is supported with exactly one schema");
        alias_[w.id] = fresh(a[0], path + "/allOf/0");
        return;
      }
      for (const char* k : {"anyOf", "oneOf"}) {
        if (!s.contains(k)) continue;
        alone(k);
        const json& a = s[k];
        if (!a.is_array() || a.empty()) refuse(path, fmt::format("'{}' must be a non-empty array of schemas", k));
        if (a.size() > 64) refuse(path, fmt::format("'{}' has more than 64 schemas", k));
        Node& u = out_.nodes_[w.id];
        u.kind = Node::union_;
        std::vector<uint32_t> alts;
        for (size_t i = 0; i < a.size(); ++i) alts.push_back(fresh(a[i], fmt::format("{}/{}/{}", path, k, i)));
        out_.nodes_[w.id].values = std::move(alts);
        return;
      }
      if (s.contains("enum") || s.contains("const")) {
        for (std::string_view o : structural)
          if (o != "enum" && o != "const" && o != "type")
            refuse(path, fmt::format("'{}' beside 'enum' or 'const' is not supported", o));
        if (s.contains("enum") && s.contains("const")) refuse(path, "'enum' and 'const' together are not supported");
        std::vector<std::string> texts;
        if (s.contains("const")) {
          texts.push_back(s["const"].dump());
        } else {
          const json& e = s["enum"];
          if (!e.is_array() || e.empty()) refuse(path, "'enum' must be a non-empty array");
          if (e.size() > JsonSchema::kMaxEnum) refuse(path, fmt::format("'enum' has more than {} values", JsonSchema::kMaxEnum));
          for (const json& v : e) texts.push_back(v.dump());
        }
        enum_values_ += texts.size();
        if (enum_values_ > JsonSchema::kMaxEnumTotal)
          refuse(path, fmt::format("the schema's enums hold more than {} values together", JsonSchema::kMaxEnumTotal));
        for (const std::string& t : texts)
          if (t.size() > JsonSchema::kMaxEnumBytes)
            refuse(path, fmt::format("an 'enum' or 'const' value is longer than {} bytes as JSON", JsonSchema::kMaxEnumBytes));
        std::sort(texts.begin(), texts.end());
        texts.erase(std::unique(texts.begin(), texts.end()), texts.end());
        Node& n = out_.nodes_[w.id];
        n.kind = Node::enumeration;
        n.texts = std::move(texts);
        return;
      }
    }
    // The type: given, one of a list, or from the keywords.
    std::string type = w.only_type;
    if (type.empty() && s.contains("type")) {
      const json& t = s["type"];
      if (t.is_array()) {
        if (t.empty() || t.size() > 7) refuse(path, "'type' must be a type name or a non-empty list of them");
        std::vector<uint32_t> alts;
        for (const json& x : t) {
          if (!x.is_string()) refuse(path, "'type' must be a type name or a list of them");
          alts.push_back(fresh(s, path, x.get<std::string>()));
        }
        Node& u = out_.nodes_[w.id];
        u.kind = Node::union_;
        u.values = std::move(alts);
        return;
      }
      if (!t.is_string()) refuse(path, "'type' must be a type name or a list of them");
      type = t.get<std::string>();
    }
    const bool listed = !w.only_type.empty();
    if (type.empty()) {
      std::string_view inferred;
      for (std::string_view k : structural) {
        const std::string_view kt = keyword_type(k);
        if (kt.empty()) continue;
        if (!inferred.empty() && kt != inferred)
          refuse(path, fmt::format("keywords of both {} and {} without a 'type'", inferred, kt));
        inferred = kt;
      }
      if (inferred.empty()) {  // {} or annotations only: any value
        alias_[w.id] = any_value_node();
        return;
      }
      type = std::string(inferred);
    }
    static constexpr std::string_view kTypes[] = {"object", "array", "string", "number", "integer", "boolean", "null"};
    if (std::find(std::begin(kTypes), std::end(kTypes), type) == std::end(kTypes))
      refuse(path, fmt::format("unknown type '{}'", type));
    // Keywords of another type: refused where the type is the schema's only
    // one, skipped for the other types of a list.
    for (std::string_view k : structural) {
      const std::string_view kt = keyword_type(k);
      if (!kt.empty() && kt != type && !(kt == "number" && type == "integer") && !listed)
        refuse(path, fmt::format("'{}' does not apply to type '{}'", k, type));
    }
    auto count = [&](const char* k, uint32_t dflt) -> uint32_t {
      if (!s.contains(k)) return dflt;
      const json& v = s[k];
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > int64_t(JsonSchema::kMaxCount))
        refuse(path, fmt::format("'{}' must be an integer from 0 to {}", k, JsonSchema::kMaxCount));
      return uint32_t(v.get<int64_t>());
    };
    Node& n = out_.nodes_[w.id];
    if (type == "boolean" || type == "null") {
      n.kind = Node::enumeration;
      n.texts = type == "null" ? std::vector<std::string>{"null"} : std::vector<std::string>{"false", "true"};
    } else if (type == "number" || type == "integer") {
      n.kind = type == "number" ? Node::number : Node::integer;
      numeric_range(s, path, n);
    } else if (type == "string") {
      n.kind = Node::string;
      n.min_count = count("minLength", 0);
      n.max_count = count("maxLength", JsonSchema::kMaxCount);
      n.limited = s.contains("minLength") || s.contains("maxLength");
      if (n.min_count > n.max_count) refuse(path, "'minLength' exceeds 'maxLength'");
      if (s.contains("pattern") || s.contains("format")) string_pattern(s, path, n);
    } else if (type == "array") {
      uint32_t lo = count("minItems", 0), hi = count("maxItems", JsonSchema::kMaxCount);
      if (lo > hi) refuse(path, "'minItems' exceeds 'maxItems'");
      // `prefixItems` (a tuple) first, then `items` for the rest; `items`
      // false allows nothing after the prefix.
      std::vector<uint32_t> values = {0};
      if (s.contains("prefixItems")) {
        const json& p = s["prefixItems"];
        if (!p.is_array()) refuse(path, "'prefixItems' must be an array of schemas");
        if (p.size() > JsonSchema::kMaxProperties)
          refuse(path, fmt::format("more than {} 'prefixItems'", JsonSchema::kMaxProperties));
        for (size_t i = 0; i < p.size(); ++i) values.push_back(fresh(p[i], fmt::format("{}/prefixItems/{}", path, i)));
      }
      const size_t prefix = values.size() - 1;
      const json* items = s.contains("items") ? &s["items"] : nullptr;
      if (items && items->is_boolean() && !items->get<bool>()) {
        if (lo > prefix)
          refuse(path, fmt::format("'minItems' {} exceeds the {} 'prefixItems' that 'items' false allows", lo, prefix));
        hi = std::min<uint32_t>(hi, uint32_t(prefix));
        values[0] = any_value_node();  // never reached
      } else {
        values[0] = items ? fresh(*items, path + "/items") : any_value_node();
      }
      Node& a = out_.nodes_[w.id];  // fresh() may have moved the nodes
      a.kind = Node::array;
      a.min_count = lo;
      a.max_count = hi;
      a.values = std::move(values);
    } else {  // object
      const json* props = s.contains("properties") ? &s["properties"] : nullptr;
      if (props && !props->is_object()) refuse(path, "'properties' must be an object");
      const json* extra = s.contains("additionalProperties") ? &s["additionalProperties"] : nullptr;
      if (extra && !extra->is_boolean() && !extra->is_object())
        refuse(path, "'additionalProperties' must be a boolean or a schema");
      const bool extra_allowed = extra && !(extra->is_boolean() && !extra->get<bool>());
      std::vector<std::string> required;
      if (s.contains("required")) {
        const json& r = s["required"];
        if (!r.is_array()) refuse(path, "'required' must be an array of property names");
        for (const json& x : r) {
          if (!x.is_string()) refuse(path, "'required' must be an array of property names");
          if (!props || !props->contains(x.get<std::string>()))
            refuse(path, fmt::format("'required' names '{}', which is not in 'properties'", x.get<std::string>()));
          required.push_back(x.get<std::string>());
        }
      }
      if (props && !props->empty() && extra_allowed)
        refuse(path, "'additionalProperties' beside 'properties' is not supported (set it to false, or give no "
                     "'properties' for a map)");
      if (props && !extra_allowed) {
        if (props->size() > JsonSchema::kMaxProperties)
          refuse(path, fmt::format("more than {} properties", JsonSchema::kMaxProperties));
        std::vector<std::string> keys;
        std::vector<uint32_t> values;
        std::vector<uint8_t> req;
        size_t run = 0;
        for (auto it = props->begin(); it != props->end(); ++it) {
          keys.push_back(escaped(it.key()));
          if (keys.back().size() > JsonSchema::kMaxKeyBytes)
            refuse(child(path + "/properties", it.key()),
                   fmt::format("a property name longer than {} bytes", JsonSchema::kMaxKeyBytes));
          req.push_back(std::find(required.begin(), required.end(), it.key()) != required.end());
          run = req.back() ? 0 : run + 1;
          if (run > JsonSchema::kMaxOptionalRun)
            refuse(path, fmt::format("more than {} optional properties in a row", JsonSchema::kMaxOptionalRun));
          values.push_back(fresh(it.value(), child(path + "/properties", it.key())));
        }
        Node& o = out_.nodes_[w.id];
        o.kind = Node::object;
        o.keys = std::move(keys);
        o.values = std::move(values);
        o.required = std::move(req);
      } else if (extra && extra->is_boolean() && !extra->get<bool>()) {  // no property at all: {}
        out_.nodes_[w.id].kind = Node::object;
      } else {
        // No properties: a map whose values follow additionalProperties (any
        // value when it is true or absent).
        const uint32_t v = extra && extra->is_object() ? fresh(*extra, path + "/additionalProperties") : any_value_node();
        Node& m = out_.nodes_[w.id];
        m.kind = Node::map;
        m.values = {v};
      }
    }
  }

  uint32_t final_of(uint32_t x) const {
    for (size_t hops = 0; alias_[x] != JsonSchema::kNone; ++hops) {
      if (hops > alias_.size()) throw std::invalid_argument("the schema: a '$ref' or 'allOf' chain refers to itself");
      x = alias_[x];
    }
    return x;
  }

  void finish() {
    std::vector<Node>& nodes = out_.nodes_;
    const size_t N = nodes.size();
    for (Node& n : nodes)
      for (uint32_t& v : n.values) v = final_of(v);
    out_.root_ = final_of(out_.root_);
    std::vector<uint8_t> live(N, 0);
    for (size_t i = 0; i < N; ++i) live[i] = alias_[i] == JsonSchema::kNone;
    // Unions hold no unions: the alternatives' alternatives, once each.
    for (size_t i = 0; i < N; ++i) {
      if (!live[i] || nodes[i].kind != Node::union_) continue;
      std::vector<uint32_t> leaves, stack(nodes[i].values.rbegin(), nodes[i].values.rend());
      std::unordered_set<uint32_t> seen = {uint32_t(i)};
      while (!stack.empty()) {
        const uint32_t a = stack.back();
        stack.pop_back();
        if (!seen.insert(a).second) continue;
        if (nodes[a].kind == Node::union_) stack.insert(stack.end(), nodes[a].values.rbegin(), nodes[a].values.rend());
        else leaves.push_back(a);
      }
      if (leaves.empty()) throw std::invalid_argument("the schema: a union refers only to itself");
      // integer | number is number (when the number has no range).
      const bool has_number = std::any_of(leaves.begin(), leaves.end(),
                                          [&](uint32_t a) { return nodes[a].kind == Node::number && !nodes[a].pattern; });
      if (has_number)
        leaves.erase(std::remove_if(leaves.begin(), leaves.end(), [&](uint32_t a) { return nodes[a].kind == Node::integer; }),
                     leaves.end());
      Node& u = nodes[i];
      u.values = leaves;
      u.first_table = uint32_t(out_.firsts_.size());
      std::array<uint32_t, 256>& first = out_.firsts_.emplace_back();
      first.fill(JsonSchema::kNone);
      for (size_t j = 0; j < leaves.size(); ++j) {
        const Node& a = nodes[leaves[j]];
        std::string firsts;
        switch (a.kind) {
          case Node::object:
          case Node::map: firsts = "{"; break;
          case Node::array: firsts = "["; break;
          case Node::string: firsts = "\""; break;
          case Node::number:
          case Node::integer:
            if (!a.pattern) firsts = "-0123456789";
            else
              for (int c = 0; c < 256; ++c)
                if (a.pattern->next(a.pattern->start(), uint8_t(c)) != Regex::kDead) firsts += char(c);
            break;
          case Node::enumeration:
            for (const std::string& t : a.texts) firsts += t[0];
            break;
          case Node::union_: break;
        }
        for (unsigned char c : firsts) {
          if (first[c] != JsonSchema::kNone && first[c] != leaves[j])
            throw std::invalid_argument(fmt::format(
                "the schema: two alternatives of a union ('anyOf', 'oneOf' or a 'type' list) can both begin with '{}'; "
                "the alternatives must differ in their first character (different types)",
                char(c)));
          first[c] = leaves[j];
        }
      }
    }
    const Node& root = nodes[out_.root_];
    if (root.kind != Node::object && root.kind != Node::map)
      throw std::invalid_argument("the schema: its root must be an object (\"type\": \"object\")");

    // The shortest instance of every node, its length first (a fixpoint from
    // above: the lengths only fall), then the texts in order of length.
    std::vector<int64_t> len(N, kInf);
    auto sat = [](int64_t a) { return std::min(a, kInf); };
    for (size_t pass = 0;; ++pass) {
      bool changed = false;
      for (size_t i = N; i-- > 0;) {  // children mostly come after their parents
        if (!live[i]) continue;
        const Node& n = nodes[i];
        int64_t l = kInf;
        switch (n.kind) {
          case Node::object: {
            l = 2;
            int64_t r = 0;
            for (size_t k = 0; k < n.keys.size(); ++k)
              if (n.required[k]) l = sat(l + int64_t(n.keys[k].size()) + 3 + len[n.values[k]]), ++r;
            l = sat(l + std::max<int64_t>(r - 1, 0));
            break;
          }
          case Node::map: l = 2; break;
          case Node::array: {
            // The required items' shortest values, then the commas between.
            const uint32_t R = std::min<uint32_t>(n.min_count, uint32_t(n.values.size() - 1));
            l = 2 + std::max<int64_t>(int64_t(n.min_count) - 1, 0);
            for (uint32_t j = 0; j < R; ++j) l = sat(l + len[n.values[j + 1]]);
            if (n.min_count > R) l = sat(l + sat(int64_t(n.min_count - R) * len[n.values[0]]));
            break;
          }
          case Node::string: l = 2 + (n.pattern ? n.pattern->distance(n.pattern->start()) : n.min_count); break;
          case Node::number:
          case Node::integer: l = n.pattern ? n.pattern->distance(n.pattern->start()) : 1; break;
          case Node::enumeration:
            l = kInf;
            for (const std::string& t : n.texts) l = std::min(l, int64_t(t.size()));
            break;
          case Node::union_:
            for (uint32_t a : n.values) l = std::min(l, len[a]);
            break;
        }
        if (l < len[i]) len[i] = l, changed = true;
      }
      if (!changed) break;
      if (pass > N + 2) throw std::logic_error("json schema: the shortest lengths did not settle");
    }
    int64_t total = 0;
    for (size_t i = 0; i < N; ++i) {
      if (!live[i]) continue;
      if (len[i] >= kInf) throw std::invalid_argument("the schema has a part with no finite instance (a required "
                                                      "property or item that always contains itself)");
      total += len[i];
    }
    if (total > int64_t(JsonSchema::kMaxMinimalBytes))
      throw std::invalid_argument(fmt::format("the schema's shortest instances take more than {} bytes together",
                                              JsonSchema::kMaxMinimalBytes));
    std::vector<uint32_t> order;
    for (size_t i = 0; i < N; ++i)
      if (live[i]) order.push_back(uint32_t(i));
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      const bool ua = nodes[a].kind == Node::union_, ub = nodes[b].kind == Node::union_;
      return len[a] != len[b] ? len[a] < len[b] : ua < ub;
    });
    for (uint32_t i : order) {
      Node& n = nodes[i];
      std::string& m = n.minimal;
      switch (n.kind) {
        case Node::object: {
          m = "{";
          bool first = true;
          for (size_t k = 0; k < n.keys.size(); ++k) {
            if (!n.required[k]) continue;
            if (!first) m += ',';
            first = false;
            m += '"' + n.keys[k] + "\":" + nodes[n.values[k]].minimal;
            n.min_depth = std::max(n.min_depth, nodes[n.values[k]].min_depth);
          }
          m += '}';
          ++n.min_depth;
          // The tables per property index.
          const size_t K = n.keys.size();
          n.req_bytes.assign(K + 1, 0);
          n.req_count.assign(K + 1, 0);
          n.req_depth.assign(K + 1, 0);
          n.next_required.assign(K + 1, uint32_t(K));
          for (size_t k = K; k-- > 0;) {
            n.req_bytes[k] = n.req_bytes[k + 1];
            n.req_count[k] = n.req_count[k + 1];
            n.req_depth[k] = n.req_depth[k + 1];
            n.next_required[k] = n.next_required[k + 1];
            if (n.required[k]) {
              n.req_bytes[k] += int64_t(n.keys[k].size()) + 3 + len[n.values[k]];
              ++n.req_count[k];
              n.req_depth[k] = std::max(n.req_depth[k], nodes[n.values[k]].min_depth);
              n.next_required[k] = uint32_t(k);
            }
          }
          break;
        }
        case Node::map: m = "{}", n.min_depth = 1; break;
        case Node::array: {
          m = "[";
          for (uint32_t j = 0; j < n.min_count; ++j) m += (j ? "," : "") + nodes[n.item(j)].minimal;
          m += ']';
          // The tables over the required prefix items (their nodes are
          // shorter, so already done), and the item after them.
          const uint32_t R = std::min<uint32_t>(n.min_count, uint32_t(n.values.size() - 1));
          n.req_bytes.assign(R + 1, 0);
          n.req_depth.assign(R + 1, 0);
          for (uint32_t j = R; j-- > 0;) {
            n.req_bytes[j] = n.req_bytes[j + 1] + len[n.values[j + 1]];
            n.req_depth[j] = std::max(n.req_depth[j + 1], nodes[n.values[j + 1]].min_depth);
          }
          if (n.min_count > R) n.item_bytes = len[n.values[0]], n.item_depth = nodes[n.values[0]].min_depth;
          n.min_depth = 1 + n.items_depth(0);
          break;
        }
        case Node::string:
          m = '"' + (n.pattern ? n.pattern->shortest(n.pattern->start()) : std::string(n.min_count, 'a')) + '"';
          break;
        case Node::number:
        case Node::integer: m = n.pattern ? n.pattern->shortest(n.pattern->start()) : "0"; break;
        case Node::enumeration: {
          const uint32_t T = uint32_t(n.texts.size());
          n.shortest.assign(1, std::vector<uint32_t>(T));
          std::iota(n.shortest[0].begin(), n.shortest[0].end(), 0u);
          for (uint32_t w = 1; (w << 1) <= T; w <<= 1) {
            const std::vector<uint32_t>& prev = n.shortest.back();
            std::vector<uint32_t> next(T - 2 * w + 1);
            for (uint32_t j = 0; j + 2 * w <= T; ++j) {
              const uint32_t a = prev[j], b = prev[j + w];
              next[j] = n.texts[b].size() < n.texts[a].size() ? b : a;
            }
            n.shortest.push_back(std::move(next));
          }
          m = n.texts[n.shortest_in(0, T)];
          break;
        }
        case Node::union_: {
          uint32_t best = n.values[0];
          for (uint32_t a : n.values)
            if (len[a] < len[best]) best = a;
          m = nodes[best].minimal;
          n.min_depth = nodes[best].min_depth;
          break;
        }
      }
      if (int64_t(m.size()) != len[i]) throw std::logic_error("json schema: a shortest text's length is off");
    }
    if (nodes[out_.root_].min_depth > JsonSchema::kMaxDepth)
      throw std::invalid_argument(fmt::format("the schema's shortest instance nests deeper than {} containers",
                                              JsonSchema::kMaxDepth));
  }

  const json& root_json_;
  // A string's `pattern` or `format` as its automaton (serve/regex.h), each
  // distinct text compiled once, all bounded together in work and states.
  void string_pattern(const json& s, const std::string& path, Node& n) {
    if (s.contains("pattern") && s.contains("format")) refuse(path, "'pattern' and 'format' together are not supported");
    const bool is_pattern = s.contains("pattern");
    const json& v = s[is_pattern ? "pattern" : "format"];
    const char* kw = is_pattern ? "pattern" : "format";
    if (!v.is_string()) refuse(path, fmt::format("'{}' must be a string", kw));
    const std::string& text = v.get_ref<const std::string&>();
    const std::string key = std::string(kw) + ":" + text;
    n.pattern = cached(key, path, [&] { return compile_pattern(text, is_pattern, kw, path); });
    if (n.limited) {
      // minLength / maxLength: the automaton times a code point counter.
      const uint32_t most = s.contains("maxLength") ? n.max_count : Regex::kNoMaxLength;
      n.pattern = cached(fmt::format("{}#{}-{}", key, n.min_count, most), path, [&] {
        try {
          return n.pattern->with_length(n.min_count, most, &pattern_work_);
        } catch (const std::invalid_argument& e) {
          refuse(path, fmt::format("'{}' with 'minLength' / 'maxLength': {}", kw, e.what()));
        }
      });
      n.limited = false;  // the automaton keeps the length
    }
  }

  std::shared_ptr<const Regex> compile_pattern(const std::string& text, bool is_pattern, const char* kw,
                                               const std::string& path) {
    // The formats OpenAI's strict mode lists that a pattern can say exactly
    // enough (RFC 3339 dates and times, with 'T' and 'Z' upper case).
    static const std::map<std::string, std::string, std::less<>> kFormats = {
        {"date", "^\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\\d|3[01])$"},
        {"time", "^([01]\\d|2[0-3]):[0-5]\\d:([0-5]\\d|60)(\\.\\d{1,9})?(Z|[+-]([01]\\d|2[0-3]):[0-5]\\d)$"},
        {"date-time", "^\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\\d|3[01])T([01]\\d|2[0-3]):[0-5]\\d:([0-5]\\d|60)"
                      "(\\.\\d{1,9})?(Z|[+-]([01]\\d|2[0-3]):[0-5]\\d)$"},
        {"uuid", "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"},
        {"email", "^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\\.[A-Za-z0-9-]{1,63})*\\.[A-Za-z]{2,24}$"},
        {"ipv4", "^((25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)\\.){3}(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)$"},
        {"hostname", "^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"},
    };
    std::string source = text;
    if (!is_pattern) {
      const auto f = kFormats.find(text);
      if (f == kFormats.end())
        refuse(path, fmt::format("'format' '{}' is not supported (supported: date, time, date-time, uuid, email, ipv4, "
                                 "hostname)",
                                 text));
      source = f->second;
    }
    Regex::Options o;
    o.json_string = true;
    o.search = is_pattern;
    o.work_left = &pattern_work_;
    try {
      return Regex::compile(source, o);
    } catch (const std::invalid_argument& e) {
      refuse(path, fmt::format("'{}': {}", kw, e.what()));
    }
  }

  // A number or an integer with `minimum` / `maximum` (or their exclusive
  // forms): the pattern of the texts inside the range (serve/number_range.h);
  // with `multipleOf`, those texts that are its multiples (Regex::
  // with_multiple). Counted with the string patterns in work and states.
  void numeric_range(const json& s, const std::string& path, Node& n) {
    std::vector<NumberBound> lower, upper;
    for (const char* k : {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"}) {
      if (!s.contains(k)) continue;
      const json& v = s[k];
      if (!v.is_number() || !std::isfinite(v.get<double>()))
        refuse(path, fmt::format("'{}' must be a finite number", k));
      const std::string_view kk = k;
      (kk == "minimum" || kk == "exclusiveMinimum" ? lower : upper).push_back(NumberBound{v.dump(), kk.starts_with("exclusive")});
    }
    const bool multiple = s.contains("multipleOf");
    if (lower.empty() && upper.empty() && !multiple) return;
    const bool integer = n.kind == Node::integer;
    std::string source;
    if (lower.empty() && upper.empty()) {
      // The texts a ranged number takes, unbounded: no exponent, no -0 (the multiples exclude it).
      source = integer ? "-?(0|[1-9][0-9]{0,15})" : "-?(0|[1-9][0-9]{0,15})(\\.[0-9]{1,16})?";
    } else {
      try {
        source = number_range_pattern(lower, upper, integer);
      } catch (const std::invalid_argument& e) {
        refuse(path, e.what());
      }
    }
    n.pattern = cached("range:" + source, path, [&] {
      Regex::Options o;
      o.work_left = &pattern_work_;
      try {
        return Regex::compile(source, o);
      } catch (const std::invalid_argument& e) {
        refuse(path, fmt::format("the range: {}", e.what()));
      }
    });
    if (!multiple) return;
    const std::pair<uint64_t, uint32_t> m = multiple_of(s["multipleOf"], integer, path);
    const uint64_t divisor = m.first;  // not structured bindings: clang 14 cannot capture them
    const uint32_t scale = m.second;
    const std::shared_ptr<const Regex> texts = n.pattern;
    n.pattern = cached(fmt::format("multiple:{}/{}:{}", divisor, scale, source), path, [&] {
      try {
        return texts->with_multiple(divisor, scale, &pattern_work_);
      } catch (const std::invalid_argument& e) {
        refuse(path, fmt::format("'multipleOf': {}", e.what()));
      }
    });
  }

  // `multipleOf` read exactly from its JSON text as divisor x 10^-scale,
  // reduced to what the written numbers can tell apart: an integer is a
  // multiple of 2.5 when it is one of 5 (scale 0); a number has at most 16
  // fraction digits, so a finer scale divides out.
  std::pair<uint64_t, uint32_t> multiple_of(const json& v, bool integer, const std::string& path) {
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() <= 0)
      refuse(path, "'multipleOf' must be a number greater than 0");
    const std::string text = v.dump();
    std::string digits;
    int64_t scale = 0, exponent = 0;
    bool fraction = false;
    for (size_t i = 0; i < text.size(); ++i) {
      const char c = text[i];
      if (c == '.') {
        fraction = true;
      } else if (c == 'e' || c == 'E') {
        exponent = std::stoll(text.substr(i + 1));
        break;
      } else {
        digits += c;
        scale += fraction;
      }
    }
    scale -= exponent;
    while (digits.size() > 1 && digits.back() == '0') digits.pop_back(), --scale;
    while (digits.size() > 1 && digits.front() == '0') digits.erase(0, 1);
    constexpr uint64_t kMaxDivisor = 1000000000000ull;  // 10^12
    for (; scale < 0; ++scale) digits += '0';
    if (digits.size() > 13 || std::stoull(digits) > kMaxDivisor)
      refuse(path, fmt::format("'multipleOf' {} needs a divisor above 10^12", text));
    uint64_t divisor = std::stoull(digits);
    // x has at most `keep` fraction digits: x = X / 10^keep, and D x 10^-scale
    // divides it when D / gcd(D, 10^(scale - keep)) divides X.
    const int64_t keep = integer ? 0 : 16;
    for (int64_t i = 0; i < scale - keep && divisor % 2 == 0; ++i) divisor /= 2;
    for (int64_t i = 0; i < scale - keep && divisor % 5 == 0; ++i) divisor /= 5;
    return {divisor, uint32_t(std::min(scale, keep))};
  }

  // The automaton kept under `key`, or the one `build` makes, then kept for
  // the schema's other nodes, its states counted against the schema's bound.
  template <typename Build>
  std::shared_ptr<const Regex> cached(const std::string& key, const std::string& path, Build&& build) {
    if (auto it = patterns_.find(key); it != patterns_.end()) return it->second;
    std::shared_ptr<const Regex> r = build();
    pattern_states_ += r->states();
    if (pattern_states_ > JsonSchema::kMaxPatternStates)
      refuse(path, fmt::format("the schema's patterns and ranges need more than {} automaton states together",
                               JsonSchema::kMaxPatternStates));
    patterns_.emplace(key, r);
    return r;
  }

  std::map<std::string, std::shared_ptr<const Regex>> patterns_;
  int64_t pattern_work_ = Regex::kMaxBuildWork;
  size_t pattern_states_ = 0;
  JsonSchema out_;
  std::vector<Work> work_;
  std::vector<uint32_t> alias_;
  std::unordered_map<std::string, uint32_t> refs_;
  uint32_t any_value_ = JsonSchema::kNone, any_object_ = JsonSchema::kNone;
  size_t enum_values_ = 0;
};

std::shared_ptr<const JsonSchema> JsonSchema::compile(const nlohmann::ordered_json& schema) { return SchemaCompiler(schema).run(); }

std::shared_ptr<const JsonSchema> JsonSchema::any_object() {
  static const json empty = json::object();
  static const std::shared_ptr<const JsonSchema> s = SchemaCompiler(empty).any_object();
  return s;
}

}  // namespace areno::serve
