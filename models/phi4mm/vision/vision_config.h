#pragma once
// Sizes of the image embedding (spec vision.md section 4), read from
// config.json. The modules are in vision.h; Config (config.h) owns one.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace areno::phi4mm {

inline constexpr const char* kImageEmbedPrefix = "model.embed_tokens_extend.image_embed.";

// What attention does with queries at padded patches (spec 4.4; only crops
// with masked patches are affected, and only the pooled tokens that straddle
// the valid/padded boundary).
enum class PaddedQueries : uint8_t {
  zero,    // released code (flash-attention-2): a padded query's attention output is 0
  attend,  // transformers eager/SDPA port: padded queries attend over the valid keys
};

struct VisionConfig {
  // SigLIP tower (spec 4.1)
  int64_t hidden_size = 1152;        // W
  int64_t intermediate_size = 4304;
  int64_t num_hidden_layers = 27;    // stored layers
  int64_t num_attention_heads = 16;
  int64_t image_size = 448;          // crop side fed to the tower (= crop_size)
  int64_t patch_size = 14;
  double layer_norm_eps = 1e-6;
  // hidden_states index read by the image path: -2 = output of layer 25 (26 layers run).
  int64_t feature_layer = -2;
  // Projector output = the language model's hidden size (D).
  int64_t projection_dim = 3072;
  int64_t image_token_id = 200010;
  // Not a config.json key: the runtime convention, reference by default.
  PaddedQueries padded_queries = PaddedQueries::zero;
  // Not a config.json key: preprocessor_config.json's `dynamic_hd`, the most
  // HD crops an image is cut into (spec vision.md 1.2, MAX); the processor's
  // placeholder counts and the tower's crops both follow it.
  int64_t dynamic_hd = 36;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t patches_per_side() const { return image_size / patch_size; }  // P = 32
  int64_t num_patches() const { return patches_per_side() * patches_per_side(); }
  int64_t pooled_per_side() const { return patches_per_side() / 2; }    // Q = 16
  int64_t pooled_per_crop() const { return pooled_per_side() * pooled_per_side(); }
  // Encoder layers that run: hidden_states has num_hidden_layers + 1 entries.
  int64_t layers_used() const { return feature_layer < 0 ? num_hidden_layers + 1 + feature_layer : feature_layer; }
  // Tokens of an image whose HD grid keeps uh pooled rows and uw pooled columns:
  // uh * (uw + 1) + 1 + Q * (Q + 1)   (= 273 + uh * (uw + 1) at the released sizes).
  int64_t image_tokens(int64_t uh, int64_t uw) const {
    return uh * (uw + 1) + 1 + pooled_per_side() * (pooled_per_side() + 1);
  }
};

// Reads the image-path sizes from a config.json object; keys absent -> the
// released values. Invalid values throw std::invalid_argument naming
// `source` and the key. Keys read:
//   hidden_size                           -> projection_dim (the LM width)
//   Original layout (model_type "phi4mm"): "img_processor" (null in the
//     released config; our presets write an object) with the transformers key
//     names hidden_size, intermediate_size, num_hidden_layers,
//     num_attention_heads, image_size, patch_size, layer_norm_eps, hidden_act
//     (must be "gelu_pytorch_tanh"), num_channels (3), image_token_id, and the
//     remote code's own "layer_idx" (feature layer, default -2) and
//     "type_feature" (must be "patch");
//   "embd_layer.image_embd_layer": crop_size (must equal image_size) and the
//     structure switches, which must have the released values:
//     image_token_compression_cls "avg_pool_2d", hd_transform_order "sub_glb",
//     projection_cls "mlp", use_hd_transform true, with_learnable_separator true.
//   Native layout: "vision_config" with the same transformers names,
//     feature_layer and crop_size.
VisionConfig vision_config_from(const nlohmann::json& config_json, const std::string& source = "config.json");
// The "img_processor" object that vision_config_from reads back (for presets).
nlohmann::json vision_config_json(const VisionConfig& c);

}  // namespace areno::phi4mm
