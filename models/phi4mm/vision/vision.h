#pragma once
// The Phi-4-multimodal image embedding (spec vision.md sections 4-6 and 9):
// SigLIP-so400m/14 @448 tower (NaViT position bucketing, patch masks), output
// of hidden_states[-2], 2x2 average pooling, the HD layout with the learnable
// separators sub_GN / glb_GN ("sub_glb" order) and the 2-layer projector.
//
// Module names equal the released checkpoint's tensor names with the prefix
// `model.embed_tokens_extend.image_embed.` (kImageEmbedPrefix) removed:
//   img_processor.embeddings.patch_embedding.weight        [W, 3, 14, 14] (+ .bias)
//   img_processor.embeddings.position_embedding.weight     [1024, W]
//   img_processor.encoder.layers.L.layer_norm1.weight      (+ .bias; layer_norm2 too)
//   img_processor.encoder.layers.L.self_attn.{q,k,v,out}_proj.weight (+ .bias)
//   img_processor.encoder.layers.L.mlp.fc1.weight, mlp.fc2.weight (+ .bias)
//   img_processor.post_layernorm.{weight,bias}              (stored, unused)
//   img_processor.head.{probe, attention.in_proj_weight, attention.in_proj_bias,
//     attention.out_proj.*, layernorm.*, mlp.fc1.*, mlp.fc2.*}  (stored, unused)
//   glb_GN [1, 1, W], sub_GN [1, 1, 1, W]
//   img_projection.0.weight [D, W] (+ .bias), img_projection.2.weight [D, D] (+ .bias)
// Every stored tensor is a parameter, so a released checkpoint loads and saves
// by a plain name walk (load_model, or load_image_embed alone). Layers past the
// feature layer, post_layernorm and head are never computed.
//
// Everything runs as tensor ops (any device, f32/bf16, differentiable). Only
// the small per-crop bookkeeping (valid rows/columns from the 32x32 masks,
// position ids, the layout's gather indices) is done on the host.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/processor/image_processor.h"
#include "models/phi4mm/vision/vision_config.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "tensor/ops.h"

namespace areno {
class SafetensorsCheckpoint;
}

namespace areno::phi4mm {

// ---- modules (parameters allocated uninitialised) ----

// weight [out, in] + bias [out].
class VisionLinear : public Module {
 public:
  VisionLinear(int64_t in, int64_t out, TensorOptions opts);
  Tensor forward(const Tensor& x) const { return linear(x, weight, bias); }
  Tensor weight, bias;
};

// weight [dim] + bias [dim].
class VisionLayerNorm : public Module {
 public:
  VisionLayerNorm(int64_t dim, TensorOptions opts);
  Tensor forward(const Tensor& x, double eps) const { return layer_norm(x, weight, bias, eps); }
  Tensor weight, bias;
};

class SiglipEmbeddings : public Module {
 public:
  SiglipEmbeddings(const VisionConfig& c, TensorOptions opts);
  // crops [C, 3, S, S], position ids [C * P * P] i64 (same device) -> [C, P * P, W]
  Tensor forward(const Tensor& crops, const Tensor& position_ids) const;
  Tensor patch_weight, patch_bias;  // patch_embedding.weight [W, 3, p, p], .bias [W]
  Tensor position_weight;           // position_embedding.weight [P * P, W]

 private:
  VisionConfig cfg_;
};

// Per-crop patch masks in the form attention needs (built by ImageEmbed).
struct PatchMasks {
  Tensor key_padding;  // [C, T] bool, true = padded patch; undefined when nothing is padded
  Tensor query_keep;   // [C, T, 1] model dtype, 1 = real patch; undefined when nothing is padded
  std::vector<bool> crop_padded;  // [C]
};

class SiglipAttention : public Module {
 public:
  SiglipAttention(const VisionConfig& c, TensorOptions opts);
  // x [C, T, W] -> [C, T, W]
  Tensor forward(const Tensor& x, const PatchMasks& masks) const;
  std::shared_ptr<VisionLinear> q_proj, k_proj, v_proj, out_proj;

 private:
  VisionConfig cfg_;
};

class SiglipMlp : public Module {
 public:
  SiglipMlp(const VisionConfig& c, TensorOptions opts);
  Tensor forward(const Tensor& x) const { return fc2->forward(gelu_tanh(fc1->forward(x))); }
  std::shared_ptr<VisionLinear> fc1, fc2;
};

class SiglipEncoderLayer : public Module {
 public:
  SiglipEncoderLayer(const VisionConfig& c, TensorOptions opts);
  Tensor forward(const Tensor& h, const PatchMasks& masks) const;
  std::shared_ptr<VisionLayerNorm> layer_norm1, layer_norm2;
  std::shared_ptr<SiglipAttention> self_attn;
  std::shared_ptr<SiglipMlp> mlp;

