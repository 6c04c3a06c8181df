#include "serve/responses.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "nn/io/atomic_file.h"

namespace areno::serve {

using nlohmann::json;
using ojson = nlohmann::ordered_json;

namespace {

ApiError bad(const std::string& field, const std::string& why) {
  return ApiError(400, fmt::format("'{}' {}", field, why), field);
}

bool present(const ojson& o, const char* key) { return o.contains(key) && !o[key].is_null(); }

const std::string& string_field(const ojson& o, const char* key, const std::string& path) {
  if (!o.contains(key) || !o[key].is_string()) throw bad(path + "." + key, "must be a string");
  return o[key].get_ref<const std::string&>();
}

// Sampling fields passed to the chat request as they are (the chat parser checks them).
constexpr const char* kPassThrough[] = {"model",         "temperature",     "top_p",      "top_k",
                                        "min_p",         "seed",            "repetition_penalty",
                                        "presence_penalty", "frequency_penalty", "stop", "stop_token_ids",
                                        "ignore_eos",    "min_tokens",      "logit_bias", "cache_salt",
                                        "skip_special_tokens", "top_logprobs", "allowed_token_ids", "bad_words",
                                        "mm_processor_kwargs"};

// Repeated in the response object when sent.
constexpr const char* kEchoed[] = {"instructions", "max_output_tokens", "metadata", "parallel_tool_calls",
                                   "user",         "tool_choice",       "tools",    "text",
                                   "service_tier", "prompt_cache_key",  "safety_identifier", "top_logprobs",
                                   "max_tool_calls"};

// A message item's content as chat content: a string, or chat parts.
ojson chat_content(const ojson& content, const std::string& path, bool assistant) {
  if (content.is_string()) return content;
  if (!content.is_array()) throw bad(path, "must be a string or an array of content parts");
  ojson parts = ojson::array();
  for (size_t i = 0; i < content.size(); ++i) {
    const ojson& p = content[i];
    const std::string where = fmt::format("{}[{}]", path, i);
    if (!p.is_object() || !p.contains("type") || !p["type"].is_string())
      throw bad(where, "must be an object with a string 'type'");
    const std::string& type = p["type"].get_ref<const std::string&>();
    if (type == "input_text" || type == "output_text" || type == "text") {
      parts.push_back({{"type", "text"}, {"text", string_field(p, "text", where)}});
    } else if (assistant) {
      throw bad(where + ".type", fmt::format("'{}' is not a part of an assistant message (output_text only)", type));
    } else if (type == "input_image") {
      if (present(p, "file_id"))
        throw bad(where + ".file_id", "is not supported: this server stores no files (send image_url, a data URL)");
      parts.push_back({{"type", "image_url"}, {"image_url", {{"url", string_field(p, "image_url", where)}}}});
    } else if (type == "input_audio") {
      if (!p.contains("input_audio")) throw bad(where + ".input_audio", "is required");
      parts.push_back({{"type", "input_audio"}, {"input_audio", p["input_audio"]}});
    } else {
      throw bad(where + ".type", fmt::format("'{}' is not supported (input_text, input_image or input_audio)", type));
    }
  }
  return parts;
}

// Input items as chat messages (consecutive calls and the message before
// them one assistant turn); `where_of[i]` names item i in errors.
void items_to_messages(const ojson& items, const std::vector<std::string>& where_of, ojson& messages,
                       std::vector<std::string>& message_from) {
  bool open_turn = false;  // the last message is an assistant turn that calls may join
  for (size_t i = 0; i < items.size(); ++i) {
    const ojson& item = items[i];
    const std::string& where = where_of[i];
    if (!item.is_object()) throw bad(where, fmt::format("must be an object (got {})", item.type_name()));
    const std::string type = present(item, "type") && item["type"].is_string() ? item["type"].get<std::string>()
                             : present(item, "type")                         ? std::string("?")
                                                                             : std::string("message");
    if (type == "message") {
      const std::string& role = string_field(item, "role", where);
      if (role != "user" && role != "assistant" && role != "system" && role != "developer")
        throw bad(where + ".role", fmt::format("'{}' is not a role (user, assistant, system or developer)", role));
      if (!item.contains("content")) throw bad(where + ".content", "is required");
      messages.push_back(
          {{"role", role}, {"content", chat_content(item["content"], where + ".content", role == "assistant")}});
      message_from.push_back(where);
      open_turn = role == "assistant";
    } else if (type == "function_call") {
      const ojson call = {{"id", string_field(item, "call_id", where)},
                          {"type", "function"},
                          {"function",
                           {{"name", string_field(item, "name", where)},
                            {"arguments", string_field(item, "arguments", where)}}}};
      if (!open_turn) {
        messages.push_back({{"role", "assistant"}, {"content", nullptr}});
        message_from.push_back(where);
        open_turn = true;
      }
      ojson& turn = messages.back();
      if (!turn.contains("tool_calls")) turn["tool_calls"] = ojson::array();
      turn["tool_calls"].push_back(call);
    } else if (type == "function_call_output") {
      const std::string& call_id = string_field(item, "call_id", where);
      if (!item.contains("output") || !item["output"].is_string()) throw bad(where + ".output", "must be a string");
      messages.push_back({{"role", "tool"}, {"tool_call_id", call_id}, {"content", item["output"]}});
      message_from.push_back(where);
      open_turn = false;
    } else if (type == "reasoning") {
      continue;  // the model does not reason: nothing to feed back
    } else {
      throw bad(where + ".type", fmt::format("'{}' is not supported (message, function_call, "
                                             "function_call_output or reasoning)",
                                             type == "?" ? std::string("a non-string") : type));
    }
  }
}

// An id for a stored item that has none, by its type.
std::string item_id_prefix(const ojson& item) {
  const std::string type = item.is_object() && item.contains("type") && item["type"].is_string()
                               ? item["type"].get<std::string>()
                               : "message";
  if (type == "function_call") return "fc_";
  if (type == "function_call_output") return "fco_";
  if (type == "reasoning") return "rs_";
  return "msg_";
}

}  // namespace

ojson stored_item(ojson item) {
  if (!item.is_object()) return item;
  if (!present(item, "type")) item["type"] = "message";
  if (item["type"] == "message") {
    if (item.contains("content") && item["content"].is_string()) {
      const bool assistant = item.value("role", "") == "assistant";
      ojson part = {{"type", assistant ? "output_text" : "input_text"}, {"text", item["content"]}};
      if (assistant) part["annotations"] = ojson::array();
      item["content"] = ojson::array({std::move(part)});
    }
    if (!item.contains("status")) item["status"] = "completed";
  }
  if (!(item.contains("id") && item["id"].is_string())) item["id"] = new_response_id(item_id_prefix(item));
  return item;
}

void check_input_items(const ojson& items, const std::string& param) {
  std::vector<std::string> where_of(items.size()), from;
  for (size_t i = 0; i < items.size(); ++i) where_of[i] = fmt::format("{}[{}]", param, i);
  ojson messages = ojson::array();
  items_to_messages(items, where_of, messages, from);
}

json check_metadata(const ojson& v, const std::string& param) {
  if (v.is_null()) return json::object();
  if (!v.is_object()) throw bad(param, "must be an object");
  if (v.size() > 16) throw bad(param, "has more than 16 keys");
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.key().size() > 64) throw bad(param, "has a key longer than 64 characters");
    if (!it.value().is_string()) throw bad(fmt::format("{}.{}", param, it.key()), "must be a string");
    if (it.value().get_ref<const std::string&>().size() > 512)
      throw bad(fmt::format("{}.{}", param, it.key()), "is longer than 512 characters");
  }
  return json::parse(v.dump());
}

