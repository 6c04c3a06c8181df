#include "models/phi4mm/audio/encoder.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "autograd/checkpoint.h"
#include "models/phi4mm/config_limits.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace areno::phi4mm {

using nlohmann::json;

// ---- config ----

int64_t AudioConfig::subsampling_stages() const {
  int64_t n = 0;
  for (int64_t r = time_reduction; r > 1; r /= 2) ++n;
  return n;
}

int64_t AudioConfig::subsampled_width() const {
  int64_t w = input_size;
  for (int64_t i = 0; i < subsampling_stages(); ++i) w = (w - 1) / 2 + 1;
  return w;
}

int64_t AudioConfig::output_frames(int64_t feature_frames) const {
  int64_t t = feature_frames;
  for (int64_t i = 0; i < subsampling_stages(); ++i) t = (t - 1) / 2 + 1;  // ceil(t / 2) per stride-2 conv
  return t;
}

void AudioConfig::validate() const {
  // Sizes are bounded before anything is allocated (config_limits.h).
  auto positive = [](int64_t v, const char* key, int64_t max = kMaxWidth) {
    if (v <= 0) throw std::invalid_argument(fmt::format("audio config: {} must be positive, got {}", key, v));
    if (v > max)
      throw std::invalid_argument(fmt::format("audio config: {} = {} is above the supported maximum {}", key, v, max));
  };
  positive(input_size, "audio_processor.config.input_size");
  positive(attention_dim, "audio_processor.config.attention_dim");
  positive(attention_heads, "audio_processor.config.attention_heads");
  positive(linear_units, "audio_processor.config.linear_units");
  positive(num_blocks, "audio_processor.config.num_blocks", kMaxLayers);
  positive(conv_channels, "audio_processor.config.nemo_conv_settings.conv_channels");
  positive(kernel_size, "audio_processor.config.kernel_size");
  positive(bias_max_distance, "audio_processor.config.relative_attention_bias_args.t5_bias_max_distance");
  positive(projection_dim, "hidden_size");
  if (attention_dim % attention_heads)
    throw std::invalid_argument(fmt::format(
        "audio config: audio_processor.config.attention_dim {} is not a multiple of attention_heads {}",
        attention_dim, attention_heads));
  if (time_reduction < 2 || time_reduction > 1024 || (time_reduction & (time_reduction - 1)))
    throw std::invalid_argument(fmt::format(
        "audio config: audio_processor.config.time_reduction must be a power of two in [2, 1024], got {}", time_reduction));
  if (!(layer_norm_eps > 0) || !std::isfinite(layer_norm_eps)) throw std::invalid_argument("audio config: layer_norm_eps must be positive");
}

namespace {

const json* find_path(const json& j, std::initializer_list<const char*> path) {
  const json* p = &j;
  for (const char* k : path) {
    if (!p->is_object() || !p->contains(k)) return nullptr;
    p = &(*p)[k];
  }
  return p;
}

void read_int(const json& j, std::initializer_list<const char*> path, const std::string& key, int64_t& out) {
  const json* v = find_path(j, path);
  if (!v || v->is_null()) return;
  if (!v->is_number_integer())
    throw std::invalid_argument(fmt::format("audio config: {} must be an integer, got {}", key, v->dump()));
  out = v->get<int64_t>();
}

// Keys whose other values select code paths we do not implement (§5.9).
template <typename T>
void require_value(const json& cfg, const char* key, const T& expected) {
  if (!cfg.contains(key) || cfg[key].is_null()) return;
  bool ok = false;
  try {
    ok = cfg[key].get<T>() == expected;
  } catch (const json::exception&) {
    ok = false;
  }
  if (!ok)
    throw std::invalid_argument(fmt::format("audio config: audio_processor.config.{} = {} is not supported (expected {})",
                                            key, cfg[key].dump(), json(expected).dump()));
}

}  // namespace

