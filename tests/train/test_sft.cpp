// The SFT loop (issue 14, "Loop", "Checkpoints"; must-shows 3, 4, 5): the
// chunked loss, freezing, dropout only where parameters train, micro-batch
// and activation-checkpointing equivalences, exact resume, and a saved step
// that loads to the same logits bit for bit.
#include <doctest/doctest.h>

#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>

#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/kv_cache.h"
#include "nn/io/files.h"
#include "tensor/autograd.h"
#include "tests/test_util.h"
#include "tests/train/train_fixtures.h"
#include "train/sft.h"

using namespace areno;
using namespace areno::train;
using namespace areno::testing;

namespace {

std::map<std::string, Tensor> grads_of(const Module& m) {
  std::map<std::string, Tensor> out;
  for (auto& [name, p] : m.named_parameters())
    if (p.grad().defined()) out[name] = p.grad().clone();
  return out;
}

std::map<std::string, Tensor> weights_of(const Module& m) {
  std::map<std::string, Tensor> out;
  for (auto& [name, p] : m.named_parameters()) out[name] = p.detach().clone();
  return out;
}

double rel(const Tensor& a, const Tensor& b) {
  const double scale = max(abs(b.to(DType::f64))).item();
  return max_abs_diff(a.to(DType::f64), b.to(DType::f64)) / std::max(scale, 1e-30);
}

double l2(const Tensor& t) { return std::sqrt(sum(square(t.to(DType::f64))).item()); }

// ||a - b|| / ||b||, with ||b|| floored at 1e-6 of `total` (the norm of the
// whole gradient): a gradient that is zero by symmetry (key biases under
// softmax) is rounding noise on both sides.
double grad_rel(const Tensor& a, const Tensor& b, double total) {
  return l2(sub(a.to(DType::f64), b.to(DType::f64))) / std::max(l2(b), 1e-6 * total);
}

double total_norm(const std::map<std::string, Tensor>& g) {
  double s = 0;
  for (auto& [n, t] : g) s += std::pow(l2(t), 2);
  return std::sqrt(s);
}

std::vector<const SftRow*> pointers(const std::vector<SftRow>& rows) {
  std::vector<const SftRow*> out;
  for (const SftRow& r : rows) out.push_back(&r);
  return out;
}

SftOptions all_groups() {
  SftOptions o;
  o.batch_size = 4;
  o.mini_bs = 4;
  o.groups.projector = o.groups.tower = true;
  return o;
}

}  // namespace