std::string conversation_id(const ojson& body) {
  if (!present(body, "conversation")) return {};
  const ojson& c = body["conversation"];
  if (c.is_string()) return c.get<std::string>();
  if (c.is_object() && c.contains("id") && c["id"].is_string()) return c["id"].get<std::string>();
  throw bad("conversation", "must be a conversation id or {\"id\": ...}");
}

std::string previous_response_id(const ojson& body) {
  if (!present(body, "previous_response_id")) return {};
  if (!body["previous_response_id"].is_string()) throw bad("previous_response_id", "must be a string");
  return body["previous_response_id"].get<std::string>();
}

ResponsesRequest parse_responses_request(const ojson& body, const ojson* previous) {
  if (!body.is_object())
    throw ApiError(400, fmt::format("the request body must be a JSON object (got {})", body.type_name()));
  ResponsesRequest r;
  r.previous_response_id = previous_response_id(body);
  r.conversation_id = conversation_id(body);
  if (!r.conversation_id.empty() && !r.previous_response_id.empty())
    throw bad("conversation", "cannot be used with 'previous_response_id' (leave out one of them)");
  if (!r.previous_response_id.empty() && (!previous || !previous->is_array()))
    throw ApiError(400, fmt::format("Previous response with id '{}' not found.", r.previous_response_id),
                   "previous_response_id", "previous_response_not_found");
  if (!r.conversation_id.empty() && (!previous || !previous->is_array()))
    throw ApiError(404, fmt::format("Conversation with id '{}' not found.", r.conversation_id), "conversation",
                   "not_found");
  if (present(body, "background") && !body["background"].is_boolean()) throw bad("background", "must be a boolean");
  r.background = present(body, "background") && body["background"].get<bool>();
  if (present(body, "prompt")) throw bad("prompt", "is not supported: this server stores no prompt templates");
  if (present(body, "truncation")) {
    if (body["truncation"] != "disabled" && body["truncation"] != "auto")
      throw bad("truncation", "must be 'auto' or 'disabled'");
    r.truncate = body["truncation"] == "auto";
  }
  if (present(body, "store") && !body["store"].is_boolean()) throw bad("store", "must be a boolean");
  r.store = !present(body, "store") || body["store"].get<bool>();
  if (r.background && !r.store) throw bad("background", "needs 'store' true: a background response is read back by id");
  if (present(body, "stream") && !body["stream"].is_boolean()) throw bad("stream", "must be a boolean");
  r.stream = present(body, "stream") && body["stream"].get<bool>();
  if (present(body, "metadata")) check_metadata(body["metadata"], "metadata");

  ojson& chat = r.chat;
  chat = ojson::object();
  for (const char* key : kPassThrough)
    if (body.contains(key)) chat[key] = body[key];
  if (body.contains("max_output_tokens")) chat["max_completion_tokens"] = body["max_output_tokens"];

  // The items: the previous response's conversation, then the input's.
  // Without input, a stored history alone is the prompt (a conversation
  // whose items were added through its own routes, say).
  const bool history = !r.previous_response_id.empty() || !r.conversation_id.empty();
  if (!present(body, "input") && !history)
    throw bad("input", "is required (or previous_response_id or conversation to answer a stored history)");
  static const ojson kNoInput = ojson::array();
  const ojson& input = present(body, "input") ? body["input"] : kNoInput;
  r.items = previous ? *previous : ojson::array();
  r.input_from = r.items.size();
  std::vector<std::string> where_of(r.items.size());
  for (size_t i = 0; i < where_of.size(); ++i)
    where_of[i] = fmt::format("{} (its item {})", r.conversation_id.empty() ? "previous_response_id" : "conversation", i);
  if (input.is_string()) {
    r.items.push_back({{"type", "message"}, {"role", "user"}, {"content", input}});
    where_of.push_back("input");
  } else if (input.is_array()) {
    if (input.empty() && present(body, "input")) throw bad("input", "must not be an empty array");
    for (size_t i = 0; i < input.size(); ++i) {
      r.items.push_back(input[i]);
      where_of.push_back(fmt::format("input[{}]", i));
    }
  } else {
    throw bad("input", fmt::format("must be a string or an array of items (got {})", input.type_name()));
  }

  // Messages: the instructions, then the items.
  ojson messages = ojson::array();
  if (present(body, "instructions")) {
    if (!body["instructions"].is_string()) throw bad("instructions", "must be a string");
    messages.push_back({{"role", "system"}, {"content", body["instructions"]}});
    r.message_from.push_back("instructions");
  }
  items_to_messages(r.items, where_of, messages, r.message_from);
  for (size_t i = r.input_from; i < r.items.size(); ++i) r.items[i] = stored_item(std::move(r.items[i]));
  if (messages.empty()) throw bad("input", "has no message (only reasoning items)");
  chat["messages"] = std::move(messages);

  // Tools: OpenAI's flat function tools, as chat's nested ones.
  if (present(body, "tools")) {
    const ojson& tools = body["tools"];
    if (!tools.is_array()) throw bad("tools", "must be an array");
    ojson out = ojson::array();
    for (size_t i = 0; i < tools.size(); ++i) {
      const ojson& t = tools[i];
      const std::string where = fmt::format("tools[{}]", i);
      if (!t.is_object()) throw bad(where, "must be an object");
      const std::string type = present(t, "type") && t["type"].is_string() ? t["type"].get<std::string>() : "";
      if (type != "function")
        throw bad(where + ".type", fmt::format("'{}' is not supported: only function tools are (the server runs "
                                               "no built-in tools)", type));
      ojson fn = {{"name", string_field(t, "name", where)}};
      for (const char* key : {"description", "parameters", "strict"})
        if (t.contains(key)) fn[key] = t[key];
      out.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    if (!out.empty()) chat["tools"] = std::move(out);
  }
  if (present(body, "tool_choice")) {
    const ojson& tc = body["tool_choice"];
    if (tc.is_string()) {
      chat["tool_choice"] = tc;
    } else if (tc.is_object() && tc.value("type", "") == "function") {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", string_field(tc, "name", "tool_choice")}}}};
    } else {
      throw bad("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"name\": ...}");
    }
  }
  if (present(body, "parallel_tool_calls") && !body["parallel_tool_calls"].is_boolean())
    throw bad("parallel_tool_calls", "must be a boolean");
  // max_tool_calls: a response makes at most one call here (the call grammar
  // holds one), so only 0 changes anything: no call at all.
  if (present(body, "max_tool_calls")) {
    const ojson& m = body["max_tool_calls"];
    if (!m.is_number_integer() || m.get<int64_t>() < 0) throw bad("max_tool_calls", "must be an integer >= 0");
    if (m.get<int64_t>() == 0 && chat.contains("tools")) {
      if (chat.contains("tool_choice") && chat["tool_choice"] != "none" && chat["tool_choice"] != "auto")
        throw bad("max_tool_calls", "is 0, but 'tool_choice' requires a call");
      chat["tool_choice"] = "none";
    }
  }

  // text.format: the output's shape.
  if (present(body, "text")) {
    const ojson& text = body["text"];
    if (!text.is_object()) throw bad("text", "must be an object");
    if (present(text, "format")) {
      const ojson& f = text["format"];
      if (!f.is_object() || !f.contains("type") || !f["type"].is_string())
        throw bad("text.format", "must be an object with a string 'type'");
      const std::string& type = f["type"].get_ref<const std::string&>();
      if (type == "json_object") {
        chat["response_format"] = {{"type", "json_object"}};
      } else if (type == "json_schema") {
        if (!f.contains("schema")) throw bad("text.format.schema", "is required");
        ojson js = {{"name", f.contains("name") ? f["name"] : ojson("response")}, {"schema", f["schema"]}};
        if (f.contains("strict")) js["strict"] = f["strict"];
        chat["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(js)}};
      } else if (type != "text") {
        throw bad("text.format.type", fmt::format("'{}' is not a format (text, json_object or json_schema)", type));
      }
    }
  }

  // include: the text's log-probabilities.
  bool logprobs = false;
  if (present(body, "include")) {
    const ojson& inc = body["include"];
    if (!inc.is_array()) throw bad("include", "must be an array of strings");
    for (size_t i = 0; i < inc.size(); ++i) {
      if (!inc[i].is_string()) throw bad(fmt::format("include[{}]", i), "must be a string");
      if (inc[i] == "message.output_text.logprobs") logprobs = true;
    }
  }
  if (logprobs || present(body, "top_logprobs")) chat["logprobs"] = true;

  for (const char* key : kEchoed)
    if (present(body, key)) r.echo[key] = json::parse(body[key].dump());
  if (logprobs) r.echo["include_logprobs"] = true;
  return r;
}

ApiError responses_error(const ApiError& e, const ResponsesRequest& r) {
  std::vector<std::pair<std::string, std::string>> names;
  for (size_t k = r.message_from.size(); k-- > 0;)  // messages[12] before messages[1]
    names.emplace_back(fmt::format("messages[{}]", k), r.message_from[k]);
  names.emplace_back("max_completion_tokens", "max_output_tokens");
  names.emplace_back("response_format.json_schema.schema", "text.format.schema");
  names.emplace_back("response_format", "text.format");
  names.emplace_back(".image_url.url", ".image_url");
  names.emplace_back("tool_choice.function.name", "tool_choice.name");
  names.emplace_back("'messages'", "'input'");
  names.emplace_back("the messages", "the input");
  auto rename = [&](std::string s) {
    for (const auto& [from, to] : names)
      for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
        s.replace(at, from.size(), to);
    // tools[i].function.x -> tools[i].x
    for (size_t at = s.find("].function."); at != std::string::npos; at = s.find("].function.", at)) {
      const size_t open = s.rfind('[', at);
      if (open >= 5 && s.compare(open - 5, 5, "tools") == 0) s.erase(at + 1, 9);
      else at += 1;
    }
    return s;
  };
  std::string param = rename(e.param);
  if (param == "messages") param = "input";
  return ApiError(e.status, rename(e.what()), param, e.code);
}

// ---- responses -------------------------------------------------------------------

namespace {

json usage_json(const ResponsesOutput& out) {
  return {{"input_tokens", out.input_tokens},
          {"input_tokens_details", {{"cached_tokens", out.cached_tokens}}},
          {"output_tokens", out.output_tokens},
          {"output_tokens_details", {{"reasoning_tokens", 0}}},
          {"total_tokens", out.input_tokens + out.output_tokens}};
}

json echoed(const ResponsesRequest& r, const char* key, json dflt) {
  return r.echo.is_object() && r.echo.contains(key) ? r.echo[key] : std::move(dflt);
}

// The response object without output and usage.
json base_object(const ResponseHeader& h, const ResponsesRequest& r, const char* status, double temperature,
                 double top_p) {
  const bool tools = r.echo.is_object() && r.echo.contains("tools");
  return {{"id", h.id},
          {"object", "response"},
          {"created_at", h.created},
          {"status", status},
          {"background", r.background},
          {"error", nullptr},
          {"incomplete_details", nullptr},
          {"instructions", echoed(r, "instructions", nullptr)},
          {"max_output_tokens", echoed(r, "max_output_tokens", nullptr)},
          {"max_tool_calls", echoed(r, "max_tool_calls", nullptr)},
          {"model", h.model},
          {"output", json::array()},
          {"parallel_tool_calls", echoed(r, "parallel_tool_calls", true)},
          {"previous_response_id", r.previous_response_id.empty() ? json(nullptr) : json(r.previous_response_id)},
          {"conversation", r.conversation_id.empty() ? json(nullptr) : json{{"id", r.conversation_id}}},
          {"reasoning", {{"effort", nullptr}, {"summary", nullptr}}},
          {"service_tier", echoed(r, "service_tier", "auto")},
          {"store", r.store},
          {"temperature", temperature},
          {"text", echoed(r, "text", json{{"format", {{"type", "text"}}}})},
          {"tool_choice", echoed(r, "tool_choice", tools ? "auto" : "none")},
          {"tools", echoed(r, "tools", json::array())},
          {"top_logprobs", echoed(r, "top_logprobs", 0)},
          {"top_p", top_p},
          {"truncation", r.truncate ? "auto" : "disabled"},
          {"usage", nullptr},
          {"user", echoed(r, "user", nullptr)},
          {"metadata", echoed(r, "metadata", json::object())}};
}

}  // namespace

json response_pending(const ResponseHeader& h, const ResponsesRequest& r, const char* status, double temperature,
                      double top_p) {
  return base_object(h, r, status, temperature, top_p);
}

namespace {

json text_part(const std::string& text, const json& logprobs) {
  return {{"type", "output_text"}, {"text", text}, {"annotations", json::array()}, {"logprobs", logprobs}};
}

json call_item(const json& call, const std::string& id, const char* status) {
  return {{"type", "function_call"},
          {"id", id},
          {"call_id", call["id"]},
          {"name", call["function"]["name"]},
          {"arguments", call["function"]["arguments"]},
          {"status", status}};
}

// The message's text: with a call found, the text besides it (null: none).
json message_text(const ResponsesOutput& out) {
  if (out.calls.found) return out.calls.content;
  return out.text;
}

json logprobs_content(const ResponsesOutput& out, const tok::Tokenizer& t, bool as_ids) {
  if (!out.with_logprobs) return json::array();
  return chat_logprobs_json(t, out.logprobs, out.top_logprobs, as_ids)["content"];
}

}  // namespace

json response_output(const ResponsesOutput& out, const tok::Tokenizer& t, bool as_ids) {
  json items = json::array();
  const json text = message_text(out);
  const char* status = out.finish == FinishReason::length ? "incomplete" : "completed";
  if (text.is_string())
    items.push_back({{"type", "message"},
                     {"id", out.message_id},
                     {"status", status},
                     {"role", "assistant"},
                     {"content", json::array({text_part(text.get<std::string>(), logprobs_content(out, t, as_ids))})}});
  if (out.calls.found)
    for (size_t i = 0; i < out.calls.tool_calls.size(); ++i)
      items.push_back(call_item(out.calls.tool_calls[i], i < out.call_item_ids.size() ? out.call_item_ids[i] : "",
                                "completed"));
  return items;
}

json response_object(const ResponseHeader& h, const ResponsesRequest& r, const ResponsesOutput& out,
                     const json& output) {
  const bool cut = out.finish == FinishReason::length;
  json o = base_object(h, r, cut ? "incomplete" : "completed", out.temperature, out.top_p);
  if (cut) o["incomplete_details"] = {{"reason", "max_output_tokens"}};
  o["output"] = output;
  o["usage"] = usage_json(out);
  return o;
}

// ---- streaming ---------------------------------------------------------------------

ResponsesStream::ResponsesStream(ResponseHeader h, const ResponsesRequest& r, std::string message_id)
    : h_(std::move(h)), message_id_(std::move(message_id)) {
  r_.echo = r.echo;
  r_.store = r.store;
  r_.background = r.background;
  r_.previous_response_id = r.previous_response_id;
}

std::string ResponsesStream::event(json e) {
  e["sequence_number"] = seq_++;
  return fmt::format("event: {}\ndata: {}\n\n", e["type"].get<std::string>(), dump_json(e));
}

json ResponsesStream::message_item(const std::string& status, const json& content) const {
  return {{"type", "message"}, {"id", message_id_}, {"status", status}, {"role", "assistant"}, {"content", content}};
}

std::string ResponsesStream::start(double temperature, double top_p) {
  const json in_progress = base_object(h_, r_, "in_progress", temperature, top_p);
  std::string s = event({{"type", "response.created"},
                         {"response", r_.background ? base_object(h_, r_, "queued", temperature, top_p) : in_progress}});
  s += event({{"type", "response.in_progress"}, {"response", in_progress}});
  return s;
}

std::string ResponsesStream::open() {
  if (open_) return {};
  open_ = true;
  // (one statement each: the order of evaluation fixes the sequence numbers)
  std::string s = event({{"type", "response.output_item.added"},
                         {"output_index", 0},
                         {"item", message_item("in_progress", json::array())}});
  s += event({{"type", "response.content_part.added"},
              {"item_id", message_id_},
              {"output_index", 0},
              {"content_index", 0},
              {"part", text_part("", json::array())}});
  return s;
}

std::string ResponsesStream::text(const std::string& delta, const json& logprobs) {
  if (delta.empty() && (!logprobs.is_array() || logprobs.empty())) return {};
  std::string s = open();
  text_ += delta;
  const json lp = logprobs.is_array() ? logprobs : json::array();
  for (const json& x : lp) logprobs_.push_back(x);
  s += event({{"type", "response.output_text.delta"},
              {"item_id", message_id_},
              {"output_index", 0},
              {"content_index", 0},
              {"delta", delta},
              {"logprobs", lp}});
  return s;
}

json& ResponsesStream::conclude(const ResponsesOutput& out, const tok::Tokenizer& t, bool as_ids) {
  json output = response_output(out, t, as_ids);
  // A message announced while its text streamed stays in the output, even
  // when a call found later took all of it.
  if (open_ && (output.empty() || output[0]["type"] != "message"))
    output.insert(output.begin(), message_item(out.finish == FinishReason::length ? "incomplete" : "completed",
                                               json::array({text_part(text_, logprobs_)})));
  final_ = response_object(h_, r_, out, output);
  return final_;
}

std::string ResponsesStream::finish() {
  std::string s;
  size_t index = 0;
  for (const json& item : final_["output"]) {
    if (item["type"] == "message") {
      // Text the stream held back (a call's neighbour) goes out now.
      const std::string full = item["content"][0]["text"];
      s += open();
      if (full.size() > text_.size() && full.compare(0, text_.size(), text_) == 0)
        s += text(full.substr(text_.size()), json::array());
      s += event({{"type", "response.output_text.done"},
                  {"item_id", message_id_},
                  {"output_index", index},
                  {"content_index", 0},
                  {"text", full},
                  {"logprobs", item["content"][0]["logprobs"]}});
      s += event({{"type", "response.content_part.done"},
                  {"item_id", message_id_},
                  {"output_index", index},
                  {"content_index", 0},
                  {"part", item["content"][0]}});
      s += event({{"type", "response.output_item.done"}, {"output_index", index}, {"item", item}});
    } else {
      json added = item;
      added["arguments"] = "";
      added["status"] = "in_progress";
      s += event({{"type", "response.output_item.added"}, {"output_index", index}, {"item", added}});
      s += event({{"type", "response.function_call_arguments.delta"},
                  {"item_id", item["id"]},
                  {"output_index", index},
                  {"delta", item["arguments"]}});
      s += event({{"type", "response.function_call_arguments.done"},
                  {"item_id", item["id"]},
                  {"output_index", index},
                  {"arguments", item["arguments"]}});
      s += event({{"type", "response.output_item.done"}, {"output_index", index}, {"item", item}});
    }
    ++index;
  }
  s += event({{"type", final_["status"] == "completed" ? "response.completed" : "response.incomplete"},
              {"response", final_}});
  return s;
}

std::string ResponsesStream::error(const ApiError& e) {
  return event({{"type", "error"},
                {"code", e.code.empty() ? json(nullptr) : json(e.code)},
                {"message", e.what()},
                {"param", e.param.empty() ? json(nullptr) : json(e.param)}});
}

}  // namespace areno::serve

// ---- the store -----------------------------------------------------------------------

namespace areno::serve {

void ResponseEvents::append(const std::string& sse) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    // ResponsesStream's events end in a blank line; their JSON holds no raw newline.
    for (size_t from = 0; from < sse.size();) {
      size_t end = sse.find("\n\n", from);
      end = end == std::string::npos ? sse.size() : end + 2;
      events_.push_back(sse.substr(from, end - from));
      bytes_ += end - from;
      from = end;
    }
  }
  cv_.notify_all();
}

