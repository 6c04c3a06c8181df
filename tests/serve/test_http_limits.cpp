// The HTTP transport under hostile clients (issue 13, classes 2-4): bodies
// over the limit however framed, slow and idle connections, deadlines, the
// listen backlog, and the API key on every route but /health. Raw sockets on
// loopback ports against the embedded tiny demo model.
#include <doctest/doctest.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "models/phi4mm/init.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/engine.h"
#include "serve/http_server.h"
#include "tests/serve/http_fixture.h"

using namespace areno;
using namespace areno::serve;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The tiny demo model behind a running engine, shared by the cases here.
Engine& engine() {
  static struct Running {
    std::unique_ptr<Engine> engine;
    Running() {
      std::signal(SIGPIPE, SIG_IGN);
      auto model = phi4mm::init_model("tiny", 0);
      EngineOptions eo;
      eo.max_running = 4;
      eo.kv_blocks = 128;
      engine = std::make_unique<Engine>(model, tokenizer_for(*model), eo);
      engine->start();
    }
    ~Running() { engine->stop(false); }
  } running;
  return *running.engine;
}

int connect_to(int port, bool nonblocking = false) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | (nonblocking ? SOCK_NONBLOCK : 0), 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  REQUIRE((rc == 0 || (nonblocking && errno == EINPROGRESS)));
  return fd;
}

void send_all(int fd, const std::string& data) {
  REQUIRE(::send(fd, data.data(), data.size(), MSG_NOSIGNAL) == ssize_t(data.size()));
}

struct RawReply {
  int status = 0;  // 0: no complete response in time
  std::string head;
  std::string body;
  double seconds = 0;  // until the response was complete
};

// Reads one HTTP/1.1 response with a Content-Length, waiting at most `timeout`
// seconds; a "100 Continue" interim response is skipped. `pending` keeps bytes
// read past the response (pipelining).
RawReply read_reply(int fd, double timeout, std::string* pending = nullptr) {
  const auto start = Clock::now();
  std::string got = pending ? std::move(*pending) : std::string();
  RawReply r;
  while (true) {
    if (got.rfind("HTTP/1.1 100", 0) == 0 && got.find("\r\n\r\n") != std::string::npos)
      got.erase(0, got.find("\r\n\r\n") + 4);
    const size_t end = got.find("\r\n\r\n");
    if (end != std::string::npos && got.rfind("HTTP/1.1 100", 0) != 0) {
      r.head = got.substr(0, end);
      const size_t cl = r.head.find("Content-Length: ");
      const size_t length = cl == std::string::npos ? 0 : std::stoul(r.head.substr(cl + 16));
      if (got.size() >= end + 4 + length) {
        r.status = std::stoi(r.head.substr(9, 3));
        r.body = got.substr(end + 4, length);
        if (pending) *pending = got.substr(end + 4 + length);
        r.seconds = seconds_since(start);
        return r;
      }
    }
    const int left_ms = int((timeout - seconds_since(start)) * 1000);
    pollfd p{fd, POLLIN, 0};
    if (left_ms <= 0 || ::poll(&p, 1, left_ms) <= 0) return r;
    char buf[65536];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return r;
    got.append(buf, size_t(n));
  }
}

// True when the server closes the connection (EOF or reset) within `timeout` s,
// discarding anything it still sends.
bool closed_within(int fd, double timeout) {
  const auto start = Clock::now();
  while (seconds_since(start) < timeout) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char buf[4096];
    if (::recv(fd, buf, sizeof buf, 0) <= 0) return true;
  }
  return false;
}

void check_openai_error(const RawReply& r, int status, const std::string& message_part) {
  CAPTURE(r.head);
  CAPTURE(r.body);
  CHECK(r.status == status);
  const json body = json::parse(r.body, nullptr, false);
  REQUIRE(body.is_object());
  REQUIRE(body.contains("error"));
  CHECK(body["error"]["message"].get<std::string>().find(message_part) != std::string::npos);
  CHECK(body["error"]["type"] == "invalid_request_error");
}

std::string chunk(const std::string& data) {
  char size[32];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  return size + data + "\r\n";
}

const std::string kTokenizeBody = R"({"prompt": "hello world"})";