TEST_CASE("train/loss: chunked cross-entropy equals the full softmax, value and gradients") {
  Generator g(7);
  Tensor h0 = rand_normal({9, 6}, g), w0 = rand_normal({13, 6}, g);
  const std::vector<int64_t> tg = {3, -1, 12, 0, -1, 5, 5, 7, -1};
  Tensor targets = from_vector(tg, {9});
  // Reference: log_softmax of the whole logits, picked at the targets.
  Tensor hr = h0.clone().set_requires_grad(), wr = w0.clone().set_requires_grad();
  Tensor lp = log_softmax(linear(hr, wr), -1);
  std::vector<int64_t> rows, picks;
  for (size_t i = 0; i < tg.size(); ++i)
    if (tg[i] >= 0) rows.push_back(int64_t(i)), picks.push_back(tg[i]);
  Tensor ref = neg(sum(gather(index_select(lp, 0, from_vector(rows, {int64_t(rows.size())})), 1,
                              from_vector(picks, {int64_t(picks.size()), 1}))));
  ref.backward();
  for (int64_t chunk : {1, 4, 100}) {
    CAPTURE(chunk);
    Tensor h = h0.clone().set_requires_grad(), w = w0.clone().set_requires_grad();
    Tensor loss = chunked_cross_entropy_sum(h, w, targets, chunk);
    CHECK(loss.item() == doctest::Approx(ref.item()).epsilon(1e-6));
    loss.backward();
    CHECK(rel(h.grad(), hr.grad()) < 1e-6);
    CHECK(rel(w.grad(), wr.grad()) < 1e-6);
    // Rows without a target get exactly no gradient.
    CHECK(max(abs(h.grad().select(0, 1))).item() == 0.0);
  }
  // A vocabulary past the kernel's 16-lane groups, and an incoming gradient
  // other than 1 (the trainer's 1 / target tokens) scaling both gradients.
  {
    Tensor h1 = rand_normal({5, 8}, g), w1 = rand_normal({77, 8}, g, 0.0, 3.0);
    Tensor t1 = from_vector<int64_t>({76, 0, -1, 40, 17}, {5});
    Tensor hr1 = h1.clone().set_requires_grad(), wr1 = w1.clone().set_requires_grad();
    Tensor lp1 = log_softmax(linear(hr1, wr1), -1);
    Tensor ref1 = mul(neg(sum(gather(index_select(lp1, 0, from_vector<int64_t>({0, 1, 3, 4}, {4})), 1,
                                     from_vector<int64_t>({76, 0, 40, 17}, {4, 1})))),
                      0.3);
    ref1.backward();
    for (int64_t chunk : {2, 100}) {
      Tensor h = h1.clone().set_requires_grad(), w = w1.clone().set_requires_grad();
      Tensor loss = mul(chunked_cross_entropy_sum(h, w, t1, chunk), 0.3);
      CHECK(loss.item() == doctest::Approx(ref1.item()).epsilon(1e-6));
      loss.backward();
      CHECK(rel(h.grad(), hr1.grad()) < 1e-6);
      CHECK(rel(w.grad(), wr1.grad()) < 1e-6);
    }
  }
  CHECK_THROWS_WITH_AS(chunked_cross_entropy_sum(h0, w0, from_vector<int64_t>({13, 0, 0, 0, 0, 0, 0, 0, 0}, {9})),
                       doctest::Contains("target 13 at row 0 is outside the vocabulary of 13"), std::invalid_argument);
}

// bf16 rows and a trainable bf16 head: the loss of log_softmax over the
// bf16 logits widened to f32, the gradients within bf16 rounding of that
// reference's (the weight's through add_head_weight_grad: f32 sums over
// chunks, oneDNN's bf16 product with f32 output where it runs, else widened).
TEST_CASE("train/loss: bf16 rows and head, loss and both gradients within bf16 rounding") {
  Generator g(11);
  const Tensor h0 = rand_normal({6, 16}, g).to(DType::bf16), w0 = rand_normal({45, 16}, g, 0.0, 0.5).to(DType::bf16);
  const std::vector<int64_t> tg = {44, -1, 3, 0, 17, 3};
  // The reference's logits are bf16 too (the chunk's are), widened for the
  // log_softmax; its gradients are taken in bf16 by the composed ops.
  Tensor hr = h0.clone().set_requires_grad(), wr = w0.clone().set_requires_grad();
  // Row 1 has no target.
  Tensor ref = neg(sum(gather(index_select(log_softmax(linear(hr, wr).to(DType::f32), -1), 0, from_vector<int64_t>({0, 2, 3, 4, 5}, {5})),
                              1, from_vector<int64_t>({44, 3, 0, 17, 3}, {5, 1}))));
  mul(ref, 0.25).backward();
  for (int64_t chunk : {2, 100}) {
    CAPTURE(chunk);
    Tensor h = h0.clone().set_requires_grad(), w = w0.clone().set_requires_grad();
    Tensor loss = mul(chunked_cross_entropy_sum(h, w, from_vector(tg, {6}), chunk), 0.25);
    CHECK(loss.item() == doctest::Approx(0.25 * ref.item()).epsilon(1e-6));
    loss.backward();
    REQUIRE(w.grad().dtype() == DType::bf16);
    CHECK(rel(h.grad(), hr.grad()) < 0x1p-7);
    CHECK(rel(w.grad(), wr.grad()) < 0x1p-7);
    CHECK(max(abs(h.grad().select(0, 1))).item() == 0.0);
  }
}

