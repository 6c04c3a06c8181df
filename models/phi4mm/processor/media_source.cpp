#include "models/phi4mm/processor/media_source.h"

#include <filesystem>
#include <fstream>
#include <stdexcept>

#include <fmt/format.h>

namespace areno::phi4mm {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

int base64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+' || c == '-') return 62;
  if (c == '/' || c == '_') return 63;
  return -1;
}

ProcessorError refuse(const std::string& where, const std::string& message) { return ProcessorError(where, where + ": " + message); }

std::string percent_decode(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && std::isxdigit((unsigned char)s[i + 1]) && std::isxdigit((unsigned char)s[i + 2])) {
      out.push_back(char(std::stoi(s.substr(i + 1, 2), nullptr, 16)));
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// One answer for every local path the server will not read -- missing,
// unreadable, not a regular file, outside the root -- so that errors do not
// tell which files exist outside the media root.
ProcessorError unreadable(const std::string& where, const std::string& path) {
  return refuse(where, fmt::format("media file '{}' is not a readable file under the media root", path));
}

std::vector<uint8_t> read_file_limited(const std::string& real, const std::string& path, size_t max_bytes,
                                       const std::string& where) {
  std::error_code ec;
  if (!fs::is_regular_file(real, ec)) throw unreadable(where, path);
  const auto size = fs::file_size(real, ec);
  if (ec) throw unreadable(where, path);
  if (size > max_bytes) throw refuse(where, fmt::format("'{}' has {} bytes, over the limit of {}", path, size, max_bytes));
  std::ifstream f(real, std::ios::binary);
  if (!f) throw unreadable(where, path);
  std::vector<uint8_t> bytes(size);
  f.read(reinterpret_cast<char*>(bytes.data()), std::streamsize(size));
  if (!f) throw unreadable(where, path);
  return bytes;
}

std::vector<uint8_t> fetch_remote(const std::string& url, const std::string& where, const MediaSource& opts) {
  if (!opts.remote)
    throw refuse(where, "http(s) media URLs are disabled on this server (start it with --allow-remote-media); "
                        "send the media as a base64 data URL instead");
  std::vector<uint8_t> bytes;
  try {
    bytes = opts.remote(url, opts.max_bytes, where);
  } catch (const ProcessorError&) {
    throw;
  } catch (const std::exception&) {
    throw refuse(where, "cannot fetch the media URL");
  }
  return bytes;
}

// data:[<mediatype>][;base64],<data>
std::vector<uint8_t> decode_data_url(const std::string& url, const std::string& where) {
  const size_t comma = url.find(',');
  if (comma == std::string::npos) throw refuse(where, "malformed data URL (no ',')");
  const std::string meta = url.substr(5, comma - 5);
  if (meta.size() < 7 || meta.compare(meta.size() - 7, 7, ";base64") != 0)
    throw refuse(where, "only base64 data URLs are supported (data:<type>;base64,<data>)");
  try {
    return decode_base64(url.substr(comma + 1));
  } catch (const std::invalid_argument& e) {
    throw refuse(where, fmt::format("bad base64 in data URL: {}", e.what()));
  }
}

}  // namespace

std::vector<uint8_t> decode_base64(const std::string& text) {
  std::vector<uint8_t> out;
  out.reserve(text.size() / 4 * 3 + 3);
  uint32_t acc = 0;
  int bits = 0, pad = 0;
  size_t count = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = (unsigned char)text[i];
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
    if (c == '=') {
      ++pad;
      continue;
    }
    if (pad) throw std::invalid_argument(fmt::format("data after '=' padding at offset {}", i));
    const int v = base64_value(c);
    if (v < 0) throw std::invalid_argument(fmt::format("invalid character at offset {}", i));
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    ++count;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(uint8_t((acc >> bits) & 0xff));
    }
  }
  if (count % 4 == 1) throw std::invalid_argument("truncated input (length is 1 mod 4)");
  if (pad > 2 || (pad && (count + size_t(pad)) % 4 != 0)) throw std::invalid_argument("wrong '=' padding");
  return out;
}

std::string encode_base64(const uint8_t* data, size_t n) {
  static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = uint32_t(data[i]) << 16;
    if (i + 1 < n) v |= uint32_t(data[i + 1]) << 8;
    if (i + 2 < n) v |= data[i + 2];
    out += abc[(v >> 18) & 63];
    out += abc[(v >> 12) & 63];
    out += i + 1 < n ? abc[(v >> 6) & 63] : '=';
    out += i + 2 < n ? abc[v & 63] : '=';
  }
  return out;
}