AudioConfig audio_config_from(const json& j) {
  AudioConfig c;
  if (!j.is_object()) throw std::invalid_argument("audio config: config.json is not a JSON object");
  read_int(j, {"hidden_size"}, "hidden_size", c.projection_dim);
  const json* ap = find_path(j, {"audio_processor"});
  if (ap && !ap->is_null()) {
    if (!ap->is_object()) throw std::invalid_argument("audio config: audio_processor must be an object");
    if (ap->contains("name") && (*ap)["name"] != "cascades")
      throw std::invalid_argument(fmt::format("audio config: audio_processor.name = {} is not supported (expected \"cascades\")",
                                              (*ap)["name"].dump()));
    const json* cfg = find_path(*ap, {"config"});
    if (cfg && !cfg->is_null()) {
      if (!cfg->is_object()) throw std::invalid_argument("audio config: audio_processor.config must be an object");
      const json& a = *cfg;
      read_int(a, {"input_size"}, "audio_processor.config.input_size", c.input_size);
      read_int(a, {"attention_dim"}, "audio_processor.config.attention_dim", c.attention_dim);
      read_int(a, {"attention_heads"}, "audio_processor.config.attention_heads", c.attention_heads);
      read_int(a, {"linear_units"}, "audio_processor.config.linear_units", c.linear_units);
      read_int(a, {"num_blocks"}, "audio_processor.config.num_blocks", c.num_blocks);
      read_int(a, {"time_reduction"}, "audio_processor.config.time_reduction", c.time_reduction);
      read_int(a, {"kernel_size"}, "audio_processor.config.kernel_size", c.kernel_size);
      c.conv_channels = c.attention_dim;  // the NeMo default when conv_channels is absent
      read_int(a, {"nemo_conv_settings", "conv_channels"}, "audio_processor.config.nemo_conv_settings.conv_channels",
               c.conv_channels);
      read_int(a, {"relative_attention_bias_args", "t5_bias_max_distance"},
               "audio_processor.config.relative_attention_bias_args.t5_bias_max_distance", c.bias_max_distance);
      int64_t emb_in = c.input_size;
      read_int(a, {"encoder_embedding_config", "input_size"},
               "audio_processor.config.encoder_embedding_config.input_size", emb_in);
      if (emb_in != c.input_size)
        throw std::invalid_argument(fmt::format(
            "audio config: audio_processor.config.encoder_embedding_config.input_size {} differs from input_size {}",
            emb_in, c.input_size));
      for (const char* key : {"ext_pw_out_channel", "depthwise_seperable_out_channel"}) {
        int64_t v = c.attention_dim;
        read_int(a, {key}, std::string("audio_processor.config.") + key, v);
        if (v != c.attention_dim)
          throw std::invalid_argument(fmt::format(
              "audio config: audio_processor.config.{} = {} is not supported (must equal attention_dim {})", key, v,
              c.attention_dim));
      }
      require_value(a, "activation", std::string("swish"));
      require_value(a, "conv_activation", std::string("swish"));
      require_value(a, "conv_glu_type", std::string("swish"));
      require_value(a, "input_layer", std::string("nemo_conv"));
      require_value(a, "bias_in_glu", true);
      require_value(a, "causal", true);
      require_value(a, "batch_norm", false);
      require_value(a, "chunk_size", int64_t(-1));
      require_value(a, "depthwise_multiplier", int64_t(1));
      require_value(a, "ext_pw_kernel_size", int64_t(1));
      require_value(a, "attention_group_size", int64_t(1));
      require_value(a, "linear_glu_in_convm", false);
      if (const json* rb = find_path(a, {"relative_attention_bias_args"}); rb && rb->is_object()) {
        require_value(*rb, "type", std::string("t5"));
        require_value(*rb, "t5_bias_symmetric", false);
      }
      if (const json* ns = find_path(a, {"nemo_conv_settings"}); ns && ns->is_object()) {
        require_value(*ns, "subsampling", std::string("dw_striding"));
        require_value(*ns, "activation", std::string("relu"));
        require_value(*ns, "is_causal", false);
      }
    }
  }
  c.validate();
  return c;
}

// ---- modules ----

