#pragma once
// The OpenAI-compatible HTTP front end of `areno serve` (issue 7), on
// cpp-httplib:
//
//   POST /v1/chat/completions   chat, non-streaming or SSE (`stream: true`)
//   POST /v1/completions        text / token-id prompts, echo + logprobs scoring
//   GET  /v1/models             the served model and its served LoRAs
//   POST /v1/load_lora_adapter, /v1/unload_lora_adapter  (with a lora_root; below)
//   GET  /health                200 {"status":"ok"}; 503 while draining
//   GET  /metrics               Prometheus text from Engine::stats()
//   GET  /version
//   POST /tokenize, /detokenize vLLM-style helpers
//   POST /v1/responses          OpenAI's Responses API (serve/responses.h); with a store,
//   GET, DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items,
//   POST /v1/responses/{id}/cancel (background responses)
//
// Every error carries OpenAI's body {"error": {"message", "type", "param",
// "code"}}: 400 bad JSON / fields / media / prompt too long (code
// "context_length_exceeded", as OpenAI and vLLM; found from the media headers
// before anything is decoded), 401 bad bearer token, 404 unknown model or
// route, 408 headers or body too slow, 413 body over --max-body-mb, 431
// headers too large, 429 engine queue full, 503 draining or the media decode
// budget full. A streaming client that disconnects aborts its request in the
// engine, which frees its KV blocks. Connections are read by
// serve/http_listener.h: workers only see complete requests.
//
// A request's "model" is the served model's name (or its path, or absent) or
// the name of one of the model's served LoRAs (phi4mm::ServedLora, `areno
// serve --lora-modules NAME=DIR`, vLLM's): that request's sequences add the
// adapter, in the same batches as every other request, and its responses
// carry that name. Anything else is a 404 naming what the server serves.
// With ServerOptions::lora_root, {"lora_name", "lora_path"} to
// /v1/load_lora_adapter loads one more (200 and a line of text, as vLLM; 400
// for a bad name, a taken one, a path outside the root, a bad folder or one
// past max_loras) and {"lora_name"} to /v1/unload_lora_adapter unloads one
// (404 unknown, 409 while a request uses it). Without a root both are 404.
//
// Every response carries `X-Request-Id`: the client's own when it sent a
// valid one (1 to 128 of [A-Za-z0-9._:-]), else "req-" and 32 random hex
// digits; the lines the server logs for a request name it
// (serve/request_context.h), so an operator finds a client's failure.
//
// Trajectory recording (the trainer's agentic rollouts, docs/rl.md "Agentic
// rollouts"): with ServerOptions::recorder set, a generation request carrying
// the header `X-Areno-Trajectory: ID` is recorded when it finishes: the
// recorder receives one TrajectoryTurn (the prompt ids as the engine saw them,
// the sampled ids with their log-probabilities, the finish reason, the parsed
// tool calls). Such a request must have n = 1 and one prompt; the ID is 1 to
// 128 characters of [A-Za-z0-9._:-]. Requests without the header are served
// and not recorded. serve/ knows nothing of what the recorder does with it.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "serve/engine.h"
#include "models/phi4mm/processor/media.h"
#include "serve/http_listener.h"
#include "serve/media_fetch.h"
#include "serve/openai.h"

