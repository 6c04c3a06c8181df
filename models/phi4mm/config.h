#pragma once
// Phi-4-multimodal configuration (spec text.md sections 1 and 7.2).
//
// Reads config.json in the original remote-code layout (model_type "phi4mm")
// and in the transformers-native layout (model_type "phi4_multimodal"), plus
// generation_config.json. Everything is validated before any weight is read;
// errors name the file and the key.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/audio/audio_config.h"
#include "models/phi4mm/vision/vision_config.h"

namespace areno::phi4mm {

// One modality adapter (spec 3.1): scaling = alpha / r.
struct LoraConfig {
  int64_t r = 0;
  double alpha = 0;
  double dropout = 0;
  std::string layer_regex;  // as written in config.json (informational once validated)
  // The user adapter only: the linears it wraps in every decoder layer, a
  // subset of kLoraTargets in that order (the released adapters wrap all four).
  std::vector<std::string> targets;
  double scaling() const { return alpha / double(r); }
};

struct TextConfig {
  int64_t vocab_size = 200064;
  int64_t hidden_size = 3072;
  int64_t intermediate_size = 8192;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 24;
  int64_t num_key_value_heads = 8;
  double rms_norm_eps = 1e-5;
  int64_t max_position_embeddings = 131072;
  int64_t original_max_position_embeddings = 4096;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 0.75;
  std::vector<double> short_factor;  // rotary_dim / 2 entries
  std::vector<double> long_factor;
  std::optional<double> rope_attention_factor;  // rope "attention_factor" override, rarely set
  bool tie_word_embeddings = true;
  int64_t bos_token_id = 199999;
  int64_t pad_token_id = 199999;
  std::vector<int64_t> eos_token_ids{199999};

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t q_size() const { return num_attention_heads * head_dim(); }
  int64_t kv_size() const { return num_key_value_heads * head_dim(); }
  int64_t qkv_size() const { return q_size() + 2 * kv_size(); }
  // int(head_dim * partial_rotary_factor), as the reference truncates.
  int64_t rotary_dim() const { return int64_t(double(head_dim()) * partial_rotary_factor); }
  // LongRoPE mscale (spec 1.4, 2.4): from the config ratio, both regimes.
  double rope_mscale() const;
};

struct GenerationConfig {
  int64_t bos_token_id = 199999;
  int64_t pad_token_id = 199999;
  std::vector<int64_t> eos_token_ids{200020, 199999};  // stop on any
};

enum class Layout { original, native };

struct Config {
  Layout layout = Layout::original;
  TextConfig text;
  // Absent in the native layout (adapters live in PEFT folders there).
  std::optional<LoraConfig> vision_lora;
  std::optional<LoraConfig> speech_lora;
  // The user adapter (config key "user_lora", written by `areno train
  // --lora-rank`): a LoRA of our own on every row, beside the modality
  // adapter the row uses. Absent in the released checkpoint.
  std::optional<LoraConfig> user_lora;
  // Tower sizes (explicit keys or the released ones); whether a tower is
  // present is the checkpoint's business (Phi4MMForCausalLM::image_embed).
  VisionConfig vision;
  AudioConfig audio;
  GenerationConfig generation;
  // The parsed config.json, kept so that saving writes back every key we do
  // not interpret (towers, processor settings).
  nlohmann::json raw;
};

// Parses and validates a config.json object. `source` names the file in errors.
Config parse_config(const nlohmann::json& j, const std::string& source = "config.json");
// Reads <dir>/config.json and, when present, <dir>/generation_config.json
// and <dir>/preprocessor_config.json (its dynamic_hd).
Config load_config(const std::string& dir);
// The most HD crops an image may be cut into (dynamic_hd): 1 to 64 (the
// released value is 36).
inline constexpr int64_t kMaxDynamicHd = 64;
// `v` as a dynamic_hd value; throws std::runtime_error "<where>: ..." otherwise.
int64_t parse_dynamic_hd(const nlohmann::json& v, const std::string& where);
// Parses generation_config.json (eos may be a number or a list).
GenerationConfig parse_generation_config(const nlohmann::json& j,
                                         const std::string& source = "generation_config.json");

// config.json in the original (phi4mm) layout, whatever layout was read.
nlohmann::json to_original_json(const Config& c);
nlohmann::json to_generation_json(const GenerationConfig& g);

// The released adapter target patterns (spec 1.1). Any other pattern is
// rejected: we would not know which modules it wraps.
extern const char* const kVisionLoraRegex;
extern const char* const kSpeechLoraRegex;
// The linears of a decoder layer a LoRA can wrap, in the layer's order.
inline const std::vector<std::string> kLoraTargets{"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
// Parses a user adapter's target list ("all" or names of kLoraTargets,
// comma-separated) into kLoraTargets order; throws std::invalid_argument
// naming `what` and the bad entry.
std::vector<std::string> parse_lora_targets(const std::string& list, const std::string& what);
// Checks a user adapter's sizes (r in [1, 4096], alpha > 0 and finite,
// dropout in [0, 1), targets non-empty and known); throws
// std::invalid_argument naming `what` and the field.
void check_user_lora(const LoraConfig& l, const std::string& what);

}  // namespace areno::phi4mm
