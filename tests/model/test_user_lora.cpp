// The user adapter (config "user_lora", `areno train --lora-rank`): a LoRA of
// our own on every row, beside the modality adapter a row uses. Its forward
// against the formula, its initialisation (outputs unchanged), the config
// block, saving and loading, the incremental (serving) forward, and refusals.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/commands_model.h"
#include "app/served_model.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/kv_cache.h"
#include "models/phi4mm/model.h"
#include "tensor/autograd.h"
#include "tests/model/model_fixtures.h"

using namespace areno;
using namespace areno::phi4mm;
using areno::testing::gold_ids;
using areno::testing::TempDir;
using areno::testing::load_error;
using areno::testing::same_bits;
using areno::testing::randomise_user;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

LoraConfig user_cfg(int64_t r, double alpha, std::vector<std::string> targets = kLoraTargets) {
  LoraConfig l;
  l.r = r;
  l.alpha = alpha;
  l.targets = std::move(targets);
  return l;
}

Tensor logits_of(const Phi4MMForCausalLM& m, Adapter a) {
  NoGradGuard ng;
  return m.logits(PackedBatch::single(gold_ids("ids_a"), a));
}


double rel(const Tensor& a, const Tensor& b) {
  return max_abs_diff(a.to(DType::f64), b.to(DType::f64)) / std::max(max(abs(b.to(DType::f64))).item(), 1e-30);
}


}  // namespace

TEST_CASE("phi4mm/user LoRA: new, it changes nothing; trained, it adds s·(x·Aᵀ)·Bᵀ on every row beside the row's adapter") {
  for (double alpha : {8.0, 6.0}) {  // scaling 2 (power of two: scaled on the r-wide product) and 1.5
    CAPTURE(alpha);
    auto m = load_model(testing::kTinyDir);
    const Tensor none0 = logits_of(*m, Adapter::none), speech0 = logits_of(*m, Adapter::speech);
    const int64_t before = m->num_parameters();
    m->add_user_lora(user_cfg(4, alpha, {"qkv_proj", "down_proj"}), 3);
    // Two layers, two targets: A [4, in] and B [out, 4] each.
    const auto& t = m->config().text;
    const int64_t per_layer = 4 * (t.hidden_size + t.qkv_size()) + 4 * (t.intermediate_size + t.hidden_size);
    CHECK(m->num_parameters() - before == t.num_hidden_layers * per_layer);
    CHECK(m->get("model.layers.1.mlp.down_proj.lora_A.user.weight").shape() == Shape{4, t.intermediate_size});
    CHECK_THROWS(m->get("model.layers.0.self_attn.o_proj.lora_A.user.weight"));
    // PEFT's initialisation: A in ±1/sqrt(in), not all zero; B zero.
    const Tensor a0 = m->get("model.layers.0.self_attn.qkv_proj.lora_A.user.weight");
    CHECK(max(abs(a0)).item() <= 1.0 / std::sqrt(double(t.hidden_size)));
    CHECK(max(abs(a0)).item() > 0.5 / std::sqrt(double(t.hidden_size)));
    CHECK(max(abs(m->get("model.layers.0.self_attn.qkv_proj.lora_B.user.weight"))).item() == 0.0);
    CHECK(max_abs_diff(logits_of(*m, Adapter::none), none0) == 0.0);
    CHECK(max_abs_diff(logits_of(*m, Adapter::speech), speech0) == 0.0);

    // With B set, one linear against the formula: the speech rows get the
    // speech term, every row the user term.
    randomise_user(*m, 9);
    auto layer = m->model->layers->at<DecoderLayer>(0);
    LoraLinear& lin = *layer->self_attn->qkv_proj;
    Generator g(4);
    const Tensor x = rand_normal({6, t.hidden_size}, g);
    AdapterRows rows;
    rows.rows[int(Adapter::speech)] = from_vector(std::vector<int64_t>{1, 4}, {2});
    NoGradGuard ng;
    const Tensor y = lin.forward(x, rows);
    const std::string p = "model.layers.0.self_attn.qkv_proj.";
    const double ss = m->config().speech_lora->scaling();
    const Tensor xs = index_select(x, 0, rows.rows[int(Adapter::speech)]);
    const Tensor speech =
        mul(linear(linear(xs, m->get(p + "lora_A.speech.weight"), Tensor()), m->get(p + "lora_B.speech.weight"), Tensor()), ss);
    Tensor want = index_add(linear(x, m->get(p + "base_layer.weight"), Tensor()), 0, rows.rows[int(Adapter::speech)], speech);
    want = add(want, mul(linear(linear(x, m->get(p + "lora_A.user.weight"), Tensor()), m->get(p + "lora_B.user.weight"), Tensor()),
                         alpha / 4.0));
    CHECK(rel(y, want) < 1e-6);
    // The adapter shows in the logits of every adapter's rows.
    CHECK(rel(logits_of(*m, Adapter::none), none0) > 1e-3);
    CHECK(rel(logits_of(*m, Adapter::speech), speech0) > 1e-3);
  }
}