void ResponseEvents::close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

std::vector<std::string> ResponseEvents::wait_from(size_t next, std::chrono::milliseconds timeout, bool& closed,
                                                   size_t max_bytes) const {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return closed_ || events_.size() > next; });
  std::vector<std::string> out;
  size_t k = next, bytes = 0;
  for (; k < events_.size() && (out.empty() || bytes + events_[k].size() <= max_bytes); ++k) {
    bytes += events_[k].size();
    out.push_back(events_[k]);
  }
  closed = closed_ && k >= events_.size();
  return out;
}

size_t ResponseEvents::bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return bytes_ + events_.size() * sizeof(std::string);
}

size_t ResponseEvents::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return events_.size();
}

size_t ResponsesStore::entry_bytes(const std::string& id, const Entry& e) {
  // Every byte as serialized, plus the id twice (map key, recency list) and a
  // fixed allowance for the entry's own bookkeeping.
  return e.object.dump().size() + e.conversation->dump().size() + (e.events ? e.events->bytes() : 0) +
         2 * id.size() + 256;
}

void ResponsesStore::make_room(size_t bytes, std::vector<std::string>* out) {
  while (bytes_ + bytes > max_bytes_ && !lru_.empty()) {
    auto victim = slots_.find(lru_.back());
    bytes_ -= victim->second.bytes;
    if (out) out->push_back(victim->first);
    slots_.erase(victim);
    lru_.pop_back();
  }
}

