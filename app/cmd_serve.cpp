// `areno serve`: the OpenAI-compatible server (serve/http_server.h) on the engine.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include "app/commands_serve.h"
#include "app/flags.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/init.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/engine.h"
#include "serve/http_server.h"
#include "tensor/backend.h"

namespace areno::app {

namespace {

constexpr const char* kServeUsage =
    "usage: areno serve [--model-path DIR] [--host 127.0.0.1] [--port 8000] [options]\n"
    "\n"
    "Serves the model over an OpenAI-compatible HTTP API: POST /v1/chat/completions\n"
    "(streaming with \"stream\": true), POST /v1/completions, POST /v1/responses (OpenAI's\n"
    "Responses API; POST /v1/responses/input_tokens, GET and DELETE /v1/responses/{id},\n"
    "GET /v1/responses/{id}/input_items,\n"
    "POST /v1/responses/{id}/cancel for background responses, whose streams\n"
    "GET /v1/responses/{id}?stream=true&starting_after=N resumes; /v1/conversations and\n"
    "its items, for a response's \"conversation\"),\n"
    "POST /v1/audio/transcriptions and /v1/audio/translations\n"
    "(multipart/form-data, the audio in \"file\"), GET /v1/models and /v1/models/{id},\n"
    "GET /health, GET /metrics (Prometheus), POST /tokenize, POST /detokenize.\n"
    "SIGINT / SIGTERM stop accepting requests, finish the running ones and exit 0.\n"
    "\n"
    "model:\n"
    "  --model-path DIR          checkpoint directory (config.json, safetensors, tokenizer.json);\n"
    "                            without it: the embedded demo model (the tiny preset trained\n"
    "                            on a synthetic set, docs/demo.md), served as \"areno-demo\"\n"
    "  --served-model-name NAME  the `model` clients send and see (default: the model path)\n"
    "  --device cpu|cuda[:N]     where the model runs (default cpu)\n"
    "  --dtype f32|bf16          compute dtype (default: the checkpoint's; demo: f32)\n"
    "  --check-weights           refuse a checkpoint holding NaN or infinite weights, naming\n"
    "                            the tensor (one more pass over the weights at load)\n"
    "  --lora DIR                a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors)\n"
    "                            run on every request beside the vision/speech adapter\n"
    "  --lora-modules NAME=DIR ...\n"
    "                            PEFT LoRA folders, each served as model NAME (vLLM's flag:\n"
    "                            several after one flag, or the flag repeated): a request whose\n"
    "                            \"model\" is NAME adds it, in the same batches as the others;\n"
    "                            GET /v1/models lists them. NAME: 1 to 128 of A-Z a-z 0-9 . _ : / -.\n"
    "                            Also vLLM's JSON form '{\"name\": NAME, \"path\": DIR}'\n"
    "  --lora-root DIR           allow POST /v1/load_lora_adapter {\"lora_name\", \"lora_path\"} and\n"
    "                            /v1/unload_lora_adapter {\"lora_name\"} (vLLM's) while serving, for\n"
    "                            folders under DIR only (default: off, both 404)\n"
    "  --lora-resolve            with --lora-root: a request whose \"model\" names a PEFT folder\n"
    "                            under DIR that is not loaded loads it first (vLLM's filesystem\n"
    "                            LoRA resolver); at --max-loras the least recently used adapter\n"
    "                            loaded this way and not in use is unloaded (429 when all are busy)\n"
    "  --max-loras N             served LoRAs loaded at once, at startup and later (default 16; 0:\n"
    "                            no limit)\n"
    "  --quantize int8           weight-only int8 for the decoder and the tied head, quantized at\n"
    "                            load (per output channel scales, f32 activations, LoRA and towers\n"
    "                            unchanged; CPU only; about half the memory of bf16). Default none\n"
    "  --mm-processor-kwargs JSON\n"
    "                            the image processor's settings (vLLM's flag): '{\"dynamic_hd\": N}',\n"
    "                            at most N HD crops per image, 1 to 64 (default: the checkpoint's\n"
    "                            preprocessor_config.json, 36 when released); fewer crops, fewer\n"
    "                            image tokens and a faster first token, at some detail\n"
    "  --tp-size N, --world-size N  tensor parallelism: only 1 is supported for now\n"
    "  --threads N               compute threads of the engine (default: OMP_NUM_THREADS, else the\n"
    "                            physical cores)\n"
    "engine:\n"
    "  --max-running-prompts N   sequences decoded together (default 16)\n"
    "  --max-batch-tokens N      tokens per engine step, decode + prefill chunks (default 2048)\n"
    "  --prefill-chunk-tokens N  prompt tokens per sequence per step (default 512)\n"
    "  --kv-cache-gb X           KV cache size in GiB (default 1)\n"
    "  --max-queue N             waiting requests before 429 (default 1024)\n"
    "  --seed N                  seed for requests without one (default 0)\n"
    "  --enable-prefix-caching, --no-enable-prefix-caching\n"
    "                            reuse the KV blocks of a prompt start seen before (same tokens,\n"
    "                            media and adapter; SHA-256 digests; default on)\n"
    "  --media-cache-mb X        media rows kept for requests that send the same images and clips\n"
    "                            again (their towers skipped); least recently used out (default\n"
    "                            256; 0: off)\n"
    "  --speculative-tokens N    speculative decoding by prompt lookup (vLLM's ngram method): up to\n"
    "                            N tokens that followed an earlier occurrence of a sequence's last\n"
    "                            tokens are checked in one step; the output is unchanged (default\n"
    "                            0: off)\n"
    "  --prompt-lookup-max N, --prompt-lookup-min N   the suffix lengths looked up, longest\n"
    "                            first (default 4 and 2)\n"
    "requests:\n"
    "  --default-max-tokens N    chat completion budget when the request sets none (default 1024;\n"
    "                            clamped to the context left)\n"
    "  --max-prompt-tokens N     longer prompts get 400 context_length_exceeded (default 0: only\n"
    "                            the context length limits them)\n"
    "  --max-context-len N       prompt + completion limit (default: the model's\n"
    "                            max_position_embeddings)\n"
    "  --max-body-mb X           request bodies above this get 413; every byte counts as received,\n"
    "                            chunk framing included (default 32)\n"
    "  --max-json-depth N        request JSON nested deeper gets 400, checked while parsing\n"
    "                            (default 64)\n"
    "http:\n"
    "  --host ADDR               address to bind (default 127.0.0.1; 0.0.0.0 for all)\n"
    "  --port N                  port (default 8000; 0 picks a free one)\n"
    "  --api-key KEY             require \"Authorization: Bearer KEY\" on every route but /health\n"
    "                            (default: none)\n"
    "  --http-threads N          HTTP worker threads; they run complete requests only (default\n"
    "                            max(64, 2 * max-running-prompts))\n"
    "  --listen-backlog N        connections the kernel queues until accepted (default 1024)\n"
    "  --max-connections N       connections open at once; more wait in the backlog (default 4096)\n"
    "  --header-timeout-s X      request line + headers must arrive within X s of the connection\n"
    "                            (or of the first byte after a keep-alive pause), else 408 (default 10)\n"
    "  --body-timeout-s X        the body must arrive within X s after the headers, else 408\n"
    "                            (default 60)\n"
    "  --keep-alive-timeout-s X  an idle connection is closed X s after its last response (default 5)\n"
    "  --access-log              one line per request on stderr: time, X-Request-Id, peer,\n"
    "                            \"METHOD path\", status, ms taken (a stream's when it ends)\n"
    "                            (default off)\n"
    "  --responses-store-mb X    /v1/responses kept in memory for previous_response_id and GET /\n"
    "                            DELETE /v1/responses/{id} (store: true, OpenAI's default), and\n"
    "                            /v1/conversations, counted as their JSON bytes, media and a\n"
    "                            background stream's events included; the least recently used go\n"
    "                            first; a restart forgets them unless --responses-store-dir (default\n"
    "                            64; 0: nothing is stored)\n"
    "  --responses-store-dir DIR keep them in DIR too (created, mode 0700, when missing): a file per\n"
    "                            response or conversation, written (temp + fsync + rename) as it\n"
    "                            changes and removed as it goes, read back at startup (default: none)\n"
    "media:\n"
    "  --media-root DIR          allow local paths and file:// URLs under DIR (symlinks resolved;\n"
    "                            default: refused)\n"
    "  --allow-remote-media      allow http(s) image/audio URLs (default: refused); the host is\n"
    "                            resolved once and only public addresses are fetched, each\n"
    "                            redirect (at most 3) is checked again, and every failure\n"
    "                            gives the client one text (the reason is logged to stderr)\n"
    "  --allow-private-media     with --allow-remote-media, also fetch from loopback, private,\n"
    "                            link-local, multicast and other non-public addresses (default: refused)\n"
    "  --media-fetch-timeout-s N deadline of one remote fetch, redirects included (default 20)\n"
    "  --max-media-decode-mb X   decoded image/audio bytes in flight across all requests; an\n"
    "                            item is reserved from its header before decoding, a request\n"
    "                            waits up to 10 s for room (then 503), an item larger than the\n"
    "                            whole budget gets 400 (default 2048)\n"
    "  image_url / audio_url (data URLs; paths per the flags above) and input_audio (base64\n"
    "  wav/mp3/flac/ogg) parts run through the checkpoint's towers; a checkpoint without a\n"
    "  tower answers 400 for that modality\n";

std::atomic<int> g_signal{0};
extern "C" void on_stop_signal(int sig) { g_signal = sig; }

}  // namespace

void add_serve_flags(Flags& flags, ServeSetup& s, bool http) {
  serve::ServerOptions& so = s.so;
  serve::EngineOptions& eo = s.eo;
  auto& lora_modules = s.lora_modules;
  s.decode_mb = double(so.max_media_decode_bytes >> 20);
  // A positive number: --kv-cache-gb, --max-body-mb, the HTTP timeouts.
  auto positive_flag = [](const std::string& name, double& dst) {
    return [name, &dst](const std::string& v) {
      dst = parse_double_flag(name, v, 0.0);
      if (dst <= 0) throw std::invalid_argument(name + ": must be > 0");
    };
  };
  flags.value("--model-path", s.model_path).value("--served-model-name", s.served_name);
  flags.value("--device", s.device).value("--dtype", s.dtype);
  flags.toggle("--check-weights", s.needs.check_weights);
  add_model_flags(flags, s.needs);
  flags.value("--mm-processor-kwargs", [&](const std::string& v) {
    const nlohmann::json j = nlohmann::json::parse(v, nullptr, false);
    if (!j.is_object() || j.empty())
      throw std::invalid_argument("--mm-processor-kwargs: expected a JSON object such as '{\"dynamic_hd\": 12}'");
    for (auto it = j.begin(); it != j.end(); ++it)
      if (it.key() != "dynamic_hd")
        throw std::invalid_argument(fmt::format("--mm-processor-kwargs: '{}' is not a setting (dynamic_hd only)", it.key()));
    try {
      s.dynamic_hd = phi4mm::parse_dynamic_hd(j["dynamic_hd"], "--mm-processor-kwargs: dynamic_hd");
    } catch (const std::runtime_error& e) {
      throw std::invalid_argument(e.what());
    }
  });
  flags.values("--lora-modules", [&](const std::string& v) {
    std::string name, dir;
    if (!v.empty() && v[0] == '{') {  // vLLM's JSON form: {"name": ..., "path": ...}
      const nlohmann::json j = nlohmann::json::parse(v, nullptr, false);
      if (!j.is_object() || !j.contains("name") || !j["name"].is_string() || !j.contains("path") ||
          !j["path"].is_string())
        throw std::invalid_argument(fmt::format("--lora-modules: expected {{\"name\": ..., \"path\": ...}}, got '{}'", v));
      name = j["name"].get<std::string>();
      dir = j["path"].get<std::string>();
    } else {
      const size_t eq = v.find('=');
      if (eq == std::string::npos || eq + 1 == v.size())
        throw std::invalid_argument(fmt::format("--lora-modules: expected NAME=DIR, got '{}'", v));
      name = v.substr(0, eq);
      dir = v.substr(eq + 1);
    }
    if (!serve::valid_lora_name(name))
      throw std::invalid_argument(
          fmt::format("--lora-modules: the name '{}' must be 1 to 128 characters of A-Z a-z 0-9 . _ : / -", name));
    for (const auto& nd : lora_modules)
      if (nd.first == name) throw std::invalid_argument(fmt::format("--lora-modules: '{}' is given twice", name));
    lora_modules.emplace_back(name, dir);
  });
  flags.value("--lora-root", [&](const std::string& v) {
    so.lora_root = v;
    if (!std::filesystem::is_directory(so.lora_root))
      throw std::invalid_argument(fmt::format("--lora-root: '{}' is not a directory", so.lora_root));
  });
  flags.value("--max-loras", [&](const std::string& v) { so.max_loras = size_t(parse_int_flag("--max-loras", v, 0)); });
  flags.toggle("--lora-resolve", so.lora_resolve);
  for (const char* name : {"--tp-size", "--world-size"})
    flags.value(name, [name](const std::string& text) {
      const int64_t v = parse_int_flag(name, text, 1);
      if (v != 1)
        throw std::invalid_argument(fmt::format("{} {}: tensor parallelism is not implemented yet; only 1 is supported",
                                                name, v));
    });
  flags.integer("--max-running-prompts", eo.max_running, 1)
      .integer("--max-batch-tokens", eo.max_batch_tokens, 1)
      .integer("--prefill-chunk-tokens", eo.prefill_chunk_tokens, 1);
  flags.value("--kv-cache-gb", positive_flag("--kv-cache-gb", s.kv_gb));
  flags.integer("--max-queue", eo.max_queue, 1).integer("--seed", eo.seed, 0);
  eo.prefix_caching = true;
  flags.toggle("--enable-prefix-caching", eo.prefix_caching).toggle("--no-enable-prefix-caching", eo.prefix_caching, false);
  flags.integer("--speculative-tokens", eo.speculative_tokens, 0)
      .integer("--prompt-lookup-max", eo.prompt_lookup_max, 1)
      .integer("--prompt-lookup-min", eo.prompt_lookup_min, 1);
  flags.value("--media-cache-mb", [&](const std::string& v) {
    s.media_cache_mb = parse_double_flag("--media-cache-mb", v, 0);
    if (s.media_cache_mb > 1e7)
      throw std::invalid_argument(fmt::format("--media-cache-mb: {} must be from 0 to 1e7", v));
  });
  flags.integer("--default-max-tokens", so.api.default_max_tokens, 1)
      .integer("--max-prompt-tokens", so.max_prompt_tokens, 0)
      .integer("--max-context-len", so.max_context_len, 0);
  flags.value("--max-body-mb", positive_flag("--max-body-mb", s.body_mb));
  flags.value("--max-json-depth", [&](const std::string& v) {
    so.max_json_depth = int(parse_int_flag("--max-json-depth", v, 1));
    if (so.max_json_depth > 4096)
      throw std::invalid_argument(fmt::format("--max-json-depth: {} is above 4096, deep enough to crash", v));
  });
  flags.compute_threads();
  flags.value("--media-root", [&](const std::string& v) {
    so.media.media_root = v;
    if (!std::filesystem::is_directory(so.media.media_root))
      throw std::invalid_argument(fmt::format("--media-root: '{}' is not a directory", so.media.media_root));
  });
  flags.toggle("--allow-remote-media", so.media.allow_remote);
  flags.toggle("--allow-private-media", so.media.allow_private);
  flags.value("--media-fetch-timeout-s", [&](const std::string& v) {
    so.media.timeout_seconds = int(parse_int_flag("--media-fetch-timeout-s", v, 1));
    if (so.media.timeout_seconds > 3600)
      throw std::invalid_argument(fmt::format("--media-fetch-timeout-s: {} is above 3600", v));
  });
  flags.value("--max-media-decode-mb", positive_flag("--max-media-decode-mb", s.decode_mb));
  if (!http) return;
  flags.value("--host", so.host);
  flags.value("--port", [&](const std::string& v) {
    so.port = int(parse_int_flag("--port", v, 0));
    if (so.port > 65535) throw std::invalid_argument(fmt::format("--port: {} is not a port number", so.port));
  });
  flags.value("--api-key", [&](const std::string& v) {
    so.api_key = v;
    if (so.api_key.empty()) throw std::invalid_argument("--api-key: the key must not be empty");
  });
  flags.integer("--http-threads", so.threads, 1)
      .integer("--listen-backlog", so.connections.backlog, 1)
      .integer("--max-connections", so.connections.max_connections, 1);
  flags.value("--header-timeout-s", positive_flag("--header-timeout-s", so.connections.header_timeout_s))
      .value("--body-timeout-s", positive_flag("--body-timeout-s", so.connections.body_timeout_s))
      .value("--keep-alive-timeout-s", positive_flag("--keep-alive-timeout-s", so.connections.keep_alive_timeout_s));
  flags.toggle("--access-log", [&] {
    so.access_log = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
  });
  flags.value("--responses-store-mb", [&](const std::string& v) {
    s.responses_store_mb = parse_double_flag("--responses-store-mb", v, 0);
    if (s.responses_store_mb > 1e7)
      throw std::invalid_argument(fmt::format("--responses-store-mb: {} must be from 0 to 1e7", v));
  });
  flags.value("--responses-store-dir", [&](const std::string& v) {
    // Checked before any weight is read: a folder, or one its parent can hold.
    std::error_code ec;
    const std::filesystem::path dir(v);
    if (v.empty() || (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)))
      throw std::invalid_argument(fmt::format("--responses-store-dir: '{}' is not a folder", v));
    const std::filesystem::path parent = dir.has_parent_path() ? dir.parent_path() : std::filesystem::path(".");
    if (!std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(parent, ec))
      throw std::invalid_argument(
          fmt::format("--responses-store-dir: '{}' does not exist and its parent is no folder", v));
    so.responses_store_dir = v;
  });
}

