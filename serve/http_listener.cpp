// The connection layer of `areno serve` (see http_listener.h): a poll() loop
// that reads whole requests, and httplib's routing on worker threads.
#include "serve/http_listener.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace areno::serve {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kReadSize = size_t(64) << 10;         // one recv()
constexpr size_t kReadsPerWake = 4;                    // then the next connection's turn
constexpr size_t kMaxChunkLine = 1024;                 // "<hex size>[;extensions]\r\n"
constexpr std::chrono::seconds kLinger(1);             // draining a refused client's bytes
constexpr std::chrono::milliseconds kAcceptPause(100); // after EMFILE and friends

Clock::duration span(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

const char* reason_phrase(int status) {
  switch (status) {
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 431: return "Request Header Fields Too Large";
    default: return "Error";
  }
}

// Writes what the socket takes now: the loop never waits for a client.
void send_now(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) data.remove_prefix(size_t(n));
    else if (!(n < 0 && errno == EINTR)) return;
  }
}

// The numeric address of a socket's own end (peer false) or its peer's.
void socket_address(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  auto* sa = reinterpret_cast<sockaddr*>(&addr);
  if ((peer ? ::getpeername(fd, sa, &len) : ::getsockname(fd, sa, &len)) != 0) return;
  char host[NI_MAXHOST];
  char serv[NI_MAXSERV];
  if (::getnameinfo(sa, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
    ip = host;
    port = std::atoi(serv);
  }
}

// httplib's view of one request the loop has read in full: reads come from
// memory, writes go to the client's socket (non-blocking, each one waiting at
// most the write timeout).
class ReadRequestStream final : public httplib::Stream {
 public:
  ReadRequestStream(int fd, const std::string& head, const std::string& body, int write_timeout_ms)
      : fd_(fd), head_(head), body_(body), write_timeout_ms_(write_timeout_ms) {}

  bool is_readable() const override { return true; }
  // As httplib's own sockets: writable in time, and the client has not hung up.
  bool is_writable() const override { return wait_writable() && peer_open(); }

  ssize_t read(char* ptr, size_t size) override {
    size_t n = 0;
    while (n < size && offset_ < head_.size() + body_.size()) {
      const bool in_head = offset_ < head_.size();
      const std::string& from = in_head ? head_ : body_;
      const size_t at = in_head ? offset_ : offset_ - head_.size();
      const size_t k = std::min(size - n, from.size() - at);
      std::memcpy(ptr + n, from.data() + at, k);
      n += k;
      offset_ += k;
    }
    return ssize_t(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::send(fd_, ptr + done, size - done, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) done += size_t(n);
      else if (n < 0 && errno == EINTR) continue;
      else if (!(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && wait_writable())) return -1;
    }
    return ssize_t(size);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { socket_address(fd_, true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { socket_address(fd_, false, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  bool wait_writable() const {
    pollfd p{fd_, POLLOUT, 0};
    int rc;
    do rc = ::poll(&p, 1, write_timeout_ms_);
    while (rc < 0 && errno == EINTR);
    return rc > 0 && (p.revents & POLLOUT) && !(p.revents & (POLLERR | POLLHUP));
  }
  // Readable with nothing to peek means the client closed its end.
  bool peer_open() const {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) return true;
    char c;
    const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR));
  }

  int fd_;
  const std::string& head_;
  const std::string& body_;
  int write_timeout_ms_;
  size_t offset_ = 0;
};

struct Refused {
  int status;
  std::string message;
};

// One client connection. The loop owns it; while `busy` a worker answers its
// request and the loop does not touch it.
struct Conn {
  enum class Phase { head, body, idle, busy, draining };
  enum class Chunk { size, data, data_end, trailer };

  int fd = -1;
  Phase phase = Phase::head;
  Clock::time_point deadline;
  std::string in;        // received, not yet consumed
  size_t searched = 0;   // prefix of `in` known not to hold the end of the head
  size_t served = 0;     // requests answered on this connection
  bool keep = false;     // set by the worker: the connection stays open
  // The request being read.
  std::string head;      // request line and headers, the framing headers left out
  std::string body;      // decoded
  bool chunked = false;
  bool expect_continue = false;
  Chunk chunk = Chunk::size;
  size_t left = 0;       // Content-Length bytes, or bytes of the current chunk, still to come
  size_t body_raw = 0;   // body bytes received, chunk framing included

  bool reading() const { return phase == Phase::head || phase == Phase::body; }
  size_t held() const { return in.size() + head.size() + body.size(); }
};

size_t hex_digit(char ch) {
  return ch <= '9' ? size_t(ch - '0') : size_t(std::tolower(static_cast<unsigned char>(ch)) - 'a' + 10);
}

// Parses a Content-Length value: digits only, at most 18 of them.
std::optional<size_t> parse_length(std::string_view v) {
  if (v.empty() || v.size() > 18) return std::nullopt;
  size_t n = 0;
  for (char ch : v) {
    if (ch < '0' || ch > '9') return std::nullopt;
    n = n * 10 + size_t(ch - '0');
  }
  return n;
}

}  // namespace

struct HttpListener::Impl {
  RequestRouter& router;
  ListenerOptions opts;
  Refusal refusal;
  int listen_fd = -1;
  int wake_read = -1, wake_write = -1;
  std::atomic<bool> stopping{false};
  std::unique_ptr<httplib::ThreadPool> pool;
  std::unordered_map<int, std::unique_ptr<Conn>> conns;
  size_t buffer_budget;
  Clock::time_point accept_paused_until{};
  std::mutex returned_mu;
  std::vector<Conn*> returned;  // answered by a worker, back to the loop

  Impl(RequestRouter& r, ListenerOptions o, Refusal f) : router(r), opts(std::move(o)), refusal(std::move(f)) {
    buffer_budget = std::max(4 * opts.max_body_bytes, size_t(256) << 20);
    int p[2];
    if (::pipe2(p, O_NONBLOCK | O_CLOEXEC) != 0)
      throw std::runtime_error(fmt::format("http listener: pipe2: {}", std::strerror(errno)));
    wake_read = p[0];
    wake_write = p[1];
    // The Keep-Alive header httplib writes states these limits.
    router.set_keep_alive_max_count(opts.limits.keep_alive_max_requests);
    router.set_keep_alive_timeout(time_t(std::ceil(opts.limits.keep_alive_timeout_s)));
    router.set_payload_max_length(opts.max_body_bytes);
  }

  ~Impl() {
    for (int fd : {listen_fd, wake_read, wake_write})
      if (fd >= 0) ::close(fd);
    for (auto& [fd, c] : conns) ::close(fd);
  }

  void wake() {
    const char b = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_write, &b, 1);  // full pipe: a wake is pending anyway
  }

  int bind() {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string port = std::to_string(opts.port);
    const int gai = ::getaddrinfo(opts.host.empty() ? nullptr : opts.host.c_str(), port.c_str(), &hints, &found);
    if (gai != 0) throw std::runtime_error(fmt::format("cannot listen on {}:{} ({})", opts.host, port, ::gai_strerror(gai)));
    std::string why = "no address";
    for (addrinfo* a = found; a && listen_fd < 0; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) {
        why = std::strerror(errno);
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, opts.limits.backlog) == 0) {
        listen_fd = fd;
      } else {
        why = std::strerror(errno);
        ::close(fd);
      }
    }
    ::freeaddrinfo(found);
    if (listen_fd < 0) throw std::runtime_error(fmt::format("cannot listen on {}:{} ({})", opts.host, port, why));
    std::string ip;
    int bound = -1;
    socket_address(listen_fd, false, ip, bound);
    return bound;
  }

  // ---- the loop ------------------------------------------------------------

  void run() {
    pool = std::make_unique<httplib::ThreadPool>(opts.workers);
    router.set_listening(listen_fd);
    std::vector<pollfd> fds;
    std::vector<Conn*> who;  // fds[i]'s connection; null: the wake pipe or the listening socket
    while (!stopping) {
      take_returned();
      const Clock::time_point now = Clock::now();
      fds.clear();
      who.clear();
      fds.push_back({wake_read, POLLIN, 0});
      who.push_back(nullptr);
      const bool room = conns.size() < opts.limits.max_connections;
      if (room && now >= accept_paused_until && listen_fd >= 0) {
        fds.push_back({listen_fd, POLLIN, 0});
        who.push_back(nullptr);
      }
      // Over the buffer budget only the fullest body goes on being read: it
      // completes and frees its bytes, where reading none could stall them all.
      size_t buffered = 0;
      Conn* fullest = nullptr;
      for (auto& [fd, c] : conns) {
        if (!c->reading()) continue;
        buffered += c->held();
        if (c->phase == Conn::Phase::body && (!fullest || c->held() > fullest->held())) fullest = c.get();
      }
      const bool over_budget = buffered > buffer_budget;
      Clock::time_point next = now + std::chrono::seconds(1);
      if (room && now < accept_paused_until) next = std::min(next, accept_paused_until);
      for (auto& [fd, c] : conns) {
        if (c->phase == Conn::Phase::busy) continue;
        next = std::min(next, c->deadline);
        if (over_budget && c->phase == Conn::Phase::body && c.get() != fullest) continue;
        fds.push_back({fd, POLLIN, 0});
        who.push_back(c.get());
      }
      const auto wait = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
      const int rc = ::poll(fds.data(), fds.size(), int(std::max<int64_t>(0, wait)));
      if (rc < 0 && errno != EINTR) {
        fmt::print(stderr, "areno serve: poll: {}\n", std::strerror(errno));
        continue;
      }
      for (size_t i = 0; rc > 0 && i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        if (who[i]) read_from(*who[i]);
        else if (fds[i].fd == listen_fd) accept_all();
        else drain_wake_pipe();
      }
      expire(Clock::now());
    }
    router.set_listening(INVALID_SOCKET);  // streams in flight end
    if (listen_fd >= 0) {
      ::close(listen_fd);
      listen_fd = -1;
    }
    std::vector<Conn*> open;
    for (auto& [fd, c] : conns)
      if (c->phase != Conn::Phase::busy) open.push_back(c.get());
    for (Conn* c : open) close_conn(*c);
    pool->shutdown();  // requests in flight finish
    take_returned();   // stopping: closes them
    pool.reset();
  }

  void drain_wake_pipe() {
    char buf[256];
    while (::read(wake_read, buf, sizeof buf) > 0) {
    }
  }

  void accept_all() {
    while (conns.size() < opts.limits.max_connections) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
          accept_paused_until = Clock::now() + kAcceptPause;
        return;  // EAGAIN: none left
      }
      const int one = 1;  // small SSE events go out at once
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      auto c = std::make_unique<Conn>();
      c->fd = fd;
      c->deadline = Clock::now() + span(opts.limits.header_timeout_s);
      conns.emplace(fd, std::move(c));
    }
  }

  void close_conn(Conn& c) {
    const int fd = c.fd;
    ::close(fd);
    conns.erase(fd);  // destroys c
  }

  void read_from(Conn& c) {
    char buf[kReadSize];
    for (size_t i = 0; i < kReadsPerWake; ++i) {
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) return close_conn(c);  // the client closed, or the socket failed
      if (c.phase == Conn::Phase::draining) continue;
      c.in.append(buf, size_t(n));
      if (!advance(c)) return;
    }
  }

  void expire(Clock::time_point now) {
    std::vector<Conn*> due;
    for (auto& [fd, c] : conns)
      if (c->phase != Conn::Phase::busy && c->deadline <= now) due.push_back(c.get());
    for (Conn* c : due) {
      if (c->phase == Conn::Phase::body || (c->phase == Conn::Phase::head && !c->in.empty())) {
        refuse(*c, {408, c->phase == Conn::Phase::head
                             ? fmt::format("the request headers did not arrive within {} s (--header-timeout-s)",
                                           opts.limits.header_timeout_s)
                             : fmt::format("the request body did not arrive within {} s (--body-timeout-s)",
                                           opts.limits.body_timeout_s)});
      } else {
        close_conn(*c);  // idle, a connection that never sent a byte, or draining done
      }
    }
  }

  // ---- reading a request ---------------------------------------------------

  // Parses what `in` holds. False when the connection stopped reading
  // (dispatched to a worker, refused).
  bool advance(Conn& c) {
    while (true) {
      switch (c.phase) {
        case Conn::Phase::idle: {
          const size_t start = c.in.find_first_not_of("\r\n");  // blank lines between requests
          c.in.erase(0, start == std::string::npos ? c.in.size() : start);
          if (c.in.empty()) return true;
          c.phase = Conn::Phase::head;
          c.searched = 0;
          c.deadline = Clock::now() + span(opts.limits.header_timeout_s);
          break;
        }
        case Conn::Phase::head: {
          const size_t end = c.in.find("\r\n\r\n", c.searched < 3 ? 0 : c.searched - 3);
          const size_t head_bytes = end == std::string::npos ? c.in.size() : end + 4;
          if (head_bytes > opts.limits.max_header_bytes)
            return refuse(c, {431, fmt::format("the request line and headers exceed {} bytes", opts.limits.max_header_bytes)});
          if (end == std::string::npos) {
            c.searched = c.in.size();
            return true;
          }
          if (auto r = read_head(c, std::string_view(c.in).substr(0, end + 2))) return refuse(c, *r);
          c.in.erase(0, end + 4);
          c.phase = Conn::Phase::body;
          c.deadline = Clock::now() + span(opts.limits.body_timeout_s);
          if (c.expect_continue && c.in.empty() && (c.chunked || c.left > 0))
            send_now(c.fd, "HTTP/1.1 100 Continue\r\n\r\n");
          break;
        }
        case Conn::Phase::body: {
          bool complete = false;
          if (auto r = read_body(c, complete)) return refuse(c, *r);
          if (!complete) return true;
          dispatch(c);
          return false;
        }
        default: return false;
      }
    }
  }

  // The head (request line and header lines, each ending in CRLF) into
  // c.head without the framing headers, and the body's framing.
  std::optional<Refused> read_head(Conn& c, std::string_view block) {
    c.head.clear();
    c.body.clear();
    c.chunked = c.expect_continue = false;
    c.chunk = Conn::Chunk::size;
    c.left = c.body_raw = 0;
    bool has_te = false;
    std::optional<size_t> length;
    size_t pos = block.find("\r\n");
    c.head.append(block.substr(0, pos + 2));  // the request line; httplib checks it
    for (pos += 2; pos < block.size();) {
      const size_t eol = block.find("\r\n", pos);
      const std::string_view line = block.substr(pos, eol - pos);
      pos = eol + 2;
      const size_t colon = line.find(':');
      if (line.empty() || line.front() == ' ' || line.front() == '\t' || colon == std::string_view::npos || colon == 0 ||
          line.substr(0, colon).find_first_of(" \t") != std::string_view::npos)
        return Refused{400, "malformed header line"};
      const std::string_view name = line.substr(0, colon), value = trim(line.substr(colon + 1));
      if (iequals(name, "Content-Length")) {
        const std::optional<size_t> n = parse_length(value);
        if (!n || (length && *length != *n)) return Refused{400, "invalid Content-Length"};
        length = n;
      } else if (iequals(name, "Transfer-Encoding")) {
        if (!iequals(value, "chunked") || has_te)
          return Refused{400, fmt::format("unsupported Transfer-Encoding '{}' (only chunked)", value)};
        has_te = c.chunked = true;
      } else if (iequals(name, "Expect")) {
        c.expect_continue = iequals(value, "100-continue");  // answered here; httplib must not
      } else {
        c.head.append(line).append("\r\n");
      }
    }
    if (has_te && length) return Refused{400, "both Transfer-Encoding and Content-Length"};
    c.left = length.value_or(0);
    if (c.left > opts.max_body_bytes) return body_too_large();
    return std::nullopt;
  }

  Refused body_too_large() const {
    return {413, fmt::format("the request body is larger than the server's limit of {} bytes (--max-body-mb)",
                             opts.max_body_bytes)};
  }

  // Moves body bytes from c.in to c.body, decoding chunks; every byte taken
  // counts against the limit.
  std::optional<Refused> read_body(Conn& c, bool& complete) {
    if (!c.chunked) {
      const size_t k = std::min(c.left, c.in.size());
      c.body.append(c.in, 0, k);
      c.in.erase(0, k);
      c.left -= k;
      complete = c.left == 0;
      return std::nullopt;
    }
    size_t p = 0;
    std::optional<Refused> refused;
    while (!complete && !refused) {
      const size_t before = p;
      if (c.chunk == Conn::Chunk::data) {
        const size_t k = std::min(c.left, c.in.size() - p);
        c.body.append(c.in, p, k);
        p += k;
        c.left -= k;
        if (c.left == 0) c.chunk = Conn::Chunk::data_end;
      } else if (c.chunk == Conn::Chunk::data_end) {
        if (c.in.size() - p < 2) break;
        if (c.in.compare(p, 2, "\r\n") != 0) refused = Refused{400, "a chunk's data does not end with CRLF"};
        p += 2;
        c.chunk = Conn::Chunk::size;
      } else {
        const size_t eol = c.in.find("\r\n", p);
        if (eol == std::string::npos) {
          if (c.in.size() - p > kMaxChunkLine) refused = Refused{400, "chunk size line too long"};
          break;
        }
        const std::string_view line(c.in.data() + p, eol - p);
        p = eol + 2;
        if (c.chunk == Conn::Chunk::trailer) {
          complete = line.empty();  // trailer fields are dropped
        } else {
          size_t digits = 0, size = 0;
          for (; digits < line.size() && std::isxdigit(static_cast<unsigned char>(line[digits])); ++digits)
            size = size * 16 + hex_digit(line[digits]);
          const std::string_view rest = line.substr(digits);
          if (digits == 0 || digits > 15 || !(rest.empty() || rest.front() == ';' || rest.front() == ' ' || rest.front() == '\t'))
            refused = Refused{400, "invalid chunk size line"};
          else if (c.body.size() + size > opts.max_body_bytes)
            refused = body_too_large();
          c.left = size;
          c.chunk = size == 0 ? Conn::Chunk::trailer : Conn::Chunk::data;
        }
      }
      c.body_raw += p - before;
      if (!refused && c.body_raw > opts.max_body_bytes) refused = body_too_large();
      if (p == before && c.chunk == Conn::Chunk::data) break;  // no data yet
    }
    c.in.erase(0, p);
    return refused;
  }

  // ---- answering -----------------------------------------------------------

  void dispatch(Conn& c) {
    c.head += fmt::format("Content-Length: {}\r\n\r\n", c.body.size());
    c.phase = Conn::Phase::busy;
    pool->enqueue([this, conn = &c] { answer(*conn); });
  }

  // On a worker thread.
  void answer(Conn& c) {
    const bool last = c.served + 1 >= opts.limits.keep_alive_max_requests;
    bool closed = false;
    bool ok = false;
    {
      ReadRequestStream strm(c.fd, c.head, c.body, int(opts.limits.write_timeout_s * 1000));
      ok = router.answer(strm, last, closed);
    }
    ++c.served;
    c.keep = ok && !closed && !last;
    std::string().swap(c.head);
    std::string().swap(c.body);
    {
      std::lock_guard<std::mutex> lk(returned_mu);
      returned.push_back(&c);
    }
    wake();
  }

  void take_returned() {
    std::vector<Conn*> back;
    {
      std::lock_guard<std::mutex> lk(returned_mu);
      back.swap(returned);
    }
    for (Conn* c : back) {
      if (!c->keep || stopping) {
        close_conn(*c);
        continue;
      }
      if (c->in.empty()) std::string().swap(c->in);  // an idle connection keeps no buffer
      c->phase = Conn::Phase::idle;
      c->deadline = Clock::now() + span(opts.limits.keep_alive_timeout_s);
      advance(*c);  // a pipelined request may be waiting in `in`
    }
  }

  // Answers `r` from the loop and closes after draining what the client still sends.
  bool refuse(Conn& c, const Refused& r) {
    const std::string body = refusal(r.status, r.message);
    send_now(c.fd, fmt::format("HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n"
                               "Connection: close\r\n\r\n{}",
                               r.status, reason_phrase(r.status), body.size(), body));
    ::shutdown(c.fd, SHUT_WR);
    c.phase = Conn::Phase::draining;
    c.deadline = Clock::now() + kLinger;
    std::string().swap(c.in);
    std::string().swap(c.head);
    std::string().swap(c.body);
    return false;
  }
};

HttpListener::HttpListener(RequestRouter& router, ListenerOptions opts, Refusal refusal)
    : impl_(std::make_unique<Impl>(router, std::move(opts), std::move(refusal))) {}

HttpListener::~HttpListener() = default;

int HttpListener::bind() { return impl_->bind(); }
void HttpListener::run() { impl_->run(); }

void HttpListener::stop() {
  impl_->stopping = true;
  impl_->router.set_listening(INVALID_SOCKET);
  impl_->wake();
}

}  // namespace areno::serve
