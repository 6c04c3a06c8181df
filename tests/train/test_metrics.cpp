// Training metrics (issue 14, "Metrics"): metrics.jsonl read back value by
// value, resume without duplicate steps, the TensorBoard event file decoded
// record by record (CRCs, Event and Summary fields), the progress line, and
// errors naming the path.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <ctime>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"
#include "train/metrics.h"

using namespace areno;
using namespace areno::train;
using testing::TempDir;

namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<nlohmann::ordered_json> read_jsonl(const std::filesystem::path& path) {
  std::vector<nlohmann::ordered_json> out;
  std::istringstream in(slurp(path));
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::ordered_json::parse(line));
  return out;
}

std::vector<int64_t> steps_of(const std::vector<nlohmann::ordered_json>& lines) {
  std::vector<int64_t> out;
  for (const auto& l : lines) out.push_back(l["step"].get<int64_t>());
  return out;
}

std::vector<std::string> keys_of(const nlohmann::ordered_json& j) {
  std::vector<std::string> out;
  for (const auto& [k, v] : j.items()) out.push_back(k);
  return out;
}

std::vector<std::filesystem::path> event_files(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> out;
  for (const auto& name : testing::names_in(dir))
    if (name.rfind("events.out.tfevents.", 0) == 0) out.push_back(dir / name);
  return out;
}

// ---- a small TFRecord + protobuf reader, independent of the writer ---------

uint64_t read_le(std::string_view s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(uint8_t(s[at + i])) << (8 * i);
  return v;
}

// The records of a TFRecord file; every length and data CRC is checked.
std::vector<std::string> read_records(const std::filesystem::path& path) {
  const std::string file = slurp(path);
  std::vector<std::string> out;
  size_t at = 0;
  while (at < file.size()) {
    REQUIRE(at + 12 <= file.size());
    const uint64_t n = read_le(file, at, 8);
    CHECK(read_le(file, at + 8, 4) == masked_crc32c(std::string_view(file).substr(at, 8)));
    REQUIRE(at + 12 + n + 4 <= file.size());
    const std::string data = file.substr(at + 12, n);
    CHECK(read_le(file, at + 12 + n, 4) == masked_crc32c(data));
    out.push_back(data);
    at += 12 + n + 4;
  }
  return out;
}

struct Field {
  int number = 0, wire = 0;
  uint64_t num = 0;   // varint, fixed64, fixed32
  std::string bytes;  // length-delimited
};

uint64_t read_varint(std::string_view s, size_t& at) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    REQUIRE(at < s.size());
    const uint8_t b = uint8_t(s[at++]);
    v |= uint64_t(b & 0x7F) << shift;
    if (!(b & 0x80)) return v;
  }
}

std::vector<Field> decode(std::string_view s) {
  std::vector<Field> out;
  size_t at = 0;
  while (at < s.size()) {
    Field f;
    const uint64_t key = read_varint(s, at);
    f.number = int(key >> 3), f.wire = int(key & 7);
    if (f.wire == 0) {
      f.num = read_varint(s, at);
    } else if (f.wire == 1 || f.wire == 5) {
      const int n = f.wire == 1 ? 8 : 4;
      REQUIRE(at + n <= s.size());
      f.num = read_le(s, at, n);
      at += n;
    } else {
      REQUIRE(f.wire == 2);
      const uint64_t n = read_varint(s, at);
      REQUIRE(at + n <= s.size());
      f.bytes = std::string(s.substr(at, n));
      at += n;
    }
    out.push_back(f);
  }
  return out;
}

// tensorflow.Event with the fields we write; an unexpected field fails.
struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  int session_status = -1;
  std::vector<std::pair<std::string, float>> values;
};

Event decode_event(const std::string& data) {
  Event e;
  for (const Field& f : decode(data)) {
    if (f.number == 1 && f.wire == 1) {
      e.wall_time = std::bit_cast<double>(f.num);
    } else if (f.number == 2 && f.wire == 0) {
      e.step = int64_t(f.num);
    } else if (f.number == 3 && f.wire == 2) {
      e.file_version = f.bytes;
    } else if (f.number == 5 && f.wire == 2) {  // Summary
      for (const Field& v : decode(f.bytes)) {
        REQUIRE((v.number == 1 && v.wire == 2));  // repeated Value value = 1
        std::pair<std::string, float> tv;
        for (const Field& x : decode(v.bytes)) {
          if (x.number == 1 && x.wire == 2)
            tv.first = x.bytes;  // tag
          else if (x.number == 2 && x.wire == 5)
            tv.second = std::bit_cast<float>(uint32_t(x.num));  // simple_value
          else
            FAIL("unexpected Summary.Value field ", x.number);
        }
        e.values.push_back(tv);
      }
    } else if (f.number == 7 && f.wire == 2) {  // SessionLog
      for (const Field& x : decode(f.bytes))
        if (x.number == 1 && x.wire == 0) e.session_status = int(x.num);
    } else {
      FAIL("unexpected Event field ", f.number, " wire ", f.wire);
    }
  }
  return e;
}