void finish_serve_flags(ServeSetup& s) {
  serve::ServerOptions& so = s.so;
  serve::EngineOptions& eo = s.eo;
  if (eo.prompt_lookup_min > eo.prompt_lookup_max)
    throw std::invalid_argument(fmt::format("--prompt-lookup-min {} exceeds --prompt-lookup-max {}",
                                            eo.prompt_lookup_min, eo.prompt_lookup_max));
  eo.kv_cache_bytes = size_t(s.kv_gb * double(size_t(1) << 30));
  eo.media_cache_bytes = size_t(s.media_cache_mb * double(size_t(1) << 20));
  so.max_body_bytes = size_t(s.body_mb * double(size_t(1) << 20));
  so.max_media_decode_bytes = size_t(s.decode_mb * double(size_t(1) << 20));
  so.responses_store_bytes = size_t(s.responses_store_mb * double(size_t(1) << 20));
  if (!so.responses_store_dir.empty() && so.responses_store_bytes == 0)
    throw std::invalid_argument("--responses-store-dir: needs a store (--responses-store-mb above 0)");
  if (so.media.allow_private && !so.media.allow_remote)
    throw std::invalid_argument("--allow-private-media: needs --allow-remote-media");
  if (so.lora_resolve && so.lora_root.empty())
    throw std::invalid_argument("--lora-resolve: needs --lora-root (the folder adapters are loaded from)");
}

