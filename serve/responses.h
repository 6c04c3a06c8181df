#pragma once
// OpenAI's Responses API, POST /v1/responses, as vLLM serves it for a model
// that does not reason; independent of HTTP (serve/http_server.cpp runs it).
//
// A request amounts to one chat request (parse_responses_request writes its
// /v1/chat/completions body), which runs through the chat path
// (parse_chat_request, the processor, the engine), so every check and limit
// of a chat request holds; only the request and response shapes are this
// file's. Finished responses may be kept in a ResponsesStore (below) for
// previous_response_id and GET / DELETE /v1/responses/{id}.
//
// Request fields:
//   input          a string (one user message) or a list of items (may be left out with
//                  previous_response_id or conversation: the stored history alone):
//                    {"type": "message" (may be left out), "role": user | assistant | system | developer,
//                     "content": a string or parts: input_text / output_text {"text"},
//                     input_image {"image_url": a URL or data URL}, and (ours, as chat's)
//                     input_audio {"input_audio": {"data", "format"}}};
//                    {"type": "function_call", "call_id", "name", "arguments"}: a call the
//                     model made (consecutive calls and the message before them are one turn);
//                    {"type": "function_call_output", "call_id", "output"}: its result;
//                    {"type": "reasoning", ...}: skipped (the model does not reason)
//   instructions   a system message before the input
//   max_output_tokens, temperature, top_p, and vLLM's sampling extras
//                  (top_k, min_p, seed, repetition_penalty, presence_penalty,
//                  frequency_penalty, stop, ignore_eos, min_tokens, logit_bias, cache_salt,
//                  mm_processor_kwargs)
//   tools          function tools {"type": "function", "name", "description", "parameters", "strict"};
//                  other tool types are a 400
//   tool_choice    none | auto | required | {"type": "function", "name"}
//   max_tool_calls an integer >= 0; 0 means tool_choice none (a 400 with a required call);
//                  more is what a response makes anyway (at most one call)
//   text.format    {"type": "text" | "json_object"} | {"type": "json_schema", "name", "schema", "strict"}
//   include        "message.output_text.logprobs": the text's log-probabilities (top_logprobs 0..20)
//   stream         typed server-sent events (ResponsesStream)
//   store          true (the default, as OpenAI's): the finished response is kept when the
//                  server has a store (`serve --responses-store-mb`, ResponsesStore); the
//                  response object says whether it was
//   previous_response_id  a stored response: its input items (its own predecessors' included)
//                  and its output items come before this input; its instructions do not
//                  (OpenAI's rule). 400 previous_response_not_found when not stored (any more)
//   background     true: answered at once with status queued; the response runs on and is
//                  read back with GET /v1/responses/{id} (status in_progress, then completed,
//                  incomplete, failed or cancelled; POST /v1/responses/{id}/cancel stops it).
//                  Needs store (and a server store). With stream: the events are kept
//                  (ResponseEvents) and the POST's stream is one reader of them; the response
//                  runs on when that client goes, and GET /v1/responses/{id}?stream=true
//                  &starting_after=N sends the events past sequence number N, then the rest
//   conversation   a conversation's id (serve/conversations.h), or {"id": ...}: its items come
//                  before the input, and when the response completes (or is incomplete) its
//                  input and output items are added to it. Not with previous_response_id;
//                  404 when not stored (any more)
//   truncation     "disabled" (the default: a prompt longer than the context is a 400) or "auto":
//                  the oldest messages are left out of the prompt until it fits (the
//                  instructions and the last message stay; a call's results go with it);
//                  the items stored and added to a conversation are all of them
//   prompt         a 400 (not supported)
//   metadata, user, parallel_tool_calls, reasoning, service_tier,
//   prompt_cache_key, safety_identifier: repeated or ignored
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/tokenizer.h"
#include "serve/openai.h"

