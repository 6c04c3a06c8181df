// OpenAI's Responses API (serve/responses.h): the request as the chat body it
// amounts to, every refusal by field, chat errors renamed to the request's
// fields, and real HTTP on the demo model: a response equals its chat
// request's answer and token counts, streamed events come in OpenAI's order
// and add up to the response, tool calls and their results round-trip,
// the length limit gives status incomplete, prefix-cached tokens are counted.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <httplib.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "models/phi4mm/demo/demo.h"
#include "serve/engine.h"
#include "serve/http_server.h"
#include "serve/responses.h"
#include "tests/serve/http_fixture.h"

using namespace areno;
using namespace areno::serve;
using nlohmann::json;
using ojson = nlohmann::ordered_json;

namespace {

ResponsesRequest parse(const char* body) { return parse_responses_request(ojson::parse(body)); }

// The 400 parse_responses_request throws for `body`, as {param, message}.
std::pair<std::string, std::string> refusal(const char* body) {
  try {
    parse(body);
  } catch (const ApiError& e) {
    CHECK(e.status == 400);
    return {e.param, e.what()};
  }
  FAIL("not refused: " << body);
  return {};
}

struct Reply {
  int status = 0;
  json j;
  std::string body;
};

Reply call(int port, const std::string& method, const std::string& path) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(120, 0);
  httplib::Result r = method == "GET" ? cli.Get(path) : cli.Delete(path);
  REQUIRE(r);
  return Reply{r->status, json::parse(r->body, nullptr, false), r->body};
}

Reply post(int port, const std::string& path, const json& body) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(120, 0);
  httplib::Result r = cli.Post(path, body.dump(), "application/json");
  REQUIRE(r);
  Reply out{r->status, json::parse(r->body, nullptr, false), r->body};
  return out;
}

// The events of a Responses stream: "event: T\ndata: {...}\n\n", T equal to data's type.
std::vector<json> events_of(const std::string& body) {
  std::vector<json> out;
  size_t at = 0;
  while ((at = body.find("event: ", at)) != std::string::npos) {
    const size_t nl = body.find('\n', at);
    const std::string type = body.substr(at + 7, nl - at - 7);
    REQUIRE(body.compare(nl + 1, 6, "data: ") == 0);
    const size_t end = body.find("\n\n", nl);
    out.push_back(json::parse(body.substr(nl + 7, end - nl - 7)));
    CHECK(out.back()["type"] == type);
    at = end;
  }
  return out;
}

// The demo model served on a free loopback port, its engine stepping on its own thread.
struct DemoServer {
  std::shared_ptr<phi4mm::Phi4MMForCausalLM> model = phi4mm::demo_model();
  Engine engine;
  Served served;
  explicit DemoServer(EngineOptions eo) : engine(model, tokenizer_for(*model), eo), served(engine, ServerOptions{}) {
    std::signal(SIGPIPE, SIG_IGN);
    engine.start();
  }
};

EngineOptions demo_engine(int64_t kv_blocks, bool prefix_caching = false) {
  EngineOptions eo;
  eo.kv_blocks = kv_blocks;
  eo.prefix_caching = prefix_caching;
  return eo;
}

}  // namespace

TEST_CASE("serve/responses the request as a chat body: input items, instructions, tools, text.format, include") {
  const ResponsesRequest a = parse(R"({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9,
                                       "temperature": 0.5, "top_k": 3, "metadata": {"k": "v"}, "store": true})");
  CHECK(a.chat["messages"] == ojson::parse(R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])"));
  CHECK(a.chat["max_completion_tokens"] == 9);
  CHECK(a.chat["temperature"] == 0.5);
  CHECK(a.chat["top_k"] == 3);
  CHECK_FALSE(a.chat.contains("stream"));
  CHECK_FALSE(a.stream);
  CHECK(a.message_from == std::vector<std::string>{"instructions", "input"});
  CHECK(a.echo["metadata"] == json{{"k", "v"}});

  // Items: parts, a developer message, an assistant turn with two calls, their results, a skipped reasoning item.
  const ResponsesRequest b = parse(R"({"input": [
      {"role": "developer", "content": "Use tools."},
      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                                     {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "auto"},
                                                     {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]},
      {"type": "reasoning", "id": "rs_1", "summary": []},
      {"role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
      {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\":1}"},
      {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{\"a\":2}"},
      {"type": "function_call_output", "call_id": "c1", "output": "1"},
      {"type": "function_call_output", "call_id": "c2", "output": "2"},
      {"type": "function_call", "call_id": "c3", "name": "add", "arguments": "{}"}],
    "tools": [{"type": "function", "name": "add", "description": "Adds.", "parameters": {"type": "object"}, "strict": true}],
    "tool_choice": {"type": "function", "name": "add"},
    "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": true}},
    "include": ["message.output_text.logprobs"], "top_logprobs": 2, "stream": true})");
  CHECK(b.stream);
  const ojson& m = b.chat["messages"];
  REQUIRE(m.size() == 6);
  CHECK(m[0] == ojson::parse(R"({"role": "developer", "content": "Use tools."})"));
  CHECK(m[1]["content"] == ojson::parse(R"([{"type": "text", "text": "Look:"},
                                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                                            {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}])"));
  CHECK(m[2] == ojson::parse(R"({"role": "assistant", "content": [{"type": "text", "text": "Let me add."}],
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\":1}"}},
                     {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{\"a\":2}"}}]})"));
  CHECK(m[3] == ojson::parse(R"({"role": "tool", "tool_call_id": "c1", "content": "1"})"));
  CHECK(m[4] == ojson::parse(R"({"role": "tool", "tool_call_id": "c2", "content": "2"})"));
  CHECK(m[5] == ojson::parse(R"({"role": "assistant", "content": null,
      "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "add", "arguments": "{}"}}]})"));
  CHECK(b.message_from == std::vector<std::string>{"input[0]", "input[1]", "input[3]", "input[6]", "input[7]", "input[8]"});
  CHECK(b.chat["tools"] == ojson::parse(R"([{"type": "function", "function": {"name": "add", "description": "Adds.",
                                              "parameters": {"type": "object"}, "strict": true}}])"));
  CHECK(b.chat["tool_choice"] == ojson::parse(R"({"type": "function", "function": {"name": "add"}})"));
  CHECK(b.chat["response_format"] == ojson::parse(R"({"type": "json_schema", "json_schema": {"name": "out",
                                                      "schema": {"type": "object"}, "strict": true}})"));
  CHECK(b.chat["logprobs"] == true);
  CHECK(b.chat["top_logprobs"] == 2);
  // The chat parser takes the body (less the format: chat refuses two constraints at once).
  ojson without_format = b.chat;
  without_format.erase("response_format");
  const ApiRequest ar = parse_chat_request(json::parse(without_format.dump()), ApiLimits{});
  CHECK(ar.logprobs);
  CHECK(ar.top_logprobs == 2);
  CHECK(ar.forced_tools == std::vector<std::string>{"add"});
  CHECK(parse(R"({"input": "x", "text": {"format": {"type": "json_object"}}})").chat["response_format"] ==
        ojson::parse(R"({"type": "json_object"})"));
  CHECK_FALSE(parse(R"({"input": "x", "text": {"format": {"type": "text"}}})").chat.contains("response_format"));
  // max_tool_calls 0: no call (tool_choice none); more changes nothing; echoed.
  const ResponsesRequest none = parse(R"({"input": "x", "max_tool_calls": 0, "tools": [{"type": "function", "name": "f"}]})");
  CHECK(none.chat["tool_choice"] == "none");
  CHECK(none.echo["max_tool_calls"] == 0);
  CHECK_FALSE(parse(R"({"input": "x", "max_tool_calls": 3, "tools": [{"type": "function", "name": "f"}]})")
                  .chat.contains("tool_choice"));
}

TEST_CASE("serve/responses previous_response_id: the stored conversation comes first, its instructions do not") {
  // A stored conversation: the earlier input (a system item given as input
  // stays) and the earlier output (a message and a call).
  const ojson previous = ojson::parse(R"([
      {"type": "message", "role": "system", "content": "Be exact.", "id": "msg_a"},
      {"type": "message", "role": "user", "content": "Add 1 and 2.", "id": "msg_b"},
      {"type": "message", "id": "msg_c", "status": "completed", "role": "assistant",
       "content": [{"type": "output_text", "text": "Calling.", "annotations": [], "logprobs": []}]},
      {"type": "function_call", "id": "fc_d", "call_id": "c1", "name": "add", "arguments": "{}", "status": "completed"}])");
  const ojson body = ojson::parse(R"({"previous_response_id": "resp_x", "instructions": "New rules.",
      "input": [{"type": "function_call_output", "call_id": "c1", "output": "3"}], "store": false})");
  const ResponsesRequest r = parse_responses_request(body, &previous);
  CHECK(r.previous_response_id == "resp_x");
  CHECK_FALSE(r.store);
  CHECK(r.chat["messages"] == ojson::parse(R"([
      {"role": "system", "content": "New rules."},
      {"role": "system", "content": "Be exact."},
      {"role": "user", "content": "Add 1 and 2."},
      {"role": "assistant", "content": [{"type": "text", "text": "Calling."}],
       "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "3"}])"));
  CHECK(r.message_from == std::vector<std::string>{"instructions", "previous_response_id (its item 0)",
                                                    "previous_response_id (its item 1)",
                                                    "previous_response_id (its item 2)", "input[0]"});
  // The items to store next: the previous ones as they were, then this
  // input's in the stored shape (an id given; a string as a user message
  // with an input_text part).
  REQUIRE(r.items.size() == 5);
  CHECK(r.input_from == 4);
  for (size_t i = 0; i < 4; ++i) CHECK(r.items[i] == previous[i]);
  ojson given = r.items[4];
  CHECK(given["id"].get<std::string>().rfind("fco_", 0) == 0);
  given.erase("id");
  CHECK(given == body["input"][0]);
  ojson hi = parse_responses_request(ojson::parse(R"({"input": "Hi"})")).items;
  REQUIRE(hi.size() == 1);
  CHECK(hi[0]["id"].get<std::string>().rfind("msg_", 0) == 0);
  CHECK(hi[0]["id"].get<std::string>().size() == 4 + 32);
  hi[0].erase("id");
  CHECK(hi == ojson::parse(R"([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}],
                               "status": "completed"}])"));
  // stored_item: the shape, ids and parts kept; an assistant's text as output_text.
  const ojson kept = ojson::parse(R"({"id": "mine", "role": "assistant", "content": "ok", "status": "incomplete"})");
  CHECK(stored_item(kept) == ojson::parse(R"({"id": "mine", "role": "assistant", "content": [{"type": "output_text",
                                              "text": "ok", "annotations": []}], "status": "incomplete", "type": "message"})"));
  const ojson parts = ojson::parse(R"({"type": "message", "id": "m", "role": "user", "status": "completed",
                                       "content": [{"type": "input_image", "image_url": "data:,"}]})");
  CHECK(stored_item(parts) == parts);
  CHECK(parse_responses_request(ojson::parse(R"({"input": "Hi"})")).store);  // OpenAI's default
  // A new input's errors keep their own index.
  try {
    parse_responses_request(ojson::parse(R"({"previous_response_id": "resp_x", "input": [{"role": "robot", "content": "x"}]})"),
                            &previous);
    FAIL("not refused");
  } catch (const ApiError& e) {
    CHECK(e.param == "input[0].role");
  }
}

