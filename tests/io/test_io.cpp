// safetensors: bit-exact interoperability with the Python package (both
// directions), device round trips, sharded checkpoints, malformed files.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "nn/io/safetensors.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

using namespace areno;
using areno::testing::error_of;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  REQUIRE_MESSAGE(bool(in), "cannot open " << p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  REQUIRE(bool(out));
}

// A fresh directory per test case, removed afterwards.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("areno_test_io_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// The bytes of a tensor in row-major order, from any device and strides.
std::string bytes_of(const Tensor& t) {
  Tensor c = t.to(Device::cpu()).contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

std::string to_hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (unsigned char b : bytes) {
    s += d[b >> 4];
    s += d[b & 15];
  }
  return s;
}

// Tensors mirrored by areno_expected() in tests/reference/io/make_golden.py.
std::vector<std::pair<std::string, Tensor>> areno_tensors() {
  std::vector<double> w(12), h(6);
  for (int i = 0; i < 12; ++i) w[i] = (i - 5) * 0.25;
  for (int i = 0; i < 6; ++i) h[i] = i * 0.5 - 1;
  std::vector<std::pair<std::string, Tensor>> ts;
  ts.emplace_back("weight", from_vector(w, {3, 4}, DType::f32));
  ts.emplace_back("half", from_vector(h, {2, 3}, DType::f16));
  ts.emplace_back("brain", from_vector(std::vector<double>{1.0, -2.5, 3.140625, 0.0}, {4}, DType::bf16));
  ts.emplace_back("double", from_vector(std::vector<double>{2.718281828459045}, {}, DType::f64));
  ts.emplace_back("ids", from_vector(std::vector<int64_t>{-1, 0, int64_t(1) << 40}, {3}, DType::i64));
  ts.emplace_back("count", from_vector(std::vector<int32_t>{7, -7}, {2}, DType::i32));
  ts.emplace_back("mask", from_vector(std::vector<double>{1, 0, 1, 0, 1}, {5}, DType::boolean));
  ts.emplace_back("empty", zeros({0, 2}, DType::f32));
  ts.emplace_back("transposed",
                  from_vector(std::vector<double>{0, 1, 2, 3, 4, 5}, {2, 3}, DType::f32).t());
  return ts;
}

// Builds a safetensors file from a header text and a data buffer.
std::string st_bytes(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = char((n >> (8 * i)) & 0xff);
  return out + header + data;
}

}  // namespace

TEST_CASE("io/golden file written by python safetensors loads bit-exactly") {
  const json expected = json::parse(read_file("tests/data/io/golden.json"));
  SafetensorsFile f("tests/data/io/golden.safetensors");
  CHECK(f.names().size() == expected["tensors"].size());
  std::map<std::string, std::string> md = expected["metadata"].get<std::map<std::string, std::string>>();
  CHECK(f.metadata() == md);
  for (auto it = expected["tensors"].begin(); it != expected["tensors"].end(); ++it) {
    const std::string& name = it.key();
    const json& e = it.value();
    CAPTURE(name);
    REQUIRE(f.contains(name));
    const SafetensorsEntry& entry = f.entry(name);
    CHECK(safetensors_dtype_name(entry.dtype) == e["dtype"].get<std::string>());
    CHECK(entry.shape == e["shape"].get<Shape>());
    Tensor t = f.load(name);
    CHECK(t.device() == Device::cpu());
    CHECK(t.dtype() == entry.dtype);
    CHECK(t.shape() == entry.shape);
    CHECK(to_hex(bytes_of(t)) == e["hex"].get<std::string>());
    CHECK(to_hex(bytes_of(f.load_copy(name))) == e["hex"].get<std::string>());
    // the values, as our dtype conversions read them
    std::vector<double> got = t.to_vector<double>();
    REQUIRE(got.size() == e["values"].size());
    for (size_t i = 0; i < got.size(); ++i) {
      if (e["values"][i].is_null()) {
        CHECK(!std::isfinite(got[i]));
      } else {
        CHECK(got[i] == e["values"][i].get<double>());
      }
    }
  }
  // i64 beyond 2^53 must not go through doubles
  CHECK(f.load("i64").to_vector<int64_t>() ==
        std::vector<int64_t>{-(int64_t(1) << 62), 0, (int64_t(1) << 40) + 1});
}

