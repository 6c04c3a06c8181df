// Weight deltas (nn/io/weight_delta.h): what the embedded demo model is made
// of. Unchanged tensors are left out, a tensor with few changed rows is
// stored row-sparse, base + delta equals the trained weights bit for bit, and
// a bad delta is refused before anything is written.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

#include "nn/io/safetensors.h"
#include "nn/io/weight_delta.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

using namespace areno;
namespace fs = std::filesystem;

namespace {

struct Net : Module {
  Tensor emb, lin, bias, norm;
  explicit Net(uint64_t seed) : Module("Net") {
    Generator g(seed);
    emb = register_parameter("emb", rand_normal({50, 4}, g));
    lin = register_parameter("lin", rand_normal({3, 4}, g));
    bias = register_parameter("bias", rand_normal({3}, g));
    norm = register_parameter("norm", rand_normal({4}, g));
  }
};

void set(Tensor& t, int64_t i, float v) { static_cast<float*>(t.data_ptr())[i] = v; }

std::string bytes_of(const Tensor& t) {
  Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

fs::path temp_file(const std::string& tag) {
  return fs::temp_directory_path() / ("areno_test_delta_" + tag + "_" + std::to_string(::getpid()) + ".safetensors");
}

}  // namespace

TEST_CASE("io/weight delta: unchanged left out, few rows sparse, the rest whole; base + delta is bitwise equal") {
  Net base(1), trained(1);
  set(trained.emb, 4 * 7 + 2, 0.5f);   // rows 7 and 31 of 50: sparse
  set(trained.emb, 4 * 31 + 0, -1.0f);
  set(trained.lin, 0, 2.0f), set(trained.lin, 4, 2.0f);  // rows 0 and 1 of 3: whole
  set(trained.bias, 1, 3.0f);                            // 1-D: whole
  WeightDeltaStats st;
  const auto delta = weight_delta(base, trained, &st);
  CHECK(st.unchanged == 1);  // norm
  CHECK(st.whole == 2);
  CHECK(st.sparse == 1);
  CHECK(st.sparse_rows == 2);
  REQUIRE(delta.size() == 4);
  CHECK(delta[0].first == "emb:rows");
  CHECK(delta[0].second.to_vector<int64_t>() == std::vector<int64_t>{7, 31});
  CHECK(delta[1].first == "emb:values");
  CHECK(delta[1].second.shape() == Shape{2, 4});
  CHECK(delta[2].first == "lin");
  CHECK(delta[3].first == "bias");

  const fs::path file = temp_file("roundtrip");
  save_safetensors(file.string(), delta);
  Net rebuilt(1);
  apply_weight_delta(rebuilt, SafetensorsFile(file.string()));
  for (auto& [name, p] : rebuilt.named_parameters()) CHECK(bytes_of(p) == bytes_of(trained.get(name)));
  // The same from bytes in memory (how the program reads the embedded demo delta).
  const std::string bytes = read_bytes(file);
  Net from_memory(1);
  apply_weight_delta(from_memory, SafetensorsFile::from_memory("<memory>", bytes));
  for (auto& [name, p] : from_memory.named_parameters()) CHECK(bytes_of(p) == bytes_of(trained.get(name)));
  CHECK(weight_delta(trained, from_memory).empty());
  fs::remove(file);
}

TEST_CASE("io/weight delta: a bad delta is refused naming the tensor, and nothing is written") {
  Net base(1);
  const std::string before = bytes_of(base.emb) + bytes_of(base.lin);
  auto refused = [&](std::vector<std::pair<std::string, Tensor>> tensors, const std::string& what) {
    const fs::path file = temp_file("bad");
    // A valid whole-tensor entry first: it must not be written either.
    tensors.insert(tensors.begin(), {"lin", zeros({3, 4})});
    save_safetensors(file.string(), tensors);
    CHECK_THROWS_WITH_AS(apply_weight_delta(base, SafetensorsFile(file.string())), doctest::Contains(what.c_str()),
                         std::runtime_error);
    CHECK(bytes_of(base.emb) + bytes_of(base.lin) == before);
    fs::remove(file);
  };
  refused({{"nope", zeros({3})}}, "'nope': the model has no such parameter");
  refused({{"bias", zeros({4})}}, "'bias': shape or dtype differs");
  refused({{"bias", zeros({3}, TensorOptions(DType::f64))}}, "'bias': shape or dtype differs");
  refused({{"emb:rows", from_vector(std::vector<int64_t>{3, 50}, {2})}, {"emb:values", zeros({2, 4})}},
          "'emb:rows': row 50 is out of range");
  refused({{"emb:rows", from_vector(std::vector<int64_t>{5, 5}, {2})}, {"emb:values", zeros({2, 4})}},
          "not ascending");
  refused({{"emb:rows", from_vector(std::vector<int64_t>{5}, {1})}}, "no matching :values");
  refused({{"emb:values", zeros({1, 4})}}, "no matching :rows");
  refused({{"emb:rows", from_vector(std::vector<int64_t>{5}, {1})}, {"emb:values", zeros({2, 4})}},
          "'emb:values': shape or dtype does not match");
  refused({{"bias:rows", from_vector(std::vector<int64_t>{0}, {1})}, {"bias:values", zeros({1})}},
          "fewer than 2 dimensions");
  // Structures that differ cannot be diffed.
  struct Other : Module {
    Other() : Module("Other") { register_parameter("emb", zeros({50, 4})); }
  } other;
  CHECK_THROWS_AS(weight_delta(base, other), std::invalid_argument);
  CHECK_THROWS_WITH_AS(SafetensorsFile::from_memory("<short>", "abc"), doctest::Contains("<short>"),
                       std::runtime_error);
}
