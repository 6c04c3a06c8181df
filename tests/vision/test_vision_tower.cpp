// SigLIP tower, 2x2 pooling, sub_GN/glb_GN layout and projector against
// transformers' phi4_multimodal on a tiny random checkpoint
// (tests/reference/vision/make_vision_tower_golden.py), plus the config keys,
// the padded-query convention of the released code, bf16, and gradients.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "autograd/gradcheck.h"
#include "models/phi4mm/processor/image_processor.h"
#include "models/phi4mm/vision/vision.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"
#include "tests/test_util.h"

using namespace areno;
using areno::testing::error_of;
using namespace areno::phi4mm;
using nlohmann::json;

namespace {

const std::string kWeights = "tests/data/vision/tower_tiny.safetensors";
const std::string kGolden = "tests/data/vision/tower_golden.safetensors";

const SafetensorsFile& golden() {
  static SafetensorsFile f(kGolden);
  return f;
}
Tensor gold(const std::string& name) { return golden().load_copy(name); }
std::vector<int64_t> gold_ints(const std::string& name) { return gold(name).to_vector<int64_t>(); }

// max |a - b| / max |b|, as the model tests.
double rel_err(const Tensor& a, const Tensor& b) {
  Tensor bf = b.to(Device::cpu(), DType::f64);
  return max_abs_diff(a.to(Device::cpu(), DType::f64), bf) / std::max(max(abs(bf)).item(), 1e-30);
}

// The spec's synthetic image (section 12): R=(7x+3y), G=x^y, B=5(x+2y)+x*y, mod 256.
RgbImage synthetic_image(int64_t w, int64_t h) {
  RgbImage im{w, h, std::vector<uint8_t>(size_t(w * h * 3))};
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x) {
      uint8_t* p = im.rgb.data() + (y * w + x) * 3;
      p[0] = uint8_t((7 * x + 3 * y) % 256);
      p[1] = uint8_t((x ^ y) % 256);
      p[2] = uint8_t((5 * (x + 2 * y) + x * y) % 256);
    }
  return im;
}

// config.json of the golden checkpoint, as a preset would write it.
json tiny_config_json() {
  json j = json::parse(R"({"model_type": "phi4mm", "hidden_size": 12,
    "embd_layer": {"embedding_cls": "image_audio", "image_embd_layer": {"crop_size": 448,
      "embedding_cls": "tune_image", "hd_transform_order": "sub_glb", "image_token_compression_cls": "avg_pool_2d",
      "projection_cls": "mlp", "use_hd_transform": true, "with_learnable_separator": true}}})");
  VisionConfig v;
  v.hidden_size = 16, v.intermediate_size = 40, v.num_hidden_layers = 3, v.num_attention_heads = 2;
  j["img_processor"] = vision_config_json(v);
  return j;
}

VisionConfig tiny_config(PaddedQueries pq = PaddedQueries::zero) {
  VisionConfig c = vision_config_from(tiny_config_json(), "tiny config.json");
  c.padded_queries = pq;
  return c;
}

std::shared_ptr<ImageEmbed> tiny_model(DType dtype = DType::f32, Device device = Device::cpu(),
                                       PaddedQueries pq = PaddedQueries::zero) {
  static SafetensorsCheckpoint ckpt(kWeights);
  return load_image_embed(ckpt, tiny_config(pq), kWeights, dtype, device);
}

ImageBatch golden_batch(const std::string& key) {
  std::vector<RgbImage> images;
  auto wh = gold_ints(key + "_wh");
  for (size_t i = 0; i < wh.size(); i += 2) images.push_back(synthetic_image(wh[i], wh[i + 1]));
  return process_images(images);
}

ImageEmbedOutput run(const ImageEmbed& m, const ImageBatch& b) {
  NoGradGuard ng;
  return m.forward_stages(b.input_image_embeds, b.image_attention_mask, b.image_sizes);
}

// Index among the real crops of the golden's flat crop index (image * Nmax + k).
int64_t real_crop(const ImageEmbedOutput& o, int64_t flat, int64_t nmax) {
  return o.images[size_t(flat / nmax)].first_crop + flat % nmax;
}

}  // namespace

// ---- config ----

