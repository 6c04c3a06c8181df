#include "models/phi4mm/vision/vision.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <stdexcept>

#include <fmt/format.h>

#include "autograd/checkpoint.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/config_limits.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"

namespace areno::phi4mm {

using nlohmann::json;

// ---- config ----

namespace {

struct KeyReader {
  const json& obj;
  std::string path;    // "img_processor", "vision_config", "" for the top level
  std::string source;  // file name for messages

  std::string name(const char* key) const { return path.empty() ? key : path + "." + key; }
  bool has(const char* key) const { return obj.contains(key) && !obj.at(key).is_null(); }
  [[noreturn]] void fail(const char* key, const std::string& why) const {
    throw std::invalid_argument(fmt::format("{}: {} {}", source, name(key), why));
  }
  // Sizes are bounded before anything is allocated (config_limits.h).
  int64_t integer(const char* key, int64_t fallback, int64_t min, int64_t max = kMaxWidth) const {
    if (!has(key)) return fallback;
    const json& v = obj.at(key);
    if (!v.is_number_integer()) fail(key, fmt::format("must be an integer, got {}", v.dump()));
    int64_t x = v.get<int64_t>();
    if (x < min) fail(key, fmt::format("must be at least {}, got {}", min, x));
    if (x > max) fail(key, fmt::format("= {} is above the supported maximum {}", x, max));
    return x;
  }
  double positive(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    const json& v = obj.at(key);
    if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>()))
      fail(key, fmt::format("must be a finite positive number, got {}", v.dump()));
    return v.get<double>();
  }
  void require_string(const char* key, const char* expected) const {
    if (!has(key)) return;
    const json& v = obj.at(key);
    if (!v.is_string() || v.get<std::string>() != expected)
      fail(key, fmt::format("must be \"{}\" (the only supported value), got {}", expected, v.dump()));
  }
  void require_bool(const char* key, bool expected) const {
    if (!has(key)) return;
    const json& v = obj.at(key);
    if (!v.is_boolean() || v.get<bool>() != expected)
      fail(key, fmt::format("must be {} (the only supported value), got {}", expected, v.dump()));
  }
};

}  // namespace

VisionConfig vision_config_from(const json& j, const std::string& source) {
  if (!j.is_object()) throw std::invalid_argument(source + ": the config must be a JSON object");
  VisionConfig c;
  KeyReader top{j, "", source};
  c.projection_dim = top.integer("hidden_size", c.projection_dim, 1);

  const bool native = j.contains("vision_config") && !j.at("vision_config").is_null();
  const char* block_key = native ? "vision_config" : "img_processor";
  std::optional<int64_t> crop_size;
  if (top.has(block_key)) {
    const json& b = j.at(block_key);
    if (!b.is_object()) top.fail(block_key, fmt::format("must be an object or null, got {}", b.dump()));
    KeyReader r{b, block_key, source};
    c.hidden_size = r.integer("hidden_size", c.hidden_size, 1);
    c.intermediate_size = r.integer("intermediate_size", c.intermediate_size, 1);
    c.num_hidden_layers = r.integer("num_hidden_layers", c.num_hidden_layers, 1, kMaxLayers);
    c.num_attention_heads = r.integer("num_attention_heads", c.num_attention_heads, 1);
    c.image_size = r.integer("image_size", c.image_size, 1, kMaxImageSide);
    c.patch_size = r.integer("patch_size", c.patch_size, 1);
    c.layer_norm_eps = r.positive("layer_norm_eps", c.layer_norm_eps);
    c.image_token_id = r.integer("image_token_id", c.image_token_id, 0, kMaxVocabSize - 1);
    r.require_string("hidden_act", "gelu_pytorch_tanh");
    if (r.has("num_channels") && r.integer("num_channels", 3, 1) != 3) r.fail("num_channels", "must be 3");
    const char* layer_key = native ? "feature_layer" : "layer_idx";  // the remote code's name
    if (r.has(layer_key)) {
      const json& v = b.at(layer_key);
      if (!v.is_number_integer()) r.fail(layer_key, fmt::format("must be an integer, got {}", v.dump()));
      c.feature_layer = v.get<int64_t>();
      if (c.feature_layer < -(c.num_hidden_layers + 1) || c.feature_layer > c.num_hidden_layers)
        r.fail(layer_key, fmt::format("= {} is outside the {} hidden states of a {}-layer tower", c.feature_layer,
                                      c.num_hidden_layers + 1, c.num_hidden_layers));
    }
    if (!native) r.require_string("type_feature", "patch");
    if (native && r.has("crop_size")) crop_size = r.integer("crop_size", 0, 1, kMaxImageSide);
    if (c.hidden_size % c.num_attention_heads)
      r.fail("num_attention_heads", fmt::format("= {} does not divide hidden_size {}", c.num_attention_heads,
                                                c.hidden_size));
    if (c.image_size % c.patch_size)
      r.fail("patch_size", fmt::format("= {} does not divide image_size {}", c.patch_size, c.image_size));
    if (c.patches_per_side() % 2)
      r.fail("image_size", fmt::format("/ patch_size = {} patches per side must be even (2x2 pooling)",
                                       c.patches_per_side()));
  }
  if (top.has("embd_layer") && j.at("embd_layer").is_object() && j.at("embd_layer").contains("image_embd_layer") &&
      !j.at("embd_layer").at("image_embd_layer").is_null()) {
    const json& e = j.at("embd_layer").at("image_embd_layer");
    if (!e.is_object()) top.fail("embd_layer", "image_embd_layer must be an object");
    KeyReader r{e, "embd_layer.image_embd_layer", source};
    if (r.has("crop_size")) crop_size = r.integer("crop_size", 0, 1, kMaxImageSide);
    r.require_string("image_token_compression_cls", "avg_pool_2d");
    r.require_string("hd_transform_order", "sub_glb");
    r.require_string("projection_cls", "mlp");
    r.require_bool("use_hd_transform", true);
    r.require_bool("with_learnable_separator", true);
    if (crop_size && *crop_size != c.image_size)
      r.fail("crop_size", fmt::format("= {} differs from the tower's image_size {}", *crop_size, c.image_size));
  } else if (crop_size && *crop_size != c.image_size) {
    throw std::invalid_argument(fmt::format("{}: vision_config.crop_size = {} differs from image_size {}", source,
                                            *crop_size, c.image_size));
  }
  return c;
}