bool ResponsesStore::put(const std::string& id, json object, const ojson& inputs, const json& outputs,
                         std::shared_ptr<ResponseEvents> events) {
  if (!enabled()) return false;
  auto conversation = std::make_shared<ojson>(inputs.is_array() ? inputs : ojson::array());
  for (ojson& item : *conversation)
    if (item.is_object() && !(item.contains("id") && item["id"].is_string())) item = stored_item(std::move(item));
  const size_t inputs_n = conversation->size();
  for (const json& item : outputs) conversation->push_back(ojson::parse(item.dump()));
  return put_entry(id, Entry{std::move(object), std::move(conversation), inputs_n, std::move(events)}, true);
}

bool ResponsesStore::put_entry(const std::string& id, Entry entry, bool write) {
  const size_t bytes = entry_bytes(id, entry);
  std::vector<std::string> gone;
  bool kept = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (auto it = slots_.find(id); it != slots_.end()) {  // replaced (or, too large now, gone)
      bytes_ -= it->second.bytes;
      lru_.erase(it->second.lru);
      slots_.erase(it);
    }
    if (bytes <= max_bytes_) {
      make_room(bytes, &gone);
      lru_.push_front(id);
      slots_[id] = Slot{std::move(entry), bytes, lru_.begin()};
      bytes_ += bytes;
      kept = true;
    }
  }
  if (write) sync_file(id);
  for (const std::string& g : gone) sync_file(g);
  return kept;
}