TEST_CASE("phi4mm/user LoRA: logits and gradients equal peft's with [row adapter, user] active (f32)") {
  // tests/reference/model/make_user_lora_golden.py: the tiny text model with a
  // third peft adapter "user" on qkv_proj and down_proj, r 3, scaling 1.5.
  const SafetensorsFile golden("tests/data/model/user_lora_golden.safetensors");
  auto m = load_model(testing::kTinyDir);
  m->add_user_lora(user_cfg(3, 4.5, {"qkv_proj", "down_proj"}), 1);
  int64_t copied = 0;
  {
    NoGradGuard ng;
    for (auto& [name, p] : m->named_parameters())
      if (name.find(".user.") != std::string::npos) {
        p.copy_(golden.load_copy(name));
        ++copied;
      }
  }
  CHECK(copied == 8);
  const std::vector<int64_t> ids_a = golden.load_copy("ids_a").to_vector<int64_t>();
  const std::vector<int64_t> ids_b = golden.load_copy("ids_b").to_vector<int64_t>();
  CHECK(ids_a == gold_ids("ids_a"));
  for (Adapter a : {Adapter::none, Adapter::vision, Adapter::speech}) {
    CAPTURE(adapter_name(a));
    NoGradGuard ng;
    const Tensor got = m->logits(PackedBatch::single(ids_a, a));
    CHECK(testing::rel_err(got, golden.load_copy(fmt::format("user_logits_a_{}", adapter_name(a)))) < 1e-5);
  }
  {
    NoGradGuard ng;
    CHECK(testing::rel_err(m->logits(PackedBatch::single(ids_b, Adapter::speech)), golden.load_copy("user_logits_b_speech")) <
          1e-5);
  }
  for (auto& [name, p] : m->named_parameters()) p.set_requires_grad(name.find(".user.") != std::string::npos);
  m->get("model.layers.0.self_attn.qkv_proj.base_layer.weight").set_requires_grad(true);
  const int64_t T = int64_t(ids_a.size());
  const Tensor logits = m->logits(PackedBatch::single(ids_a, Adapter::speech));
  const Tensor target = from_vector(std::vector<int64_t>(ids_a.begin() + 1, ids_a.end()), {T - 1});
  const Tensor loss = cross_entropy(logits.narrow(0, 0, T - 1), target);
  CHECK(loss.item() == doctest::Approx(golden.load_copy("grad_loss").item()).epsilon(1e-5));
  loss.backward();
  int64_t grads = 0;
  for (auto& [name, p] : m->named_parameters()) {
    if (!p.requires_grad()) continue;
    const std::string& param = name;  // clang 14 cannot capture a structured binding
    CAPTURE(param);
    const std::string key = name == "model.layers.0.self_attn.qkv_proj.base_layer.weight" ? "grad_qkv_base_0" : "grad_" + name;
    REQUIRE(p.grad().defined());
    CHECK(testing::rel_err(p.grad(), golden.load_copy(key)) < 1e-4);
    ++grads;
  }
  CHECK(grads == 9);
}

