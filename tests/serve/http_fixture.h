#pragma once
// What the HTTP tests share: an `areno serve` server on a free loopback port,
// serving from its own thread.
#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/http_server.h"

namespace areno::serve {

// Polls `cond` every 20 ms until it holds (true) or `seconds` pass (false).
inline bool wait_for(const std::function<bool()>& cond, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// The demo tokenizer, padded to `model`'s vocabulary.
inline std::shared_ptr<const tok::Tokenizer> tokenizer_for(const phi4mm::Phi4MMForCausalLM& model) {
  return phi4mm::padded_tokenizer(phi4mm::make_tokenizer(), model.config().text.vocab_size);
}

struct Served {
  std::unique_ptr<HttpServer> server;
  std::thread thread;
  int port = 0;
  // `start` false: bound and listening (the kernel queues connections) but
  // nothing accepted until start().
  Served(Engine& e, ServerOptions o, bool start_now = true) {
    o.host = "127.0.0.1";
    o.port = 0;
    o.threads = 16;
    server = std::make_unique<HttpServer>(e, std::move(o));
    port = server->bind();
    if (start_now) start();
  }
  void start() {
    thread = std::thread([this] { server->listen(); });
  }
  ~Served() {
    server->stop();
    if (thread.joinable()) thread.join();
  }
};

}  // namespace areno::serve