// The composed fallback of cross_entropy_rows (a backend without the row
// kernel) gives the kernel's losses and softmax - onehot, from f32 and from
// bf16 logits.
TEST_CASE("train/loss: the composed cross-entropy rows equal the row kernel's") {
  Generator g(13);
  const Tensor x = rand_normal({4, 77}, g, 0.0, 3.0);
  const Tensor t = from_vector<int64_t>({76, 0, 40, 17}, {4, 1});
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    const Tensor xd = x.to(dt);
    const CrossEntropyRows k = cross_entropy_rows(xd.clone(), t, true), c = cross_entropy_rows_composed(xd.clone(), t, true);
    const CrossEntropyRows c_nograd = cross_entropy_rows_composed(xd.clone(), t, false);
    REQUIRE(c.grad.dtype() == DType::f32);
    CHECK_FALSE(c_nograd.grad.defined());
    CHECK(rel(c.nll, k.nll) < 1e-6);
    CHECK(rel(c_nograd.nll, k.nll) < 1e-6);
    // f32: the same values to f32 rounding; bf16: the kernel's grad is rounded once.
    CHECK(max_abs_diff(c.grad, k.grad.to(DType::f32)) < (dt == DType::f32 ? 1e-6 : 0x1p-8));
    // Each row of softmax - onehot sums to 0.
    CHECK(max(abs(sum(c.grad, {1}))).item() < 1e-5);
  }
}

TEST_CASE("train/groups: names map to lm, projector and tower; weight decay skips biases, norms, separators") {
  CHECK(group_of("model.embed_tokens.weight") == Group::lm);
  CHECK(group_of("model.layers.3.self_attn.qkv_proj.lora_B.speech.weight") == Group::lm);
  CHECK(is_lora("model.layers.3.self_attn.qkv_proj.lora_B.speech.weight"));
  CHECK_FALSE(is_lora("model.layers.3.self_attn.qkv_proj.base_layer.weight"));
  CHECK(group_of("model.embed_tokens_extend.image_embed.glb_GN") == Group::projector);
  CHECK(group_of("model.embed_tokens_extend.image_embed.img_projection.2.bias") == Group::projector);
  CHECK(group_of("model.embed_tokens_extend.audio_embed.audio_projection.vision.0.weight") == Group::projector);
  CHECK(group_of("model.embed_tokens_extend.image_embed.img_processor.head.probe") == Group::tower);
  CHECK(group_of("model.embed_tokens_extend.audio_embed.encoder.encoders.0.conv.glu.b1") == Group::tower);
  CHECK_THROWS_AS(group_of("model.embed_tokens_extend.image_embed.something_new"), std::invalid_argument);
  CHECK(decays(zeros({4, 3})));
  CHECK_FALSE(decays(zeros({3})));
  CHECK_FALSE(decays(zeros({1, 1, 3})));  // glb_GN
  CHECK_FALSE(decays(zeros({1, 3, 1})));  // glu.b1
}

TEST_CASE("train/freeze: by default towers and projectors stay bitwise unchanged, get no gradient, hold no state") {
  auto model = tiny_phi4mm();
  const auto before = weights_of(*model);
  SftOptions o;
  o.batch_size = 4, o.mini_bs = 2, o.lr = 1e-3;
  SftTrainer t(model, golden_rows(), o);
  for (const ParamGroup& g : t.optimizer().param_groups()) {
    CHECK(group_of_param_group(g) == Group::lm);
    for (const std::string& n : g.names) CHECK(group_of(n) == Group::lm);
  }
  // The gradient right after the backward: only lm parameters have one.
  t.accumulate(t.next_batch(), 0, 1);
  int64_t with_grad = 0;
  for (auto& [name, p] : model->named_parameters()) {
    CAPTURE(name);
    if (group_of(name) == Group::lm) {
      with_grad += p.grad().defined();
    } else {
      CHECK_FALSE(p.requires_grad());
      CHECK_FALSE(p.grad().defined());
    }
  }
  CHECK(with_grad > 0);
  model->zero_grad();
  StepStats st = t.step();
  CHECK(std::isfinite(st.loss));
  CHECK(st.rows == 4);
  REQUIRE(st.lrs.size() == 1);
  CHECK(st.lrs[0].first == "lm");
  int64_t changed = 0;
  for (auto& [name, p] : model->named_parameters()) {
    CAPTURE(name);
    const double d = max_abs_diff(p, before.at(name));
    if (group_of(name) == Group::lm) changed += d > 0;
    else CHECK(d == 0.0);
  }
  CHECK(changed > 0);
}

