#pragma once
// The server's media sources: where the chat processor may read the bytes of
// media parts (phi4mm::MediaSource) under this server's options -- files
// under --media-root, and http(s) URLs fetched here when --allow-remote-media.
//
// Remote fetching is not a scanner: the host name is resolved once and only
// public addresses are connected to (loopback, private, link-local, shared,
// multicast, reserved and unspecified ones -- IPv4, IPv6 and IPv4 embedded in
// IPv6 -- are refused unless --allow-private-media), the checked address is
// the one connected to (no second resolution: DNS rebinding), every redirect
// hop is checked again (at most max_redirects), the whole fetch has one
// deadline and a byte cap, and every failure answers the client with the same
// text (kMediaFetchFailed); the reason goes to the server log (stderr).
#include <cstdint>
#include <string>
#include <vector>

#include "models/phi4mm/processor/media_source.h"

namespace areno::serve {

struct MediaFetchOptions {
  std::string media_root;       // local paths / file:// URLs allowed only under it; empty: refused
  bool allow_remote = false;    // http:// and https:// URLs
  bool allow_private = false;   // also non-public addresses (loopback, private, ...)
  size_t max_bytes = size_t(64) << 20;
  int timeout_seconds = 20;     // deadline of one remote fetch, redirects included
  int max_redirects = 3;
};

// What every failed remote fetch tells the client, after the field.
inline constexpr const char* kMediaFetchFailed = "cannot fetch the media URL (the server log has the reason)";

// The source the processor reads media from with these options.
phi4mm::MediaSource media_source(const MediaFetchOptions& opts);

// GET `url` (http or https) under the rules above, at most `max_bytes`.
// Throws phi4mm::ProcessorError naming `field` with kMediaFetchFailed.
std::vector<uint8_t> fetch_remote_media(const std::string& url, size_t max_bytes, const std::string& field,
                                        const MediaFetchOptions& opts);

// Why a numeric IPv4 or IPv6 address is not public ("loopback", "private",
// "link-local", "multicast", "unspecified", "reserved", "shared"), or "" when
// it is public. Throws std::invalid_argument when `ip` is not numeric.
std::string non_public_address_kind(const std::string& ip);

}  // namespace areno::serve
