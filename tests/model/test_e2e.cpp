// End-to-end multimodal logits (issues 5 and 6): the tiny preset with every
// component (init_phi4mm("tiny", 5, f32), deterministic), synthetic images and
// clips, the processors, the towers, the merge (spec text.md 5.4) and the text
// model with the adapter of the spec's mode table (3.3), against transformers'
// Phi4MultimodalForCausalLM + peft on the same weights
// (tests/reference/model/make_e2e_golden.py -> tests/data/model/e2e_golden.safetensors).
//
//   a  two images, 3 and 2 crops           vision LoRA
//   b  one 16 kHz clip, speech only        speech LoRA, speech projector
//   c  one 8 kHz clip, then one image      vision LoRA, vision projector for the audio
//
// The golden holds, at a few rows per prompt, the merged input rows, the first
// 1024 logit columns, and the argmax / max / logsumexp over the whole vocabulary.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "model_fixtures.h"
#include "tests/media_fixtures.h"
#include "models/phi4mm/model.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"

using namespace areno;
using namespace areno::phi4mm;
using areno::testing::rel_err;
using areno::testing::clip_b;
using areno::testing::clip_c;
using areno::testing::formula_image;

namespace {

constexpr int64_t kImg = 200010, kAud = 200011;
constexpr int64_t kUser = 200021, kEnd = 200020, kAssistant = 200019;

const SafetensorsFile& e2e_golden() {
  static SafetensorsFile f("tests/data/model/e2e_golden.safetensors");
  return f;
}
Tensor eg(const std::string& name) { return e2e_golden().load_copy(name); }

const Phi4MMForCausalLM& tiny_model() {
  static std::shared_ptr<Phi4MMForCausalLM> m = init_phi4mm("tiny", 5, DType::f32);
  return *m;
}

struct Prompt {
  std::vector<int64_t> ids;
  std::vector<Media> media;
  Adapter adapter = Adapter::none;
};

void append(std::vector<int64_t>& ids, std::initializer_list<int64_t> v) {
  for (int64_t id : v) ids.push_back(id);
}
void append(std::vector<int64_t>& ids, int64_t id, int64_t n) {
  for (int64_t i = 0; i < n; ++i) ids.push_back(id);
}

void add_image(Prompt& p, int64_t w, int64_t h) {
  p.media.push_back(Media::of_image(formula_image(w, h)));
  append(p.ids, kImg, num_image_tokens(p.media.back().image.width, p.media.back().image.height));
}

void add_clip(Prompt& p, std::vector<double> samples, int64_t rate) {
  append(p.ids, kAud, audio_token_count(int64_t(samples.size()), rate));
  p.media.push_back(Media::of_audio(std::move(samples), rate));
}

// The prompts of make_e2e_golden.py, with the same hand-written text ids.
Prompt prompt(const std::string& key) {
  Prompt p;
  if (key == "a") {
    p.adapter = Adapter::vision;
    append(p.ids, {kUser, 9125, 220});
    add_image(p, 896, 448);  // 2x1 grid: 3 crops, 801 tokens
    append(p.ids, {198, 3436, 220});
    add_image(p, 448, 448);  // 1x1 grid: 2 crops, 545 tokens
    append(p.ids, {23719, 13, kEnd, kAssistant});
  } else if (key == "b") {
    p.adapter = Adapter::speech;
    append(p.ids, {kUser});
    add_clip(p, clip_b(), 16000);
    append(p.ids, {4827, 495, 13, kEnd, kAssistant});
  } else {
    p.adapter = Adapter::vision;  // image + audio: vision LoRA (spec text.md 3.3)
    append(p.ids, {kUser, 12194, 220});
    add_clip(p, clip_c(), 8000);
    append(p.ids, {326, 220});
    add_image(p, 448, 896);  // 1x2 grid: 3 crops, 801 tokens
    append(p.ids, {13, kEnd, kAssistant});
  }
  return p;
}

struct Outcome {
  double rows = 0, h0 = 0, logits = 0, max = 0, lse = 0;
};

Outcome check_prompt(const std::string& key) {
  const Phi4MMForCausalLM& m = tiny_model();
  NoGradGuard ng;
  Prompt p = prompt(key);
  REQUIRE(p.ids == eg(key + ".ids").to_vector<int64_t>());

  // Tower rows, in prompt order: per-row sums against the reference's merged rows.
  Tensor rows = media_rows(m, p.media);
  std::vector<int64_t> mask;
  for (int64_t id : p.ids) mask.push_back(id == kImg || id == kAud);
  const int64_t n_media = std::count(mask.begin(), mask.end(), int64_t(1));
  REQUIRE(rows.dim() == 2);
  REQUIRE(rows.size(0) == n_media);
  REQUIRE(rows.size(1) == m.config().text.hidden_size);
  Outcome o;
  o.rows = std::max(rel_err(sum(rows, {1}), eg(key + ".media_row_sums")),
                    rel_err(sum(abs(rows), {1}), eg(key + ".media_row_abs")));

  // Merged input rows at the stored positions.
  const std::vector<int64_t> pos = eg(key + ".positions").to_vector<int64_t>();
  std::vector<int64_t> media_index(p.ids.size(), -1);
  for (int64_t t = 0, k = 0; t < int64_t(p.ids.size()); ++t)
    if (mask[size_t(t)]) media_index[size_t(t)] = k++;
  std::vector<Tensor> h0;
  for (int64_t t : pos) {
    const int64_t k = media_index[size_t(t)];
    h0.push_back(k >= 0 ? rows.select(0, k) : m.model->embed_tokens->weight.select(0, p.ids[size_t(t)]));
  }
  o.h0 = rel_err(stack(h0, 0), eg(key + ".h0"));

  // Logits of the stored rows.
  PackedBatch b = PackedBatch::single(p.ids, p.adapter);
  b.media_rows = rows;
  Tensor logits = m.logits_at(b, pos);  // [P, V]
  const Tensor gold_logits = eg(key + ".logits");
  o.logits = rel_err(logits.narrow(1, 0, gold_logits.size(1)).contiguous(), gold_logits);

  const int64_t vocab = logits.size(1);
  const std::vector<float> lv = logits.to_vector<float>();
  const std::vector<int64_t> want_argmax = eg(key + ".argmax").to_vector<int64_t>();
  std::vector<double> mx(pos.size()), lse(pos.size());
  for (size_t r = 0; r < pos.size(); ++r) {
    const float* row = lv.data() + r * size_t(vocab);
    const int64_t am = std::max_element(row, row + vocab) - row;
    CAPTURE(key);
    CAPTURE(pos[r]);
    CHECK(am == want_argmax[r]);
    mx[r] = row[am];
    double s = 0;
    for (int64_t v = 0; v < vocab; ++v) s += std::exp(double(row[v]) - mx[r]);
    lse[r] = mx[r] + std::log(s);
  }
  const auto n = int64_t(pos.size());
  o.max = rel_err(from_vector(mx, {n}), eg(key + ".max"));
  o.lse = rel_err(from_vector(lse, {n}), eg(key + ".lse"));
  MESSAGE("e2e ", key, ": ", p.ids.size(), " tokens, ", n_media, " media rows; max rel err: row sums ", o.rows,
          ", h0 ", o.h0, ", logits ", o.logits, ", max ", o.max, ", logsumexp ", o.lse);
  return o;
}

void check_within(const Outcome& o, double tol) {
  CHECK(o.rows < tol);
  CHECK(o.h0 < tol);
  CHECK(o.logits < tol);
  CHECK(o.max < tol);
  CHECK(o.lse < tol);
}

}  // namespace

TEST_CASE("e2e: two images of different crop counts match the reference logits (vision LoRA)") {
  check_within(check_prompt("a"), 1e-4);
}

TEST_CASE("e2e: speech-only logits match the reference (speech LoRA, speech projector)") {
  check_within(check_prompt("b"), 1e-4);
  // The tolerance separates the adapters: the vision LoRA on the same rows is far off.
  const Phi4MMForCausalLM& m = tiny_model();
  NoGradGuard ng;
  Prompt p = prompt("b");
  PackedBatch b = PackedBatch::single(p.ids, Adapter::vision);
  b.media_rows = media_rows(m, p.media);
  const std::vector<int64_t> pos = eg("b.positions").to_vector<int64_t>();
  const Tensor gold_logits = eg("b.logits");
  Tensor wrong = m.logits_at(b, pos).narrow(1, 0, gold_logits.size(1)).contiguous();
  CHECK(rel_err(wrong, gold_logits) > 1e-2);
}

TEST_CASE("e2e: audio + image logits match the reference (vision LoRA, vision projector)") {
  check_within(check_prompt("c"), 1e-4);
}
