#pragma once
// The bytes of a media content part (spec tokens-api.md 3.1): base64 data
// URLs, `input_audio` base64 data, local files under the media root, and
// http(s) URLs through a fetcher the caller injects (the server's, which
// enforces its remote-media rules; none: refused). Every refusal is a
// ProcessorError naming the part.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/processor/media.h"

namespace areno::phi4mm {

// Fetches an http(s) URL, at most `max_bytes`; throws ProcessorError (its
// message is shown to the client) or any exception (shown as a generic
// "cannot fetch" error naming `field`).
using RemoteFetch = std::function<std::vector<uint8_t>(const std::string& url, size_t max_bytes, const std::string& field)>;

struct MediaSource {
  std::string media_root;       // local paths / file:// URLs allowed only under it; empty: refused
  RemoteFetch remote;           // http(s) URLs; empty: refused
  size_t max_bytes = size_t(64) << 20;
};

// Strict base64 (standard or URL-safe alphabet, padding optional, ASCII
// whitespace ignored). Throws std::invalid_argument on anything else.
std::vector<uint8_t> decode_base64(const std::string& text);
std::string encode_base64(const uint8_t* data, size_t n);

// The bytes of an image_url / input_image / audio_url / input_audio part.
// `field` names the part in errors ("messages[0].content[1]").
std::vector<uint8_t> read_media_part(const nlohmann::json& part, MediaKind kind, const std::string& field,
                                     const MediaSource& source);

// Resolves `path` (relative paths against the root) and returns the real path
// if it lies under the real `root`, symlinks resolved; throws ProcessorError
// otherwise, with one text for a missing path and one outside the root (and
// read_media_part the same text for one it cannot read or that is no regular
// file): no error tells whether a file exists outside the root.
std::string resolve_under_root(const std::string& root, const std::string& path, const std::string& field);

}  // namespace areno::phi4mm