TEST_CASE("vision/config: the released sizes when the tower keys are absent") {
  const VisionConfig c = vision_config_from(json::parse(R"({"hidden_size": 3072, "img_processor": null,
      "embd_layer": {"image_embd_layer": {"crop_size": 448, "hd_transform_order": "sub_glb"}}})"));
  CHECK(c.hidden_size == 1152);
  CHECK(c.intermediate_size == 4304);
  CHECK(c.num_hidden_layers == 27);
  CHECK(c.num_attention_heads == 16);
  CHECK(c.head_dim() == 72);
  CHECK(c.image_size == 448);
  CHECK(c.patch_size == 14);
  CHECK(c.layer_norm_eps == 1e-6);
  CHECK(c.feature_layer == -2);
  CHECK(c.layers_used() == 26);  // hidden_states[-2]: the output of layer 25
  CHECK(c.projection_dim == 3072);
  CHECK(c.image_token_id == 200010);
  CHECK(c.patches_per_side() == 32);
  CHECK(c.pooled_per_side() == 16);
  CHECK(c.padded_queries == PaddedQueries::zero);
  // Spec 2.2 worked examples: 273 + uh * (uw + 1).
  CHECK(c.image_tokens(16, 16) == 545);
  CHECK(c.image_tokens(32, 43) == 1681);
  CHECK(c.image_tokens(7, 32) == 504);
  CHECK(c.image_tokens(576, 16) == 10065);
  CHECK(vision_config_from(json::object()).hidden_size == 1152);
}

TEST_CASE("vision/config: explicit keys in img_processor (original) and vision_config (native)") {
  const VisionConfig t = tiny_config();
  CHECK(t.hidden_size == 16);
  CHECK(t.num_hidden_layers == 3);
  CHECK(t.layers_used() == 2);
  CHECK(t.projection_dim == 12);
  const VisionConfig n = vision_config_from(json::parse(R"({"model_type": "phi4_multimodal", "hidden_size": 64,
      "vision_config": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "image_size": 56, "patch_size": 7, "feature_layer": -1, "crop_size": 56,
        "image_token_id": 7, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-5}})"));
  CHECK(n.hidden_size == 32);
  CHECK(n.patches_per_side() == 8);
  CHECK(n.layers_used() == 4);
  CHECK(n.layer_norm_eps == 1e-5);
  CHECK(n.image_token_id == 7);
  CHECK(n.projection_dim == 64);
  CHECK(n.image_tokens(4, 4) == 4 * 5 + 1 + 4 * 5);
}

TEST_CASE("vision/config: invalid values fail naming the key") {
  auto err = [](const std::string& text) {
    return error_of([&] { vision_config_from(json::parse(text), "cfg.json"); });
  };
  CHECK(err(R"({"img_processor": {"num_attention_heads": 5}})") ==
        "cfg.json: img_processor.num_attention_heads = 5 does not divide hidden_size 1152");
  CHECK(err(R"({"img_processor": {"hidden_act": "gelu"}})").find("img_processor.hidden_act must be "
                                                                  "\"gelu_pytorch_tanh\"") != std::string::npos);
  CHECK(err(R"({"img_processor": {"hidden_size": "wide"}})") ==
        "cfg.json: img_processor.hidden_size must be an integer, got \"wide\"");
  CHECK(err(R"({"img_processor": {"num_hidden_layers": 0}})") ==
        "cfg.json: img_processor.num_hidden_layers must be at least 1, got 0");
  CHECK(err(R"({"img_processor": {"patch_size": 15}})") ==
        "cfg.json: img_processor.patch_size = 15 does not divide image_size 448");
  CHECK(err(R"({"img_processor": {"patch_size": 16, "image_size": 48}})").find("img_processor.image_size") !=
        std::string::npos);  // 3 patches per side: 2x2 pooling needs an even count
  CHECK(err(R"({"img_processor": {"layer_idx": -29}})").find("img_processor.layer_idx = -29 is outside") !=
        std::string::npos);
  CHECK(err(R"({"img_processor": {"type_feature": "cls_patch"}})").find("img_processor.type_feature") !=
        std::string::npos);
  CHECK(err(R"({"img_processor": 3})") == "cfg.json: img_processor must be an object or null, got 3");
  CHECK(err(R"({"embd_layer": {"image_embd_layer": {"crop_size": 336}}})") ==
        "cfg.json: embd_layer.image_embd_layer.crop_size = 336 differs from the tower's image_size 448");
  CHECK(err(R"({"embd_layer": {"image_embd_layer": {"projection_cls": "linear"}}})")
            .find("embd_layer.image_embd_layer.projection_cls must be \"mlp\"") != std::string::npos);
  CHECK(err(R"({"embd_layer": {"image_embd_layer": {"hd_transform_order": "glb_sub"}}})")
            .find("embd_layer.image_embd_layer.hd_transform_order") != std::string::npos);
  CHECK(err(R"({"embd_layer": {"image_embd_layer": {"with_learnable_separator": false}}})")
            .find("with_learnable_separator") != std::string::npos);
  CHECK(err(R"({"vision_config": {"crop_size": 224}})") ==
        "cfg.json: vision_config.crop_size = 224 differs from image_size 448");
  CHECK(err(R"({"hidden_size": -1})") == "cfg.json: hidden_size must be at least 1, got -1");
}