json vision_config_json(const VisionConfig& c) {
  return json{{"hidden_size", c.hidden_size},
              {"intermediate_size", c.intermediate_size},
              {"num_hidden_layers", c.num_hidden_layers},
              {"num_attention_heads", c.num_attention_heads},
              {"image_size", c.image_size},
              {"patch_size", c.patch_size},
              {"layer_norm_eps", c.layer_norm_eps},
              {"hidden_act", "gelu_pytorch_tanh"},
              {"layer_idx", c.feature_layer},
              {"type_feature", "patch"}};
}

// ---- modules ----

VisionLinear::VisionLinear(int64_t in, int64_t out, TensorOptions opts) : Module("Linear") {
  weight = register_parameter("weight", empty({out, in}, opts));
  bias = register_parameter("bias", empty({out}, opts));
}

VisionLayerNorm::VisionLayerNorm(int64_t dim, TensorOptions opts) : Module("LayerNorm") {
  weight = register_parameter("weight", empty({dim}, opts));
  bias = register_parameter("bias", empty({dim}, opts));
}

SiglipEmbeddings::SiglipEmbeddings(const VisionConfig& c, TensorOptions opts)
    : Module("SiglipVisionEmbeddings"), cfg_(c) {
  auto patch = register_module("patch_embedding", std::make_shared<Module>("Conv2d"));
  patch_weight = patch->register_parameter("weight", empty({c.hidden_size, 3, c.patch_size, c.patch_size}, opts));
  patch_bias = patch->register_parameter("bias", empty({c.hidden_size}, opts));
  auto pos = register_module("position_embedding", std::make_shared<Module>("Embedding"));
  position_weight = pos->register_parameter("weight", empty({c.num_patches(), c.hidden_size}, opts));
}

Tensor SiglipEmbeddings::forward(const Tensor& crops, const Tensor& position_ids) const {
  // Conv2d with kernel = stride = p as one GEMM: each patch's (channel, ky, kx)
  // vector against the weight viewed as [W, 3 p p]. Patches in row-major order.
  const int64_t C = crops.size(0), P = cfg_.patches_per_side(), p = cfg_.patch_size, W = cfg_.hidden_size;
  Tensor patches = crops.reshape({C, 3, P, p, P, p}).permute({0, 2, 4, 1, 3, 5}).reshape({C * P * P, 3 * p * p});
  Tensor e = linear(patches, patch_weight.reshape({W, 3 * p * p}), patch_bias);  // [C P P, W]
  e = add(e, embedding(position_weight, position_ids));
  return e.reshape({C, P * P, W});
}