TEST_CASE("train/groups: --embed-rows data trains only the embedding rows of the dataset's ids; none freezes it") {
  const std::vector<SftRow> rows = golden_rows();
  std::set<int64_t> used;
  for (const SftRow& r : rows)
    for (int64_t id : r.ids) used.insert(id);
  auto model = tiny_phi4mm();
  const Tensor before = model->model->embed_tokens->weight.detach().clone();
  SftOptions o;
  o.batch_size = 4, o.mini_bs = 4, o.lr = 1e-3, o.epochs = 2;
  o.groups.embed_rows = EmbedRows::data;
  {
    SftOptions bad = o;
    bad.weight_decay = 0.1;
    CHECK_THROWS_WITH_AS(SftTrainer(tiny_phi4mm(), rows, bad), doctest::Contains("--weight-decay 0"),
                         std::invalid_argument);
  }
  SftTrainer t(model, rows, o);
  t.step();
  t.step();
  const Tensor after = model->model->embed_tokens->weight;
  const int64_t vocab = after.size(0);
  int64_t changed = 0, changed_outside = 0;
  for (int64_t r = 0; r < vocab; ++r) {
    const bool differs = max_abs_diff(after.narrow(0, r, 1), before.narrow(0, r, 1)) != 0.0;
    changed += differs;
    if (differs && !used.count(r)) ++changed_outside;
  }
  CHECK(changed_outside == 0);
  // The rows of text tokens move (the placeholders' rows are replaced by media
  // rows in the forward and get no gradient).
  CHECK(changed >= int64_t(used.size()) - 3);
  CHECK(changed <= int64_t(used.size()));
  // The rest of the decoder trains as usual.
  CHECK(max_abs_diff(model->model->norm->weight, tiny_phi4mm()->model->norm->weight) > 0);

  auto frozen = tiny_phi4mm();
  o.groups.embed_rows = EmbedRows::none;
  SftTrainer tf(frozen, rows, o);
  CHECK_FALSE(frozen->model->embed_tokens->weight.requires_grad());
  tf.step();
  CHECK(max_abs_diff(frozen->model->embed_tokens->weight, before) == 0.0);
  CHECK(embed_rows_from_name("data") == EmbedRows::data);
  CHECK_THROWS_WITH_AS(embed_rows_from_name("some"), doctest::Contains("--embed-rows"), std::invalid_argument);
}

TEST_CASE("train/freeze: dropout (the speech LoRA's 0.01) runs only when its group trains") {
  auto model = tiny_phi4mm();
  const SftRow speech = golden_rows()[2];
  auto hidden = [&](uint64_t seed) {
    phi4mm::PackedBatch b = phi4mm::PackedBatch::single(speech.ids, speech.adapter);
    b.media_rows = phi4mm::media_rows(*model, speech.media);
    b.dropout_seed = seed;
    NoGradGuard ng;
    return model->hidden_states(b);
  };
  auto lora_module_training = [&] {
    return model->model->layers->at<phi4mm::DecoderLayer>(0)->self_attn->qkv_proj->is_training();
  };
  SUBCASE("lm trains: training mode, masks differ by seed") {
    SftTrainer t(model, golden_rows(), SftOptions{});
    CHECK(lora_module_training());
    CHECK_FALSE(model->image_embed()->is_training());
    CHECK(max_abs_diff(hidden(1), hidden(2)) > 0);
    CHECK(max_abs_diff(hidden(1), hidden(1)) == 0);
  }
  SUBCASE("only the LoRA branches train: still dropout") {
    SftOptions o;
    o.groups.lm = LmTrainable::lora;
    SftTrainer t(model, golden_rows(), o);
    CHECK(lora_module_training());
    CHECK_FALSE(model->model->embed_tokens->weight.requires_grad());
    CHECK(max_abs_diff(hidden(1), hidden(2)) > 0);
  }
  SUBCASE("lm frozen, projector trains: evaluation mode, no dropout") {
    SftOptions o;
    o.groups.lm = LmTrainable::none;
    o.groups.projector = true;
    SftTrainer t(model, golden_rows(), o);
    CHECK_FALSE(lora_module_training());
    CHECK_FALSE(model->image_embed()->img_processor->is_training());
    CHECK(max_abs_diff(hidden(1), hidden(2)) == 0);
  }
  SUBCASE("nothing to train is an error") {
    SftOptions o;
    o.groups.lm = LmTrainable::none;
    CHECK_THROWS_WITH_AS(SftTrainer(model, golden_rows(), o), doctest::Contains("nothing to train"),
                         std::invalid_argument);
  }
}