TEST_CASE("io/our writer's file is the one python verified") {
  // tests/reference/io/make_golden.py --verify loaded the committed file with
  // the Python package (log: tests/data/io/written_by_areno.verify.txt); the
  // writer must still produce exactly those bytes.
  TempDir dir("writer");
  const std::string path = dir.file("written.safetensors");
  save_safetensors(path, areno_tensors(), {{"writer", "areno"}, {"format", "pt"}});
  const std::string ours = read_file(path);
  if (std::getenv("ARENO_UPDATE_GOLDEN") != nullptr)
    write_file("tests/data/io/written_by_areno.safetensors", ours);
  CHECK(ours == read_file("tests/data/io/written_by_areno.safetensors"));
  const std::string verify = read_file("tests/data/io/written_by_areno.verify.txt");
  CHECK(verify.find("RESULT: PASS") != std::string::npos);

  // layout rules shared with the Python package
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(ours[size_t(i)]);
  CHECK(n % 8 == 0);
  CHECK(ours[8] == '{');
  CHECK(ours[8 + n - 1] != '\0');
  SafetensorsFile f(path);
  for (const auto& name : f.names()) {
    const auto& e = f.entry(name);
    CHECK(e.begin % dtype_size(e.dtype) == 0);  // every tensor aligned for its dtype
  }
  // and reading it back gives the tensors we wrote
  for (const auto& [name, t] : areno_tensors()) {
    CAPTURE(name);
    Tensor back = f.load(name);
    CHECK(back.dtype() == t.dtype());
    CHECK(back.shape() == t.shape());
    CHECK(bytes_of(back) == bytes_of(t));
  }
  CHECK(f.load("transposed").to_vector<double>() == std::vector<double>{0, 3, 1, 4, 2, 5});
}

DEVICE_TEST_CASE("io/save and load round trip every dtype from the device") {
  TempDir dir("device_" + device.str().substr(0, 3));
  std::vector<std::pair<std::string, Tensor>> ts;
  std::vector<double> v(24);
  for (int i = 0; i < 24; ++i) v[i] = (i % 7) * 1.25 - 3.0;
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64,
                  DType::boolean}) {
    if (device.is_cuda() && t == DType::f64) continue;  // f64 lives on the CPU
    std::vector<double> vals = v;
    if (t == DType::boolean)
      for (double& x : vals) x = x > 0 ? 1 : 0;
    Tensor base = from_vector(vals, {4, 6}, t).to(device);
    const std::string n(dtype_name(t));
    ts.emplace_back(n + ".contig", base);
    ts.emplace_back(n + ".transposed", base.t());                       // [6, 4], strided
    ts.emplace_back(n + ".sliced", base.slice(1, 1, 6, 2));             // [4, 3], offset
    ts.emplace_back(n + ".scalar", base.select(0, 2).select(0, 3));     // 0-d
    ts.emplace_back(n + ".empty", base.narrow(0, 0, 0));                 // [0, 6]
  }
  const std::string path = dir.file("round.safetensors");
  save_safetensors(path, ts);
  SafetensorsFile f(path);
  CHECK(f.names().size() == ts.size());
  for (const auto& [name, t] : ts) {
    CAPTURE(name);
    Tensor back = f.load(name);
    CHECK(back.dtype() == t.dtype());
    CHECK(back.shape() == t.shape());
    CHECK(bytes_of(back) == bytes_of(t));
    // and onto the device again
    CHECK(bytes_of(back.to(device)) == bytes_of(t));
  }
  // load_safetensors: the whole file in data order
  auto all = load_safetensors(path);
  CHECK(all.size() == ts.size());
}

TEST_CASE("io/loaded tensors view the mapping copy-on-write") {
  TempDir dir("cow");
  const std::string path = dir.file("cow.safetensors");
  save_safetensors(path, {{"x", full({3}, 2.0)}});
  const std::string before = read_file(path);
  {
    SafetensorsFile f(path);
    Tensor x = f.load("x");
    x.fill_(7.0);  // writes into the private mapping, not the file
    CHECK(x.to_vector<double>() == std::vector<double>{7, 7, 7});
    CHECK(f.load("x").to_vector<double>() == std::vector<double>{7, 7, 7});
  }
  CHECK(read_file(path) == before);
  // a tensor outlives its SafetensorsFile (the mapping is shared)
  Tensor kept = SafetensorsFile(path).load("x");
  CHECK(kept.to_vector<double>() == std::vector<double>{2, 2, 2});
  // rewriting the file does not disturb an existing view (write + rename)
  save_safetensors(path, {{"x", full({3}, 5.0)}});
  CHECK(kept.to_vector<double>() == std::vector<double>{2, 2, 2});
  CHECK(SafetensorsFile(path).load("x").to_vector<double>() == std::vector<double>{5, 5, 5});
}