bool ResponsesStore::recount(const std::string& id) {
  std::optional<Entry> e = get(id);
  if (!e) return false;
  const size_t bytes = entry_bytes(id, *e);  // (serialized outside the lock)
  std::vector<std::string> gone;
  bool kept = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = slots_.find(id);
    if (it == slots_.end()) return false;
    if (it->second.entry.conversation != e->conversation) return true;  // replaced since: counted by its put
    bytes_ -= it->second.bytes;
    lru_.erase(it->second.lru);
    Slot slot = std::move(it->second);
    slots_.erase(it);
    if (bytes <= max_bytes_) {
      make_room(bytes, &gone);
      lru_.push_front(id);
      slot.bytes = bytes;
      slot.lru = lru_.begin();
      slots_[id] = std::move(slot);
      bytes_ += bytes;
      kept = true;
    }
  }
  sync_file(id);
  for (const std::string& g : gone) sync_file(g);
  return kept;
}

std::optional<ResponsesStore::Entry> ResponsesStore::get(const std::string& id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = slots_.find(id);
  if (it == slots_.end()) return std::nullopt;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return it->second.entry;
}

bool ResponsesStore::erase(const std::string& id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = slots_.find(id);
    if (it == slots_.end()) return false;
    bytes_ -= it->second.bytes;
    lru_.erase(it->second.lru);
    slots_.erase(it);
  }
  sync_file(id);
  return true;
}