AudioAffine::AudioAffine(const std::string& type, Shape weight_shape, int64_t out, TensorOptions opts)
    : Module(type) {
  weight = register_parameter("weight", empty(std::move(weight_shape), opts));
  bias = register_parameter("bias", empty({out}, opts));
}

namespace {

std::shared_ptr<AudioAffine> linear_module(Module& parent, const std::string& name, int64_t in, int64_t out,
                                           TensorOptions opts) {
  return parent.register_module(name, std::make_shared<AudioAffine>("Linear", Shape{out, in}, out, opts));
}

std::shared_ptr<AudioAffine> norm_module(Module& parent, const std::string& name, int64_t dim, TensorOptions opts) {
  return parent.register_module(name, std::make_shared<AudioAffine>("LayerNorm", Shape{dim}, dim, opts));
}

std::shared_ptr<AudioAffine> conv1d_module(Module& parent, const std::string& name, int64_t out, int64_t in,
                                           int64_t k, TensorOptions opts) {
  return parent.register_module(name, std::make_shared<AudioAffine>("Conv1d", Shape{out, in, k}, out, opts));
}

std::shared_ptr<Module> container(Module& parent, const std::string& name, const char* type = "Module") {
  return parent.register_module(name, std::make_shared<Module>(type));
}

// A [out, in, 1] (or [out, in, 1, 1]) pointwise conv weight as a Linear weight.
Tensor as_linear(const Tensor& w) { return w.reshape({w.size(0), w.size(1)}); }

}  // namespace

ConformerBlock::ConformerBlock(const AudioConfig& c, TensorOptions opts) : Module("ConformerEncoderLayer"), cfg_(c) {
  const int64_t d = c.attention_dim;
  auto make_ffn = [&](const std::string& name) {
    auto m = container(*this, name, "FeedForward");
    FeedForward f;
    f.layer_norm = norm_module(*m, "layer_norm", d, opts);
    auto net = container(*m, "net", "Sequential");
    auto glu = container(*net, "0", "GLULinear");
    f.up = linear_module(*glu, "linear", d, 2 * c.linear_units, opts);
    f.down = linear_module(*net, "2", c.linear_units, d, opts);
    return f;
  };
  ffn_in = make_ffn("feed_forward_in");
  auto attn = container(*this, "self_attn", "MultiHeadedAttention");
  q = linear_module(*attn, "linear_q", d, d, opts);
  k = linear_module(*attn, "linear_k", d, d, opts);
  v = linear_module(*attn, "linear_v", d, d, opts);
  out = linear_module(*attn, "linear_out", d, d, opts);
  auto conv = container(*this, "conv", "ConvModule");
  conv_norm = norm_module(*conv, "layer_norm", d, opts);
  auto glu = container(*conv, "glu", "GLUPointWiseConv");
  glu_pw = conv1d_module(*glu, "ext_pw_conv_1d", 2 * d, d, 1, opts);
  glu_b1 = glu->register_parameter("b1", empty({1, d, 1}, opts));
  glu_b2 = glu->register_parameter("b2", empty({1, d, 1}, opts));
  auto dws = container(*conv, "dw_sep_conv_1d", "DepthWiseSeperableConv1d");
  dw = conv1d_module(*dws, "dw_conv", d, 1, c.kernel_size, opts);
  pw = conv1d_module(*dws, "pw_conv", d, d, 1, opts);
  ext_pw = conv1d_module(*conv, "ext_pw_conv_1d", d, d, 1, opts);
  ffn_out = make_ffn("feed_forward_out");
  norm_att = norm_module(*this, "layer_norm_att", d, opts);
  norm_final = norm_module(*this, "layer_norm", d, opts);
}

Tensor ConformerBlock::feed_forward(const FeedForward& f, const Tensor& x) const {
  Tensor z = layer_norm(x, f.layer_norm->weight, f.layer_norm->bias, cfg_.layer_norm_eps);
  auto halves = chunk(linear(z, f.up->weight, f.up->bias), 2, -1);  // value | gate
  return linear(mul(halves[0], silu(halves[1])), f.down->weight, f.down->bias);
}

