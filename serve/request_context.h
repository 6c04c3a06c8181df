#pragma once
// The HTTP request a worker thread is handling, for the lines the server logs
// on its behalf (a media fetch's failure reason, the access log): set by
// HttpServer before routing, on the thread that runs the handler.
#include <chrono>
#include <ctime>
#include <string>

#include <fmt/format.h>

namespace areno::serve {

struct RequestContext {
  std::string id;  // the X-Request-Id the response carries ("" outside a request)
  std::chrono::steady_clock::time_point start;
};

// This thread's request (empty id when none).
inline RequestContext& current_request() {
  static thread_local RequestContext ctx;
  return ctx;
}

// " [request ID]" for a log line, or "" outside a request.
inline std::string request_tag() {
  const std::string& id = current_request().id;
  return id.empty() ? std::string() : " [request " + id + "]";
}

// Client text for a log line: control characters and non-ASCII bytes as
// \xNN (so no one can forge a line), at most `max` bytes of it.
inline std::string log_printable(const std::string& s, size_t max = 512) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    out += c >= 0x20 && c < 0x7F ? std::string(1, char(c)) : fmt::format("\\x{:02x}", c);
  }
  if (s.size() > max) out += "...";
  return out;
}

// Now, as 2026-12-06T19:40:12Z.
inline std::string utc_time_text() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace areno::serve
