#include "train/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "nn/io/atomic_file.h"
#include "nn/io/files.h"

namespace areno::train {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void fail(const std::string& what, const fs::path& path, int err) {
  throw std::runtime_error(fmt::format("{} {}: {}", what, path.string(), std::strerror(err)));
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// ---- protobuf wire format, the few field kinds an Event needs --------------

void put_varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out += char(v | 0x80);
  out += char(v);
}
void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += char(v >> (8 * i));
}
enum Wire { varint = 0, fixed64 = 1, length_delimited = 2, fixed32 = 5 };
void put_key(std::string& out, int field, Wire wire) { put_varint(out, uint64_t(field) << 3 | wire); }
void put_double(std::string& out, int field, double v) {
  put_key(out, field, fixed64);
  put_le(out, std::bit_cast<uint64_t>(v), 8);
}
void put_float(std::string& out, int field, float v) {
  put_key(out, field, fixed32);
  put_le(out, std::bit_cast<uint32_t>(v), 4);
}
void put_int(std::string& out, int field, int64_t v) {
  put_key(out, field, varint);
  put_varint(out, uint64_t(v));
}
void put_bytes(std::string& out, int field, std::string_view v) {
  put_key(out, field, length_delimited);
  put_varint(out, v.size());
  out += v;
}

// tensorflow.Event (tensorflow/core/util/event.proto): wall_time = 1 (double),
// step = 2 (int64), file_version = 3 (string), summary = 5 (Summary),
// session_log = 7 (SessionLog). Summary (framework/summary.proto): repeated
// Value value = 1; Value: tag = 1 (string), simple_value = 2 (float).
// SessionLog: status = 1 (enum, START = 1).
std::string file_version_event(double wall_time) {
  std::string e;
  put_double(e, 1, wall_time);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string session_start_event(double wall_time, int64_t step) {
  std::string log, e;
  put_int(log, 1, 1);
  put_double(e, 1, wall_time);
  put_int(e, 2, step);
  put_bytes(e, 7, log);
  return e;
}

std::string scalars_event(double wall_time, int64_t step, const Scalars& scalars) {
  std::string summary;
  for (const auto& [name, v] : scalars) {
    std::string value;
    put_bytes(value, 1, name);
    put_float(value, 2, float(v));
    put_bytes(summary, 1, value);
  }
  std::string e;
  put_double(e, 1, wall_time);
  put_int(e, 2, step);
  put_bytes(e, 5, summary);
  return e;
}

// TFRecord: uint64 length, masked CRC of those 8 bytes, the data, masked CRC of the data.
std::string tfrecord(std::string_view data) {
  std::string length;
  put_le(length, data.size(), 8);
  std::string out = length;
  put_le(out, masked_crc32c(length), 4);
  out += data;
  put_le(out, masked_crc32c(data), 4);
  return out;
}

// ---- files -------------------------------------------------------------------

// Keeps the lines of metrics.jsonl whose step is <= last_step; a line that does
// not parse (the one a crash cut short) goes too.
void keep_steps_up_to(const fs::path& path, int64_t last_step) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return;
  std::istringstream in(read_file(path.string()));
  std::string kept, line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() <= last_step)
      kept += line + '\n';
  }
  write_file_atomic(path.string(), kept);
}

int open_append(const fs::path& path, bool exclusive) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (exclusive ? O_EXCL : 0), 0644);
  if (fd < 0 && !(exclusive && errno == EEXIST)) fail("cannot open", path, errno);
  return fd;
}

// events.out.tfevents.<unix s>.<host>.<pid>.areno; a second writer in the same
// process and second (tests) adds .1, .2, ...
fs::path new_events_file(const fs::path& dir, int& fd) {
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) != 0 || host[0] == 0) std::strcpy(host.data(), "localhost");
  const std::string base =
      fmt::format("events.out.tfevents.{}.{}.{}.areno", int64_t(std::time(nullptr)), host.data(), ::getpid());
  for (int n = 0;; ++n) {
    const fs::path path = dir / (n == 0 ? base : fmt::format("{}.{}", base, n));
    fd = open_append(path, /*exclusive=*/true);
    if (fd >= 0) return path;
  }
}

}  // namespace

uint32_t crc32c(std::string_view data) {
  static constexpr auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reversed Castagnoli polynomial
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : data) c = table[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

void MetricsWriter::Output::append(std::string_view data) {
  while (!data.empty()) {
    const ssize_t w = ::write(fd, data.data(), data.size());
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail("cannot write", path, w < 0 ? errno : ENOSPC);
    data.remove_prefix(size_t(w));
  }
}

MetricsWriter::Output::~Output() {
  if (fd >= 0) ::close(fd);
}

MetricsWriter::MetricsWriter(const fs::path& dir, int64_t resume_step) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("cannot create the metrics folder", dir, ec.value());
  jsonl_.path = dir / "metrics.jsonl";
  keep_steps_up_to(jsonl_.path, resume_step);
  jsonl_.fd = open_append(jsonl_.path, /*exclusive=*/false);

  events_.path = new_events_file(dir, events_.fd);
  const double now = unix_seconds();
  events_.append(tfrecord(file_version_event(now)));
  events_.append(tfrecord(session_start_event(now, resume_step + 1)));
}

void MetricsWriter::write(int64_t step, const Scalars& scalars) {
  const double now = unix_seconds();
  nlohmann::ordered_json line;
  line["step"] = step;
  line["time"] = now;
  for (const auto& [name, v] : scalars) {
    if (std::isfinite(v))
      line[name] = v;
    else
      line[name] = nullptr;
  }
  jsonl_.append(line.dump() + '\n');
  events_.append(tfrecord(scalars_event(now, step, scalars)));
}

std::string format_duration(double seconds) {
  if (!(seconds >= 0 && seconds < 1e15)) return "?";
  const int64_t t = std::llround(seconds);
  const int64_t h = t / 3600, m = t / 60 % 60, s = t % 60;
  if (h > 0) return fmt::format("{}h{:02}m{:02}s", h, m, s);
  if (m > 0) return fmt::format("{}m{:02}s", m, s);
  return fmt::format("{}s", s);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string format_group_lrs(const std::vector<std::pair<std::string, double>>& lrs) {
  std::string s = "lr";
  for (const auto& [group, lr] : lrs) s += fmt::format(" {} {:.2e}", group, lr);
  return s;
}

std::string format_progress(const ProgressInfo& p) {
  std::string s = p.total_steps > 0 ? fmt::format("step {}/{}", p.step, p.total_steps) : fmt::format("step {}", p.step);
  s += fmt::format("  loss {:.4f}", p.loss);
  if (!p.lrs.empty()) s += "  " + format_group_lrs(p.lrs);
  s += fmt::format("  grad_norm {:.3f}  tok/s {:.0f}  elapsed {}", p.grad_norm, p.tokens_per_s,
                   format_duration(p.elapsed_s));
  if (p.total_steps > 0)
    s += "  eta " + (p.step > 0 ? format_duration(p.elapsed_s / double(p.step) * double(p.total_steps - p.step)) : "?");
  return s;
}

int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::strtoll(line.c_str() + 6, nullptr, 10) * 1024;  // "VmHWM:  1234 kB"
  return 0;
}

}  // namespace areno::train