ServedModel load_for_serving(ServeSetup& s, const char* command) {
  serve::ServerOptions& so = s.so;
  ServedModel m = load_served_model(s.model_path, s.device, s.dtype, s.needs);
  if (m.demo)
    fmt::print("areno {}: no --model-path; serving the embedded demo model \"areno-demo\" (a tiny model trained "
               "on a synthetic set: it answers small sums, the colour or shape of a drawn shape, beep or noise, "
               "loud or quiet; docs/demo.md)\n",
               command);
  so.served_model_name = s.served_name.empty() ? m.name : s.served_name;
  so.model_path = s.model_path;
  if (so.max_loras > 0 && s.lora_modules.size() > so.max_loras)
    throw std::invalid_argument(fmt::format("--lora-modules: {} adapters, above --max-loras {}", s.lora_modules.size(),
                                            so.max_loras));
  for (const auto& [name, dir] : s.lora_modules) {
    if (name == so.served_model_name || name == s.model_path)
      throw std::invalid_argument(fmt::format("--lora-modules: '{}' is the served model's own name", name));
    phi4mm::load_served_lora(*m.model, name, dir);
    const phi4mm::LoraConfig& c = m.model->served_loras().back().cfg;
    fmt::print(stderr, "served LoRA '{}' from {}: rank {}, scaling {}, on {}\n", name, dir, c.r, c.scaling(),
               fmt::join(c.targets, ","));
  }
  if (s.dynamic_hd) m.model->set_dynamic_hd(*s.dynamic_hd);
  s.eo.eos_token_ids = m.model->config().generation.eos_token_ids;
  return m;
}

