// OpenAI request validation and response building (spec tokens-api.md 3, 5.2).
#include "serve/openai.h"

#include <fmt/format.h>

#include <sys/random.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "models/phi4mm/config.h"
#include "serve/cfg.h"
#include "serve/grammar.h"

namespace areno::serve {

using nlohmann::json;

ApiError::ApiError(int status_, const std::string& message, std::string param_, std::string code_)
    : std::runtime_error(message), status(status_), param(std::move(param_)), code(std::move(code_)) {}

const char* error_type(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

json error_body(const ApiError& e) {
  json err = {{"message", e.what()}, {"type", error_type(e.status)}};
  err["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  err["code"] = e.code.empty() ? json(nullptr) : json(e.code);
  return {{"error", err}};
}

namespace {

template <typename J>
J parse_bounded(const std::string& text, int max_depth) {
  // The callback sees every container as it opens; throwing stops the parser
  // before it descends further (nlohmann's parser itself is iterative).
  struct TooDeep {};
  typename J::parser_callback_t cb = [max_depth](int depth, typename J::parse_event_t event, J&) {
    if ((event == J::parse_event_t::object_start || event == J::parse_event_t::array_start) && depth >= max_depth)
      throw TooDeep{};
    return true;
  };
  try {
    return J::parse(text, cb);
  } catch (const TooDeep&) {
    throw ApiError(400, fmt::format("the JSON body nests arrays and objects more than {} levels deep "
                                    "(the server's --max-json-depth)", max_depth));
  } catch (const typename J::parse_error& e) {
    throw ApiError(400, fmt::format("malformed JSON body: {}", e.what()));
  }
}

}  // namespace

json parse_json_bounded(const std::string& text, int max_depth) { return parse_bounded<json>(text, max_depth); }

nlohmann::ordered_json parse_ordered_json_bounded(const std::string& text, int max_depth) {
  return parse_bounded<nlohmann::ordered_json>(text, max_depth);
}

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// ---- field readers ---------------------------------------------------------

namespace {

ApiError bad(const std::string& field, const std::string& message) { return ApiError(400, message, field); }

// Present and not null.
bool has(const json& body, const char* key) { return body.contains(key) && !body[key].is_null(); }

bool get_bool(const json& body, const char* key, bool dflt) {
  if (!has(body, key)) return dflt;
  if (!body[key].is_boolean()) throw bad(key, fmt::format("'{}' must be a boolean (got {})", key, body[key].type_name()));
  return body[key].get<bool>();
}

// A number in the bounds table's range for its parameter (sampler.h).
double get_number(const json& body, const Bound& b, double dflt) {
  const char* key = b.name;
  if (!has(body, key)) return dflt;
  const json& v = body[key];
  if (!v.is_number()) throw bad(key, fmt::format("'{}' must be a number (got {})", key, v.type_name()));
  const double x = v.get<double>();
  if (!std::isfinite(x) || !b.contains(x)) throw bad(key, fmt::format("'{}' must be in {} (got {})", key, b.range(), x));
  return x;
}

int64_t as_int(const json& v, const std::string& field) {
  // Unsigned values past int64 would wrap to negative numbers the client never sent.
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    throw bad(field, fmt::format("'{}' is out of range: {} does not fit in a 64-bit signed integer", field, dump_json(v)));
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double x = v.get<double>();
    if (std::isfinite(x) && x == std::floor(x) && std::fabs(x) < 9.0e18) return int64_t(x);
  }
  throw bad(field, fmt::format("'{}' must be an integer (got {})", field, v.is_number() ? dump_json(v) : v.type_name()));
}

int64_t get_int(const json& body, const char* key, int64_t dflt, int64_t lo, int64_t hi) {
  if (!has(body, key)) return dflt;
  const int64_t x = as_int(body[key], key);
  if (x < lo || x > hi) {
    if (hi == std::numeric_limits<int64_t>::max())
      throw bad(key, fmt::format("'{}' must be >= {} (got {})", key, lo, x));
    throw bad(key, fmt::format("'{}' must be in [{}, {}] (got {})", key, lo, hi, x));
  }
  return x;
}

constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

int64_t token_id(const json& v, const std::string& field, int64_t vocab) {
  const int64_t id = as_int(v, field);
  if (id < 0 || id >= vocab) throw bad(field, fmt::format("'{}': token id {} is outside the vocabulary [0, {})", field, id, vocab));
  return id;
}

// Fields both endpoints share.
// One constrained output per request: a second field asking for one is a 400.
void set_constraint(ApiRequest& r, const std::string& field) {
  if (!r.constraint_field.empty() && r.constraint_field != field)
    throw bad(field, fmt::format("'{}' and '{}' both constrain the output; give one", r.constraint_field, field));
  r.constraint_field = field;
}

void parse_choices(const json& v, const std::string& field, ApiRequest& r) {
  if (!v.is_array() || v.empty() || v.size() > OutputGrammar::kMaxNames)
    throw bad(field, fmt::format("'{}' must be an array of 1 to {} strings", field, OutputGrammar::kMaxNames));
  for (const json& c : v) {
    if (!c.is_string() || c.get_ref<const std::string&>().empty() ||
        c.get_ref<const std::string&>().size() > OutputGrammar::kMaxNameBytes)
      throw bad(field, fmt::format("'{}' must hold strings of 1 to {} bytes", field, OutputGrammar::kMaxNameBytes));
    r.choices.push_back(c.get<std::string>());
  }
}

// A constraint given as text (a regular expression, a GBNF grammar) of at
// most `max_bytes`: into `out`, `given` set (the empty text is one).
void parse_text(const json& v, const std::string& field, const char* kind, size_t max_bytes, std::string& out, bool& given) {
  if (!v.is_string()) throw bad(field, fmt::format("'{}' must be a string ({})", field, kind));
  if (v.get_ref<const std::string&>().size() > max_bytes)
    throw bad(field, fmt::format("'{}' must have at most {} bytes", field, max_bytes));
  out = v.get<std::string>();
  given = true;
}

void parse_regex(const json& v, const std::string& field, ApiRequest& r) {
  parse_text(v, field, "a regular expression", Regex::kMaxPatternBytes, r.regex, r.has_regex);
}

void parse_grammar(const json& v, const std::string& field, ApiRequest& r) {
  parse_text(v, field, "a GBNF grammar", Cfg::kMaxGrammarBytes, r.grammar, r.has_grammar);
}

// vLLM's guided decoding fields and their newer form, structured_outputs:
// JSON schemas, choices, regular expressions and grammars are enforced;
// anything else is refused by name, never ignored.
void parse_guided(const json& body, ApiRequest& r) {
  if (has(body, "guided_whitespace_pattern"))
    throw bad("guided_whitespace_pattern",
              "'guided_whitespace_pattern' is not supported (supported: guided_json, guided_choice, guided_regex, "
              "guided_grammar, response_format json_object and json_schema)");
  if (has(body, "guided_grammar")) {
    set_constraint(r, "guided_grammar");
    parse_grammar(body["guided_grammar"], "guided_grammar", r);
  }
  if (has(body, "guided_regex")) {
    set_constraint(r, "guided_regex");
    parse_regex(body["guided_regex"], "guided_regex", r);
  }
  if (has(body, "guided_json")) {
    const json& g = body["guided_json"];
    if (!g.is_object() && !g.is_string()) throw bad("guided_json", "'guided_json' must be a JSON schema (an object or its JSON text)");
    set_constraint(r, "guided_json");
    r.schema_field = "guided_json";
  }
  if (has(body, "guided_choice")) {
    set_constraint(r, "guided_choice");
    parse_choices(body["guided_choice"], "guided_choice", r);
  }
  // llama.cpp's names (llama-server reads them beside its OpenAI fields too):
  // a client moving from it keeps its constraint instead of losing it unseen.
  if (has(body, "grammar")) {
    set_constraint(r, "grammar");
    parse_grammar(body["grammar"], "grammar", r);
  }
  if (has(body, "json_schema")) {
    if (!body["json_schema"].is_object()) throw bad("json_schema", "'json_schema' must be a JSON schema (an object)");
    set_constraint(r, "json_schema");
    r.schema_field = "json_schema";
  }
  if (has(body, "structured_outputs")) {
    const json& so = body["structured_outputs"];
    if (!so.is_object()) throw bad("structured_outputs", "'structured_outputs' must be an object");
    for (auto it = so.begin(); it != so.end(); ++it) {
      const std::string field = "structured_outputs." + it.key();
      if (it.value().is_null()) continue;
      if (it.key() == "json") {
        if (!it.value().is_object() && !it.value().is_string())
          throw bad(field, "'structured_outputs.json' must be a JSON schema (an object or its JSON text)");
        set_constraint(r, "structured_outputs");
        r.schema_field = field;
      } else if (it.key() == "choice") {
        set_constraint(r, "structured_outputs");
        parse_choices(it.value(), field, r);
      } else if (it.key() == "regex") {
        set_constraint(r, "structured_outputs");
        parse_regex(it.value(), field, r);
      } else if (it.key() == "grammar") {
        set_constraint(r, "structured_outputs");
        parse_grammar(it.value(), field, r);
      } else if (it.key() == "json_object") {
        if (!it.value().is_boolean()) throw bad(field, "'structured_outputs.json_object' must be a boolean");
        if (it.value().get<bool>()) set_constraint(r, "structured_outputs"), r.json_object = true;
      } else {
        throw bad(field, fmt::format("'{}' is not supported (supported: json, choice, regex, grammar, json_object)", field));
      }
    }
    if (int(!r.schema_field.empty()) + int(!r.choices.empty()) + int(r.json_object) + int(r.has_regex) +
            int(r.has_grammar) >
        1)
      throw bad("structured_outputs", "'structured_outputs' must hold one of json, choice, regex, grammar and json_object");
  }
}

void parse_common(const json& body, const ApiLimits& lim, ApiRequest& r) {
  if (!body.is_object()) throw ApiError(400, fmt::format("the request body must be a JSON object (got {})", body.type_name()));
  if (has(body, "model")) {
    if (!body["model"].is_string()) throw bad("model", "'model' must be a string");
    r.model = body["model"].get<std::string>();
  }
  SamplingParams& p = r.params;
  p.n = get_int(body, "n", 1, 1, lim.max_n);
  const SamplingParams defaults;
  p.temperature = get_number(body, bounds::temperature, defaults.temperature);
  p.top_p = get_number(body, bounds::top_p, defaults.top_p);
  if (has(body, "top_k")) {
    p.top_k = as_int(body["top_k"], "top_k");
    if (p.top_k < bounds::kMinTopK)
      throw bad("top_k", fmt::format("'top_k' must be -1 (off), 0 (off) or >= 1 (got {})", p.top_k));
  }
  p.min_p = get_number(body, bounds::min_p, defaults.min_p);
  p.presence_penalty = get_number(body, bounds::presence_penalty, defaults.presence_penalty);
  p.frequency_penalty = get_number(body, bounds::frequency_penalty, defaults.frequency_penalty);
  p.repetition_penalty = get_number(body, bounds::repetition_penalty, defaults.repetition_penalty);
  if (has(body, "seed")) {
    const int64_t s = as_int(body["seed"], "seed");
    p.seed = uint64_t(s);
  }
  if (has(body, "stop")) {
    const json& s = body["stop"];
    if (s.is_string()) {
      p.stop.push_back(s.get<std::string>());
    } else if (s.is_array()) {
      if (s.size() > 4) throw bad("stop", fmt::format("'stop' takes at most 4 strings (got {})", s.size()));
      for (const json& x : s) {
        if (!x.is_string()) throw bad("stop", "'stop' must be a string or an array of strings");
        p.stop.push_back(x.get<std::string>());
      }
    } else {
      throw bad("stop", "'stop' must be a string or an array of strings");
    }
    for (const std::string& x : p.stop)
      if (x.empty()) throw bad("stop", "'stop' strings must not be empty");
  }
  if (has(body, "stop_token_ids")) {
    const json& s = body["stop_token_ids"];
    if (!s.is_array()) throw bad("stop_token_ids", "'stop_token_ids' must be an array of token ids");
    for (const json& x : s) p.stop_token_ids.push_back(token_id(x, "stop_token_ids", lim.vocab_size));
  }
  if (has(body, "logit_bias")) {
    const json& b = body["logit_bias"];
    if (!b.is_object()) throw bad("logit_bias", "'logit_bias' must be an object mapping token ids to biases");
    for (auto it = b.begin(); it != b.end(); ++it) {
      int64_t id = -1;
      try {
        size_t used = 0;
        id = std::stoll(it.key(), &used);
        if (used != it.key().size()) id = -1;
      } catch (const std::exception&) {
        id = -1;
      }
      if (id < 0 || id >= lim.vocab_size)
        throw bad("logit_bias", fmt::format("'logit_bias': key '{}' is not a token id in [0, {})", it.key(), lim.vocab_size));
      if (!it.value().is_number()) throw bad("logit_bias", "'logit_bias' values must be numbers");
      const double v = it.value().get<double>();
      if (!bounds::logit_bias.contains(v))
        throw bad("logit_bias", fmt::format("'logit_bias' values must be in {} (got {} for {})",
                                            bounds::logit_bias.range(), v, it.key()));
      p.logit_bias.emplace_back(id, v);
    }
  }
  p.ignore_eos = get_bool(body, "ignore_eos", false);
  p.skip_special_tokens = get_bool(body, "skip_special_tokens", true);
  p.include_stop_str_in_output = get_bool(body, "include_stop_str_in_output", false);
  r.return_tokens_as_token_ids = get_bool(body, "return_tokens_as_token_ids", false);
  r.return_token_ids = get_bool(body, "return_token_ids", false);
  if (has(body, "allowed_token_ids")) {
    const json& a = body["allowed_token_ids"];
    if (!a.is_array() || a.empty() || int64_t(a.size()) > lim.vocab_size)
      throw bad("allowed_token_ids", fmt::format("'allowed_token_ids' must be a non-empty array of at most {} token ids",
                                                 lim.vocab_size));
    for (size_t i = 0; i < a.size(); ++i) {
      const int64_t id = as_int(a[i], "allowed_token_ids");
      if (id < 0 || id >= lim.vocab_size)
        throw bad("allowed_token_ids", fmt::format("'allowed_token_ids': {} is not a token id in [0, {})", id, lim.vocab_size));
      p.allowed_token_ids.push_back(id);
    }
  }
  if (has(body, "bad_words")) {
    const json& w = body["bad_words"];
    if (!w.is_array() || int64_t(w.size()) > bounds::kMaxBadWords)
      throw bad("bad_words", fmt::format("'bad_words' must be an array of at most {} strings", bounds::kMaxBadWords));
    for (const json& x : w) {
      if (!x.is_string() || !has_non_blank(x.get_ref<const std::string&>()) ||
          int64_t(x.get_ref<const std::string&>().size()) > bounds::kMaxBadWordBytes)
        throw bad("bad_words", fmt::format("'bad_words' entries must be strings with a non-blank character, of at "
                                           "most {} bytes", bounds::kMaxBadWordBytes));
      p.bad_words.push_back(x.get<std::string>());
    }
  }
  // vLLM's fields this server does not run: refused by name, never ignored.
  if (get_bool(body, "use_beam_search", false))
    throw bad("use_beam_search", "'use_beam_search' is not supported (sampling and greedy decoding only)");
  if (has(body, "logits_processors") && !(body["logits_processors"].is_array() && body["logits_processors"].empty()))
    throw bad("logits_processors", "'logits_processors' is not supported (the server runs no client code)");
  if (has(body, "priority") && as_int(body["priority"], "priority") != 0)
    throw bad("priority", "'priority' other than 0 is not supported (requests are served first come, first served)");
  r.image_max_crops = parse_mm_processor_kwargs(body);
  if (has(body, "truncate_prompt_tokens"))
    throw bad("truncate_prompt_tokens", "'truncate_prompt_tokens' is not supported: a prompt longer than the "
                                        "context is refused, never cut");
  if (has(body, "cache_salt")) {
    const json& s = body["cache_salt"];
    if (!s.is_string() || s.get_ref<const std::string&>().empty() || s.get_ref<const std::string&>().size() > 1024)
      throw bad("cache_salt", "'cache_salt' must be a non-empty string of at most 1024 bytes");
    r.cache_salt = s.get<std::string>();
  }
  r.stream = get_bool(body, "stream", false);
  if (has(body, "stream_options")) {
    const json& so = body["stream_options"];
    if (!so.is_object()) throw bad("stream_options", "'stream_options' must be an object");
    if (!r.stream) throw bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
    r.include_usage = get_bool(so, "include_usage", false);
    r.continuous_usage = r.include_usage && get_bool(so, "continuous_usage_stats", false);
  }
  if (has(body, "prompt_logprobs")) {
    // An integer as vLLM's; a boolean counts as 0 or 1 (pydantic's coercion,
    // which clients written against vLLM rely on).
    const json& v = body["prompt_logprobs"];
    r.prompt_logprobs = v.is_boolean() ? int64_t(v.get<bool>()) : get_int(body, "prompt_logprobs", -1, 0, lim.max_logprobs);
    if (r.stream) throw bad("prompt_logprobs", "'prompt_logprobs' is not supported with 'stream'");
    r.params.prompt_logprobs = std::max(r.params.prompt_logprobs, r.prompt_logprobs);
  }
  parse_guided(body, r);
}

void parse_min_tokens(const json& body, ApiRequest& r) {
  r.params.min_tokens = get_int(body, "min_tokens", 0, 0, kMaxInt);
  if (r.max_tokens_given && r.params.min_tokens > r.params.max_tokens)
    throw bad("min_tokens", fmt::format("'min_tokens' ({}) must not exceed the maximum number of tokens ({})",
                                        r.params.min_tokens, r.params.max_tokens));
}

}  // namespace

ApiRequest parse_chat_request(const json& body, const ApiLimits& lim) {
  ApiRequest r;
  r.kind = ApiKind::chat;
  parse_common(body, lim, r);
  if (!body.contains("messages")) throw bad("messages", "'messages' is required");
  if (!body["messages"].is_array()) throw bad("messages", fmt::format("'messages' must be an array (got {})", body["messages"].type_name()));
  if (body["messages"].empty()) throw bad("messages", "'messages' must be a non-empty array");
  r.messages = body["messages"];

  for (const char* key : {"max_completion_tokens", "max_tokens"}) {
    if (has(body, key)) {
      r.params.max_tokens = get_int(body, key, 0, 1, kMaxInt);
      r.max_tokens_given = true;
      break;
    }
  }
  if (!r.max_tokens_given) r.params.max_tokens = lim.default_max_tokens;
  parse_min_tokens(body, r);

  r.logprobs = get_bool(body, "logprobs", false);
  if (has(body, "top_logprobs")) {
    r.top_logprobs = get_int(body, "top_logprobs", 0, 0, lim.max_logprobs);
    if (!r.logprobs) throw bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
  }
  r.params.logprobs = r.logprobs ? r.top_logprobs : -1;

  if (has(body, "tools")) {
    const json& t = body["tools"];
    if (!t.is_array()) throw bad("tools", "'tools' must be an array");
    if (t.empty()) throw bad("tools", "'tools' must not be an empty array (leave it out instead)");
    for (size_t i = 0; i < t.size(); ++i) {
      const json& f = t[i].is_object() ? t[i].value("function", json()) : json();
      if (!f.is_object() || !f.contains("name") || !f["name"].is_string())
        throw bad(fmt::format("tools[{}]", i), fmt::format("tools[{}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", i));
    }
    r.tools = t;
    r.tool_choice = "auto";
  }
  if (has(body, "tool_choice")) {
    const json& tc = body["tool_choice"];
    if (tc.is_string()) {
      const std::string s = tc.get<std::string>();
      if (s != "none" && s != "auto" && s != "required")
        throw bad("tool_choice", fmt::format("'tool_choice' must be none, auto, required or a function (got '{}')", s));
      if (s != "none" && r.tools.is_null()) throw bad("tool_choice", fmt::format("'tool_choice' '{}' needs 'tools'", s));
      r.tool_choice = s;
      if (s == "required")
        for (const json& t : r.tools) r.forced_tools.push_back(t["function"]["name"].get<std::string>());
    } else if (tc.is_object() && tc.contains("function") && tc["function"].is_object() &&
               tc["function"].contains("name") && tc["function"]["name"].is_string()) {
      const std::string name = tc["function"]["name"].get<std::string>();
      bool known = false;
      if (r.tools.is_array())
        for (const json& t : r.tools) known = known || t["function"]["name"] == name;
      if (!known) throw bad("tool_choice", fmt::format("'tool_choice' names function '{}', which is not in 'tools'", name));
      r.tool_choice = name;
      r.forced_tools = {name};
    } else {
      throw bad("tool_choice", "'tool_choice' must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
  }
  if (has(body, "response_format")) {
    const json& rf = body["response_format"];
    if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string())
      throw bad("response_format", "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}");
    const std::string type = rf["type"].get<std::string>();
    if (type == "json_object" || type == "json_schema") set_constraint(r, "response_format");
    if (type == "json_object") {
      r.json_object = true;
    } else if (type == "json_schema") {
      const json* js = rf.contains("json_schema") ? &rf["json_schema"] : nullptr;
      if (!js || !js->is_object())
        throw bad("response_format.json_schema",
                  "'response_format' json_schema needs 'json_schema': {\"name\": ..., \"schema\": {...}}");
      const json* name = js->contains("name") ? &(*js)["name"] : nullptr;
      if (!name || !name->is_string() || name->get<std::string>().empty() || name->get<std::string>().size() > 64 ||
          !std::all_of(name->get_ref<const std::string&>().begin(), name->get_ref<const std::string&>().end(),
                       [](char c) { return std::isalnum(uint8_t(c)) || c == '_' || c == '-'; }))
        throw bad("response_format.json_schema.name",
                  "'response_format.json_schema.name' must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -");
      if (!js->contains("schema") || !(*js)["schema"].is_object())
        throw bad("response_format.json_schema.schema", "'response_format.json_schema.schema' must be a JSON schema object");
      if (js->contains("strict") && !(*js)["strict"].is_boolean() && !(*js)["strict"].is_null())
        throw bad("response_format.json_schema.strict", "'response_format.json_schema.strict' must be a boolean");
      r.schema_field = "response_format.json_schema.schema";
    } else if (type != "text") {
      throw bad("response_format", fmt::format("'response_format' type '{}' is not supported (use \"text\", "
                                               "\"json_object\" or \"json_schema\")",
                                               type));
    }
  }
  if (!r.forced_tools.empty()) set_constraint(r, "tool_choice");
  // "auto" with no other constraint: a call the model begins is constrained (AutoToolCall).
  if (r.tool_choice == "auto" && r.constraint_field.empty())
    for (const json& t : r.tools) r.auto_tools.push_back(t["function"]["name"].get<std::string>());
  if (has(body, "modalities")) {
    const json& m = body["modalities"];
    if (!m.is_array()) throw bad("modalities", "'modalities' must be an array");
    for (const json& x : m)
      if (x != "text") throw bad("modalities", "this model only produces text ('modalities': [\"text\"])");
  }
  r.add_generation_prompt = get_bool(body, "add_generation_prompt", true);
  r.continue_final_message = get_bool(body, "continue_final_message", false);
  if (r.continue_final_message && r.add_generation_prompt)
    throw bad("continue_final_message",
              "'continue_final_message' and 'add_generation_prompt' cannot both be true (send \"add_generation_prompt\": "
              "false to continue the last message)");
  const json& last = r.messages.back();
  if (get_bool(body, "echo", false) && last.is_object() && last.value("role", "") == "assistant") {
    r.chat_echo = true;
    const json content = last.contains("content") ? last["content"] : json();
    if (content.is_string()) {
      r.echo_prefix = content.get<std::string>();
    } else if (content.is_array()) {  // its text parts, as the template joins them
      for (const json& part : content)
        if (part.is_object() && part.value("type", "") == "text" && part.contains("text") && part["text"].is_string())
          r.echo_prefix += (r.echo_prefix.empty() ? "" : "\n") + part["text"].get<std::string>();
    }
  }
  return r;
}

namespace {

// A function's `parameters` (none: it takes no arguments, `{}`); throws
// std::invalid_argument for a schema outside the subset.
std::shared_ptr<const JsonSchema> compile_parameters(const nlohmann::ordered_json& function) {
  static const nlohmann::ordered_json none = {{"type", "object"}, {"properties", nlohmann::ordered_json::object()}};
  return JsonSchema::compile(function.contains("parameters") && !function["parameters"].is_null() ? function["parameters"]
                                                                                                  : none);
}

}  // namespace

void compile_output_schemas(const nlohmann::ordered_json& body, ApiRequest& r) {
  using ojson = nlohmann::ordered_json;
  if (!r.schema_field.empty()) {
    const ojson* at = &body;
    for (size_t i = 0; i <= r.schema_field.size();) {
      const size_t dot = std::min(r.schema_field.find('.', i), r.schema_field.size());
      at = &at->at(r.schema_field.substr(i, dot - i));
      i = dot + 1;
    }
    try {
      // A string holds the schema's JSON (vLLM's guided_json takes either).
      r.output_schema = at->is_string()
                            ? JsonSchema::compile(parse_ordered_json_bounded(at->get<std::string>(), kDefaultMaxJsonDepth))
                            : JsonSchema::compile(*at);
    } catch (const std::invalid_argument& e) {
      throw bad(r.schema_field, fmt::format("'{}': {}", r.schema_field, e.what()));
    } catch (const ApiError& e) {
      throw bad(r.schema_field, fmt::format("'{}': {}", r.schema_field, e.what()));
    }
  }
  r.forced_schemas.clear();
  r.auto_schemas.clear();
  if (!r.auto_tools.empty()) {
    // tool_choice "auto": each tool's parameters where the subset covers
    // them, else any object; past the node budget, no constraint at all (the
    // request stays valid: "auto" promised free text before).
    size_t nodes = 0;
    for (const ojson& t : body.at("tools")) {
      std::shared_ptr<const JsonSchema> schema;
      try {
        schema = compile_parameters(t["function"]);
      } catch (const std::invalid_argument&) {
      }
      if (schema && (nodes += schema->size()) > JsonSchema::kMaxRequestNodes) {
        r.auto_tools.clear();
        r.auto_schemas.clear();
        break;
      }
      r.auto_schemas.push_back(std::move(schema));
    }
  }
  if (r.forced_tools.empty()) return;
  size_t nodes = 0;
  const ojson& tools = body.at("tools");
  for (const std::string& name : r.forced_tools) {
    size_t i = 0;
    while (i < tools.size() && tools[i]["function"]["name"] != name) ++i;
    if (i == tools.size()) throw std::logic_error("compile_output_schemas: a forced tool is not in 'tools'");
    const ojson& f = tools[i]["function"];
    const std::string field = fmt::format("tools[{}].function.parameters", i);
    const bool strict = f.contains("strict") && f["strict"].is_boolean() && f["strict"].get<bool>();
    std::shared_ptr<const JsonSchema> schema;
    try {
      schema = compile_parameters(f);
    } catch (const std::invalid_argument& e) {
      // As OpenAI: a function's parameters bind its arguments when it is
      // `strict`; otherwise a schema outside the subset leaves them any JSON
      // object (what a forced call gave before schemas were enforced).
      if (strict) throw bad(field, fmt::format("'{}' (tool '{}', strict, forced by 'tool_choice'): {}", field, name, e.what()));
    }
    if (schema && (nodes += schema->size()) > JsonSchema::kMaxRequestNodes)
      throw bad(field, fmt::format("'{}': the forced tools' schemas need more than {} nodes together", field,
                                   JsonSchema::kMaxRequestNodes));
    r.forced_schemas.push_back(std::move(schema));
  }
}

ApiRequest parse_completion_request(const json& body, const ApiLimits& lim) {
  ApiRequest r;
  r.kind = ApiKind::completion;
  parse_common(body, lim, r);
  r.echo = get_bool(body, "echo", false);
  if (has(body, "max_tokens")) {
    // max_tokens 0 with echo scores the prompt without generating.
    r.params.max_tokens = get_int(body, "max_tokens", 0, r.echo ? 0 : 1, kMaxInt);
    r.max_tokens_given = true;
  } else {
    r.params.max_tokens = lim.completion_default_max_tokens;
  }
  parse_min_tokens(body, r);
  if (has(body, "logprobs")) {
    if (body["logprobs"].is_boolean()) throw bad("logprobs", "'logprobs' of /v1/completions is an integer (the number of top tokens)");
    r.completion_logprobs = get_int(body, "logprobs", -1, 0, lim.max_logprobs);
  }
  r.params.logprobs = r.completion_logprobs;
  if (r.echo && r.completion_logprobs >= 0)
    r.params.prompt_logprobs = std::max(r.params.prompt_logprobs, r.completion_logprobs);
  if (has(body, "suffix")) {
    if (!body["suffix"].is_string() || !body["suffix"].get<std::string>().empty())
      throw bad("suffix", "'suffix' is not supported");
  }
  if (has(body, "best_of") && as_int(body["best_of"], "best_of") != r.params.n)
    throw bad("best_of", "'best_of' other than 'n' is not supported");

  if (!has(body, "prompt")) throw bad("prompt", "'prompt' is required");
  const json& p = body["prompt"];
  auto is_id_list = [](const json& a) {
    if (!a.is_array() || a.empty()) return false;
    for (const json& x : a)
      if (!x.is_number()) return false;
    return true;
  };
  if (p.is_string()) {
    r.prompts.push_back(p);
  } else if (is_id_list(p)) {
    r.prompts.push_back(p);
  } else if (p.is_array() && !p.empty()) {
    for (const json& x : p) {
      if (!x.is_string() && !is_id_list(x))
        throw bad("prompt", "'prompt' must be a string, an array of strings, an array of token ids or an array of arrays "
                            "of token ids");
      r.prompts.push_back(x);
    }
  } else {
    throw bad("prompt", "'prompt' must be a non-empty string, array of strings, array of token ids or array of arrays "
                        "of token ids");
  }
  if (int64_t(r.prompts.size()) > lim.max_prompts)
    throw bad("prompt", fmt::format("at most {} prompts per request (got {})", lim.max_prompts, r.prompts.size()));
  return r;
}

std::vector<std::vector<int64_t>> completion_prompt_ids(const ApiRequest& req, const tok::Tokenizer& tokenizer,
                                                        int64_t vocab) {
  std::vector<std::vector<int64_t>> out;
  for (size_t i = 0; i < req.prompts.size(); ++i) {
    const json& p = req.prompts[i];
    const std::string field = req.prompts.size() == 1 ? "prompt" : fmt::format("prompt[{}]", i);
    std::vector<int64_t> ids;
    if (p.is_string()) {
      try {
        for (tok::TokenId t : tokenizer.encode(p.get<std::string>())) ids.push_back(t);
      } catch (const std::exception& e) {
        throw bad(field, fmt::format("'{}': {}", field, e.what()));
      }
    } else {
      for (const json& x : p) ids.push_back(token_id(x, field, vocab));
    }
    if (ids.empty()) throw bad(field, fmt::format("'{}' must not be empty", field));
    out.push_back(std::move(ids));
  }
  return out;
}

// ---- responses -------------------------------------------------------------

void ChoiceOutput::add(const RequestOutput& o) {
  tokens.insert(tokens.end(), o.tokens.begin(), o.tokens.end());
  text += o.text;
  logprobs.insert(logprobs.end(), o.logprobs.begin(), o.logprobs.end());
  if (o.finish != FinishReason::none) {
    finish = o.finish;
    stop_reason = o.stop_reason;
  }
}

json Usage::to_json() const {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

int64_t parse_mm_processor_kwargs(const json& body) {
  if (!body.is_object() || !body.contains("mm_processor_kwargs") || body["mm_processor_kwargs"].is_null()) return 0;
  const json& k = body["mm_processor_kwargs"];
  if (!k.is_object()) throw bad("mm_processor_kwargs", "'mm_processor_kwargs' must be an object");
  int64_t crops = 0;
  for (const auto& [key, value] : k.items()) {
    if (key != "dynamic_hd")
      throw bad("mm_processor_kwargs." + key,
                fmt::format("'mm_processor_kwargs.{}' is not a setting of this model's processor (dynamic_hd only)",
                            key.size() > 64 ? key.substr(0, 64) + "..." : key));
    try {
      crops = phi4mm::parse_dynamic_hd(value, "'mm_processor_kwargs.dynamic_hd' (the most HD crops per image)");
    } catch (const std::runtime_error& e) {
      throw bad("mm_processor_kwargs.dynamic_hd", e.what());
    }
  }
  return crops;
}

std::string new_response_id(const std::string& prefix) {
  // From the kernel's random source, not a seeded generator: a stored
  // response's id is what lets a client read it, so ids must not be
  // predictable from the ones a client has seen.
  unsigned char b[16];
  size_t got = 0;
  while (got < sizeof b) {
    const ssize_t n = getrandom(b + got, sizeof b - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error(fmt::format("getrandom failed: {}", std::strerror(errno)));
    got += size_t(n);
  }
  std::string id = prefix;
  for (unsigned char c : b) id += fmt::format("{:02x}", c);
  return id;
}

json stop_reason_json(const ChoiceOutput& c, const SamplingParams& p) {
  if (c.finish != FinishReason::stop || c.stop_reason.empty()) return nullptr;
  for (const std::string& s : p.stop)
    if (s == c.stop_reason) return s;
  // A stop token id (eos ids included) is reported as a number, as vLLM does.
  bool digits = true;
  for (char ch : c.stop_reason) digits = digits && ch >= '0' && ch <= '9';
  if (digits && c.stop_reason.size() < 19) return std::stoll(c.stop_reason);
  return c.stop_reason;
}

namespace {

float clamp_lp(float lp) { return std::isfinite(lp) ? lp : -9999.0f; }

std::string token_text(const tok::Tokenizer& t, int64_t id, bool as_ids) {
  if (as_ids) return fmt::format("token_id:{}", id);
  const tok::TokenId tid = tok::TokenId(id);
  return t.decode(std::span<const tok::TokenId>(&tid, 1));
}

json token_bytes(const tok::Tokenizer& t, int64_t id) {
  const tok::TokenId tid = tok::TokenId(id);
  const std::string b = t.decode_bytes(std::span<const tok::TokenId>(&tid, 1));
  json arr = json::array();
  for (unsigned char c : b) arr.push_back(int(c));
  return arr;
}

const char* finish_name(FinishReason f) {
  const char* n = finish_reason_name(f);
  return n ? n : "stop";
}

}  // namespace

json chat_logprobs_json(const tok::Tokenizer& t, const std::vector<TokenLogprob>& lps, int64_t top_k, bool as_ids) {
  json content = json::array();
  for (const TokenLogprob& lp : lps) {
    json top = json::array();
    for (size_t i = 0; i < lp.top.size() && int64_t(i) < top_k; ++i)
      top.push_back({{"token", token_text(t, lp.top[i].first, as_ids)},
                     {"logprob", clamp_lp(lp.top[i].second)},
                     {"bytes", token_bytes(t, lp.top[i].first)}});
    content.push_back({{"token", token_text(t, lp.token, as_ids)},
                       {"logprob", clamp_lp(lp.logprob)},
                       {"bytes", token_bytes(t, lp.token)},
                       {"top_logprobs", top}});
  }
  return {{"content", content}, {"refusal", nullptr}};
}

json completion_logprobs_json(const tok::Tokenizer& t, const std::vector<int64_t>& prompt_ids,
                              const std::vector<std::optional<TokenLogprob>>& prompt_lps,
                              const std::vector<TokenLogprob>& lps, bool as_ids, int64_t offset) {
  json tokens = json::array(), token_lps = json::array(), tops = json::array(), offsets = json::array();
  auto add = [&](int64_t id, const TokenLogprob* lp) {
    const std::string text = token_text(t, id, as_ids);
    tokens.push_back(text);
    offsets.push_back(offset);
    offset += int64_t(as_ids ? 0 : text.size());
    if (!lp) {
      token_lps.push_back(nullptr);
      tops.push_back(nullptr);
      return;
    }
    token_lps.push_back(clamp_lp(lp->logprob));
    // As vLLM: the sampled token first, then the top k.
    json top = json::object();
    top[text] = clamp_lp(lp->logprob);
    for (const auto& [tid, v] : lp->top) {
      const std::string k = token_text(t, tid, as_ids);
      if (!top.contains(k)) top[k] = clamp_lp(v);
    }
    tops.push_back(top);
  };
  for (size_t i = 0; i < prompt_ids.size(); ++i)
    add(prompt_ids[i], i < prompt_lps.size() && prompt_lps[i] ? &*prompt_lps[i] : nullptr);
  for (const TokenLogprob& lp : lps) add(lp.token, &lp);
  return {{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json prompt_logprobs_json(const tok::Tokenizer& t, const std::vector<int64_t>& prompt_ids,
                          const std::vector<std::optional<TokenLogprob>>& prompt_lps, int64_t top_k, bool as_ids) {
  json out = json::array();
  for (size_t i = 0; i < prompt_ids.size(); ++i) {
    const TokenLogprob* lp = i < prompt_lps.size() && prompt_lps[i] ? &*prompt_lps[i] : nullptr;
    if (!lp) {
      out.push_back(nullptr);
      continue;
    }
    auto entry = [&](int64_t id, float logprob, int64_t rank) {
      return json{{"logprob", clamp_lp(logprob)}, {"rank", rank}, {"decoded_token", token_text(t, id, as_ids)}};
    };
    json pos = json::object();
    pos[std::to_string(lp->token)] = entry(lp->token, lp->logprob, lp->rank);
    for (size_t k = 0; k < lp->top.size() && int64_t(k) < top_k; ++k) {
      const std::string key = std::to_string(lp->top[k].first);
      if (!pos.contains(key)) pos[key] = entry(lp->top[k].first, lp->top[k].second, int64_t(k) + 1);
    }
    out.push_back(std::move(pos));
  }
  return out;
}

// ---- tool calls --------------------------------------------------------------

namespace {

// End (one past) of the JSON array or object starting at text[start], honouring
// strings; npos when unbalanced.
size_t match_bracket(const std::string& text, size_t start) {
  int depth = 0;
  bool in_str = false, esc = false;
  for (size_t i = start; i < text.size(); ++i) {
    const char c = text[i];
    if (in_str) {
      if (esc) esc = false;
      else if (c == '\\') esc = true;
      else if (c == '"') in_str = false;
      continue;
    }
    if (c == '"') in_str = true;
    else if (c == '[' || c == '{') ++depth;
    else if (c == ']' || c == '}') {
      if (--depth == 0) return i + 1;
    }
  }
  return std::string::npos;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return {};
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::optional<json> calls_from(const json& parsed, const json& tools) {
  json list = parsed.is_array() ? parsed : json::array({parsed});
  if (list.empty()) return std::nullopt;
  json calls = json::array();
  for (const json& c : list) {
    if (!c.is_object() || !c.contains("name") || !c["name"].is_string()) return std::nullopt;
    const std::string name = c["name"].get<std::string>();
    bool known = !tools.is_array();
    if (tools.is_array())
      for (const json& t : tools) known = known || (t.contains("function") && t["function"].value("name", "") == name);
    if (!known) return std::nullopt;
    json args = c.contains("arguments") ? c["arguments"] : c.value("parameters", json::object());
    const std::string arg_text = args.is_string() ? args.get<std::string>() : dump_json(args);
    calls.push_back({{"id", new_response_id("call_")},
                     {"type", "function"},
                     {"function", {{"name", name}, {"arguments", arg_text}}}});
  }
  return calls;
}

}  // namespace

ToolCallParse parse_tool_calls(const std::string& text, const json& tools) {
  ToolCallParse r;
  r.content = text.empty() ? json(nullptr) : json(text);
  size_t begin = std::string::npos, body = 0, end = 0;
  static const std::string kOpen = "<|tool_call|>", kClose = "<|/tool_call|>", kFunctools = "functools";
  // The JSON in text[from, to) as calls; the text outside [begin, after) stays content.
  auto accept = [&](size_t from, size_t to, size_t after) {
    json parsed;
    try {
      parsed = parse_json_bounded(text.substr(from, to - from), kDefaultMaxJsonDepth);
    } catch (const ApiError&) {
      return;  // not a call: the text stays content
    }
    auto calls = calls_from(parsed, tools);
    if (!calls) return;
    r.found = true;
    r.tool_calls = *calls;
    const std::string rest = trim(text.substr(0, begin) + text.substr(after));
    r.content = rest.empty() ? json(nullptr) : json(rest);
  };
  if ((begin = text.find(kOpen)) != std::string::npos) {
    body = begin + kOpen.size();
    const size_t close = text.find(kClose, body);
    const size_t json_start = text.find_first_of("[{", body);
    if (json_start == std::string::npos || (close != std::string::npos && json_start > close)) return r;
    const size_t json_end = match_bracket(text, json_start);
    if (json_end == std::string::npos) return r;
    if (close != std::string::npos && json_end > close) return r;
    accept(json_start, json_end, close == std::string::npos ? json_end : close + kClose.size());
    return r;
  }
  if ((begin = text.find(kFunctools + "[")) != std::string::npos) {
    body = begin + kFunctools.size();
    end = match_bracket(text, body);
    if (end == std::string::npos) return r;
    accept(body, end, end);
  }
  return r;
}

std::string ToolCallStreamer::push(std::string_view text) {
  held_ += text;
  if (in_call_) return "";
  static constexpr std::string_view kMarkers[] = {"<|tool_call|>", "functools["};
  size_t at = std::string::npos;
  for (std::string_view m : kMarkers) at = std::min(at, held_.find(m));
  // Held back: from a call's marker, or else from the longest end that could
  // begin one; with the whitespace before either (content keeps it only if
  // no call follows, as parse_tool_calls trims it).
  size_t keep = 0;
  if (at != std::string::npos) {
    keep = held_.size() - at;
    in_call_ = true;
  } else {
    for (std::string_view m : kMarkers)
      for (size_t k = std::min(m.size() - 1, held_.size()); k > keep; --k)
        if (std::string_view(held_).substr(held_.size() - k) == m.substr(0, k)) {
          keep = k;
          break;
        }
  }
  size_t cut = held_.size() - keep;
  while (cut > 0 && std::string_view(" \t\r\n").find(held_[cut - 1]) != std::string_view::npos) --cut;
  std::string out = held_.substr(0, cut);
  held_.erase(0, cut);
  return out;
}

ToolCallParse ToolCallStreamer::finish(const json& tools) {
  ToolCallParse r;
  if (in_call_) r = parse_tool_calls(held_, tools);
  if (!r.found) r.content = held_.empty() ? json(nullptr) : json(held_);
  held_.clear();
  in_call_ = false;
  return r;
}

// ---- whole responses ---------------------------------------------------------

json chat_response(const ResponseHeader& h, const ApiRequest& req, const tok::Tokenizer& t,
                   const std::vector<ChoiceOutput>& choices, const Usage& usage, const std::vector<int64_t>& prompt_ids,
                   const std::vector<std::optional<TokenLogprob>>& prompt_lps) {
  json out_choices = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceOutput& c = choices[i];
    json message = {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}};
    json finish = finish_name(c.finish);
    if (!req.tools.is_null() && req.tool_choice != "none") {
      ToolCallParse tc = parse_tool_calls(c.text, req.tools);
      if (tc.found) {
        message["content"] = tc.content;
        message["tool_calls"] = tc.tool_calls;
        finish = "tool_calls";
      }
    }
    if (req.chat_echo)
      message["content"] = req.echo_prefix + (message["content"].is_string() ? message["content"].get<std::string>() : "");
    out_choices.push_back({{"index", i},
                           {"message", message},
                           {"logprobs", req.logprobs ? chat_logprobs_json(t, c.logprobs, req.top_logprobs,
                                                                          req.return_tokens_as_token_ids)
                                                     : json(nullptr)},
                           {"finish_reason", finish},
                           {"stop_reason", stop_reason_json(c, req.params)}});
    if (req.return_token_ids) out_choices.back()["token_ids"] = c.tokens;
  }
  json out = {{"id", h.id},           {"object", "chat.completion"}, {"created", h.created}, {"model", h.model},
              {"system_fingerprint", nullptr}, {"choices", out_choices},  {"usage", usage.to_json()}};
  if (req.prompt_logprobs >= 0)
    out["prompt_logprobs"] = prompt_logprobs_json(t, prompt_ids, prompt_lps, req.prompt_logprobs,
                                                  req.return_tokens_as_token_ids);
  if (req.return_token_ids) out["prompt_token_ids"] = prompt_ids;
  return out;
}

json completion_response(const ResponseHeader& h, const ApiRequest& req, const tok::Tokenizer& t,
                         const std::vector<std::vector<int64_t>>& prompt_ids,
                         const std::vector<std::vector<std::optional<TokenLogprob>>>& prompt_lps,
                         const std::vector<ChoiceOutput>& choices, const Usage& usage) {
  json out_choices = json::array();
  const size_t n = size_t(req.params.n);
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceOutput& c = choices[i];
    const size_t p = i / n;
    std::string text;
    std::vector<int64_t> echo_ids;
    std::vector<std::optional<TokenLogprob>> echo_lps;
    if (req.echo && p < prompt_ids.size()) {
      echo_ids = prompt_ids[p];
      std::vector<tok::TokenId> tids(echo_ids.begin(), echo_ids.end());
      text = t.decode(tids, req.params.skip_special_tokens);
      if (p < prompt_lps.size()) echo_lps = prompt_lps[p];
      // The engine's top list is the larger of `logprobs` and `prompt_logprobs`.
      for (std::optional<TokenLogprob>& lp : echo_lps)
        if (lp && req.completion_logprobs >= 0 && int64_t(lp->top.size()) > req.completion_logprobs)
          lp->top.resize(size_t(req.completion_logprobs));
    }
    text += c.text;
    json lp = nullptr;
    if (req.completion_logprobs >= 0)
      lp = completion_logprobs_json(t, echo_ids, echo_lps, c.logprobs, req.return_tokens_as_token_ids);
    out_choices.push_back({{"index", i},
                           {"text", text},
                           {"logprobs", lp},
                           {"finish_reason", finish_name(c.finish)},
                           {"stop_reason", stop_reason_json(c, req.params)}});
    json& choice = out_choices.back();
    static const std::vector<std::optional<TokenLogprob>> kNone;
    if (req.prompt_logprobs >= 0)
      choice["prompt_logprobs"] = p < prompt_ids.size()
                                      ? prompt_logprobs_json(t, prompt_ids[p], p < prompt_lps.size() ? prompt_lps[p] : kNone,
                                                             req.prompt_logprobs, req.return_tokens_as_token_ids)
                                      : json(nullptr);
    if (req.return_token_ids) {
      choice["prompt_token_ids"] = p < prompt_ids.size() ? json(prompt_ids[p]) : json(nullptr);
      choice["token_ids"] = c.tokens;
    }
  }
  return {{"id", h.id},         {"object", "text_completion"}, {"created", h.created},
          {"model", h.model},   {"system_fingerprint", nullptr}, {"choices", out_choices},
          {"usage", usage.to_json()}};
}

json chat_chunk(const ResponseHeader& h, int64_t index, const json& delta, const json& logprobs, const json& finish,
                const json& stop_reason) {
  json choice = {{"index", index}, {"delta", delta}, {"logprobs", logprobs}, {"finish_reason", finish}};
  if (!finish.is_null()) choice["stop_reason"] = stop_reason;
  return {{"id", h.id},       {"object", "chat.completion.chunk"}, {"created", h.created},
          {"model", h.model}, {"choices", json::array({choice})}};
}

json completion_chunk(const ResponseHeader& h, int64_t index, const std::string& text, const json& logprobs,
                      const json& finish, const json& stop_reason) {
  json choice = {{"index", index}, {"text", text}, {"logprobs", logprobs}, {"finish_reason", finish}};
  if (!finish.is_null()) choice["stop_reason"] = stop_reason;
  return {{"id", h.id}, {"object", "text_completion"}, {"created", h.created}, {"model", h.model},
          {"choices", json::array({choice})}};
}

json usage_chunk(const ResponseHeader& h, ApiKind kind, const Usage& usage) {
  return {{"id", h.id},
          {"object", kind == ApiKind::chat ? "chat.completion.chunk" : "text_completion"},
          {"created", h.created},
          {"model", h.model},
          {"choices", json::array()},
          {"usage", usage.to_json()}};
}

std::string sse_event(const json& j) { return "data: " + dump_json(j) + "\n\n"; }

}  // namespace areno::serve
