// Every config.json value is validated with an error naming the file and the
// key, sizes bounded before anything is allocated (config_limits.h), and a
// loaded checkpoint's NaN weights refused by name with check_weights.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "app/commands_model.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/config.h"
#include "nn/io/files.h"
#include "nn/io/safetensors.h"
#include "tests/model/model_fixtures.h"
#include "tests/test_util.h"

using namespace areno;
using namespace areno::phi4mm;
using areno::testing::error_of;
using areno::testing::TempDir;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json tiny_config() { return json::parse(read_file(testing::kTinyDir + "/config.json")); }

// One invalid value: where it goes in config.json and what the error must say.
struct BadValue {
  json::json_pointer key;
  json value;
  std::vector<std::string> needles;  // besides "config.json"
};

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();
const int64_t k2e40 = int64_t(1) << 40;

std::vector<BadValue> bad_values() {
  using P = json::json_pointer;
  return {
      {P("/rms_norm_eps"), -1, {"rms_norm_eps", "-1"}},
      {P("/bos_token_id"), -5, {"bos_token_id", "-5"}},
      {P("/pad_token_id"), int64_t(1) << 40, {"pad_token_id", "1099511627776"}},
      {P("/eos_token_id"), 300000, {"eos_token_id", "300000"}},
      {P("/rms_norm_eps"), 0, {"rms_norm_eps", "positive"}},
      {P("/rms_norm_eps"), kNaN, {"rms_norm_eps", "nan"}},
      {P("/rms_norm_eps"), kInf, {"rms_norm_eps", "inf"}},
      {P("/vocab_size"), k2e40, {"vocab_size", "1099511627776", "maximum"}},
      {P("/vocab_size"), 0, {"vocab_size", "positive"}},
      {P("/hidden_size"), 0, {"hidden_size", "positive"}},
      {P("/hidden_size"), k2e40, {"hidden_size", "maximum"}},
      {P("/intermediate_size"), -64, {"intermediate_size", "positive"}},
      {P("/intermediate_size"), k2e40, {"intermediate_size", "maximum"}},
      {P("/num_hidden_layers"), 0, {"num_hidden_layers", "positive"}},
      {P("/num_hidden_layers"), 1000000, {"num_hidden_layers", "maximum"}},
      {P("/num_attention_heads"), 0, {"num_attention_heads", "positive"}},
      {P("/num_attention_heads"), 3, {"num_attention_heads", "not divisible"}},
      {P("/num_key_value_heads"), 0, {"num_key_value_heads", "positive"}},
      {P("/num_key_value_heads"), 3, {"num_key_value_heads", "not divisible"}},
      {P("/max_position_embeddings"), 0, {"max_position_embeddings", "positive"}},
      {P("/max_position_embeddings"), k2e40, {"max_position_embeddings", "maximum"}},
      {P("/original_max_position_embeddings"), 0, {"original_max_position_embeddings", "positive"}},
      {P("/head_dim"), 7, {"head_dim", "hidden_size / num_attention_heads"}},
      {P("/head_dim"), "8", {"head_dim", "expected an integer"}},
      {P("/rope_theta"), -10000, {"rope_theta", "positive"}},
      {P("/rope_theta"), kNaN, {"rope_theta", "nan"}},
      {P("/partial_rotary_factor"), kNaN, {"partial_rotary_factor"}},
      {P("/rope_scaling/short_factor/1"), kInf, {"short_factor", "finite"}},
      {P("/rope_scaling/attention_factor"), -1, {"attention_factor", "positive"}},
      {P("/vision_lora/lora_alpha"), kNaN, {"vision_lora", "lora_alpha"}},
      {P("/vision_lora/dp"), 1.5, {"vision_lora", "dp", "1.5"}},
      {P("/speech_lora/r"), k2e40, {"speech_lora", "'r'", "maximum"}},
      {P("/img_processor"), json{{"hidden_size", k2e40}}, {"img_processor.hidden_size", "maximum"}},
      {P("/img_processor"), json{{"num_hidden_layers", 1000000}}, {"img_processor.num_hidden_layers", "maximum"}},
      {P("/img_processor"), json{{"image_size", 1 << 20}}, {"img_processor.image_size", "maximum"}},
      {P("/img_processor"), json{{"layer_norm_eps", -1}}, {"img_processor.layer_norm_eps", "positive"}},
      {P("/img_processor"), json{{"layer_norm_eps", kInf}}, {"img_processor.layer_norm_eps", "finite"}},
      {P("/audio_processor/config/kernel_size"), k2e40, {"kernel_size", "maximum"}},
      {P("/audio_processor/config/num_blocks"), 1000000, {"num_blocks", "maximum"}},
      {P("/audio_processor/config/linear_units"), 0, {"linear_units", "positive"}},
      {P("/audio_processor/config/linear_units"), k2e40, {"linear_units", "maximum"}},
  };
}