std::vector<Event> read_events(const std::filesystem::path& path) {
  std::vector<Event> out;
  for (const auto& r : read_records(path)) out.push_back(decode_event(r));
  return out;
}

}  // namespace

TEST_CASE("train/metrics crc32c is Castagnoli: check value and the RFC 3720 vectors") {
  CHECK(crc32c("123456789") == 0xE3069283u);
  CHECK(crc32c("") == 0u);
  CHECK(crc32c(std::string(32, '\0')) == 0x8A9136AAu);
  std::string ramp;
  for (int i = 0; i < 32; ++i) ramp += char(i);
  CHECK(crc32c(ramp) == 0x46DD794Eu);
  // masked values from tensorboard's own masked_crc32c
  CHECK(masked_crc32c("123456789") == 0xC78AB0E5u);
  CHECK(masked_crc32c("") == 0xA282EAD8u);
  CHECK(masked_crc32c(ramp) == 0x951F7892u);
}

TEST_CASE("train/metrics metrics.jsonl has one object per step in the given order, non-finite as null") {
  TempDir tmp;
  const auto dir = tmp.path / "logs" / "run1";  // created, parents too
  const double t0 = now_s();
  MetricsWriter w(dir, 0);
  CHECK(w.jsonl_path() == dir / "metrics.jsonl");
  w.write(1, {{"train/loss", 2.5}, {"train/lr/lm", 1e-5}, {"train/grad_norm", kNaN}, {"train/tokens", 4096},
              {"time/step_s", kInf}});
  w.write(2, {{"train/loss", 2.25}, {"train/lr/lm", 2e-5}, {"train/grad_norm", 0.75}, {"train/tokens", 8192},
              {"time/step_s", -kInf}});
  const double t1 = now_s();

  // read while the writer is open: each line is on disk when write() returns
  const auto text = slurp(dir / "metrics.jsonl");
  CHECK(text.back() == '\n');
  const auto lines = read_jsonl(dir / "metrics.jsonl");
  REQUIRE(lines.size() == 2);
  const std::vector<std::string> keys{"step", "time", "train/loss", "train/lr/lm", "train/grad_norm", "train/tokens",
                                      "time/step_s"};
  CHECK(keys_of(lines[0]) == keys);
  CHECK(keys_of(lines[1]) == keys);
  CHECK(steps_of(lines) == std::vector<int64_t>{1, 2});
  for (const auto& l : lines) {
    CHECK(l["time"].get<double>() >= t0 - 1e-3);
    CHECK(l["time"].get<double>() <= t1 + 1e-3);
  }
  CHECK(lines[0]["train/loss"].get<double>() == 2.5);
  CHECK(lines[0]["train/lr/lm"].get<double>() == 1e-5);
  CHECK(lines[0]["train/grad_norm"].is_null());
  CHECK(lines[0]["train/tokens"].get<double>() == 4096);
  CHECK(lines[0]["time/step_s"].is_null());
  CHECK(lines[1]["train/loss"].get<double>() == 2.25);
  CHECK(lines[1]["train/lr/lm"].get<double>() == 2e-5);
  CHECK(lines[1]["train/grad_norm"].get<double>() == 0.75);
  CHECK(lines[1]["time/step_s"].is_null());
}

TEST_CASE("train/metrics a resumed run keeps the steps up to the resume step, then appends") {
  TempDir tmp;
  {
    MetricsWriter w(tmp.path, 0);
    for (int64_t s = 1; s <= 5; ++s) w.write(s, {{"train/loss", double(s)}});
  }
  {
    MetricsWriter w(tmp.path, 3);
    w.write(4, {{"train/loss", 40.0}});
  }
  const auto lines = read_jsonl(tmp.path / "metrics.jsonl");
  CHECK(steps_of(lines) == std::vector<int64_t>{1, 2, 3, 4});
  CHECK(lines[2]["train/loss"].get<double>() == 3.0);
  CHECK(lines[3]["train/loss"].get<double>() == 40.0);  // the resumed run's step 4
  // no temporary left behind; one event file per run
  const auto names = testing::names_in(tmp.path);
  CHECK(names.size() == 3);
  CHECK(event_files(tmp.path).size() == 2);
}

