#pragma once
// What the HTTP tests share: an `areno serve` server on a free loopback port,
// serving from its own thread.
#include <memory>
#include <thread>
#include <utility>

#include "serve/http_server.h"

namespace areno::serve {

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
