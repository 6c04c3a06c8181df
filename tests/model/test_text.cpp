// Decoder parity with transformers' phi4_multimodal + peft on the tiny golden
// checkpoint (tests/reference/model/make_golden.py): logits per adapter,
// LongRoPE short/long regimes, greedy continuation, packed batches, media
// rows, log-probabilities and gradients.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/text.h"
#include "tensor/autograd.h"
#include "tests/model/model_fixtures.h"
#include "tests/test_util.h"

using namespace areno;
using namespace areno::phi4mm;
using areno::testing::gold;
using areno::testing::gold_ids;
using areno::testing::rel_err;

namespace {

std::shared_ptr<Phi4MMForCausalLM> tiny(DType dtype = DType::f32) {
  LoadOptions o;
  o.dtype = dtype;
  return load_model(testing::kTinyDir, o);
}

const Phi4MMForCausalLM& tiny_f32() {
  static auto m = tiny();
  return *m;
}

Tensor run(const Phi4MMForCausalLM& m, const std::vector<int64_t>& ids, Adapter a,
           RopeTable r = RopeTable::automatic) {
  NoGradGuard ng;
  return m.logits(PackedBatch::single(ids, a, r)).to(Device::cpu(), DType::f32);
}

std::vector<int64_t> slice(const std::vector<int64_t>& v, size_t n) { return {v.begin(), v.begin() + n}; }

}  // namespace

TEST_CASE("phi4mm/tiny checkpoint loads every tensor") {
  LoadReport rep;
  auto m = load_model(testing::kTinyDir, {}, &rep);
  // 2 layers x (2 norms + 4 modules x (base + 2 adapters x (A, B))) + embed + final norm
  CHECK(rep.expected == 2 * (2 + 4 * 5) + 2);
  CHECK(rep.summary() == "46 of 46 tensors consumed, 0 missing, 0 unexpected (0 skipped)");
  CHECK(m->dtype() == DType::f32);
  CHECK(m->get("model.layers.1.mlp.down_proj.lora_B.speech.weight").shape() == Shape{32, 4});
}

DEVICE_TEST_CASE("phi4mm/logits match transformers for text, vision and speech (f32)") {
  LoadOptions o;
  o.device = device;
  auto mp = load_model(testing::kTinyDir, o);
  const auto& m = *mp;
  CHECK(m.device() == device);
  auto ids = gold_ids("ids_a");
  CHECK(rel_err(run(m, ids, Adapter::none), gold("logits_a_none")) < 1e-4);
  CHECK(rel_err(run(m, ids, Adapter::vision), gold("logits_a_vision")) < 1e-4);
  CHECK(rel_err(run(m, ids, Adapter::speech), gold("logits_a_speech")) < 1e-4);
  // The adapters really change the output (a model without LoRA would pass none only).
  CHECK(rel_err(gold("logits_a_vision"), gold("logits_a_none")) > 1e-2);
  CHECK(rel_err(gold("logits_a_speech"), gold("logits_a_vision")) > 1e-2);
}

TEST_CASE("phi4mm/longrope uses the short table up to original_max_position_embeddings, long after") {
  const auto& m = tiny_f32();
  auto ids = gold_ids("ids_b");  // 24 tokens, original_max_position_embeddings = 16
  CHECK_FALSE(m.uses_long_table(15, RopeTable::automatic));
  CHECK(m.uses_long_table(16, RopeTable::automatic));
  Tensor short16 = run(m, slice(ids, 16), Adapter::none);
  CHECK(rel_err(short16, gold("logits_b16_none")) < 1e-4);
  Tensor long24 = run(m, ids, Adapter::none);
  CHECK(rel_err(long24, gold("logits_b_none")) < 1e-4);
  CHECK(rel_err(run(m, ids, Adapter::speech), gold("logits_b_speech")) < 1e-4);
  // Switching re-computes the whole sequence: the first 16 rows change too.
  CHECK(rel_err(long24.narrow(0, 0, 16), short16) > 1e-3);
  // The explicit choice: long for 16 tokens equals the first rows of the long run,
  // short for 24 tokens does not match the reference's long run.
  CHECK(rel_err(run(m, slice(ids, 16), Adapter::none, RopeTable::long_table), long24.narrow(0, 0, 16)) < 1e-5);
  CHECK(rel_err(run(m, ids, Adapter::none, RopeTable::short_table), gold("logits_b_none")) > 1e-3);
}

