// Checkpoint loading (both layouts, PEFT adapter folders, skipped towers,
// every failure) and saving (bit-identical reload), plus `areno init` and
// `areno logits`.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <tuple>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "app/commands_model.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/init.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"
#include "tests/model/model_fixtures.h"

using namespace areno;
using namespace areno::phi4mm;
using areno::testing::gold;
using areno::testing::gold_ids;
using areno::testing::rel_err;
using areno::testing::TempDir;
using areno::testing::load_error;
using areno::testing::same_bits;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using Named = std::vector<std::pair<std::string, Tensor>>;

Named tiny_tensors() {
  Named out;
  SafetensorsCheckpoint ck(testing::kTinyDir);
  for (auto& n : ck.names()) out.emplace_back(n, ck.load(n).clone());
  return out;
}

// A checkpoint directory with the tiny config and these tensors (two shards).
void write_ckpt(const std::string& dir, const Named& tensors, const std::string& config = testing::kTinyDir + "/config.json") {
  fs::create_directories(dir);
  save_safetensors_sharded(dir, tensors, 60000);
  fs::copy_file(config, dir + "/config.json", fs::copy_options::overwrite_existing);
}



Tensor logits_of(const Phi4MMForCausalLM& m, Adapter a) {
  NoGradGuard ng;
  return m.logits(PackedBatch::single(gold_ids("ids_a"), a));
}

}  // namespace

TEST_CASE("phi4mm/save then load is bit-identical (original layout, shards + index)") {
  auto m = load_model(testing::kTinyDir);
  TempDir tmp;
  SaveOptions so;
  so.max_shard_bytes = 50000;
  save_model(*m, tmp.str(), so);
  CHECK(fs::exists(tmp.str("model.safetensors.index.json")));
  CHECK(fs::exists(tmp.str("model-00001-of-00003.safetensors")));
  CHECK(fs::exists(tmp.str("generation_config.json")));
  LoadReport rep;
  auto r = load_model(tmp.str(), {}, &rep);
  CHECK(rep.summary() == "46 of 46 tensors consumed, 0 missing, 0 unexpected (0 skipped)");
  auto a = m->named_parameters(), b = r->named_parameters();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK_MESSAGE(same_bits(a[i].second, b[i].second), a[i].first);
  CHECK(same_bits(logits_of(*m, Adapter::speech), logits_of(*r, Adapter::speech)));
  // The saved files use the original names.
  SafetensorsCheckpoint ck(tmp.str());
  CHECK(ck.contains("model.layers.0.self_attn.qkv_proj.base_layer.weight"));
  CHECK(ck.contains("model.layers.1.mlp.gate_up_proj.lora_B.vision.weight"));
  CHECK_FALSE(ck.contains("lm_head.weight"));
  Config c = load_config(tmp.str());
  CHECK(c.generation.eos_token_ids == std::vector<int64_t>{2, 3});
  CHECK(c.speech_lora->scaling() == 3.0);
}

TEST_CASE("phi4mm/native layout with PEFT adapter folders gives identical logits") {
  TempDir tmp;
  Named base, vision, speech;
  for (auto& entry : tiny_tensors()) {  // not a structured binding: clang 14 cannot capture one
    std::string name = entry.first;
    const Tensor& t = entry.second;
    auto cut = [&](const std::string& what, Named& into) {
      auto pos = name.find(what);
      if (pos == std::string::npos) return false;
      // model.layers.0.<m>.lora_A.vision.weight -> base_model.model.model.layers.0.<m>.lora_A.weight
      into.emplace_back("base_model.model." + name.substr(0, pos) + what.substr(0, 7) + ".weight", t);
      return true;
    };
    if (cut(".lora_A.vision", vision) || cut(".lora_B.vision", vision) || cut(".lora_A.speech", speech) ||
        cut(".lora_B.speech", speech))
      continue;
    auto pos = name.find(".base_layer.weight");
    if (pos != std::string::npos) name = name.substr(0, pos) + ".weight";
    base.emplace_back(name, t);
  }
  write_ckpt(tmp.str(), base, "tests/data/model/config_native.json");
  for (auto [sub, tensors, r, alpha] : {std::tuple{"vision-lora", &vision, 8, 16}, std::tuple{"speech-lora", &speech, 4, 12}}) {
    fs::create_directories(tmp.str(sub));
    save_safetensors(tmp.str(sub) + "/adapter_model.safetensors", *tensors);
    std::ofstream(tmp.str(sub) + "/adapter_config.json")
        << json{{"r", r}, {"lora_alpha", alpha}, {"lora_dropout", 0.0}, {"peft_type", "LORA"}}.dump();
  }
  LoadReport rep;
  auto native = load_model(tmp.str(), {}, &rep);
  CHECK(rep.expected == 46);
  auto orig = load_model(testing::kTinyDir);
  for (Adapter a : {Adapter::none, Adapter::vision, Adapter::speech})
    CHECK_MESSAGE(same_bits(logits_of(*native, a), logits_of(*orig, a)), std::string(adapter_name(a)));
  // Text-only load of the native directory needs no adapters.
  auto text_only = load_model(tmp.str(), [] { LoadOptions o; o.with_lora = false; return o; }());
  CHECK(same_bits(logits_of(*text_only, Adapter::none), logits_of(*orig, Adapter::none)));
}