namespace areno::serve {

struct ResponsesRequest {
  nlohmann::ordered_json chat;            // the /v1/chat/completions body it amounts to (stream false)
  std::vector<std::string> message_from;  // per chat message: the field it came from ("instructions", "input[2]")
  bool stream = false;
  bool store = true;                      // asked to be stored (the response object says whether it was)
  bool background = false;                // run after the answer, read back by id
  bool truncate = false;                  // truncation "auto"
  std::string previous_response_id;       // "" when none
  std::string conversation_id;            // "" when none
  nlohmann::ordered_json items;           // the input items as stored: the previous response's
                                          // conversation (or the conversation's items), then
                                          // this input's (stored_item's shape)
  size_t input_from = 0;                  // where this input's items begin in `items`
  nlohmann::json echo;                    // the request's fields a response object repeats
};

// The body's previous_response_id: "" when absent or null; a 400 when not a string.
std::string previous_response_id(const nlohmann::ordered_json& body);
// The body's conversation (an id, or {"id": ...}): "" when absent or null; a 400 otherwise.
std::string conversation_id(const nlohmann::ordered_json& body);

// An input item as it is stored and listed: "type" given ("message" when
// left out), a message's string content as one input_text part (output_text
// for the assistant's), its "status" completed, and an "id" when it has none
// (msg_, fc_, fco_ or rs_ and 32 hex digits). Other fields as sent.
nlohmann::ordered_json stored_item(nlohmann::ordered_json item);

// Checks `items` as input items (what the input's would be refused for),
// naming them `param`[i]. Throws ApiError 400.
void check_input_items(const nlohmann::ordered_json& items, const std::string& param);

// OpenAI's metadata: null (none: {}) or an object of at most 16 string
// values, keys of at most 64 characters, values of at most 512. 400 naming `param`.
nlohmann::json check_metadata(const nlohmann::ordered_json& v, const std::string& param);

// Validates the body (a JSON object). Throws ApiError 400 naming the field.
// `previous`: the stored conversation of the body's previous_response_id
// (ResponsesStore::Entry::conversation), or the items of its conversation;
// required when it names one (a 404 for a conversation without).
ResponsesRequest parse_responses_request(const nlohmann::ordered_json& body,
                                         const nlohmann::ordered_json* previous = nullptr);

// An error of the chat path with the request's names: messages[k] becomes
// the item it came from, max_completion_tokens max_output_tokens,
// response_format text.format, tools[i].function tools[i].
ApiError responses_error(const ApiError& e, const ResponsesRequest& r);

// A finished response: the engine's output, and the ids its items carry.
struct ResponsesOutput {
  std::string text;
  std::vector<TokenLogprob> logprobs;   // of the sampled tokens, when asked
  int64_t top_logprobs = 0;
  bool with_logprobs = false;
  FinishReason finish = FinishReason::none;
  ToolCallParse calls;                  // with tools: parse_tool_calls of the text
  int64_t input_tokens = 0, output_tokens = 0, cached_tokens = 0;
  double temperature = 0, top_p = 1;
  std::string message_id;               // "msg_..."
  std::vector<std::string> call_item_ids;  // "fc_...", one per call
};

// The output items: the assistant's message (its text, or with calls the
// text besides them, if any) and a function_call item per call.
nlohmann::json response_output(const ResponsesOutput& out, const tok::Tokenizer& tokenizer, bool tokens_as_ids);

// The response object before its output: status queued, in_progress, or
// (with the error or reason set by the caller) failed or cancelled.
nlohmann::json response_pending(const ResponseHeader& h, const ResponsesRequest& r, const char* status,
                                double temperature, double top_p);

// The response object. status: completed, or incomplete with
// incomplete_details {"reason": "max_output_tokens"} when the length limit
// cut it; `output` as response_output gives it; "store" as asked (the server
// sets whether it was stored).
nlohmann::json response_object(const ResponseHeader& h, const ResponsesRequest& r, const ResponsesOutput& out,
                               const nlohmann::json& output);

// Streaming, as OpenAI's server sends it: each event "event: TYPE\ndata: {JSON with type and
// sequence_number}\n\n", in order
//   response.created, response.in_progress (the response, status in_progress, no output),
//   for the text: response.output_item.added (the message), response.content_part.added,
//     response.output_text.delta per piece, response.output_text.done, response.content_part.done,
//     response.output_item.done;
//   per call: response.output_item.added, response.function_call_arguments.delta,
//     response.function_call_arguments.done, response.output_item.done;
//   response.completed or response.incomplete (the whole response object, as without stream);
// a failure ends the stream with an "error" event. No [DONE].
//
// A background stream (background with stream) begins the same way, its
// response.created object with status queued; its end is the same, or an
// "error" event: code server_error (the engine failed; the stored response is
// failed) or response_cancelled (cancelled, or deleted while it ran).
class ResponsesStream {
 public:
  ResponsesStream(ResponseHeader h, const ResponsesRequest& r, std::string message_id);
  std::string start(double temperature, double top_p);
  // A piece of text (and its tokens' log-probabilities, chat's "content" entries).
  std::string text(const std::string& delta, const nlohmann::json& logprobs);
  // The final response object (its output as the stream shows it: a message
  // announced while text streamed stays); the caller may still change it
  // (its "store") before finish() sends it.
  nlohmann::json& conclude(const ResponsesOutput& out, const tok::Tokenizer& tokenizer, bool tokens_as_ids);
  // The end, after conclude(): closes the message, sends the calls and the final response.
  std::string finish();
  std::string error(const ApiError& e);

