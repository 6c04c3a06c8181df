#pragma once
// For the serve tests: one `areno serve` HTTP server on a loopback port,
// listening on its own thread, and the demo tokenizer.
#include <memory>
#include <thread>

#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/http_server.h"

namespace areno::serve {

// The demo tokenizer, padded to `model`'s vocabulary.
inline std::shared_ptr<const tok::Tokenizer> tokenizer_for(const phi4mm::Phi4MMForCausalLM& model) {
  auto t = phi4mm::make_tokenizer();
  t.set_padded_vocab_size(size_t(model.config().text.vocab_size));
  return std::make_shared<const tok::Tokenizer>(std::move(t));
}

struct Served {
  std::unique_ptr<HttpServer> server;
  std::thread thread;
  int port = 0;
  Served(Engine& e, ServerOptions o) {
    o.host = "127.0.0.1";
    o.port = 0;
    o.threads = 16;
    server = std::make_unique<HttpServer>(e, std::move(o));
    port = server->bind();
    thread = std::thread([this] { server->listen(); });
  }
  ~Served() {
    server->stop();
    thread.join();
  }
};

}  // namespace areno::serve