std::string resolve_under_root(const std::string& root, const std::string& path, const std::string& where) {
  if (root.empty())
    throw refuse(where, "local media paths are disabled on this server (start it with --media-root DIR); "
                        "send the media as a base64 data URL instead");
  std::error_code ec;
  const fs::path real_root = fs::canonical(root, ec);
  if (ec) throw refuse(where, fmt::format("the media root of this server is not accessible ({})", ec.message()));
  fs::path p(path);
  if (p.is_relative()) p = real_root / p;
  // Symlinks are resolved before the check; a missing file and one outside
  // the root get the same answer.
  const fs::path real = fs::canonical(p, ec);
  if (ec) throw unreadable(where, path);
  const fs::path rel = real.lexically_relative(real_root);
  if (rel.empty() || *rel.begin() == "..") throw unreadable(where, path);
  return real.string();
}

std::vector<uint8_t> read_media_part(const json& part, MediaKind kind, const std::string& where,
                                     const MediaSource& opts) {
  // input_audio: {"data": "<base64>", "format": "wav" | "mp3" | "flac" | "ogg"}
  if (part.value("type", "") == "input_audio" || (!part.contains("type") && part.contains("input_audio"))) {
    const json& a = part["input_audio"];
    const std::string w = where + ".input_audio";
    if (!a.is_object() || !a.contains("data") || !a["data"].is_string())
      throw refuse(w, "expected {\"data\": \"<base64>\", \"format\": \"wav\" | \"mp3\" | \"flac\" | \"ogg\"}");
    if (a.contains("format") && !a["format"].is_null()) {
      if (!a["format"].is_string()) throw refuse(w + ".format", "must be a string");
      const std::string f = a["format"].get<std::string>();
      if (f != "wav" && f != "mp3" && f != "flac" && f != "ogg")
        throw refuse(w + ".format", fmt::format("unsupported audio format '{}' (expected wav, mp3, flac or ogg)", f));
    }
    const std::string data = a["data"].get<std::string>();
    if (data.rfind("data:", 0) == 0) return decode_data_url(data, w + ".data");
    try {
      std::vector<uint8_t> bytes = decode_base64(data);
      if (bytes.size() > opts.max_bytes)
        throw refuse(w, fmt::format("{} bytes exceed the limit of {}", bytes.size(), opts.max_bytes));
      return bytes;
    } catch (const std::invalid_argument& e) {
      throw refuse(w + ".data", fmt::format("bad base64: {}", e.what()));
    }
  }
  // image_url / input_image / audio_url: {"url": "..."} or the URL string itself.
  const char* key = kind == MediaKind::kImage ? (part.contains("image_url") ? "image_url" : "input_image") : "audio_url";
  const json& u = part.contains(key) ? part[key] : json();
  const std::string w = where + "." + key;
  std::string url;
  if (u.is_string()) url = u.get<std::string>();
  else if (u.is_object() && u.contains("url") && u["url"].is_string()) url = u["url"].get<std::string>();
  else throw refuse(w, "expected {\"url\": \"...\"}");
  if (url.empty()) throw refuse(w, "the URL is empty");

  std::vector<uint8_t> bytes;
  if (url.rfind("data:", 0) == 0) {
    bytes = decode_data_url(url, w + ".url");
  } else if (url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0) {
    bytes = fetch_remote(url, w + ".url", opts);
  } else {
    std::string path = url;
    if (url.rfind("file://", 0) == 0) {
      path = url.substr(7);
      if (path.rfind("localhost/", 0) == 0) path = path.substr(9);
      if (path.empty() || path[0] != '/') throw refuse(w + ".url", fmt::format("unsupported file URL '{}'", url));
      path = percent_decode(path);
    } else if (url.find("://") != std::string::npos) {
      throw refuse(w + ".url", fmt::format("unsupported URL scheme in '{}' (expected data:, http(s):, file: or a path)",
                                           url.substr(0, url.find("://"))));
    }
    bytes = read_file_limited(resolve_under_root(opts.media_root, path, w + ".url"), path, opts.max_bytes, w + ".url");
  }
  if (bytes.size() > opts.max_bytes)
    throw refuse(w, fmt::format("{} bytes exceed the limit of {}", bytes.size(), opts.max_bytes));
  return bytes;
}

}  // namespace areno::phi4mm