 private:
  std::string event(nlohmann::json e);
  std::string open();  // the message item's added events, once
  nlohmann::json message_item(const std::string& status, const nlohmann::json& content) const;

  ResponseHeader h_;
  ResponsesRequest r_;  // (its chat body cleared)
  std::string message_id_;
  int64_t seq_ = 0;
  bool open_ = false;       // the message item was announced
  std::string text_;        // the text sent so far
  nlohmann::json logprobs_ = nlohmann::json::array();
  nlohmann::json final_;
};

// A background stream's events (serve/responses.h "background"), kept so
// that readers join and resume: event k has sequence number k. The producer
// appends what ResponsesStream writes and closes the log after the last one.
// Thread-safe.
class ResponseEvents {
 public:
  // Appends the events of `sse` (ResponsesStream's text: "event: ...\n\n" each).
  void append(const std::string& sse);
  void close();
  // The events from index `next` on, waiting up to `timeout` for one: at most
  // `max_bytes` of them (at least one), so a reader of a long log holds a
  // slice at a time. `closed`: true when the log is closed and every event
  // past `next` was returned.
  std::vector<std::string> wait_from(size_t next, std::chrono::milliseconds timeout, bool& closed,
                                     size_t max_bytes = size_t(1) << 20) const;
  size_t bytes() const;
  size_t size() const;

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<std::string> events_;
  size_t bytes_ = 0;
  bool closed_ = false;
};

// Finished responses kept in memory for previous_response_id and GET / DELETE
// /v1/responses/{id} (`areno serve --responses-store-mb`). Bounded by bytes:
// each entry counts its response object and its conversation as serialized
// JSON (media data URLs included), and the least recently used entries (put,
// get) go first to make room; an entry larger than the whole budget is not
// kept. Ids are the responses' own (resp_ and 32 hex digits from the kernel's
// random source, so one client cannot guess another's). Thread-safe.
//
// With a folder (`serve --responses-store-dir`), every entry kept is also a
// file there, "<id>.json" (written temp + fsync + rename, nn/io/atomic_file.h),
// rewritten when the entry changes and removed when it goes (deleted, pushed
// out), so the folder never holds more than the budget; load() reads them
// back at startup. Without one, a restart forgets everything.
class ResponsesStore {
 public:
  struct Entry {
    nlohmann::json object;  // the response object as it was sent
    // Every item the response saw as input (previous responses' inputs and
    // outputs first; instructions excluded), then its output items; items
    // without an id were given one when stored.
    std::shared_ptr<const nlohmann::ordered_json> conversation;
    size_t inputs = 0;      // the number of leading items of `conversation` that were input
    std::shared_ptr<ResponseEvents> events;  // a background stream's events, else null
  };