SiglipAttention::SiglipAttention(const VisionConfig& c, TensorOptions opts) : Module("SiglipAttention"), cfg_(c) {
  const int64_t W = c.hidden_size;
  k_proj = register_module("k_proj", std::make_shared<VisionLinear>(W, W, opts));
  v_proj = register_module("v_proj", std::make_shared<VisionLinear>(W, W, opts));
  q_proj = register_module("q_proj", std::make_shared<VisionLinear>(W, W, opts));
  out_proj = register_module("out_proj", std::make_shared<VisionLinear>(W, W, opts));
}

Tensor SiglipAttention::forward(const Tensor& x, const PatchMasks& masks) const {
  const int64_t C = x.size(0), T = x.size(1), H = cfg_.num_attention_heads, Dh = cfg_.head_dim();
  auto heads = [&](const Tensor& t) { return t.view({C, T, H, Dh}).transpose(1, 2); };  // [C, H, T, Dh]
  Tensor q = heads(q_proj->forward(x)), k = heads(k_proj->forward(x)), v = heads(v_proj->forward(x));
  // The attention op materialises [crops, H, T, T] f32 scores: bound them to
  // about 32 M elements (128 MB) per call by taking a few crops at a time.
  const int64_t per_crop = H * T * T;
  const int64_t chunk = std::max<int64_t>(1, (int64_t(1) << 25) / std::max<int64_t>(per_crop, 1));
  std::vector<Tensor> outs;
  for (int64_t c0 = 0; c0 < C; c0 += chunk) {
    const int64_t n = std::min(chunk, C - c0);
    AttentionOptions ao;
    ao.scale = 1.0 / std::sqrt(double(Dh));
    bool any_padded = false;
    for (int64_t c = c0; c < c0 + n && !masks.crop_padded.empty(); ++c) any_padded |= masks.crop_padded[size_t(c)];
    if (any_padded) ao.key_padding_mask = n == C ? masks.key_padding : masks.key_padding.narrow(0, c0, n);
    if (n == C)
      outs.push_back(scaled_dot_product_attention(q, k, v, ao));
    else
      outs.push_back(scaled_dot_product_attention(q.narrow(0, c0, n), k.narrow(0, c0, n), v.narrow(0, c0, n), ao));
  }
  Tensor o = outs.size() == 1 ? outs[0] : cat(outs, 0);
  o = o.transpose(1, 2).reshape({C, T, H * Dh});
  // Released convention (flash-attention-2 varlen): padded queries produce a
  // zero attention output; out_proj still adds its bias.
  if (cfg_.padded_queries == PaddedQueries::zero && masks.query_keep.defined()) o = mul(o, masks.query_keep);
  return out_proj->forward(o);
}

SiglipMlp::SiglipMlp(const VisionConfig& c, TensorOptions opts) : Module("SiglipMLP") {
  fc1 = register_module("fc1", std::make_shared<VisionLinear>(c.hidden_size, c.intermediate_size, opts));
  fc2 = register_module("fc2", std::make_shared<VisionLinear>(c.intermediate_size, c.hidden_size, opts));
}

SiglipEncoderLayer::SiglipEncoderLayer(const VisionConfig& c, TensorOptions opts)
    : Module("SiglipEncoderLayer"), eps_(c.layer_norm_eps) {
  self_attn = register_module("self_attn", std::make_shared<SiglipAttention>(c, opts));
  layer_norm1 = register_module("layer_norm1", std::make_shared<VisionLayerNorm>(c.hidden_size, opts));
  mlp = register_module("mlp", std::make_shared<SiglipMlp>(c, opts));
  layer_norm2 = register_module("layer_norm2", std::make_shared<VisionLayerNorm>(c.hidden_size, opts));
}

Tensor SiglipEncoderLayer::forward(const Tensor& h, const PatchMasks& masks) const {
  Tensor x = add(h, self_attn->forward(layer_norm1->forward(h, eps_), masks));
  return add(x, mlp->forward(layer_norm2->forward(x, eps_)));
}