TEST_CASE("phi4mm/tower tensors are skipped, a tied lm_head is tolerated") {
  TempDir tmp;
  Named t = tiny_tensors();
  t.emplace_back("model.embed_tokens_extend.image_embed.glb_GN", zeros({1, 1, 16}));
  t.emplace_back("model.embed_tokens_extend.audio_embed.encoder.encoder_embedding.global_mean", zeros({80}));
  write_ckpt(tmp.str(), t);
  LoadReport rep;
  LoadOptions text_only;
  text_only.vision = text_only.audio = false;
  auto m = load_model(tmp.str(), text_only, &rep);
  CHECK(rep.summary() == "46 of 46 tensors consumed, 0 missing, 0 unexpected (2 skipped)");
  // Asked for (the default), a tower with only some of its tensors is an error naming the rest.
  CHECK_THROWS_WITH_AS(load_model(tmp.str()),
                       doctest::Contains("missing model.embed_tokens_extend.image_embed.sub_GN"),
                       std::runtime_error);
  CHECK(rel_err(logits_of(*m, Adapter::vision).to(DType::f32), gold("logits_a_vision")) < 1e-4);
}

TEST_CASE("phi4mm/checkpoint errors name the tensor or file") {
  TempDir tmp;
  SUBCASE("missing tensor") {
    Named t = tiny_tensors();
    t.erase(std::remove_if(t.begin(), t.end(), [](auto& p) { return p.first == "model.layers.1.post_attention_layernorm.weight"; }), t.end());
    write_ckpt(tmp.str(), t);
    std::string e = load_error(tmp.str());
    CHECK(e.find("1 missing") != std::string::npos);
    CHECK(e.find("model.layers.1.post_attention_layernorm.weight") != std::string::npos);
  }
  SUBCASE("unexpected tensor") {
    Named t = tiny_tensors();
    t.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", zeros({3}));
    write_ckpt(tmp.str(), t);
    std::string e = load_error(tmp.str());
    CHECK(e.find("1 unexpected") != std::string::npos);
    CHECK(e.find("rotary_emb.inv_freq") != std::string::npos);
  }
  SUBCASE("wrong shape") {
    Named t = tiny_tensors();
    for (auto& [n, v] : t)
      if (n == "model.layers.0.mlp.down_proj.lora_A.speech.weight") v = zeros({5, 64});
    write_ckpt(tmp.str(), t);
    std::string e = load_error(tmp.str());
    CHECK(e.find("wrong shape") != std::string::npos);
    CHECK(e.find("model.layers.0.mlp.down_proj.lora_A.speech.weight") != std::string::npos);
    CHECK(e.find("[4, 64]") != std::string::npos);
  }
  SUBCASE("truncated shard") {
    for (auto& f : fs::directory_iterator(testing::kTinyDir)) fs::copy_file(f.path(), tmp.path / f.path().filename());
    fs::resize_file(tmp.path / "model-00002-of-00002.safetensors", 30000);
    std::string e = load_error(tmp.str());
    CHECK(e.find("model-00002-of-00002.safetensors") != std::string::npos);
  }
  SUBCASE("invalid config is reported before any weight") {
    for (auto& f : fs::directory_iterator(testing::kTinyDir)) fs::copy_file(f.path(), tmp.path / f.path().filename());
    fs::resize_file(tmp.path / "model-00002-of-00002.safetensors", 10);  // would fail later
    json j = json::parse(std::ifstream(tmp.str("config.json")));
    j["rope_scaling"]["type"] = "dynamic";
    std::ofstream(tmp.str("config.json")) << j.dump();
    std::string e = load_error(tmp.str());
    CHECK(e.find("rope_scaling.type") != std::string::npos);
  }
}

