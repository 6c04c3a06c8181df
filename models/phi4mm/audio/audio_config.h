#pragma once
// Sizes of the audio embedding (spec audio.md section 5.1), read from
// config.json. The modules are in encoder.h; Config (config.h) owns one.
#include <cstdint>

#include <nlohmann/json.hpp>

namespace areno::phi4mm {

inline constexpr const char* kAudioEmbedPrefix = "model.embed_tokens_extend.audio_embed.";
// Length of the independent attention windows after subsampling (§5.5). Not a
// config key: the reference hard-codes it ("max_seq_len = 500").
inline constexpr int64_t kAudioWindow = 500;

// Sizes of the audio tower. Defaults are the released values (§5.1).
// audio_config_from() reads them from config.json (original remote-code
// layout); the keys, under "audio_processor.config" unless stated:
//   input_size                                  input_size (= encoder_embedding_config.input_size)
//   attention_dim                               attention_dim
//   attention_heads                             attention_heads
//   linear_units                                linear_units
//   num_blocks                                  num_blocks
//   time_reduction                              time_reduction (a power of two >= 2)
//   conv_channels                               nemo_conv_settings.conv_channels
//   kernel_size                                 kernel_size (causal depthwise conv)
//   bias_max_distance                           relative_attention_bias_args.t5_bias_max_distance
//   projection_dim                              top-level hidden_size (the language model width)
// Keys whose values change the math in ways we do not implement (activation
// other than "swish", chunk_size != -1, batch_norm, ext_pw_out_channel or
// depthwise_seperable_out_channel != attention_dim, ...) are rejected by name.
struct AudioConfig {
  int64_t input_size = 80;
  int64_t attention_dim = 1024;
  int64_t attention_heads = 16;
  int64_t linear_units = 1536;
  int64_t num_blocks = 24;
  int64_t time_reduction = 8;
  int64_t conv_channels = 1024;
  int64_t kernel_size = 3;
  int64_t bias_max_distance = 500;  // T5 table rows = 2 * this (asymmetric)
  int64_t projection_dim = 3072;
  double layer_norm_eps = 1e-5;

  int64_t head_dim() const { return attention_dim / attention_heads; }
  int64_t subsampling_stages() const;  // log2(time_reduction)
  int64_t subsampled_width() const;    // input_size halved (ceil) per stage: 80 -> 10
  int64_t bias_table_rows() const { return 2 * bias_max_distance; }
  // Encoder frames (= audio tokens) of T feature frames: ceil(T / time_reduction).
  int64_t output_frames(int64_t feature_frames) const;
  // Throws std::invalid_argument naming the first inconsistent field.
  void validate() const;
};

// Reads the audio sizes from a parsed config.json (see AudioConfig). Missing
// keys keep the released values; wrong types or values throw
// std::invalid_argument naming the key.
AudioConfig audio_config_from(const nlohmann::json& config_json);

}  // namespace areno::phi4mm
