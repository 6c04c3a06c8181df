// Module: dotted names, counts, freeze/unfreeze, state_dict round trips and
// load errors, in-place to(dtype)/to(device), train/eval, registration errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "nn/layers.h"
#include "nn/module.h"
#include "tensor/autograd.h"
#include "tests/nn/tiny_model.h"
#include "tests/test_util.h"

using namespace areno;
using namespace areno::testing;

namespace {

std::vector<std::string> names_of(const NamedTensors& nt) {
  std::vector<std::string> out;
  for (auto& [n, t] : nt) out.push_back(n);
  return out;
}

Tensor tiny_ids() { return from_vector<int64_t>({3, 1, 4, 1, 5, 9, 2, 6}, {2, 4}); }

bool throws_containing(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
  } catch (const std::exception& e) {
    std::string m = e.what();
    for (auto& p : parts)
      if (m.find(p) == std::string::npos) {
        MESSAGE("message '" << m << "' lacks '" << p << "'");
        return false;
      }
    return true;
  }
  return false;
}

}  // namespace

TEST_CASE("nn/module names parameters, buffers and modules with stable dotted paths") {
  Generator gen(1);
  TinyModel m(gen);
  const std::vector<std::string> want = {
      "embed.weight",          "layers.0.norm.weight", "layers.0.proj.weight", "layers.0.proj.bias",
      "layers.1.norm.weight",  "layers.1.proj.weight", "layers.1.proj.bias",   "final_norm.weight",
      "final_norm.bias",       "head.weight"};
  CHECK(names_of(m.named_parameters()) == want);
  CHECK(m.parameters().size() == want.size());
  // 11*6 + 2*(6 + 36 + 6) + 6 + 6 + 6*11
  CHECK(m.num_parameters() == 66 + 2 * 48 + 12 + 66);
  CHECK(m.named_parameters(false).empty());
  CHECK(m.get("layers.1.proj.weight").shape() == Shape{6, 6});
  CHECK(m.get("layers.1.proj.weight").same(m.layers->at<TinyBlock>(1)->proj->weight));
  CHECK_THROWS_AS(m.get("layers.2.proj.weight"), std::invalid_argument);
  CHECK_THROWS_AS(m.layers->at<TinyBlock>(2), std::out_of_range);
  CHECK_THROWS_AS(m.layers->at<Linear>(0), std::invalid_argument);

  std::vector<std::string> mods;
  for (auto& [n, p] : m.named_modules()) mods.push_back(n);
  const std::vector<std::string> want_mods = {"",           "embed",       "layers",
                                              "layers.0",   "layers.0.norm", "layers.0.proj",
                                              "layers.1",   "layers.1.norm", "layers.1.proj",
                                              "final_norm", "head"};
  CHECK(mods == want_mods);

  // Buffers: listed with their path; non-persistent ones stay out of state_dict.
  m.layers->at<TinyBlock>(0)->register_buffer("positions", arange(4));
  m.register_buffer("scratch", zeros({2}), /*persistent=*/false);
  CHECK(names_of(m.named_buffers()) == std::vector<std::string>{"scratch", "layers.0.positions"});
  auto sd = m.state_dict();
  CHECK(sd.size() == want.size() + 1);
  CHECK(sd.count("layers.0.positions") == 1);
  CHECK(sd.count("scratch") == 0);
}

TEST_CASE("nn/module registration rejects bad names and non-float trainable parameters") {
  Module m("Test");
  m.register_parameter("w", zeros({2}));
  CHECK_THROWS_AS(m.register_parameter("w", zeros({2})), std::invalid_argument);
  CHECK_THROWS_AS(m.register_buffer("w", zeros({2})), std::invalid_argument);
  CHECK_THROWS_AS(m.register_parameter("a.b", zeros({2})), std::invalid_argument);
  CHECK_THROWS_AS(m.register_parameter("", zeros({2})), std::invalid_argument);
  CHECK_THROWS_AS(m.register_parameter("ids", arange(3)), std::invalid_argument);
  CHECK_NOTHROW(m.register_parameter("frozen_ids", arange(3), /*requires_grad=*/false));
  CHECK(m.get("w").requires_grad());
}

