// The one file writer (nn/io/atomic_file.h), saving into a folder that holds
// an older checkpoint (stale shards and index), a save that runs out of disk,
// and the non-finite weight check (nn/io/finite.h).
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "nn/io/atomic_file.h"
#include "nn/io/finite.h"
#include "nn/io/safetensors.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

using namespace areno;
using namespace areno::testing;  // TempDir, names_in, FileSizeLimit, error_of
namespace fs = std::filesystem;

namespace {

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

using Named = std::vector<std::pair<std::string, Tensor>>;

// Three tensors of a checkpoint, every element `value`: a small one, a large
// one (alone in its shard at 50 kB per shard) and a small one.
Named checkpoint_tensors(float value, int64_t large_rows = 8192) {
  return {{"a.weight", full({16}, value)},
          {"b.weight", full({large_rows, 4}, value)},
          {"c.weight", full({16}, value)}};
}

// Every tensor of the checkpoint in `dir` holds `value` only, and it has exactly `names`.
void check_checkpoint(const std::string& dir, float value, const std::vector<std::string>& names) {
  SafetensorsCheckpoint ck(dir);
  CHECK(ck.names() == names);
  for (const auto& n : ck.names()) {
    CAPTURE(n);
    const std::vector<float> v = ck.load(n).to_vector<float>();
    CHECK(std::all_of(v.begin(), v.end(), [&](float x) { return x == value; }));
  }
}

const std::vector<std::string> kNames{"a.weight", "b.weight", "c.weight"};

}  // namespace

TEST_CASE("io/atomic file: the target changes only on commit, and no temporary is left") {
  TempDir dir;
  const std::string target = dir.str("config.json");
  write_file_atomic(target, "old\n");
  CHECK(slurp(target) == "old\n");
  {
    AtomicFile f(target);
    f.write("new contents");
    CHECK(fs::path(f.temp_path()).parent_path() == dir.path);  // same folder: the rename is atomic
    CHECK(slurp(target) == "old\n");
    f.finish();
    CHECK(slurp(target) == "old\n");
    // destroyed without commit: the old file stays, the temporary goes
  }
  CHECK(slurp(target) == "old\n");
  CHECK(names_in(dir.path) == std::vector<std::string>{"config.json"});
  {
    AtomicFile f(target);
    f.write("new contents");
    f.commit();
  }
  CHECK(slurp(target) == "new contents");
  CHECK(names_in(dir.path) == std::vector<std::string>{"config.json"});
  // A folder that does not exist: the error names the file and the reason.
  const std::string e = error_of([&] { write_file_atomic(dir.str("missing/x.json"), "x"); });
  CHECK(e.find("missing/x.json") != std::string::npos);
  CHECK(e.find("No such file or directory") != std::string::npos);
}

TEST_CASE("io/atomic file: a write past the disk's end fails naming the file and keeps the old one") {
  TempDir dir;
  const std::string target = dir.str("tokenizer.json");
  write_file_atomic(target, "old tokenizer");
  std::string e;
  {
    FileSizeLimit limit(4096);
    e = error_of([&] { write_file_atomic(target, std::string(10000, 'x')); });
  }
  CHECK(e.find(target) != std::string::npos);
  CHECK(e.find("File too large") != std::string::npos);
  CHECK(slurp(target) == "old tokenizer");
  CHECK(names_in(dir.path) == std::vector<std::string>{"tokenizer.json"});
}

TEST_CASE("io/a file set puts every file in place only when all are written") {
  TempDir dir;
  write_file_atomic(dir.str("a"), "old a");
  write_file_atomic(dir.str("b"), "old b");
  {
    FileSet set;
    set.add(dir.str("a")).write("new a");
    set.add(dir.str("b")).write("new b");
    // not committed (an exception on the way): nothing changes
  }
  CHECK(slurp(dir.str("a")) == "old a");
  CHECK(slurp(dir.str("b")) == "old b");
  CHECK(names_in(dir.path) == std::vector<std::string>{"a", "b"});
  FileSet set;
  set.add(dir.str("a")).write("new a");
  set.add(dir.str("b")).write("new b");
  set.commit();
  CHECK(slurp(dir.str("a")) == "new a");
  CHECK(slurp(dir.str("b")) == "new b");
}