Tensor ConformerBlock::attention(const Tensor& x, const Tensor& bias, const Tensor& key_mask,
                                 const Tensor& keep) const {
  const int64_t n = x.size(0), l = x.size(1), h = cfg_.attention_heads, dk = cfg_.head_dim();
  auto heads = [&](const std::shared_ptr<AudioAffine>& p) {
    return linear(x, p->weight, p->bias).view({n, l, h, dk}).transpose(1, 2);  // [N, H, L, dk]
  };
  AttentionOptions o;
  o.bias = bias;
  o.key_padding_mask = key_mask;
  Tensor a = scaled_dot_product_attention(heads(q), heads(k), heads(v), o);  // [N, H, L, dk]
  a = a.transpose(1, 2).reshape({n, l, h * dk});
  if (keep.defined()) a = mul(a, keep);
  return linear(a, out->weight, out->bias);
}

Tensor ConformerBlock::conv_module(const Tensor& x) const {
  const int64_t d = cfg_.attention_dim, kk = cfg_.kernel_size;
  Tensor z = layer_norm(x, conv_norm->weight, conv_norm->bias, cfg_.layer_norm_eps);
  auto halves = chunk(linear(z, as_linear(glu_pw->weight), glu_pw->bias), 2, -1);  // [N, L, D] each
  Tensor u = mul(add(halves[0], glu_b1.reshape({d})), silu(add(halves[1], glu_b2.reshape({d}))));
  // Causal depthwise conv along time: y[t] = b + sum_i W[:, 0, i] * u[t - (K-1) + i], u[<0] = 0,
  // as a [K, 1] depthwise kernel over [N, L + K - 1, 1, D].
  Tensor up = kk > 1 ? pad(u, {0, 0, kk - 1, 0}) : u;
  Tensor y = depthwise_conv2d_nhwc(up.unsqueeze(2), dw->weight.reshape({d, kk, 1}), dw->bias).squeeze(2);
  Tensor p = silu(linear(y, as_linear(pw->weight), pw->bias));
  return linear(p, as_linear(ext_pw->weight), ext_pw->bias);
}

Tensor ConformerBlock::forward(const Tensor& x0, const Tensor& bias, const Tensor& key_mask,
                               const Tensor& keep) const {
  Tensor x = add_scaled(x0, feed_forward(ffn_in, x0), 0.5);
  x = add(x, attention(layer_norm(x, norm_att->weight, norm_att->bias, cfg_.layer_norm_eps), bias, key_mask, keep));
  x = add(x, conv_module(x));
  x = add_scaled(x, feed_forward(ffn_out, x), 0.5);
  return layer_norm(x, norm_final->weight, norm_final->bias, cfg_.layer_norm_eps);
}

AudioEmbed::AudioEmbed(const AudioConfig& c, TensorOptions opts) : Module("Phi4MMAudioEmbedding"), cfg_(c) {
  cfg_.validate();
  const int64_t d = c.attention_dim, ch = c.conv_channels;
  auto encoder = container(*this, "encoder", "ConformerEncoder");
  auto cmvn = container(*encoder, "encoder_embedding", "MeanVarianceNormLayer");
  global_mean = cmvn->register_parameter("global_mean", empty({c.input_size}, opts), false);
  global_invstd = cmvn->register_parameter("global_invstd", empty({c.input_size}, opts), false);
  auto embed = container(*encoder, "embed", "NemoConvSubsampling");
  auto conv = container(*embed, "conv", "Sequential");
  embed_conv.push_back(conv->register_module("0", std::make_shared<AudioAffine>("Conv2d", Shape{ch, 1, 3, 3}, ch, opts)));
  for (int64_t s = 1; s < c.subsampling_stages(); ++s) {
    embed_conv.push_back(conv->register_module(
        std::to_string(3 * s - 1), std::make_shared<AudioAffine>("Conv2d", Shape{ch, 1, 3, 3}, ch, opts)));
    embed_conv.push_back(conv->register_module(
        std::to_string(3 * s), std::make_shared<AudioAffine>("Conv2d", Shape{ch, ch, 1, 1}, ch, opts)));
  }
  embed_out = linear_module(*embed, "out", ch * c.subsampled_width(), d, opts);
  auto rel = container(*encoder, "relative_attention_bias_layer", "T5RelativeAttentionLogitBias");
  auto values = container(*rel, "bias_values", "Embedding");
  bias_table = values->register_parameter("weight", empty({c.bias_table_rows(), c.attention_heads}, opts));
  auto encoders = container(*encoder, "encoders", "ModuleList");
  for (int64_t i = 0; i < c.num_blocks; ++i)
    blocks.push_back(encoders->register_module(std::to_string(i), std::make_shared<ConformerBlock>(c, opts)));
  auto proj = container(*this, "audio_projection", "ModuleDict");
  auto speech = container(*proj, "speech", "Sequential");
  speech_up = linear_module(*speech, "0", d, c.projection_dim, opts);
  speech_down = linear_module(*speech, "2", c.projection_dim, c.projection_dim, opts);
  auto vision = container(*proj, "vision", "Sequential");
  vision_up = linear_module(*vision, "0", d, c.projection_dim, opts);
  vision_down = linear_module(*vision, "2", c.projection_dim, c.projection_dim, opts);
}

