#include "models/phi4mm/init.h"

#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "models/phi4mm/vision/vision.h"
#include "tensor/autograd.h"

namespace areno::phi4mm {

using nlohmann::json;

namespace {

// The released long_factor table (spec 1.2), sampled down to `n` entries.
std::vector<double> released_long_factor(int64_t n) {
  static const double kLong[48] = {
      1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
      2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
      5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
      11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
      25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
      32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77};
  std::vector<double> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(kLong[i * 48 / n]);
  return out;
}

// The released config.json (spec 1.1) with the text sizes replaced.
json released_config_json() {
  json j = json::parse(R"({
    "architectures": ["Phi4MMForCausalLM"], "model_type": "phi4mm",
    "auto_map": {"AutoConfig": "configuration_phi4mm.Phi4MMConfig",
                 "AutoModelForCausalLM": "modeling_phi4mm.Phi4MMForCausalLM",
                 "AutoTokenizer": "Xenova/gpt-4o"},
    "torch_dtype": "bfloat16", "transformers_version": "4.46.1",
    "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 262144, "tie_word_embeddings": true,
    "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999,
    "attention_bias": false, "mlp_bias": false, "lm_head_bias": false,
    "attention_dropout": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
    "initializer_range": 0.02, "use_cache": true, "full_attn_mod": 1, "interpolate_factor": 1,
    "embd_layer": {"embedding_cls": "image_audio",
      "image_embd_layer": {"crop_size": 448, "embedding_cls": "tune_image", "enable_gradient_checkpointing": true,
        "hd_transform_order": "sub_glb", "image_token_compression_cls": "avg_pool_2d", "projection_cls": "mlp",
        "use_hd_transform": true, "with_learnable_separator": true},
      "audio_embd_layer": {"compression_rate": 8, "downsample_rate": 1, "embedding_cls": "audio",
        "enable_gradient_checkpointing": true, "projection_cls": "mlp", "use_conv_downsample": false,
        "use_qformer": false}},
    "audio_processor": {"name": "cascades", "config": {"activation": "swish", "attention_dim": 1024,
      "attention_heads": 16, "batch_norm": false, "bias_in_glu": true, "causal": true, "chunk_size": -1,
      "cnn_layer_norm": true, "conv_activation": "swish", "conv_glu_type": "swish", "depthwise_multiplier": 1,
      "depthwise_seperable_out_channel": 1024, "dropout_rate": 0.0, "encoder_embedding_config": {"input_size": 80},
      "ext_pw_kernel_size": 1, "ext_pw_out_channel": 1024, "input_layer": "nemo_conv", "input_size": 80,
      "kernel_size": 3, "left_chunk": 18, "linear_units": 1536, "nemo_conv_settings": {"conv_channels": 1024},
      "num_blocks": 24, "relative_attention_bias_args": {"t5_bias_max_distance": 500, "type": "t5"},
      "time_reduction": 8}}
  })");
  j["vision_lora"] = {{"dp", 0.0}, {"layer", kVisionLoraRegex}, {"lora_alpha", 512}, {"r", 256}};
  j["speech_lora"] = {{"dp", 0.01}, {"layer", kSpeechLoraRegex}, {"lora_alpha", 640}, {"r", 320}};
  return j;
}

}  // namespace

