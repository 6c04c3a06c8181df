// Audio encoder and projectors (issue 6) against transformers' phi4_multimodal port
// on a tiny random checkpoint (tests/reference/audio/make_audio_encoder_golden.py):
// one short clip, one clip past 500 encoder frames, a padded batch with masks as
// the spec (not the port) defines them; bf16; gradients; config parsing; names.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "autograd/gradcheck.h"
#include "models/phi4mm/audio/audio_features.h"
#include "models/phi4mm/audio/encoder.h"
#include "models/phi4mm/checkpoint.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

using namespace areno;
using areno::testing::error_of;
using namespace areno::phi4mm;
using json = nlohmann::json;

namespace {

const std::string kTinyWeights = "tests/data/audio/encoder_tiny.safetensors";
const std::string kTinyConfig = "tests/data/audio/encoder_tiny_config.json";
const std::string kGolden = "tests/data/audio/encoder_golden.safetensors";

json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open " + path + " (run from the source root)");
  return json::parse(f);
}

const SafetensorsFile& golden() {
  static SafetensorsFile f(kGolden);
  return f;
}
Tensor gold(const std::string& name) { return golden().load_copy(name); }

// The golden script's input stream: xorshift32, value = ((x >> 8) % 129 - 64) / 16.
std::vector<float> xorshift_features(uint32_t seed, int64_t t, int64_t f = 80) {
  std::vector<float> out(size_t(t * f));
  uint32_t x = seed;
  for (auto& v : out) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    v = float(int64_t((x >> 8) % 129) - 64) / 16.0f;
  }
  return out;
}

// A zero-padded [B, T_max, 80] batch of the golden case's clips.
Tensor case_features(const std::string& name, std::vector<int64_t>& lengths) {
  lengths = gold(name + ".lengths").to_vector<int64_t>();
  auto seeds = gold(name + ".seeds").to_vector<int64_t>();
  const int64_t b = int64_t(lengths.size()), tmax = *std::max_element(lengths.begin(), lengths.end());
  std::vector<float> all(size_t(b * tmax * 80), 0.0f);
  for (int64_t i = 0; i < b; ++i) {
    auto clip = xorshift_features(uint32_t(seeds[size_t(i)]), lengths[size_t(i)]);
    std::copy(clip.begin(), clip.end(), all.begin() + i * tmax * 80);
  }
  return from_vector(all, {b, tmax, 80});
}

std::shared_ptr<AudioEmbed> tiny_model(DType dtype = DType::f32) {
  AudioConfig cfg = audio_config_from(read_json(kTinyConfig));
  auto m = std::make_shared<AudioEmbed>(cfg, TensorOptions(DType::f32));
  SafetensorsCheckpoint ckpt(kTinyWeights);
  load_prefixed(*m, ckpt, kAudioEmbedPrefix, kTinyWeights);
  if (dtype != DType::f32) m->to(dtype);
  m->eval();
  return m;
}

// max |a - b| / max |b|.
double rel_err(const Tensor& a, const Tensor& b) {
  Tensor bf = b.to(Device::cpu(), DType::f64);
  return max_abs_diff(a.to(Device::cpu(), DType::f64), bf) / std::max(max(abs(bf)).item(), 1e-30);
}

double cosine(const Tensor& a, const Tensor& b) {
  Tensor x = a.to(DType::f64).flatten(), y = b.to(DType::f64).flatten();
  return sum(mul(x, y)).item() / std::sqrt(sum(mul(x, x)).item() * sum(mul(y, y)).item());
}

// Rows of each clip (first lengths[b]) concatenated, as the goldens store them.
Tensor valid_rows(const AudioEncoderOutput& e) {
  std::vector<Tensor> rows;
  for (size_t i = 0; i < e.lengths.size(); ++i) rows.push_back(e.hidden.select(0, int64_t(i)).narrow(0, 0, e.lengths[i]));
  return cat(rows, 0);
}

}  // namespace