TEST_CASE("serve/responses the store: every byte counted, least recently used out, ids given, input items paged") {
  const json object = {{"id", "resp_1"}, {"object", "response"}, {"output", json::array()}};
  const ojson inputs = ojson::parse(R"([{"type": "message", "role": "user", "content": "a"},
                                        {"type": "function_call_output", "call_id": "c", "output": "o", "id": "mine"}])");
  const json outputs = json::parse(R"([{"type": "message", "id": "msg_o", "role": "assistant", "content": []}])");

  ResponsesStore off(0);
  CHECK_FALSE(off.enabled());
  CHECK_FALSE(off.put("resp_1", object, inputs, outputs));

  ResponsesStore big(1 << 20);
  REQUIRE(big.put("resp_1", object, inputs, outputs));
  const size_t one = big.bytes();
  // The count covers the object, the conversation and the id.
  {
    const std::optional<ResponsesStore::Entry> e = big.get("resp_1");
    REQUIRE(e);
    CHECK(one >= object.dump().size() + e->conversation->dump().size() + 2 * std::string("resp_1").size());
    CHECK(e->object == object);
    REQUIRE(e->conversation->size() == 3);
    CHECK(e->inputs == 2);
    const std::string given = (*e->conversation)[0]["id"];
    CHECK(given.rfind("msg_", 0) == 0);
    CHECK(given.size() == 4 + 32);
    CHECK((*e->conversation)[1]["id"] == "mine");  // kept
    CHECK((*e->conversation)[2]["id"] == "msg_o");
    CHECK((*e->conversation)[1]["output"] == "o");
  }
  // Replacing an id does not count it twice.
  REQUIRE(big.put("resp_1", object, inputs, outputs));
  CHECK(big.size() == 1);
  CHECK(big.bytes() == one);

  // A budget of two entries and a bit: a third pushes out the least recently used.
  ResponsesStore small(2 * one + one / 2);
  REQUIRE(small.put("resp_a", object, inputs, outputs));
  REQUIRE(small.put("resp_b", object, inputs, outputs));
  REQUIRE(small.get("resp_a"));  // a is now the more recent
  REQUIRE(small.put("resp_c", object, inputs, outputs));
  CHECK(small.get("resp_a"));
  CHECK_FALSE(small.get("resp_b"));
  CHECK(small.get("resp_c"));
  CHECK(small.size() == 2);
  CHECK(small.bytes() <= small.max_bytes());
  CHECK(small.erase("resp_a"));
  CHECK_FALSE(small.erase("resp_a"));
  CHECK(small.size() == 1);
  CHECK(small.bytes() == one);
  // Larger than the whole budget: not kept, nothing pushed out.
  ResponsesStore tiny(one - 1);
  CHECK_FALSE(tiny.put("resp_1", object, inputs, outputs));
  CHECK(tiny.size() == 0);
  CHECK(tiny.bytes() == 0);
  // An entry replaced by one too large to keep is gone (a background
  // response's queued object does not stay after its end).
  REQUIRE(tiny.put("resp_1", object, ojson::array(), json::array()));
  CHECK_FALSE(tiny.put("resp_1", object, inputs, outputs));
  CHECK_FALSE(tiny.get("resp_1"));
  CHECK(tiny.bytes() == 0);

  // Input items: the inputs only (not the output), newest first by default.
  ResponsesStore::Entry e;
  e.conversation = std::make_shared<const ojson>(ojson::parse(
      R"([{"id": "i0"}, {"id": "i1"}, {"id": "i2"}, {"id": "i3"}, {"id": "out"}])"));
  e.inputs = 4;
  auto ids = [](const json& page) {
    std::string s;
    for (const json& x : page["data"]) s += x["id"].get<std::string>() + " ";
    return s;
  };
  const json all = input_items_page(e, "", "", "");
  CHECK(ids(all) == "i3 i2 i1 i0 ");
  CHECK(all["object"] == "list");
  CHECK(all["first_id"] == "i3");
  CHECK(all["last_id"] == "i0");
  CHECK(all["has_more"] == false);
  const json p1 = input_items_page(e, "2", "asc", "");
  CHECK(ids(p1) == "i0 i1 ");
  CHECK(p1["has_more"] == true);
  const json p2 = input_items_page(e, "2", "asc", "i1");
  CHECK(ids(p2) == "i2 i3 ");
  CHECK(p2["has_more"] == false);
  const json p3 = input_items_page(e, "", "desc", "i0");
  CHECK(p3["data"].empty());
  CHECK(p3["first_id"].is_null());
  for (const char* bad : {"0", "101", "-1", "x", "1000000000000000000000"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(input_items_page(e, bad, "", ""), ApiError);
  }
  CHECK_THROWS_AS(input_items_page(e, "", "up", ""), ApiError);
  CHECK_THROWS_AS(input_items_page(e, "", "", "out"), ApiError);  // an output item is no input item
}

TEST_CASE("serve/responses a background stream's events: one per blank line, read from any index, counted in the store") {
  auto events = std::make_shared<ResponseEvents>();
  events->append("event: a\ndata: {\"sequence_number\":0}\n\nevent: b\ndata: {\"sequence_number\":1}\n\n");
  events->append("");
  events->append("event: c\ndata: {\"sequence_number\":2}\n\n");
  CHECK(events->size() == 3);
  bool closed = true;
  std::vector<std::string> got = events->wait_from(1, std::chrono::milliseconds(0), closed);
  CHECK_FALSE(closed);
  REQUIRE(got.size() == 2);
  CHECK(got[0] == "event: b\ndata: {\"sequence_number\":1}\n\n");
  CHECK(got[1] == "event: c\ndata: {\"sequence_number\":2}\n\n");
  // Nothing past the end: waits the timeout, then nothing.
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(events->wait_from(3, std::chrono::milliseconds(50), closed).empty());
  CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(45));
  CHECK_FALSE(closed);
  // A waiting reader wakes at the next event, and at the close.
  std::thread producer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    events->append("event: d\ndata: {}\n\n");
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    events->close();
  });
  got = events->wait_from(3, std::chrono::seconds(20), closed);
  REQUIRE(got.size() == 1);
  CHECK(got[0] == "event: d\ndata: {}\n\n");
  got = events->wait_from(4, std::chrono::seconds(20), closed);
  producer.join();
  CHECK(got.empty());
  CHECK(closed);
  CHECK(events->wait_from(0, std::chrono::milliseconds(0), closed).size() == 4);  // closed: all, at once
  CHECK(closed);
  // At most max_bytes at a time (but one event at least): closed only with the last.
  got = events->wait_from(0, std::chrono::milliseconds(0), closed, 80);
  CHECK(got.size() == 2);  // 38 + 38 bytes fit 80, a third would not
  CHECK_FALSE(closed);
  got = events->wait_from(0, std::chrono::milliseconds(0), closed, 1);
  CHECK(got.size() == 1);
  CHECK_FALSE(closed);
  got = events->wait_from(3, std::chrono::milliseconds(0), closed, 1);
  CHECK(got.size() == 1);
  CHECK(closed);

  // The store counts the events' bytes at put, and again at recount.
  const json object = {{"id", "resp_1"}, {"object", "response"}, {"output", json::array()}};
  const ojson inputs = ojson::parse(R"([{"type": "message", "role": "user", "content": "a"}])");
  ResponsesStore plain(1 << 20), with(1 << 20);
  REQUIRE(plain.put("resp_1", object, inputs, json::array()));
  auto log = std::make_shared<ResponseEvents>();
  log->append("event: a\ndata: {}\n\n");
  REQUIRE(with.put("resp_1", object, inputs, json::array(), log));
  CHECK(with.bytes() == plain.bytes() + log->bytes());
  CHECK(log->bytes() >= std::string("event: a\ndata: {}\n\n").size());
  log->append(std::string(1000, 'x') + "\n\n");
  CHECK(with.bytes() == plain.bytes() + log->bytes() - 1002 - sizeof(std::string));  // not yet recounted
  CHECK(with.recount("resp_1"));
  CHECK(with.bytes() == plain.bytes() + log->bytes());
  CHECK(with.get("resp_1")->events == log);
  CHECK_FALSE(with.recount("resp_2"));
  // Grown past the whole budget: dropped at the recount.
  ResponsesStore budget(plain.bytes() + log->bytes() + 10);
  REQUIRE(budget.put("resp_1", object, inputs, json::array(), log));
  log->append(std::string(100, 'y') + "\n\n");
  CHECK_FALSE(budget.recount("resp_1"));
  CHECK(budget.size() == 0);
  CHECK(budget.bytes() == 0);
}