Config preset_config(const std::string& preset) {
  json j = released_config_json();
  int64_t hidden, inter, layers, heads, kv, orig_max, max_pos, vr, sr;
  if (preset == "full") {
    // The released sizes (spec 1.1), random weights: for GPU benchmarks.
    j["_name_or_path"] = "areno-full";
    j["vocab_size"] = 200064, j["hidden_size"] = 3072, j["intermediate_size"] = 8192;
    j["num_hidden_layers"] = 32, j["num_attention_heads"] = 24, j["num_key_value_heads"] = 8;
    j["original_max_position_embeddings"] = 4096, j["max_position_embeddings"] = 131072;
    j["partial_rotary_factor"] = 0.75;
    j["rope_scaling"] = {{"type", "longrope"},
                         {"short_factor", std::vector<double>(48, 1.0)},
                         {"long_factor", released_long_factor(48)}};
    Config c = parse_config(j, "preset full");
    c.generation.eos_token_ids = {200020, 199999};
    return c;
  }
  // Smaller towers are written explicitly (the released config leaves
  // img_processor null and implies the SigLIP-so400m sizes): vision under
  // "img_processor", audio under "audio_processor.config".
  int64_t vw, vinter, vlayers, vheads, aw, aheads, aunits, ablocks;
  if (preset == "tiny") {
    hidden = 64, inter = 128, layers = 2, heads = 4, kv = 2, orig_max = 64, max_pos = 4096, vr = 8, sr = 8;
    vw = 32, vinter = 64, vlayers = 3, vheads = 2, aw = 32, aheads = 2, aunits = 48, ablocks = 2;
  } else if (preset == "small") {
    hidden = 256, inter = 768, layers = 4, heads = 8, kv = 2, orig_max = 4096, max_pos = 131072, vr = 32, sr = 40;
    vw = 256, vinter = 512, vlayers = 5, vheads = 4, aw = 256, aheads = 4, aunits = 384, ablocks = 4;
  } else {
    throw std::invalid_argument(fmt::format("unknown preset '{}' (expected tiny, small or full)", preset));
  }
  j["_name_or_path"] = "areno-" + preset;
  j["vocab_size"] = 200064;
  j["hidden_size"] = hidden;
  j["intermediate_size"] = inter;
  j["num_hidden_layers"] = layers;
  j["num_attention_heads"] = heads;
  j["num_key_value_heads"] = kv;
  j["original_max_position_embeddings"] = orig_max;
  j["max_position_embeddings"] = max_pos;
  j["partial_rotary_factor"] = 0.75;
  const int64_t nfreq = int64_t(double(hidden / heads) * 0.75) / 2;
  j["rope_scaling"] = {{"type", "longrope"},
                       {"short_factor", std::vector<double>(size_t(nfreq), 1.0)},
                       {"long_factor", released_long_factor(nfreq)}};
  {
    VisionConfig v;
    v.hidden_size = vw, v.intermediate_size = vinter, v.num_hidden_layers = vlayers, v.num_attention_heads = vheads;
    v.projection_dim = hidden;
    j["img_processor"] = vision_config_json(v);
    json& a = j["audio_processor"]["config"];
    a["attention_dim"] = aw, a["attention_heads"] = aheads, a["linear_units"] = aunits, a["num_blocks"] = ablocks;
    a["nemo_conv_settings"]["conv_channels"] = aw;
    a["depthwise_seperable_out_channel"] = aw, a["ext_pw_out_channel"] = aw;
  }
  j["vision_lora"]["r"] = vr;
  j["vision_lora"]["lora_alpha"] = 2 * vr;
  j["speech_lora"]["r"] = sr;
  j["speech_lora"]["lora_alpha"] = 2 * sr;
  Config c = parse_config(j, "preset " + preset);
  c.generation.eos_token_ids = {200020, 199999};
  return c;
}

void init_weights(Phi4MMForCausalLM& model, Generator& gen, double std) {
  NoGradGuard ng;
  for (auto& [name, p] : model.named_parameters()) {
    if (name.rfind("model.embed_tokens_extend.", 0) == 0) continue;  // towers: their own init
    Tensor v = p.dim() == 1 ? ones(p.shape()) : rand_normal(p.shape(), gen, 0.0, std);
    p.copy_(v);
  }
}

std::shared_ptr<Phi4MMForCausalLM> init_model(const std::string& preset, uint64_t seed, DType dtype) {
  Config c = preset_config(preset);
  auto m = std::make_shared<Phi4MMForCausalLM>(c, TensorOptions(dtype));
  Generator gen(seed);
  init_weights(*m, gen);
  m->eval();
  return m;
}

}  // namespace areno::phi4mm