// ---- the folder ----------------------------------------------------------------------

namespace {

bool stored_file_name(const std::string& name) {
  if (name.size() != 5 + 32 + 5 || (name.compare(0, 5, "resp_") != 0 && name.compare(0, 5, "conv_") != 0) ||
      name.compare(37, 5, ".json") != 0)
    return false;
  for (size_t i = 5; i < 37; ++i)
    if (!std::isxdigit(static_cast<unsigned char>(name[i])) || std::isupper(static_cast<unsigned char>(name[i])))
      return false;
  return true;
}

// A stream's last event when the server stopped before it ended.
std::string stopped_event(size_t seq) {
  const json e = {{"type", "error"},
                  {"code", "server_error"},
                  {"message", "the server stopped before the response finished"},
                  {"param", nullptr},
                  {"sequence_number", seq}};
  return fmt::format("event: error\ndata: {}\n\n", e.dump());
}

}  // namespace

void ResponsesStore::sync_file(const std::string& id) {
  if (dir_.empty()) return;
  std::lock_guard<std::mutex> fl(file_mu_);
  std::optional<Entry> e;
  {
    std::lock_guard<std::mutex> lk(mu_);  // (not get(): writing is no use, the order stays)
    if (auto it = slots_.find(id); it != slots_.end()) e = it->second.entry;
  }
  const std::string path = dir_ + "/" + id + ".json";
  try {
    if (!e) {
      if (::unlink(path.c_str()) == 0) sync_dir(dir_);
      return;
    }
    ojson file = {{"id", id},
                  {"object", ojson::parse(e->object.dump())},
                  {"conversation", *e->conversation},
                  {"inputs", e->inputs}};
    if (e->events) {
      bool closed = false;
      const std::vector<std::string> all =
          e->events->wait_from(0, std::chrono::milliseconds(0), closed, std::numeric_limits<size_t>::max());
      file["events"] = all;
      file["events_closed"] = closed;
    }
    write_file_atomic(path, file.dump(), 0600);  // conversations: the owner's only, whatever the folder's mode
  } catch (const std::exception& ex) {
    // The entry stays served from memory; only its copy on disk is behind.
    fmt::print(stderr, "areno serve: {}: could not write the stored entry: {}\n", path, ex.what());
  }
}

