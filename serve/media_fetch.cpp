// http(s) media for the chat processor, with --allow-remote-media (rules in media_fetch.h).
#include "serve/media_fetch.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <httplib.h>

#include "serve/request_context.h"

namespace areno::serve {

namespace {

using Clock = std::chrono::steady_clock;

// A failed fetch; its message goes to the server log only.
struct FetchFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string ipv4_kind(uint32_t a) {
  auto in = [a](uint32_t net, int bits) { return (a >> (32 - bits)) == (net >> (32 - bits)); };
  if (in(0x00000000, 8)) return "unspecified";
  if (in(0x7F000000, 8)) return "loopback";
  if (in(0x0A000000, 8) || in(0xAC100000, 12) || in(0xC0A80000, 16)) return "private";
  if (in(0xA9FE0000, 16)) return "link-local";
  if (in(0x64400000, 10)) return "shared";
  if (in(0xE0000000, 4)) return "multicast";
  if (in(0xF0000000, 4) || in(0xC0000000, 24) || in(0xC0000200, 24) || in(0xC6120000, 15) ||
      in(0xC6336400, 24) || in(0xCB007100, 24))
    return "reserved";  // 240/4 and broadcast, IETF, TEST-NETs, benchmarking
  return "";
}

uint32_t ipv4_at(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }

std::string ipv6_kind(const std::array<uint8_t, 16>& b) {
  auto zeros = [&](size_t from, size_t to) {
    for (size_t i = from; i < to; ++i)
      if (b[i]) return false;
    return true;
  };
  if (zeros(0, 16)) return "unspecified";
  if (zeros(0, 15) && b[15] == 1) return "loopback";
  // IPv4 inside IPv6: mapped ::ffff:a.b.c.d, compatible ::a.b.c.d, NAT64 64:ff9b::a.b.c.d, 6to4 2002:a.b.c.d::
  if (zeros(0, 10) && b[10] == 0xFF && b[11] == 0xFF) return ipv4_kind(ipv4_at(&b[12]));
  if (zeros(0, 12)) return ipv4_kind(ipv4_at(&b[12]));
  if (b[0] == 0x00 && b[1] == 0x64 && b[2] == 0xFF && b[3] == 0x9B && zeros(4, 12)) return ipv4_kind(ipv4_at(&b[12]));
  if (b[0] == 0x20 && b[1] == 0x02) return ipv4_kind(ipv4_at(&b[2]));
  if (b[0] == 0xFF) return "multicast";
  if (b[0] == 0xFE && (b[1] & 0xC0) == 0x80) return "link-local";
  if (b[0] == 0xFE && (b[1] & 0xC0) == 0xC0) return "private";  // deprecated site-local
  if ((b[0] & 0xFE) == 0xFC) return "private";                  // unique local fc00::/7
  if ((b[0] == 0x01 && b[1] == 0x00 && zeros(2, 8)) || (b[0] == 0x20 && b[1] == 0x01 && b[2] == 0x0D && b[3] == 0xB8))
    return "reserved";  // discard 100::/64, documentation 2001:db8::/32
  return "";
}

// Control characters and the like shown as \xNN, so a URL cannot forge log lines.
std::string printable(const std::string& s) { return log_printable(s, s.size()); }

struct Url {
  std::string scheme, host;  // host without IPv6 brackets
  int port = 0;
  std::string target;        // path and query
  std::string origin() const {
    return fmt::format("{}://{}:{}", scheme, host.find(':') != std::string::npos ? "[" + host + "]" : host, port);
  }
};

Url parse_url(const std::string& url) {
  for (unsigned char c : url)
    if (c <= 0x20 || c >= 0x7F) throw FetchFailure("the URL has spaces, control or non-ASCII characters");
  Url u;
  const size_t se = url.find("://");
  if (se == std::string::npos) throw FetchFailure("malformed URL");
  u.scheme = url.substr(0, se);
  for (char& c : u.scheme) c = char(std::tolower((unsigned char)c));
  if (u.scheme != "http" && u.scheme != "https") throw FetchFailure(fmt::format("unsupported scheme '{}'", u.scheme));
  const size_t auth_end = url.find_first_of("/?#", se + 3);
  const std::string auth = url.substr(se + 3, auth_end == std::string::npos ? std::string::npos : auth_end - se - 3);
  if (auth.find('@') != std::string::npos) throw FetchFailure("credentials in the URL are not accepted");
  std::string port;
  if (!auth.empty() && auth[0] == '[') {
    const size_t close = auth.find(']');
    if (close == std::string::npos) throw FetchFailure("malformed IPv6 host");
    u.host = auth.substr(1, close - 1);
    if (close + 1 < auth.size()) {
      if (auth[close + 1] != ':') throw FetchFailure("malformed host");
      port = auth.substr(close + 2);
    }
  } else {
    const size_t colon = auth.find(':');
    u.host = auth.substr(0, colon);
    if (colon != std::string::npos) port = auth.substr(colon + 1);
  }
  if (u.host.empty()) throw FetchFailure("no host in the URL");
  u.port = u.scheme == "https" ? 443 : 80;
  if (!port.empty()) {
    if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos) throw FetchFailure("bad port");
    u.port = std::stoi(port);
    if (u.port < 1 || u.port > 65535) throw FetchFailure("bad port");
  }
  std::string rest = auth_end == std::string::npos ? "" : url.substr(auth_end);
  rest = rest.substr(0, rest.find('#'));
  u.target = rest.empty() ? "/" : rest[0] == '?' ? "/" + rest : rest;
  return u;
}

// A redirect's Location against the URL it came from.
std::string resolve_location(const Url& from, const std::string& loc) {
  if (loc.find("://") != std::string::npos) return loc;
  if (loc.rfind("//", 0) == 0) return from.scheme + ":" + loc;
  if (!loc.empty() && loc[0] == '/') return from.origin() + loc;
  const std::string path = from.target.substr(0, from.target.find('?'));
  return from.origin() + path.substr(0, path.rfind('/') + 1) + loc;
}

// The host's addresses that may be fetched, resolved once, in resolver order.
std::vector<std::string> checked_addresses(const std::string& host, bool allow_private) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) throw FetchFailure(fmt::format("cannot resolve '{}': {}", printable(host), gai_strerror(rc)));
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owned(res, freeaddrinfo);
  std::vector<std::string> ok, refused;
  for (const addrinfo* a = res; a; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    const void* src = a->ai_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
                                              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    if ((a->ai_family != AF_INET && a->ai_family != AF_INET6) || !inet_ntop(a->ai_family, src, buf, sizeof buf)) continue;
    const std::string ip = buf, kind = non_public_address_kind(ip);
    if (!kind.empty() && !allow_private) refused.push_back(ip + " (" + kind + ")");
    else if (std::find(ok.begin(), ok.end(), ip) == ok.end()) ok.push_back(ip);
  }
  if (ok.empty())
    throw FetchFailure(fmt::format("'{}' resolves to no public address ({}); --allow-private-media allows them",
                                   printable(host), fmt::join(refused, ", ")));
  return ok;
}