TEST_CASE("phi4mm/user LoRA: saved in the original layout with its config block, reloaded bit for bit, served the same") {
  auto m = load_model(testing::kTinyDir);
  m->add_user_lora(user_cfg(3, 12.0, {"o_proj", "gate_up_proj"}), 5);
  randomise_user(*m, 2);
  TempDir tmp;
  save_model(*m, tmp.str());
  std::ifstream f(tmp.str("config.json"));
  const json j = json::parse(f);
  CHECK(j["user_lora"] == json{{"dp", 0.0}, {"lora_alpha", 12.0}, {"r", 3}, {"target_modules", {"o_proj", "gate_up_proj"}}});
  SafetensorsCheckpoint ck(tmp.str());
  CHECK(ck.contains("model.layers.1.self_attn.o_proj.lora_B.user.weight"));
  CHECK_FALSE(ck.contains("model.layers.1.self_attn.qkv_proj.lora_B.user.weight"));

  LoadReport rep;
  auto r = load_model(tmp.str(), {}, &rep);
  CHECK(rep.summary() == "54 of 54 tensors consumed, 0 missing, 0 unexpected (0 skipped)");
  REQUIRE(r->config().user_lora);
  CHECK(r->config().user_lora->targets == std::vector<std::string>{"o_proj", "gate_up_proj"});
  auto a = m->named_parameters(), b = r->named_parameters();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK_MESSAGE(same_bits(a[i].second, b[i].second), a[i].first);
  for (Adapter ad : {Adapter::none, Adapter::vision, Adapter::speech})
    CHECK(same_bits(logits_of(*m, ad), logits_of(*r, ad)));
  // A text-only load (no vision/speech adapters) still loads the user adapter:
  // it is part of every row's weights.
  LoadOptions text_only;
  text_only.with_lora = false;
  auto t = load_model(tmp.str(), text_only, &rep);
  CHECK(rep.summary() == "22 of 22 tensors consumed, 0 missing, 0 unexpected (32 skipped)");
  CHECK(same_bits(logits_of(*t, Adapter::none), logits_of(*m, Adapter::none)));

  // The serving forward (chunked prefill and decode over the KV cache) gives
  // the packed forward's logits.
  const std::vector<int64_t> ids = gold_ids("ids_a");
  PagedKvCache cache(*r, 64, 4);
  KvSequence s;
  NoGradGuard ng;
  const Tensor full = r->logits(PackedBatch::single(ids, Adapter::vision));
  Tensor last;
  for (size_t at = 0; at < ids.size(); at += 5) {
    IncrementalBatch b;
    const size_t n = std::min<size_t>(5, ids.size() - at);
    std::vector<int64_t> chunk(ids.begin() + int64_t(at), ids.begin() + int64_t(at + n));
    b.add(s, chunk, Adapter::vision);
    last = forward_incremental(*r, cache, b).to(DType::f32);
  }
  CHECK(rel(last.select(0, 0), full.select(0, int64_t(ids.size()) - 1)) < 1e-5);
}

