// HTTP endpoints of `areno serve` on cpp-httplib (see http_server.h).
#include "serve/http_server.h"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <deque>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string_view>
#include <thread>

#include "areno_build_config.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/processor/chat_processor.h"
#include "models/phi4mm/processor/media_source.h"
#include "serve/cfg.h"
#include "serve/conversations.h"
#include "serve/grammar.h"
#include "serve/request_context.h"
#include "serve/responses.h"
#include "serve/speech.h"

namespace areno::serve {

using nlohmann::json;

namespace {

int64_t unix_now() { return int64_t(std::time(nullptr)); }

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) { send_json(res, e.status, error_body(e)); }

// Takes time that depends only on `expected`'s length, so a client cannot
// learn from the answer's timing how much of a guessed key was right.
bool equal_secret(std::string_view given, std::string_view expected) {
  volatile unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i)
    diff = diff | static_cast<unsigned char>(expected[i] ^ (i < given.size() ? given[i] : 0));
  return diff == 0;
}

// 1 to 128 characters of A-Z a-z 0-9 and `punct`.
bool valid_id(const std::string& id, const char* punct) {
  return !id.empty() && id.size() <= 128 && std::all_of(id.begin(), id.end(), [&](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || (c != '\0' && std::strchr(punct, c) != nullptr);
  });
}

bool valid_trajectory_id(const std::string& id) { return valid_id(id, "._:-"); }

// The outputs of one HTTP request's engine requests, filled by the engine
// thread's callbacks and drained by the handler.
// Wakes the thread that waits on it (the background responses' one) at once.
struct Wakeup {
  std::mutex mu;
  std::condition_variable cv;
  bool set = false;
  void notify() {
    {
      std::lock_guard<std::mutex> lk(mu);
      set = true;
    }
    cv.notify_all();
  }
  void wait_for(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait_for(lk, timeout, [&] { return set; });
    set = false;
  }
};

struct Pending {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<size_t, RequestOutput>> events;  // (engine request index, output)
  size_t done = 0;
  size_t total = 0;
  std::vector<int64_t> ids;
  std::vector<bool> finished;
  std::shared_ptr<Wakeup> wake;  // also woken by every output, when set

  void push(size_t i, const RequestOutput& o) {
    std::shared_ptr<Wakeup> w;
    {
      std::lock_guard<std::mutex> lk(mu);
      events.emplace_back(i, o);
      if (o.done) {
        ++done;
        finished[i] = true;
      }
      w = wake;
    }
    cv.notify_all();
    if (w) w->notify();
  }
  void watch(std::shared_ptr<Wakeup> w) {
    {
      std::lock_guard<std::mutex> lk(mu);
      wake = std::move(w);
    }
    wake->notify();  // what came before
  }
  // Waits up to `timeout` for events; returns them (maybe none).
  std::deque<std::pair<size_t, RequestOutput>> take(std::chrono::milliseconds timeout, bool& all_done) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait_for(lk, timeout, [&] { return !events.empty() || done == total; });
    std::deque<std::pair<size_t, RequestOutput>> out;
    out.swap(events);
    all_done = done == total;
    return out;
  }
};

// Counts requests in flight for draining; lives as long as the response.
struct InFlight {
  std::atomic<int64_t>& n;
  explicit InFlight(std::atomic<int64_t>& c) : n(c) { ++n; }
  ~InFlight() { --n; }
};

// Prometheus label escaping (model names are the operator's and the clients').
std::string prometheus_label(const std::string& v) {
  std::string label;
  for (char c : v) label += c == '\\' ? "\\\\" : c == '"' ? "\\\"" : c == '\n' ? "\\n" : std::string(1, c);
  return label;
}

// Runs one response's stream until every engine request is done: each
// output to `on_output` (false: stop, a write failed), each engine error as an
// SSE error event (error_event's, else chat's; and `failed` set), an SSE comment after 2 s without
// events (clients ignore it; a gone client fails the write). False when a
// write failed.
bool pump_events(Pending& pending, bool& failed, const std::function<bool(const std::string&)>& write,
                 const std::function<bool(size_t, const RequestOutput&)>& on_output,
                 const std::function<std::string(const ApiError&)>& error_event = {}) {
  auto idle = std::chrono::steady_clock::now();
  bool all_done = false;
  while (true) {
    auto events = pending.take(std::chrono::milliseconds(200), all_done);
    for (auto& [i, o] : events) {
      if (!o.error.empty()) {
        failed = true;
        const ApiError e(500, o.error);
        if (!write(error_event ? error_event(e) : sse_event(error_body(e)))) return false;
        continue;
      }
      if (!on_output(i, o)) return false;
    }
    if (all_done) return true;
    const auto now = std::chrono::steady_clock::now();
    if (!events.empty()) {
      idle = now;
    } else if (now - idle > std::chrono::seconds(2)) {
      if (!write(": keep-alive\n\n")) return false;
      idle = now;
    }
  }
}

// A streamed response's release callback: the client gone (or a write
// failed) frees the engine's unfinished sequences. Holds `guard` until then.
std::function<void(bool)> abort_when_gone(std::shared_ptr<Pending> pending, std::shared_ptr<InFlight> guard, Engine* eng) {
  return [pending, guard, eng](bool success) {
    if (success) return;
    std::lock_guard<std::mutex> lk(pending->mu);
    for (size_t i = 0; i < pending->ids.size(); ++i)
      if (!pending->finished[i]) eng->abort(pending->ids[i]);
  };
}

// A 200 text/event-stream answer written by `provider` (never buffered by a
// proxy); `released` runs when it ends (abort_when_gone).
void start_sse(httplib::Response& res, httplib::ContentProviderWithoutLength provider,
               httplib::ContentProviderResourceReleaser released) {
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider("text/event-stream", std::move(provider), std::move(released));
}

// The engine's whole output of a response as a ResponsesOutput: the text, its calls (with tools).
void finish_responses_output(const ApiRequest& ar, ChoiceOutput& c, ResponsesOutput& out) {
  out.text = std::move(c.text);
  out.logprobs = std::move(c.logprobs);
  out.finish = c.finish;
  out.output_tokens = int64_t(c.tokens.size());
  if (!ar.tools.is_null() && ar.tool_choice != "none") out.calls = parse_tool_calls(out.text, ar.tools);
  for (size_t i = 0; out.calls.found && i < out.calls.tool_calls.size(); ++i)
    out.call_item_ids.push_back(new_response_id("fc_"));
}

// One /v1/responses answer's engine output as it comes (a stream, a
// background response): its choice, and with a ResponsesStream its events,
// text that may begin a call held back until that is known.
struct ResponsesRun {
  ApiRequest ar;
  ResponsesOutput out;
  std::optional<ResponsesStream> rs;  // streamed
  ChoiceOutput c;
  bool tools = false;
  ToolCallStreamer streamer;
  std::vector<TokenLogprob> held;  // the log-probabilities of text the streamer holds
  bool aborted = false;            // the engine stopped it (a cancel, a client gone)
  std::string error;               // the engine's error, if any

  ResponsesRun(ApiRequest a, ResponsesOutput o) : ar(std::move(a)), out(std::move(o)) {
    tools = !ar.tools.is_null() && ar.tool_choice != "none";
  }

  // An output that is not an error: counted; returns its events (with a stream).
  std::string add(const RequestOutput& o, const tok::Tokenizer& t) {
    if (o.done) {
      out.cached_tokens = o.cached_tokens;
      aborted |= o.finish == FinishReason::abort;
    }
    if (o.sample < 0) return {};
    c.add(o);
    if (!rs) return {};
    std::string text = o.text;
    std::vector<TokenLogprob> lps = o.logprobs;
    if (tools) {
      held.insert(held.end(), o.logprobs.begin(), o.logprobs.end());
      text = streamer.push(o.text);
      lps.clear();
      if (!text.empty()) lps = std::exchange(held, {});
    }
    const json lp =
        ar.logprobs ? chat_logprobs_json(t, lps, ar.top_logprobs, ar.return_tokens_as_token_ids)["content"] : json::array();
    return rs->text(text, lp);
  }

  // After the last output.
  void finish() { finish_responses_output(ar, c, out); }
};

}  // namespace

struct HttpServer::Impl {
  Engine& engine;
  ServerOptions opts;
  phi4mm::ProcessorOptions processor;  // the model's modalities, media sources and limits
  RequestRouter http;
  std::unique_ptr<HttpListener> listener;
  int bound_port = -1;
  std::atomic<bool> draining{false};
  std::atomic<int64_t> inflight{0};
  std::atomic<bool> stopped{false};
  int64_t started = unix_now();
  int64_t context = 0;

  // --lora-resolve: loads and evictions take it uniquely; a request holds it
  // shared from the adapter's last lookup until its submit, so the adapter it
  // names cannot be evicted in between (once submitted, the engine counts it
  // in use).
  std::shared_mutex lora_mu;
  std::mutex lora_use_mu;
  std::map<std::string, uint64_t> resolved_last_use;  // adapters loaded on demand -> last use (a counter)
  std::map<std::string, int> lora_reserved;  // adapters a request is loading to pin: never evicted meanwhile
  uint64_t lora_clock = 0;
  std::atomic<int64_t> lora_resolved_loads{0}, lora_evictions{0};

  ResponsesStore stored_responses{opts.responses_store_bytes, opts.responses_store_dir};
  std::mutex conv_mu;  // conversations change one at a time (read, changed, put back)

  // Background responses (serve/responses.h "background"): each runs in the
  // engine after its answer; one thread (started with the first) finishes
  // and stores them as they end.
  // With stream, its events are kept (ResponseEvents) for every reader.
  struct BackgroundJob {
    BackgroundJob(ResponsesRun r) : run(std::move(r)) {}
    std::shared_ptr<Pending> pending;
    ResponsesRun run;
    ResponsesRequest rr;  // its items kept for the store
    ResponseHeader h;
    std::shared_ptr<ResponseEvents> events;  // with stream
    std::shared_ptr<InFlight> guard;  // draining waits for it
    bool cancel = false;    // (under bg_mu) asked to stop
    bool finished = false;  // (under bg_mu) stored
  };
  std::mutex bg_mu;
  std::condition_variable bg_cv;  // a job finished, or stopping
  std::map<std::string, std::shared_ptr<BackgroundJob>> bg_jobs;  // by response id, until stored
  bool bg_stop = false;
  std::thread bg_thread;
  std::shared_ptr<Wakeup> bg_wake = std::make_shared<Wakeup>();  // an output or a job for the thread

  std::mutex metrics_mu;
  std::map<std::pair<std::string, int>, int64_t> http_counts;  // (route, status) -> count
  std::map<std::string, int64_t> model_counts;  // generation requests by model (the served one, or a served LoRA)