TEST_CASE("nn/freeze and unfreeze set requires_grad by name prefix") {
  Generator gen(2);
  TinyModel m(gen);
  CHECK(m.freeze("layers.0") == 3);
  for (auto& [n, p] : m.named_parameters()) {
    CAPTURE(n);
    CHECK(p.requires_grad() == (n.rfind("layers.0.", 0) != 0));
  }
  CHECK(m.num_parameters(/*only_trainable=*/true) == m.num_parameters() - 48);
  // A prefix matches whole name components only: "proj.w" is not "proj.weight".
  CHECK_THROWS_AS(m.freeze("layers.0.proj.w"), std::invalid_argument);
  CHECK(m.freeze("layers.0.proj.weight") == 1);  // an exact name is a prefix too
  CHECK(m.unfreeze("layers.0.proj") == 2);
  CHECK(m.get("layers.0.proj.weight").requires_grad());
  CHECK_FALSE(m.get("layers.0.norm.weight").requires_grad());
}

TEST_CASE("nn/freeze matches whole components, rejects unknown prefixes, and frozen params get no grad") {
  Generator gen(3);
  Module m("M");
  auto a = m.register_module("layer", std::make_shared<Linear>(LinearOptions(2, 2), gen));
  auto b = m.register_module("layer1", std::make_shared<Linear>(LinearOptions(2, 2), gen));
  CHECK(m.freeze("layer") == 2);
  CHECK_FALSE(a->weight.requires_grad());
  CHECK(b->weight.requires_grad());  // "layer1" does not start with "layer."
  CHECK(throws_containing([&] { m.freeze("layr"); }, {"layr"}));

  Tensor x = ones({3, 2});
  sum(b->forward(a->forward(x))).backward();
  CHECK_FALSE(a->weight.grad().defined());
  CHECK(b->weight.grad().defined());

  CHECK(m.unfreeze("") == 4);
  CHECK(a->weight.requires_grad());
  m.zero_grad();
  CHECK_FALSE(b->weight.grad().defined());
}

TEST_CASE("nn/state_dict round trip copies values into another model") {
  Generator g1(10), g2(20);
  TinyModel a(g1), b(g2);
  Tensor ids = tiny_ids();
  CHECK(max_abs_diff(a.forward(ids), b.forward(ids)) > 1e-3);
  Tensor b_weight = b.head->weight;  // a handle taken before loading stays valid
  b.load_state_dict(a.state_dict());
  CHECK(max_abs_diff(a.forward(ids), b.forward(ids)) == 0.0);
  CHECK(b_weight.same(b.head->weight));
  CHECK(max_abs_diff(b_weight, a.head->weight) == 0.0);
  // The values were copied, not aliased.
  a.head->weight.fill_(0.0);
  CHECK(max_abs_diff(b.head->weight, zeros({11, 6})) > 1e-3);
  // Loading casts: an f64 state dict into an f32 model.
  StateDict sd64;
  for (auto& [n, t] : a.state_dict()) sd64[n] = t.to(DType::f64);
  b.load_state_dict(sd64);
  CHECK(b.head->weight.dtype() == DType::f32);
  CHECK(max_abs_diff(b.head->weight, a.head->weight) == 0.0);
}

TEST_CASE("nn/load_state_dict names missing, unexpected and wrong-shape tensors") {
  Generator g(4);
  TinyModel m(g);
  auto good = m.state_dict();
  Tensor before = m.embed->weight.clone();

  auto missing = good;
  missing.erase("layers.1.proj.bias");
  CHECK(throws_containing([&] { m.load_state_dict(missing); }, {"missing", "layers.1.proj.bias"}));

  auto extra = good;
  extra["layers.2.proj.bias"] = zeros({6});
  CHECK(throws_containing([&] { m.load_state_dict(extra); }, {"unexpected", "layers.2.proj.bias"}));

  auto bad = good;
  bad["head.weight"] = zeros({6, 11});
  bad["embed.weight"] = ones({11, 6});
  CHECK(throws_containing([&] { m.load_state_dict(bad); }, {"wrong shape", "head.weight", "[11, 6]", "[6, 11]"}));
  // Nothing was copied: the error came before any tensor was touched.
  CHECK(max_abs_diff(m.embed->weight, before) == 0.0);

  // Non-strict loading skips missing/unexpected names but never a shape mismatch.
  missing["layers.9.x"] = zeros({1});
  CHECK_NOTHROW(m.load_state_dict(missing, /*strict=*/false));
  CHECK_THROWS_AS(m.load_state_dict(bad, /*strict=*/false), std::runtime_error);
}