TEST_CASE("io/sharded checkpoint round trip is bitwise") {
  TempDir dir("sharded");
  std::vector<std::pair<std::string, Tensor>> ts;
  Generator gen(7);
  for (int i = 0; i < 7; ++i) {
    DType t = i % 3 == 0 ? DType::bf16 : i % 3 == 1 ? DType::f32 : DType::i64;
    Tensor x = rand_normal({int64_t(3 + i), 4}, gen, 0.0, 3.0, DType::f32);
    ts.emplace_back("layers." + std::to_string(i) + ".weight", x.to(t));
  }
  ts.emplace_back("scalar", scalar_tensor(1.5, DType::f16));
  uint64_t total = 0;
  for (const auto& kv : ts) total += kv.second.nbytes();

  const auto files = save_safetensors_sharded(dir.path.string(), ts, 200, {{"format", "pt"}});
  // tensors of 48..288 bytes, at most 200 per shard (a larger one alone)
  REQUIRE(files.size() >= 4);
  const size_t nshards = files.size() - 1;
  char first[64];
  std::snprintf(first, sizeof first, "model-00001-of-%05zu.safetensors", nshards);
  CHECK(files.front() == first);
  CHECK(files.back() == "model.safetensors.index.json");
  const json index = json::parse(read_file(dir.path / "model.safetensors.index.json"));
  CHECK(index["metadata"]["total_size"].get<uint64_t>() == total);
  CHECK(index["weight_map"].size() == ts.size());
  for (size_t s = 0; s < nshards; ++s) {
    SafetensorsFile shard(dir.file(files[s]));
    uint64_t bytes = 0;
    for (const auto& n : shard.names()) bytes += shard.entry(n).end - shard.entry(n).begin;
    CHECK((bytes <= 200 || shard.names().size() == 1));
    CHECK(shard.metadata().at("format") == "pt");
  }

  for (const std::string& open : {dir.path.string(), dir.file("model.safetensors.index.json")}) {
    CAPTURE(open);
    SafetensorsCheckpoint ck(open);
    CHECK(ck.files().size() == nshards);
    CHECK(ck.names().size() == ts.size());
    CHECK(ck.metadata().at("total_size") == std::to_string(total));
    for (const auto& [name, t] : ts) {
      CAPTURE(name);
      REQUIRE(ck.contains(name));
      CHECK(index["weight_map"][name].get<std::string>() ==
            fs::path(ck.file_of(name).path()).filename().string());
      Tensor back = ck.load(name);
      CHECK(back.dtype() == t.dtype());
      CHECK(back.shape() == t.shape());
      CHECK(bytes_of(back) == bytes_of(t));
    }
  }

  // everything fits in one shard: model.safetensors, no index (as transformers)
  TempDir one("sharded_one");
  CHECK(save_safetensors_sharded(one.path.string(), ts, 1 << 20) ==
        std::vector<std::string>{"model.safetensors"});
  CHECK(!fs::exists(one.path / "model.safetensors.index.json"));
  SafetensorsCheckpoint ck(one.path.string());
  CHECK(ck.files().size() == 1);
  for (const auto& [name, t] : ts) CHECK(bytes_of(ck.load(name)) == bytes_of(t));
}