// ---- names ----

TEST_CASE("vision/parameter names equal the released checkpoint's image tensors") {
  const VisionConfig c = tiny_config();
  ImageEmbed m(c);
  std::set<std::string> ours, stored;
  for (auto& [name, t] : m.named_parameters()) ours.insert(kImageEmbedPrefix + name);
  const SafetensorsFile file(kWeights);
  for (auto& name : file.names()) stored.insert(name);
  CHECK(ours == stored);
  // Spec 9: 16 per layer + 3 embeddings + 2 post-LN + 11 head + 6 projector/separators.
  CHECK(ours.size() == size_t(16 * c.num_hidden_layers + 22));
  CHECK(ours.count("model.embed_tokens_extend.image_embed.img_processor.encoder.layers.0.self_attn.q_proj.weight"));
  CHECK(ours.count("model.embed_tokens_extend.image_embed.img_processor.head.attention.in_proj_weight"));
  CHECK(m.get("sub_GN").shape() == Shape{1, 1, 1, 16});
  CHECK(m.get("glb_GN").shape() == Shape{1, 1, 16});
  CHECK(m.get("img_projection.0.weight").shape() == Shape{12, 16});
  CHECK(m.get("img_projection.2.weight").shape() == Shape{12, 12});
  CHECK(m.get("img_processor.embeddings.patch_embedding.weight").shape() == Shape{16, 3, 14, 14});
  CHECK(m.get("img_processor.embeddings.position_embedding.weight").shape() == Shape{1024, 16});
  // Saving writes the same names back.
  auto saved = image_embed_tensors(m, DType::bf16);
  CHECK(saved.size() == ours.size());
  CHECK(saved[0].second.dtype() == DType::bf16);
}

TEST_CASE("vision/a checkpoint directory loads by config.json + name walk, and saves back bit-identically") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("areno_vision_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream(dir / "config.json") << tiny_config_json().dump(2);
  }
  fs::copy_file(kWeights, dir / "model.safetensors");
  auto load_dir = [](const fs::path& d) {
    std::ifstream f(d / "config.json");
    return load_image_embed(SafetensorsCheckpoint(d.string()), vision_config_from(json::parse(f)), d.string());
  };
  auto m = load_dir(dir);
  CHECK(m->config().hidden_size == 16);
  CHECK(m->config().projection_dim == 12);
  const ImageBatch b = golden_batch("a");
  {
    NoGradGuard ng;
    CHECK(rel_err(m->forward(b), gold("a_rows")) < 1e-4);
  }
  // Save in bf16 (the stored dtype) and reload: the same values.
  save_safetensors((dir / "model.safetensors").string(), image_embed_tensors(*m, DType::bf16));
  auto again = load_dir(dir);
  for (auto& [name, t] : m->named_parameters())
    if (max_abs_diff(t, again->get(name)) != 0) FAIL("parameter " << name << " changed by save + load");
  // A missing tensor is named.
  auto tensors = image_embed_tensors(*m, DType::bf16);
  tensors.erase(tensors.begin() + 5);
  const std::string dropped = image_embed_tensors(*m, DType::bf16)[5].first;
  save_safetensors((dir / "model.safetensors").string(), tensors);
  CHECK(error_of([&] { load_dir(dir); }).find("missing " + dropped) != std::string::npos);
  fs::remove_all(dir);
}

// ---- inputs ----