std::vector<uint8_t> fetch_checked(const std::string& url, size_t max_bytes, const MediaFetchOptions& opts) {
  const auto deadline = Clock::now() + std::chrono::seconds(opts.timeout_seconds);
  std::string current = url;
  for (int hop = 0;; ++hop) {
    const Url u = parse_url(current);
    const std::vector<std::string> ips = checked_addresses(u.host, opts.allow_private);
    int status = 0;
    std::string location;
    std::vector<uint8_t> bytes;
    bool too_big = false, late = false;
    httplib::Error error = httplib::Error::Connection;
    // Each checked address in turn until one connects; the name is never resolved again.
    for (const std::string& ip : ips) {
      const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
      if (left <= 0) throw FetchFailure(fmt::format("no answer within {} s", opts.timeout_seconds));
      httplib::Client cli(u.origin());
      if (!cli.is_valid()) throw FetchFailure("unsupported URL");
      cli.set_hostname_addr_map({{u.host, ip}});
      cli.set_follow_location(false);
      cli.set_keep_alive(false);
      cli.set_connection_timeout(left / 1000000, left % 1000000);
      cli.set_read_timeout(left / 1000000, left % 1000000);
      cli.set_write_timeout(left / 1000000, left % 1000000);
      const httplib::Result res = cli.Get(
          u.target,
          [&](const httplib::Response& r) {
            status = r.status;
            location = r.get_header_value("Location");
            return status == 200;  // no body read for redirects and errors
          },
          [&](const char* data, size_t n) {
            if (Clock::now() > deadline) return !(late = true);
            if (bytes.size() + n > max_bytes) return !(too_big = true);
            bytes.insert(bytes.end(), data, data + n);
            return true;
          });
      error = res ? httplib::Error::Success : res.error();
      if (error != httplib::Error::Connection) break;
    }
    if (too_big) throw FetchFailure(fmt::format("larger than the limit of {} bytes", max_bytes));
    if (late) throw FetchFailure(fmt::format("not complete within {} s", opts.timeout_seconds));
    if (status == 301 || status == 302 || status == 303 || status == 307 || status == 308) {
      if (location.empty()) throw FetchFailure(fmt::format("HTTP {} without a Location", status));
      if (hop >= opts.max_redirects) throw FetchFailure(fmt::format("more than {} redirects", opts.max_redirects));
      current = resolve_location(u, location);
      continue;
    }
    if (status != 0 && status != 200) throw FetchFailure(fmt::format("HTTP {}", status));
    if (error != httplib::Error::Success)
      throw FetchFailure(fmt::format("{} ({})", httplib::to_string(error), u.origin()));
    return bytes;
  }
}

}  // namespace

std::string non_public_address_kind(const std::string& ip) {
  std::array<uint8_t, 16> b{};
  if (inet_pton(AF_INET, ip.c_str(), b.data()) == 1) return ipv4_kind(ipv4_at(b.data()));
  if (inet_pton(AF_INET6, ip.c_str(), b.data()) == 1) return ipv6_kind(b);
  throw std::invalid_argument(fmt::format("'{}' is not a numeric IP address", ip));
}

std::vector<uint8_t> fetch_remote_media(const std::string& url, size_t max_bytes, const std::string& where,
                                        const MediaFetchOptions& opts) {
  try {
    return fetch_checked(url, max_bytes, opts);
  } catch (const std::exception& e) {
    fmt::print(stderr, "areno serve: media fetch failed{}: {}: {}: {}\n", request_tag(), where, printable(url),
               e.what());
    throw phi4mm::ProcessorError(where, fmt::format("{}: {}", where, kMediaFetchFailed));
  }
}

phi4mm::MediaSource media_source(const MediaFetchOptions& opts) {
  phi4mm::MediaSource s;
  s.media_root = opts.media_root;
  s.max_bytes = opts.max_bytes;
  if (opts.allow_remote)
    s.remote = [opts](const std::string& url, size_t max_bytes, const std::string& field) {
      return fetch_remote_media(url, max_bytes, field, opts);
    };
  return s;
}

}  // namespace areno::serve