TEST_CASE("serve/responses refusals name the field; chat errors are renamed to the request's fields") {
  const std::pair<const char*, std::pair<std::string, std::string>> cases[] = {
      {R"([1])", {"", "the request body must be a JSON object (got array)"}},
      {R"({})", {"input", "'input' is required (or previous_response_id or conversation to answer a stored history)"}},
      {R"({"input": []})", {"input", "'input' must not be an empty array"}},
      {R"({"input": 3})", {"input", "'input' must be a string or an array of items (got number)"}},
      {R"({"input": [{"type": "reasoning"}]})", {"input", "'input' has no message (only reasoning items)"}},
      {R"({"input": "x", "previous_response_id": "resp_1"})",
       {"previous_response_id", "Previous response with id 'resp_1' not found."}},
      {R"({"input": "x", "previous_response_id": 1})", {"previous_response_id", "'previous_response_id' must be a string"}},
      {R"({"input": "x", "store": "yes"})", {"store", "'store' must be a boolean"}},
      {R"({"input": "x", "conversation": 1})", {"conversation", ""}},
      {R"({"input": "x", "conversation": {"name": "c"}})", {"conversation", ""}},
      {R"({"input": "x", "conversation": "c", "previous_response_id": "r"})", {"conversation", ""}},
      {R"({"input": "x", "metadata": {"k": 1}})", {"metadata.k", ""}},
      {R"({"input": "x", "metadata": []})", {"metadata", ""}},
      {R"({"input": "x", "background": 1})", {"background", "'background' must be a boolean"}},
      {R"({"input": "x", "background": true, "store": false})", {"background", ""}},
      {R"({"input": "x", "prompt": {"id": "p"}})", {"prompt", ""}},
      {R"({"input": "x", "truncation": "middle"})", {"truncation", ""}},
      {R"({"input": "x", "stream": "yes"})", {"stream", "'stream' must be a boolean"}},
      {R"({"input": "x", "instructions": 5})", {"instructions", "'instructions' must be a string"}},
      {R"({"input": [5]})", {"input[0]", "'input[0]' must be an object (got number)"}},
      {R"({"input": [{"role": "robot", "content": "x"}]})",
       {"input[0].role", "'input[0].role' 'robot' is not a role (user, assistant, system or developer)"}},
      {R"({"input": [{"role": "user"}]})", {"input[0].content", "'input[0].content' is required"}},
      {R"({"input": [{"type": "item_reference", "id": "x"}]})", {"input[0].type", ""}},
      {R"({"input": [{"type": 7}]})", {"input[0].type", ""}},
      {R"({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]})",
       {"input[0].content[0].type", "'input[0].content[0].type' 'input_file' is not supported (input_text, "
                                    "input_image or input_audio)"}},
      {R"({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]})",
       {"input[0].content[0].file_id", ""}},
      {R"({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})",
       {"input[0].content[0].image_url", "'input[0].content[0].image_url' must be a string"}},
      {R"({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}]})",
       {"input[0].content[0].type", ""}},
      {R"({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]})", {"input[0].arguments", ""}},
      {R"({"input": [{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]})",
       {"input[0].output", "'input[0].output' must be a string"}},
      {R"({"input": "x", "tools": [{"type": "web_search_preview"}]})",
       {"tools[0].type", "'tools[0].type' 'web_search_preview' is not supported: only function tools are (the "
                         "server runs no built-in tools)"}},
      {R"({"input": "x", "tools": [{"type": "function"}]})", {"tools[0].name", ""}},
      {R"({"input": "x", "tool_choice": {"type": "file_search"}})", {"tool_choice", ""}},
      {R"({"input": "x", "text": {"format": {"type": "xml"}}})", {"text.format.type", ""}},
      {R"({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}})", {"text.format.schema", ""}},
      {R"({"input": "x", "include": "all"})", {"include", ""}},
      {R"({"input": "x", "metadata": []})", {"metadata", ""}},
      {R"({"input": "x", "max_tool_calls": -1})", {"max_tool_calls", "'max_tool_calls' must be an integer >= 0"}},
      {R"({"input": "x", "max_tool_calls": 0, "tool_choice": "required",
           "tools": [{"type": "function", "name": "f"}]})", {"max_tool_calls", ""}},
  };
  for (const auto& item : cases) {  // no structured binding: clang 14 cannot capture one
    const char* body = item.first;
    const std::pair<std::string, std::string>& want = item.second;
    CAPTURE(body);
    const std::pair<std::string, std::string> got = refusal(body);
    CHECK(got.first == want.first);
    if (!want.second.empty()) CHECK(got.second == want.second);
  }

  // Chat-path errors, renamed: a message's index becomes its item's, the
  // chat names become the request's.
  const ResponsesRequest r = parse(R"({"instructions": "s", "input": [{"role": "user", "content": "a"},
      {"type": "reasoning"}, {"role": "user", "content": "b"}]})");
  const ApiError e1 = responses_error(ApiError(400, "'messages[2].content' is bad", "messages[2].content"), r);
  CHECK(e1.param == "input[2].content");
  CHECK(std::string(e1.what()) == "'input[2].content' is bad");
  CHECK(responses_error(ApiError(400, "x", "messages[0]"), r).param == "instructions");
  CHECK(responses_error(ApiError(400, "'max_completion_tokens' must be >= 1", "max_completion_tokens"), r).param ==
        "max_output_tokens");
  CHECK(responses_error(ApiError(400, "x", "tools[3].function.parameters"), r).param == "tools[3].parameters");
  CHECK(responses_error(ApiError(400, "x", "response_format.json_schema.schema"), r).param == "text.format.schema");
  CHECK(responses_error(ApiError(400, "x", "messages"), r).param == "input");
  CHECK(responses_error(ApiError(404, "no model", "model", "model_not_found"), r).code == "model_not_found");
  // Over the chat parser: a bad temperature keeps its name, a bad token limit takes the request's.
  const ResponsesRequest t = parse(R"({"input": "x", "max_output_tokens": 0})");
  try {
    parse_chat_request(json::parse(t.chat.dump()), ApiLimits{});
    FAIL("not refused");
  } catch (const ApiError& e) {
    const ApiError mapped = responses_error(e, t);
    CHECK(mapped.param == "max_output_tokens");
    CHECK(std::string(mapped.what()).find("max_completion_tokens") == std::string::npos);
  }
}

TEST_CASE("serve/responses over HTTP: the chat answer as a response; streamed events in order; tools; incomplete; cached tokens") {
  DemoServer demo(demo_engine(256, /*prefix_caching=*/true));
  Served& served = demo.served;

  // The same turn through chat, greedy.
  const std::string question = "What is 2 + 3?";
  Reply chat = post(served.port, "/v1/chat/completions",
                    {{"messages", {{{"role", "system"}, {"content", "Answer."}}, {{"role", "user"}, {"content", question}}}},
                     {"max_completion_tokens", 8},
                     {"temperature", 0}});
  REQUIRE(chat.status == 200);
  const std::string text = chat.j["choices"][0]["message"]["content"];
  const int64_t prompt_tokens = chat.j["usage"]["prompt_tokens"], completion_tokens = chat.j["usage"]["completion_tokens"];
  REQUIRE_FALSE(text.empty());

  const json body = {{"input", question}, {"instructions", "Answer."}, {"max_output_tokens", 8}, {"temperature", 0},
                     {"metadata", {{"run", "1"}}}, {"include", {"message.output_text.logprobs"}}};
  Reply r = post(served.port, "/v1/responses", body);
  CAPTURE(r.body);
  REQUIRE(r.status == 200);
  CHECK(r.j["object"] == "response");
  CHECK(r.j["id"].get<std::string>().rfind("resp_", 0) == 0);
  CHECK(r.j["status"] == "completed");
  CHECK(r.j["model"] == "areno-demo");
  CHECK(r.j["instructions"] == "Answer.");
  CHECK(r.j["max_output_tokens"] == 8);
  CHECK(r.j["metadata"] == json{{"run", "1"}});
  CHECK(r.j["store"] == true);  // OpenAI's default, and the server has a store
  REQUIRE(r.j["output"].size() == 1);
  const json& msg = r.j["output"][0];
  CHECK(msg["type"] == "message");
  CHECK(msg["role"] == "assistant");
  CHECK(msg["status"] == "completed");
  CHECK(msg["id"].get<std::string>().rfind("msg_", 0) == 0);
  CHECK(msg["content"][0]["type"] == "output_text");
  CHECK(msg["content"][0]["text"] == text);
  CHECK(msg["content"][0]["logprobs"].size() == size_t(completion_tokens));
  CHECK(r.j["usage"]["input_tokens"] == prompt_tokens);
  CHECK(r.j["usage"]["output_tokens"] == completion_tokens);
  CHECK(r.j["usage"]["total_tokens"] == prompt_tokens + completion_tokens);

  // Streamed: OpenAI's order, sequence numbers 0.., the deltas add up, the
  // final response is the whole one.
  json sbody = body;
  sbody["stream"] = true;
  Reply s = post(served.port, "/v1/responses", sbody);
  REQUIRE(s.status == 200);
  const std::vector<json> ev = events_of(s.body);
  REQUIRE(ev.size() >= 9);
  for (size_t i = 0; i < ev.size(); ++i) CHECK(ev[i]["sequence_number"] == i);
  CHECK(ev[0]["type"] == "response.created");
  CHECK(ev[0]["response"]["status"] == "in_progress");
  CHECK(ev[1]["type"] == "response.in_progress");
  CHECK(ev[2]["type"] == "response.output_item.added");
  CHECK(ev[3]["type"] == "response.content_part.added");
  std::string deltas;
  size_t k = 4, lps = 0;
  for (; k < ev.size() && ev[k]["type"] == "response.output_text.delta"; ++k) {
    deltas += ev[k]["delta"].get<std::string>();
    lps += ev[k]["logprobs"].size();
  }
  CHECK(deltas == text);
  CHECK(lps == size_t(completion_tokens));
  REQUIRE(k + 4 == ev.size());
  CHECK(ev[k]["type"] == "response.output_text.done");
  CHECK(ev[k]["text"] == text);
  CHECK(ev[k + 1]["type"] == "response.content_part.done");
  CHECK(ev[k + 2]["type"] == "response.output_item.done");
  CHECK(ev[k + 2]["item"]["content"][0]["text"] == text);
  CHECK(ev[k + 3]["type"] == "response.completed");
  const json& fin = ev[k + 3]["response"];
  CHECK(fin["id"] == ev[0]["response"]["id"]);
  CHECK(fin["output"][0]["id"] == ev[2]["item"]["id"]);
  CHECK(fin["output"][0]["content"][0]["text"] == text);
  CHECK(fin["usage"]["output_tokens"] == completion_tokens);
  CHECK(s.body.find("[DONE]") == std::string::npos);

  // The length limit: status incomplete, the reason, the message incomplete.
  Reply cut = post(served.port, "/v1/responses", {{"input", "Tell me a long story."}, {"max_output_tokens", 2},
                                                  {"temperature", 0}, {"ignore_eos", true}});
  REQUIRE(cut.status == 200);
  CHECK(cut.j["status"] == "incomplete");
  CHECK(cut.j["incomplete_details"] == json{{"reason", "max_output_tokens"}});
  CHECK(cut.j["output"][0]["status"] == "incomplete");
  CHECK(cut.j["usage"]["output_tokens"] == 2);

  // Tools: a required call comes back as a function_call item (whole and
  // streamed), and the call with its output continues the conversation.
  const json tools = json::parse(R"([{"type": "function", "name": "add", "parameters": {"type": "object",
      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}])");
  Reply call = post(served.port, "/v1/responses", {{"input", "Add 2 and 3."}, {"tools", tools},
                                                   {"tool_choice", "required"}, {"max_output_tokens", 60},
                                                   {"temperature", 0}});
  CAPTURE(call.body);
  REQUIRE(call.status == 200);
  const json* fc = nullptr;
  for (const json& item : call.j["output"])
    if (item["type"] == "function_call") fc = &item;
  REQUIRE(fc != nullptr);
  CHECK((*fc)["name"] == "add");
  CHECK((*fc)["id"].get<std::string>().rfind("fc_", 0) == 0);
  const json args = json::parse((*fc)["arguments"].get<std::string>());
  CHECK(args.contains("a"));
  CHECK(args.contains("b"));
  CHECK(call.j["tools"] == tools);
  CHECK(call.j["tool_choice"] == "required");
  Reply scall = post(served.port, "/v1/responses", {{"input", "Add 2 and 3."}, {"tools", tools},
                                                    {"tool_choice", "required"}, {"max_output_tokens", 60},
                                                    {"temperature", 0}, {"stream", true}});
  REQUIRE(scall.status == 200);
  const std::vector<json> cev = events_of(scall.body);
  std::string arg_delta;
  for (const json& e : cev)
    if (e["type"] == "response.function_call_arguments.delta") arg_delta += e["delta"].get<std::string>();
  CHECK(arg_delta == (*fc)["arguments"]);  // greedy: the same call
  CHECK(cev.back()["type"] == "response.completed");
  const json input = {{{"role", "user"}, {"content", "Add 2 and 3."}},
                      {{"type", "function_call"}, {"call_id", (*fc)["call_id"]}, {"name", "add"}, {"arguments", (*fc)["arguments"]}},
                      {{"type", "function_call_output"}, {"call_id", (*fc)["call_id"]}, {"output", "5"}}};
  Reply next = post(served.port, "/v1/responses", {{"input", input}, {"tools", tools}, {"max_output_tokens", 4},
                                                   {"temperature", 0}});
  REQUIRE(next.status == 200);
  // The same history through chat gives the same prompt length.
  const json history = {{{"role", "user"}, {"content", "Add 2 and 3."}},
                        {{"role", "assistant"}, {"content", nullptr},
                         {"tool_calls", {{{"id", (*fc)["call_id"]}, {"type", "function"},
                                          {"function", {{"name", "add"}, {"arguments", (*fc)["arguments"]}}}}}}},
                        {{"role", "tool"}, {"tool_call_id", (*fc)["call_id"]}, {"content", "5"}}};
  json chat_tools = json::array({{{"type", "function"}, {"function", {{"name", "add"}, {"parameters", tools[0]["parameters"]}}}}});
  Reply cnext = post(served.port, "/v1/chat/completions", {{"messages", history}, {"tools", chat_tools},
                                                           {"max_completion_tokens", 4}, {"temperature", 0}});
  REQUIRE(cnext.status == 200);
  CHECK(next.j["usage"]["input_tokens"] == cnext.j["usage"]["prompt_tokens"]);

  // Prefix caching: a longer shared prompt sent twice reports its cached blocks.
  std::string long_text;
  for (int i = 0; i < 20; ++i) long_text += fmt::format("Line {} of a long shared preamble. ", i);
  const json lbody = {{"input", long_text}, {"max_output_tokens", 1}, {"temperature", 0}};
  Reply first = post(served.port, "/v1/responses", lbody);
  Reply second = post(served.port, "/v1/responses", lbody);
  REQUIRE(first.status == 200);
  REQUIRE(second.status == 200);
  const int64_t input_tokens = second.j["usage"]["input_tokens"];
  const int64_t cached = second.j["usage"]["input_tokens_details"]["cached_tokens"];
  CHECK(first.j["usage"]["input_tokens_details"]["cached_tokens"] == 0);
  CHECK(cached > 0);
  CHECK(cached % 16 == 0);  // whole blocks
  CHECK(cached <= input_tokens - 1);
  // Chat and completions report the same in usage.prompt_tokens_details (streamed too).
  const json cbody = {{"messages", {{{"role", "user"}, {"content", long_text}}}}, {"max_tokens", 1}, {"temperature", 0}};
  Reply c1 = post(served.port, "/v1/chat/completions", cbody);
  REQUIRE(c1.status == 200);
  CHECK(c1.j["usage"]["prompt_tokens_details"]["cached_tokens"] == cached);  // the same prompt as the Responses one
  json sc = cbody;
  sc["stream"] = true;
  sc["stream_options"] = {{"include_usage", true}};
  Reply c2 = post(served.port, "/v1/chat/completions", sc);
  REQUIRE(c2.status == 200);
  const size_t u = c2.body.rfind("\"usage\"");
  REQUIRE(u != std::string::npos);
  CHECK(c2.body.find(fmt::format("\"cached_tokens\":{}", cached), u) != std::string::npos);

  // Errors: the request's fields, the chat path's checks.
  Reply e1 = post(served.port, "/v1/responses", {{"input", "x"}, {"temperature", 7}});
  CHECK(e1.status == 400);
  CHECK(e1.j["error"]["param"] == "temperature");
  Reply e2 = post(served.port, "/v1/responses",
                  {{"input", {{{"role", "user"}, {"content", {{{"type", "input_image"}, {"image_url", "http://127.0.0.1:9/a.png"}}}}}}}});
  CHECK(e2.status == 400);
  CHECK(e2.j["error"]["param"].get<std::string>().rfind("input[0]", 0) == 0);
  Reply e3 = post(served.port, "/v1/responses", {{"input", "x"}, {"model", "nope"}});
  CHECK(e3.status == 404);
  CHECK(e3.j["error"]["code"] == "model_not_found");
  Reply e4 = post(served.port, "/v1/responses", {{"input", "x"}, {"max_output_tokens", 1000000}});
  CHECK(e4.status == 400);
  CHECK(e4.j["error"]["message"].get<std::string>().find("messages") == std::string::npos);
  // The server still answers.
  CHECK(post(served.port, "/v1/responses", body).status == 200);
}