SiglipPoolingHead::SiglipPoolingHead(const VisionConfig& c, TensorOptions opts)
    : Module("SiglipMultiheadAttentionPoolingHead") {
  const int64_t W = c.hidden_size;
  register_parameter("probe", empty({1, 1, W}, opts));
  auto attn = register_module("attention", std::make_shared<Module>("MultiheadAttention"));
  attn->register_parameter("in_proj_weight", empty({3 * W, W}, opts));
  attn->register_parameter("in_proj_bias", empty({3 * W}, opts));
  attn->register_module("out_proj", std::make_shared<VisionLinear>(W, W, opts));
  register_module("layernorm", std::make_shared<VisionLayerNorm>(W, opts));
  register_module("mlp", std::make_shared<SiglipMlp>(c, opts));
}

SiglipVisionModel::SiglipVisionModel(const VisionConfig& c, TensorOptions opts)
    : Module("SiglipVisionTransformer") {
  embeddings = register_module("embeddings", std::make_shared<SiglipEmbeddings>(c, opts));
  encoder = register_module("encoder", std::make_shared<Module>("SiglipEncoder"));
  layers = encoder->register_module("layers", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(std::make_shared<SiglipEncoderLayer>(c, opts));
  post_layernorm = register_module("post_layernorm", std::make_shared<VisionLayerNorm>(c.hidden_size, opts));
  head = register_module("head", std::make_shared<SiglipPoolingHead>(c, opts));
}

ImageEmbed::ImageEmbed(const VisionConfig& c, TensorOptions opts) : Module("Phi4MMImageEmbedding"), cfg_(c) {
  if (c.hidden_size % c.num_attention_heads || c.image_size % c.patch_size || c.patches_per_side() % 2 ||
      c.layers_used() < 0 || c.layers_used() > c.num_hidden_layers)
    throw std::invalid_argument(fmt::format(
        "ImageEmbed: inconsistent vision config (width {}, heads {}, image {}, patch {}, feature layer {} of {})",
        c.hidden_size, c.num_attention_heads, c.image_size, c.patch_size, c.feature_layer, c.num_hidden_layers));
  img_processor = register_module("img_processor", std::make_shared<SiglipVisionModel>(c, opts));
  glb_GN = register_parameter("glb_GN", empty({1, 1, c.hidden_size}, opts));
  sub_GN = register_parameter("sub_GN", empty({1, 1, 1, c.hidden_size}, opts));
  img_projection = register_module("img_projection", std::make_shared<Module>("Sequential"));
  // Index 1 of the reference's Sequential is the parameter-less GELU.
  projection_up = img_projection->register_module(
      "0", std::make_shared<VisionLinear>(c.hidden_size, c.projection_dim, opts));
  projection_down = img_projection->register_module(
      "2", std::make_shared<VisionLinear>(c.projection_dim, c.projection_dim, opts));
}

DType ImageEmbed::dtype() const { return glb_GN.dtype(); }
Device ImageEmbed::device() const { return glb_GN.device(); }

// ---- host bookkeeping ----

std::vector<int64_t> navit_position_ids(const std::vector<float>& mask, int64_t P) {
  if (int64_t(mask.size()) != P * P)
    throw std::invalid_argument(fmt::format("patch mask has {} values, expected {}x{}", mask.size(), P, P));
  int64_t n_h = 0, n_w = 0;  // ones in column 0 / row 0 (spec 4.3)
  for (int64_t i = 0; i < P; ++i) n_h += mask[size_t(i * P)] != 0.0f;
  for (int64_t j = 0; j < P; ++j) n_w += mask[size_t(j)] != 0.0f;
  std::vector<int64_t> pos(size_t(P * P), 0);
  for (int64_t i = 0; i < P; ++i)
    for (int64_t j = 0; j < P; ++j) {
      const float m = mask[size_t(i * P + j)];
      const bool inside = i < n_h && j < n_w;
      if ((m != 0.0f && m != 1.0f) || (m == 1.0f) != inside)
        throw std::invalid_argument(fmt::format(
            "patch mask is not a 0/1 top-left rectangle ({} rows x {} columns valid, value {} at row {} column {})",
            n_h, n_w, m, i, j));
      // Bucket B(i, n) = floor(P i / n): the spec's recommended definition (transformers,
      // vLLM, exact math); the released code's float32 linspace differs for a few n.
      if (inside) pos[size_t(i * P + j)] = (P * i / n_h) * P + (P * j / n_w);
    }
  return pos;
}

namespace {

// Masks and position ids of the crops fed to the tower.
struct CropMasks {
  std::vector<int64_t> position_ids;  // [C * P * P]
  std::vector<float> keep;            // [C * P * P] 1 = real patch
  std::vector<bool> padded;           // [C]
  bool any_padded = false;
};

CropMasks crop_masks(const std::vector<float>& host_masks, int64_t C, int64_t P) {
  CropMasks m;
  const size_t T = size_t(P * P);
  if (host_masks.empty()) {
    std::vector<float> ones(T, 1.0f);
    std::vector<int64_t> ident = navit_position_ids(ones, P);
    for (int64_t c = 0; c < C; ++c) m.position_ids.insert(m.position_ids.end(), ident.begin(), ident.end());
    m.padded.assign(size_t(C), false);
    return m;
  }
  m.keep = host_masks;
  for (int64_t c = 0; c < C; ++c) {
    std::vector<float> one(host_masks.begin() + ptrdiff_t(c * T), host_masks.begin() + ptrdiff_t((c + 1) * T));
    std::vector<int64_t> pos;
    try {
      pos = navit_position_ids(one, P);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(fmt::format("crop {}: {}", c, e.what()));
    }
    if (pos.empty() || one[0] == 0.0f) throw std::invalid_argument(fmt::format("crop {}: every patch is masked", c));
    m.position_ids.insert(m.position_ids.end(), pos.begin(), pos.end());
    const bool padded = std::find(one.begin(), one.end(), 0.0f) != one.end();
    m.padded.push_back(padded);
    m.any_padded |= padded;
  }
  return m;
}

PatchMasks patch_masks(const CropMasks& cm, int64_t C, int64_t P, DType dtype, Device device) {
  PatchMasks pm;
  pm.crop_padded = cm.padded;
  if (!cm.any_padded) return pm;
  std::vector<float> pad(cm.keep.size());
  for (size_t i = 0; i < pad.size(); ++i) pad[i] = cm.keep[i] == 0.0f ? 1.0f : 0.0f;
  pm.key_padding = from_vector(pad, {C, P * P}, TensorOptions(DType::boolean, device));
  pm.query_keep = from_vector(cm.keep, {C, P * P, 1}, TensorOptions(dtype, device));
  return pm;
}

}  // namespace

// ---- forward ----

namespace {

// Embeddings and the first layers_used() encoder layers on `crops` [C, 3, S, S]
// with host masks [C * P * P] (empty = no padding).
Tensor run_tower(const ImageEmbed& m, const Tensor& crops, const std::vector<float>& host_masks) {
  const VisionConfig& c = m.config();
  const int64_t C = crops.size(0), P = c.patches_per_side();
  const CropMasks cm = crop_masks(host_masks, C, P);
  Tensor x = crops.to(m.device(), m.dtype());  // the reference casts pixels to the tower's dtype
  Tensor pos = from_vector(cm.position_ids, {C * P * P}, TensorOptions(DType::i64, m.device()));
  Tensor h = m.img_processor->embeddings->forward(x, pos);
  const PatchMasks pm = patch_masks(cm, C, P, m.dtype(), m.device());
  const bool recompute = m.recompute_layers && grad_enabled();
  for (int64_t l = 0; l < c.layers_used(); ++l) {
    std::shared_ptr<SiglipEncoderLayer> layer = m.img_processor->layers->at<SiglipEncoderLayer>(size_t(l));
    if (!recompute) {
      h = layer->forward(h, pm);
      continue;
    }
    h = checkpoint([layer, pm](const std::vector<Tensor>& in) { return layer->forward(in[0], pm); }, {h});
  }
  return h;
}

}  // namespace

Tensor ImageEmbed::tower(const Tensor& crops, const Tensor& masks) const {
  const int64_t P = cfg_.patches_per_side(), S = cfg_.image_size;
  if (crops.dim() != 4 || crops.size(1) != 3 || crops.size(2) != S || crops.size(3) != S)
    throw std::invalid_argument(fmt::format("vision tower: crops must be [C, 3, {}, {}], got {}", S, S, crops.str()));
  const int64_t C = crops.size(0);
  std::vector<float> host;
  if (masks.defined()) {
    if (masks.shape() != Shape{C, P, P})
      throw std::invalid_argument(fmt::format("vision tower: masks must be [{}, {}, {}], got {}", C, P, P, masks.str()));
    host = masks.to_vector<float>();
  }
  return run_tower(*this, crops, host);
}

Tensor ImageEmbed::pool(const Tensor& hidden) const {
  // AvgPool2d(2, 2) on the [C, P, P, W] patch grid (spec 5.1).
  const int64_t C = hidden.size(0), Q = cfg_.pooled_per_side(), W = hidden.size(-1);
  Tensor g = hidden.reshape({C, Q, 2, Q, 2, W});
  return mean(g, {2, 4}).reshape({C, Q * Q, W});
}

Tensor ImageEmbed::project(const Tensor& tokens) const {
  // Exact (erf) GELU between the two linears (spec 6).
  return projection_down->forward(gelu(projection_up->forward(tokens)));
}

ImageEmbedOutput ImageEmbed::forward_stages(const Tensor& pixel_values, const Tensor& image_attention_mask,
                                            const Tensor& image_sizes) const {
  const int64_t S = cfg_.image_size, P = cfg_.patches_per_side(), Q = cfg_.pooled_per_side();
  if (pixel_values.dim() != 5 || pixel_values.size(2) != 3 || pixel_values.size(3) != S || pixel_values.size(4) != S)
    throw std::invalid_argument(fmt::format("image embedding: pixel_values must be [n_images, crops, 3, {}, {}], got {}",
                                            S, S, pixel_values.str()));
  const int64_t n = pixel_values.size(0), nmax = pixel_values.size(1);
  if (image_attention_mask.shape() != Shape{n, nmax, P, P})
    throw std::invalid_argument(fmt::format("image embedding: image_attention_mask must be [{}, {}, {}, {}], got {}", n,
                                            nmax, P, P, image_attention_mask.str()));
  if (image_sizes.shape() != Shape{n, 2})
    throw std::invalid_argument(
        fmt::format("image embedding: image_sizes must be [{}, 2] ([Hc, Wc] per image), got {}", n, image_sizes.str()));
  const std::vector<int64_t> sizes = image_sizes.to_vector<int64_t>();
  const std::vector<float> mask_all = image_attention_mask.to_vector<float>();
  const size_t T = size_t(P * P);
  auto at = [&](int64_t crop, int64_t y, int64_t x) { return mask_all[size_t(crop) * T + size_t(y * P + x)]; };

  // 1. Plans: crop grid from image_sizes, kept pooled rows/columns from the
  //    stride-2 subsampled masks of the HD crops (spec 2.1, 5.3).
  ImageEmbedOutput out;
  std::vector<int64_t> real;  // flat crop index (image * nmax + k) of every crop the tower runs
  for (int64_t i = 0; i < n; ++i) {
    const int64_t hc = sizes[size_t(2 * i)], wc = sizes[size_t(2 * i + 1)];
    if (hc < S || wc < S || hc % S || wc % S)
      throw std::invalid_argument(fmt::format(
          "image embedding: image {} has size [{}, {}]; image_sizes holds the padded canvas [Hc, Wc], multiples of {}",
          i, hc, wc, S));
    ImagePlan p;
    p.gh = hc / S, p.gw = wc / S;
    if (p.num_crops() > nmax)
      throw std::invalid_argument(fmt::format("image embedding: image {} needs {} crops ({}x{} grid + global), the "
                                              "pixel tensor holds {}", i, p.num_crops(), p.gw, p.gh, nmax));
    p.first_crop = int64_t(real.size());
    for (int64_t k = 0; k < p.num_crops(); ++k) real.push_back(i * nmax + k);
    for (int64_t R = 0; R < Q * p.gh; ++R) p.uh += at(i * nmax + 1 + (R / Q) * p.gw, 2 * (R % Q), 0) != 0.0f;
    for (int64_t Cc = 0; Cc < Q * p.gw; ++Cc) p.uw += at(i * nmax + 1 + Cc / Q, 0, 2 * (Cc % Q)) != 0.0f;
    if (p.uh == 0 || p.uw == 0)
      throw std::invalid_argument(fmt::format("image embedding: image {} has no valid patch in its HD crops", i));
    out.images.push_back(p);
    out.num_tokens.push_back(cfg_.image_tokens(p.uh, p.uw));
  }
  const int64_t C = int64_t(real.size());

  // 2. Tower on the real crops only (padding crops are discarded by the reference).
  const bool all_real = C == n * nmax;
  Tensor crops = pixel_values.reshape({n * nmax, 3, S, S});
  std::vector<float> host_masks;
  host_masks.reserve(size_t(C) * T);
  for (int64_t r : real)
    host_masks.insert(host_masks.end(), mask_all.begin() + ptrdiff_t(size_t(r) * T),
                      mask_all.begin() + ptrdiff_t(size_t(r + 1) * T));
  if (!all_real) crops = index_select(crops.to(device()), 0, from_vector(real, {C}, TensorOptions(DType::i64, device())));
  out.hidden = run_tower(*this, crops, host_masks);
  out.pooled = pool(out.hidden);

  // 3. Layout (spec 5.2) as one gather from [pooled rows; sub_GN; glb_GN].
  const int64_t QQ = Q * Q, sub = C * QQ, glb = C * QQ + 1;
  std::vector<int64_t> idx;
  for (const ImagePlan& p : out.images) {
    for (int64_t R = 0; R < p.uh; ++R) {
      for (int64_t Cc = 0; Cc < p.uw; ++Cc) {
        const int64_t crop = p.first_crop + 1 + (R / Q) * p.gw + Cc / Q;
        idx.push_back(crop * QQ + (R % Q) * Q + Cc % Q);
      }
      idx.push_back(sub);
    }
    idx.push_back(glb);
    for (int64_t y = 0; y < Q; ++y) {
      for (int64_t x = 0; x < Q; ++x) idx.push_back(p.first_crop * QQ + y * Q + x);
      idx.push_back(sub);
    }
  }
  const int64_t W = cfg_.hidden_size;
  Tensor table = cat({out.pooled.reshape({C * QQ, W}), sub_GN.reshape({1, W}), glb_GN.reshape({1, W})}, 0);
  out.tokens = index_select(table, 0, from_vector(idx, {int64_t(idx.size())}, TensorOptions(DType::i64, device())));

  // 4. Projector on every token, separators included.
  out.rows = project(out.tokens);
  return out;
}

Tensor ImageEmbed::forward(const ImageBatch& batch) const {
  if (cfg_.image_size != kCropSize || cfg_.patch_size != kPatchSize)
    throw std::invalid_argument(fmt::format("image embedding: the image processor makes {}-pixel crops of {}-pixel "
                                            "patches, the tower expects {} and {}",
                                            kCropSize, kPatchSize, cfg_.image_size, cfg_.patch_size));
  ImageEmbedOutput o = forward_stages(batch.input_image_embeds, batch.image_attention_mask, batch.image_sizes);
  if (o.num_tokens != batch.num_img_tokens) {
    std::string a, b;
    for (auto t : o.num_tokens) a += fmt::format(" {}", t);
    for (auto t : batch.num_img_tokens) b += fmt::format(" {}", t);
    throw std::runtime_error(fmt::format("image embedding: token counts from the masks [{} ] differ from the "
                                         "processor's [{} ]", a, b));
  }
  return o.rows;
}

// ---- weights ----

void init_weights(ImageEmbed& m, Generator& gen, double std) {
  NoGradGuard ng;
  auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (auto& [name, t] : m.named_parameters()) {
    const bool norm = name.find("layer_norm") != std::string::npos || name.find("layernorm") != std::string::npos;
    if (norm && ends_with(name, ".weight"))
      t.fill_(1.0);
    else if (norm && ends_with(name, ".bias"))
      t.fill_(0.0);
    else
      t.copy_(rand_normal(t.shape(), gen, 0.0, std, TensorOptions(DType::f32, Device::cpu())));
  }
}

std::shared_ptr<ImageEmbed> load_image_embed(const SafetensorsCheckpoint& ckpt, const VisionConfig& c,
                                             const std::string& source, DType dtype, Device device) {
  auto m = std::make_shared<ImageEmbed>(c, TensorOptions(dtype, device));
  load_prefixed(*m, ckpt, kImageEmbedPrefix, source);
  return m;
}

std::vector<std::pair<std::string, Tensor>> image_embed_tensors(const ImageEmbed& m, DType dtype) {
  return prefixed_tensors(m, kImageEmbedPrefix, dtype);
}

}  // namespace areno::phi4mm