Tensor AudioEmbed::embed(const Tensor& features) const {
  Tensor x = mul(sub(features, global_mean), global_invstd);  // CMVN, padded frames too (§5.3)
  // The reference views x [B, T, F] as an image [B, 1, T, F] (height = time,
  // width = frequency) and runs NCHW convolutions. We keep the same math in a
  // channels-last layout [B, T, F, C]: every depthwise conv is then one pass
  // over contiguous channel rows (depthwise_conv2d_nhwc, summed in f32 and
  // rounded once, as torch's conv2d) and every pointwise conv one GEMM.
  const int64_t b = x.size(0), ch = cfg_.conv_channels;
  auto out_len = [](int64_t n) { return (n - 1) / 2 + 1; };  // k 3, stride 2, pad 1
  // Tap (a, c) of a 3x3 stride-2 pad-1 conv over [B, H, W, ...] padded by one.
  auto tap = [&](const Tensor& xp, int64_t a, int64_t c, int64_t ho, int64_t wo) {
    return xp.slice(1, a, a + 2 * (ho - 1) + 1, 2).slice(2, c, c + 2 * (wo - 1) + 1, 2);
  };
  // conv.0 (1 -> C): im2col as 9 strided slices [B, T1, F1, 9], then one GEMM.
  int64_t ho = out_len(x.size(1)), wo = out_len(x.size(2));
  Tensor xp = pad(x, {1, 1, 1, 1});
  std::vector<Tensor> taps;
  for (int64_t a = 0; a < 3; ++a)
    for (int64_t c = 0; c < 3; ++c) taps.push_back(tap(xp, a, c, ho, wo));
  // [B, T1, F1, 9 taps (a * 3 + c, the weight's order) + a ones column for the
  // bias], zero-padded by one row/column: the GEMM then writes conv.0's output
  // already padded for the next conv (zero border: relu(0) = 0), which saves two
  // passes over the largest tensor of the encoder ([T/2, 40, C]).
  taps.push_back(ones_like(taps[0]));
  Tensor cols = pad(stack(taps, -1), {0, 0, 1, 1, 1, 1});
  Tensor w0 = cat({embed_conv[0]->weight.reshape({ch, 9}), embed_conv[0]->bias.reshape({ch, 1})}, 1);  // [C, 10]
  Tensor hp = relu(matmul(cols, w0.t()));  // [B, T1 + 2, F1 + 2, C], zero border
  Tensor h;
  for (size_t s = 1; s + 1 < embed_conv.size(); s += 2) {
    // Depthwise 3x3 stride 2 (groups = C) over the zero-padded input: out_len per dim.
    const auto& dwc = embed_conv[s];
    if (s > 1) hp = pad(h, {0, 0, 1, 1, 1, 1});
    Tensor y = depthwise_conv2d_nhwc(hp, dwc->weight.reshape({ch, 3, 3}), dwc->bias, {2, 2});
    // Pointwise 1x1 conv: a Linear over channels.
    const auto& pwc = embed_conv[s + 1];
    h = relu(linear(y, as_linear(pwc->weight), pwc->bias));  // [B, T', F', C]
  }
  if (!h.defined()) h = hp.narrow(1, 1, hp.size(1) - 2).narrow(2, 1, hp.size(2) - 2);  // time_reduction 2
  // Flatten as the reference's [B, C, T', F'] -> [B, T', C * F'] (index c * F' + f), then Linear.
  const int64_t t = h.size(1), f = h.size(2);
  Tensor flat = h.permute({0, 1, 3, 2}).reshape({b, t, ch * f});
  return linear(flat, embed_out->weight, embed_out->bias);
}