int cmd_serve(const Args& args) {
  ServeSetup setup;
  Flags flags("serve", kServeUsage);
  add_serve_flags(flags, setup, /*http=*/true);
  if (auto rc = flags.parse(args)) return *rc;
  finish_serve_flags(setup);
  ServedModel m = load_for_serving(setup, "serve");
  const serve::ServerOptions& so = setup.so;
  serve::Engine engine(m.model, m.tokenizer, setup.eo);
  serve::HttpServer server(engine, so);
  const int port = server.bind();

  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  release_cpu_threads();  // the load's workers; this thread runs no more ops
  engine.start();
  std::atomic<bool> listening{true};
  std::thread listener([&] {
    server.listen();
    listening = false;
  });
  fmt::print("areno serve: {} on http://{}:{} (OpenAI API at /v1; Ctrl-C to stop)\n", so.served_model_name, so.host,
             port);
  std::fflush(stdout);
  while (g_signal == 0 && listening) std::this_thread::sleep_for(std::chrono::milliseconds(100));

  std::signal(SIGINT, SIG_DFL);  // a second Ctrl-C kills
  std::signal(SIGTERM, SIG_DFL);
  fmt::print("areno serve: {}; draining {} request(s)\n", g_signal ? "signal received" : "listener stopped",
             server.in_flight());
  std::fflush(stdout);
  server.begin_drain();
  engine.stop(/*drain=*/true);
  if (!server.wait_idle(30)) fmt::print(stderr, "areno serve: {} request(s) still open after 30 s\n", server.in_flight());
  server.stop();
  listener.join();
  const serve::EngineStats s = engine.stats();
  fmt::print("areno serve: stopped ({} requests, {} generated tokens)\n", s.requests_total, s.generated_tokens);
  return 0;
}

}  // namespace areno::app