TEST_CASE("phi4mm/audio config: released sizes by default, tiny sizes from config.json") {
  AudioConfig r = audio_config_from(json::object());
  CHECK(r.attention_dim == 1024);
  CHECK(r.attention_heads == 16);
  CHECK(r.linear_units == 1536);
  CHECK(r.num_blocks == 24);
  CHECK(r.time_reduction == 8);
  CHECK(r.conv_channels == 1024);
  CHECK(r.kernel_size == 3);
  CHECK(r.bias_table_rows() == 1000);
  CHECK(r.subsampled_width() == 10);
  CHECK(r.projection_dim == 3072);
  // The released config.json text (tiny text preset) gives the released audio sizes.
  AudioConfig t = audio_config_from(read_json("tests/data/model/tiny/config.json"));
  CHECK(t.attention_dim == 1024);
  CHECK(t.bias_max_distance == 500);
  AudioConfig tiny = audio_config_from(read_json(kTinyConfig));
  CHECK(tiny.attention_dim == 32);
  CHECK(tiny.attention_heads == 4);
  CHECK(tiny.linear_units == 24);
  CHECK(tiny.num_blocks == 2);
  CHECK(tiny.conv_channels == 8);
  CHECK(tiny.bias_max_distance == 64);
  CHECK(tiny.projection_dim == 24);
}

TEST_CASE("phi4mm/audio config: invalid values fail naming the key") {
  auto with = [](const std::string& key, json v) {
    json j = read_json(kTinyConfig);
    j["audio_processor"]["config"][key] = v;
    return error_of([&] { audio_config_from(j); });
  };
  CHECK(with("attention_dim", 30).find("attention_dim") != std::string::npos);
  CHECK(with("num_blocks", 0).find("num_blocks") != std::string::npos);
  CHECK(with("num_blocks", "two").find("num_blocks must be an integer") != std::string::npos);
  CHECK(with("time_reduction", 6).find("time_reduction") != std::string::npos);
  CHECK(with("chunk_size", 18).find("chunk_size") != std::string::npos);
  CHECK(with("activation", "relu").find("activation") != std::string::npos);
  CHECK(with("ext_pw_out_channel", 16).find("ext_pw_out_channel") != std::string::npos);
  json j = read_json(kTinyConfig);
  j["hidden_size"] = -1;
  CHECK(error_of([&] { audio_config_from(j); }).find("hidden_size") != std::string::npos);
}

TEST_CASE("phi4mm/audio module names equal the released checkpoint names (887 tensors, 466,416,416 values)") {
  // Released sizes, never initialised (bf16 keeps the untouched allocation small).
  AudioEmbed released(AudioConfig{}, TensorOptions(DType::bf16));
  auto params = released.named_parameters();
  CHECK(params.size() == 887);
  CHECK(released.num_parameters() == 466416416);
  auto shape_of = [&](const std::string& n) { return released.get(n).shape(); };
  CHECK(shape_of("encoder.encoder_embedding.global_mean") == Shape{80});
  CHECK(shape_of("encoder.embed.conv.0.weight") == Shape{1024, 1, 3, 3});
  CHECK(shape_of("encoder.embed.conv.6.weight") == Shape{1024, 1024, 1, 1});
  CHECK(shape_of("encoder.embed.out.weight") == Shape{1024, 10240});
  CHECK(shape_of("encoder.relative_attention_bias_layer.bias_values.weight") == Shape{1000, 16});
  CHECK(shape_of("encoder.encoders.23.feed_forward_in.net.0.linear.weight") == Shape{3072, 1024});
  CHECK(shape_of("encoder.encoders.0.feed_forward_out.net.2.weight") == Shape{1024, 1536});
  CHECK(shape_of("encoder.encoders.5.conv.glu.b1") == Shape{1, 1024, 1});
  CHECK(shape_of("encoder.encoders.5.conv.glu.ext_pw_conv_1d.weight") == Shape{2048, 1024, 1});
  CHECK(shape_of("encoder.encoders.5.conv.dw_sep_conv_1d.dw_conv.weight") == Shape{1024, 1, 3});
  CHECK(shape_of("audio_projection.speech.2.weight") == Shape{3072, 3072});
  CHECK(shape_of("audio_projection.vision.0.weight") == Shape{3072, 1024});
  // The tiny checkpoint holds exactly the module's names, under the prefix.
  auto m = tiny_model();
  SafetensorsFile f(kTinyWeights);
  std::vector<std::string> stored = f.names(), mine;
  for (auto& [n, t] : m->named_parameters()) mine.push_back(kAudioEmbedPrefix + n);
  std::sort(stored.begin(), stored.end());
  std::sort(mine.begin(), mine.end());
  CHECK(stored == mine);
}