Tensor AudioEmbed::relative_bias(int64_t l) const {
  const int64_t maxd = cfg_.bias_max_distance;
  std::vector<int64_t> idx(size_t(l * l));
  for (int64_t i = 0; i < l; ++i)
    for (int64_t j = 0; j < l; ++j) idx[size_t(i * l + j)] = std::clamp(j - i, -maxd, maxd - 1) + maxd;
  Tensor ids = from_vector(idx, {l, l}, TensorOptions(DType::i64, bias_table.device()));
  return embedding(bias_table, ids).permute({2, 0, 1}).unsqueeze(0).contiguous();  // [1, H, L, L]
}

AudioEncoderOutput AudioEmbed::encode(const Tensor& features, std::span<const int64_t> lengths_in,
                                      AudioMasking masking) const {
  if (features.dim() != 3 || features.size(2) != cfg_.input_size)
    throw std::invalid_argument(
        fmt::format("audio encoder: features must be [B, T, {}], got {}", cfg_.input_size, features.str()));
  const int64_t b = features.size(0), t_max = features.size(1);
  if (b == 0 || t_max == 0) throw std::invalid_argument("audio encoder: empty feature batch " + features.str());
  std::vector<int64_t> frames(lengths_in.begin(), lengths_in.end());
  if (frames.empty()) frames.assign(size_t(b), t_max);
  if (int64_t(frames.size()) != b)
    throw std::invalid_argument(fmt::format("audio encoder: {} lengths for a batch of {}", frames.size(), b));
  for (int64_t f : frames)
    if (f < 1 || f > t_max)
      throw std::invalid_argument(fmt::format("audio encoder: clip length {} outside [1, {}]", f, t_max));
  const bool masked = masking == AudioMasking::masked || (masking == AudioMasking::reference && b > 1);

  const TensorOptions popt(global_mean.dtype(), global_mean.device());
  Tensor x = features.to(popt.device, popt.dtype);
  Tensor h = embed(x);  // [B, T', D]
  const int64_t t_out = h.size(1), d = cfg_.attention_dim;

  AudioEncoderOutput out;
  for (int64_t f : frames) out.lengths.push_back(cfg_.output_frames(f));

  // Windows (§5.5): [B, T', D] -> [B * nw, L, D].
  const int64_t win = t_out > kAudioWindow ? kAudioWindow : t_out;
  const int64_t nw = (t_out + win - 1) / win, padded = nw * win;
  if (padded > t_out) h = pad(h, {0, 0, 0, padded - t_out});
  h = h.reshape({b * nw, win, d});

  Tensor key_mask, keep;
  if (masked) {
    std::vector<bool> mask_host(size_t(b * padded));
    std::vector<float> keep_host(size_t(b * nw), 1.0f);
    bool any_masked = false, any_empty = false;
    for (int64_t i = 0; i < b; ++i)
      for (int64_t w = 0; w < nw; ++w) {
        const int64_t valid = std::clamp(out.lengths[size_t(i)] - w * win, int64_t(0), win);
        // A window with no valid key: the reference's softmax gives NaN, which it
        // then sets to 0 (§5.6); we unmask it and zero its attention output.
        if (valid == 0) {
          keep_host[size_t(i * nw + w)] = 0.0f;
          any_empty = true;
        }
        for (int64_t j = 0; j < win; ++j) {
          const bool m = valid > 0 && j >= valid;
          mask_host[size_t((i * nw + w) * win + j)] = m;
          any_masked |= m;
        }
      }
    if (any_masked) {
      key_mask = from_vector(mask_host, {b * nw, win}, TensorOptions(DType::boolean, popt.device));
    }
    if (any_empty) keep = from_vector(keep_host, {b * nw, 1, 1}, popt);
  }

  Tensor bias = relative_bias(win);
  const bool recompute = recompute_layers && grad_enabled();
  for (const auto& blk : blocks) {
    if (!recompute) {
      h = blk->forward(h, bias, key_mask, keep);
      continue;
    }
    // The relative bias (from a parameter) is an input, so its gradient
    // leaves each block's node as in the run without checkpointing.
    h = checkpoint([blk, key_mask, keep](const std::vector<Tensor>& in) {
      return blk->forward(in[0], in[1], key_mask, keep);
    }, {h, bias});
  }

  h = h.reshape({b, padded, d});
  if (padded > t_out) h = h.narrow(1, 0, t_out);
  out.hidden = h;
  return out;
}

