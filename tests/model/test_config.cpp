// config.json / generation_config.json parsing and validation (spec 1.1, 7.2).
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/model/model_fixtures.h"
#include "models/phi4mm/config.h"
#include "models/phi4mm/init.h"

using namespace areno;
using namespace areno::phi4mm;
using nlohmann::json;

namespace {

json read_json(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f.good());
  return json::parse(f);
}

json tiny_json() { return read_json(testing::kTinyDir + "/config.json"); }

// Parsing `j` must fail with a message containing every string of `needles`.
void expect_error(const json& j, std::vector<std::string> needles) {
  try {
    parse_config(j, "config.json");
    FAIL("parse_config accepted an invalid config; expected an error mentioning " << needles[0]);
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    for (auto& n : needles) CHECK_MESSAGE(msg.find(n) != std::string::npos, "message: " << msg << " lacks " << n);
  }
}

}  // namespace

TEST_CASE("phi4mm/config parses the original layout") {
  Config c = load_config(testing::kTinyDir);
  CHECK(c.layout == Layout::original);
  const TextConfig& t = c.text;
  CHECK(t.vocab_size == 128);
  CHECK(t.hidden_size == 32);
  CHECK(t.head_dim() == 8);
  CHECK(t.qkv_size() == 32 + 2 * 16);
  CHECK(t.rotary_dim() == 6);
  CHECK(t.original_max_position_embeddings == 16);
  CHECK(t.short_factor == std::vector<double>{1.0, 1.25, 1.5});
  CHECK(t.long_factor == std::vector<double>{1.0, 2.5, 7.75});
  // mscale = sqrt(1 + ln(64/16) / ln 16) = sqrt(1.5)
  CHECK(t.rope_mscale() == doctest::Approx(std::sqrt(1.5)).epsilon(1e-12));
  REQUIRE(c.vision_lora);
  REQUIRE(c.speech_lora);
  CHECK(c.vision_lora->r == 8);
  CHECK(c.vision_lora->scaling() == 2.0);
  CHECK(c.speech_lora->r == 4);
  CHECK(c.speech_lora->scaling() == 3.0);
  CHECK(c.generation.eos_token_ids == std::vector<int64_t>{2, 3});
}

TEST_CASE("phi4mm/config parses the transformers-native layout to the same text config") {
  Config o = load_config(testing::kTinyDir);
  Config n = parse_config(read_json("tests/data/model/config_native.json"), "config_native.json");
  CHECK(n.layout == Layout::native);
  CHECK_FALSE(n.vision_lora);
  CHECK(n.text.hidden_size == o.text.hidden_size);
  CHECK(n.text.num_key_value_heads == o.text.num_key_value_heads);
  CHECK(n.text.rotary_dim() == o.text.rotary_dim());
  CHECK(n.text.short_factor == o.text.short_factor);
  CHECK(n.text.long_factor == o.text.long_factor);
  CHECK(n.text.original_max_position_embeddings == o.text.original_max_position_embeddings);
  CHECK(n.text.rope_mscale() == o.text.rope_mscale());
  // Written back in the original layout, it parses as original.
  Config back = parse_config(to_original_json(n), "roundtrip");
  CHECK(back.layout == Layout::original);
  CHECK(back.text.long_factor == o.text.long_factor);
}

TEST_CASE("phi4mm/config released values: mscale and sizes of the full model") {
  json j = tiny_json();
  j["hidden_size"] = 3072, j["num_attention_heads"] = 24, j["num_key_value_heads"] = 8;
  j["max_position_embeddings"] = 131072, j["original_max_position_embeddings"] = 4096;
  j["intermediate_size"] = 8192, j["vocab_size"] = 200064, j["num_hidden_layers"] = 32;
  j["rope_scaling"]["short_factor"] = std::vector<double>(48, 1.0);
  j["rope_scaling"]["long_factor"] = std::vector<double>(48, 2.0);
  Config c = parse_config(j);
  CHECK(c.text.rotary_dim() == 96);
  CHECK(c.text.qkv_size() == 5120);
  CHECK(float(c.text.rope_mscale()) == 1.1902381181716919f);  // spec 1.4
  CHECK(text_parameter_count(c.text) == 3836021760);           // spec 4.3
}