TEST_CASE("train/metrics resuming drops a line a crash cut short") {
  TempDir tmp;
  {
    MetricsWriter w(tmp.path, 0);
    for (int64_t s = 1; s <= 3; ++s) w.write(s, {{"train/loss", 1.0}});
  }
  std::ofstream(tmp.path / "metrics.jsonl", std::ios::app) << R"({"step": 4, "time": 17000)";
  {
    MetricsWriter w(tmp.path, 5);
    w.write(6, {{"train/loss", 6.0}});
  }
  CHECK(steps_of(read_jsonl(tmp.path / "metrics.jsonl")) == std::vector<int64_t>{1, 2, 3, 6});
}

TEST_CASE("train/metrics a fresh run (resume step 0) starts metrics.jsonl empty") {
  TempDir tmp;
  {
    MetricsWriter w(tmp.path, 0);
    w.write(1, {{"train/loss", 1.0}});
    w.write(2, {{"train/loss", 1.0}});
  }
  MetricsWriter w(tmp.path, 0);
  CHECK(slurp(tmp.path / "metrics.jsonl").empty());
  w.write(1, {{"train/loss", 9.0}});
  const auto lines = read_jsonl(tmp.path / "metrics.jsonl");
  CHECK(steps_of(lines) == std::vector<int64_t>{1});
  CHECK(lines[0]["train/loss"].get<double>() == 9.0);
}

TEST_CASE("train/metrics the event file is TFRecords of Events: file_version, SessionLog START, one Summary per step") {
  TempDir tmp;
  const double t0 = now_s();
  // The name's seconds come from std::time, glibc's coarse clock, which can
  // trail system_clock by a tick: the window for them is taken on it too.
  const int64_t secs0 = int64_t(std::time(nullptr));
  MetricsWriter w(tmp.path, 0);
  w.write(1, {{"train/loss", 2.5}, {"train/lr/lm", 1e-5}, {"train/tokens_per_s", 1234.5}});
  w.write(2, {{"train/loss", 2.25}, {"train/grad_norm", kNaN}});
  w.write(300, {{"train/loss", 0.125}});
  const double t1 = now_s();
  const int64_t secs1 = int64_t(std::time(nullptr));

  const auto files = event_files(tmp.path);
  REQUIRE(files.size() == 1);
  CHECK(files[0] == w.events_path());
  const std::string name = files[0].filename().string();
  // events.out.tfevents.<unix s>.<host>.<pid>.areno
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string prefix = "events.out.tfevents.";
  REQUIRE(name.rfind(prefix, 0) == 0);
  const size_t dot = name.find('.', prefix.size());
  const int64_t secs = std::stoll(name.substr(prefix.size(), dot - prefix.size()));
  CHECK(secs >= secs0);
  CHECK(secs <= secs1);
  CHECK(name.substr(dot) == fmt::format(".{}.{}.areno", host, ::getpid()));

  // read while the writer is open: each event is on disk when write() returns
  const auto events = read_events(files[0]);
  REQUIRE(events.size() == 5);
  CHECK(events[0].file_version == "brain.Event:2");
  CHECK(events[0].values.empty());
  CHECK(events[1].session_status == 1);  // START at step 1: a fresh run
  CHECK(events[1].step == 1);
  CHECK(events[1].values.empty());
  for (const auto& e : events) {
    CHECK(e.wall_time >= t0 - 1e-3);
    CHECK(e.wall_time <= t1 + 1e-3);
  }
  CHECK(events[2].step == 1);
  REQUIRE(events[2].values.size() == 3);
  CHECK(events[2].values[0] == std::pair<std::string, float>{"train/loss", 2.5f});
  CHECK(events[2].values[1] == std::pair<std::string, float>{"train/lr/lm", 1e-5f});
  CHECK(events[2].values[2] == std::pair<std::string, float>{"train/tokens_per_s", 1234.5f});
  CHECK(events[3].step == 2);
  REQUIRE(events[3].values.size() == 2);
  CHECK(events[3].values[0] == std::pair<std::string, float>{"train/loss", 2.25f});
  CHECK(events[3].values[1].first == "train/grad_norm");
  CHECK(std::isnan(events[3].values[1].second));
  CHECK(events[4].step == 300);  // a two-byte varint
  CHECK(events[4].values == std::vector<std::pair<std::string, float>>{{"train/loss", 0.125f}});
}