TEST_CASE("serve/responses stored: GET returns it, previous_response_id continues it, input items, DELETE, no store") {
  DemoServer demo(demo_engine(256));
  Engine& engine = demo.engine;
  const int port = demo.served.port;

  // A first turn; GET gives the object the POST answered.
  const json first_body = {{"input", "What is 2 + 3?"}, {"instructions", "Answer."}, {"max_output_tokens", 6},
                           {"temperature", 0}};
  Reply first = post(port, "/v1/responses", first_body);
  CAPTURE(first.body);
  REQUIRE(first.status == 200);
  CHECK(first.j["store"] == true);
  const std::string id = first.j["id"];
  CHECK(id.size() == 5 + 32);
  Reply got = call(port, "GET", "/v1/responses/" + id);
  REQUIRE(got.status == 200);
  CHECK(got.j == first.j);
  const std::string answer = first.j["output"][0]["content"][0]["text"];

  // The next turn continues it: its prompt is the chat of the earlier input,
  // the earlier answer and the new input, without the earlier instructions.
  Reply second = post(port, "/v1/responses", {{"previous_response_id", id}, {"input", "And 4 + 5?"},
                                              {"max_output_tokens", 6}, {"temperature", 0}});
  CAPTURE(second.body);
  REQUIRE(second.status == 200);
  CHECK(second.j["previous_response_id"] == id);
  CHECK(second.j["instructions"].is_null());
  const json history = {{{"role", "user"}, {"content", "What is 2 + 3?"}},
                        {{"role", "assistant"}, {"content", answer}},
                        {{"role", "user"}, {"content", "And 4 + 5?"}}};
  Reply chat = post(port, "/v1/chat/completions", {{"messages", history}, {"max_completion_tokens", 6}, {"temperature", 0}});
  REQUIRE(chat.status == 200);
  CHECK(second.j["usage"]["input_tokens"] == chat.j["usage"]["prompt_tokens"]);
  CHECK(second.j["output"][0]["content"][0]["text"] == chat.j["choices"][0]["message"]["content"]);

  // Its input items: the whole context, oldest first with order=asc, paged.
  Reply items = call(port, "GET", "/v1/responses/" + second.j["id"].get<std::string>() + "/input_items?order=asc");
  CAPTURE(items.body);
  REQUIRE(items.status == 200);
  REQUIRE(items.j["data"].size() == 3);
  CHECK(items.j["data"][0]["content"] == json::parse(R"([{"type": "input_text", "text": "What is 2 + 3?"}])"));
  CHECK(items.j["data"][0]["type"] == "message");
  CHECK(items.j["data"][0]["status"] == "completed");
  CHECK(items.j["data"][1]["id"] == first.j["output"][0]["id"]);
  CHECK(items.j["data"][2]["content"][0]["text"] == "And 4 + 5?");
  CHECK(items.j["has_more"] == false);
  Reply page = call(port, "GET", "/v1/responses/" + second.j["id"].get<std::string>() + "/input_items?limit=1");
  REQUIRE(page.status == 200);
  CHECK(page.j["data"].size() == 1);
  CHECK(page.j["data"][0]["content"][0]["text"] == "And 4 + 5?");  // newest first by default
  CHECK(page.j["has_more"] == true);
  CHECK(call(port, "GET", "/v1/responses/" + id + "/input_items?limit=500").status == 400);

  // Streamed, continuing the second: the final event's response is what GET gives.
  Reply s = post(port, "/v1/responses", {{"previous_response_id", second.j["id"]}, {"input", "Thanks."},
                                         {"max_output_tokens", 4}, {"temperature", 0}, {"stream", true}});
  REQUIRE(s.status == 200);
  const std::vector<json> ev = events_of(s.body);
  REQUIRE(!ev.empty());
  CHECK(ev[0]["response"]["previous_response_id"] == second.j["id"]);
  const json& fin = ev.back()["response"];
  CHECK(fin["store"] == true);
  Reply sgot = call(port, "GET", "/v1/responses/" + fin["id"].get<std::string>());
  REQUIRE(sgot.status == 200);
  CHECK(sgot.j == fin);
  Reply sitems = call(port, "GET", "/v1/responses/" + fin["id"].get<std::string>() + "/input_items?limit=100");
  CHECK(sitems.j["data"].size() == 5);

  // A tool call answered through previous_response_id gives the prompt of the whole input sent again.
  const json tools = json::parse(R"([{"type": "function", "name": "add", "parameters": {"type": "object",
      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}])");
  Reply c1 = post(port, "/v1/responses", {{"input", "Add 2 and 3."}, {"tools", tools}, {"tool_choice", "required"},
                                          {"max_output_tokens", 60}, {"temperature", 0}});
  REQUIRE(c1.status == 200);
  json whole = json::array({{{"role", "user"}, {"content", "Add 2 and 3."}}});
  std::string call_id;
  for (const json& item : c1.j["output"]) {
    whole.push_back(item);
    if (item["type"] == "function_call") call_id = item["call_id"];
  }
  REQUIRE_FALSE(call_id.empty());
  const json result = {{"type", "function_call_output"}, {"call_id", call_id}, {"output", "5"}};
  whole.push_back(result);
  Reply c2 = post(port, "/v1/responses", {{"previous_response_id", c1.j["id"]}, {"input", {result}}, {"tools", tools},
                                          {"max_output_tokens", 4}, {"temperature", 0}});
  Reply c3 = post(port, "/v1/responses", {{"input", whole}, {"tools", tools}, {"max_output_tokens", 4},
                                          {"temperature", 0}, {"store", false}});
  REQUIRE(c2.status == 200);
  REQUIRE(c3.status == 200);
  CHECK(c2.j["usage"]["input_tokens"] == c3.j["usage"]["input_tokens"]);
  REQUIRE(c2.j["output"].size() == c3.j["output"].size());  // greedy: the same answer (ids differ)
  for (size_t i = 0; i < c2.j["output"].size(); ++i) {
    CHECK(c2.j["output"][i]["type"] == c3.j["output"][i]["type"]);
    CHECK(c2.j["output"][i].value("content", json()) == c3.j["output"][i].value("content", json()));
  }
  // store false: answered, not kept.
  CHECK(c3.j["store"] == false);
  CHECK(call(port, "GET", "/v1/responses/" + c3.j["id"].get<std::string>()).status == 404);

  // DELETE: gone for GET, for input items and as a previous response.
  Reply del = call(port, "DELETE", "/v1/responses/" + id);
  REQUIRE(del.status == 200);
  CHECK(del.j == json{{"id", id}, {"object", "response.deleted"}, {"deleted", true}});
  Reply gone = call(port, "GET", "/v1/responses/" + id);
  CHECK(gone.status == 404);
  CHECK(gone.j["error"]["message"] == fmt::format("Response with id '{}' not found.", id));
  CHECK(call(port, "DELETE", "/v1/responses/" + id).status == 404);
  CHECK(call(port, "GET", "/v1/responses/" + id + "/input_items").status == 404);
  Reply orphan = post(port, "/v1/responses", {{"previous_response_id", id}, {"input", "x"}});
  CHECK(orphan.status == 400);
  CHECK(orphan.j["error"]["code"] == "previous_response_not_found");
  CHECK(orphan.j["error"]["param"] == "previous_response_id");
  // A later turn stands on its own copy: the second still loads after the first is gone.
  CHECK(call(port, "GET", "/v1/responses/" + second.j["id"].get<std::string>()).status == 200);
  // Ids outside the route's pattern are no route.
  CHECK(call(port, "GET", "/v1/responses/" + std::string(200, 'a')).status == 404);
  CHECK(call(port, "GET", "/v1/responses/a%2Fb").status == 404);

  // Metrics label the route, not the id.
  Reply metrics = call(port, "GET", "/metrics");
  CHECK(metrics.body.find("route=\"/v1/responses/{id}\"") != std::string::npos);
  CHECK(metrics.body.find("route=\"/v1/responses/{id}/input_items\"") != std::string::npos);
  CHECK(metrics.body.find(id) == std::string::npos);
  CHECK(metrics.body.find("areno_responses_stored ") != std::string::npos);

  // A server without a store: answered with store false, nothing to GET, previous ids refused.
  ServerOptions none;
  none.responses_store_bytes = 0;
  Served bare(engine, none);
  Reply plain = post(bare.port, "/v1/responses", first_body);
  REQUIRE(plain.status == 200);
  CHECK(plain.j["store"] == false);
  CHECK(call(bare.port, "GET", "/v1/responses/" + plain.j["id"].get<std::string>()).status == 404);
  Reply background = post(bare.port, "/v1/responses", {{"input", "x"}, {"background", true}});
  CHECK(background.status == 400);
  CHECK(background.j["error"]["param"] == "background");
  Reply refused = post(bare.port, "/v1/responses", {{"previous_response_id", second.j["id"]}, {"input", "x"}});
  CHECK(refused.status == 400);
  CHECK(refused.j["error"]["param"] == "previous_response_id");
  CHECK(refused.j["error"]["message"].get<std::string>().find("--responses-store-mb") != std::string::npos);
}