TEST_CASE("phi4mm/config rejects unsupported fields naming the key") {
  SUBCASE("rope_scaling type") {
    json j = tiny_json();
    j["rope_scaling"]["type"] = "yarn";
    expect_error(j, {"rope_scaling.type", "yarn"});
  }
  SUBCASE("short_factor length") {
    json j = tiny_json();
    j["rope_scaling"]["short_factor"] = {1.0, 1.0};
    expect_error(j, {"short_factor", "expected rotary_dim / 2 = 3"});
  }
  SUBCASE("long_factor length") {
    json j = tiny_json();
    j["rope_scaling"]["long_factor"] = {1.0, 1.0, 1.0, 1.0};
    expect_error(j, {"long_factor", "4 entries"});
  }
  SUBCASE("hidden size not divisible by heads") {
    json j = tiny_json();
    j["hidden_size"] = 30;
    expect_error(j, {"num_attention_heads", "not divisible"});
  }
  SUBCASE("heads not divisible by kv heads") {
    json j = tiny_json();
    j["num_key_value_heads"] = 3;
    expect_error(j, {"num_key_value_heads", "not divisible"});
  }
  SUBCASE("unknown LoRA target pattern") {
    json j = tiny_json();
    j["vision_lora"]["layer"] = "layers.*self_attn\\.qkv_proj";
    expect_error(j, {"vision_lora", "layer", "unknown LoRA target pattern"});
  }
  SUBCASE("LoRA rank") {
    json j = tiny_json();
    j["speech_lora"]["r"] = 0;
    expect_error(j, {"speech_lora", "'r'", "positive"});
  }
  SUBCASE("image crop size") {
    json j = tiny_json();
    j["embd_layer"]["image_embd_layer"]["crop_size"] = 336;
    expect_error(j, {"image_embd_layer", "crop_size", "336"});
  }
  SUBCASE("image HD order") {
    json j = tiny_json();
    j["embd_layer"]["image_embd_layer"]["hd_transform_order"] = "glb_sub";
    expect_error(j, {"hd_transform_order"});
  }
  SUBCASE("image token compression") {
    json j = tiny_json();
    j["embd_layer"]["image_embd_layer"]["image_token_compression_cls"] = "none";
    expect_error(j, {"image_token_compression_cls"});
  }
  SUBCASE("audio encoder") {
    json j = tiny_json();
    j["audio_processor"]["name"] = "whisper";
    expect_error(j, {"audio_processor", "name"});
  }
  SUBCASE("audio time reduction") {
    json j = tiny_json();
    j["audio_processor"]["config"]["time_reduction"] = 4;
    expect_error(j, {"time_reduction"});
  }
  SUBCASE("audio input size") {
    json j = tiny_json();
    j["audio_processor"]["config"]["input_size"] = 128;
    expect_error(j, {"input_size"});
  }
  SUBCASE("custom image tower") {
    json j = tiny_json();
    j["img_processor"] = "clip_vision_model";
    expect_error(j, {"img_processor"});
  }
  SUBCASE("image tower with an unsupported activation") {
    json j = tiny_json();
    j["img_processor"] = {{"hidden_act", "relu"}};
    expect_error(j, {"hidden_act"});
  }
  SUBCASE("audio tower with sizes that do not divide") {
    json j = tiny_json();
    j["audio_processor"]["config"]["attention_dim"] = 30;
    j["audio_processor"]["config"]["attention_heads"] = 4;
    expect_error(j, {"attention"});
  }
  SUBCASE("model type") {
    json j = tiny_json();
    j["model_type"] = "phi3";
    expect_error(j, {"model_type", "phi3"});
  }
  SUBCASE("missing size") {
    json j = tiny_json();
    j.erase("hidden_size");
    expect_error(j, {"hidden_size", "missing"});
  }
  SUBCASE("untied head") {
    json j = tiny_json();
    j["tie_word_embeddings"] = false;
    expect_error(j, {"tie_word_embeddings"});
  }
  SUBCASE("native rope_type") {
    json j = read_json("tests/data/model/config_native.json");
    j["rope_parameters"]["rope_type"] = "dynamic";
    expect_error(j, {"rope_parameters.type", "dynamic"});
  }
  SUBCASE("native crop size") {
    json j = read_json("tests/data/model/config_native.json");
    j["vision_config"] = {{"crop_size", 224}};
    expect_error(j, {"vision_config", "crop_size"});
  }
}