TEST_CASE("io/malformed files are rejected with the file and tensor named") {
  TempDir dir("malformed");
  const std::string f32x4 = std::string(16, '\0');
  struct Case {
    const char* label;
    std::string bytes;
    std::vector<std::string> expect;  // substrings of the message
  };
  std::string huge(8, '\0');
  huge[5] = 1;  // header length 2^40
  std::string past(8, '\0');
  past[0] = char(200);
  past += "{}";
  const std::vector<Case> cases = {
      {"short", "abc", {"shorter than the 8-byte header length"}},
      {"empty", "", {"shorter than the 8-byte header length"}},
      {"header_past_end", past, {"runs past the end of the file"}},
      {"header_huge", huge + "{}", {"exceeds"}},
      {"not_json", st_bytes("{\"w\": {\"dtype\": "), {"header is not valid JSON"}},
      {"not_utf8", st_bytes("{\"\xff\": 1}"), {"header is not valid JSON"}},
      {"not_object", st_bytes("[1, 2, 3]"), {"must be a JSON object", "array"}},
      {"entry_not_object", st_bytes("{\"w\": 5}"), {"tensor 'w'", "entry must be an object"}},
      {"missing_dtype", st_bytes(R"({"w": {"shape": [4], "data_offsets": [0, 16]}})", f32x4),
       {"tensor 'w'", "missing \"dtype\""}},
      {"missing_shape", st_bytes(R"({"w": {"dtype": "F32", "data_offsets": [0, 16]}})", f32x4),
       {"tensor 'w'", "missing \"shape\""}},
      {"missing_offsets", st_bytes(R"({"w": {"dtype": "F32", "shape": [4]}})", f32x4),
       {"tensor 'w'", "missing \"data_offsets\""}},
      {"unknown_dtype", st_bytes(R"({"w": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}})", f32x4),
       {"tensor 'w'", "unknown dtype 'Q7'"}},
      {"unsupported_dtype",
       st_bytes(R"({"w": {"dtype": "F8_E4M3", "shape": [16], "data_offsets": [0, 16]}})", f32x4),
       {"tensor 'w'", "F8_E4M3 is not supported"}},
      {"negative_shape", st_bytes(R"({"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}})", f32x4),
       {"tensor 'w'", "not a non-negative integer"}},
      {"fractional_shape", st_bytes(R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 16]}})", f32x4),
       {"tensor 'w'", "not a non-negative integer"}},
      {"overflowing_shape",
       st_bytes(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 16]}})", f32x4),
       {"tensor 'w'", "64 bits"}},
      {"offsets_past_end", st_bytes(R"({"w": {"dtype": "F32", "shape": [100], "data_offsets": [0, 400]}})", f32x4),
       {"tensor 'w'", "run past the end of the data"}},
      {"offsets_reversed", st_bytes(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", f32x4),
       {"tensor 'w'", "reversed"}},
      {"offsets_arity", st_bytes(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", f32x4),
       {"tensor 'w'", "two non-negative integers"}},
      {"offsets_negative", st_bytes(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", f32x4),
       {"tensor 'w'", "two non-negative integers"}},
      {"size_mismatch", st_bytes(R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})", f32x4),
       {"tensor 'w'", "hold 12 bytes", "needs 4 x 4"}},
      {"overlap",
       st_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", f32x4),
       {"tensor 'b'", "overlaps tensor 'a'"}},
      {"overlap_across_empty",
       st_bytes(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
                R"( "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},)"
                R"( "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})", f32x4),
       {"tensor 'b'", "overlaps tensor 'a'"}},
      {"duplicate_name",
       st_bytes(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                R"( "w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})", f32x4),
       {"key 'w' twice", "duplicate tensor name"}},
      {"metadata_not_strings", st_bytes(R"({"__metadata__": {"step": 3}})"), {"__metadata__", "not a string"}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.label);
    const std::string path = dir.file(std::string(c.label) + ".safetensors");
    write_file(path, c.bytes);
    const std::string msg = error_of([&] { SafetensorsFile f(path); });
    CHECK_MESSAGE(msg.find(path) != std::string::npos, msg);
    for (const auto& s : c.expect) CHECK_MESSAGE(msg.find(s) != std::string::npos, msg);
  }

  // errors found when the data is read
  {
    const std::string path = dir.file("bad_bool.safetensors");
    write_file(path, st_bytes(R"({"m": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}})",
                              std::string("\x01\x02\x00", 3)));
    SafetensorsFile f(path);
    const std::string msg = error_of([&] { f.load("m"); });
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find("tensor 'm'") != std::string::npos);
    CHECK(msg.find("byte value 2") != std::string::npos);
    CHECK(error_of([&] { f.load("nope"); }).find("no tensor named 'nope'") != std::string::npos);
  }
  CHECK(error_of([&] { SafetensorsFile f(dir.file("missing.safetensors")); }).find("cannot open") !=
        std::string::npos);

  // a misaligned (foreign writer) tensor still loads, as an aligned copy
  {
    const std::string path = dir.file("misaligned.safetensors");
    std::string data(6, '\0');
    float one = 1.0f;
    std::memcpy(&data[2], &one, 4);
    write_file(path, st_bytes(R"({"pad": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]},)"
                              R"( "x": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}})",
                              data));
    Tensor x = SafetensorsFile(path).load("x");
    CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0);
    CHECK(x.item() == 1.0);
  }

  // sharded checkpoints: broken indexes
  save_safetensors(dir.file("shard1.safetensors"), {{"a", ones({2})}});
  struct IndexCase {
    const char* label;
    std::string text;
    std::vector<std::string> expect;
  };
  const std::vector<IndexCase> index_cases = {
      {"missing_shard", R"({"weight_map": {"a": "shard1.safetensors", "b": "shard2.safetensors"}})",
       {"shard 'shard2.safetensors'", "tensor 'b'", "does not exist"}},
      {"absent_tensor", R"({"weight_map": {"a": "shard1.safetensors", "c": "shard1.safetensors"}})",
       {"tensor 'c'", "shard1.safetensors", "no such tensor"}},
      {"not_json", R"({"weight_map": )", {"not valid JSON"}},
      {"no_weight_map", R"({"metadata": {}})", {"weight_map"}},
      {"duplicate", R"({"weight_map": {"a": "shard1.safetensors", "a": "shard1.safetensors"}})",
       {"key 'a' twice"}},
  };
  for (const auto& c : index_cases) {
    CAPTURE(c.label);
    const std::string path = dir.file(std::string(c.label) + ".index.json");
    write_file(path, c.text);
    const std::string msg = error_of([&] { SafetensorsCheckpoint ck(path); });
    CHECK_MESSAGE(msg.find(path) != std::string::npos, msg);
    for (const auto& s : c.expect) CHECK_MESSAGE(msg.find(s) != std::string::npos, msg);
  }
  CHECK(error_of([&] { SafetensorsCheckpoint ck(dir.file("nothing_here")); }) != "");
  // a directory without a checkpoint
  TempDir empty_dir("no_ckpt");
  CHECK(error_of([&] { SafetensorsCheckpoint ck(empty_dir.path.string()); }).find("neither") !=
        std::string::npos);
}