TEST_CASE("phi4mm/audio encoder f32 matches the reference: short clip, both projectors") {
  auto m = tiny_model();
  std::vector<int64_t> lengths;
  Tensor x = case_features("short", lengths);
  NoGradGuard ng;
  AudioEncoderOutput e = m->encode(x, lengths);
  REQUIRE(e.lengths == std::vector<int64_t>{13});
  double enc = rel_err(valid_rows(e), gold("short.encoder"));
  double sp = rel_err(m->project(e, AudioProjection::speech), gold("short.speech"));
  double vi = rel_err(m->project(e, AudioProjection::vision), gold("short.vision"));
  MESSAGE("short: encoder " << enc << ", speech rows " << sp << ", vision rows " << vi);
  CHECK(enc < 1e-4);
  CHECK(sp < 1e-4);
  CHECK(vi < 1e-4);
  // The two projectors are different weights: rows differ.
  CHECK(rel_err(m->project(e, AudioProjection::speech), gold("short.vision")) > 1e-2);
}

TEST_CASE("phi4mm/audio encoder f32 matches the reference past 500 frames (unmasked window padding)") {
  auto m = tiny_model();
  std::vector<int64_t> lengths;
  Tensor x = case_features("long", lengths);
  NoGradGuard ng;
  Tensor rows = m->forward(x, lengths, AudioProjection::speech);
  AudioEncoderOutput e = m->encode(x, lengths);
  REQUIRE(e.lengths == std::vector<int64_t>{513});
  CHECK(e.hidden.shape() == Shape{1, 513, 32});
  double enc = rel_err(valid_rows(e), gold("long.encoder"));
  double sp = rel_err(rows, gold("long.speech"));
  MESSAGE("long (513 frames, 2 windows): encoder " << enc << ", speech rows " << sp);
  CHECK(enc < 1e-4);
  CHECK(sp < 1e-4);
  // Masking the 487 padding rows of the second window (the batched rule) changes
  // the second window only: the reference's single-clip path leaves them unmasked.
  AudioEncoderOutput em = m->encode(x, lengths, AudioMasking::masked);
  CHECK(rel_err(em.hidden.narrow(1, 0, 500), e.hidden.narrow(1, 0, 500)) < 1e-6);
  CHECK(rel_err(em.hidden.narrow(1, 500, 13), e.hidden.narrow(1, 500, 13)) > 1e-3);
}

