// The trainer against PyTorch (issue 14, must-shows 1 and 2), from the goldens
// of tests/reference/train/make_train_golden.py:
//   grad_golden    one micro-batch of text, image, audio and image+audio rows on
//                  the tiny checkpoint in f32, every group unfrozen: the loss and
//                  the gradient of every trainable parameter (transformers' port + peft)
//   optim_golden   three AdamW steps, three groups with their learning rates,
//                  warm-up + cosine / linear decay, global-norm clipping (torch.optim.AdamW)
#include <doctest/doctest.h>

#include <fmt/format.h>

#include "nn/io/safetensors.h"
#include "tests/train/grad_golden_check.h"
#include "tests/train/train_fixtures.h"
#include "train/sft.h"

using namespace areno;
using namespace areno::train;
using namespace areno::testing;

TEST_CASE("train/golden: one mixed micro-batch gives PyTorch's loss and gradients, every group unfrozen") {
  SafetensorsFile g("tests/data/train/grad_golden.safetensors");
  auto model = tiny_phi4mm(0.0);  // the golden runs without dropout
  std::vector<SftRow> rows = golden_rows();
  std::vector<int64_t> ids, targets, adapters;
  for (const SftRow& r : rows) {
    ids.insert(ids.end(), r.ids.begin(), r.ids.end());
    targets.insert(targets.end(), r.targets.begin(), r.targets.end());
    adapters.push_back(int64_t(r.adapter));
  }
  REQUIRE(ids == g.load_copy("batch.ids").to_vector<int64_t>());
  REQUIRE(targets == g.load_copy("batch.targets").to_vector<int64_t>());
  REQUIRE(adapters == g.load_copy("batch.adapters").to_vector<int64_t>());

  SftOptions o;
  o.batch_size = o.mini_bs = 4;  // one packed forward
  o.groups.projector = o.groups.tower = true;
  SftTrainer t(model, rows, o);
  std::vector<const SftRow*> all;
  for (const SftRow& r : rows) all.push_back(&r);
  const double loss = t.accumulate(all, 0, 0);
  const double want = g.load_copy("loss").item();
  CHECK(std::abs(loss - want) / want < 1e-6);

  const GradCheck gc = check_golden_grads(*model, g);
  CHECK(gc.compared == 180);  // 179 tensors + the embedding
  MESSAGE("loss " << loss << " (torch " << want << "), worst gradient error " << gc.worst);
}

TEST_CASE("train/golden: three AdamW steps, three groups, warm-up, decay and clipping equal torch.optim.AdamW") {
  SafetensorsFile g("tests/data/train/optim_golden.safetensors");
  const std::vector<std::string> names = {
      "model.layers.0.mlp.down_proj.base_layer.weight",
      "model.layers.0.input_layernorm.weight",
      "model.embed_tokens_extend.image_embed.img_projection.0.weight",
      "model.embed_tokens_extend.image_embed.img_projection.0.bias",
      "model.embed_tokens_extend.image_embed.glb_GN",
      "model.embed_tokens_extend.image_embed.img_processor.encoder.layers.0.mlp.fc1.weight",
      "model.embed_tokens_extend.image_embed.img_processor.encoder.layers.0.mlp.fc1.bias"};
  struct Trajectory {
    const char* prefix;
    DecayStyle style;
    int64_t warmup, decay;
  };
  for (const Trajectory& tr : {Trajectory{"cos", DecayStyle::cosine, 2, 3}, Trajectory{"lin", DecayStyle::linear, 2, 3},
                               Trajectory{"cos_alt", DecayStyle::cosine, 1, 4},
                               Trajectory{"lin_alt", DecayStyle::linear, 1, 4}}) {
    CAPTURE(tr.prefix);
    // A module tree with the checkpoint names, so the trainer's grouping applies.
    Module root;
    std::map<std::string, Tensor> params;
    for (const std::string& n : names) {
      Module* m = &root;
      std::string rest = n;
      for (size_t dot; (dot = rest.find('.')) != std::string::npos; rest = rest.substr(dot + 1)) {
        const std::string part = rest.substr(0, dot);
        Module* next = nullptr;
        for (auto& [cn, c] : m->named_children())
          if (cn == part) next = c.get();
        m = next ? next : m->register_module(part, std::make_shared<Module>()).get();
      }
      params[n] = m->register_parameter(rest, g.load_copy("init." + n));
    }
    GroupHyper h;
    h.lr[int(Group::lm)] = 1e-2, h.lr[int(Group::projector)] = 5e-3, h.lr[int(Group::tower)] = 2e-3;
    h.weight_decay = 0.1;
    h.schedule = make_schedule(tr.style, tr.warmup, tr.decay, 0.1);
    AdamWOptions ao;
    ao.beta1 = 0.9, ao.beta2 = 0.95, ao.eps = 1e-8;
    AdamW opt(make_param_groups(root, h), ao);
    REQUIRE(opt.param_groups().size() == 6);  // lm, projector, tower, each with and without decay
    Tensor lrs = g.load_copy(std::string(tr.prefix) + ".lrs"), norms = g.load_copy(std::string(tr.prefix) + ".norms");
    for (int64_t k = 0; k < 3; ++k) {
      CAPTURE(k);
      for (const std::string& n : names) params[n].set_grad(g.load_copy(fmt::format("grad.{}.{}", k, n)));
      for (size_t i = 0; i < opt.param_groups().size(); ++i) {
        const int grp = int(group_of_param_group(opt.param_groups()[i]));
        CHECK(opt.current_lr(i) == doctest::Approx(lrs.select(0, k).select(0, grp).item()).epsilon(1e-12));
      }
      CHECK(clip_grad_norm(opt.parameters(), 1.0) == doctest::Approx(norms.select(0, k).item()).epsilon(1e-6));
      opt.step();
      opt.zero_grad();
      for (const std::string& n : names) {
        CAPTURE(n);
        Tensor want = g.load_copy(fmt::format("{}.{}.{}", tr.prefix, k, n));
        CHECK(max_abs_diff(params[n], want) / max_abs(want) < 1e-6);
      }
    }
  }
}