TEST_CASE("train/freeze: a user LoRA's gradients follow from the base weight's; --lm-trainable user trains it alone") {
  auto m = tiny_phi4mm(0.0);  // no adapter dropout: the identities below are exact up to rounding
  phi4mm::LoraConfig l;
  l.r = 3;
  l.alpha = 4.5;  // scaling 1.5
  l.targets = phi4mm::kLoraTargets;
  m->add_user_lora(l, 7);
  {  // B random, so that A gets a gradient too
    Generator g(3);
    NoGradGuard ng;
    for (auto& [name, t] : m->named_parameters())
      if (name.find(".lora_B.user.") != std::string::npos) t.copy_(rand_normal(t.shape(), g, 0.0, 0.3));
  }
  const std::vector<SftRow> rows = golden_rows();
  SUBCASE("gradients: dB = s·dW·Aᵀ and dA = s·Bᵀ·dW (every row uses the base weight and the adapter)") {
    // The base weight's gradient is checked against PyTorch (test_golden);
    // the adapter's follows from it on the same x and upstream gradient.
    SftTrainer t(m, rows, all_groups());
    t.accumulate(pointers(rows), 0, 1);
    const auto g = grads_of(*m);
    const double total = total_norm(g);
    int64_t checked = 0;
    for (int64_t i = 0; i < 2; ++i)
      for (const char* mod : {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}) {
        const std::string p = fmt::format("model.layers.{}.{}.", i, mod);
        CAPTURE(p);
        const Tensor gw = g.at(p + "base_layer.weight");
        const Tensor a = m->get(p + "lora_A.user.weight").detach(), b = m->get(p + "lora_B.user.weight").detach();
        CHECK(grad_rel(g.at(p + "lora_B.user.weight"), mul(matmul(gw, a.t()), 1.5), total) < 1e-5);
        CHECK(grad_rel(g.at(p + "lora_A.user.weight"), mul(matmul(b.t(), gw), 1.5), total) < 1e-5);
        CHECK(l2(g.at(p + "lora_A.user.weight")) > 0);
        ++checked;
      }
    CHECK(checked == 8);
  }
  SUBCASE("only the adapter trains: every other weight bitwise unchanged, the loss falls") {
    const auto before = weights_of(*m);
    SftOptions o;
    o.batch_size = 4;
    o.mini_bs = 2;
    o.max_steps = 12;
    o.lr = 1e-1;
    o.decay = DecayStyle::constant;
    o.groups.lm = LmTrainable::user;
    SftTrainer t(m, rows, o);
    int64_t params = 0;
    for (const ParamGroup& pg : t.optimizer().param_groups()) params += int64_t(pg.params.size());
    CHECK(params == 16);  // A and B of 4 linears in 2 layers
    std::vector<double> losses;
    while (!t.done()) losses.push_back(t.step().loss);
    CHECK(losses.back() < losses.front() - 0.3);  // 12.24 -> 11.65 as written
    int64_t changed = 0;
    for (auto& [name, p] : m->named_parameters()) {
      CAPTURE(name);
      const bool user = is_user_lora(name);
      CHECK(p.requires_grad() == user);
      if (user) changed += max_abs_diff(p.detach(), before.at(name)) > 0;
      else CHECK(max_abs_diff(p.detach(), before.at(name)) == 0.0);
    }
    CHECK(changed == 16);
  }
  SUBCASE("--lm-trainable user without an adapter has nothing to train") {
    SftOptions o;
    o.groups.lm = LmTrainable::user;
    CHECK_THROWS_WITH_AS(SftTrainer(tiny_phi4mm(), rows, o), doctest::Contains("a user LoRA comes with --lora-rank"),
                         std::invalid_argument);
  }
}

