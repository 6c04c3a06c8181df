// `areno serve`: the OpenAI-compatible server (serve/http_server.h) on the engine.
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include "app/commands_serve.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/init.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/engine.h"
#include "serve/http_server.h"

namespace areno::app {

namespace {

constexpr const char* kServeUsage =
    "usage: areno serve [--model-path DIR] [--host 127.0.0.1] [--port 8000] [options]\n"
    "\n"
    "Serves the model over an OpenAI-compatible HTTP API: POST /v1/chat/completions\n"
    "(streaming with \"stream\": true), POST /v1/completions, GET /v1/models,\n"
    "GET /health, GET /metrics (Prometheus), POST /tokenize, POST /detokenize.\n"
    "SIGINT / SIGTERM stop accepting requests, finish the running ones and exit 0.\n"
    "\n"
    "model:\n"
    "  --model-path DIR          checkpoint directory (config.json, safetensors, tokenizer.json);\n"
    "                            without it: the embedded demo model (tiny preset, random\n"
    "                            weights, seed 0), served as \"areno-demo\"\n"
    "  --served-model-name NAME  the `model` clients send and see (default: the model path)\n"
    "  --device cpu|cuda[:N]     where the model runs (default cpu)\n"
    "  --dtype f32|bf16          compute dtype (default: the checkpoint's; demo: f32)\n"
    "  --tp-size N, --world-size N  tensor parallelism: only 1 is supported for now\n"
    "engine:\n"
    "  --max-running-prompts N   sequences decoded together (default 16)\n"
    "  --max-batch-tokens N      tokens per engine step, decode + prefill chunks (default 2048)\n"
    "  --prefill-chunk-tokens N  prompt tokens per sequence per step (default 512)\n"
    "  --kv-cache-gb X           KV cache size in GiB (default 1)\n"
    "  --max-queue N             waiting requests before 429 (default 1024)\n"
    "  --seed N                  seed for requests without one (default 0)\n"
    "requests:\n"
    "  --default-max-tokens N    chat completion budget when the request sets none (default 1024;\n"
    "                            clamped to the context left)\n"
    "  --max-prompt-tokens N     longer prompts get 400 context_length_exceeded (default 0: only\n"
    "                            the context length limits them)\n"
    "  --max-context-len N       prompt + completion limit (default: the model's\n"
    "                            max_position_embeddings)\n"
    "  --max-body-mb X           request bodies above this get 413 (default 32)\n"
    "http:\n"
    "  --host ADDR               address to bind (default 127.0.0.1; 0.0.0.0 for all)\n"
    "  --port N                  port (default 8000; 0 picks a free one)\n"
    "  --api-key KEY             require \"Authorization: Bearer KEY\" on /v1/* (default: none)\n"
    "  --threads N               HTTP worker threads (default max(64, 2 * max-running-prompts))\n"
    "media:\n"
    "  --media-root DIR          allow local paths and file:// URLs under DIR (symlinks resolved;\n"
    "                            default: refused)\n"
    "  --allow-remote-media      allow http(s) image/audio URLs (default: refused)\n"
    "  image_url / audio_url (data URLs; paths per the flags above) and input_audio (base64\n"
    "  wav/mp3/flac/ogg) parts run through the checkpoint's towers; a checkpoint without a\n"
    "  tower answers 400 for that modality\n";

std::atomic<int> g_signal{0};
extern "C" void on_stop_signal(int sig) { g_signal = sig; }

}  // namespace

int64_t parse_int_flag(const std::string& flag, const std::string& value, int64_t min_value) {
  try {
    size_t used = 0;
    const long long v = std::stoll(value, &used);
    if (used == value.size() && v >= min_value) return v;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(fmt::format("{}: expected an integer >= {}, got '{}'", flag, min_value, value));
}

double parse_double_flag(const std::string& flag, const std::string& value, double min_value) {
  try {
    size_t used = 0;
    const double v = std::stod(value, &used);
    if (used == value.size() && v >= min_value && std::isfinite(v)) return v;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(fmt::format("{}: expected a number >= {}, got '{}'", flag, min_value, value));
}

ServedModel load_served_model(const std::string& model_path, const std::string& device, const std::string& dtype) {
  if (!dtype.empty() && dtype != "f32" && dtype != "bf16")
    throw std::invalid_argument(fmt::format("--dtype: expected f32 or bf16, got '{}'", dtype));
  Device dev;
  try {
    dev = Device::parse(device);
  } catch (const std::exception& e) {
    throw std::invalid_argument(fmt::format("--device: expected cpu or cuda[:N], got '{}' ({})", device, e.what()));
  }
  ServedModel m;
  if (model_path.empty()) {
    m.mm = phi4mm::init_phi4mm("tiny", 0, dtype == "bf16" ? DType::bf16 : DType::f32);
    if (!dev.is_cpu()) {
      m.mm->lm->to(dev);
      m.mm->vision->to(dev);
      m.mm->audio->to(dev);
    }
    m.model = m.mm->lm;
    m.encoder = serve::make_media_encoder(m.mm);
    auto t = phi4mm::make_tokenizer();
    t.set_padded_vocab_size(size_t(m.model->config().text.vocab_size));
    m.tokenizer = std::make_shared<const tok::Tokenizer>(std::move(t));
    m.name = "areno-demo";
    m.demo = true;
    return m;
  }
  phi4mm::ModelLoadOptions lo;
  if (!dtype.empty()) lo.dtype = dtype == "f32" ? DType::f32 : DType::bf16;
  lo.device = dev;
  phi4mm::LoadReport report;
  m.mm = phi4mm::load_phi4mm(model_path, lo, &report);
  m.model = m.mm->lm;
  m.encoder = serve::make_media_encoder(m.mm);
  fmt::print(stderr, "{}: vision tower {}, audio encoder {}\n", model_path, m.mm->vision ? "loaded" : "absent",
             m.mm->audio ? "loaded" : "absent");
  fmt::print(stderr, "loaded {}: {}\n", model_path, report.summary());
  auto t = phi4mm::load_tokenizer(model_path);
  t.set_padded_vocab_size(size_t(m.model->config().text.vocab_size));
  m.tokenizer = std::make_shared<const tok::Tokenizer>(std::move(t));
  m.name = model_path;
  return m;
}

int cmd_serve(const Args& args) {
  std::string model_path, served_name, device = "cpu", dtype;
  serve::ServerOptions so;
  serve::EngineOptions eo;
  double kv_gb = 1.0, body_mb = 32;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw std::invalid_argument(a + " needs a value");
      return args[++i];
    };
    if (a == "--help" || a == "-h") {
      fmt::print("{}", kServeUsage);
      return 0;
    } else if (a == "--model-path") {
      model_path = value();
    } else if (a == "--served-model-name") {
      served_name = value();
    } else if (a == "--host") {
      so.host = value();
    } else if (a == "--port") {
      so.port = int(parse_int_flag(a, value(), 0));
      if (so.port > 65535) throw std::invalid_argument(fmt::format("--port: {} is not a port number", so.port));
    } else if (a == "--device") {
      device = value();
    } else if (a == "--dtype") {
      dtype = value();
    } else if (a == "--tp-size" || a == "--world-size") {
      const int64_t v = parse_int_flag(a, value(), 1);
      if (v != 1)
        throw std::invalid_argument(fmt::format("{} {}: tensor parallelism is not implemented yet; only 1 is supported",
                                                a, v));
    } else if (a == "--max-running-prompts") {
      eo.max_running = parse_int_flag(a, value(), 1);
    } else if (a == "--max-batch-tokens") {
      eo.max_batch_tokens = parse_int_flag(a, value(), 1);
    } else if (a == "--prefill-chunk-tokens") {
      eo.prefill_chunk_tokens = parse_int_flag(a, value(), 1);
    } else if (a == "--kv-cache-gb") {
      kv_gb = parse_double_flag(a, value(), 0.0);
      if (kv_gb <= 0) throw std::invalid_argument("--kv-cache-gb: must be > 0");
    } else if (a == "--max-queue") {
      eo.max_queue = parse_int_flag(a, value(), 1);
    } else if (a == "--seed") {
      eo.seed = uint64_t(parse_int_flag(a, value(), 0));
    } else if (a == "--default-max-tokens") {
      so.api.default_max_tokens = parse_int_flag(a, value(), 1);
    } else if (a == "--max-prompt-tokens") {
      so.max_prompt_tokens = parse_int_flag(a, value(), 0);
    } else if (a == "--max-context-len") {
      so.max_context_len = parse_int_flag(a, value(), 0);
    } else if (a == "--max-body-mb") {
      body_mb = parse_double_flag(a, value(), 0.0);
      if (body_mb <= 0) throw std::invalid_argument("--max-body-mb: must be > 0");
    } else if (a == "--api-key") {
      so.api_key = value();
      if (so.api_key.empty()) throw std::invalid_argument("--api-key: the key must not be empty");
    } else if (a == "--threads") {
      so.threads = size_t(parse_int_flag(a, value(), 1));
    } else if (a == "--media-root") {
      so.media.media_root = value();
      if (!std::filesystem::is_directory(so.media.media_root))
        throw std::invalid_argument(fmt::format("--media-root: '{}' is not a directory", so.media.media_root));
    } else if (a == "--allow-remote-media") {
      so.media.allow_remote = true;
    } else {
      fmt::print(stderr, "areno serve: unknown option '{}'\n\n{}", a, kServeUsage);
      return 2;
    }
  }
  eo.kv_cache_bytes = size_t(kv_gb * double(size_t(1) << 30));
  so.max_body_bytes = size_t(body_mb * double(size_t(1) << 20));

  ServedModel m = load_served_model(model_path, device, dtype);
  if (m.demo)
    fmt::print("areno serve: no --model-path; serving the embedded demo model \"areno-demo\" (tiny preset, random "
               "weights: it answers, but with nonsense)\n");
  so.served_model_name = served_name.empty() ? m.name : served_name;
  so.model_path = model_path;
  eo.eos_token_ids = m.model->config().generation.eos_token_ids;

  serve::Engine engine(m.model, m.tokenizer, eo);
  serve::HttpServer server(engine, m.encoder.get(), so);
  const int port = server.bind();

  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
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
