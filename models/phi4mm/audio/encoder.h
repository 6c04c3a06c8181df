#pragma once
// Phi-4-multimodal audio tower: the "cascades" Conformer encoder and the two
// audio projectors (shared/spec/audio.md §5, §6, §8). Module names equal the
// released checkpoint's names under `model.embed_tokens_extend.audio_embed.`
// (kAudioEmbedPrefix), so loading is a name walk (checkpoint.h load_prefixed).
//
//   features [B, T, 80] f32 (audio_features.h)
//   -> global CMVN (x - global_mean) * global_invstd                      §5.3
//   -> NeMo dw_striding subsampling x8 + Linear(C*10 -> D)  [B, T', D]     §5.4
//   -> 500-frame windows when T' > 500, each window on its own             §5.5
//   -> num_blocks Conformer blocks (macaron FFN, MHSA + T5 bias, conv)     §5.7, §5.8
//   -> projector "speech" or "vision": Linear, GELU(erf), Linear -> [T', 3072]  §6
//
// Everything is composed from tensor/ops.h, so it runs on any device, in f32
// or bf16, and is differentiable.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/audio/audio_config.h"
#include "nn/module.h"
#include "tensor/tensor.h"

namespace areno::phi4mm {

// Which projector maps encoder frames to language-model rows (§6): speech for
// audio-only requests, vision when the request also has an image.
enum class AudioProjection { speech, vision };

// Whether attention masks the padded keys of a batch (§5.6).
//  reference: as the released processor + model: a mask exists only when B > 1
//             (a single clip runs unmasked, including the zero rows that pad its
//             last 500-frame window);
//  masked:    always mask keys past each clip's length;
//  unmasked:  never mask.
enum class AudioMasking { reference, masked, unmasked };

struct AudioEncoderOutput {
  Tensor hidden;                // [B, T'_max, D] (rows past lengths[b] are padding)
  std::vector<int64_t> lengths;  // T'_b = ceil(T_b / time_reduction)
};

// One Linear-like parameter pair (weight + bias) under a checkpoint name. Conv
// weights keep their checkpoint shapes ([out, in, 1] etc.).
class AudioAffine : public Module {
 public:
  AudioAffine(const std::string& type, Shape weight_shape, int64_t out, TensorOptions opts);
  Tensor weight;
  Tensor bias;
};

// The Conformer block (§5.8), prefix `encoder.encoders.N.`.
class ConformerBlock : public Module {
 public:
  ConformerBlock(const AudioConfig& c, TensorOptions opts);
  // x: [N, L, D]; bias: [1, H, L, L]; key_mask: [N, L] bool (true = masked
  // out) or undefined; keep: [N, 1, 1] (0 for windows whose keys are all
  // masked, whose attention output the reference zeroes) or undefined.
  Tensor forward(const Tensor& x, const Tensor& bias, const Tensor& key_mask, const Tensor& keep) const;

  struct FeedForward {
    std::shared_ptr<AudioAffine> layer_norm, up, down;  // net.0.linear, net.2
  };
  FeedForward ffn_in, ffn_out;
  std::shared_ptr<AudioAffine> q, k, v, out;  // self_attn.linear_{q,k,v,out}
  std::shared_ptr<AudioAffine> conv_norm, glu_pw, dw, pw, ext_pw;
  Tensor glu_b1, glu_b2;  // [1, D, 1]
  std::shared_ptr<AudioAffine> norm_att, norm_final;

 private:
  Tensor feed_forward(const FeedForward& f, const Tensor& x) const;
  Tensor attention(const Tensor& x, const Tensor& bias, const Tensor& key_mask, const Tensor& keep) const;
  Tensor conv_module(const Tensor& x) const;
  AudioConfig cfg_;
};

// The audio tower with the two projectors. Named like the released checkpoint
// with kAudioEmbedPrefix removed: `encoder.encoder_embedding.global_mean`,
// `encoder.embed.conv.0.weight`, `encoder.encoders.0.self_attn.linear_q.weight`,
// `audio_projection.speech.0.weight`, ... (887 tensors at released sizes).
// The CMVN buffers global_mean / global_invstd are registered as parameters
// (requires_grad false) so they load and save with the rest.
class AudioEmbed : public Module {
 public:
  // Uninitialised: load a checkpoint (load_prefixed) or call init_audio_weights.
  explicit AudioEmbed(const AudioConfig& c, TensorOptions opts = {});

  // features: [B, T_max, input_size] (any float dtype; cast to the parameters'
  // dtype and device); lengths: T_b per clip, each in [1, T_max] (empty: every
  // clip is T_max long). Rows past a clip's length are padding.
  AudioEncoderOutput encode(const Tensor& features, std::span<const int64_t> lengths = {},
                            AudioMasking masking = AudioMasking::reference) const;
  // Projected rows of every clip, its first lengths[b] rows, concatenated in
  // clip order: [sum_b T'_b, projection_dim] — the rows that replace the audio
  // placeholder tokens (§7).
  Tensor project(const AudioEncoderOutput& encoded, AudioProjection mode) const;
  // encode + project.
  Tensor forward(const Tensor& features, std::span<const int64_t> lengths, AudioProjection mode,
                 AudioMasking masking = AudioMasking::reference) const;

  // The front end alone (§5.3-5.4): CMVN, subsampling convs, Linear:
  // [B, T, input_size] (the parameters' dtype and device) -> [B, T', D].
  Tensor embed(const Tensor& features) const;

  const AudioConfig& config() const { return cfg_; }

  // Activation checkpointing per Conformer block when gradients are recorded
  // (as ImageEmbed::recompute_layers; the trainer sets it).
  bool recompute_layers = false;

  // Parameters, in checkpoint-name order of registration.
  Tensor global_mean, global_invstd;                // [input_size]
  std::vector<std::shared_ptr<AudioAffine>> embed_conv;  // conv.0, conv.2, conv.3, conv.5, conv.6, ...
  std::shared_ptr<AudioAffine> embed_out;           // [D, C * subsampled_width]
  Tensor bias_table;                                // [2 * max_distance, H]
  std::vector<std::shared_ptr<ConformerBlock>> blocks;
  std::shared_ptr<AudioAffine> speech_up, speech_down, vision_up, vision_down;

 private:
  Tensor relative_bias(int64_t length) const;  // [1, H, L, L]
  AudioConfig cfg_;
};

// Random initialisation as torch's defaults for the layer types (kaiming-uniform
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for Linear/Conv weights and biases, ones /
// zeros for LayerNorm, N(0, 1) for the bias table, zeros for the GLU biases),
// CMVN mean 0 / invstd 1. Values are drawn in f32 and cast to the parameters'
// dtype, so a seed gives the same model on every device.
void init_audio_weights(AudioEmbed& m, Generator& gen);

}  // namespace areno::phi4mm