TEST_CASE("train/equivalence: 4 micro-batches of 1 equal one micro-batch of 4") {
  // No dropout: a row's mask depends on where it sits in the packed batch.
  auto a = tiny_phi4mm(0.0), b = tiny_phi4mm(0.0);
  SftOptions o = all_groups();
  std::vector<SftRow> rows = golden_rows();
  SftTrainer ta(a, rows, o);
  o.mini_bs = 1;
  SftTrainer tb(b, rows, o);
  const double la = ta.accumulate(pointers(rows), 0, 3), lb = tb.accumulate(pointers(rows), 0, 3);
  CHECK(la == doctest::Approx(lb).epsilon(1e-6));
  const auto ga = grads_of(*a), gb = grads_of(*b);
  REQUIRE(ga.size() == gb.size());
  int64_t towers = 0;
  const double total = total_norm(gb);
  for (auto& [name, g] : ga) {
    CAPTURE(name);
    REQUIRE(gb.count(name));
    // f32 reassociation: the decoder's gradient differs in the last bits
    // between packings, and the audio encoder's small q/k gradients amplify
    // that to about 2e-5 (the same comparison in f64 weights gives 5e-8).
    CHECK(grad_rel(g, gb.at(name), total) < 1e-4);
    towers += group_of(name) == Group::tower;
  }
  CHECK(towers > 0);  // the towers got gradients
}

// The RL trainers (GRPO/GSPO, DPO, PPO) build their optimizer through
// make_training_optimizer as SftTrainer does; the towers' activation
// checkpointing is set there, so it follows their groups too.
TEST_CASE("train/make_training_optimizer: tower checkpointing follows --activation-checkpointing and the tower group") {
  auto m = tiny_phi4mm(0.0);
  REQUIRE(m->image_embed());
  REQUIRE(m->audio_embed());
  for (bool ckpt : {true, false})
    for (bool tower : {true, false}) {
      CAPTURE(ckpt);
      CAPTURE(tower);
      SftOptions o = all_groups();
      o.activation_checkpointing = ckpt;
      o.groups.tower = tower;
      (void)make_training_optimizer(*m, o, 10);
      CHECK(m->image_embed()->recompute_layers == (ckpt && tower));
      CHECK(m->audio_embed()->recompute_layers == (ckpt && tower));
    }
}

TEST_CASE("train/equivalence: activation checkpointing on and off give identical gradients (dropout on)") {
  auto a = tiny_phi4mm(0.2), b = tiny_phi4mm(0.2);  // a large dropout so that a wrong mask shows
  SftOptions o = all_groups();
  o.mini_bs = 2;
  std::vector<SftRow> rows = golden_rows();
  SftTrainer ta(a, rows, o);
  o.activation_checkpointing = false;
  SftTrainer tb(b, rows, o);
  // The towers train here, so checkpointing reaches into their layers too.
  REQUIRE(a->image_embed());
  REQUIRE(a->audio_embed());
  CHECK(a->image_embed()->recompute_layers);
  CHECK(a->audio_embed()->recompute_layers);
  CHECK_FALSE(b->image_embed()->recompute_layers);
  CHECK_FALSE(b->audio_embed()->recompute_layers);
  CHECK(ta.accumulate(pointers(rows), 0, 9) == tb.accumulate(pointers(rows), 0, 9));
  const auto ga = grads_of(*a), gb = grads_of(*b);
  REQUIRE(ga.size() == gb.size());
  for (auto& [name, g] : ga) {
    CAPTURE(name);
    CHECK(max_abs_diff(g, gb.at(name)) == 0.0);
  }
}

