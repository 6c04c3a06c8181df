#pragma once
// Bytes of a media content part (spec tokens-api.md 3.1): base64 data URLs,
// `input_audio` base64 data, local files under the media root, and http(s)
// URLs when remote media are allowed. Every refusal is an ApiError (400)
// naming the part.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/media.h"

namespace areno::serve {

struct MediaFetchOptions {
  std::string media_root;       // local paths / file:// URLs allowed only under it; empty: refused
  bool allow_remote = false;    // http:// and https:// URLs
  size_t max_bytes = size_t(64) << 20;
  int timeout_seconds = 20;     // remote fetches
};

// Strict base64 (standard or URL-safe alphabet, padding optional, ASCII
// whitespace ignored). Throws std::invalid_argument on anything else.
std::vector<uint8_t> decode_base64(const std::string& text);
std::string encode_base64(const uint8_t* data, size_t n);

// The bytes of an image_url / audio_url / input_audio part. `where` names the
// part in errors ("messages[0].content[1]").
std::vector<uint8_t> fetch_media(const nlohmann::json& part, MediaKind kind, const std::string& where,
                                 const MediaFetchOptions& opts);

// Resolves `path` (relative paths against the root) and returns the real path
// if it lies under the real `root`, symlinks resolved; throws otherwise.
std::string resolve_under_root(const std::string& root, const std::string& path, const std::string& where);

}  // namespace areno::serve