  explicit ResponsesStore(size_t max_bytes, std::string dir = {}) : max_bytes_(max_bytes), dir_(std::move(dir)) {}
  ~ResponsesStore();
  ResponsesStore(const ResponsesStore&) = delete;
  ResponsesStore& operator=(const ResponsesStore&) = delete;
  bool enabled() const { return max_bytes_ > 0; }
  const std::string& dir() const { return dir_; }

  // Reads the folder's entries back (oldest first, so the least recently
  // written go first when they do not all fit): files named "resp_" or
  // "conv_" and 32 hex digits ".json"; anything else is left alone. Entries
  // that do not fit the budget (now perhaps smaller than when they were
  // written) are dropped, their files removed, as when the store pushes one
  // out. A file that is not a valid entry is skipped (left as it is) and
  // named in `skipped` with the reason; temporaries of an interrupted write are removed. A response that
  // was still running when the server stopped is loaded as failed (its stream,
  // if kept, ends with an error event). Creates the folder (mode 0700) when it
  // does not exist; throws std::runtime_error naming it when it cannot, or
  // when another store holds it (an exclusive lock on "<dir>/.lock", kept
  // while this store lives: two servers on one folder would remove each
  // other's files).
  struct LoadReport {
    size_t loaded = 0;
    size_t dropped = 0;                // did not fit the budget: their files removed
    std::vector<std::string> skipped;  // "FILE: reason"
  };
  LoadReport load();

  // Keeps a finished response: `inputs` (ResponsesRequest::items) then
  // `outputs` (response_output), and a background stream's `events` (their
  // bytes counted as they are now). False when it does not fit the budget
  // alone (an entry kept under `id` before is dropped then: a queued
  // background response never outlives its end).
  bool put(const std::string& id, nlohmann::json object, const nlohmann::ordered_json& inputs,
           const nlohmann::json& outputs, std::shared_ptr<ResponseEvents> events = nullptr);
  // Counts an entry's bytes again (its events grew since put); an entry now
  // larger than the budget alone is dropped. False when `id` is not kept (any more).
  bool recount(const std::string& id);
  std::optional<Entry> get(const std::string& id);
  bool erase(const std::string& id);

  size_t bytes() const;
  size_t size() const;
  size_t max_bytes() const { return max_bytes_; }

 private:
  struct Slot {
    Entry entry;
    size_t bytes = 0;
    std::list<std::string>::iterator lru;
  };
  static size_t entry_bytes(const std::string& id, const Entry& e);
  // (under mu_) least recently used out until `bytes` more fit; their ids to `out`
  void make_room(size_t bytes, std::vector<std::string>* out);
  // With a folder: makes id's file what the store holds now (written, or removed when gone).
  void sync_file(const std::string& id);
  bool put_entry(const std::string& id, Entry entry, bool write);
  const size_t max_bytes_;
  const std::string dir_;
  std::mutex file_mu_;  // one file change at a time
  int lock_fd_ = -1;    // the folder's lock, held from load()
  mutable std::mutex mu_;
  std::list<std::string> lru_;  // most recent first
  std::unordered_map<std::string, Slot> slots_;
  size_t bytes_ = 0;
};

// GET /v1/responses/{id}/input_items: the stored input items as OpenAI lists
// them, {"object": "list", "data", "first_id", "last_id", "has_more"}.
// Query: limit 1..100 (default 20), order asc | desc (default desc), after
// (an item id: the items past it in that order). 400 naming the parameter.
nlohmann::json input_items_page(const ResponsesStore::Entry& e, const std::string& limit, const std::string& order,
                                const std::string& after);

}  // namespace areno::serve