TEST_CASE("vision/golden inputs: our processor gives the reference's pixels, masks, sizes and counts") {
  for (std::string key : {"a", "b", "c"}) {
    CAPTURE(key);
    const ImageBatch b = golden_batch(key);
    CHECK(b.num_img_tokens == gold_ints(key + "_num_tokens"));
    CHECK(b.image_sizes.to_vector<int64_t>() == gold_ints(key + "_image_sizes"));
    Tensor pix = b.input_image_embeds.to(DType::f64);
    CHECK(rel_err(sum(pix, {2, 3, 4}), gold(key + "_pixel_sums")) < 1e-9);
    CHECK(rel_err(sum(abs(pix), {2, 3, 4}), gold(key + "_pixel_abs_sums")) < 1e-9);
    CHECK(max_abs_diff(sum(b.image_attention_mask.to(DType::f64), {2, 3}), gold(key + "_mask_sums")) == 0);
  }
}

// ---- parity ----

DEVICE_TEST_CASE("vision/tower, pooling, layout and projector match transformers (f32)") {
  auto m = tiny_model(DType::f32, device);
  {
    const ImageEmbedOutput o = run(*m, golden_batch("a"));  // one image, 2x1 grid
    CHECK(o.hidden.device() == device);
    CHECK(o.num_tokens == std::vector<int64_t>{801});
    const double ep = rel_err(o.pooled, gold("a_pooled")), et = rel_err(o.tokens, gold("a_tokens")),
                 er = rel_err(o.rows, gold("a_rows"));
    MESSAGE("batch a: pooled " << ep << ", tokens " << et << ", rows " << er);
    CHECK(ep < 1e-4);
    CHECK(et < 1e-4);
    CHECK(er < 1e-4);
  }
  {
    const ImageBatch b = golden_batch("b");  // 2 + 3 crops, masked rows; image 0 has a padding crop
    const ImageEmbedOutput o = run(*m, b);
    CHECK(o.hidden.size(0) == 5);  // the padding crop is skipped
    CHECK(o.num_tokens == std::vector<int64_t>{545, 636});
    const double er = rel_err(o.rows, gold("b_rows"));
    MESSAGE("batch b: rows " << er);
    CHECK(er < 1e-4);
    NoGradGuard ng;
    CHECK(rel_err(m->forward(b), gold("b_rows")) < 1e-4);
  }
  {
    const ImageBatch b = golden_batch("c");  // masked columns; 2x2 grid with masked rows; 3 padding crops
    const ImageEmbedOutput o = run(*m, b);
    const int64_t nmax = b.input_image_embeds.size(1);
    auto idx = gold_ints("c_hidden_index");
    Tensor ref = gold("c_hidden");
    double eh = 0;
    for (size_t k = 0; k < idx.size(); ++k)
      eh = std::max(eh, rel_err(o.hidden.select(0, real_crop(o, idx[k], nmax)), ref.select(0, int64_t(k))));
    const double er = rel_err(o.rows, gold("c_rows"));
    MESSAGE("batch c: hidden of the masked crops " << eh << ", rows " << er);
    CHECK(eh < 1e-4);
    CHECK(er < 1e-4);
  }
}

TEST_CASE("vision/padded queries: released zero-output convention by default, transformers' as an option") {
  const ImageBatch b = golden_batch("c");
  Tensor zero = run(*tiny_model(), b).rows;
  Tensor attend = run(*tiny_model(DType::f32, Device::cpu(), PaddedQueries::attend), b).rows;
  CHECK(rel_err(zero, gold("c_rows")) < 1e-4);
  CHECK(rel_err(attend, gold("c_rows_attend")) < 1e-4);
  // The conventions differ only in the pooled tokens whose 2x2 window holds
  // padded patches: 16 rows of image 0 (21 valid columns) and 32 columns of
  // image 1 (53 valid rows).
  Tensor row_diff = max(abs(sub(zero, attend)), 1);
  auto d = row_diff.to_vector<float>();
  const int64_t changed = std::count_if(d.begin(), d.end(), [](float v) { return v > 1e-6f; });
  CHECK(changed == 16 + 32);
  CHECK(rel_err(attend, gold("c_rows")) > 1e-2);
  // Without padded patches the two conventions agree exactly.
  const ImageBatch a = golden_batch("a");
  CHECK(max_abs_diff(run(*tiny_model(), a).rows,
                     run(*tiny_model(DType::f32, Device::cpu(), PaddedQueries::attend), a).rows) == 0);
}