TEST_CASE("serve/responses background: queued at once, read back when done, cancelled, deleted while running") {
  DemoServer demo(demo_engine(512));
  Engine& engine = demo.engine;
  Served& served = demo.served;
  const int port = served.port;
  auto poll = [&](const std::string& id) {
    Reply g;
    for (int i = 0; i < 600; ++i) {
      g = call(port, "GET", "/v1/responses/" + id);
      if (g.status != 200 || (g.j["status"] != "queued" && g.j["status"] != "in_progress")) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return g;
  };

  // Queued at once; read back, it is the answer the same request gives in the foreground.
  const json ask = {{"input", "What is 2 + 3?"}, {"max_output_tokens", 6}, {"temperature", 0}};
  Reply fg = post(port, "/v1/responses", ask);
  REQUIRE(fg.status == 200);
  json bask = ask;
  bask["background"] = true;
  Reply q = post(port, "/v1/responses", bask);
  CAPTURE(q.body);
  REQUIRE(q.status == 200);
  CHECK(q.j["status"] == "queued");
  CHECK(q.j["background"] == true);
  CHECK(q.j["store"] == true);
  CHECK(q.j["output"].empty());
  const std::string id = q.j["id"];
  Reply done = poll(id);
  CAPTURE(done.body);
  REQUIRE(done.status == 200);
  CHECK(done.j["status"] == "completed");
  CHECK(done.j["background"] == true);
  CHECK(done.j["output"][0]["content"][0]["text"] == fg.j["output"][0]["content"][0]["text"]);
  CHECK(done.j["usage"]["input_tokens"] == fg.j["usage"]["input_tokens"]);
  CHECK(done.j["usage"]["output_tokens"] == fg.j["usage"]["output_tokens"]);
  // It continues as any stored response; cancelling it now answers it as it is.
  Reply next = post(port, "/v1/responses", {{"previous_response_id", id}, {"input", "And 1 + 1?"}, {"max_output_tokens", 2}});
  CHECK(next.status == 200);
  Reply late = post(port, "/v1/responses/" + id + "/cancel", json::object());
  CHECK(late.status == 200);
  CHECK(late.j["status"] == "completed");

  // A long one: running (in_progress, not continuable, counted in flight), then cancelled.
  json longer = {{"input", "Tell me a long story."}, {"max_output_tokens", 3000}, {"ignore_eos", true},
                 {"temperature", 0}, {"background", true}};
  Reply run = post(port, "/v1/responses", longer);
  REQUIRE(run.status == 200);
  const std::string rid = run.j["id"];
  Reply g = call(port, "GET", "/v1/responses/" + rid);
  CHECK(g.j["status"] == "in_progress");
  CHECK(served.server->in_flight() >= 1);  // draining waits for it
  Reply cont = post(port, "/v1/responses", {{"previous_response_id", rid}, {"input", "x"}});
  CHECK(cont.status == 400);
  CHECK(cont.j["error"]["message"].get<std::string>().find("in_progress") != std::string::npos);
  Reply cancelled = post(port, "/v1/responses/" + rid + "/cancel", json::object());
  CAPTURE(cancelled.body);
  REQUIRE(cancelled.status == 200);
  CHECK(cancelled.j["status"] == "cancelled");
  CHECK(call(port, "GET", "/v1/responses/" + rid).j["status"] == "cancelled");
  CHECK(post(port, "/v1/responses", {{"previous_response_id", rid}, {"input", "x"}}).status == 400);
  CHECK(wait_for([&] { return engine.stats().running == 0 && engine.stats().kv_blocks_used == 0; }, 20));

  // Deleted while running: stopped, gone.
  Reply run2 = post(port, "/v1/responses", longer);
  REQUIRE(run2.status == 200);
  const std::string did = run2.j["id"];
  Reply del = call(port, "DELETE", "/v1/responses/" + did);
  CHECK(del.status == 200);
  CHECK(call(port, "GET", "/v1/responses/" + did).status == 404);
  CHECK(wait_for([&] { return engine.stats().running == 0 && engine.stats().kv_blocks_used == 0; }, 20));
  CHECK(wait_for([&] { return served.server->in_flight() == 0; }, 20));

  // Refusals: a foreground response cannot be cancelled; an unknown id is 404.
  Reply fgc = post(port, "/v1/responses/" + fg.j["id"].get<std::string>() + "/cancel", json::object());
  CHECK(fgc.status == 400);
  CHECK(fgc.j["error"]["message"] == "Only background responses can be cancelled.");
  CHECK(post(port, "/v1/responses/resp_nothing/cancel", json::object()).status == 404);
  Reply metrics = call(port, "GET", "/metrics");
  CHECK(metrics.body.find("route=\"/v1/responses/{id}/cancel\"") != std::string::npos);
}

namespace {

// A request whose answer is an event stream, read until `enough` says so
// (then the client hangs up) or to its end. Returns (status, what was read).
std::pair<int, std::string> read_stream(int port, const std::string& method, const std::string& path,
                                        const json& body = nullptr,
                                        const std::function<bool(const std::string&)>& enough = {}) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(120, 0);
  httplib::Request req;
  req.method = method;
  req.path = path;
  if (!body.is_null()) {
    req.body = body.dump();
    req.set_header("Content-Type", "application/json");
  }
  std::string got;
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    got.append(d, n);
    return !(enough && enough(got));
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool ok = cli.send(req, res, err);
  if (!ok && !(enough && enough(got))) FAIL("the stream failed: " << httplib::to_string(err));
  return {ok ? res.status : 200, got};
}

size_t count_of(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("serve/responses background streams: the foreground's events, kept to be resumed after a hang-up, cancelled") {
  DemoServer demo(demo_engine(512));
  Engine& engine = demo.engine;
  const int port = demo.served.port;

  // The foreground stream and the background one: the same events, but the
  // first object's status (queued), and the ids.
  const json ask = {{"input", "What is 2 + 3?"}, {"max_output_tokens", 6}, {"temperature", 0}, {"stream", true}};
  auto [fs, fbody] = read_stream(port, "POST", "/v1/responses", ask);
  REQUIRE(fs == 200);
  json bask = ask;
  bask["background"] = true;
  const std::pair<int, std::string> bstream = read_stream(port, "POST", "/v1/responses", bask);
  const std::string& bbody = bstream.second;  // (no structured binding: clang 14's CAPTURE cannot take one)
  CAPTURE(bbody);
  REQUIRE(bstream.first == 200);
  const std::vector<json> fg = events_of(fbody), bg = events_of(bbody);
  REQUIRE(bg.size() == fg.size());
  REQUIRE(bg.size() >= 5);
  for (size_t k = 0; k < bg.size(); ++k) {
    CAPTURE(k);
    CHECK(bg[k]["type"] == fg[k]["type"]);
    CHECK(bg[k]["sequence_number"] == k);
    if (bg[k].contains("delta")) CHECK(bg[k]["delta"] == fg[k]["delta"]);
  }
  CHECK(bg[0]["type"] == "response.created");
  CHECK(bg[0]["response"]["status"] == "queued");
  CHECK(bg[0]["response"]["background"] == true);
  CHECK(bg[1]["response"]["status"] == "in_progress");
  const json final = bg.back()["response"];
  CHECK(bg.back()["type"] == "response.completed");
  CHECK(final["background"] == true);
  CHECK(final["store"] == true);
  CHECK(final["output"][0]["content"][0]["text"] == fg.back()["response"]["output"][0]["content"][0]["text"]);
  const std::string id = final["id"];

  // Read back: the object; the whole stream again; the events past a sequence number.
  Reply got = call(port, "GET", "/v1/responses/" + id);
  REQUIRE(got.status == 200);
  CHECK(got.j == final);
  auto [s0, again] = read_stream(port, "GET", "/v1/responses/" + id + "?stream=true");
  CHECK(s0 == 200);
  CHECK(again == bbody);
  auto [s1, tail] = read_stream(port, "GET", "/v1/responses/" + id + "?stream=true&starting_after=2");
  CHECK(s1 == 200);
  const std::vector<json> rest = events_of(tail);
  REQUIRE(rest.size() == bg.size() - 3);
  CHECK(rest.front() == bg[3]);
  CHECK(rest.back() == bg.back());
  auto [s2, none] = read_stream(port, "GET", "/v1/responses/" + id + "?stream=true&starting_after=100000");
  CHECK(s2 == 200);
  CHECK(none.empty());

  // A long one: the client hangs up after a few deltas; the response runs
  // on; a reader resumes after the last event it saw; every event once, in order.
  const json longer = {{"input", "Tell me a long story."}, {"max_output_tokens", 1500}, {"ignore_eos", true},
                       {"temperature", 0}, {"stream", true}, {"background", true}};
  auto [ls, first] = read_stream(port, "POST", "/v1/responses", longer,
                                 [](const std::string& g) { return count_of(g, "event: response.output_text.delta") >= 5; });
  (void)ls;
  std::vector<json> seen = events_of(first.substr(0, first.rfind("\n\n") + 2));
  REQUIRE(seen.size() >= 5);
  const std::string lid = seen[0]["response"]["id"];
  const int64_t last = seen.back()["sequence_number"];
  const std::string status = call(port, "GET", "/v1/responses/" + lid).j["status"];
  CHECK((status == "in_progress" || status == "incomplete"));  // not cancelled by the hang-up
  auto [rs, resumed] =
      read_stream(port, "GET", fmt::format("/v1/responses/{}?stream=true&starting_after={}", lid, last));
  CHECK(rs == 200);
  for (const json& e : events_of(resumed)) seen.push_back(e);
  std::string text;
  for (size_t k = 0; k < seen.size(); ++k) {
    REQUIRE(seen[k]["sequence_number"] == k);
    if (seen[k]["type"] == "response.output_text.delta") text += seen[k]["delta"].get<std::string>();
  }
  REQUIRE(seen.back()["type"] == "response.incomplete");
  CHECK(seen.back()["response"]["usage"]["output_tokens"] == 1500);
  CHECK(seen.back()["response"]["output"][0]["content"][0]["text"] == text);
  CHECK(call(port, "GET", "/v1/responses/" + lid).j == seen.back()["response"]);

  // Cancelled while a reader follows it: the reader's stream ends with the
  // cancellation; the response is stored cancelled; the engine is free.
  json endless = longer;
  endless["max_output_tokens"] = 3000;
  auto [cs, cbody] = read_stream(port, "POST", "/v1/responses", endless,
                                 [](const std::string& g) { return g.find("response.in_progress") != std::string::npos; });
  (void)cs;
  const std::string cid = events_of(cbody.substr(0, cbody.rfind("\n\n") + 2))[0]["response"]["id"];
  std::string followed;
  std::thread reader([&] { followed = read_stream(port, "GET", "/v1/responses/" + cid + "?stream=true").second; });
  CHECK(wait_for([&] { return engine.stats().running == 1; }, 20));
  Reply cancelled = post(port, "/v1/responses/" + cid + "/cancel", json::object());
  CHECK(cancelled.status == 200);
  CHECK(cancelled.j["status"] == "cancelled");
  reader.join();
  const std::vector<json> fe = events_of(followed);
  REQUIRE(fe.size() >= 3);
  CHECK(fe.back()["type"] == "error");
  CHECK(fe.back()["code"] == "response_cancelled");
  CHECK(fe.back()["sequence_number"] == fe.size() - 1);
  CHECK(wait_for([&] { return engine.stats().running == 0 && engine.stats().kv_blocks_used == 0; }, 20));
  CHECK(wait_for([&] { return demo.served.server->in_flight() == 0; }, 20));

  // Refusals: no stream to resume, bad query values.
  Reply nostream = call(port, "GET", "/v1/responses/" + fg.back()["response"]["id"].get<std::string>() + "?stream=true");
  CHECK(nostream.status == 400);
  CHECK(nostream.j["error"]["param"] == "stream");
  for (const char* q : {"?stream=yes", "?stream=true&starting_after=x", "?stream=true&starting_after=-1",
                        "?starting_after=2", "?stream=false&starting_after=2"}) {
    CAPTURE(q);
    Reply r = call(port, "GET", "/v1/responses/" + id + q);
    CHECK(r.status == 400);
    CHECK(r.j["error"]["param"].get<std::string>() == (std::string(q).find("starting") != std::string::npos &&
                                                       std::string(q) != "?stream=yes" ? "starting_after" : "stream"));
  }
  CHECK(call(port, "GET", "/v1/responses/resp_none?stream=true").status == 404);
}

TEST_CASE("serve/conversations: created with items, read by responses as history, grown by their items, edited") {
  DemoServer demo(demo_engine(512));
  const int port = demo.served.port;
  auto user = [](const std::string& text) { return json{{"role", "user"}, {"content", text}}; };
  auto text_of = [](const json& response) { return response["output"][0]["content"][0]["text"]; };
  const json sampling = {{"max_output_tokens", 6}, {"temperature", 0}};
  auto ask = [&](json body) {
    body.update(sampling);
    return post(port, "/v1/responses", body);
  };

  // Created with one item and metadata.
  Reply made = post(port, "/v1/conversations", {{"items", {user("What is 2 + 3?")}}, {"metadata", {{"topic", "sums"}}}});
  CAPTURE(made.body);
  REQUIRE(made.status == 200);
  const std::string cid = made.j["id"];
  CHECK(cid.rfind("conv_", 0) == 0);
  CHECK(cid.size() == 5 + 32);
  CHECK(made.j["object"] == "conversation");
  CHECK(made.j["metadata"] == json{{"topic", "sums"}});
  CHECK(made.j["created_at"].get<int64_t>() > 1700000000);
  CHECK(call(port, "GET", "/v1/conversations/" + cid).j == made.j);
  Reply items0 = call(port, "GET", "/v1/conversations/" + cid + "/items");
  REQUIRE(items0.j["data"].size() == 1);
  CHECK(items0.j["data"][0]["content"] == json::parse(R"([{"type": "input_text", "text": "What is 2 + 3?"}])"));

  // A response in it answers as the whole history sent as input would.
  Reply r1 = ask({{"conversation", cid}, {"input", "And 4 + 5?"}});
  CAPTURE(r1.body);
  REQUIRE(r1.status == 200);
  CHECK(r1.j["conversation"] == json{{"id", cid}});
  Reply s1 = ask({{"input", {user("What is 2 + 3?"), user("And 4 + 5?")}}, {"store", false}});
  REQUIRE(s1.status == 200);
  CHECK(s1.j["conversation"].is_null());
  CHECK(r1.j["usage"]["input_tokens"] == s1.j["usage"]["input_tokens"]);
  CHECK(text_of(r1.j) == text_of(s1.j));
  // Its input and output were added: the next turn sees all three, streamed
  // or not, stored or not (store: false keeps the response, not the conversation, out).
  Reply items1 = call(port, "GET", "/v1/conversations/" + cid + "/items?order=asc");
  REQUIRE(items1.j["data"].size() == 3);
  CHECK(items1.j["data"][1]["content"][0]["text"] == "And 4 + 5?");
  CHECK(items1.j["data"][2]["id"] == r1.j["output"][0]["id"]);
  Reply r2 = ask({{"conversation", {{"id", cid}}}, {"input", "Thanks."}, {"stream", true}, {"store", false}});
  REQUIRE(r2.status == 200);
  const json r2_final = events_of(r2.body).back()["response"];
  const json whole = {user("What is 2 + 3?"), user("And 4 + 5?"),
                      {{"role", "assistant"}, {"content", text_of(r1.j)}}, user("Thanks.")};
  Reply s2 = ask({{"input", whole}});
  REQUIRE(s2.status == 200);
  CHECK(r2_final["usage"]["input_tokens"] == s2.j["usage"]["input_tokens"]);
  CHECK(text_of(r2_final) == text_of(s2.j));
  CHECK(call(port, "GET", "/v1/responses/" + r2_final["id"].get<std::string>()).status == 404);
  Reply items2 = call(port, "GET", "/v1/conversations/" + cid + "/items?limit=2");
  REQUIRE(items2.j["data"].size() == 2);
  CHECK(items2.j["has_more"] == true);
  CHECK(items2.j["data"][0]["id"] == r2_final["output"][0]["id"]);  // newest first
  CHECK(items2.j["data"][1]["content"][0]["text"] == "Thanks.");
  // In the background too, once it ends.
  Reply bg = ask({{"conversation", cid}, {"input", "Bye."}, {"background", true}});
  REQUIRE(bg.status == 200);
  CHECK(wait_for([&] { return call(port, "GET", "/v1/conversations/" + cid + "/items?limit=100").j["data"].size() == 7; },
                 60));
  const json all = call(port, "GET", "/v1/conversations/" + cid + "/items?limit=100&order=asc").j["data"];
  CHECK(all[5]["content"][0]["text"] == "Bye.");
  CHECK(all[6]["id"] == call(port, "GET", "/v1/responses/" + bg.j["id"].get<std::string>()).j["output"][0]["id"]);

  // Items: one read, one deleted (the conversation answered), more added.
  const std::string item = all[1]["id"];
  Reply one = call(port, "GET", "/v1/conversations/" + cid + "/items/" + item);
  CHECK(one.status == 200);
  CHECK(one.j == all[1]);
  Reply dropped = call(port, "DELETE", "/v1/conversations/" + cid + "/items/" + item);
  CHECK(dropped.status == 200);
  CHECK(dropped.j == made.j);
  CHECK(call(port, "GET", "/v1/conversations/" + cid + "/items/" + item).status == 404);
  CHECK(call(port, "DELETE", "/v1/conversations/" + cid + "/items/" + item).j["error"]["param"] == "item_id");
  Reply added = post(port, "/v1/conversations/" + cid + "/items",
                     {{"items", {user("One."), {{"type", "message"}, {"role", "assistant"}, {"content", "Two."}}}}});
  CAPTURE(added.body);
  REQUIRE(added.status == 200);
  CHECK(added.j["object"] == "list");
  REQUIRE(added.j["data"].size() == 2);
  CHECK(added.j["data"][1]["content"] == json::parse(R"([{"type": "output_text", "text": "Two.", "annotations": []}])"));
  CHECK(added.j["last_id"] == added.j["data"][1]["id"]);
  CHECK(call(port, "GET", "/v1/conversations/" + cid + "/items?limit=100").j["data"].size() == 8);
  // A response with no input answers the conversation's items as they are,
  // as the same items sent as input would.
  const Reply before = call(port, "GET", "/v1/conversations/" + cid + "/items?limit=100&order=asc");
  REQUIRE(before.j["data"].size() == 8);
  Reply bare_turn = ask({{"conversation", cid}});
  CAPTURE(bare_turn.body);
  REQUIRE(bare_turn.status == 200);
  Reply sent = ask({{"input", before.j["data"]}, {"store", false}});
  REQUIRE(sent.status == 200);
  CHECK(bare_turn.j["usage"]["input_tokens"] == sent.j["usage"]["input_tokens"]);
  CHECK(call(port, "GET", "/v1/conversations/" + cid + "/items?limit=100").j["data"].size() == 9);  // + its answer
  // Metadata replaced.
  Reply upd = post(port, "/v1/conversations/" + cid, {{"metadata", {{"topic", "done"}}}});
  CHECK(upd.status == 200);
  CHECK(upd.j["metadata"] == json{{"topic", "done"}});
  CHECK(call(port, "GET", "/v1/conversations/" + cid).j["metadata"] == json{{"topic", "done"}});

  // Refusals by field.
  json many = json::array();
  for (int i = 0; i < 21; ++i) many.push_back(user("x"));
  json big_meta = json::object();
  for (int i = 0; i < 17; ++i) big_meta[fmt::format("k{}", i)] = "v";
  const std::vector<std::pair<std::string, json>> refused = {
      {"items", {{"items", many}}},
      {"items[0].role", {{"items", {{{"role", "robot"}, {"content", "x"}}}}}},
      {"items", {{"items", "x"}}},
      {"metadata", {{"metadata", big_meta}}},
      {"metadata.k", {{"metadata", {{"k", std::string(513, 'v')}}}}},
      {"name", {{"name", "x"}}}};
  for (const auto& pb : refused) {
    CAPTURE(pb.second.dump());
    Reply r = post(port, "/v1/conversations", pb.second);
    CHECK(r.status == 400);
    CHECK(r.j["error"]["param"] == pb.first);
  }
  CHECK(post(port, "/v1/conversations/" + cid + "/items", {{"items", json::array()}}).status == 400);
  CHECK(post(port, "/v1/conversations/" + cid, json::object()).j["error"]["param"] == "metadata");
  Reply both = ask({{"conversation", cid}, {"previous_response_id", r1.j["id"]}, {"input", "x"}});
  CHECK(both.status == 400);
  CHECK(both.j["error"]["param"] == "conversation");
  Reply unknown = ask({{"conversation", "conv_nothing"}, {"input", "x"}});
  CHECK(unknown.status == 404);
  CHECK(unknown.j["error"]["param"] == "conversation");
  // Responses and conversations do not answer for each other.
  CHECK(call(port, "GET", "/v1/responses/" + cid).status == 404);
  CHECK(call(port, "DELETE", "/v1/responses/" + cid).status == 404);
  CHECK(call(port, "GET", "/v1/conversations/" + r1.j["id"].get<std::string>()).status == 404);
  CHECK(ask({{"previous_response_id", cid}, {"input", "x"}}).status == 400);
  CHECK(ask({{"conversation", r1.j["id"]}, {"input", "x"}}).status == 404);

  // Deleted: gone everywhere; a response that named it gets a 404.
  Reply del = call(port, "DELETE", "/v1/conversations/" + cid);
  CHECK(del.j == json{{"id", cid}, {"object", "conversation.deleted"}, {"deleted", true}});
  CHECK(call(port, "GET", "/v1/conversations/" + cid).status == 404);
  CHECK(call(port, "GET", "/v1/conversations/" + cid + "/items").status == 404);
  CHECK(ask({{"conversation", cid}, {"input", "x"}}).status == 404);
  Reply metrics = call(port, "GET", "/metrics");
  CHECK(metrics.body.find("route=\"/v1/conversations/{id}/items/{item_id}\"") != std::string::npos);
  CHECK(metrics.body.find(cid) == std::string::npos);

  // A change that would outgrow the whole store is refused, the conversation kept as it was.
  ServerOptions tight;
  tight.responses_store_bytes = 4096;
  Served small(demo.engine, tight);
  Reply kept = post(small.port, "/v1/conversations", {{"items", {user("hello")}}});
  REQUIRE(kept.status == 200);
  const std::string kid = kept.j["id"];
  Reply grown = post(small.port, "/v1/conversations/" + kid + "/items", {{"items", {user(std::string(5000, 'x'))}}});
  CHECK(grown.status == 400);
  CHECK(grown.j["error"]["message"].get<std::string>().find("it was not changed") != std::string::npos);
  Reply still = call(small.port, "GET", "/v1/conversations/" + kid + "/items");
  REQUIRE(still.status == 200);
  CHECK(still.j["data"].size() == 1);

  // A server without a store keeps no conversations.
  ServerOptions none;
  none.responses_store_bytes = 0;
  Served bare(demo.engine, none);
  CHECK(post(bare.port, "/v1/conversations", json::object()).status == 400);
  Reply nc = post(bare.port, "/v1/responses", {{"conversation", "conv_x"}, {"input", "x"}});
  CHECK(nc.status == 400);
  CHECK(nc.j["error"]["param"] == "conversation");
}

namespace {

// A fresh folder under the system's temporary folder, removed at the end.
struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "areno-store-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// The entry files of a store folder, sorted.
std::vector<std::string> json_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& d : std::filesystem::directory_iterator(dir))
    if (d.path().extension() == ".json") out.push_back(d.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

}  // namespace

TEST_CASE("serve/responses a store folder: a file per entry as it changes and goes, read back after a restart") {
  TempDir tmp;
  const std::string dir = tmp.path + "/store";  // created by load()
  const json object = {{"id", "resp_00000000000000000000000000000001"}, {"object", "response"}, {"status", "completed"},
                       {"output", json::array()}};
  const ojson inputs = ojson::parse(R"([{"type": "message", "role": "user", "content": "a"}])");
  const json outputs = json::parse(R"([{"type": "message", "id": "msg_o", "role": "assistant", "content": []}])");
  const std::string r1 = "resp_00000000000000000000000000000001", r2 = "resp_00000000000000000000000000000002",
                    c1 = "conv_00000000000000000000000000000003", b1 = "resp_00000000000000000000000000000004";
  json o2 = object, conv = {{"id", c1}, {"object", "conversation"}, {"created_at", 1}, {"metadata", json::object()}};
  o2["id"] = r2;
  json queued = object;
  queued["id"] = b1;
  queued["status"] = "queued";
  auto events = std::make_shared<ResponseEvents>();
  events->append("event: response.created\ndata: {\"sequence_number\":0}\n\n");
  {
    ResponsesStore store(1 << 20, dir);
    const ResponsesStore::LoadReport none = store.load();
    CHECK(none.loaded == 0);
    CHECK(none.skipped.empty());
    CHECK((std::filesystem::status(dir).permissions() & std::filesystem::perms::all) == std::filesystem::perms::owner_all);
    REQUIRE(store.put(r1, object, inputs, outputs));
    REQUIRE(store.put(r2, o2, inputs, outputs));
    REQUIRE(store.put(c1, conv, inputs, json::array()));
    REQUIRE(store.put(b1, queued, inputs, json::array(), events));  // running when the server stops
    CHECK(json_files(dir) == std::vector<std::string>{c1 + ".json", r1 + ".json", r2 + ".json", b1 + ".json"});
    // Each entry is its owner's only, even in a folder others may read.
    for (const std::string& f : json_files(dir))
      CHECK((std::filesystem::status(dir + "/" + f).permissions() & std::filesystem::perms::all) ==
            (std::filesystem::perms::owner_read | std::filesystem::perms::owner_write));
    CHECK(store.erase(r2));
    CHECK_FALSE(std::filesystem::exists(dir + "/" + r2 + ".json"));
    // A change rewrites the file.
    conv["metadata"] = {{"k", "v"}};
    REQUIRE(store.put(c1, conv, inputs, json::array()));
  }
  // Left beside them: a temporary of an interrupted write, files that are not
  // entries, and files named as entries that are not valid ones.
  write_text(dir + "/" + r2 + ".json.tmp-1-1", "{");
  write_text(dir + "/notes.txt", "mine");
  write_text(dir + "/resp_0000000000000000000000000000000a.json", "{not json");
  write_text(dir + "/resp_0000000000000000000000000000000b.json",
             R"({"id": "resp_0000000000000000000000000000000c", "object": {}, "conversation": [], "inputs": 0})");
  write_text(dir + "/conv_0000000000000000000000000000000d.json",
             R"({"id": "conv_0000000000000000000000000000000d", "object": {"id": "conv_0000000000000000000000000000000d",
                 "object": "response"}, "conversation": [], "inputs": 0})");
  write_text(dir + "/conv_0000000000000000000000000000000e.json",
             R"({"id": "conv_0000000000000000000000000000000e", "object": {"id": "conv_0000000000000000000000000000000e",
                 "object": "conversation"}, "conversation": [], "inputs": 3})");

  std::optional<ResponsesStore> again_store;  // (reset below: the folder's lock goes with it)
  ResponsesStore& again = again_store.emplace(1 << 20, dir);
  const ResponsesStore::LoadReport rep = again.load();
  {
    // One store per folder: a second one is refused while the first lives.
    ResponsesStore twin(1 << 20, dir);
    CHECK_THROWS_WITH(twin.load(), doctest::Contains("another areno serve keeps its store in this folder"));
  }
  CHECK(rep.loaded == 3);
  CHECK(rep.dropped == 0);
  REQUIRE(rep.skipped.size() == 4);
  std::string skipped;
  for (const std::string& s : rep.skipped) skipped += s + "\n";
  CAPTURE(skipped);
  CHECK(skipped.find("resp_0000000000000000000000000000000a.json: ") != std::string::npos);
  CHECK(skipped.find("resp_0000000000000000000000000000000b.json: 'id' is not the file's name") != std::string::npos);
  CHECK(skipped.find("conv_0000000000000000000000000000000d.json: 'object' is not") != std::string::npos);
  CHECK(skipped.find("conv_0000000000000000000000000000000e.json: 'inputs'") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir + "/" + r2 + ".json.tmp-1-1"));
  CHECK(std::filesystem::exists(dir + "/notes.txt"));
  // As they were: the object, every item (with the ids given), the input count.
  std::optional<ResponsesStore::Entry> e1 = again.get(r1);
  REQUIRE(e1);
  CHECK(e1->object == object);
  REQUIRE(e1->conversation->size() == 2);
  CHECK(e1->inputs == 1);
  CHECK((*e1->conversation)[0]["id"].get<std::string>().rfind("msg_", 0) == 0);
  CHECK((*e1->conversation)[1]["id"] == "msg_o");
  CHECK(again.get(c1)->object["metadata"] == json{{"k", "v"}});
  CHECK_FALSE(again.get(r2));
  // The one that was running: failed, and its stream ends with the reason.
  std::optional<ResponsesStore::Entry> b = again.get(b1);
  REQUIRE(b);
  CHECK(b->object["status"] == "failed");
  CHECK(b->object["error"]["code"] == "server_error");
  REQUIRE(b->events);
  bool closed = false;
  const std::vector<std::string> evs = b->events->wait_from(0, std::chrono::milliseconds(0), closed);
  CHECK(closed);
  REQUIRE(evs.size() == 2);
  CHECK(evs[0] == "event: response.created\ndata: {\"sequence_number\":0}\n\n");
  const std::vector<json> last = events_of(evs[1]);
  REQUIRE(last.size() == 1);
  CHECK(last[0]["code"] == "server_error");
  CHECK(last[0]["sequence_number"] == 1);
  CHECK(again.bytes() > 0);

  // A smaller budget at the next start keeps the newest that fit (by the
  // files' times); the files of the rest are removed, so the folder never
  // holds more than the budget.
  for (const char* bad : {"resp_0000000000000000000000000000000a", "resp_0000000000000000000000000000000b",
                                 "conv_0000000000000000000000000000000d", "conv_0000000000000000000000000000000e"})
    std::filesystem::remove(dir + "/" + bad + ".json");
  const auto now = std::filesystem::file_time_type::clock::now();
  std::filesystem::last_write_time(dir + "/" + r1 + ".json", now - std::chrono::seconds(30));
  std::filesystem::last_write_time(dir + "/" + b1 + ".json", now - std::chrono::seconds(20));
  std::filesystem::last_write_time(dir + "/" + c1 + ".json", now - std::chrono::seconds(10));
  ResponsesStore probe(1 << 20);
  const std::optional<ResponsesStore::Entry> ce = again.get(c1);
  REQUIRE(probe.put(c1, ce->object, *ce->conversation, json::array()));
  again_store.reset();
  ResponsesStore small(probe.bytes(), dir);
  const ResponsesStore::LoadReport part = small.load();
  CHECK(part.loaded == 1);
  CHECK(part.dropped == 2);
  CHECK(fmt::format("{}", fmt::join(part.skipped, "; ")) == "");
  CHECK(small.get(c1));
  CHECK(json_files(dir) == std::vector<std::string>{c1 + ".json"});
}