ResponsesStore::~ResponsesStore() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // (closing releases the lock)
}

ResponsesStore::LoadReport ResponsesStore::load() {
  LoadReport report;
  if (dir_.empty() || !enabled()) return report;
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(dir_, ec)) {
    if (::mkdir(dir_.c_str(), 0700) != 0)
      throw std::runtime_error(fmt::format("{}: cannot create the folder: {}", dir_, std::strerror(errno)));
  } else if (!fs::is_directory(dir_, ec)) {
    throw std::runtime_error(fmt::format("{}: not a folder", dir_));
  }
  if (lock_fd_ < 0) {
    const std::string lock = dir_ + "/.lock";
    const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) throw std::runtime_error(fmt::format("{}: cannot open: {}", lock, std::strerror(errno)));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd);
      throw std::runtime_error(err == EWOULDBLOCK
                                   ? fmt::format("{}: another areno serve keeps its store in this folder", dir_)
                                   : fmt::format("{}: cannot lock: {}", lock, std::strerror(err)));
    }
    lock_fd_ = fd;
  }
  struct Found {
    fs::file_time_type when;
    std::string name;
  };
  std::vector<Found> found;
  for (const fs::directory_entry& d : fs::directory_iterator(dir_, ec)) {
    const std::string name = d.path().filename().string();
    if (name.find(".json.tmp-") != std::string::npos && name.size() > 10 &&
        stored_file_name(name.substr(0, name.find(".tmp-")))) {
      fs::remove(d.path(), ec);  // an interrupted write's temporary
      continue;
    }
    if (!stored_file_name(name)) continue;
    if (!d.is_regular_file(ec)) {
      report.skipped.push_back(name + ": not a regular file");
      continue;
    }
    found.push_back({d.last_write_time(ec), name});
  }
  if (ec) throw std::runtime_error(fmt::format("{}: cannot read the folder: {}", dir_, ec.message()));
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return a.when != b.when ? a.when < b.when : a.name < b.name;
  });
  for (const Found& f : found) {
    const std::string path = dir_ + "/" + f.name;
    const std::string id = f.name.substr(0, f.name.size() - 5);
    try {
      if (fs::file_size(path) > max_bytes_) {  // (what it holds counts at least its bytes)
        fs::remove(path, ec);
        ++report.dropped;
        continue;
      }
      std::ifstream in(path, std::ios::binary);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (!in.good() && !in.eof()) throw std::runtime_error("cannot be read");
      ojson file = parse_ordered_json_bounded(text, 4 * kDefaultMaxJsonDepth);
      auto field = [&](const char* key) -> ojson& {
        if (!file.is_object() || !file.contains(key)) throw std::runtime_error(fmt::format("'{}' is missing", key));
        return file[key];
      };
      if (field("id") != id) throw std::runtime_error("'id' is not the file's name");
      json object = json::parse(field("object").dump());
      const std::string kind = object.is_object() ? object.value("object", "") : "";
      if (kind != (id.rfind("resp_", 0) == 0 ? "response" : "conversation") || object.value("id", "") != id)
        throw std::runtime_error("'object' is not this response's or conversation's object");
      if (!field("conversation").is_array()) throw std::runtime_error("'conversation' is not an array");
      if (!field("inputs").is_number_unsigned() || field("inputs").get<size_t>() > file["conversation"].size())
        throw std::runtime_error("'inputs' is not a count of the conversation's items");
      Entry e{std::move(object), std::make_shared<ojson>(std::move(file["conversation"])), file["inputs"].get<size_t>(),
              nullptr};
      bool changed = false;
      if (file.contains("events")) {
        if (!file["events"].is_array()) throw std::runtime_error("'events' is not an array");
        e.events = std::make_shared<ResponseEvents>();
        for (const ojson& ev : file["events"]) {
          if (!ev.is_string() || ev.get_ref<const std::string&>().size() < 2 ||
              ev.get_ref<const std::string&>().compare(ev.get_ref<const std::string&>().size() - 2, 2, "\n\n") != 0 ||
              ev.get_ref<const std::string&>().find("\n\n") + 2 != ev.get_ref<const std::string&>().size())
            throw std::runtime_error("'events' holds something that is not one event");
          e.events->append(ev.get<std::string>());
        }
        if (!file.value("events_closed", false)) {
          e.events->append(stopped_event(e.events->size()));
          changed = true;
        }
        e.events->close();
      }
      const std::string status = e.object.value("status", "");
      if (kind == "response" && (status == "queued" || status == "in_progress")) {
        e.object["status"] = "failed";
        e.object["error"] = {{"code", "server_error"}, {"message", "the server stopped before the response finished"}};
        changed = true;
      }
      ++report.loaded;
      if (!put_entry(id, std::move(e), changed)) sync_file(id);  // larger than the whole store: removed
    } catch (const std::exception& ex) {
      report.skipped.push_back(fmt::format("{}: {}", f.name, ex.what()));
    }
  }
  // Those that made room for newer ones, or did not fit at all, are gone with their files.
  report.dropped += report.loaded - size();
  report.loaded = size();
  return report;
}

