#pragma once
// The connection layer of `areno serve` (issue 13): one event-loop thread
// accepts connections and reads each request in full (headers, then the body,
// chunked or not) under byte limits and deadlines; only complete requests go
// to the worker threads, which route and answer them with httplib. A slow or
// idle client therefore holds a socket and a few bytes, never a worker.
//
// Limits, per connection unless said otherwise:
//   head (request line + headers)   max_header_bytes, else 431
//   body, every byte as received    max_body_bytes (chunk framing included), else 413
//                                   (a larger Content-Length is refused before any body byte is read)
//   head deadline                   header_timeout_s from the accept, or from the first byte after
//                                   a keep-alive pause; total, not per read; else 408
//   body deadline                   body_timeout_s from the end of the head, total; else 408
//   keep-alive pause                keep_alive_timeout_s, then closed; keep_alive_max_requests per connection
//   open connections                max_connections; more wait in the listen backlog (`backlog`)
//   bodies buffered, all clients    max(4 * max_body_bytes, 256 MiB); above it only the fullest
//                                   body goes on being read, the others wait (deadlines running)
// A refused request gets its status with the body `refusal` returns, then the
// connection is closed after the client's pending bytes are drained (at most
// 1 s), so the client reads the answer instead of a reset.
#include <httplib.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace areno::serve {

// What `areno serve` exposes as flags (see docs/serving.md), and the fixed rest.
struct ConnectionLimits {
  int backlog = 1024;
  size_t max_connections = 4096;
  double header_timeout_s = 10;
  double body_timeout_s = 60;
  double keep_alive_timeout_s = 5;
  size_t max_header_bytes = size_t(64) << 10;
  size_t keep_alive_max_requests = 1000;
  double write_timeout_s = 30;  // per write of a response: the client must accept bytes this often
};

struct ListenerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  size_t workers = 64;
  size_t max_body_bytes = size_t(32) << 20;
  ConnectionLimits limits;
};

// httplib's Server without its sockets: routes and answers one request that
// the listener has read in full.
class RequestRouter : public httplib::Server {
 public:
  bool answer(httplib::Stream& strm, bool close_connection, bool& connection_closed) {
    return process_request(strm, close_connection, connection_closed, nullptr);
  }
  // httplib ends streamed responses once its listening socket is invalid.
  void set_listening(socket_t fd) { svr_sock_ = fd; }
};

class HttpListener {
 public:
  // The JSON body of a request refused by the listener (status 400, 408, 413,
  // 431), given its message; called on the loop thread.
  using Refusal = std::function<std::string(int status, const std::string& message)>;

  HttpListener(RequestRouter& router, ListenerOptions opts, Refusal refusal);
  ~HttpListener();
  HttpListener(const HttpListener&) = delete;
  HttpListener& operator=(const HttpListener&) = delete;

  // Binds and listens (with opts.backlog); returns the port. Throws with the address on failure.
  int bind();
  // Runs the loop until stop(), then closes every connection and joins the
  // workers (requests in flight finish first).
  void run();
  // Idempotent; any thread.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace areno::serve