TEST_CASE("phi4mm/generation config: eos as a list or a number") {
  GenerationConfig g = parse_generation_config(json::parse(R"({"eos_token_id": [200020, 199999]})"));
  CHECK(g.eos_token_ids == std::vector<int64_t>{200020, 199999});
  g = parse_generation_config(json::parse(R"({"eos_token_id": 7, "bos_token_id": 1})"));
  CHECK(g.eos_token_ids == std::vector<int64_t>{7});
  CHECK(g.bos_token_id == 1);
  CHECK_THROWS_WITH_AS(parse_generation_config(json::parse(R"({"eos_token_id": "x"})")),
                       doctest::Contains("eos_token_id"), std::runtime_error);
}

TEST_CASE("phi4mm/config reads dynamic_hd from preprocessor_config.json; a bad value fails at load naming it") {
  areno::testing::TempDir dir;
  std::ofstream(dir.path / "config.json") << to_original_json(preset_config("tiny")).dump();
  CHECK(load_config(dir.path.string()).vision.dynamic_hd == 36);  // no preprocessor_config.json: the released value
  std::ofstream(dir.path / "preprocessor_config.json") << R"({"image_processor_type": "Phi4MMImageProcessor", "dynamic_hd": 4})";
  CHECK(load_config(dir.path.string()).vision.dynamic_hd == 4);
  for (const char* bad : {"0", "65", "\"4\"", "4.5", "-1"}) {
    CAPTURE(bad);
    std::ofstream(dir.path / "preprocessor_config.json") << std::string(R"({"dynamic_hd": )") + bad + "}";
    CHECK_THROWS_WITH_AS(load_config(dir.path.string()),
                         doctest::Contains("preprocessor_config.json: dynamic_hd: must be an integer from 1 to 64"),
                         std::runtime_error);
  }
  std::ofstream(dir.path / "preprocessor_config.json") << "[]";
  CHECK_THROWS_WITH_AS(load_config(dir.path.string()), doctest::Contains("preprocessor_config.json: must be a JSON object"),
                       std::runtime_error);
}

TEST_CASE("phi4mm/presets validate and keep the released structure") {
  for (const char* p : {"tiny", "small"}) {
    Config c = preset_config(p);
    CHECK(c.text.vocab_size == 200064);
    CHECK(c.text.rotary_dim() * 4 == c.text.head_dim() * 3);
    CHECK(c.text.num_attention_heads % c.text.num_key_value_heads == 0);
    REQUIRE(c.vision_lora);
    CHECK(c.vision_lora->scaling() == 2.0);
    CHECK(c.speech_lora->scaling() == 2.0);
    CHECK(c.generation.eos_token_ids == std::vector<int64_t>{200020, 199999});
  }
  Config full = preset_config("full");
  CHECK(text_parameter_count(full.text) == 3836021760);  // spec 4.3
  CHECK(full.text.long_factor[47] == 47.77);
  CHECK(full.vision_lora->r == 256);
  CHECK(full.speech_lora->r == 320);
  CHECK(full.vision_lora->layer_regex == kVisionLoraRegex);
  CHECK_THROWS_WITH_AS(preset_config("huge"), doctest::Contains("unknown preset"), std::invalid_argument);
}