// A copy of the tiny checkpoint whose config.json has `key` = `value`.
void write_tiny_with(const std::string& dir, const json::json_pointer& key, const json& value) {
  for (auto& f : fs::directory_iterator(testing::kTinyDir)) fs::copy_file(f.path(), fs::path(dir) / f.path().filename());
  json j = tiny_config();
  j[key] = value;
  std::ofstream(dir + "/config.json") << j.dump();
}

}  // namespace

TEST_CASE("phi4mm/config refuses every invalid value naming config.json and the key") {
  REQUIRE_NOTHROW(parse_config(tiny_config(), "config.json"));
  for (const BadValue& b : bad_values()) {
    CAPTURE(b.key.to_string());
    CAPTURE(b.value.dump());
    json j = tiny_config();
    j[b.key] = b.value;
    std::string msg;
    try {
      parse_config(j, "config.json");
      FAIL("accepted");
    } catch (const std::exception& e) {
      msg = e.what();
    }
    CAPTURE(msg);
    CHECK(msg.find("config.json") != std::string::npos);
    for (const auto& n : b.needles) CHECK_MESSAGE(msg.find(n) != std::string::npos, "lacks " << n);
  }
}

TEST_CASE("phi4mm/load_model refuses an invalid config before any weight file is opened") {
  for (const BadValue& b : bad_values()) {
    if (b.value.dump().find("null") != std::string::npos) continue;  // NaN and inf have no JSON text
    CAPTURE(b.key.to_string());
    CAPTURE(b.value.dump());
    TempDir tmp;
    write_tiny_with(tmp.str(), b.key, b.value);
    std::map<std::string, int> opens;
    set_open_hook([&](const std::string& path) { ++opens[fs::path(path).filename().string()]; });
    const std::string e = error_of([&] { load_model(tmp.str()); });
    set_open_hook(nullptr);
    CHECK(e.find(tmp.str("config.json")) != std::string::npos);
    CHECK(e.find(b.needles[0]) != std::string::npos);
    CHECK(opens == std::map<std::string, int>{{"config.json", 1}});
  }
}

TEST_CASE("phi4mm/a config that does not describe the stored embedding fails before allocating the model") {
  TempDir tmp;
  write_tiny_with(tmp.str(), json::json_pointer("/vocab_size"), 4000000);  // within the bounds, 31250 x too many
  const std::string e = error_of([&] { load_model(tmp.str()); });
  CHECK(e.find(tmp.str("config.json")) != std::string::npos);
  CHECK(e.find("vocab_size 4000000") != std::string::npos);
  CHECK(e.find("model.embed_tokens.weight [128, 32]") != std::string::npos);
}

TEST_CASE("phi4mm/check_weights refuses a NaN weight naming the tensor and the file") {
  TempDir tmp;
  for (auto& f : fs::directory_iterator(testing::kTinyDir))
    if (f.path().extension() == ".json") fs::copy_file(f.path(), tmp.path / f.path().filename());
  std::vector<std::pair<std::string, Tensor>> tensors;
  SafetensorsCheckpoint ck(testing::kTinyDir);
  const std::string bad = "model.layers.1.mlp.down_proj.base_layer.weight";
  for (const auto& n : ck.names()) {
    Tensor t = ck.load(n).clone();
    if (n == bad) {
      std::vector<float> v = t.to_vector<float>();
      v[5] = std::numeric_limits<float>::quiet_NaN();
      t = from_vector(v, t.shape(), t.dtype());
    }
    tensors.emplace_back(n, t);
  }
  fs::remove(tmp.str("model.safetensors.index.json"));
  save_safetensors(tmp.str("model.safetensors"), tensors);

  CHECK_NOTHROW(load_model(tmp.str()));  // off by default: the weights are taken as they are
  LoadOptions check;
  check.check_weights = true;
  const std::string e = error_of([&] { load_model(tmp.str(), check); });
  CHECK(e.find(tmp.str("model.safetensors")) != std::string::npos);
  CHECK(e.find("tensor " + bad + " holds nan at element 5") != std::string::npos);
  // The commands' --check-weights flag sets it.
  const std::string out = tmp.str("logits.safetensors");
  CHECK(app::cmd_logits({"--model-path", tmp.str(), "--token-ids", "1,2", "--out", out}) == 0);
  CHECK_THROWS_WITH_AS(app::cmd_logits({"--model-path", tmp.str(), "--token-ids", "1,2", "--out", out,
                                        "--check-weights"}),
                       doctest::Contains(bad.c_str()), std::runtime_error);
  // The healthy checkpoint passes the check.
  CHECK_NOTHROW(load_model(testing::kTinyDir, check));
}