TEST_CASE("vision/layout: HD rows with sub_GN newlines, one glb_GN, then the global 16x(16+1)") {
  auto m = tiny_model();
  const ImageBatch b = golden_batch("c");
  const ImageEmbedOutput o = run(*m, b);
  // Image 0: 290x448 -> 1x1 grid, 21 valid patch columns -> uw 11, uh 16.
  // Image 1: 896x730 -> 2x2 grid, 53 valid patch rows -> uh 27, uw 32.
  REQUIRE(o.images.size() == 2);
  CHECK(o.images[0].gw == 1);
  CHECK(o.images[0].uw == 11);
  CHECK(o.images[0].uh == 16);
  CHECK(o.images[1].gw == 2);
  CHECK(o.images[1].gh == 2);
  CHECK(o.images[1].uh == 27);
  CHECK(o.images[1].uw == 32);
  CHECK(o.images[1].first_crop == 2);
  CHECK(o.num_tokens == std::vector<int64_t>{273 + 16 * 12, 273 + 27 * 33});
  CHECK(o.num_tokens == b.num_img_tokens);
  CHECK(o.tokens.size(0) == 465 + 1164);
  CHECK(o.rows.shape() == Shape{465 + 1164, 12});

  const Tensor sub_gn = m->sub_GN.reshape({16}), glb_gn = m->glb_GN.reshape({16});
  const ImagePlan& p = o.images[1];
  const int64_t base = 465;  // image 1 starts after image 0's rows
  auto token = [&](int64_t i) { return o.tokens.select(0, base + i); };
  auto pooled = [&](int64_t crop, int64_t y, int64_t x) { return o.pooled.select(0, crop).select(0, 16 * y + x); };
  int64_t i = 0;
  for (int64_t R = 0; R < p.uh; ++R) {
    for (int64_t C = 0; C < p.uw; ++C, ++i) {
      const int64_t crop = p.first_crop + 1 + (R / 16) * p.gw + C / 16;
      if (max_abs_diff(token(i), pooled(crop, R % 16, C % 16)) != 0) FAIL("HD token " << R << "," << C);
    }
    if (max_abs_diff(token(i++), sub_gn) != 0) FAIL("newline after HD row " << R);
  }
  CHECK(max_abs_diff(token(i++), glb_gn) == 0);
  for (int64_t y = 0; y < 16; ++y) {
    for (int64_t x = 0; x < 16; ++x, ++i)
      if (max_abs_diff(token(i), pooled(p.first_crop, y, x)) != 0) FAIL("global token " << y << "," << x);
    if (max_abs_diff(token(i++), sub_gn) != 0) FAIL("newline after global row " << y);
  }
  CHECK(i == 1164);
  // Pooling is the 2x2 mean of the tower's patch grid.
  Tensor h = o.hidden.select(0, 3);  // image 1, first HD crop
  Tensor manual = mul(add(add(h.select(0, 0), h.select(0, 1)), add(h.select(0, 32), h.select(0, 33))), 0.25);
  CHECK(max_abs_diff(manual, pooled(3, 0, 0)) < 1e-6);
}

TEST_CASE("vision/navit position ids bucket floor(32 i / n) of the valid rows and columns") {
  std::vector<float> mask(32 * 32, 0.0f);
  for (int y = 0; y < 20; ++y)
    for (int x = 0; x < 3; ++x) mask[size_t(y * 32 + x)] = 1.0f;
  auto pos = navit_position_ids(mask, 32);
  // n_h = 20: rows 0,1,3,4,6,...; n_w = 3: columns 0,10,21 (spec 4.3 table).
  CHECK(pos[0] == 0);
  CHECK(pos[1] == 10);
  CHECK(pos[2] == 21);
  CHECK(pos[32] == 1 * 32);
  CHECK(pos[2 * 32 + 1] == 3 * 32 + 10);
  CHECK(pos[10 * 32] == 16 * 32);  // the released float32 linspace gives 15 here on AVX512 machines
  CHECK(pos[19 * 32 + 2] == 30 * 32 + 21);
  CHECK(pos[3] == 0);  // padded patches use position 0
  std::vector<float> full(32 * 32, 1.0f);
  auto ident = navit_position_ids(full, 32);
  for (int64_t k = 0; k < 1024; ++k)
    if (ident[size_t(k)] != k) FAIL("identity position " << k);
  mask[5 * 32 + 10] = 1.0f;  // not a top-left rectangle
  CHECK_THROWS_WITH_AS(navit_position_ids(mask, 32),
                       "patch mask is not a 0/1 top-left rectangle (20 rows x 3 columns valid, value 1 at row 5 "
                       "column 10)",
                       std::invalid_argument);
}

