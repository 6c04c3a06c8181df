#pragma once
// The server's media sources: where the chat processor may read the bytes of
// media parts (phi4mm::MediaSource) under this server's options -- files
// under --media-root, and http(s) URLs fetched here when --allow-remote-media.
#include <cstdint>
#include <string>
#include <vector>

#include "models/phi4mm/processor/media_source.h"

namespace areno::serve {

struct MediaFetchOptions {
  std::string media_root;       // local paths / file:// URLs allowed only under it; empty: refused
  bool allow_remote = false;    // http:// and https:// URLs
  size_t max_bytes = size_t(64) << 20;
  int timeout_seconds = 20;     // remote fetches
};

// The source the processor reads media from with these options.
phi4mm::MediaSource media_source(const MediaFetchOptions& opts);

// GET `url` (http or https) with the options' timeout, at most `max_bytes`.
// Throws phi4mm::ProcessorError naming `field`.
std::vector<uint8_t> fetch_remote_media(const std::string& url, size_t max_bytes, const std::string& field,
                                        const MediaFetchOptions& opts);

}  // namespace areno::serve