TEST_CASE("phi4mm/greedy continuation of 32 tokens equals transformers (crosses the LongRoPE switch)") {
  // Prompt of 4 tokens + 32 new ones: the sequence passes 16 tokens
  // (original_max_position_embeddings) at step 13, after which every step
  // recomputes the whole sequence with the long table (HF re-prefill).
  const auto& m = tiny_f32();
  for (const auto& run_case : {std::pair{Adapter::none, "greedy_none"}, std::pair{Adapter::vision, "greedy_vision"}}) {
    const Adapter adapter = run_case.first;  // not a structured binding: clang 14 cannot use one in CHECK_MESSAGE
    const char* key = run_case.second;
    std::vector<int64_t> ids = gold_ids("greedy_prompt"), out;
    Tensor ref_last = gold(std::string(key) + "_last_logits");  // [32, V]
    double worst = 0;
    for (int step = 0; step < 32; ++step) {
      Tensor last = run(m, ids, adapter).select(0, int64_t(ids.size()) - 1);
      worst = std::max(worst, rel_err(last, ref_last.select(0, step)));
      int64_t next = int64_t(argmax(last, 0).item());
      out.push_back(next);
      ids.push_back(next);
    }
    CHECK_MESSAGE(out == gold_ids(key), "adapter " << std::string(adapter_name(adapter)));
    CHECK_MESSAGE(worst < 1e-4, "adapter " << std::string(adapter_name(adapter)) << " worst step rel err " << worst);
  }
}

DEVICE_TEST_CASE("phi4mm/a mixed packed batch gives each sequence its solo logits") {
  LoadOptions o;
  o.device = device;
  auto mp = load_model(testing::kTinyDir, o);
  const auto& m = *mp;
  auto a = gold_ids("ids_a"), b = gold_ids("ids_b");
  PackedBatch pb = PackedBatch::pack({a, b, a, slice(b, 16), a},
                                     {Adapter::vision, Adapter::none, Adapter::speech, Adapter::none, Adapter::none});
  NoGradGuard ng;
  Tensor out = m.logits(pb).to(Device::cpu());
  auto rows = [&](int s) { return out.narrow(0, pb.cu_seqlens[s], pb.cu_seqlens[s + 1] - pb.cu_seqlens[s]); };
  CHECK(rel_err(rows(0), gold("logits_a_vision")) < 1e-4);
  CHECK(rel_err(rows(1), gold("logits_b_none")) < 1e-4);   // long table (24 tokens)
  CHECK(rel_err(rows(2), gold("logits_a_speech")) < 1e-4);
  CHECK(rel_err(rows(3), gold("logits_b16_none")) < 1e-4);  // short table (16 tokens)
  CHECK(rel_err(rows(4), gold("logits_a_none")) < 1e-4);
  // And against this model's own solo runs, tighter.
  CHECK(rel_err(rows(0), run(m, a, Adapter::vision)) < 1e-5);
  CHECK(rel_err(rows(2), run(m, a, Adapter::speech)) < 1e-5);
}

TEST_CASE("phi4mm/media rows replace the embeddings at masked positions") {
  const auto& m = tiny_f32();
  auto ids = gold_ids("ids_a");
  // Put the embeddings of the real tokens at positions 2..4 while the ids there
  // are media placeholders (image and audio; the model finds them by id, and
  // the tiny vocabulary need not hold them): the result must equal the plain run.
  std::vector<int64_t> with_placeholder = ids, other_token = ids;
  std::vector<int64_t> media_ids;
  for (size_t i = 2; i < 5; ++i) {
    with_placeholder[i] = i == 3 ? kAudioTokenId : kImageTokenId;
    other_token[i] = 5;
    media_ids.push_back(ids[i]);
  }
  NoGradGuard ng;
  PackedBatch pb = PackedBatch::single(with_placeholder, Adapter::vision);
  pb.media_rows = embedding(m.model->embed_tokens->weight, from_vector(media_ids, {3}));
  CHECK(rel_err(m.logits(pb), gold("logits_a_vision")) < 1e-4);
  // Other tokens at those rows change the logits.
  CHECK(rel_err(run(m, other_token, Adapter::vision), gold("logits_a_vision")) > 1e-3);
  // The placeholders and the media rows must agree in number.
  pb.media_rows = pb.media_rows.narrow(0, 0, 2);
  CHECK_THROWS_WITH_AS(m.logits(pb), doctest::Contains("3 media placeholders but media_rows has 2 rows"),
                       std::invalid_argument);
}