TEST_CASE("train/checkpoint: a resumed run reproduces the uninterrupted losses exactly; the step serves as saved") {
  std::vector<SftRow> rows = golden_rows();
  std::vector<SftRow> more = golden_rows();
  rows.insert(rows.end(), more.begin(), more.end());  // 8 rows, batch 3: a short last step per epoch
  SftOptions o;
  o.batch_size = 3, o.mini_bs = 2, o.lr = 2e-3, o.warmup_steps = 1, o.max_steps = 5;
  o.groups.projector = true;
  std::vector<double> full;
  {
    SftTrainer t(tiny_phi4mm(), rows, o);
    while (!t.done()) full.push_back(t.step().loss);
  }
  TempDir dir;
  std::vector<double> resumed;
  std::filesystem::path step2;
  {
    auto model = tiny_phi4mm();
    SftTrainer t(model, rows, o);
    resumed.push_back(t.step().loss);
    resumed.push_back(t.step().loss);
    step2 = t.save_checkpoint(dir.path / "save", "");
    CHECK(step2 == dir.path / "save" / "step-2");
    CHECK(read_file((dir.path / "save" / "latest").string()) == "step-2\n");
    // The saved weights are the in-memory ones: the same logits, bit for bit.
    model->eval();
    auto loaded = phi4mm::load_model(step2.string());
    const SftRow& r = rows[3];
    phi4mm::PackedBatch b = phi4mm::PackedBatch::single(r.ids, r.adapter);
    NoGradGuard ng;
    b.media_rows = phi4mm::media_rows(*model, r.media);
    Tensor want = model->logits(b);
    b.media_rows = phi4mm::media_rows(*loaded, r.media);
    CHECK(max_abs_diff(loaded->logits(b), want) == 0.0);
    // And through the serving forward (paged KV cache, chunked prefill, the
    // inference kernels): the last row's logits, bit for bit.
    auto served = [&](const phi4mm::Phi4MMForCausalLM& m) {
      phi4mm::PagedKvCache cache(m, 64);
      phi4mm::KvSequence seq;
      phi4mm::IncrementalBatch ib;
      ib.add(seq, r.ids, r.adapter);
      ib.media_rows = phi4mm::media_rows(m, r.media);
      return phi4mm::forward_incremental(m, cache, ib);
    };
    CHECK(max_abs_diff(served(*loaded), served(*model)) == 0.0);
  }
  CHECK(resolve_resume_dir(dir.path / "save") == step2);
  {
    auto model = phi4mm::load_model(step2.string());
    SftTrainer t(model, rows, o);
    t.load_state(resolve_resume_dir(dir.path / "save"));
    CHECK(t.state().step == 2);
    while (!t.done()) resumed.push_back(t.step().loss);
  }
  REQUIRE(resumed.size() == full.size());
  for (size_t i = 0; i < full.size(); ++i) {
    CAPTURE(i);
    CHECK(resumed[i] == full[i]);
  }
  SUBCASE("another dataset is refused") {
    rows.pop_back();
    SftTrainer t(phi4mm::load_model(step2.string()), rows, o);
    CHECK_THROWS_WITH_AS(t.load_state(step2), doctest::Contains("another dataset"), std::runtime_error);
  }
}

TEST_CASE("train/freeze: a dropout the forward does not implement is refused for a group that trains") {
  phi4mm::Config c = phi4mm::preset_config("tiny");
  c.raw["resid_pdrop"] = 0.1;
  c.raw["audio_processor"]["config"]["dropout_rate"] = 0.05;
  auto model = phi4mm::init_phi4mm(c, 5, DType::f32);
  CHECK_THROWS_WITH_AS(SftTrainer(model, golden_rows(), SftOptions{}),
                       doctest::Contains("config.json: resid_pdrop = 0.1"), std::invalid_argument);
  SftOptions lora;
  lora.groups.lm = LmTrainable::lora;
  CHECK_THROWS_AS(SftTrainer(model, golden_rows(), lora), std::invalid_argument);
  SftOptions towers;
  towers.groups.lm = LmTrainable::none;
  towers.groups.tower = true;
  CHECK_THROWS_WITH_AS(SftTrainer(model, golden_rows(), towers),
                       doctest::Contains("audio_processor.config.dropout_rate = 0.05"), std::invalid_argument);
  SftOptions projector;  // the decoder and towers frozen: their dropouts never run
  projector.groups.lm = LmTrainable::none;
  projector.groups.projector = true;
  CHECK_NOTHROW(SftTrainer(model, golden_rows(), projector));
}