  // The tokens' bytes for constrained decoding, built at the first request that needs them.
  std::once_flag token_bytes_once;
  std::shared_ptr<const TokenBytes> token_bytes_table;
  std::shared_ptr<const TokenBytes> token_bytes() {
    std::call_once(token_bytes_once, [&] {
      token_bytes_table = std::make_shared<const TokenBytes>(engine.tokenizer(), opts.api.vocab_size);
    });
    return token_bytes_table;
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> lk(bg_mu);
      bg_stop = true;
    }
    bg_cv.notify_all();
    bg_wake->notify();
    if (bg_thread.joinable()) bg_thread.join();
  }

  Impl(Engine& e, ServerOptions o) : engine(e), opts(std::move(o)) {
    processor = phi4mm::processor_options_for(engine.model());
    processor.source = media_source(opts.media);
    processor.limits = opts.media_limits;
    processor.decode_budget = std::make_shared<phi4mm::DecodeBudget>(
        opts.max_media_decode_bytes, std::chrono::milliseconds(opts.media_decode_wait_ms));
    context = engine.max_context();
    if (opts.max_context_len > 0) context = std::min(context, opts.max_context_len);
    opts.api.vocab_size = engine.model().config().text.vocab_size;
    if (opts.threads == 0) opts.threads = size_t(std::max<int64_t>(64, 2 * engine.options().max_running));
    if (!stored_responses.dir().empty()) {
      const ResponsesStore::LoadReport rep = stored_responses.load();
      for (const std::string& s : rep.skipped)
        fmt::print(stderr, "areno serve: {}/{} (skipped)\n", stored_responses.dir(), s);
      fmt::print(stderr, "areno serve: {} stored responses and conversations read from {} ({} bytes){}\n", rep.loaded,
                 stored_responses.dir(), stored_responses.bytes(),
                 rep.dropped ? fmt::format("; {} more did not fit --responses-store-mb and were removed", rep.dropped)
                             : std::string());
    }
    routes();
    ListenerOptions lo;
    lo.host = opts.host;
    lo.port = opts.port;
    lo.workers = opts.threads;
    lo.max_body_bytes = opts.max_body_bytes;
    lo.limits = opts.connections;
    listener = std::make_unique<HttpListener>(http, lo, [this](int status, const std::string& message) {
      count_http("other", status);
      return dump_json(error_body(ApiError(status, message)));
    });
  }

  // A route's metrics label: ids in paths become {id}, so clients cannot grow the label set.
  static std::string route_label(const std::string& path) {
    if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
    if (path == "/v1/responses/input_tokens") return path;
    for (const std::string prefix : {"/v1/responses/", "/v1/conversations/"}) {
      if (path.compare(0, prefix.size(), prefix) != 0) continue;
      // {id}, then one of the tails, the last one with an item id
      const size_t slash = path.find('/', prefix.size());
      if (slash == std::string::npos) return prefix + "{id}";
      const std::string tail = path.substr(slash);
      for (const char* known : {"/input_items", "/cancel", "/items"})
        if (tail == known) return prefix + "{id}" + tail;
      if (tail.rfind("/items/", 0) == 0) return prefix + "{id}/items/{item_id}";
      return prefix + "{id}/?";
    }
    return path;
  }

  void count_http(const std::string& route, int status) {
    std::lock_guard<std::mutex> lk(metrics_mu);
    http_counts[{route, status}]++;
  }

  // ---- plumbing ----------------------------------------------------------

  void routes() {
    // Only liveness is open: /tokenize and /detokenize decode media, /metrics
    // and /version describe the server.
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      RequestContext& ctx = current_request();
      ctx.start = std::chrono::steady_clock::now();
      ctx.id = req.get_header_value(kRequestIdHeader);
      if (!valid_id(ctx.id, "._:-")) ctx.id = new_response_id("req-");
      res.set_header(kRequestIdHeader, ctx.id);
      if (!opts.api_key.empty() && req.path != "/health") {
        const std::string auth = req.get_header_value("Authorization");
        if (!equal_secret(auth, "Bearer " + opts.api_key)) {
          send_error(res, ApiError(401, auth.empty() ? "missing API key: send 'Authorization: Bearer <key>'"
                                                     : "invalid API key",
                                   "", "invalid_api_key"));
          return httplib::Server::HandlerResponse::Handled;
        }
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    http.set_post_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      count_http(req.matches.empty() ? "other" : route_label(req.path), res.status);
      if (opts.access_log) {
        const RequestContext& ctx = current_request();
        const auto start = ctx.start;
        const auto since = [start] {
          return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        };
        std::string line = fmt::format("{} {} {} \"{} {}\" {}", utc_time_text(), ctx.id, req.remote_addr,
                                       log_printable(req.method, 16), log_printable(req.path, 256), res.status);
        if (!res.content_provider_) {
          opts.access_log(fmt::format("{} {:.1f} ms", line, since()));
        } else {
          // A stream: logged when it ends (httplib releases the provider then),
          // with the time to its headers too.
          const double headers = since();
          auto log = opts.access_log;
          auto released = std::move(res.content_provider_resource_releaser_);
          res.content_provider_resource_releaser_ = [=](bool success) {
            if (released) released(success);
            log(fmt::format("{} {:.1f} ms (stream{}; headers at {:.1f} ms)", line, since(),
                            success ? "" : " cut short: the client went away or a write failed", headers));
          };
        }
      }
    });
    // httplib's own errors (404 unknown route, 400 bad request line...) get
    // OpenAI bodies too; the listener answers 408, 413 and 431 itself.
    http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      std::string msg;
      switch (res.status) {
        case 404: msg = fmt::format("no route {} {}", req.method, req.path); break;
        case 405: msg = fmt::format("method {} is not allowed on {}", req.method, req.path); break;
        default: msg = fmt::format("HTTP error {} on {} {}", res.status, req.method, req.path);
      }
      send_error(res, ApiError(res.status, msg));
    });
    http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "unknown error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      send_error(res, ApiError(500, "internal error: " + what));
    });

    http.Post("/v1/chat/completions", [this](const httplib::Request& q, httplib::Response& r) {
      generate(ApiKind::chat, q, r);
    });
    http.Post("/v1/completions", [this](const httplib::Request& q, httplib::Response& r) {
      generate(ApiKind::completion, q, r);
    });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& r) {
      send_json(r, 200, {{"object", "list"}, {"data", models()}});
    });
    // OpenAI's retrieve: one of them by id (a model path may hold '/'; bounded for std::regex).
    http.Get(R"(/v1/models/(.{1,1024}))", [this](const httplib::Request& q, httplib::Response& r) {
      const std::string id = q.matches[1];
      for (const json& m : models())
        if (m["id"] == id) return send_json(r, 200, m);
      send_error(r, ApiError(404, fmt::format("The model '{}' does not exist.", id), "model", "model_not_found"));
    });
    http.Get("/health", [this](const httplib::Request&, httplib::Response& r) {
      if (draining) send_json(r, 503, {{"status", "draining"}});
      else send_json(r, 200, {{"status", "ok"}});
    });
    http.Get("/version", [](const httplib::Request&, httplib::Response& r) {
      send_json(r, 200, {{"version", ARENO_VERSION}});
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(metrics_text(), "text/plain; version=0.0.4");
    });
    http.Post("/v1/load_lora_adapter", [this](const httplib::Request& q, httplib::Response& r) { load_lora(q, r); });
    http.Post("/v1/unload_lora_adapter", [this](const httplib::Request& q, httplib::Response& r) { unload_lora(q, r); });
    http.Post("/v1/audio/transcriptions", [this](const httplib::Request& q, httplib::Response& r) {
      speech(SpeechTask::transcribe, q, r);
    });
    http.Post("/v1/audio/translations", [this](const httplib::Request& q, httplib::Response& r) {
      speech(SpeechTask::translate, q, r);
    });
    http.Post("/v1/responses", [this](const httplib::Request& q, httplib::Response& r) { responses(q, r); });
    http.Post("/v1/responses/input_tokens",
              [this](const httplib::Request& q, httplib::Response& r) { response_input_tokens(q, r); });
    // (a bounded id: std::regex recurses per character matched)
    static const char* kResponseId = R"(/v1/responses/([A-Za-z0-9_-]{1,128}))";
    http.Get(kResponseId, [this](const httplib::Request& q, httplib::Response& r) { stored_response(q, r, false); });
    http.Delete(kResponseId, [this](const httplib::Request& q, httplib::Response& r) { stored_response(q, r, true); });
    http.Get(std::string(kResponseId) + "/input_items",
             [this](const httplib::Request& q, httplib::Response& r) { stored_input_items(q, r); });
    http.Post(std::string(kResponseId) + "/cancel",
              [this](const httplib::Request& q, httplib::Response& r) { cancel_response(q, r); });
    static const char* kConversationId = R"(/v1/conversations/([A-Za-z0-9_-]{1,128}))";
    static const std::string kItem = std::string(kConversationId) + R"(/items/([A-Za-z0-9_-]{1,128}))";
    auto conv = [this](ConversationCall c) {
      return [this, c](const httplib::Request& q, httplib::Response& r) { conversation(c, q, r); };
    };
    http.Post("/v1/conversations", conv(ConversationCall::create));
    http.Get(kConversationId, conv(ConversationCall::get));
    http.Post(kConversationId, conv(ConversationCall::update));
    http.Delete(kConversationId, conv(ConversationCall::remove));
    http.Get(std::string(kConversationId) + "/items", conv(ConversationCall::list_items));
    http.Post(std::string(kConversationId) + "/items", conv(ConversationCall::add_items));
    http.Get(kItem, conv(ConversationCall::get_item));
    http.Delete(kItem, conv(ConversationCall::remove_item));
    http.Post("/tokenize", [this](const httplib::Request& q, httplib::Response& r) { tokenize(q, r); });
    http.Post("/detokenize", [this](const httplib::Request& q, httplib::Response& r) { detokenize(q, r); });
  }

  // GET /v1/models's entries: the served model, then its served LoRAs as vLLM lists them (parent: the base).
  json models() const {
    json data = json::array({{{"id", opts.served_model_name},
                              {"object", "model"},
                              {"created", started},
                              {"owned_by", "areno"},
                              {"root", opts.model_path.empty() ? opts.served_model_name : opts.model_path},
                              {"parent", nullptr},
                              {"max_model_len", context}}});
    for (const phi4mm::ServedLora& l : engine.loras())
      data.push_back({{"id", l.name},
                      {"object", "model"},
                      {"created", started},
                      {"owned_by", "areno"},
                      {"root", l.source},
                      {"parent", opts.served_model_name},
                      {"max_model_len", context}});
    return data;
  }

  json parse_body(const httplib::Request& req) {
    json body = parse_json_bounded(req.body, opts.max_json_depth);
    if (!body.is_object()) throw ApiError(400, fmt::format("the request body must be a JSON object (got {})", body.type_name()));
    return body;
  }

  // What a request's "model" names: the served model (or no name: number
  // 0), or one of its served LoRAs (phi4mm::ServedLora); 404 otherwise.
  phi4mm::ServedLora check_model(const std::string& model) {
    if (model.empty() || model == opts.served_model_name || (!opts.model_path.empty() && model == opts.model_path))
      return {};
    if (std::optional<phi4mm::ServedLora> l = engine.find_lora(model)) {
      touch_lora(model);
      return *l;
    }
    if (opts.lora_resolve && !opts.lora_root.empty())
      if (std::optional<phi4mm::ServedLora> l = resolve_lora(model)) return *l;
    std::string names = fmt::format("`{}`", opts.served_model_name);
    for (const phi4mm::ServedLora& l : engine.loras()) names += fmt::format(", `{}`", l.name);
    throw ApiError(404, fmt::format("The model `{}` does not exist (this server serves {}).", model, names), "model",
                   "model_not_found");
  }

  // ---- served LoRAs loaded on demand (--lora-resolve) ----------------------

  // An adapter loaded or unloaded through the routes is no longer one loaded on demand.
  void forget_resolved(const std::string& name) {
    std::lock_guard<std::mutex> lk(lora_use_mu);
    resolved_last_use.erase(name);
  }

  void touch_lora(const std::string& name) {
    if (!opts.lora_resolve) return;
    std::lock_guard<std::mutex> lk(lora_use_mu);
    if (auto it = resolved_last_use.find(name); it != resolved_last_use.end()) it->second = ++lora_clock;
  }

  // Loads `name` from the LoRA root, evicting the least recently used idle
  // adapter loaded on demand when max_loras are loaded. nullopt: no such
  // folder (the caller answers 404). Throws ApiError 429 (every evictable
  // adapter busy), 400 (the folder does not load), 503 (stopping).
  std::optional<phi4mm::ServedLora> resolve_lora(const std::string& name) {
    if (!valid_lora_name(name) || name.front() == '/') return std::nullopt;
    std::string real;
    try {
      real = phi4mm::resolve_under_root(opts.lora_root, name, "model");
    } catch (const phi4mm::ProcessorError&) {
      return std::nullopt;
    }
    if (!std::filesystem::is_regular_file(std::filesystem::path(real) / "adapter_config.json")) return std::nullopt;
    std::unique_lock<std::shared_mutex> lk(lora_mu);
    if (std::optional<phi4mm::ServedLora> l = engine.find_lora(name)) return l;  // another request loaded it
    auto unloadable = [&](const std::string& what) {
      std::string w = what;
      for (size_t at; (at = w.find(real)) != std::string::npos;) w.replace(at, real.size(), name);
      return ApiError(400, fmt::format("the adapter '{}' could not be loaded: {}", name, w), "model");
    };
    try {  // its config checked before anything is evicted for it
      phi4mm::peft_lora_config(real, engine.model().config().text.num_hidden_layers);
    } catch (const std::exception& e) {
      throw unloadable(e.what());
    }
    if (opts.max_loras > 0 && engine.loras().size() >= opts.max_loras) {
      std::vector<std::pair<uint64_t, std::string>> idle;  // oldest first
      {
        std::lock_guard<std::mutex> ul(lora_use_mu);
        for (const auto& [n, t] : resolved_last_use)
          if (!lora_reserved.count(n)) idle.emplace_back(t, n);
      }
      std::sort(idle.begin(), idle.end());
      bool freed = false;
      for (const auto& [t, n] : idle) {
        bool evicted = true;
        try {
          engine.unload_lora(n);
        } catch (const LoraInUse&) {
          continue;
        } catch (const std::out_of_range&) {  // unloaded through the route meanwhile: a slot is free
          evicted = false;
        } catch (const std::runtime_error& e) {
          throw ApiError(503, e.what());
        }
        forget_resolved(n);
        if (evicted) {
          ++lora_evictions;
          fmt::print(stderr, "served LoRA '{}' unloaded to make room for '{}' (--lora-resolve)\n", n, name);
        }
        freed = true;
        break;
      }
      if (!freed)
        throw ApiError(429, fmt::format("all {} served LoRAs are in use or were not loaded on demand; '{}' cannot be "
                                        "loaded now, retry later", opts.max_loras, name), "model");
    }
    try {
      engine.load_lora(name, real, opts.max_loras, name);
    } catch (const std::length_error& e) {
      throw ApiError(429, e.what(), "model");
    } catch (const std::invalid_argument& e) {
      throw ApiError(400, e.what(), "model");
    } catch (const std::exception& e) {
      throw unloadable(e.what());
    }
    {
      std::lock_guard<std::mutex> ul(lora_use_mu);
      resolved_last_use[name] = ++lora_clock;
    }
    ++lora_resolved_loads;
    fmt::print(stderr, "served LoRA '{}' loaded on demand from {}\n", name, real);
    return engine.find_lora(name);
  }

  // Before submitting requests for a served LoRA: holds lora_mu shared in
  // `hold` and returns the adapter as loaded now (loaded again if it was
  // evicted since check_model). Without --lora-resolve, `l` as it is.
  phi4mm::ServedLora pin_lora(const std::string& model, const phi4mm::ServedLora& l,
                              std::shared_lock<std::shared_mutex>& hold) {
    if (!opts.lora_resolve || l.number == 0) return l;
    hold = std::shared_lock<std::shared_mutex>(lora_mu);
    if (std::optional<phi4mm::ServedLora> now = engine.find_lora(model)) return *now;
    hold.unlock();
    // Evicted since check_model: load it again, reserved so that no other
    // request's load evicts it before this one holds the lock.
    struct Reservation {
      Impl* self;
      std::string name;
      Reservation(Impl* s, std::string n) : self(s), name(std::move(n)) {
        std::lock_guard<std::mutex> lk(self->lora_use_mu);
        ++self->lora_reserved[name];
      }
      ~Reservation() {
        std::lock_guard<std::mutex> lk(self->lora_use_mu);
        if (--self->lora_reserved[name] == 0) self->lora_reserved.erase(name);
      }
    } reserved(this, model);
    check_model(model);  // loads it again (or throws)
    hold = std::shared_lock<std::shared_mutex>(lora_mu);
    if (std::optional<phi4mm::ServedLora> now = engine.find_lora(model)) return *now;
    throw ApiError(503, fmt::format("the served LoRA '{}' was unloaded through /v1/unload_lora_adapter while this "
                                    "request started; retry", model), "model");
  }

  // ---- prompts -----------------------------------------------------------

  // The one place where the processor's {field, message} errors become 400s
  // (503 when the media decode budget stays full). With `ar`, a prompt too long
  // for it is refused from the media headers, before any media is decoded.
  // The request's mm_processor_kwargs (`ar`'s, else `image_max_crops` when
  // not 0) set its images' crop limit.
  phi4mm::ProcessedChat build_chat(const json& messages, const json& tools, bool add_generation_prompt,
                                   const ApiRequest* ar = nullptr, bool continue_final_message = false,
                                   int64_t image_max_crops = 0) {
    phi4mm::ProcessorOptions po = processor;
    if (ar && ar->image_max_crops > 0) image_max_crops = ar->image_max_crops;
    if (image_max_crops > 0) po.image_max_crops = image_max_crops;
    po.add_generation_prompt = add_generation_prompt;
    po.continue_final_message = continue_final_message || (ar && ar->continue_final_message);
    if (ar) po.max_prompt_tokens = max_prompt_length(*ar);
    try {
      return phi4mm::process_chat(engine.tokenizer(), messages, tools, po);
    } catch (const phi4mm::PromptTooLong& e) {
      check_prompt_length(e.tokens(), *ar, "messages");
      throw ApiError(400, e.what(), "messages", "context_length_exceeded");
    } catch (const phi4mm::MediaBusy& e) {
      throw ApiError(503, e.what(), e.field());
    } catch (const phi4mm::ProcessorError& e) {
      throw ApiError(400, e.what(), e.field());
    }
  }

  // The longest prompt check_prompt_length accepts for `ar`.
  int64_t max_prompt_length(const ApiRequest& ar) const {
    int64_t n = context - (ar.max_tokens_given ? std::max<int64_t>(ar.params.max_tokens, 0) : 1);
    if (opts.max_prompt_tokens > 0) n = std::min(n, opts.max_prompt_tokens);
    return std::max<int64_t>(n, 1);
  }

  // Throws 400 context_length_exceeded when a prompt of `len` tokens does not fit.
  void check_prompt_length(int64_t len, const ApiRequest& ar, const char* field) const {
    if (opts.max_prompt_tokens > 0 && len > opts.max_prompt_tokens)
      throw ApiError(400,
                     fmt::format("The prompt has {} tokens, more than this server's limit of {} (--max-prompt-tokens). "
                                 "Please reduce the length of the {}.",
                                 len, opts.max_prompt_tokens, field),
                     field, "context_length_exceeded");
    int64_t max_tokens = ar.params.max_tokens;
    if (!ar.max_tokens_given) max_tokens = std::min(max_tokens, context - len);
    const int64_t need = len + std::max<int64_t>(max_tokens, ar.max_tokens_given ? 0 : 1);
    if (need > context)
      throw ApiError(400,
                     fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens "
                                 "({} in the {}, {} in the completion). Please reduce the length of the {} or completion.",
                                 context, len + std::max<int64_t>(max_tokens, 1), len, field,
                                 std::max<int64_t>(max_tokens, 1), field),
                     field, "context_length_exceeded");
  }

  // Checks the prompt length and fixes max_tokens / max_context of `r`; a
  // forced tool call, a JSON object, a JSON schema, a choice, a regex or a grammar gets its
  // grammar, and max_tokens must leave room for its shortest output.
  // The engine request of a processed chat turn (its media moved in),
  // fitted to the context; `field` names the prompt in errors. The served
  // LoRA is set when it is submitted (pinned).
  Request chat_engine_request(phi4mm::ProcessedChat pc, const ApiRequest& ar, const char* field) {
    Request r;
    r.prompt = pc.ids();
    r.adapter = pc.adapter;
    r.media = std::move(pc.media);
    r.params = ar.params;
    r.cache_salt = ar.cache_salt;
    fit_context(r, ar, field);
    return r;
  }

  void fit_context(Request& r, const ApiRequest& ar, const char* field) {
    const int64_t len = int64_t(r.prompt.size());
    check_prompt_length(len, ar, field);
    int64_t& max_tokens = r.params.max_tokens;
    if (!ar.max_tokens_given) max_tokens = std::min(max_tokens, context - len);
    r.params.min_tokens = std::min(r.params.min_tokens, max_tokens);
    r.max_context = context;
    if (!ar.auto_tools.empty()) {
      try {
        r.params.grammar = std::make_shared<AutoToolCall>(OutputGrammar::tool_call(token_bytes(), ar.auto_tools, ar.auto_schemas));
      } catch (const std::invalid_argument&) {
        // More tools or longer names than a call grammar takes: free text, as before.
      }
      return;
    }
    if (ar.constraint_field.empty()) return;
    const char* what = ar.constraint_field.c_str();
    try {
      auto& g = r.params.grammar;
      if (!ar.forced_tools.empty()) g = OutputGrammar::tool_call(token_bytes(), ar.forced_tools, ar.forced_schemas);
      else if (!ar.choices.empty()) g = OutputGrammar::choice(token_bytes(), ar.choices);
      else if (ar.has_regex) g = OutputGrammar::regex(token_bytes(), Regex::compile(ar.regex));
      else if (ar.has_grammar) g = Cfg::compile(token_bytes(), ar.grammar);
      else if (ar.output_schema) g = OutputGrammar::json_schema(token_bytes(), ar.output_schema);
      else g = OutputGrammar::json_object(token_bytes());
    } catch (const std::invalid_argument& e) {
      throw ApiError(400, fmt::format("'{}': {}", what, e.what()), what);
    }
    if (max_tokens < r.params.grammar->min_tokens())
      throw ApiError(400,
                     fmt::format("max_tokens is {}, but the shortest output that '{}' allows takes {} tokens", max_tokens,
                                 what, r.params.grammar->min_tokens()),
                     "max_tokens");
  }

  // ---- generation --------------------------------------------------------

  void generate(ApiKind kind, const httplib::Request& hreq, httplib::Response& res) {
    auto guard = std::make_shared<InFlight>(inflight);
    try {
      if (draining) throw ApiError(503, "the server is shutting down");
      const json body = parse_body(hreq);
      ApiRequest ar = kind == ApiKind::chat ? parse_chat_request(body, opts.api) : parse_completion_request(body, opts.api);
      const phi4mm::ServedLora served_lora = check_model(ar.model);
      // Schemas are read from the body again in key order (the parse above sorts keys).
      if (!ar.schema_field.empty() || !ar.forced_tools.empty() || !ar.auto_tools.empty())
        compile_output_schemas(parse_ordered_json_bounded(hreq.body, opts.max_json_depth), ar);
      std::shared_ptr<TrajectoryTurn> turn = trajectory_turn(hreq, kind, ar, served_lora);

      std::vector<Request> reqs;
      std::vector<std::vector<int64_t>> prompt_ids;
      if (kind == ApiKind::chat) {
        phi4mm::ProcessedChat pc = build_chat(ar.messages, ar.tools, ar.add_generation_prompt, &ar);
        Request r = chat_engine_request(std::move(pc), ar, "messages");
        if (turn) turn->media = r.media, turn->adapter = r.adapter;
        prompt_ids.push_back(r.prompt);
        reqs.push_back(std::move(r));
      } else {
        for (auto& ids : completion_prompt_ids(ar, engine.tokenizer(), opts.api.vocab_size)) {
          Request r;
          r.prompt = ids;
          r.served_lora = served_lora.number;
          r.served_lora_uid = served_lora.uid;
          r.params = ar.params;
          r.cache_salt = ar.cache_salt;
          fit_context(r, ar, "prompt");
          prompt_ids.push_back(std::move(ids));
          reqs.push_back(std::move(r));
        }
      }
      std::shared_lock<std::shared_mutex> lora_hold;
      const phi4mm::ServedLora pinned = pin_lora(ar.model, served_lora, lora_hold);
      for (Request& r : reqs) r.served_lora = pinned.number, r.served_lora_uid = pinned.uid;
      std::shared_ptr<Pending> pending = submit_all(reqs);
      if (lora_hold.owns_lock()) lora_hold.unlock();

      ResponseHeader h{new_response_id(kind == ApiKind::chat ? "chatcmpl-" : "cmpl-"), unix_now(),
                       served_lora.number ? ar.model : opts.served_model_name};
      {
        std::lock_guard<std::mutex> lk(metrics_mu);
        model_counts[h.model]++;
      }
      if (turn) turn->prompt = prompt_ids[0];
      if (!ar.stream) {
        respond_once(kind, ar, h, prompt_ids, *pending, res, turn.get());
      } else {
        stream(kind, std::move(ar), std::move(h), std::move(prompt_ids), pending, guard, res, std::move(turn));
      }
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  }

  // Submits every request, its outputs to the returned Pending. Engine::submit
  // validates each one (sampler.h's bounds table, as the parser did); an
  // invalid one is a 400 and aborts those submitted.
  std::shared_ptr<Pending> submit_all(std::vector<Request>& reqs) {
    auto pending = std::make_shared<Pending>();
    pending->total = reqs.size();
    pending->finished.assign(reqs.size(), false);
    for (size_t i = 0; i < reqs.size(); ++i) {
      try {
        // Not under pending->mu: the engine thread takes it in the callback.
        const int64_t id = engine.submit(std::move(reqs[i]), [pending, i](const RequestOutput& o) {
          pending->push(i, o);
        });
        std::lock_guard<std::mutex> lk(pending->mu);
        pending->ids.push_back(id);
      } catch (...) {
        for (int64_t id : pending->ids) engine.abort(id);
        try {
          throw;
        } catch (const QueueFull& e) {
          throw ApiError(429, fmt::format("the server is overloaded: {}; retry later", e.what()));
        } catch (const std::invalid_argument& e) {
          throw ApiError(400, e.what());
        } catch (const std::exception& e) {
          if (draining) throw ApiError(503, "the server is shutting down");
          throw ApiError(500, fmt::format("the engine refused the request: {}", e.what()));
        }
      }
    }
    return pending;
  }

  // Hands a finished turn to the recorder: `c` is its one choice.
  void record_turn(TrajectoryTurn& turn, const ApiRequest& ar, const ChoiceOutput& c) {
    if (c.finish == FinishReason::abort) return;  // not a finished turn (the engine stopped)
    turn.completion = c.tokens;
    turn.logprobs.clear();
    for (const TokenLogprob& lp : c.logprobs) turn.logprobs.push_back(lp.logprob);
    if (turn.logprobs.size() != turn.completion.size())
      throw ApiError(500, fmt::format("trajectory '{}': {} tokens but {} log-probabilities", turn.trajectory,
                                      turn.completion.size(), turn.logprobs.size()));
    turn.finish = c.finish;
    turn.text = c.text;
    if (ar.kind == ApiKind::chat && !ar.tools.is_null() && ar.tool_choice != "none") {
      ToolCallParse tc = parse_tool_calls(c.text, ar.tools);
      if (tc.found) turn.tool_calls = tc.tool_calls;
    }
    opts.recorder->record(std::move(turn));
  }

  void respond_once(ApiKind kind, const ApiRequest& ar, const ResponseHeader& h,
                    const std::vector<std::vector<int64_t>>& prompt_ids, Pending& pending, httplib::Response& res,
                    TrajectoryTurn* turn) {
    const size_t n = size_t(ar.params.n);
    std::vector<ChoiceOutput> choices(prompt_ids.size() * n);
    std::vector<std::vector<std::optional<TokenLogprob>>> prompt_lps(prompt_ids.size());
    std::string error;
    bool all_done = false;
    Usage usage;
    while (!all_done) {
      for (auto& [i, o] : pending.take(std::chrono::milliseconds(1000), all_done)) {
        if (!o.error.empty()) error = o.error;
        if (o.done) usage.cached_tokens += o.cached_tokens;
        if (o.sample < 0) {
          if (!o.prompt_logprobs.empty()) prompt_lps[i] = o.prompt_logprobs;
          continue;
        }
        choices[i * n + size_t(o.sample)].add(o);
      }
    }
    if (!error.empty()) throw ApiError(500, error);
    if (turn) record_turn(*turn, ar, choices[0]);
    for (auto& p : prompt_ids) usage.prompt_tokens += int64_t(p.size());
    for (auto& c : choices) usage.completion_tokens += int64_t(c.tokens.size());
    const json out = kind == ApiKind::chat
                         ? chat_response(h, ar, engine.tokenizer(), choices, usage, prompt_ids[0], prompt_lps[0])
                         : completion_response(h, ar, engine.tokenizer(), prompt_ids, prompt_lps, choices, usage);
    send_json(res, 200, out);
  }

  void stream(ApiKind kind, ApiRequest ar, ResponseHeader h, std::vector<std::vector<int64_t>> prompt_ids,
              std::shared_ptr<Pending> pending, std::shared_ptr<InFlight> guard, httplib::Response& res,
              std::shared_ptr<TrajectoryTurn> turn) {
    struct State {
      ApiRequest ar;
      ResponseHeader h;
      std::vector<std::vector<int64_t>> prompt_ids;
      std::vector<std::vector<std::optional<TokenLogprob>>> prompt_lps;
      std::vector<bool> started;        // per choice: role / echo chunk sent
      std::vector<int64_t> text_offset; // per choice (completion logprobs)
      Usage usage;
      ChoiceOutput recorded;            // the one choice of a recorded turn
      bool failed = false;
      // Chat with tools: per choice, the content sent as it is known not to
      // be a call, a call held and sent as one tool_calls delta when the
      // choice finishes (ToolCallStreamer); the held tokens' log-probabilities
      // go with the next chunk sent.
      bool tools = false;
      std::vector<ToolCallStreamer> streamer;
      std::vector<std::vector<TokenLogprob>> held_lps;
      // return_token_ids: per choice, the ids not yet sent in a chunk's
      // token_ids, and whether its first chunk (prompt_token_ids) went out.
      std::vector<std::vector<int64_t>> unsent_ids;
      std::vector<bool> prompt_ids_sent;
    };
    auto st = std::make_shared<State>();
    st->ar = std::move(ar);
    st->h = std::move(h);
    st->prompt_ids = std::move(prompt_ids);
    st->prompt_lps.resize(st->prompt_ids.size());
    const size_t n = size_t(st->ar.params.n);
    st->started.assign(st->prompt_ids.size() * n, false);
    st->text_offset.assign(st->prompt_ids.size() * n, 0);
    for (auto& p : st->prompt_ids) st->usage.prompt_tokens += int64_t(p.size());
    st->tools = kind == ApiKind::chat && !st->ar.tools.is_null() && st->ar.tool_choice != "none";
    st->streamer.resize(st->prompt_ids.size() * n);
    st->held_lps.resize(st->prompt_ids.size() * n);
    st->unsent_ids.resize(st->prompt_ids.size() * n);
    st->prompt_ids_sent.assign(st->prompt_ids.size() * n, false);

    Engine* eng = &engine;
    Impl* self = this;
    start_sse(
        res,
        [st, pending, kind, n, eng, self, turn](size_t, httplib::DataSink& sink) {
          const tok::Tokenizer& t = eng->tokenizer();
          ApiRequest& ar = st->ar;
          auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
          // A chunk of choice c (prompt i) as sent: with continuous usage,
          // the usage so far; with return_token_ids, the ids not sent yet,
          // and the prompt's ids in its first chunk.
          auto ids = [&](json chunk, size_t i, size_t c) {
            if (ar.continuous_usage) chunk["usage"] = st->usage.to_json();
            if (!ar.return_token_ids) return chunk;
            json& choice = chunk["choices"][0];
            if (!st->prompt_ids_sent[c]) {
              st->prompt_ids_sent[c] = true;
              (kind == ApiKind::chat ? chunk : choice)["prompt_token_ids"] = st->prompt_ids[i];
            }
            choice["token_ids"] = std::move(st->unsent_ids[c]);
            st->unsent_ids[c].clear();
            return chunk;
          };
          // The first chunk of a choice: the role (chat) or the echoed prompt (completions).
          auto start_choice = [&](size_t i, size_t c) {
            if (st->started[c]) return true;
            st->started[c] = true;
            if (kind == ApiKind::chat)
              return write(sse_event(ids(chat_chunk(st->h, int64_t(c), {{"role", "assistant"}, {"content", ""}}), i, c))) &&
                     (ar.echo_prefix.empty() ||
                      write(sse_event(ids(chat_chunk(st->h, int64_t(c), {{"content", ar.echo_prefix}}), i, c))));
            if (!ar.echo) return true;
            std::vector<tok::TokenId> tids(st->prompt_ids[i].begin(), st->prompt_ids[i].end());
            const std::string text = t.decode(tids, ar.params.skip_special_tokens);
            json lp = nullptr;
            if (ar.completion_logprobs >= 0)
              lp = completion_logprobs_json(t, st->prompt_ids[i], st->prompt_lps[i], {}, ar.return_tokens_as_token_ids);
            st->text_offset[c] = int64_t(text.size());
            return write(sse_event(ids(completion_chunk(st->h, int64_t(c), text, lp), i, c)));
          };
          const bool all_sent = pump_events(*pending, st->failed, write, [&](size_t i, const RequestOutput& o) {
            if (o.done) st->usage.cached_tokens += o.cached_tokens;
            if (o.sample < 0) {
              if (!o.prompt_logprobs.empty()) st->prompt_lps[i] = o.prompt_logprobs;
              return true;
            }
            const size_t c = i * n + size_t(o.sample);
            if (turn) st->recorded.add(o);
            if (!start_choice(i, c)) return false;
            if (ar.return_token_ids) st->unsent_ids[c].insert(st->unsent_ids[c].end(), o.tokens.begin(), o.tokens.end());
            st->usage.completion_tokens += int64_t(o.tokens.size());
            const bool want_lp = kind == ApiKind::chat ? ar.logprobs : ar.completion_logprobs >= 0;
            // What this event sends as content: its own text, or (tools)
            // what the streamer releases; a parsed call at the finish.
            std::string text = o.text;
            std::vector<TokenLogprob> lps = o.logprobs;
            json call_delta;
            if (st->tools) {
              std::vector<TokenLogprob>& held = st->held_lps[c];
              held.insert(held.end(), o.logprobs.begin(), o.logprobs.end());
              text = st->streamer[c].push(o.text);
              if (o.finish != FinishReason::none) {
                const ToolCallParse tc = st->streamer[c].finish(ar.tools);
                if (tc.found) {
                  json calls = tc.tool_calls;
                  for (size_t k = 0; k < calls.size(); ++k) calls[k]["index"] = k;
                  call_delta = {{"tool_calls", calls}};
                  if (tc.content.is_string()) call_delta["content"] = tc.content;
                } else if (tc.content.is_string()) {
                  text += tc.content.get<std::string>();
                }
              }
              lps.clear();
              if (!text.empty() || !call_delta.is_null() || o.finish != FinishReason::none) {
                lps = std::move(held);
                held.clear();
              }
            }
            if (!call_delta.is_null() && !text.empty()) {  // the content before the call, then the call
              if (!write(sse_event(ids(chat_chunk(st->h, int64_t(c), {{"content", text}}, nullptr), i, c)))) return false;
              text.clear();
            }
            if (!call_delta.is_null()) {
              json lp = want_lp ? chat_logprobs_json(t, lps, ar.top_logprobs, ar.return_tokens_as_token_ids) : json(nullptr);
              if (!write(sse_event(ids(chat_chunk(st->h, int64_t(c), call_delta, lp), i, c)))) return false;
            } else if (!text.empty() || (want_lp && !lps.empty())) {
              json chunk;
              if (kind == ApiKind::chat) {
                json lp = want_lp ? chat_logprobs_json(t, lps, ar.top_logprobs, ar.return_tokens_as_token_ids)
                                  : json(nullptr);
                chunk = chat_chunk(st->h, int64_t(c), {{"content", text}}, lp);
              } else {
                json lp = want_lp ? completion_logprobs_json(t, {}, {}, o.logprobs, ar.return_tokens_as_token_ids,
                                                             st->text_offset[c])
                                  : json(nullptr);
                st->text_offset[c] += int64_t(o.text.size());
                chunk = completion_chunk(st->h, int64_t(c), o.text, lp);
              }
              if (!write(sse_event(ids(std::move(chunk), i, c)))) return false;
            }
            if (o.finish != FinishReason::none) {
              ChoiceOutput co;
              co.finish = o.finish;
              co.stop_reason = o.stop_reason;
              const json stop = stop_reason_json(co, ar.params);
              const json finish = call_delta.is_null() ? finish_reason_name(o.finish) : json("tool_calls");
              json chunk = kind == ApiKind::chat ? chat_chunk(st->h, int64_t(c), json::object(), nullptr, finish, stop)
                                                 : completion_chunk(st->h, int64_t(c), "", nullptr, finish, stop);
              if (!write(sse_event(ids(std::move(chunk), i, c)))) return false;
            }
            return true;
          });
          if (!all_sent) return false;
          if (turn && !st->failed) {
            try {
              self->record_turn(*turn, ar, st->recorded);
            } catch (const std::exception& e) {
              if (!write(sse_event(error_body(ApiError(500, e.what()))))) return false;
            }
          }
          if (ar.include_usage && !write(sse_event(usage_chunk(st->h, kind, st->usage)))) return false;
          if (!write(kSseDone)) return false;
          sink.done();
          return true;
        },
        abort_when_gone(pending, guard, eng));
  }

  // ---- speech to text (serve/speech.h) --------------------------------------

  // A chat-path error of a speech request, naming the form's field: the audio
  // part is `file`, the text part `prompt`, anything else in the turn `file`.
  static ApiError speech_error(const ApiError& e) {
    if (e.param.rfind("messages", 0) != 0) return e;
    static const std::pair<const char*, const char*> kNames[] = {{"messages[0].content[0].input_audio", "file"},
                                                                 {"messages[0].content[1].text", "prompt"},
                                                                 {"messages[0].content[0]", "file"},
                                                                 {"messages[0].content[1]", "prompt"},
                                                                 {"messages[0].content", "file"},
                                                                 {"Please reduce the length of the messages or completion.",
                                                                  "Please send a shorter clip or prompt, or ask for fewer tokens."},
                                                                 {"Please reduce the length of the messages.",
                                                                  "Please send a shorter clip or prompt."},
                                                                 {"in the messages", "in the prompt"}};
    std::string msg = e.what();
    for (const auto& [from, to] : kNames)
      for (size_t at = msg.find(from); at != std::string::npos; at = msg.find(from, at))
        msg.replace(at, std::strlen(from), to);
    return ApiError(e.status, msg, e.param.rfind("messages[0].content[1]", 0) == 0 ? "prompt" : "file", e.code);
  }

  void speech(SpeechTask task, const httplib::Request& hreq, httplib::Response& res) {
    auto guard = std::make_shared<InFlight>(inflight);
    try {
      if (draining) throw ApiError(503, "the server is shutting down");
      if (!hreq.is_multipart_form_data())
        throw ApiError(400, "send the audio as multipart/form-data with a part named 'file' (as OpenAI's clients do)",
                       "file");
      std::vector<FormField> form;
      for (const auto& [name, f] : hreq.files) form.push_back({name, f.content, f.filename});
      SpeechRequest sr = parse_speech_request(task, form);
      ApiRequest ar = parse_chat_request(sr.chat, opts.api);
      sr.chat = json();  // its base64 copy of the audio
      const phi4mm::ServedLora served_lora = check_model(ar.model);
      ar.params.logprobs = std::max<int64_t>(ar.params.logprobs, 0);  // verbose_json's avg_logprob
      if (!ar.max_tokens_given) ar.params.max_tokens = context;        // what the context leaves (fit_context)
      phi4mm::ProcessedChat pc;
      try {
        pc = build_chat(ar.messages, ar.tools, /*add_generation_prompt=*/true, &ar);
      } catch (const ApiError& e) {
        throw speech_error(e);
      }
      ar.messages = json();
      SpeechOutput out;
      out.temperature = ar.params.temperature;
      for (const phi4mm::Media& m : pc.media)
        if (m.kind == phi4mm::MediaKind::kAudio && m.sample_rate > 0)
          out.duration_s = double(m.samples.size()) / double(m.sample_rate);
      Request r = chat_engine_request(std::move(pc), ar, "file");
      out.prompt_tokens = int64_t(r.prompt.size());
      out.audio_tokens = std::count(r.prompt.begin(), r.prompt.end(), int64_t(phi4mm::kAudioTokenId));
      ResponseHeader h;
      std::shared_ptr<Pending> pending = submit_one(std::move(r), ar.model, served_lora, "trsc-", h);
      if (sr.stream) {
        stream_speech(ar.include_usage, std::move(h), std::move(out), pending, guard, res);
        return;
      }
      ChoiceOutput c = collect_one(*pending);
      out.text = std::move(c.text);
      out.tokens = std::move(c.tokens);
      out.logprobs = std::move(c.logprobs);
      out.finish = c.finish;
      const SpeechBody b = speech_response(sr, out);
      res.status = 200;
      res.set_content(b.body, b.content_type);
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  }

  void stream_speech(bool include_usage, ResponseHeader h, SpeechOutput out, std::shared_ptr<Pending> pending,
                     std::shared_ptr<InFlight> guard, httplib::Response& res) {
    struct State {
      ResponseHeader h;
      SpeechOutput out;
      bool failed = false;
    };
    auto st = std::make_shared<State>(State{std::move(h), std::move(out), false});
    Engine* eng = &engine;
    start_sse(
        res,
        [st, pending, include_usage](size_t, httplib::DataSink& sink) {
          auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
          const bool all_sent = pump_events(*pending, st->failed, write, [&](size_t, const RequestOutput& o) {
            if (o.sample < 0) return true;
            SpeechOutput& so = st->out;
            so.tokens.insert(so.tokens.end(), o.tokens.begin(), o.tokens.end());
            so.logprobs.insert(so.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
            so.text += o.text;
            if (o.finish != FinishReason::none) so.finish = o.finish;
            return o.text.empty() || write(sse_event(speech_delta_event(st->h, o.text)));
          });
          if (!all_sent) return false;
          if (!st->failed && !write(sse_event(speech_done_event(st->h, st->out)))) return false;
          if (include_usage && !write(sse_event(speech_usage_chunk(st->h, st->out)))) return false;
          if (!write(kSseDone)) return false;
          sink.done();
          return true;
        },
        abort_when_gone(pending, guard, eng));
  }

  // A recorded trajectory turn (the request names one under
  // X-Areno-Trajectory on a server with a recorder), else null: one sample
  // of one prompt for the served model, its log-probabilities always
  // computed (the response shows them only when asked).
  std::shared_ptr<TrajectoryTurn> trajectory_turn(const httplib::Request& hreq, ApiKind kind, ApiRequest& ar,
                                                  const phi4mm::ServedLora& served_lora) {
    if (!opts.recorder || !hreq.has_header(kTrajectoryHeader)) return nullptr;
    auto turn = std::make_shared<TrajectoryTurn>();
    turn->trajectory = hreq.get_header_value(kTrajectoryHeader);
    turn->kind = kind;
    if (!valid_trajectory_id(turn->trajectory))
      throw ApiError(400, fmt::format("{}: '{}' is not a trajectory id (1 to 128 characters of A-Z a-z 0-9 . _ : -)",
                                      kTrajectoryHeader, turn->trajectory));
    if (ar.params.n != 1)
      throw ApiError(400, fmt::format("'n' must be 1 in a request recorded under {} (got {})", kTrajectoryHeader,
                                      ar.params.n), "n");
    if (served_lora.number)  // the trainer scores turns with the model it trains, not a served adapter
      throw ApiError(400, fmt::format("a request recorded under {} must name the served model `{}`, not the "
                                      "served LoRA `{}`", kTrajectoryHeader, opts.served_model_name, ar.model),
                     "model");
    if (kind == ApiKind::completion && ar.prompts.size() != 1)
      throw ApiError(400, fmt::format("'prompt' must be one prompt in a request recorded under {} (got {})",
                                      kTrajectoryHeader, ar.prompts.size()), "prompt");
    ar.params.logprobs = std::max<int64_t>(ar.params.logprobs, 0);
    return turn;
  }

  // Submits one request for `model` (a served LoRA pinned from its lookup to
  // submit), counts it by model, and sets its response header.
  std::shared_ptr<Pending> submit_one(Request r, const std::string& model, const phi4mm::ServedLora& served,
                                      const std::string& id_prefix, ResponseHeader& h) {
    std::shared_lock<std::shared_mutex> lora_hold;
    const phi4mm::ServedLora pinned = pin_lora(model, served, lora_hold);
    r.served_lora = pinned.number;
    r.served_lora_uid = pinned.uid;
    std::vector<Request> reqs;
    reqs.push_back(std::move(r));
    std::shared_ptr<Pending> pending = submit_all(reqs);
    if (lora_hold.owns_lock()) lora_hold.unlock();
    h = ResponseHeader{new_response_id(id_prefix), unix_now(), served.number ? model : opts.served_model_name};
    std::lock_guard<std::mutex> lk(metrics_mu);
    model_counts[h.model]++;
    return pending;
  }

  // The one choice of a one-request answer, once it is done (and the
  // prompt tokens the prefix cache gave). An engine error is a 500.
  static ChoiceOutput collect_one(Pending& pending, int64_t* cached_tokens = nullptr) {
    ChoiceOutput c;
    std::string error;
    bool all_done = false;
    while (!all_done)
      for (auto& [i, o] : pending.take(std::chrono::milliseconds(1000), all_done)) {
        if (!o.error.empty()) error = o.error;
        if (o.done && cached_tokens) *cached_tokens = o.cached_tokens;
        if (o.sample >= 0) c.add(o);
      }
    if (!error.empty()) throw ApiError(500, error);
    return c;
  }

  // ---- /v1/responses (serve/responses.h) ----------------------------------------

  // A /v1/responses body made ready to run: its stored history looked up,
  // parsed, the chat request it amounts to checked, its prompt built (cut
  // with truncation "auto"). `counting`: for /v1/responses/input_tokens,
  // nothing recorded and no background or trajectory check.
  struct PreparedResponse {
    ResponsesRequest rr;
    ApiRequest ar;
    phi4mm::ServedLora served_lora;
    Request r;
    std::shared_ptr<TrajectoryTurn> turn;  // recorded for agentic rollouts, as a chat turn
  };
  PreparedResponse prepare_response(const httplib::Request& hreq, const nlohmann::ordered_json& body, bool counting) {
    std::optional<ResponsesStore::Entry> previous;
    if (const std::string id = previous_response_id(body); !id.empty()) {
      if (!stored_responses.enabled())
        throw ApiError(400, "'previous_response_id' is not supported: this server stores no responses (start areno "
                            "serve with --responses-store-mb N, or send the whole conversation as 'input')",
                       "previous_response_id");
      previous = get_response(id);
      if (previous) {
        const std::string status = previous->object.value("status", "");
        if (status != "completed" && status != "incomplete")
          throw ApiError(400, fmt::format("Previous response with id '{}' is {}: only a completed or incomplete "
                                          "response can be continued.", id, background_status(id, status)),
                         "previous_response_id");
      }
    }
    if (const std::string conv = conversation_id(body); !conv.empty() && previous_response_id(body).empty()) {
      if (!stored_responses.enabled())
        throw ApiError(400, "'conversation' is not supported: this server stores no conversations (start areno "
                            "serve with --responses-store-mb N, or send the whole conversation as 'input')",
                       "conversation");
      previous = find_stored(conv, /*conversation=*/true);
    }
    PreparedResponse p;
    ResponsesRequest& rr = p.rr;
    rr = parse_responses_request(body, previous ? previous->conversation.get() : nullptr);
    previous.reset();
    if (rr.background && !counting && !stored_responses.enabled())
      throw ApiError(400, "'background' needs a response store: this server stores no responses (start areno serve "
                          "with --responses-store-mb N)", "background");
    if (!stored_responses.enabled()) rr.store = false;
    if (!rr.store && rr.conversation_id.empty()) rr.items = nlohmann::ordered_json();
    ApiRequest& ar = p.ar;
    try {
      ar = parse_chat_request(parse_json_bounded(rr.chat.dump(), opts.max_json_depth), opts.api);
      p.served_lora = check_model(ar.model);
      if (!ar.schema_field.empty() || !ar.forced_tools.empty() || !ar.auto_tools.empty())
        compile_output_schemas(rr.chat, ar);
      if (!counting) p.turn = trajectory_turn(hreq, ApiKind::chat, ar, p.served_lora);
      if (p.turn && rr.background)
        throw ApiError(400, fmt::format("'background' is not supported with {} (a recorded turn ends with its "
                                        "request)", kTrajectoryHeader), "background");
      auto build = [&] {
        return chat_engine_request(build_chat(ar.messages, ar.tools, /*add_generation_prompt=*/true, &ar), ar,
                                   "messages");
      };
      p.r = rr.truncate ? fit_by_truncation(ar, rr, build) : build();
      if (p.turn) p.turn->media = p.r.media, p.turn->adapter = p.r.adapter, p.turn->prompt = p.r.prompt;
    } catch (const ApiError& e) {
      throw responses_error(e, rr);
    }
    return p;
  }

  // POST /v1/responses/input_tokens: the prompt tokens a /v1/responses body
  // would have (OpenAI's count), with its history, tools and truncation.
  void response_input_tokens(const httplib::Request& hreq, httplib::Response& res) {
    InFlight g(inflight);
    try {
      if (draining) throw ApiError(503, "the server is shutting down");
      const nlohmann::ordered_json body = parse_ordered_json_bounded(hreq.body, opts.max_json_depth);
      const PreparedResponse p = prepare_response(hreq, body, /*counting=*/true);
      send_json(res, 200, {{"object", "response.input_tokens"}, {"input_tokens", int64_t(p.r.prompt.size())}});
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  }

  void responses(const httplib::Request& hreq, httplib::Response& res) {
    auto guard = std::make_shared<InFlight>(inflight);
    try {
      if (draining) throw ApiError(503, "the server is shutting down");
      const nlohmann::ordered_json body = parse_ordered_json_bounded(hreq.body, opts.max_json_depth);
      PreparedResponse p = prepare_response(hreq, body, /*counting=*/false);
      ResponsesRequest& rr = p.rr;
      ApiRequest& ar = p.ar;
      const phi4mm::ServedLora& served_lora = p.served_lora;
      Request& r = p.r;
      std::shared_ptr<TrajectoryTurn> turn = p.turn;
      rr.chat = nlohmann::ordered_json();  // its copy of the media
      ar.messages = json();
      ResponsesOutput out;
      out.input_tokens = int64_t(r.prompt.size());
      out.temperature = ar.params.temperature;
      out.top_p = ar.params.top_p;
      out.with_logprobs = ar.logprobs;
      out.top_logprobs = ar.top_logprobs;
      out.message_id = new_response_id("msg_");
      ResponseHeader h;
      std::shared_ptr<Pending> pending = submit_one(std::move(r), ar.model, served_lora, "resp_", h);
      if (rr.background) {
        const bool stream = rr.stream;
        std::shared_ptr<ResponseEvents> events;
        json queued =
            start_background(std::move(ar), std::move(rr), std::move(h), std::move(out), pending, guard, events);
        if (stream)
          follow_events(res, std::move(events), 0);  // one reader: the response runs on without it
        else
          send_json(res, 200, queued);
        return;
      }
      if (rr.stream) {
        stream_responses(std::move(ar), std::move(rr), std::move(h), std::move(out), pending, guard, res,
                         std::move(turn));
        return;
      }
      ChoiceOutput c = collect_one(*pending, &out.cached_tokens);
      if (turn) record_turn(*turn, ar, c);
      finish_responses_output(ar, c, out);
      const json output = response_output(out, engine.tokenizer(), ar.return_tokens_as_token_ids);
      json object = response_object(h, rr, out, output);
      add_to_conversation(rr, object["output"]);
      if (rr.store) store_response(object, rr.items);
      send_json(res, 200, object);
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  }

  // truncation "auto" (serve/responses.h): the prompt of the messages with the
  // oldest left out until it fits. The instructions and the last message
  // stay, and the kept part begins at a message that is not a call's result.
  // Fewer messages never make a longer prompt, so the first cut that fits is
  // found by bisection. `ar.messages` and `rr.message_from` end as the kept
  // ones; when nothing fits, the whole request's error.
  static Request fit_by_truncation(ApiRequest& ar, ResponsesRequest& rr, const std::function<Request()>& build) {
    auto too_long = [](const ApiError& e) { return e.code == "context_length_exceeded"; };
    std::optional<ApiError> whole;
    try {
      return build();
    } catch (const ApiError& e) {
      if (!too_long(e)) throw;
      whole = e;
    }
    const json all = ar.messages;
    const std::vector<std::string> from = rr.message_from;
    if (!all.is_array() || from.size() != all.size()) throw *whole;  // (one name per message, always)
    const size_t keep = !from.empty() && from[0] == "instructions" ? 1 : 0;
    std::vector<size_t> cuts;  // where the kept part may begin
    for (size_t i = keep + 1; i < all.size(); ++i)
      if (!(all[i].is_object() && all[i].value("role", "") == "tool")) cuts.push_back(i);
    auto select = [&](size_t cut) {
      ar.messages = json::array();
      rr.message_from.clear();
      for (size_t i = 0; i < all.size(); ++i)
        if (i < keep || i >= cut) ar.messages.push_back(all[i]), rr.message_from.push_back(from[i]);
    };
    auto attempt = [&](size_t cut, std::optional<Request>& out) {
      select(cut);
      try {
        out = build();
      } catch (const ApiError& e) {
        if (!too_long(e)) throw;
        out.reset();
      }
    };
    size_t lo = 0, hi = cuts.size();  // cuts[hi] fits (when hi < cuts.size())
    std::optional<Request> best, r;
    while (lo < hi) {
      const size_t mid = lo + (hi - lo) / 2;
      attempt(cuts[mid], r);
      if (r) {
        best = std::move(r);
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    if (!best) {
      rr.message_from = from;
      throw *whole;
    }
    select(cuts[hi]);  // (the last attempt may have been a longer one)
    return std::move(*best);
  }

  // Keeps a response (its "store" says whether it was kept).
  void store_response(json& object, const nlohmann::ordered_json& items,
                      std::shared_ptr<ResponseEvents> events = nullptr) {
    object["store"] = true;
    if (!stored_responses.put(object["id"].get<std::string>(), object, items, object["output"], std::move(events)))
      object["store"] = false;
  }

  // GET (the response object, or with ?stream=true a background stream's
  // events) or DELETE /v1/responses/{id}.
  void stored_response(const httplib::Request& hreq, httplib::Response& res, bool erase) {
    InFlight g(inflight);
    try {
      const std::string id = hreq.matches[1];
      if (erase) {
        stop_background(id);  // a running one stops (and is stored) first
        if (!get_response(id) || !stored_responses.erase(id)) throw response_not_found(id);
        send_json(res, 200, {{"id", id}, {"object", "response.deleted"}, {"deleted", true}});
        return;
      }
      const std::string stream = hreq.get_param_value("stream");
      if (hreq.has_param("stream") && stream != "true" && stream != "false")
        throw ApiError(400, "'stream' must be true or false", "stream");
      const std::string after = hreq.get_param_value("starting_after");
      int64_t starting_after = -1;
      if (hreq.has_param("starting_after")) {
        if (stream != "true") throw ApiError(400, "'starting_after' needs stream=true", "starting_after");
        if (after.empty() || after.size() > 18 || after.find_first_not_of("0123456789") != std::string::npos)
          throw ApiError(400, "'starting_after' must be a sequence number (an integer >= 0)", "starting_after");
        starting_after = std::stoll(after);
      }
      std::optional<ResponsesStore::Entry> e = get_response(id);
      if (!e) throw response_not_found(id);
      if (stream == "true") {
        if (!e->events)
          throw ApiError(400, fmt::format("Response with id '{}' was not created with 'background' and 'stream' "
                                          "both true, so it has no stream to resume.", id), "stream");
        follow_events(res, std::move(e->events), size_t(starting_after + 1));
        return;
      }
      json object = e->object;
      if (object["status"] == "queued") object["status"] = background_status(id, "queued");
      send_json(res, 200, object);
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  }

  // A 200 event stream of a background response's events from index `next`
  // on, as they come, until its last one. A reader going away stops nothing.
  void follow_events(httplib::Response& res, std::shared_ptr<ResponseEvents> events, size_t next) {
    auto guard = std::make_shared<InFlight>(inflight);
    start_sse(
        res,
        [events, next, self = this](size_t, httplib::DataSink& sink) mutable {
          auto idle = std::chrono::steady_clock::now();
          while (!self->stopped) {
            bool closed = false;
            const std::vector<std::string> got = events->wait_from(next, std::chrono::milliseconds(200), closed);
            for (const std::string& e : got)
              if (!sink.write(e.data(), e.size())) return false;
            next += got.size();
            if (closed) {
              sink.done();
              return true;
            }
            const auto now = std::chrono::steady_clock::now();
            if (!got.empty()) {
              idle = now;
            } else if (now - idle > std::chrono::seconds(2)) {
              if (!sink.write(": keep-alive\n\n", 14)) return false;
              idle = now;
            }
          }
          return false;
        },
        [guard](bool) {});
  }

  // ---- /v1/conversations (serve/conversations.h) ------------------------------

  enum class ConversationCall { create, get, update, remove, list_items, add_items, get_item, remove_item };

  // A stored entry of one kind (a conversation, or a response) by id: the
  // two kinds share the store, never each other's routes.
  std::optional<ResponsesStore::Entry> find_stored(const std::string& id, bool conversation) {
    std::optional<ResponsesStore::Entry> e = stored_responses.get(id);
    if (e && is_conversation(*e) != conversation) e.reset();
    return e;
  }
  std::optional<ResponsesStore::Entry> get_response(const std::string& id) { return find_stored(id, false); }

  // A stored conversation by id, else the 404.
  ResponsesStore::Entry get_conversation(const std::string& id) {
    std::optional<ResponsesStore::Entry> e = find_stored(id, /*conversation=*/true);
    if (!e)
      throw ApiError(404,
                     stored_responses.enabled()
                         ? fmt::format("Conversation with id '{}' not found.", id)
                         : fmt::format("Conversation with id '{}' not found: this server stores no conversations "
                                       "(start areno serve with --responses-store-mb N)", id),
                     "conversation_id", "not_found");
    return *e;
  }

  // Stores a conversation's new object and items in place of `old` (under
  // conv_mu); one that would outgrow the whole store stays as it was.
  bool put_conversation(const std::string& id, const ResponsesStore::Entry& old, const json& object,
                        const nlohmann::ordered_json& items) {
    if (stored_responses.put(id, object, items, json::array())) return true;
    stored_responses.put(id, old.object, *old.conversation, json::array());
    return false;
  }
  void change_conversation(const std::string& id, const ResponsesStore::Entry& old, const json& object,
                           const nlohmann::ordered_json& items) {
    if (!put_conversation(id, old, object, items))
      throw ApiError(400, "the conversation would be larger than this server's whole store (--responses-store-mb); "
                          "it was not changed", "items");
  }

  void conversation(ConversationCall call, const httplib::Request& hreq, httplib::Response& res) {
    InFlight g(inflight);
    try {
      if (call == ConversationCall::create) {
        if (!stored_responses.enabled())
          throw ApiError(400, "conversations are not supported: this server stores none (start areno serve with "
                              "--responses-store-mb N)");
        auto [object, items] = parse_new_conversation(parse_ordered_json_bounded(hreq.body, opts.max_json_depth),
                                                      unix_now());
        std::lock_guard<std::mutex> lk(conv_mu);
        if (!stored_responses.put(object["id"].get<std::string>(), object, items, json::array()))
          throw ApiError(400, "the conversation is larger than this server's whole store (--responses-store-mb)",
                         "items");
        send_json(res, 200, object);
        return;
      }
      const std::string id = hreq.matches[1];
      std::unique_lock<std::mutex> lk(conv_mu);  // one change at a time (a response's items, a client's)
      ResponsesStore::Entry e = get_conversation(id);
      const nlohmann::ordered_json& items = *e.conversation;
      switch (call) {
        case ConversationCall::get:
          send_json(res, 200, e.object);
          return;
        case ConversationCall::update: {
          json object = e.object;
          object["metadata"] = parse_conversation_update(parse_ordered_json_bounded(hreq.body, opts.max_json_depth));
          change_conversation(id, e, object, items);
          send_json(res, 200, object);
          return;
        }
        case ConversationCall::remove:
          stored_responses.erase(id);
          send_json(res, 200, {{"id", id}, {"object", "conversation.deleted"}, {"deleted", true}});
          return;
        case ConversationCall::list_items:
          lk.unlock();
          send_json(res, 200, input_items_page(e, hreq.get_param_value("limit"), hreq.get_param_value("order"),
                                               hreq.get_param_value("after")));
          return;
        case ConversationCall::add_items: {
          const nlohmann::ordered_json added =
              parse_conversation_items(parse_ordered_json_bounded(hreq.body, opts.max_json_depth));
          nlohmann::ordered_json all = items;
          for (const auto& item : added) all.push_back(item);
          change_conversation(id, e, e.object, all);
          send_json(res, 200, item_list(added));
          return;
        }
        case ConversationCall::get_item:
        case ConversationCall::remove_item: {
          const std::string item_id = hreq.matches[2];
          const int64_t at = find_item(items, item_id);
          if (at < 0)
            throw ApiError(404, fmt::format("Item with id '{}' not found.", item_id), "item_id", "not_found");
          if (call == ConversationCall::get_item) {
            send_json(res, 200, json::parse(items[size_t(at)].dump()));
            return;
          }
          nlohmann::ordered_json rest = items;
          rest.erase(size_t(at));
          change_conversation(id, e, e.object, rest);
          send_json(res, 200, e.object);
          return;
        }
        case ConversationCall::create:
          break;
      }
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  }

  // A response that names a conversation adds its input items (those after
  // the conversation's) and its output items, once it completed or is
  // incomplete. A conversation deleted meanwhile gets nothing.
  void add_to_conversation(const ResponsesRequest& rr, const json& output) {
    if (rr.conversation_id.empty()) return;
    std::lock_guard<std::mutex> lk(conv_mu);
    std::optional<ResponsesStore::Entry> e = find_stored(rr.conversation_id, /*conversation=*/true);
    if (!e) return;
    nlohmann::ordered_json all = *e->conversation;
    for (size_t i = rr.input_from; i < rr.items.size(); ++i) all.push_back(rr.items[i]);
    for (const json& item : output) all.push_back(nlohmann::ordered_json::parse(item.dump()));
    if (!put_conversation(rr.conversation_id, *e, e->object, all))
      fmt::print(stderr, "areno serve: a response's items were not added to conversation {}: it would outgrow the "
                         "whole store (--responses-store-mb)\n",
                 rr.conversation_id);
  }

  // ---- background responses ------------------------------------------------

  // A stored background response's status: in_progress while its job runs.
  std::string background_status(const std::string& id, const std::string& stored) {
    std::lock_guard<std::mutex> lk(bg_mu);
    return bg_jobs.count(id) ? "in_progress" : stored;
  }

  // Stores the queued response and hands it to the background thread;
  // returns the queued object (and with stream, `events`: its first ones in).
  json start_background(ApiRequest ar, ResponsesRequest rr, ResponseHeader h, ResponsesOutput out,
                        std::shared_ptr<Pending> pending, std::shared_ptr<InFlight> guard,
                        std::shared_ptr<ResponseEvents>& events) {
    json queued = response_pending(h, rr, "queued", out.temperature, out.top_p);
    auto j = std::make_shared<BackgroundJob>(ResponsesRun(std::move(ar), std::move(out)));
    if (rr.stream) {
      events = std::make_shared<ResponseEvents>();
      j->run.rs.emplace(h, rr, j->run.out.message_id);
      events->append(j->run.rs->start(j->run.out.temperature, j->run.out.top_p));
    }
    store_response(queued, rr.items, events);
    if (queued["store"] != true) {
      for (int64_t e : pending->ids) engine.abort(e);
      throw ApiError(400, "the request is larger than this server's whole response store (--responses-store-mb), so "
                          "it cannot run in the background", "background");
    }
    j->pending = std::move(pending);
    j->rr = std::move(rr);
    j->h = std::move(h);
    j->events = events;
    j->guard = std::move(guard);
    {
      std::lock_guard<std::mutex> lk(bg_mu);
      bg_jobs[j->h.id] = j;
      if (!bg_thread.joinable()) bg_thread = std::thread([this] { background_loop(); });
    }
    j->pending->watch(bg_wake);
    return queued;
  }

  // The background thread: takes each job's outputs as they come (a stream's
  // events appended), and stores each job as it ends.
  void background_loop() {
    while (true) {
      std::vector<std::shared_ptr<BackgroundJob>> jobs;
      {
        std::lock_guard<std::mutex> lk(bg_mu);
        if (bg_stop) break;
        for (auto& [id, j] : bg_jobs) jobs.push_back(j);
      }
      for (auto& j : jobs) {
        bool cancel = false;
        try {
          if (!take_background(*j)) continue;
          {
            std::lock_guard<std::mutex> lk(bg_mu);
            cancel = j->cancel;
          }
          finish_background(*j, cancel);
        } catch (const std::exception& e) {
          fmt::print(stderr, "background response {} could not be stored: {}\n", j->h.id, e.what());
        }
        if (j->events) j->events->close();
        {
          std::lock_guard<std::mutex> lk(bg_mu);
          j->finished = true;
          bg_jobs.erase(j->h.id);
        }
        bg_cv.notify_all();
      }
      bg_wake->wait_for(std::chrono::milliseconds(200));
    }
    std::lock_guard<std::mutex> lk(bg_mu);
    for (auto& [id, j] : bg_jobs) {  // the server is going away: what still runs is stopped
      for (int64_t e : j->pending->ids) engine.abort(e);
      if (j->events) j->events->close();
    }
    bg_jobs.clear();
  }

  // A job's outputs so far (with stream, its events appended); true when it is done.
  bool take_background(BackgroundJob& j) {
    bool all_done = false;
    std::string sse;
    for (auto& [i, o] : j.pending->take(std::chrono::milliseconds(0), all_done)) {
      if (!o.error.empty())
        j.run.error = o.error;
      else
        sse += j.run.add(o, engine.tokenizer());
    }
    if (j.events && !sse.empty()) j.events->append(sse);
    return all_done;
  }

  // A finished job's final object, stored under its id; with stream, the last events.
  void finish_background(BackgroundJob& j, bool cancel) {
    ResponsesRun& run = j.run;
    json object;
    std::string tail;  // a stream's last events
    if (!run.error.empty()) {
      object = response_pending(j.h, j.rr, "failed", run.out.temperature, run.out.top_p);
      object["error"] = {{"code", "server_error"}, {"message", run.error}};
      if (run.rs) tail = run.rs->error(ApiError(500, run.error, "", "server_error"));
    } else if (cancel || run.aborted) {
      object = response_pending(j.h, j.rr, "cancelled", run.out.temperature, run.out.top_p);
      if (run.rs) tail = run.rs->error(ApiError(400, "The response was cancelled.", "", "response_cancelled"));
    } else {
      run.finish();
      if (run.rs) {
        json& final = run.rs->conclude(run.out, engine.tokenizer(), run.ar.return_tokens_as_token_ids);
        add_to_conversation(j.rr, final["output"]);
        store_response(final, j.rr.items, j.events);
        j.events->append(run.rs->finish());
        j.events->close();
        stored_responses.recount(j.h.id);  // its last events counted
        return;
      }
      object = response_object(j.h, j.rr, run.out,
                               response_output(run.out, engine.tokenizer(), run.ar.return_tokens_as_token_ids));
      add_to_conversation(j.rr, object["output"]);
    }
    store_response(object, j.rr.items, j.events);
    if (j.events) {
      j.events->append(tail);
      j.events->close();
      stored_responses.recount(j.h.id);
    }
  }

  // Stops a running background response and waits until it is stored; false when none runs.
  bool stop_background(const std::string& id) {
    std::unique_lock<std::mutex> lk(bg_mu);
    auto it = bg_jobs.find(id);
    if (it == bg_jobs.end()) return false;
    std::shared_ptr<BackgroundJob> j = it->second;
    j->cancel = true;
    const std::vector<int64_t> ids = j->pending->ids;
    lk.unlock();
    for (int64_t e : ids) engine.abort(e);
    bg_wake->notify();
    lk.lock();
    bg_cv.wait(lk, [&] { return j->finished || bg_stop; });
    return true;
  }

  // POST /v1/responses/{id}/cancel: a background response stops (status
  // cancelled); one that ended already is answered as it is.
  void cancel_response(const httplib::Request& hreq, httplib::Response& res) {
    InFlight g(inflight);
    try {
      const std::string id = hreq.matches[1];
      stop_background(id);
      std::optional<ResponsesStore::Entry> e = get_response(id);
      if (!e) throw response_not_found(id);
      if (!e->object.value("background", false))
        throw ApiError(400, "Only background responses can be cancelled.", "response_id");
      send_json(res, 200, e->object);
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  }

  void stored_input_items(const httplib::Request& hreq, httplib::Response& res) {
    InFlight g(inflight);
    try {
      const std::string id = hreq.matches[1];
      std::optional<ResponsesStore::Entry> e = get_response(id);
      if (!e) throw response_not_found(id);
      send_json(res, 200, input_items_page(*e, hreq.get_param_value("limit"), hreq.get_param_value("order"),
                                           hreq.get_param_value("after")));
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  }

  ApiError response_not_found(const std::string& id) const {
    return ApiError(404,
                    stored_responses.enabled()
                        ? fmt::format("Response with id '{}' not found.", id)
                        : fmt::format("Response with id '{}' not found: this server stores no responses (start "
                                      "areno serve with --responses-store-mb N)",
                                      id),
                    "response_id", "not_found");
  }

  void stream_responses(ApiRequest ar, ResponsesRequest rr, ResponseHeader h, ResponsesOutput out,
                        std::shared_ptr<Pending> pending, std::shared_ptr<InFlight> guard, httplib::Response& res,
                        std::shared_ptr<TrajectoryTurn> turn) {
    struct State {
      explicit State(ResponsesRun r) : run(std::move(r)) {}
      ResponsesRun run;
      ResponsesRequest rr;  // its items to store, its conversation
      bool started = false;
      bool failed = false;
    };
    auto st = std::make_shared<State>(ResponsesRun(std::move(ar), std::move(out)));
    st->run.rs.emplace(h, rr, st->run.out.message_id);
    st->rr = std::move(rr);
    Engine* eng = &engine;
    start_sse(
        res,
        [st, pending, eng, self = this, turn](size_t, httplib::DataSink& sink) {
          auto write = [&](const std::string& s) { return s.empty() || sink.write(s.data(), s.size()); };
          const tok::Tokenizer& t = eng->tokenizer();
          ResponsesRun& run = st->run;
          if (!st->started) {
            st->started = true;
            if (!write(run.rs->start(run.out.temperature, run.out.top_p))) return false;
          }
          const bool all_sent = pump_events(
              *pending, st->failed, write, [&](size_t, const RequestOutput& o) { return write(run.add(o, t)); },
              [&](const ApiError& e) { return run.rs->error(e); });
          if (!all_sent) return false;
          if (turn && !st->failed) {
            try {
              self->record_turn(*turn, run.ar, run.c);
            } catch (const std::exception& e) {
              st->failed = true;
              if (!write(run.rs->error(ApiError(500, e.what())))) return false;
            }
          }
          if (!st->failed) {
            run.finish();
            json& final = run.rs->conclude(run.out, t, run.ar.return_tokens_as_token_ids);
            self->add_to_conversation(st->rr, final["output"]);
            if (st->rr.store) self->store_response(final, st->rr.items);
            st->rr.items = nlohmann::ordered_json();
            if (!write(run.rs->finish())) return false;
          }
          sink.done();
          return true;
        },
        abort_when_gone(pending, guard, eng));
  }

  // ---- helpers -------------------------------------------------------------

  // ---- served LoRAs while serving ----------------------------------------

  // The body's lora_name, checked; 404 when updates are off.
  std::string lora_request(const json& body) const {
    if (draining) throw ApiError(503, "the server is shutting down");
    if (opts.lora_root.empty())
      throw ApiError(404, "loading and unloading LoRA adapters is off on this server (start areno serve with "
                          "--lora-root DIR)", "", "not_found");
    if (!body.contains("lora_name") || !body["lora_name"].is_string())
      throw ApiError(400, "'lora_name' must be a string", "lora_name");
    return body["lora_name"].get<std::string>();
  }

  void load_lora(const httplib::Request& hreq, httplib::Response& res) {
    InFlight g(inflight);
    try {
      const json body = parse_body(hreq);
      const std::string name = lora_request(body);
      if (!valid_lora_name(name))
        throw ApiError(400, "'lora_name' must be 1 to 128 characters of A-Z a-z 0-9 . _ : / -", "lora_name");
      if (name == opts.served_model_name || name == opts.model_path)
        throw ApiError(400, fmt::format("'{}' is the served model's own name", name), "lora_name");
      if (!body.contains("lora_path") || !body["lora_path"].is_string())
        throw ApiError(400, "'lora_path' must be a string", "lora_path");
      const std::string path = body["lora_path"].get<std::string>();
      // Inside the root, symlinks resolved; a missing folder and one outside get the same answer.
      if (!std::filesystem::is_directory(opts.lora_root))
        throw ApiError(500, "the LoRA root of this server is not accessible");
      std::string real;
      try {
        real = phi4mm::resolve_under_root(opts.lora_root, path, "lora_path");
      } catch (const phi4mm::ProcessorError&) {
      }
      if (real.empty() || !std::filesystem::is_directory(real))
        throw ApiError(400, fmt::format("'lora_path': '{}' is not a folder under this server's LoRA root", path),
                       "lora_path");
      try {
        engine.load_lora(name, real, opts.max_loras, path);  // /v1/models shows the path as sent
      } catch (const std::invalid_argument& e) {
        throw ApiError(400, e.what(), "lora_name");
      } catch (const std::length_error& e) {
        throw ApiError(400, e.what(), "lora_name");
      } catch (const std::exception& e) {  // the folder: names the key or tensor, with the server's path cut
        std::string what = e.what();
        for (size_t at; (at = what.find(real)) != std::string::npos;) what.replace(at, real.size(), path);
        throw ApiError(400, fmt::format("the adapter could not be loaded: {}", what), "lora_path");
      }
      forget_resolved(name);
      fmt::print(stderr, "served LoRA '{}' loaded from {}\n", name, real);
      res.status = 200;
      res.set_content(fmt::format("Success: LoRA adapter '{}' added successfully.", name), "text/plain");
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  }

  void unload_lora(const httplib::Request& hreq, httplib::Response& res) {
    InFlight g(inflight);
    try {
      const std::string name = lora_request(parse_body(hreq));
      try {
        engine.unload_lora(name);
      } catch (const std::out_of_range& e) {
        throw ApiError(404, e.what(), "lora_name", "model_not_found");
      } catch (const LoraInUse& e) {
        throw ApiError(409, e.what(), "lora_name");
      } catch (const std::runtime_error& e) {  // the engine is stopping
        throw ApiError(503, e.what());
      }
      forget_resolved(name);
      fmt::print(stderr, "served LoRA '{}' unloaded\n", name);
      res.status = 200;
      res.set_content(fmt::format("Success: LoRA adapter '{}' removed successfully.", name), "text/plain");
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  }

  void tokenize(const httplib::Request& hreq, httplib::Response& res) {
    InFlight g(inflight);
    try {
      const json body = parse_body(hreq);
      if (body.contains("model") && body["model"].is_string()) check_model(body["model"].get<std::string>());
      std::vector<int64_t> ids;
      if (body.contains("messages")) {
        const bool agp = body.value("add_generation_prompt", true);
        const bool cont = body.value("continue_final_message", false);
        if (agp && cont)
          throw ApiError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                         "continue_final_message");
        ids = build_chat(body["messages"], body.value("tools", json()), agp, nullptr, cont,
                         parse_mm_processor_kwargs(body))
                  .ids();
      } else if (body.contains("prompt") && body["prompt"].is_string()) {
        for (tok::TokenId t : engine.tokenizer().encode(body["prompt"].get<std::string>())) ids.push_back(t);
      } else {
        throw ApiError(400, "expected 'prompt' (a string) or 'messages'", "prompt");
      }
      send_json(res, 200, {{"count", ids.size()}, {"max_model_len", context}, {"tokens", ids}});
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const std::exception& e) {
      send_error(res, ApiError(400, e.what()));
    }
  }

  void detokenize(const httplib::Request& hreq, httplib::Response& res) {
    try {
      const json body = parse_body(hreq);
      if (body.contains("model") && body["model"].is_string()) check_model(body["model"].get<std::string>());
      if (!body.contains("tokens") || !body["tokens"].is_array()) throw ApiError(400, "'tokens' must be an array of ids", "tokens");
      std::vector<tok::TokenId> ids;
      for (const json& x : body["tokens"]) {
        if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= opts.api.vocab_size)
          throw ApiError(400, fmt::format("'tokens': {} is not a token id in [0, {})", dump_json(x), opts.api.vocab_size),
                         "tokens");
        ids.push_back(tok::TokenId(x.get<int64_t>()));
      }
      send_json(res, 200, {{"prompt", engine.tokenizer().decode(ids)}});
    } catch (const ApiError& e) {
      send_error(res, e);
    }
  }

  std::string metrics_text() {
    const EngineStats s = engine.stats();
    std::string out;
    auto metric = [&](const char* name, const char* type, const char* help, double v) {
      out += fmt::format("# HELP {0} {1}\n# TYPE {0} {2}\n{0} {3}\n", name, help, type, v);
    };
    metric("areno_requests_total", "counter", "Requests submitted to the engine.", double(s.requests_total));
    metric("areno_requests_finished_total", "counter", "Requests that finished normally.", double(s.requests_finished));
    metric("areno_requests_aborted_total", "counter", "Requests aborted (client gone, shutdown).", double(s.requests_aborted));
    metric("areno_requests_failed_total", "counter", "Requests that failed in the engine.", double(s.requests_failed));
    metric("areno_numerical_faults_total", "counter", "Requests failed for a non-finite logit.",
           double(s.numerical_faults));
    metric("areno_media_items_total", "counter", "Media items encoded at submit (processors + towers).",
           double(s.media_items_total));
    metric("areno_media_seconds_total", "counter", "Seconds spent encoding media at submit.", s.media_seconds_total);
    metric("areno_media_cache_hits_total", "counter", "Media items whose rows came from the media cache.",
           double(s.media_cache_hits));
    metric("areno_prompt_tokens_total", "counter", "Prompt tokens admitted (expanded media included).", double(s.prompt_tokens));
    metric("areno_generation_tokens_total", "counter", "Tokens generated.", double(s.generated_tokens));
    metric("areno_preemptions_total", "counter", "Sequences preempted when the KV cache was full.", double(s.preemptions));
    metric("areno_reprefills_total", "counter", "Sequence caches rebuilt (preemption, LongRoPE switch).", double(s.reprefills));
    metric("areno_requests_running", "gauge", "Sequences in the running batch.", double(s.running));
    metric("areno_requests_waiting", "gauge", "Requests waiting for admission.", double(s.waiting));
    metric("areno_kv_blocks_used", "gauge", "KV cache blocks in use.", double(s.kv_blocks_used));
    metric("areno_kv_blocks_total", "gauge", "KV cache blocks.", double(s.kv_blocks_total));
    metric("areno_kv_blocks_cached", "gauge", "KV blocks remembered for prefix caching (held or evictable).",
           double(s.kv_blocks_cached));
    metric("areno_kv_touched_bytes", "gauge",
           "KV pool bytes written at least once (on the CPU the pool is committed as written).",
           double(s.kv_touched_bytes));
    metric("areno_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           double(s.prefix_cache_queries));
    metric("areno_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (not computed).",
           double(s.prefix_cache_hits));
    metric("areno_spec_draft_tokens_total", "counter", "Draft tokens checked by speculative decoding.",
           double(s.spec_draft_tokens));
    metric("areno_spec_accepted_tokens_total", "counter", "Draft tokens kept (equal to the token decoding picked).",
           double(s.spec_accepted_tokens));
    metric("areno_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use.",
           s.kv_blocks_total ? double(s.kv_blocks_used) / double(s.kv_blocks_total) : 0.0);
    metric("areno_engine_steps_total", "counter", "Engine steps run.", double(s.steps));
    metric("areno_engine_step_seconds_total", "counter", "Seconds spent in engine steps.", s.step_seconds_total);
    metric("areno_engine_last_step_seconds", "gauge", "Duration of the last engine step.", s.last_step_seconds);
    metric("areno_responses_stored", "gauge", "Responses kept for previous_response_id (--responses-store-mb).",
           double(stored_responses.size()));
    metric("areno_responses_stored_bytes", "gauge", "Bytes the stored responses count against --responses-store-mb.",
           double(stored_responses.bytes()));
    metric("areno_http_requests_in_flight", "gauge", "HTTP requests being handled (streams included).", double(inflight.load()));
    metric("areno_served_loras", "gauge", "Served LoRAs loaded (--lora-modules, /v1/load_lora_adapter, --lora-resolve).",
           double(engine.loras().size()));
    metric("areno_lora_resolved_loads_total", "counter", "Served LoRAs loaded on demand (--lora-resolve).",
           double(lora_resolved_loads.load()));
    metric("areno_lora_evictions_total", "counter", "Served LoRAs loaded on demand and unloaded to make room.",
           double(lora_evictions.load()));
    out += "# HELP areno_http_requests_total HTTP requests answered, by route and status.\n"
           "# TYPE areno_http_requests_total counter\n";
    std::lock_guard<std::mutex> lk(metrics_mu);
    for (const auto& [key, count] : http_counts)
      out += fmt::format("areno_http_requests_total{{route=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, count);
    // Per served LoRA (vLLM's lora_requests_info as one gauge per adapter and state).
    out += "# HELP areno_lora_requests Sequences running and requests waiting, by served LoRA.\n"
           "# TYPE areno_lora_requests gauge\n";
    for (const phi4mm::ServedLora& l : engine.loras()) {
      const auto it = s.lora_running_waiting.find(l.number);
      const std::pair<int64_t, int64_t> rw = it == s.lora_running_waiting.end() ? std::pair<int64_t, int64_t>{0, 0}
                                                                                 : it->second;
      out += fmt::format("areno_lora_requests{{adapter=\"{0}\",state=\"running\"}} {1}\n"
                         "areno_lora_requests{{adapter=\"{0}\",state=\"waiting\"}} {2}\n",
                         prometheus_label(l.name), rw.first, rw.second);
    }
    out += "# HELP areno_model_requests_total Generation requests accepted, by the model they named.\n"
           "# TYPE areno_model_requests_total counter\n";
    for (const auto& [model, count] : model_counts)
      out += fmt::format("areno_model_requests_total{{model=\"{}\"}} {}\n", prometheus_label(model), count);
    return out;
  }
};

HttpServer::HttpServer(Engine& engine, ServerOptions opts) : impl_(std::make_unique<Impl>(engine, std::move(opts))) {}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind() { return impl_->bound_port = impl_->listener->bind(); }
void HttpServer::listen() { impl_->listener->run(); }
int HttpServer::port() const { return impl_->bound_port; }
void HttpServer::begin_drain() { impl_->draining = true; }
bool HttpServer::draining() const { return impl_->draining; }
int64_t HttpServer::in_flight() const { return impl_->inflight; }

bool HttpServer::wait_idle(double seconds) const {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (impl_->inflight > 0) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

void HttpServer::stop() {
  if (impl_ && !impl_->stopped.exchange(true)) impl_->listener->stop();
}

bool valid_lora_name(const std::string& name) { return valid_id(name, "._:/-"); }

}  // namespace areno::serve
