// http(s) media for the chat processor, with --allow-remote-media.
#include "serve/media_fetch.h"

#include <fmt/format.h>
#include <httplib.h>

namespace areno::serve {

namespace {

phi4mm::ProcessorError refuse(const std::string& field, const std::string& message) {
  return phi4mm::ProcessorError(field, field + ": " + message);
}

}  // namespace

std::vector<uint8_t> fetch_remote_media(const std::string& url, size_t max_bytes, const std::string& where,
                                        const MediaFetchOptions& opts) {
  // scheme://host[:port]/path?query
  const size_t scheme_end = url.find("://");
  if (scheme_end == std::string::npos) throw refuse(where, fmt::format("malformed URL '{}'", url));
  const size_t path_start = url.find('/', scheme_end + 3);
  const std::string origin = path_start == std::string::npos ? url : url.substr(0, path_start);
  const std::string path = path_start == std::string::npos ? "/" : url.substr(path_start);
  if (origin.size() <= scheme_end + 3) throw refuse(where, fmt::format("malformed URL '{}'", url));
  httplib::Client cli(origin);
  if (!cli.is_valid()) throw refuse(where, fmt::format("cannot fetch '{}': unsupported URL", url));
  cli.set_connection_timeout(opts.timeout_seconds, 0);
  cli.set_read_timeout(opts.timeout_seconds, 0);
  cli.set_follow_location(true);
  std::vector<uint8_t> bytes;
  bool too_big = false;
  auto res = cli.Get(path, [&](const char* data, size_t n) {
    if (bytes.size() + n > max_bytes) {
      too_big = true;
      return false;
    }
    bytes.insert(bytes.end(), data, data + n);
    return true;
  });
  if (too_big) throw refuse(where, fmt::format("'{}' is larger than the limit of {} bytes", url, max_bytes));
  if (!res) throw refuse(where, fmt::format("cannot fetch '{}': {}", url, httplib::to_string(res.error())));
  if (res->status != 200) throw refuse(where, fmt::format("cannot fetch '{}': HTTP {}", url, res->status));
  return bytes;
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