TEST_CASE("serve/responses a store folder over HTTP: responses and conversations outlive the server") {
  TempDir tmp;
  DemoServer demo(demo_engine(256));
  ServerOptions o;
  o.responses_store_dir = tmp.path;
  std::string rid, cid;
  json first;
  {
    Served one(demo.engine, o);
    Reply made = post(one.port, "/v1/conversations", {{"items", {{{"role", "user"}, {"content", "What is 2 + 3?"}}}}});
    REQUIRE(made.status == 200);
    cid = made.j["id"];
    Reply r = post(one.port, "/v1/responses",
                   {{"conversation", cid}, {"input", "And 4 + 5?"}, {"max_output_tokens", 6}, {"temperature", 0}});
    REQUIRE(r.status == 200);
    rid = r.j["id"];
    first = r.j;
    CHECK(json_files(tmp.path) == (std::vector<std::string>{std::min(cid, rid) + ".json", std::max(cid, rid) + ".json"}));
  }
  Served two(demo.engine, o);  // a new server over the same folder
  Reply got = call(two.port, "GET", "/v1/responses/" + rid);
  CHECK(got.status == 200);
  CHECK(got.j == first);
  Reply items = call(two.port, "GET", "/v1/conversations/" + cid + "/items?order=asc");
  REQUIRE(items.j["data"].size() == 3);
  CHECK(items.j["data"][2]["id"] == first["output"][0]["id"]);
  Reply next = post(two.port, "/v1/responses", {{"previous_response_id", rid}, {"input", "Thanks."}, {"max_output_tokens", 2}});
  CHECK(next.status == 200);
  CHECK(call(two.port, "DELETE", "/v1/conversations/" + cid).status == 200);
  CHECK_FALSE(std::filesystem::exists(tmp.path + "/" + cid + ".json"));
}