TEST_CASE("phi4mm/token log-probabilities and logits of selected rows") {
  const auto& m = tiny_f32();
  auto ids = gold_ids("ids_a");
  PackedBatch pb = PackedBatch::single(ids, Adapter::speech);
  std::vector<int64_t> targets(ids.begin() + 1, ids.end());
  targets.push_back(-100);
  NoGradGuard ng;
  Tensor lp = m.token_logprobs(pb, from_vector(targets, {int64_t(targets.size())}));
  Tensor ref = log_softmax(gold("logits_a_speech"), -1);
  auto lpv = lp.to_vector<float>();
  for (size_t t = 0; t + 1 < ids.size(); ++t)
    CHECK(lpv[t] == doctest::Approx(ref.select(0, int64_t(t)).select(0, targets[t]).item()).epsilon(1e-4));
  CHECK(lpv.back() == 0.0f);
  Tensor sel = m.logits_at(pb, {0, 11});
  CHECK(rel_err(sel.select(0, 1), gold("logits_a_speech").select(0, 11)) < 1e-4);
}

TEST_CASE("phi4mm/gradients of a next-token loss match torch autograd (f32)") {
  auto m = tiny();
  for (auto& [name, p] : m->named_parameters()) p.set_requires_grad(false);
  const char* names[] = {"model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.base_layer.weight",
                         "model.layers.1.mlp.down_proj.lora_A.vision.weight",
                         "model.layers.0.self_attn.qkv_proj.lora_B.vision.weight"};
  const char* golds[] = {"grad_embed_tokens", "grad_qkv_base_0", "grad_lora_A_vision_down_1", "grad_lora_B_vision_qkv_0"};
  for (auto n : names) m->get(n).set_requires_grad(true);
  auto ids = gold_ids("ids_a");
  Tensor logits = m->logits(PackedBatch::single(ids, Adapter::vision));
  const int64_t T = int64_t(ids.size());
  Tensor target = from_vector(std::vector<int64_t>(ids.begin() + 1, ids.end()), {T - 1});
  Tensor loss = cross_entropy(logits.narrow(0, 0, T - 1), target);
  CHECK(loss.item() == doctest::Approx(gold("grad_loss").item()).epsilon(1e-5));
  loss.backward();
  for (int i = 0; i < 4; ++i) {
    Tensor g = m->get(names[i]).grad();
    REQUIRE_MESSAGE(g.defined(), names[i]);
    CHECK_MESSAGE(rel_err(g, gold(golds[i])) < 1e-4, names[i] << " rel err " << rel_err(g, gold(golds[i])));
  }
}

TEST_CASE("phi4mm/bf16 logits match the bf16 reference within bf16 rounding") {
  auto m = tiny(DType::bf16);
  CHECK(m->dtype() == DType::bf16);
  auto ids = gold_ids("ids_a");
  Tensor none = run(*m, ids, Adapter::none), vision = run(*m, ids, Adapter::vision);
  // bf16 has 8 significant bits: a few ulps of the largest logit after two layers.
  CHECK(rel_err(none, gold("logits_a_none_bf16")) < 2e-2);
  CHECK(rel_err(vision, gold("logits_a_vision_bf16")) < 2e-2);
  // The remaining difference (up to ~7.5e-3, one ulp of the largest logit) is
  // below the reference's own bf16 error: its bf16 run differs from its f32 run
  // by 9.2e-3. Ours is no further from the f32 truth than the reference is.
  const double ref_noise = rel_err(gold("logits_a_none_bf16"), gold("logits_a_none"));
  CHECK(ref_noise > 5e-3);
  CHECK(rel_err(none, gold("logits_a_none")) <= 1.5 * ref_noise);
  CHECK(rel_err(none, gold("logits_a_none_bf16")) <= ref_noise);
  // and it is a bf16 computation, not the f32 one.
  CHECK(rel_err(none, gold("logits_a_none")) > 1e-5);
}

TEST_CASE("phi4mm/packed batch errors are clear") {
  const auto& m = tiny_f32();
  PackedBatch pb = PackedBatch::single({1, 2, 3});
  pb.cu_seqlens = {0, 2};
  CHECK_THROWS_WITH_AS(m.logits(pb), doctest::Contains("cu_seqlens"), std::invalid_argument);
  pb = PackedBatch::pack({{1, 2}, {3}}, {Adapter::none});
  CHECK_THROWS_WITH_AS(m.logits(pb), doctest::Contains("adapters"), std::invalid_argument);
  auto base = load_model(testing::kTinyDir, [] { LoadOptions o; o.with_lora = false; return o; }());
  CHECK_THROWS_WITH_AS(base->logits(PackedBatch::single({1, 2}, Adapter::speech)),
                       doctest::Contains("without the speech adapter"), std::invalid_argument);
}