TEST_CASE("phi4mm/audio encoder f32 matches the spec on a padded batch (masked keys, empty windows)") {
  auto m = tiny_model();
  std::vector<int64_t> lengths;
  Tensor x = case_features("batch", lengths);
  REQUIRE(lengths == std::vector<int64_t>{4020, 61, 130});
  NoGradGuard ng;
  AudioEncoderOutput e = m->encode(x, lengths);  // B > 1: masked, as the reference processor
  CHECK(e.lengths == std::vector<int64_t>{503, 8, 17});
  double enc = rel_err(valid_rows(e), gold("batch.encoder"));
  Tensor rows = m->project(e, AudioProjection::vision);
  CHECK(rows.shape() == Shape{528, 24});
  double vi = rel_err(rows, gold("batch.vision"));
  MESSAGE("batch (503/8/17 frames): encoder " << enc << ", vision rows " << vi);
  CHECK(enc < 1e-4);
  CHECK(vi < 1e-4);
  // The transformers port adds the boolean mask to the bias (+1/+0) instead of
  // masking: its rows for clip 2 differ from the spec's (we follow the spec).
  Tensor clip2 = e.hidden.select(0, 2).narrow(0, 0, 17);
  CHECK(rel_err(clip2, gold("batch.port_encoder_clip2")) > 1e-2);
  // The longest clip sees no padding in the subsampling convs: alone (masked
  // path, for its window padding) it gives the same rows as in the batch.
  AudioEncoderOutput alone = m->encode(x.narrow(0, 0, 1), std::vector<int64_t>{4020}, AudioMasking::masked);
  CHECK(rel_err(alone.hidden.select(0, 0), e.hidden.select(0, 0)) < 1e-5);
}

TEST_CASE("phi4mm/audio encoder bf16 stays within bf16 rounding of the f32 reference") {
  auto m = tiny_model(DType::bf16);
  NoGradGuard ng;
  for (std::string name : {"short", "batch"}) {
    std::vector<int64_t> lengths;
    Tensor x = case_features(name, lengths);
    AudioEncoderOutput e = m->encode(x, lengths);
    CHECK(e.hidden.dtype() == DType::bf16);
    Tensor rows = m->project(e, AudioProjection::vision);
    double enc = rel_err(valid_rows(e), gold(name + ".encoder"));
    double vi = rel_err(rows, gold(name + ".vision"));
    double cos = cosine(rows, gold(name + ".vision"));
    MESSAGE(name << " bf16: encoder " << enc << ", vision rows " << vi << ", cosine " << cos);
    CHECK(enc < 5e-2);
    CHECK(vi < 5e-2);
    CHECK(cos > 0.999);
  }
}

TEST_CASE("phi4mm/audio rows per clip equal the processor's token counts") {
  auto m = tiny_model();
  NoGradGuard ng;
  struct Case {
    int64_t samples, rate, tokens;
  };
  // Spec 3.11 / 4 worked examples and the other supported rates.
  for (Case c : {Case{16000, 16000, 13}, Case{160000, 16000, 125}, Case{480000, 16000, 375}, Case{8000, 8000, 13},
                 Case{11025, 11025, 0}, Case{22050, 22050, 0}, Case{44100, 44100, 17}, Case{48000, 48000, 13},
                 Case{400, 16000, 1}}) {
    AudioPlan plan = plan_audio(c.samples, c.rate);
    if (c.tokens) CHECK(plan.tokens == c.tokens);
    Tensor x = zeros({1, plan.frames, 80});
    Tensor rows = m->forward(x, {}, AudioProjection::speech);
    CHECK_MESSAGE(rows.size(0) == plan.tokens, c.samples << " samples @ " << c.rate << " Hz");
    CHECK(m->config().output_frames(plan.frames) == plan.tokens);
  }
  // 500 encoder frames are one window; 501 are two.
  CHECK(m->encode(zeros({1, 4000, 80})).hidden.size(1) == 500);
  CHECK(m->encode(zeros({1, 4001, 80})).hidden.size(1) == 501);
}

TEST_CASE("phi4mm/audio time_reduction 2, 4 and 8 give ceil(T / r) rows") {
  for (int64_t r : {2, 4, 8}) {
    AudioConfig c;
    c.input_size = 12;
    c.attention_dim = 8;
    c.attention_heads = 2;
    c.linear_units = 6;
    c.num_blocks = 1;
    c.conv_channels = 3;
    c.projection_dim = 5;
    c.time_reduction = r;
    AudioEmbed m(c);
    Generator gen(3);
    init_audio_weights(m, gen);
    NoGradGuard ng;
    AudioEncoderOutput e = m.encode(rand_normal({1, 37, 12}, gen));
    CHECK(e.hidden.shape() == Shape{1, (37 + r - 1) / r, 8});
    CHECK(m.embed_out->weight.size(1) == 3 * c.subsampled_width());
  }
}