size_t ResponsesStore::bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return bytes_;
}

size_t ResponsesStore::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return slots_.size();
}

json input_items_page(const ResponsesStore::Entry& e, const std::string& limit_s, const std::string& order,
                      const std::string& after) {
  int64_t limit = 20;
  if (!limit_s.empty()) {
    limit = -1;
    if (limit_s.size() <= 3 && limit_s.find_first_not_of("0123456789") == std::string::npos)
      limit = std::stoll(limit_s);
    if (limit < 1 || limit > 100) throw bad("limit", "must be an integer from 1 to 100");
  }
  if (!order.empty() && order != "asc" && order != "desc") throw bad("order", "must be 'asc' or 'desc'");
  const bool desc = order != "asc";
  const ojson& items = *e.conversation;
  const size_t n = std::min(e.inputs, items.size());
  std::vector<size_t> index(n);
  for (size_t i = 0; i < n; ++i) index[i] = desc ? n - 1 - i : i;
  size_t from = 0;
  if (!after.empty()) {
    bool found = false;
    for (size_t k = 0; k < n && !found; ++k)
      if (items[index[k]].value("id", "") == after) from = k + 1, found = true;
    if (!found) throw bad("after", fmt::format("'{}' is not an input item of this response", after));
  }
  json data = json::array();
  for (size_t k = from; k < n && int64_t(data.size()) < limit; ++k) data.push_back(json::parse(items[index[k]].dump()));
  const bool more = from + data.size() < n;
  return {{"object", "list"},
          {"data", data},
          {"first_id", data.empty() ? json(nullptr) : data.front()["id"]},
          {"last_id", data.empty() ? json(nullptr) : data.back()["id"]},
          {"has_more", more}};
}

}  // namespace areno::serve