TEST_CASE("serve/responses truncation auto: the oldest messages left out until the prompt fits, the items kept whole") {
  DemoServer demo(demo_engine(256));
  ServerOptions o;
  o.max_context_len = 96;
  Served small(demo.engine, o);
  const int port = small.port;
  auto user = [](const std::string& t) { return json{{"role", "user"}, {"content", t}}; };
  auto assistant = [](const std::string& t) { return json{{"role", "assistant"}, {"content", t}}; };
  // Items (a call and its result among them); each allowed start is an item
  // that is not a call's result.
  const json items = {user("What is 2 + 3?"), assistant("5"), user("What is 4 + 5? Use the tool."),
                      {{"type", "function_call"}, {"call_id", "c1"}, {"name", "add"}, {"arguments", "{\"a\":4,\"b\":5}"}},
                      {{"type", "function_call_output"}, {"call_id", "c1"}, {"output", "9"}},
                      assistant("9"), user("What is 6 + 7?"), assistant("13"), user("What is 8 + 9?"),
                      assistant("17"), user("And 1 + 1?")};
  const json tools = json::parse(R"([{"type": "function", "name": "add", "parameters": {"type": "object",
      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}])");
  auto body = [&](size_t from, const char* truncation) {
    json in = json::array();
    for (size_t i = from; i < items.size(); ++i) in.push_back(items[i]);
    return json{{"instructions", "Answer."}, {"input", in}, {"tools", tools}, {"tool_choice", "none"},
                {"max_output_tokens", 4}, {"temperature", 0}, {"truncation", truncation}, {"store", false}};
  };
  Reply whole = post(port, "/v1/responses", body(0, "disabled"));
  CAPTURE(whole.body);
  REQUIRE(whole.status == 400);
  CHECK(whole.j["error"]["code"] == "context_length_exceeded");
  Reply cut = post(port, "/v1/responses", body(0, "auto"));
  CAPTURE(cut.body);
  REQUIRE(cut.status == 200);
  CHECK(cut.j["truncation"] == "auto");
  // It is the first allowed start whose prompt fits, sent as it is.
  size_t first_fit = 0;
  for (size_t from = 1; from < items.size() && first_fit == 0; ++from) {
    if (items[from].value("type", "") == "function_call_output") continue;
    if (post(port, "/v1/responses", body(from, "disabled")).status == 200) first_fit = from;
  }
  REQUIRE(first_fit > 0);
  CAPTURE(first_fit);
  Reply same = post(port, "/v1/responses", body(first_fit, "disabled"));
  CHECK(cut.j["usage"]["input_tokens"] == same.j["usage"]["input_tokens"]);
  REQUIRE(cut.j["output"].size() == same.j["output"].size());  // greedy: the same answer (ids differ)
  if (!cut.j["output"].empty()) CHECK(cut.j["output"][0]["content"] == same.j["output"][0]["content"]);
  CHECK(cut.j["usage"]["input_tokens"].get<int64_t>() < 96);
  // The start before it was too long (so something was left out that had to be).
  size_t before = first_fit - 1;
  while (items[before].value("type", "") == "function_call_output") --before;
  CHECK(post(port, "/v1/responses", body(before, "disabled")).status == 400);

  // In a conversation: the prompt is cut, the conversation keeps every item.
  Reply conv = post(port, "/v1/conversations", {{"items", json(items.begin(), items.end() - 1)}});
  REQUIRE(conv.status == 200);
  const std::string cid = conv.j["id"];
  json in_conv = body(items.size() - 1, "auto");
  in_conv["conversation"] = cid;
  Reply rc = post(port, "/v1/responses", in_conv);
  CAPTURE(rc.body);
  REQUIRE(rc.status == 200);
  CHECK(rc.j["usage"]["input_tokens"] == cut.j["usage"]["input_tokens"]);
  CHECK(call(port, "GET", "/v1/conversations/" + cid + "/items?limit=100").j["data"].size() == items.size() + 1);

  // Nothing fits (the last message alone is too long): the whole request's 400.
  Reply huge = post(port, "/v1/responses", {{"input", std::string(2000, 'x')}, {"truncation", "auto"}});
  CHECK(huge.status == 400);
  CHECK(huge.j["error"]["code"] == "context_length_exceeded");
  CHECK(huge.j["error"]["param"] == "input");
}