TEST_CASE("io/randomly corrupted files load or throw, never crash") {
  // Byte flips, truncations and header-length changes of a valid file: each
  // must either open and load every tensor or throw a std::exception (run
  // under -fsanitize=address,undefined to also catch silent UB).
  TempDir dir("fuzz");
  const std::string good = read_file("tests/data/io/golden.safetensors");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(good[size_t(i)]);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&] {  // xorshift64
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  const std::string path = dir.file("fuzz.safetensors");
  int opened = 0, rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bytes = good;
    switch (trial % 4) {
      case 0:  // flip a header byte to a JSON-significant character
        bytes[8 + next() % n] = "{}[]\",:-0123456789e. "[next() % 21];
        break;
      case 1:  // random bytes anywhere
        for (int k = 0; k < 3; ++k) bytes[next() % bytes.size()] = char(next());
        break;
      case 2:  // truncate
        bytes.resize(next() % bytes.size());
        break;
      case 3:  // change the header length
        bytes[next() % 3] = char(next());
        break;
    }
    write_file(path, bytes);
    try {
      SafetensorsFile f(path);
      for (const auto& name : f.names()) {
        Tensor t = f.load(name);
        CHECK(t.nbytes() == f.entry(name).end - f.entry(name).begin);
      }
      ++opened;
    } catch (const std::exception& e) {
      CHECK(std::string(e.what()).find(path) != std::string::npos);
      ++rejected;
    }
  }
  MESSAGE("corrupted files: " << opened << " opened, " << rejected << " rejected");
  CHECK(rejected > 1000);
  CHECK(opened > 20);  // data-only damage keeps the file readable
}

TEST_CASE("io/writer rejects bad input") {
  TempDir dir("writer_bad");
  const std::string p = dir.file("x.safetensors");
  CHECK(error_of([&] { save_safetensors(p, {{"a", ones({1})}, {"a", ones({1})}}); }).find("given twice") !=
        std::string::npos);
  CHECK(error_of([&] { save_safetensors(p, {{"__metadata__", ones({1})}}); }).find("reserved") !=
        std::string::npos);
  CHECK(error_of([&] { save_safetensors(p, {{"", ones({1})}}); }).find("empty tensor name") !=
        std::string::npos);
  CHECK(error_of([&] { save_safetensors(p, {{"u", Tensor()}}); }).find("undefined") != std::string::npos);
  CHECK(error_of([&] { save_safetensors(dir.file("no/such/dir/x.safetensors"), {{"a", ones({1})}}); })
            .find("cannot create") != std::string::npos);
  CHECK(!fs::exists(p));
}