TEST_CASE("phi4mm/areno init and areno logits") {
  TempDir tmp;
  const std::string dir = tmp.str("tiny"), dir2 = tmp.str("tiny2");
  REQUIRE(app::cmd_init({"--preset", "tiny", "--out", dir, "--seed", "3", "--dtype", "f32"}) == 0);
  REQUIRE(app::cmd_init({"--preset", "tiny", "--out", dir2, "--seed", "3", "--dtype", "f32", "--no-tokenizer"}) == 0);
  CHECK(fs::exists(dir + "/tokenizer.json"));
  CHECK_NOTHROW(phi4mm::load_tokenizer(dir));
  CHECK_FALSE(fs::exists(dir2 + "/tokenizer.json"));
  LoadReport rep, text_rep;
  LoadOptions text_only;
  text_only.vision = text_only.audio = false;
  auto mm = load_model(dir, {}, &rep);
  auto m = load_model(dir, text_only, &text_rep);
  auto m2 = load_model(dir2, text_only);
  CHECK(rep.skipped == 0);  // every tensor consumed, towers included
  CHECK(rep.consumed == rep.expected);
  REQUIRE(mm->image_embed());
  REQUIRE(mm->audio_embed());
  // The text-only load skips exactly the tower tensors, unread.
  CHECK(text_rep.skipped ==
        int64_t(mm->image_embed()->named_parameters().size() + mm->audio_embed()->named_parameters().size()));
  auto a = m->named_parameters(), b = m2->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) CHECK_MESSAGE(same_bits(a[i].second, b[i].second), a[i].first);  // same seed
  Config c = load_config(dir);
  CHECK(c.text.vocab_size == 200064);
  CHECK(c.raw["img_processor"]["hidden_size"] == 32);  // tiny towers are written explicitly
  CHECK(c.raw["audio_processor"]["config"]["attention_dim"] == 32);

  const std::string out = tmp.str("logits.safetensors");
  REQUIRE(app::cmd_logits({"--model-path", dir, "--token-ids", "1,200019,7,42", "--adapter", "vision", "--out", out}) == 0);
  SafetensorsFile f(out);
  Tensor logits = f.load("logits");
  CHECK(logits.shape() == Shape{4, 200064});
  {
    NoGradGuard ng;
    Tensor ref = m->logits(PackedBatch::single({1, 200019, 7, 42}, Adapter::vision));
    CHECK(same_bits(logits, ref));
    Tensor none = m->logits(PackedBatch::single({1, 200019, 7, 42}, Adapter::none));
    CHECK(rel_err(none, ref) > 1e-4);  // the adapter was applied
  }
  // --rows: only those rows, equal to the same rows of the full logits.
  CHECK(f.load_copy("rows").to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3});
  for (const auto& rows_case : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"last", {3}}, {"1:3", {1, 2}}, {"0:4", {0, 1, 2, 3}}}) {
    const std::string& flag = rows_case.first;
    const std::vector<int64_t>& want = rows_case.second;
    CAPTURE(flag);
    const std::string part = tmp.str("rows.safetensors");
    REQUIRE(app::cmd_logits({"--model-path", dir, "--token-ids", "1,200019,7,42", "--adapter", "vision", "--rows", flag,
                             "--out", part}) == 0);
    SafetensorsFile p(part);
    CHECK(p.load_copy("rows").to_vector<int64_t>() == want);
    Tensor got = p.load_copy("logits");
    REQUIRE(got.shape() == Shape{int64_t(want.size()), 200064});
    for (size_t i = 0; i < want.size(); ++i)
      CHECK(rel_err(got.narrow(0, int64_t(i), 1), logits.narrow(0, want[i], 1)) < 1e-6);
  }
  for (const char* bad : {"4:5", "2:2", "first", "1:x", "-1:2"})
    CHECK_THROWS_WITH_AS(app::cmd_logits({"--model-path", dir, "--token-ids", "1,200019,7,42", "--rows", bad, "--out",
                                          tmp.str("bad.safetensors")}),
                         doctest::Contains("--rows"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_logits({"--model-path", dir, "--token-ids", "1,x", "--out", out}),
                       doctest::Contains("--token-ids"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_logits({"--model-path", dir, "--token-ids", "300000", "--out", out}),
                       doctest::Contains("outside the vocabulary"), std::invalid_argument);
  CHECK(app::cmd_init({"--preset", "tiny"}) == 2);
  // bf16 init rounds the same draws.
  REQUIRE(app::cmd_init({"--preset", "tiny", "--out", tmp.str("bf"), "--seed", "3", "--no-tokenizer"}) == 0);
  CHECK_THROWS_WITH_AS(app::cmd_init({"--preset", "tiny", "--out", tmp.str("x"), "--seed", "1", "--rank-file", "/nonexistent"}),
                       doctest::Contains("--rank-file"), std::runtime_error);
  auto mb = load_model(tmp.str("bf"));
  CHECK(mb->dtype() == DType::bf16);
  CHECK(same_bits(mb->get("model.norm.weight"), ones({64}, DType::bf16)));
  CHECK(same_bits(mb->get("model.embed_tokens.weight"), m->get("model.embed_tokens.weight").to(DType::bf16)));
}