std::string tokenize_request(const std::string& extra_headers = "") {
  return "POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" + extra_headers +
         "Content-Length: " + std::to_string(kTokenizeBody.size()) + "\r\n\r\n" + kTokenizeBody;
}

void check_tokenized(const RawReply& r) {
  CAPTURE(r.body);
  REQUIRE(r.status == 200);
  CHECK(json::parse(r.body)["tokens"] == json::array({24912, 2375}));
}

}  // namespace

TEST_CASE("serve/http limits: a chunked body over --max-body-mb gets 413 before it ends, then the connection closes") {
  ServerOptions so;
  so.max_body_bytes = size_t(1) << 20;
  Served s(engine(), so);

  // 2 MiB in 64 KiB chunks, and no last chunk: a server that buffers the body
  // until it ends never answers.
  const int fd = connect_to(s.port);
  send_all(fd, "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               "Transfer-Encoding: chunked\r\n\r\n");
  const std::string piece = chunk(std::string(size_t(64) << 10, ' '));
  for (int i = 0; i < 32; ++i) send_all(fd, piece);
  const RawReply r = read_reply(fd, 5);
  check_openai_error(r, 413, "limit of 1048576 bytes (--max-body-mb)");
  CHECK(r.head.find("Connection: close") != std::string::npos);
  CHECK(closed_within(fd, 1));  // the answer, then end of stream
  // The server stops reading soon after: a client that goes on sending is cut off.
  const auto start = Clock::now();
  bool cut = false;
  while (!cut && seconds_since(start) < 5) cut = ::send(fd, piece.data(), piece.size(), MSG_NOSIGNAL) < 0;
  CHECK(cut);
  ::close(fd);

  // Chunk framing counts too: 1-byte chunks of a body whose decoded size is
  // under the limit but whose framing is not.
  const int fd2 = connect_to(s.port);
  std::string tiny_chunks;
  for (int i = 0; i < 200000; ++i) tiny_chunks += "1\r\n \r\n";  // 6 bytes per byte
  send_all(fd2, "POST /tokenize HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + tiny_chunks);
  check_openai_error(read_reply(fd2, 5), 413, "--max-body-mb");
  ::close(fd2);

  // A Content-Length over the limit is refused before any body byte is sent.
  const int fd3 = connect_to(s.port);
  send_all(fd3, "POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Length: 2097152\r\n\r\n");
  check_openai_error(read_reply(fd3, 5), 413, "--max-body-mb");
  ::close(fd3);

  // Within the limit, chunked bodies are decoded (trailers dropped), a client
  // waiting for "100 Continue" gets it, and pipelined requests on one
  // connection are each answered in order.
  const int fd4 = connect_to(s.port);
  send_all(fd4, "POST /tokenize HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" +
                    chunk(kTokenizeBody.substr(0, 7)) + chunk(kTokenizeBody.substr(7)) + "0\r\nX-Trailer: 1\r\n\r\n" +
                    tokenize_request());
  std::string pending;
  check_tokenized(read_reply(fd4, 5, &pending));
  check_tokenized(read_reply(fd4, 5, &pending));
  send_all(fd4, "POST /tokenize HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: " +
                    std::to_string(kTokenizeBody.size()) + "\r\n\r\n");
  std::string cont;
  char buf[256];
  pollfd p{fd4, POLLIN, 0};
  REQUIRE(::poll(&p, 1, 2000) == 1);
  const ssize_t n = ::recv(fd4, buf, sizeof buf, 0);
  REQUIRE(n > 0);
  cont.assign(buf, size_t(n));
  CHECK(cont.rfind("HTTP/1.1 100 Continue\r\n\r\n", 0) == 0);
  send_all(fd4, kTokenizeBody);
  check_tokenized(read_reply(fd4, 5));
  ::close(fd4);

  // Framing that could smuggle a second request is refused.
  const int fd5 = connect_to(s.port);
  send_all(fd5, "POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n");
  check_openai_error(read_reply(fd5, 5), 400, "Transfer-Encoding");
  ::close(fd5);

  httplib::Client cli("127.0.0.1", s.port);
  auto health = cli.Get("/health");
  REQUIRE(health);
  CHECK(health->status == 200);
  auto metrics = cli.Get("/metrics");
  REQUIRE(metrics);
  CHECK(metrics->body.find("areno_http_requests_total{route=\"other\",status=\"413\"} 3") != std::string::npos);
}

TEST_CASE("serve/http limits: 100 clients dripping headers do not hold the workers; /health answers in under 1 s") {
  Served s(engine(), ServerOptions{});  // 16 workers (the fixture)
  // One byte per connection every 0.5 s: never a whole head in this test.
  struct Drippers {
    std::vector<int> fds;
    std::atomic<bool> on{true};
    std::thread thread;
    Drippers(int port) {
      for (int i = 0; i < 100; ++i) fds.push_back(connect_to(port));
      thread = std::thread([this] {
        const std::string partial = "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n";
        for (size_t k = 0; on && k < partial.size(); ++k) {
          for (int fd : fds) ::send(fd, &partial[k], 1, MSG_NOSIGNAL);
          for (int i = 0; on && i < 10; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      });
    }
    ~Drippers() {
      on = false;
      thread.join();
      for (int fd : fds) ::close(fd);
    }
  } slow(s.port);
  std::this_thread::sleep_for(std::chrono::milliseconds(700));  // every slow client has sent bytes

  httplib::Client cli("127.0.0.1", s.port);
  cli.set_connection_timeout(3, 0);
  cli.set_read_timeout(3, 0);
  double worst = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t = Clock::now();
    auto r = cli.Get("/health");
    const double took = seconds_since(t);
    worst = std::max(worst, took);
    REQUIRE_MESSAGE(r, "GET /health failed: " << httplib::to_string(r.error()));
    CHECK(r->status == 200);
    CHECK(took < 1.0);
  }
  MESSAGE("worst /health latency with 100 slow clients: " << worst * 1000 << " ms");
  cli.set_read_timeout(20, 0);
  const json req = {{"model", "areno-demo"}, {"prompt", "Hello"}, {"max_tokens", 4}, {"temperature", 0}};
  auto r = cli.Post("/v1/completions", req.dump(), "application/json");
  REQUIRE(r);
  CHECK(r->status == 200);
  CHECK(json::parse(r->body)["usage"]["completion_tokens"] == 4);

  // The slow clients are still connected (well within --header-timeout-s).
  int open = 0;
  for (int fd : slow.fds) {
    pollfd p{fd, POLLIN, 0};
    open += ::poll(&p, 1, 0) == 0;
  }
  CHECK(open == 100);
}

TEST_CASE("serve/http limits: head and body deadlines are totals, idle keep-alive connections close") {
  ServerOptions so;
  so.connections.header_timeout_s = 1;
  so.connections.body_timeout_s = 1;
  so.connections.keep_alive_timeout_s = 0.5;
  Served s(engine(), so);

  // Dripping a byte every 0.1 s never idles 1 s, yet the head gets 408 at about 1 s.
  const std::string head = tokenize_request();
  const int fd = connect_to(s.port);
  const auto start = Clock::now();
  RawReply r;
  for (size_t k = 0; k < head.size() && r.status == 0; ++k) {
    ::send(fd, &head[k], 1, MSG_NOSIGNAL);
    r = read_reply(fd, 0.1);
  }
  const double took = seconds_since(start);
  check_openai_error(r, 408, "--header-timeout-s");
  CHECK(took > 0.9);
  CHECK(took < 2.0);
  CHECK(closed_within(fd, 2));
  ::close(fd);

  // The same for a body after a complete head.
  const int fb = connect_to(s.port);
  send_all(fb, "POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n");
  const auto body_start = Clock::now();
  RawReply rb;
  for (int k = 0; k < 1000 && rb.status == 0; ++k) {
    ::send(fb, " ", 1, MSG_NOSIGNAL);
    rb = read_reply(fb, 0.1);
  }
  check_openai_error(rb, 408, "--body-timeout-s");
  CHECK(seconds_since(body_start) < 2.0);
  ::close(fb);

  // A connection that never sends a byte is closed after the head deadline.
  const int quiet = connect_to(s.port);
  CHECK(closed_within(quiet, 2.5));
  ::close(quiet);

  // Keep-alive: a second request within the pause is served; after 0.5 s idle the server closes.
  const int ka = connect_to(s.port);
  send_all(ka, tokenize_request());
  check_tokenized(read_reply(ka, 5));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  send_all(ka, tokenize_request());
  check_tokenized(read_reply(ka, 5));
  const auto idle_start = Clock::now();
  CHECK(closed_within(ka, 2));
  const double idle = seconds_since(idle_start);
  CHECK(idle > 0.4);
  CHECK(idle < 1.5);
  ::close(ka);
}

TEST_CASE("serve/http limits: 300 simultaneous connects are queued by the backlog and all answered") {
  Served s(engine(), ServerOptions{}, /*start_now=*/false);
  // Nothing accepts yet: the kernel completes handshakes only for the backlog
  // (1024 by default; httplib listened with 5, and dropped the rest's SYNs).
  std::vector<int> fds;
  for (int i = 0; i < 300; ++i) fds.push_back(connect_to(s.port, /*nonblocking=*/true));
  std::vector<pollfd> ps;
  for (int fd : fds) ps.push_back({fd, POLLOUT, 0});
  const auto start = Clock::now();
  size_t connected = 0;
  while (connected < fds.size() && seconds_since(start) < 0.5) {
    ::poll(ps.data(), ps.size(), 50);
    connected = 0;
    for (const pollfd& p : ps) connected += (p.revents & POLLOUT) != 0;
  }
  CHECK(connected == 300);
  for (int fd : fds) {
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    CHECK(err == 0);
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    send_all(fd, "GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
  }
  s.start();
  int ok = 0;
  for (int fd : fds) {
    ok += read_reply(fd, 10).status == 200;
    ::close(fd);
  }
  CHECK(ok == 300);

  // And while serving: 300 clients connecting and asking at once, none reset.
  std::atomic<int> answered{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < 300; ++i)
    clients.emplace_back([&] {
      httplib::Client cli("127.0.0.1", s.port);
      cli.set_connection_timeout(10, 0);
      auto r = cli.Get("/health");
      answered += r && r->status == 200;
    });
  for (auto& t : clients) t.join();
  CHECK(answered == 300);
}

TEST_CASE("serve/http limits: with --api-key every route but /health needs the key, compared exactly") {
  ServerOptions so;
  so.api_key = "sekret";
  Served s(engine(), so);
  httplib::Client cli("127.0.0.1", s.port);
  const httplib::Headers good = {{"Authorization", "Bearer sekret"}};
  const std::string detok = R"({"tokens": [24912, 2375]})";

  for (const auto& wrong : std::vector<httplib::Headers>{
           {}, {{"Authorization", "Bearer sekre"}}, {{"Authorization", "Bearer sekretX"}},
           {{"Authorization", "Bearer SEKRET"}}, {{"Authorization", "sekret"}}, {{"Authorization", "Bearer "}}}) {
    CAPTURE(wrong.empty() ? std::string("(none)") : wrong.begin()->second);
    for (const auto& [path, body] : std::vector<std::pair<std::string, std::string>>{
             {"/tokenize", kTokenizeBody}, {"/detokenize", detok}, {"/v1/completions", R"({"prompt": "hi"})"}}) {
      const auto& path_ = path;  // clang 14 cannot capture a structured binding
      CAPTURE(path_);
      auto r = cli.Post(path, wrong, body, "application/json");
      REQUIRE(r);
      CHECK(r->status == 401);
      const json e = json::parse(r->body);
      CHECK(e["error"]["type"] == "authentication_error");
      CHECK(e["error"]["code"] == "invalid_api_key");
    }
    for (const char* path : {"/metrics", "/version", "/v1/models"}) {
      CAPTURE(path);
      auto r = cli.Get(path, wrong);
      REQUIRE(r);
      CHECK(r->status == 401);
    }
  }

  auto health = cli.Get("/health");
  REQUIRE(health);
  CHECK(health->status == 200);
  auto t = cli.Post("/tokenize", good, kTokenizeBody, "application/json");
  REQUIRE(t);
  CHECK(t->status == 200);
  CHECK(json::parse(t->body)["tokens"] == json::array({24912, 2375}));
  auto d = cli.Post("/detokenize", good, detok, "application/json");
  REQUIRE(d);
  CHECK(d->status == 200);
  CHECK(json::parse(d->body)["prompt"] == "hello world");
  auto m = cli.Get("/metrics", good);
  REQUIRE(m);
  CHECK(m->status == 200);
  CHECK(m->body.find("areno_requests_total") != std::string::npos);
}