TEST_CASE("io/saving into a folder with an older layout removes its stale index and shards") {
  SUBCASE("sharded, then one file: the stale index must not win") {
    TempDir dir;
    CHECK(save_safetensors_sharded(dir.str(), checkpoint_tensors(1.0f), 50000).size() == 4);
    CHECK(save_safetensors_sharded(dir.str(), checkpoint_tensors(2.0f, 16), 50000) ==
          std::vector<std::string>{"model.safetensors"});
    CHECK(names_in(dir.path) == std::vector<std::string>{"model.safetensors"});
    check_checkpoint(dir.str(), 2.0f, kNames);
  }
  SUBCASE("one file, then sharded: the stale model.safetensors goes") {
    TempDir dir;
    save_safetensors_sharded(dir.str(), checkpoint_tensors(1.0f, 16), 50000);
    save_safetensors_sharded(dir.str(), checkpoint_tensors(2.0f), 50000);
    CHECK(names_in(dir.path) == std::vector<std::string>{"model-00001-of-00003.safetensors",
                                                  "model-00002-of-00003.safetensors",
                                                  "model-00003-of-00003.safetensors",
                                                  "model.safetensors.index.json"});
    check_checkpoint(dir.str(), 2.0f, kNames);
  }
  SUBCASE("three shards, then two: the third old shard goes, other files stay") {
    TempDir dir;
    save_safetensors_sharded(dir.str(), checkpoint_tensors(1.0f), 50000);
    write_file_atomic(dir.str("config.json"), "{}");
    write_file_atomic(dir.str("model-notes.safetensors"), "not a shard name");
    const Named two{{"a.weight", full({16}, 2.0f)}, {"b.weight", full({8192, 4}, 2.0f)}};
    save_safetensors_sharded(dir.str(), two, 50000);
    CHECK(names_in(dir.path) == std::vector<std::string>{"config.json", "model-00001-of-00002.safetensors",
                                                  "model-00002-of-00002.safetensors", "model-notes.safetensors",
                                                  "model.safetensors.index.json"});
    check_checkpoint(dir.str(), 2.0f, {"a.weight", "b.weight"});
  }
}

TEST_CASE("io/a sharded save that runs out of disk leaves the previous checkpoint loadable") {
  TempDir dir;
  save_safetensors_sharded(dir.str(), checkpoint_tensors(1.0f), 50000);
  const std::vector<std::string> before = names_in(dir.path);
  std::string e;
  {
    // The first shard (a.weight, under 1 kB) fits; the second (128 kB) does not.
    FileSizeLimit limit(16384);
    e = error_of([&] { save_safetensors_sharded(dir.str(), checkpoint_tensors(2.0f), 50000); });
  }
  CHECK(e.find(dir.str("model-00002-of-00003.safetensors")) != std::string::npos);
  CHECK(e.find("File too large") != std::string::npos);
  CHECK(names_in(dir.path) == before);  // no temporary left, nothing replaced
  check_checkpoint(dir.str(), 1.0f, kNames);
}

TEST_CASE("io/non-finite values are found in every floating dtype") {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(t));
    CHECK_FALSE(first_nonfinite(from_vector(std::vector<double>{0, -1e-30, 65504, -3}, {2, 2}, t)));
    auto n = first_nonfinite(from_vector(std::vector<double>{0, 1, 2, nan, inf}, {5}, t));
    REQUIRE(n);
    CHECK(n->index == 3);
    CHECK(std::isnan(n->value));
    auto i = first_nonfinite(from_vector(std::vector<double>{0, -inf, 1}, {3}, t));
    REQUIRE(i);
    CHECK(i->index == 1);
    CHECK(i->value == -inf);
  }
  // Strides are followed: the transposed view's element 1 is the stored element 2.
  Tensor m = from_vector(std::vector<double>{0, 1, nan, 3}, {2, 2}, DType::f32).t();
  REQUIRE(first_nonfinite(m));
  CHECK(first_nonfinite(m)->index == 1);
  CHECK_FALSE(first_nonfinite(from_vector(std::vector<int64_t>{1, 2}, {2}, DType::i64)));
  const std::string e = error_of([&] { check_finite(from_vector(std::vector<double>{1, nan}, {2}), "w.safetensors", "x"); });
  CHECK(e.find("w.safetensors") != std::string::npos);
  CHECK(e.find("tensor x holds nan at element 1") != std::string::npos);
}