TEST_CASE("phi4mm/causal attention with key history equals the tail of the full attention") {
  // The contract the KV-cache path builds on: queries of the last Lq positions
  // against all Lk keys give the last Lq rows of the full causal attention.
  Generator gen(5);
  Tensor q = rand_normal({9, 4, 8}, gen), k = rand_normal({9, 2, 8}, gen), v = rand_normal({9, 2, 8}, gen);
  Tensor full_out = causal_attention(q, k, v);  // [9, 32]
  CHECK(full_out.shape() == Shape{9, 32});
  Tensor tail = causal_attention(q.narrow(0, 6, 3), k, v);
  CHECK(max_abs_diff(tail, full_out.narrow(0, 6, 3)) < 1e-6);
  // Row 0 sees only key 0: its output is v[0] of its kv head (heads 0,1 -> kv 0).
  auto row0 = full_out.select(0, 0).to_vector<float>();
  auto v0 = v.select(0, 0).to_vector<float>();
  for (int h = 0; h < 4; ++h)
    for (int d = 0; d < 8; ++d) CHECK(row0[size_t(h * 8 + d)] == doctest::Approx(v0[size_t((h / 2) * 8 + d)]));
}

TEST_CASE("phi4mm/rotary: position 0 scales the rotated dims by mscale, pass-through dims unchanged") {
  const auto& m = tiny_f32();
  PackedBatch pb = PackedBatch::single({1, 2, 3});
  auto [cos, sin] = m.rope_tables(pb);
  CHECK(cos.shape() == Shape{3, 1, 6});
  const float ms = float(std::sqrt(1.5));
  CHECK(cos.select(0, 0).select(0, 0).select(0, 3).item() == doctest::Approx(ms));
  CHECK(sin.select(0, 0).select(0, 0).select(0, 3).item() == 0.0);
  // position 1, frequency 1 (short factor 1.25): theta = 1 / (1.25 * 10000^(2/6))
  const float th = 1.0f / (1.25f * std::pow(10000.0f, 2.0f / 6.0f));
  CHECK(cos.select(0, 1).select(0, 0).select(0, 1).item() == doctest::Approx(std::cos(th) * ms).epsilon(1e-6));
  CHECK(sin.select(0, 1).select(0, 0).select(0, 4).item() == doctest::Approx(std::sin(th) * ms).epsilon(1e-6));
  Generator gen(1);
  Tensor x = rand_normal({3, 2, 8}, gen);
  Tensor y = apply_rotary(x, cos, sin);
  CHECK(max_abs_diff(y.narrow(-1, 6, 2), x.narrow(-1, 6, 2)) == 0.0);
  CHECK(max_abs_diff(y.select(0, 0).narrow(-1, 0, 6), mul(x.select(0, 0).narrow(-1, 0, 6), double(ms))) < 1e-6);
}

TEST_CASE("phi4mm/packed gradients are the sum of the per-sequence gradients") {
  // Exercises the backward of the per-row LoRA (index_select / index_add) and
  // of the per-sequence attention: a vision sequence and a speech sequence
  // packed together give each adapter exactly its own sequence's gradient.
  auto m = tiny();
  for (auto& [name, p] : m->named_parameters()) p.set_requires_grad(false);
  const std::string va = "model.layers.0.mlp.gate_up_proj.lora_A.vision.weight";
  const std::string sb = "model.layers.1.self_attn.o_proj.lora_B.speech.weight";
  const std::string base = "model.layers.1.self_attn.qkv_proj.base_layer.weight";
  for (auto& n : {va, sb, base}) m->get(n).set_requires_grad(true);
  auto a = gold_ids("ids_a"), b = gold_ids("ids_b");
  auto loss_of = [&](const PackedBatch& pb, std::vector<int64_t> targets) {
    Tensor lp = m->token_logprobs(pb, from_vector(targets, {int64_t(targets.size())}));
    return neg(sum(lp));
  };
  auto next = [](const std::vector<int64_t>& s) {
    std::vector<int64_t> t(s.begin() + 1, s.end());
    t.push_back(-100);
    return t;
  };
  std::map<std::string, Tensor> solo;
  Tensor l1 = loss_of(PackedBatch::single(a, Adapter::vision), next(a));
  l1.backward();
  for (auto& n : {va, sb, base}) solo[n] = m->get(n).grad().defined() ? m->get(n).grad().clone() : Tensor();
  CHECK_FALSE(solo[sb].defined());  // the speech adapter is untouched by a vision sequence
  m->zero_grad();
  Tensor l2 = loss_of(PackedBatch::single(b, Adapter::speech), next(b));
  l2.backward();
  Tensor speech_b = m->get(sb).grad().clone(), base_b = m->get(base).grad().clone();
  CHECK_FALSE(m->get(va).grad().defined());
  m->zero_grad();
  std::vector<int64_t> targets = next(a), tb = next(b);
  targets.insert(targets.end(), tb.begin(), tb.end());
  Tensor lp = loss_of(PackedBatch::pack({a, b}, {Adapter::vision, Adapter::speech}), targets);
  CHECK(lp.item() == doctest::Approx(l1.item() + l2.item()).epsilon(1e-5));
  lp.backward();
  CHECK(rel_err(m->get(va).grad(), solo[va]) < 1e-5);
  CHECK(rel_err(m->get(sb).grad(), speech_b) < 1e-5);
  CHECK(rel_err(m->get(base).grad(), add(solo[base], base_b)) < 1e-5);
}