TEST_CASE("serve/responses input_tokens: the prompt tokens a response would have, history and truncation included") {
  DemoServer demo(demo_engine(256));
  const int port = demo.served.port;
  const json body = {{"input", "What is 2 + 3?"}, {"instructions", "Answer."}, {"max_output_tokens", 4},
                     {"temperature", 0}};
  Reply done = post(port, "/v1/responses", body);
  REQUIRE(done.status == 200);
  Reply count = post(port, "/v1/responses/input_tokens", body);
  CAPTURE(count.body);
  REQUIRE(count.status == 200);
  CHECK(count.j == json{{"object", "response.input_tokens"}, {"input_tokens", done.j["usage"]["input_tokens"]}});
  // With the stored history: what the continued response then reports.
  const json next = {{"previous_response_id", done.j["id"]}, {"input", "And 4 + 5?"}, {"max_output_tokens", 4}};
  Reply counted = post(port, "/v1/responses/input_tokens", next);
  Reply ran = post(port, "/v1/responses", next);
  REQUIRE(ran.status == 200);
  CHECK(counted.j["input_tokens"] == ran.j["usage"]["input_tokens"]);
  CHECK(counted.j["input_tokens"].get<int64_t>() > count.j["input_tokens"].get<int64_t>());
  // No input: the stored history alone (instructions are not carried), as if sent whole.
  Reply alone = post(port, "/v1/responses/input_tokens", {{"previous_response_id", done.j["id"]}});
  CAPTURE(alone.body);
  REQUIRE(alone.status == 200);
  const json whole = {{"input", {{{"role", "user"}, {"content", "What is 2 + 3?"}},
                                 {{"role", "assistant"}, {"content", done.j["output"][0]["content"][0]["text"]}}}}};
  CHECK(alone.j["input_tokens"] == post(port, "/v1/responses/input_tokens", whole).j["input_tokens"]);
  Reply none = post(port, "/v1/responses/input_tokens", json::object());
  CHECK(none.status == 400);
  CHECK(none.j["error"]["param"] == "input");
  // Nothing is stored or run; errors are the response's.
  Reply bad = post(port, "/v1/responses/input_tokens", {{"input", json::array({{{"role", "robot"}, {"content", "x"}}})}});
  CHECK(bad.status == 400);
  CHECK(bad.j["error"]["param"] == "input[0].role");
  CHECK(demo.engine.stats().requests_total == 2);
  Reply metrics = call(port, "GET", "/metrics");
  CHECK(metrics.body.find("route=\"/v1/responses/input_tokens\",status=\"200\"") != std::string::npos);
}