namespace areno::serve {

inline constexpr const char* kTrajectoryHeader = "X-Areno-Trajectory";
inline constexpr const char* kRequestIdHeader = "X-Request-Id";

// One finished generation request of a trajectory.
struct TrajectoryTurn {
  std::string trajectory;               // the X-Areno-Trajectory value
  ApiKind kind = ApiKind::chat;
  std::vector<int64_t> prompt;          // expanded prompt ids, exactly as the engine prefilled them
  std::vector<phi4mm::Media> media;     // the prompt's media, in order of appearance
  phi4mm::Adapter adapter = phi4mm::Adapter::none;
  std::vector<int64_t> completion;      // sampled ids (a stop token included)
  std::vector<float> logprobs;          // of `completion`, raw distribution
  FinishReason finish = FinishReason::none;
  std::string text;                     // the completion text (special tokens skipped as requested)
  nlohmann::json tool_calls = nlohmann::json::array();  // parsed (chat with tools), else empty
};

// Receives the turns of requests that name a trajectory. record() runs on an
// HTTP worker thread (several at once) before the response is sent; it must
// be thread-safe. A throw becomes a 500 for that request.
class TrajectoryRecorder {
 public:
  virtual ~TrajectoryRecorder() = default;
  virtual void record(TrajectoryTurn turn) = 0;
};

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                  // 0: any free port (see HttpServer::port())
  std::string served_model_name = "areno-demo";
  std::string model_path;           // also accepted as `model`; reported as `root`
  std::string api_key;              // non-empty: every route but /health needs "Authorization: Bearer <key>"
  size_t max_body_bytes = size_t(32) << 20;  // every body byte as received, chunk framing included
  int max_json_depth = kDefaultMaxJsonDepth;  // arrays/objects nested deeper get 400 while parsing
  int64_t max_prompt_tokens = 0;    // 0: only the context length limits prompts
  int64_t max_context_len = 0;      // 0: the engine's (the model's max_position_embeddings)
  size_t threads = 0;               // HTTP worker threads; 0: max(64, 2 * engine max_running)
  ConnectionLimits connections;     // backlog, deadlines, keep-alive (serve/http_listener.h)
  ApiLimits api;
  MediaFetchOptions media;
  phi4mm::MediaLimits media_limits;
  // Decoded media bytes in flight across all requests (--max-media-decode-mb);
  // a request waits up to media_decode_wait_ms for room, then gets 503.
  size_t max_media_decode_bytes = size_t(2048) << 20;
  int64_t media_decode_wait_ms = 10000;
  // Records the requests that carry X-Areno-Trajectory (see the top); null: the header is ignored.
  std::shared_ptr<TrajectoryRecorder> recorder;
  // Served LoRAs loaded and unloaded while serving (POST /v1/load_lora_adapter
  // and /v1/unload_lora_adapter, vLLM's): on only with a root, and every
  // lora_path must resolve inside it (relative paths against it, symlinks
  // resolved). At most max_loras loaded at once (0: no limit).
  std::string lora_root;
  size_t max_loras = 16;
  // With lora_root (--lora-resolve, vLLM's filesystem LoRA resolver): a
  // request whose `model` is no loaded adapter but names a PEFT folder under
  // the root (the name as a relative path) loads it first. When max_loras
  // are loaded, the least recently used adapter loaded this way and not in
  // use is unloaded to make room (429 when every one is in use); adapters
  // loaded at startup or through /v1/load_lora_adapter stay.
  bool lora_resolve = false;
  // Finished /v1/responses requests kept for previous_response_id and GET /
  // DELETE /v1/responses/{id} (serve/responses.h ResponsesStore), in bytes of
  // their JSON; the least recently used go first. 0: nothing is stored.
  size_t responses_store_bytes = size_t(64) << 20;
  // A folder that keeps the stored responses and conversations across
  // restarts (ResponsesStore's folder): read back when the server starts,
  // each entry a file written as it changes. "": memory only.
  std::string responses_store_dir;
  // One line per HTTP request after its handler (`--access-log`): time,
  // request id, peer, method, path, status, milliseconds taken; a stream's
  // line when it ends (from a worker thread), with its headers' time too.
  // Null: no access log.
  std::function<void(const std::string& line)> access_log;
};

// A served LoRA's name (`--lora-modules NAME=DIR`, `lora_name`): 1 to 128
// characters of A-Z a-z 0-9 . _ : / -.
bool valid_lora_name(const std::string& name);

class HttpServer {
 public:
  // Media parts are accepted for the modalities whose towers the engine's
  // model has (others are refused with 400).
  HttpServer(Engine& engine, ServerOptions opts);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the listening socket; returns the port. Throws with the address on failure.
  int bind();
  // Serves until stop() (blocking). bind() first.
  void listen();
  int port() const;

  // Draining: /health answers 503 and new API requests get 503; requests in
  // flight continue.
  void begin_drain();
  bool draining() const;
  // Requests being handled (streams included).
  int64_t in_flight() const;
  // Waits until no request is in flight or `seconds` pass; true when idle.
  bool wait_idle(double seconds) const;
  // Stops listening and joins the worker threads. Idempotent.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace areno::serve