// ---- bf16 ----

TEST_CASE("vision/bf16 forward stays within bf16 rounding of the f32 reference") {
  auto m = tiny_model(DType::bf16);
  CHECK(m->dtype() == DType::bf16);
  const ImageEmbedOutput a = run(*m, golden_batch("a"));
  const ImageEmbedOutput c = run(*m, golden_batch("c"));
  CHECK(c.rows.dtype() == DType::bf16);
  const double ep = rel_err(a.pooled, gold("a_pooled")), ea = rel_err(a.rows, gold("a_rows")),
               ec = rel_err(c.rows, gold("c_rows"));
  MESSAGE("bf16 vs f32 golden: pooled " << ep << ", rows a " << ea << ", rows c " << ec);
  // bf16 keeps 8 significant bits (relative step 2^-8 = 0.0039); the bf16
  // pixels, two layers and the projector accumulate a few such roundings.
  // transformers' own bf16 run of batch a is 0.0093 from its f32 rows.
  CHECK(ep < 3e-2);
  CHECK(ea < 3e-2);
  CHECK(ec < 3e-2);
  // Same layout and separators exactly: the separators are bf16 parameters copied as they are.
  CHECK(c.num_tokens == gold_ints("c_num_tokens"));
}

// ---- gradients ----

namespace {

// A very small tower for finite differences: 16-pixel crops of 4-pixel patches
// (4x4 patches, pooled 2x2), width 8.
VisionConfig grad_config() {
  VisionConfig c;
  c.hidden_size = 8, c.intermediate_size = 12, c.num_hidden_layers = 3, c.num_attention_heads = 2;
  c.image_size = 16, c.patch_size = 4, c.projection_dim = 6;
  return c;
}

struct GradInputs {
  Tensor pixels, masks, sizes;
};

// One image on a 2x1 grid (global + 2 crops) whose last crop has 3 of 4 patch
// columns: its last pooled column straddles real and padded patches.
GradInputs grad_inputs(Generator& gen) {
  GradInputs in;
  in.pixels = rand_uniform({1, 3, 3, 16, 16}, gen, -1.0, 1.0, DType::f64);
  std::vector<float> m(3 * 16, 1.0f);
  for (int y = 0; y < 4; ++y) m[size_t(2 * 16 + y * 4 + 3)] = 0.0f;
  in.masks = from_vector(m, {1, 3, 4, 4});
  in.sizes = from_vector(std::vector<int64_t>{16, 32}, {1, 2});
  return in;
}

}  // namespace