TEST_CASE("phi4mm/audio encoder rejects malformed inputs with clear messages") {
  auto m = tiny_model();
  NoGradGuard ng;
  CHECK(error_of([&] { m->encode(zeros({1, 10, 64})); }).find("features must be [B, T, 80]") != std::string::npos);
  CHECK(error_of([&] { m->encode(zeros({2, 10, 80}), std::vector<int64_t>{10}); }).find("1 lengths for a batch of 2") !=
        std::string::npos);
  CHECK(error_of([&] { m->encode(zeros({1, 10, 80}), std::vector<int64_t>{11}); }).find("outside [1, 10]") !=
        std::string::npos);
}

TEST_CASE("phi4mm/audio encoder gradients match central differences (f64, tiny config)") {
  AudioConfig c;
  c.input_size = 12;
  c.attention_dim = 8;
  c.attention_heads = 2;
  c.linear_units = 6;
  c.num_blocks = 1;
  c.conv_channels = 3;
  c.bias_max_distance = 2;
  c.projection_dim = 5;
  AudioEmbed m(c, TensorOptions(DType::f64));
  Generator gen(5);
  init_audio_weights(m, gen);
  {
    NoGradGuard ng;  // non-trivial norms, GLU biases and CMVN so every path carries gradient
    for (auto& [n, p] : m.named_parameters())
      if (n.find("layer_norm") != std::string::npos || n.find(".b1") != std::string::npos ||
          n.find(".b2") != std::string::npos || n.find("global_") != std::string::npos)
        p.copy_(add(p, rand_uniform(p.shape(), gen, -0.3, 0.3, TensorOptions(DType::f64))));
  }
  Tensor x = rand_uniform({2, 20, 12}, gen, -1.0, 1.0, TensorOptions(DType::f64)).set_requires_grad(true);
  const std::vector<int64_t> lengths{20, 9};  // masked keys in clip 1
  auto f = [&](const std::vector<Tensor>& in) { return m.forward(in[0], lengths, AudioProjection::speech); };
  GradcheckResult r = gradcheck(f, {x}, 1e-6, 1e-6, 1e-4);
  CHECK_MESSAGE(r.ok, r.message);
  // Parameter gradients: a few elements of several tensors against central differences.
  m.zero_grad();
  Tensor w = rand_uniform({5}, gen, -1.0, 1.0, TensorOptions(DType::f64));
  auto loss = [&] { return sum(mul(m.forward(x.detach(), lengths, AudioProjection::speech), w)); };
  loss().backward();
  for (std::string name : {"encoder.relative_attention_bias_layer.bias_values.weight",
                           "encoder.encoders.0.conv.dw_sep_conv_1d.dw_conv.weight", "encoder.encoders.0.conv.glu.b2",
                           "encoder.embed.conv.2.weight", "encoder.embed.out.bias",
                           "encoder.encoders.0.self_attn.linear_k.weight", "audio_projection.speech.0.weight"}) {
    Tensor p = m.get(name);
    REQUIRE(p.grad().defined());
    auto g = p.grad().to_vector<double>();
    for (int64_t i : {int64_t(0), p.numel() / 2, p.numel() - 1}) {
      NoGradGuard ng;
      Tensor flat = p.view({p.numel()});
      const double v0 = flat.select(0, i).item(), eps = 1e-6;
      flat.narrow(0, i, 1).fill_(v0 + eps);
      const double up = loss().item();
      flat.narrow(0, i, 1).fill_(v0 - eps);
      const double down = loss().item();
      flat.narrow(0, i, 1).fill_(v0);
      const double fd = (up - down) / (2 * eps);
      CHECK_MESSAGE(std::abs(fd - g[size_t(i)]) <= 1e-6 + 1e-4 * std::abs(fd), name << "[" << i << "]");
    }
  }
}