// An adapter on every row adds its B product inside y's GEMM
// (linear_accumulate), in training as in inference: the same bits with and
// without autograd (a rollout's forward is the training forward's), within one
// rounding of the f64 value, and the gradients of x, A and B those of the
// composed ops (PEFT's order: linear, linear, scale, add) to their rounding.
TEST_CASE("phi4mm/LoRA: an adapter on every row joins the base GEMM, training and inference alike") {
  for (DType dt : {DType::f32, DType::bf16}) {
    for (double alpha : {16.0, 12.0}) {  // scaling 2 (the checkpoint's, power of two: on x·Aᵀ) and 1.5 (the GEMM's alpha)
      CAPTURE(dtype_name(dt));
      CAPTURE(alpha);
      const double s = alpha / 8.0;
      const LoraConfig cfg{8, alpha, 0.0, "", {}};
      LoraLinear lin(24, 40, cfg, std::nullopt, TensorOptions(dt));
      Generator g(11);
      Tensor A, B;
      for (auto& [name, t] : lin.named_parameters()) {
        NoGradGuard ng;
        t.copy_(rand_normal(t.shape(), g, 0.0, 0.5).to(dt));
        if (name == "lora_A.vision.weight") A = t;
        if (name == "lora_B.vision.weight") B = t;
      }
      REQUIRE(A.defined());
      REQUIRE(B.defined());
      const Tensor x0 = rand_normal({5, 24}, g).to(dt), w = rand_normal({5, 40}, g).to(dt);
      AdapterRows rows;
      rows.all[int(Adapter::vision)] = true;
      const Tensor xa = x0.detach().set_requires_grad(true), xb = x0.detach().set_requires_grad(true);
      const Tensor y = lin.forward(xa, rows);
      const Tensor Ab = A.detach().set_requires_grad(true), Bb = B.detach().set_requires_grad(true);
      const Tensor want = add(linear(xb, lin.base_layer->weight, Tensor()), mul(linear(linear(xb, Ab), Bb), s));
      sum(mul(y, w)).backward();
      sum(mul(want, w)).backward();
      const double tol = dt == DType::bf16 ? 0x1p-6 : 1e-6;
      CHECK(rel_err(y.detach(), want.detach()) <= tol);
      CHECK(rel_err(xa.grad(), xb.grad()) <= tol);
      CHECK(rel_err(A.grad(), Ab.grad()) <= tol);
      CHECK(rel_err(B.grad(), Bb.grad()) <= tol);
      NoGradGuard ng;
      const Tensor inference = lin.forward(x0, rows);
      CHECK(max_abs_diff(inference.to(DType::f64), y.detach().to(DType::f64)) == 0.0);
      // One rounding of the exact value (the r-wide x·Aᵀ is rounded too).
      const std::vector<double> fused = inference.to(DType::f64).to_vector<double>();
      const Tensor x64 = x0.to(DType::f64), W64 = lin.base_layer->weight.to(DType::f64);
      const Tensor xa64 = linear(x64, A.to(DType::f64), Tensor()), B64 = B.to(DType::f64);
      const std::vector<double> exact =
          add(linear(x64, W64, Tensor()), mul(linear(xa64, B64, Tensor()), s)).to_vector<double>();
      // The roundings' reach: each term's magnitude.
      const std::vector<double> mag =
          add(abs(linear(x64, W64, Tensor())), mul(linear(abs(xa64), abs(B64), Tensor()), s)).to_vector<double>();
      const double one = dt == DType::bf16 ? 0x1p-7 : 1e-6;
      double worst = 0;
      for (size_t i = 0; i < fused.size(); ++i)
        worst = std::max(worst, std::fabs(fused[i] - exact[i]) - (mag[i] + std::fabs(exact[i])) * one);
      CHECK(worst <= 1e-4);
    }
  }
}