TEST_CASE("train/metrics a resumed run's event file has its SessionLog START at resume + 1") {
  TempDir tmp;
  {
    MetricsWriter w(tmp.path, 0);
    for (int64_t s = 1; s <= 5; ++s) w.write(s, {{"train/loss", double(s)}});
  }
  MetricsWriter w(tmp.path, 3);
  w.write(4, {{"train/loss", 40.0}});
  const auto files = event_files(tmp.path);
  REQUIRE(files.size() == 2);
  CHECK(files[0] != w.events_path());
  CHECK(read_events(files[0]).size() == 7);  // the first run's file is left as it was
  const auto events = read_events(w.events_path());
  REQUIRE(events.size() == 3);
  CHECK(events[0].file_version == "brain.Event:2");
  CHECK(events[1].session_status == 1);  // START: TensorBoard drops the steps >= 4 seen before it
  CHECK(events[1].step == 4);
  CHECK(events[2].step == 4);
  CHECK(events[2].values == std::vector<std::pair<std::string, float>>{{"train/loss", 40.0f}});
}

TEST_CASE("train/metrics errors name the path and the reason") {
  TempDir tmp;
  std::ofstream(tmp.path / "plain_file") << "x";
  const auto bad = tmp.path / "plain_file" / "logs";
  const std::string err = testing::error_of([&] { MetricsWriter w(bad, 0); });
  CHECK(err.find(bad.string()) != std::string::npos);
  CHECK(err.find("Not a directory") != std::string::npos);

  MetricsWriter w(tmp.path / "logs", 0);
  w.write(1, {{"train/loss", 1.0}});
  const std::string full = [&] {
    testing::FileSizeLimit limit(4096);  // a full disk
    return testing::error_of([&] { w.write(2, {{std::string(5000, 'x'), 1.0}}); });
  }();
  CHECK(full.find((tmp.path / "logs" / "metrics.jsonl").string()) != std::string::npos);
  CHECK(full.find("File too large") != std::string::npos);
}

TEST_CASE("train/metrics format_duration: seconds, minutes, hours") {
  CHECK(format_duration(0) == "0s");
  CHECK(format_duration(59.4) == "59s");
  CHECK(format_duration(59.6) == "1m00s");
  CHECK(format_duration(62) == "1m02s");
  CHECK(format_duration(3600) == "1h00m00s");
  CHECK(format_duration(7446) == "2h04m06s");
  CHECK(format_duration(100 * 3600.0) == "100h00m00s");
  CHECK(format_duration(-1) == "?");
  CHECK(format_duration(kNaN) == "?");
  CHECK(format_duration(kInf) == "?");
}

TEST_CASE("train/metrics format_progress gives the one-line progress") {
  ProgressInfo p{12, 300, 2.34561, {{"lm", 1e-5}, {"projector", 5e-5}}, 0.8734, 1234.4, 62};
  CHECK(format_progress(p) ==
        "step 12/300  loss 2.3456  lr lm 1.00e-05 projector 5.00e-05  grad_norm 0.873  tok/s 1234  elapsed 1m02s"
        "  eta 24m48s");  // 62 / 12 * 288 = 1488 s

  p = {1, 3, 0.5, {}, 12.5, 99.6, 3723};  // no lr groups: no "lr"
  CHECK(format_progress(p) == "step 1/3  loss 0.5000  grad_norm 12.500  tok/s 100  elapsed 1h02m03s  eta 2h04m06s");

  p = {0, 300, kNaN, {{"lm", 0}}, kNaN, 0, 0};  // before the first step
  CHECK(format_progress(p) == "step 0/300  loss nan  lr lm 0.00e+00  grad_norm nan  tok/s 0  elapsed 0s  eta ?");

  p = {5, 0, 1.0, {{"lm", 3e-4}}, 1.0, 10, 7};  // total unknown: no ETA
  CHECK(format_progress(p) == "step 5  loss 1.0000  lr lm 3.00e-04  grad_norm 1.000  tok/s 10  elapsed 7s");

  p = {300, 300, 1.0, {}, 1.0, 10, 600};  // the last step
  CHECK(format_progress(p) == "step 300/300  loss 1.0000  grad_norm 1.000  tok/s 10  elapsed 10m00s  eta 0s");
}

TEST_CASE("train/metrics peak_rss_bytes reads VmHWM") {
  std::vector<char> buffer(64 << 20);
  std::memset(buffer.data(), 1, buffer.size());  // touched, so resident
  const int64_t peak = peak_rss_bytes();
  CHECK(peak >= int64_t(64) << 20);
  CHECK(peak % 1024 == 0);
  CHECK(buffer[buffer.size() / 2] == 1);
}