TEST_CASE("vision/gradients: pixels by gradcheck, parameters by central differences (f64)") {
  ImageEmbed m(grad_config(), DType::f64);
  Generator gen(7);
  init_weights(m, gen, 0.5);
  GradInputs in = grad_inputs(gen);
  {
    ImageEmbedOutput o = m.forward_stages(in.pixels, in.masks, in.sizes);
    // uh 2; uw 4 = 2 + ceil(3 / 2): the last pooled column straddles real and padded patches.
    CHECK(o.num_tokens == std::vector<int64_t>{2 * (4 + 1) + 1 + 2 * 3});
  }
  Tensor px = in.pixels.clone().set_requires_grad(true);
  auto res = gradcheck([&](const std::vector<Tensor>& xs) { return m.forward(xs[0], in.masks, in.sizes); }, {px});
  CHECK_MESSAGE(res.ok, res.message);
  MESSAGE("pixel gradcheck max abs err " << res.max_abs_err);

  // Parameters: d sum(rows * w) / d p against central differences at a few elements each.
  Tensor w = rand_uniform({17, 6}, gen, 0.5, 1.5, DType::f64);
  auto loss = [&] { return sum(mul(m.forward(in.pixels, in.masks, in.sizes), w)); };
  m.zero_grad();
  loss().backward();
  const std::vector<std::string> names = {
      "sub_GN", "glb_GN", "img_projection.0.weight", "img_projection.2.bias",
      "img_processor.embeddings.patch_embedding.weight", "img_processor.embeddings.patch_embedding.bias",
      "img_processor.embeddings.position_embedding.weight", "img_processor.encoder.layers.0.self_attn.q_proj.weight",
      "img_processor.encoder.layers.0.self_attn.k_proj.bias", "img_processor.encoder.layers.1.self_attn.v_proj.weight",
      "img_processor.encoder.layers.1.self_attn.out_proj.bias", "img_processor.encoder.layers.0.layer_norm1.weight",
      "img_processor.encoder.layers.1.layer_norm2.bias", "img_processor.encoder.layers.1.mlp.fc1.weight",
      "img_processor.encoder.layers.0.mlp.fc2.bias"};
  double worst = 0;
  NoGradGuard ng;
  for (const auto& name : names) {
    Tensor p = m.get(name);
    REQUIRE_MESSAGE(p.grad().defined(), name);
    auto g = p.grad().contiguous().to_vector<double>();
    double* data = p.data<double>();
    const int64_t n = p.numel();
    for (int64_t j : {int64_t(0), n / 3, n - 1}) {
      const double orig = data[j], eps = 1e-6;
      data[j] = orig + eps;
      const double fp = loss().item();
      data[j] = orig - eps;
      const double fm = loss().item();
      data[j] = orig;
      const double numeric = (fp - fm) / (2 * eps);
      const double err = std::abs(numeric - g[size_t(j)]) / std::max(1.0, std::abs(numeric));
      worst = std::max(worst, err);
      CHECK_MESSAGE(err < 1e-6, name << "[" << j << "]: numeric " << numeric << " analytic " << g[size_t(j)]);
    }
  }
  MESSAGE("parameter central differences: worst relative error " << worst);
  // The layer after the feature layer, post_layernorm and the head are never used.
  CHECK_FALSE(m.get("img_processor.encoder.layers.2.self_attn.q_proj.weight").grad().defined());
  CHECK_FALSE(m.get("img_processor.post_layernorm.weight").grad().defined());
  CHECK_FALSE(m.get("img_processor.head.probe").grad().defined());
}

// ---- errors ----

TEST_CASE("vision/bad inputs fail with messages that say what was expected") {
  ImageEmbed m(grad_config(), DType::f32);
  Generator gen(3);
  init_weights(m, gen);
  Tensor pix = zeros({1, 3, 3, 16, 16}), masks = ones({1, 3, 4, 4});
  Tensor sizes = from_vector(std::vector<int64_t>{16, 32}, {1, 2});
  NoGradGuard ng;
  CHECK(m.forward(pix, masks, sizes).shape() == Shape{2 * (4 + 1) + 1 + 2 * 3, 6});
  CHECK(error_of([&] { m.forward(zeros({1, 3, 3, 16, 8}), masks, sizes); }) ==
        "image embedding: pixel_values must be [n_images, crops, 3, 16, 16], got Tensor[1, 3, 3, 16, 8] f32 cpu");
  CHECK(error_of([&] { m.forward(pix, ones({1, 3, 4, 5}), sizes); }).find("image_attention_mask must be [1, 3, 4, 4]") !=
        std::string::npos);
  CHECK(error_of([&] { m.forward(pix, masks, from_vector(std::vector<int64_t>{16, 24}, {1, 2})); }) ==
        "image embedding: image 0 has size [16, 24]; image_sizes holds the padded canvas [Hc, Wc], multiples of 16");
  CHECK(error_of([&] { m.forward(pix, masks, from_vector(std::vector<int64_t>{32, 32}, {1, 2})); }) ==
        "image embedding: image 0 needs 5 crops (2x2 grid + global), the pixel tensor holds 3");
  std::vector<float> holes(3 * 16, 1.0f);
  holes[16 + 5] = 0.0f;  // a hole inside crop 1
  CHECK(error_of([&] { m.forward(pix, from_vector(holes, {1, 3, 4, 4}), sizes); })
            .find("crop 1: patch mask is not a 0/1 top-left rectangle") != std::string::npos);
  // The processor's batch needs the released crop geometry.
  const ImageBatch b = process_images({synthetic_image(20, 20)});
  CHECK(error_of([&] { m.forward(b); }).find("the image processor makes 448-pixel crops") != std::string::npos);
  ImageBatch wrong = process_images({synthetic_image(40, 40)});
  wrong.num_img_tokens = {546};
  CHECK(error_of([&] { tiny_model()->forward(wrong); }) ==
        "image embedding: token counts from the masks [ 545 ] differ from the processor's [ 546 ]");
}