TEST_CASE("nn/to(dtype) converts floating tensors in place and keeps handles valid") {
  Generator g(5);
  TinyModel m(g);
  m.register_buffer("ids", arange(4));
  m.register_buffer("table", ones({3}));
  Tensor w = m.layers->at<TinyBlock>(0)->proj->weight;
  auto params_before = m.parameters();
  Tensor ids = tiny_ids();
  Tensor y32 = m.forward(ids);
  sum(y32).backward();  // gradients exist and must follow the conversion
  REQUIRE(w.grad().defined());

  m.to(DType::bf16);
  for (auto& [n, p] : m.named_parameters()) {
    CAPTURE(n);
    CHECK(p.dtype() == DType::bf16);
    CHECK(p.requires_grad());
    CHECK(p.is_leaf());
  }
  CHECK(w.dtype() == DType::bf16);  // the handle taken before to() sees the new data
  CHECK(w.same(m.layers->at<TinyBlock>(0)->proj->weight));
  CHECK(params_before[0].dtype() == DType::bf16);
  CHECK(w.grad().dtype() == DType::bf16);
  CHECK(m.get("ids").dtype() == DType::i64);  // integer buffers keep their dtype
  CHECK(m.get("table").dtype() == DType::bf16);
  Tensor y16 = m.forward(ids);
  CHECK(y16.dtype() == DType::bf16);
  CHECK(max_abs_diff(y16, y32) < 0.15);  // bf16 rounding of weights and activations

  m.to(DType::f32);
  CHECK(w.dtype() == DType::f32);
  CHECK_THROWS_AS(m.to(DType::i32), std::invalid_argument);
}

DEVICE_TEST_CASE("nn/to(device) moves every tensor and forward runs there") {
  Generator g(6);
  TinyModel m(g);
  Tensor ids = tiny_ids();
  Tensor want = m.forward(ids);
  Tensor w = m.head->weight;
  void* before = w.data_ptr();
  m.to(device);
  for (auto& [n, p] : m.named_parameters()) CHECK(p.device() == device);
  CHECK(w.device() == device);
  if (device.is_cpu()) CHECK(w.data_ptr() == before);  // a move to the same device copies nothing
  Tensor y = m.forward(ids.to(device));
  CHECK(y.device() == device);
  CHECK(max_abs_diff(y, want) < 1e-5);
  m.to(Device::cpu());
  CHECK(w.device() == Device::cpu());
}

TEST_CASE("nn/train and eval are recursive; dropout is the identity in eval") {
  Generator g(7);
  TinyModel m(g);
  auto d = m.register_module("drop", std::make_shared<Dropout>(DropoutOptions(0.5).seed(3)));
  CHECK(m.is_training());
  CHECK(m.layers->at<TinyBlock>(1)->proj->is_training());
  m.eval();
  CHECK_FALSE(m.is_training());
  CHECK_FALSE(m.layers->at<TinyBlock>(1)->proj->is_training());
  CHECK_FALSE(d->is_training());
  Tensor x = ones({4, 8});
  CHECK(max_abs_diff(d->forward(x), x) == 0.0);
  m.train();
  CHECK(d->is_training());
  CHECK(max_abs_diff(d->forward(x), x) > 0.5);
}

TEST_CASE("nn/a tied parameter is listed once and converted once") {
  Generator g(8);
  Module m("Tied");
  auto embed = m.register_module("embed", std::make_shared<Embedding>(EmbeddingOptions(7, 3), g));
  auto head = m.register_module("head", std::make_shared<Module>("Head"));
  Tensor w = head->register_parameter("weight", embed->weight);  // the same handle
  CHECK(names_of(m.named_parameters()) == std::vector<std::string>{"embed.weight"});
  CHECK(m.num_parameters() == 21);
  m.to(DType::bf16);
  CHECK(w.dtype() == DType::bf16);
  CHECK(w.same(embed->weight));
  // Both names are in the state dict, as torch writes tied weights...
  auto sd = m.state_dict();
  CHECK(sd.size() == 2);
  CHECK(sd.at("head.weight").same(w));
  // ...and a checkpoint that stores only one of them loads strictly.
  StateDict one{{"embed.weight", ones({7, 3})}};
  CHECK_NOTHROW(m.load_state_dict(one));
  CHECK(max_abs_diff(w, ones({7, 3})) == 0.0);
}