Tensor AudioEmbed::project(const AudioEncoderOutput& enc, AudioProjection mode) const {
  const auto& up = mode == AudioProjection::speech ? speech_up : vision_up;
  const auto& down = mode == AudioProjection::speech ? speech_down : vision_down;
  const int64_t b = enc.hidden.size(0);
  if (int64_t(enc.lengths.size()) != b)
    throw std::invalid_argument(fmt::format("audio projector: {} lengths for a batch of {}", enc.lengths.size(), b));
  std::vector<Tensor> rows;
  bool whole = true;
  for (int64_t i = 0; i < b; ++i) whole &= enc.lengths[size_t(i)] == enc.hidden.size(1);
  Tensor h;
  if (whole) {
    h = enc.hidden.reshape({b * enc.hidden.size(1), enc.hidden.size(2)});
  } else {
    for (int64_t i = 0; i < b; ++i) rows.push_back(enc.hidden.select(0, i).narrow(0, 0, enc.lengths[size_t(i)]));
    h = cat(rows, 0);
  }
  return linear(gelu(linear(h, up->weight, up->bias)), down->weight, down->bias);
}

Tensor AudioEmbed::forward(const Tensor& features, std::span<const int64_t> lengths, AudioProjection mode,
                           AudioMasking masking) const {
  return project(encode(features, lengths, masking), mode);
}

void init_audio_weights(AudioEmbed& m, Generator& gen) {
  NoGradGuard ng;
  for (auto& [name, p] : m.named_parameters()) {
    const std::string leaf = name.substr(name.rfind('.') + 1);
    auto set = [&dst = p](const Tensor& v) { dst.copy_(v); };
    if (name.find("global_mean") != std::string::npos) {
      p.fill_(0.0);
    } else if (name.find("global_invstd") != std::string::npos) {
      p.fill_(1.0);
    } else if (name.find("bias_values") != std::string::npos) {
      set(rand_normal(p.shape(), gen, 0.0, 1.0, TensorOptions(DType::f32, p.device())));
    } else if (leaf == "b1" || leaf == "b2") {
      p.fill_(0.0);
    } else if (name.find("layer_norm") != std::string::npos) {
      p.fill_(leaf == "weight" ? 1.0 : 0.0);
    } else {
      // Linear / Conv: fan_in = in_channels/groups * kernel elements of the weight.
      const std::string owner = name.substr(0, name.rfind('.'));
      const Tensor w = m.get(owner + ".weight");
      int64_t fan_in = 1;
      for (int64_t i = 1; i < w.dim(); ++i) fan_in *= w.size(i);
      const double bound = 1.0 / std::sqrt(double(fan_in));
      set(rand_uniform(p.shape(), gen, -bound, bound, TensorOptions(DType::f32, p.device())));
    }
  }
}

}  // namespace areno::phi4mm