 private:
  double eps_;
};

// The attention-pooling head: stored in the checkpoint, never used by the image path.
class SiglipPoolingHead : public Module {
 public:
  SiglipPoolingHead(const VisionConfig& c, TensorOptions opts);
};

class SiglipVisionModel : public Module {
 public:
  SiglipVisionModel(const VisionConfig& c, TensorOptions opts);
  std::shared_ptr<SiglipEmbeddings> embeddings;
  std::shared_ptr<Module> encoder;        // holds "layers"
  std::shared_ptr<ModuleList> layers;     // encoder.layers
  std::shared_ptr<VisionLayerNorm> post_layernorm;
  std::shared_ptr<SiglipPoolingHead> head;
};

// Host-side facts about one image of a batch (from image_sizes and its masks).
struct ImagePlan {
  int64_t gw = 0, gh = 0;       // crop grid: columns, rows
  int64_t uw = 0, uh = 0;       // pooled HD columns / rows kept
  int64_t first_crop = 0;       // index of its global crop among the batch's real crops
  int64_t num_crops() const { return 1 + gw * gh; }
};

struct ImageEmbedOutput {
  Tensor hidden;  // [C, P*P, W] tower output after layers_used() layers, real crops in batch order
  Tensor pooled;  // [C, Q*Q, W] after 2x2 average pooling
  Tensor tokens;  // [N, W] the sub_glb layout with separators (projector input)
  Tensor rows;    // [N, D] projected rows, in placeholder order
  std::vector<ImagePlan> images;
  std::vector<int64_t> num_tokens;  // per image; N is their sum
};

class ImageEmbed : public Module {
 public:
  ImageEmbed(const VisionConfig& c, TensorOptions opts = {});

  const VisionConfig& config() const { return cfg_; }
  DType dtype() const;
  Device device() const;

  // The processor's tensors (spec 1.9): pixel_values [n, Nmax, 3, S, S] (any
  // float dtype, cast to the model dtype as the reference does),
  // image_attention_mask [n, Nmax, P, P] (1 = real patch) and image_sizes
  // [n, 2] = [Hc, Wc] (multiples of S). Padding crops (index >= 1 + gw*gh) are
  // skipped. Inputs may live on any device; results are on the model's.
  ImageEmbedOutput forward_stages(const Tensor& pixel_values, const Tensor& image_attention_mask,
                                  const Tensor& image_sizes) const;
  // Rows [sum of token counts, D] in placeholder order.
  Tensor forward(const Tensor& pixel_values, const Tensor& image_attention_mask, const Tensor& image_sizes) const {
    return forward_stages(pixel_values, image_attention_mask, image_sizes).rows;
  }
  // Same, from the processor's batch; checks the token counts it reports.
  Tensor forward(const ImageBatch& batch) const;

  // Stages, exposed for tests and benchmarks.
  // crops [C, 3, S, S], masks [C, P, P] (undefined = no padding) -> [C, P*P, W]
  Tensor tower(const Tensor& crops, const Tensor& masks = Tensor()) const;
  // hidden [C, P*P, W] -> [C, Q*Q, W]
  Tensor pool(const Tensor& hidden) const;
  // [.., W] -> [.., D]
  Tensor project(const Tensor& tokens) const;

  // Activation checkpointing per encoder layer when gradients are recorded:
  // only each layer's input is kept, the backward runs the layer again (the
  // trainer sets it with --activation-checkpointing when the tower trains).
  // Without a tape it changes nothing.
  bool recompute_layers = false;

  std::shared_ptr<SiglipVisionModel> img_processor;
  Tensor glb_GN;  // [1, 1, W]
  Tensor sub_GN;  // [1, 1, 1, W]
  std::shared_ptr<Module> img_projection;  // children "0" and "2"
  std::shared_ptr<VisionLinear> projection_up, projection_down;  // img_projection.0 / .2

 private:
  VisionConfig cfg_;
};

// NaViT position ids of one crop (spec 4.3) from its P x P mask (row-major,
// 1 = real): pos = floor(P*i/n_h) * P + floor(P*j/n_w) for real patches, 0 for
// padded ones. The mask must be a non-empty top-left rectangle.
std::vector<int64_t> navit_position_ids(const std::vector<float>& mask, int64_t P);

// Fills every parameter from `gen`: N(0, std) for matrices, the patch and
// position embeddings, the separators, the probe and all biases; LayerNorm
// weights 1, biases 0.
void init_weights(ImageEmbed& m, Generator& gen, double std = 0.02);

// The image embedding alone (tower tests and benchmarks; the model loads it
// with everything else through load_model): tensors under kImageEmbedPrefix
// of an opened checkpoint, converted to `dtype`.
std::shared_ptr<ImageEmbed> load_image_embed(const SafetensorsCheckpoint& ckpt, const VisionConfig& c,
                                             const std::string& source, DType dtype = DType::f32,
                                             Device device = Device::cpu());
// The parameters under their checkpoint names (kImageEmbedPrefix + name), for saving.
std::vector<std::pair<std::string, Tensor>> image_embed_tensors(const ImageEmbed& m, DType dtype);

}  // namespace areno::phi4mm