TEST_CASE("phi4mm/user LoRA: bad settings and a second adapter are refused by name") {
  CHECK(parse_lora_targets("all", "--lora-targets") == kLoraTargets);
  CHECK(parse_lora_targets("down_proj,qkv_proj", "--lora-targets") == std::vector<std::string>{"qkv_proj", "down_proj"});
  CHECK_THROWS_WITH_AS(parse_lora_targets("qkv_proj,q_proj", "--lora-targets"),
                       "--lora-targets: 'q_proj' is not one of qkv_proj, o_proj, gate_up_proj, down_proj (or all)",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(check_user_lora(user_cfg(0, 1), "x"), "x: rank 0 is not in [1, 4096]", std::invalid_argument);
  CHECK_THROWS_WITH_AS(check_user_lora(user_cfg(4, NAN), "x"), "x: alpha must be positive and finite, got nan",
                       std::invalid_argument);
  LoraConfig d = user_cfg(4, 8);
  d.dropout = 1;
  CHECK_THROWS_WITH_AS(check_user_lora(d, "x"), "x: dropout must be in [0, 1), got 1", std::invalid_argument);

  auto m = load_model(testing::kTinyDir);
  m->add_user_lora(user_cfg(2, 4), 1);
  CHECK_THROWS_WITH_AS(m->add_user_lora(user_cfg(2, 4), 1), doctest::Contains("has a user LoRA already (rank 2)"),
                       std::invalid_argument);

  // config.json's block is checked before any weight is read.
  TempDir tmp;
  save_model(*m, tmp.str());
  auto with_block = [&](const json& block) {
    std::ifstream in(tmp.str("config.json"));
    json j = json::parse(in);
    j["user_lora"] = block;
    std::ofstream(tmp.str("config.json")) << j.dump();
    return load_error(tmp.str());
  };
  CHECK(with_block({{"r", 2}, {"lora_alpha", 4}, {"target_modules", {"qkv_proj", "v_proj"}}}).find(
            "user_lora.target_modules: 'v_proj' is not one of") != std::string::npos);
  CHECK(with_block({{"r", 2}, {"lora_alpha", 4}, {"target_modules", {"qkv_proj", "qkv_proj"}}}).find(
            "key 'user_lora.target_modules': lists a module twice") != std::string::npos);
  CHECK(with_block({{"r", 2}, {"lora_alpha", 4}, {"dp", 1.5}, {"target_modules", {"qkv_proj"}}}).find(
            "dropout must be in [0, 1), got 1.5") != std::string::npos);
  CHECK(with_block({{"r", 2}, {"lora_alpha", 4}}).find("user_lora.target_modules") != std::string::npos);
  // A block that differs from the stored tensors: a shape error naming the tensor.
  CHECK(with_block({{"r", 3}, {"lora_alpha", 4}, {"target_modules", {"qkv_proj"}}}).find("lora_A.user.weight") !=
        std::string::npos);
}

TEST_CASE("phi4mm/areno merge-lora: the adapter folded into the base weights gives the same logits under the released names") {
  auto m = load_model(testing::kTinyDir);
  m->add_user_lora(user_cfg(3, 4.5, {"qkv_proj", "down_proj"}), 5);
  randomise_user(*m, 8);
  TempDir tmp;
  save_model(*m, tmp.str("lora"));
  std::ofstream(tmp.str("lora/tokenizer_config.json")) << "{}";
  REQUIRE(app::cmd_merge_lora({"--model-path", tmp.str("lora"), "--out", tmp.str("merged")}) == 0);
  LoadReport rep;
  auto merged = load_model(tmp.str("merged"), {}, &rep);
  CHECK(rep.summary() == "46 of 46 tensors consumed, 0 missing, 0 unexpected (0 skipped)");
  CHECK_FALSE(merged->config().user_lora);
  std::ifstream f(tmp.str("merged/config.json"));
  CHECK_FALSE(json::parse(f).contains("user_lora"));
  CHECK(fs::exists(tmp.str("merged/tokenizer_config.json")));
  CHECK(fs::exists(tmp.str("merged/preprocessor_config.json")));
  for (Adapter a : {Adapter::none, Adapter::vision, Adapter::speech}) {
    CAPTURE(adapter_name(a));
    CHECK(rel(logits_of(*merged, a), logits_of(*m, a)) < 1e-5);
  }
  // W + s·B·A on the targets; every other tensor as it was.
  NoGradGuard ng;
  for (auto& [name, p] : merged->named_parameters()) {
    const std::string& param = name;  // clang 14 cannot capture a structured binding
    CAPTURE(param);
    const Tensor before = m->get(name);
    const std::string base = ".base_layer.weight";
    const bool target = (name.find("qkv_proj") != std::string::npos || name.find("down_proj") != std::string::npos) &&
                        name.ends_with(base);
    if (!target) {
      CHECK(same_bits(p, before));
      continue;
    }
    const std::string mod = name.substr(0, name.size() - base.size());
    const Tensor want = add(before, mul(matmul(m->get(mod + ".lora_B.user.weight"), m->get(mod + ".lora_A.user.weight")), 1.5));
    CHECK(rel(p, want) < 1e-6);
    CHECK(max_abs_diff(p, before) > 1e-3);
  }
  // Nothing to merge, or the checkpoint itself as --out, is refused.
  CHECK_THROWS_WITH_AS(app::cmd_merge_lora({"--model-path", testing::kTinyDir, "--out", tmp.str("x")}),
                       doctest::Contains("no \"user_lora\": nothing to merge"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_merge_lora({"--model-path", tmp.str("lora"), "--out", tmp.str("lora")}),
                       doctest::Contains("the checkpoint itself"), std::invalid_argument);
}

TEST_CASE("phi4mm/--lora DIR: a PEFT folder as peft saves it loads as the user adapter and gives peft's logits") {
  // tests/data/model/user_peft: the golden's "user" adapter, pm.save_pretrained.
  const std::string peft_dir = "tests/data/model/user_peft";
  const SafetensorsFile golden("tests/data/model/user_lora_golden.safetensors");
  LoadOptions lo;
  lo.lora_dir = peft_dir;
  LoadReport rep;
  auto m = load_model(testing::kTinyDir, lo, &rep);
  CHECK(rep.summary() == "54 of 54 tensors consumed, 0 missing, 0 unexpected (0 skipped)");
  REQUIRE(m->config().user_lora);
  CHECK(m->config().user_lora->r == 3);
  CHECK(m->config().user_lora->scaling() == 1.5);
  CHECK(m->config().user_lora->targets == std::vector<std::string>{"qkv_proj", "down_proj"});
  const std::vector<int64_t> ids = golden.load_copy("ids_a").to_vector<int64_t>();
  for (Adapter a : {Adapter::none, Adapter::vision, Adapter::speech}) {
    CAPTURE(adapter_name(a));
    NoGradGuard ng;
    CHECK(testing::rel_err(m->logits(PackedBatch::single(ids, a)),
                           golden.load_copy(fmt::format("user_logits_a_{}", adapter_name(a)))) < 1e-5);
  }
  // merge-lora folds a PEFT folder into a checkpoint without one.
  TempDir tmp;
  REQUIRE(app::cmd_merge_lora({"--model-path", testing::kTinyDir, "--lora", peft_dir, "--out", tmp.str("merged")}) == 0);
  auto merged = load_model(tmp.str("merged"));
  CHECK_FALSE(merged->config().user_lora);
  CHECK(rel(logits_of(*merged, Adapter::speech), logits_of(*m, Adapter::speech)) < 1e-5);

  // Refusals, by key or tensor, before any weight is read.
  auto with_config = [&](const std::function<void(json&)>& edit) {
    const fs::path d = tmp.path / "peft";
    fs::create_directories(d);
    fs::copy_file(peft_dir + "/adapter_model.safetensors", d / "adapter_model.safetensors",
                  fs::copy_options::overwrite_existing);
    std::ifstream in(peft_dir + "/adapter_config.json");
    json j = json::parse(in);
    edit(j);
    std::ofstream(d / "adapter_config.json") << j.dump();
    LoadOptions bad;
    bad.lora_dir = d.string();
    try {
      load_model(testing::kTinyDir, bad);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(with_config([](json& j) { j["use_dora"] = true; }).find("DoRA / rsLoRA adapters are not supported") != std::string::npos);
  CHECK(with_config([](json& j) { j["bias"] = "all"; }).find("key 'bias'") != std::string::npos);
  CHECK(with_config([](json& j) { j["modules_to_save"] = {"lm_head"}; }).find("key 'modules_to_save'") != std::string::npos);
  CHECK(with_config([](json& j) { j["rank_pattern"] = {{"qkv_proj", 8}}; }).find("key 'rank_pattern'") != std::string::npos);
  CHECK(with_config([](json& j) { j["r"] = 4; }).find("lora_A.user.weight") != std::string::npos);  // shapes
  CHECK(with_config([](json&) {}).empty());
  {
    // A tensor of a module the user adapter cannot wrap.
    const fs::path d = tmp.path / "peft_tower";
    fs::create_directories(d);
    fs::copy_file(peft_dir + "/adapter_config.json", d / "adapter_config.json", fs::copy_options::overwrite_existing);
    save_safetensors((d / "adapter_model.safetensors").string(),
                     {{"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight", zeros({3, 32})}});
    LoadOptions bad;
    bad.lora_dir = d.string();
    CHECK_THROWS_WITH_AS(load_model(testing::kTinyDir, bad),
                         doctest::Contains("tensor 'base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight' is "
                                           "not a LoRA weight of a decoder layer's"),
                         std::runtime_error);
  }
  // The commands' loader: through --model-path only.
  app::ModelNeeds needs;
  needs.lora_dir = peft_dir;
  CHECK(app::load_served_model(testing::kTinyDir, "cpu", "", [&] {
          app::ModelNeeds n = needs;
          n.tokenizer = false;
          return n;
        }()).model->config().user_lora->r == 3);
  // The demo model (its sizes are not the tiny checkpoint's): refused by tensor shape.
  CHECK_THROWS_WITH_AS(app::load_served_model("", "cpu", "", needs), doctest::Contains("wrong shape"), std::runtime_error);
  // A checkpoint that holds a user adapter already.
  save_model(*m, tmp.str("with_user"));
  LoadOptions twice;
  twice.lora_dir = peft_dir;
  CHECK_THROWS_WITH_AS(load_model(tmp.str("with_user"), twice), doctest::Contains("holds a user LoRA already"),
                       std::runtime_error);
}

TEST_CASE("phi4mm/areno export-lora: the user adapter as peft saves it, read back by --lora to the same logits") {
  const std::string peft_dir = "tests/data/model/user_peft";
  LoadOptions lo;
  lo.lora_dir = peft_dir;
  auto m = load_model(testing::kTinyDir, lo);
  TempDir tmp;
  save_model(*m, tmp.str("ckpt"));
  REQUIRE(app::cmd_export_lora({"--model-path", tmp.str("ckpt"), "--out", tmp.str("peft")}) == 0);
  // peft's own file, tensor for tensor.
  const SafetensorsFile ours(tmp.str("peft/adapter_model.safetensors")), theirs(peft_dir + "/adapter_model.safetensors");
  std::vector<std::string> a = ours.names(), b = theirs.names();
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  CHECK(a == b);
  for (const std::string& n : b) CHECK_MESSAGE(same_bits(ours.load(n), theirs.load(n)), n);
  std::ifstream f(tmp.str("peft/adapter_config.json"));
  const json cfg = json::parse(f);
  CHECK(cfg["r"] == 3);
  CHECK(cfg["lora_alpha"] == 4.5);
  CHECK(cfg["target_modules"] == "model\\.layers\\.\\d+\\.(self_attn\\.qkv_proj|mlp\\.down_proj)");
  LoadOptions back;
  back.lora_dir = tmp.str("peft");
  auto r = load_model(testing::kTinyDir, back);
  for (Adapter ad : {Adapter::none, Adapter::speech}) CHECK(same_bits(logits_of(*r, ad), logits_of(*m, ad)));
  CHECK_THROWS_WITH_AS(app::cmd_export_lora({"--model-path", testing::kTinyDir, "--out", tmp.str("x")}),
                       doctest::Contains("nothing to export"), std::invalid_argument);
}

TEST_CASE("phi4mm/served LoRAs (--lora-modules): each sequence's adapter, as that folder loaded as the user adapter") {
  const std::string peft_a = "tests/data/model/user_peft";  // rank 3, scaling 1.5, qkv_proj and down_proj
  TempDir tmp;
  {
    // Adapter b: rank 4, alpha 8 (a power-of-two scaling: the fused path), every target.
    auto mb = load_model(testing::kTinyDir);
    mb->add_user_lora(user_cfg(4, 8.0), 1);
    randomise_user(*mb, 7);
    save_user_lora_peft(*mb, tmp.str("b"));
  }
  auto base = load_model(testing::kTinyDir);
  LoadOptions la, lb;
  la.lora_dir = peft_a;
  lb.lora_dir = tmp.str("b");
  auto ua = load_model(testing::kTinyDir, la), ub = load_model(testing::kTinyDir, lb);
  const Phi4MMForCausalLM* ref[3] = {base.get(), ua.get(), ub.get()};

  auto m = load_model(testing::kTinyDir);
  const size_t params = m->named_parameters().size();
  CHECK(load_served_lora(*m, "a", peft_a) == 1);
  CHECK(load_served_lora(*m, "b", tmp.str("b")) == 2);
  REQUIRE(m->served_loras().size() == 2);
  CHECK(m->served_loras()[0].name == "a");
  CHECK(m->served_loras()[0].source == peft_a);
  CHECK(m->served_loras()[1].cfg.r == 4);
  CHECK(m->served_loras()[1].cfg.targets == kLoraTargets);
  CHECK(m->served_loras()[0].uid != m->served_loras()[1].uid);
  CHECK(m->named_parameters().size() == params);  // outside the module tree: never trained or saved
  CHECK_FALSE(m->config().user_lora);

  NoGradGuard ng;
  const std::vector<int64_t> ids = gold_ids("ids_a");
  // Alone: the bits of the same folder as the user adapter, beside each row adapter.
  for (Adapter ad : {Adapter::none, Adapter::vision, Adapter::speech})
    for (int32_t j = 0; j < 3; ++j) {
      CAPTURE(adapter_name(ad));
      CAPTURE(j);
      PackedBatch pb = PackedBatch::single(ids, ad);
      pb.served_lora = {j};
      CHECK(same_bits(m->logits(pb), ref[j]->logits(PackedBatch::single(ids, ad))));
    }
  // Mixed in one batch: every sequence its own adapters.
  const std::vector<std::vector<int64_t>> seqs = {ids, {ids.begin(), ids.begin() + 5}, ids, {ids.begin() + 2, ids.end()},
                                                  {ids.begin(), ids.begin() + 3}};
  const std::vector<Adapter> row = {Adapter::vision, Adapter::none, Adapter::speech, Adapter::none, Adapter::speech};
  PackedBatch pb = PackedBatch::pack(seqs, row);
  pb.served_lora = {1, 0, 2, 1, 2};
  const Tensor mixed = m->logits(pb);
  for (size_t s = 0; s < seqs.size(); ++s) {
    CAPTURE(s);
    const Tensor want = ref[pb.served_lora[s]]->logits(PackedBatch::single(seqs[s], row[s]));
    CHECK(testing::rel_err(mixed.narrow(0, pb.cu_seqlens[s], int64_t(seqs[s].size())), want) < 1e-5);
  }
  // The incremental (serving) forward: the same rows.
  {
    PagedKvCache cache(*m, 16, 4);
    std::vector<KvSequence> kv(seqs.size());
    IncrementalBatch ib;
    for (size_t s = 0; s < seqs.size(); ++s) ib.add(kv[s], seqs[s], row[s], RopeTable::automatic, pb.served_lora[s]);
    for (size_t s = 0; s < seqs.size(); ++s) ib.logit_rows.push_back(pb.cu_seqlens[s + 1] - 1);
    const Tensor inc = forward_incremental(*m, cache, ib);
    for (size_t s = 0; s < seqs.size(); ++s)
      CHECK(testing::rel_err(inc.narrow(0, int64_t(s), 1), mixed.narrow(0, pb.cu_seqlens[s + 1] - 1, 1)) < 1e-5);
  }
  // On top of the model's own user adapter: the sum of both.
  REQUIRE(app::cmd_merge_lora({"--model-path", testing::kTinyDir, "--lora", peft_a, "--out", tmp.str("merged")}) == 0);
  auto merged_b = load_model(tmp.str("merged"), lb);
  CHECK(load_served_lora(*ua, "b", tmp.str("b")) == 1);
  PackedBatch both = PackedBatch::single(ids, Adapter::speech);
  both.served_lora = {1};
  CHECK(testing::rel_err(ua->logits(both), merged_b->logits(PackedBatch::single(ids, Adapter::speech))) < 1e-5);

  // Refusals: nothing is attached after one.
  CHECK_THROWS_WITH_AS(load_served_lora(*m, "a", tmp.str("b")), doctest::Contains("named 'a' already"),
                       std::invalid_argument);
  {
    const fs::path d = tmp.path / "bad";
    fs::create_directories(d);
    fs::copy_file(peft_a + "/adapter_model.safetensors", d / "adapter_model.safetensors");
    std::ifstream in(peft_a + "/adapter_config.json");
    json j = json::parse(in);
    j["r"] = 4;
    std::ofstream(d / "adapter_config.json") << j.dump();
  }
  CHECK_THROWS_WITH_AS(load_served_lora(*m, "c", tmp.str("bad")), doctest::Contains("wrong shape"), std::runtime_error);
  CHECK_THROWS_WITH_AS(load_served_lora(*m, "c", tmp.str("nowhere")), doctest::Contains("no adapter_config.json"),
                       std::runtime_error);
  CHECK(m->served_loras().size() == 2);
  PackedBatch again = PackedBatch::single(ids, Adapter::vision);
  again.served_lora = {2};
  CHECK(same_bits(m->logits(again), ub->logits(PackedBatch::single(ids, Adapter::vision))));
  again.served_lora = {3};
  CHECK_THROWS_WITH_AS(m->logits(again), doctest::Contains("served LoRA 3 of 2"), std::invalid_argument);
  again.served_lora = {1, 1};
  CHECK_THROWS_WITH_AS(m->logits(again), doctest::Contains("2 served LoRAs for 1 sequences"), std::invalid_argument);
  // Unloaded: refused by number; the next adapter takes the number, with a new uid.
  const uint64_t uid_a = m->served_loras()[0].uid;
  m->remove_served_lora(1);
  CHECK(m->served_loras()[0].removed);
  again.served_lora = {1};
  CHECK_THROWS_WITH_AS(m->logits(again), doctest::Contains("served LoRA 1 of 2 was unloaded"), std::invalid_argument);
  CHECK_THROWS_AS(m->remove_served_lora(1), std::out_of_range);
  CHECK(load_served_lora(*m, "a", peft_a) == 1);
  CHECK(m->served_loras()[0].uid != uid_a);
  CHECK(same_bits(m->logits(again), ua->logits(PackedBatch::single(ids, Adapter::vision))));
  CHECK(load_served_lora(*m, "c", tmp.str("b")) == 3);
}
