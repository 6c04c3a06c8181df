#include "models/phi4mm/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "models/phi4mm/config_limits.h"
#include "nn/io/files.h"

namespace areno::phi4mm {

using nlohmann::json;

const char* const kVisionLoraRegex =
    "layers.*((self_attn\\.(qkv_proj|o_proj))|(mlp\\.(gate_up|down)_proj))";
const char* const kSpeechLoraRegex =
    "((layers.*self_attn\\.(qkv|o)_proj)|(layers.*mlp\\.(gate_up|down)_proj))";

namespace {

[[noreturn]] void fail(const std::string& source, const std::string& key, const std::string& what);

// Special token ids must be rows of the vocabulary (the engine stops on them
// and the embedding is indexed by them).
void check_token_ids(const std::string& source, int64_t bos, int64_t pad, const std::vector<int64_t>& eos,
                     int64_t vocab) {
  auto check = [&](const char* key, int64_t id) {
    if (id < 0 || id >= vocab) fail(source, key, fmt::format("{} is not a token id in [0, {})", id, vocab));
  };
  check("bos_token_id", bos);
  check("pad_token_id", pad);
  for (int64_t id : eos) check("eos_token_id", id);
}

[[noreturn]] void fail(const std::string& source, const std::string& key, const std::string& what) {
  throw std::runtime_error(fmt::format("{}: key '{}': {}", source, key, what));
}

// A number (JSON int or float) under `key`, or `def` when absent/null.
double get_number(const json& j, const std::string& source, const std::string& key,
                  std::optional<double> def = std::nullopt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (def) return *def;
    fail(source, key, "missing (a number is required)");
  }
  if (!it->is_number()) fail(source, key, fmt::format("expected a number, got {}", it->dump()));
  return it->get<double>();
}

int64_t get_int(const json& j, const std::string& source, const std::string& key,
                std::optional<int64_t> def = std::nullopt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (def) return *def;
    fail(source, key, "missing (an integer is required)");
  }
  if (!it->is_number_integer())
    fail(source, key, fmt::format("expected an integer, got {}", it->dump()));
  return it->get<int64_t>();
}

// An integer in [1, max]: sizes are bounded before anything is allocated (config_limits.h).
int64_t get_positive(const json& j, const std::string& source, const std::string& key, int64_t max,
                     std::optional<int64_t> def = std::nullopt) {
  int64_t v = get_int(j, source, key, def);
  if (v <= 0) fail(source, key, fmt::format("must be positive, got {}", v));
  if (v > max) fail(source, key, fmt::format("{} is above the supported maximum {}", v, max));
  return v;
}

// A finite number > 0 (NaN, infinities, zero and negatives are refused).
double get_positive_number(const json& j, const std::string& source, const std::string& key,
                           std::optional<double> def = std::nullopt) {
  const double v = get_number(j, source, key, def);
  if (!(v > 0) || !std::isfinite(v)) fail(source, key, fmt::format("must be a finite positive number, got {}", v));
  return v;
}

std::vector<int64_t> get_id_list(const json& j, const std::string& source, const std::string& key,
                                 std::vector<int64_t> def) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  std::vector<int64_t> out;
  if (it->is_number_integer()) return {it->get<int64_t>()};
  if (!it->is_array()) fail(source, key, "expected an integer or a list of integers");
  for (auto& v : *it) {
    if (!v.is_number_integer()) fail(source, key, "expected a list of integers");
    out.push_back(v.get<int64_t>());
  }
  return out;
}

std::vector<double> get_factors(const json& rope, const std::string& source, const std::string& key,
                                int64_t expected) {
  auto it = rope.find(key);
  if (it == rope.end() || !it->is_array())
    fail(source, key, fmt::format("missing or not a list (expected {} numbers)", expected));
  std::vector<double> out;
  for (auto& v : *it) {
    if (!v.is_number()) fail(source, key, "expected a list of numbers");
    out.push_back(v.get<double>());
  }
  if (int64_t(out.size()) != expected)
    fail(source, key,
         fmt::format("has {} entries, expected rotary_dim / 2 = {}", out.size(), expected));
  for (double f : out)
    if (!(f > 0) || !std::isfinite(f)) fail(source, key, fmt::format("factors must be finite and positive, got {}", f));
  return out;
}

// Checks `j[key] == want` when the key is present (towers we do not implement
// yet must still be the released layout, or later issues would silently load
// a different model).
template <typename T>
void expect_value(const json& j, const std::string& source, const std::string& key, const T& want) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;
  if (*it != json(want))
    fail(source, key,
         fmt::format("unsupported value {} (only the released layout {} is implemented)", it->dump(),
                     json(want).dump()));
}

std::optional<LoraConfig> parse_lora(const json& j, const std::string& source, const std::string& key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_object()) fail(source, key, "expected an object with r, lora_alpha, layer");
  LoraConfig l;
  const std::string where = source + ": " + key;
  l.r = get_positive(*it, where, "r", kMaxWidth);
  l.alpha = get_positive_number(*it, where, "lora_alpha");
  l.dropout = get_number(*it, where, "dp", 0.0);
  if (!(l.dropout >= 0 && l.dropout < 1)) fail(where, "dp", fmt::format("must be in [0, 1), got {}", l.dropout));
  auto layer = it->find("layer");
  if (layer == it->end() || !layer->is_string())
    fail(source, key + ".layer", "missing (the module pattern the adapter wraps)");
  l.layer_regex = layer->get<std::string>();
  if (l.layer_regex != kVisionLoraRegex && l.layer_regex != kSpeechLoraRegex)
    fail(source, key + ".layer",
         fmt::format("unknown LoRA target pattern \"{}\"; only the released patterns (qkv_proj, "
                     "o_proj, gate_up_proj, down_proj of every layer) are supported",
                     l.layer_regex));
  return l;
}

std::optional<LoraConfig> parse_user_lora(const json& j, const std::string& source) {
  auto it = j.find("user_lora");
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_object()) fail(source, "user_lora", "expected an object with r, lora_alpha, dp, target_modules");
  LoraConfig l;
  const std::string where = source + ": user_lora";
  l.r = get_positive(*it, where, "r", kMaxWidth);
  l.alpha = get_positive_number(*it, where, "lora_alpha");
  l.dropout = get_number(*it, where, "dp", 0.0);
  auto t = it->find("target_modules");
  if (t == it->end() || !t->is_array() || t->empty())
    fail(source, "user_lora.target_modules", "expected a non-empty list of qkv_proj, o_proj, gate_up_proj, down_proj");
  std::string list;
  for (const json& e : *t) {
    if (!e.is_string()) fail(source, "user_lora.target_modules", "expected strings");
    list += (list.empty() ? "" : ",") + e.get<std::string>();
  }
  try {
    l.targets = parse_lora_targets(list, where + ".target_modules");
    if (l.targets.size() != t->size()) fail(source, "user_lora.target_modules", "lists a module twice");
    check_user_lora(l, where);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(e.what());
  }
  return l;
}

void validate_original_towers(const json& j, const std::string& source) {
  // img_processor: null in the released config (the SigLIP-448 sizes are
  // implied); an object gives smaller tower sizes (presets), checked by
  // vision_config_from before any weight is read.
  if (auto it = j.find("img_processor"); it != j.end() && !it->is_null() && !it->is_object())
    fail(source, "img_processor", "must be null or an object of SigLIP tower sizes");
  if (auto it = j.find("embd_layer"); it != j.end() && !it->is_null()) {
    const json& e = *it;
    expect_value(e, source + ": embd_layer", "embedding_cls", std::string("image_audio"));
    if (auto im = e.find("image_embd_layer"); im != e.end()) {
      std::string s = source + ": embd_layer.image_embd_layer";
      expect_value(*im, s, "crop_size", 448);
      expect_value(*im, s, "hd_transform_order", std::string("sub_glb"));
      expect_value(*im, s, "image_token_compression_cls", std::string("avg_pool_2d"));
      expect_value(*im, s, "projection_cls", std::string("mlp"));
      expect_value(*im, s, "use_hd_transform", true);
      expect_value(*im, s, "with_learnable_separator", true);
    }
    if (auto au = e.find("audio_embd_layer"); au != e.end()) {
      std::string s = source + ": embd_layer.audio_embd_layer";
      expect_value(*au, s, "compression_rate", 8);
      expect_value(*au, s, "downsample_rate", 1);
      expect_value(*au, s, "projection_cls", std::string("mlp"));
      expect_value(*au, s, "use_conv_downsample", false);
      expect_value(*au, s, "use_qformer", false);
    }
  }
  if (auto it = j.find("audio_processor"); it != j.end() && !it->is_null()) {
    expect_value(*it, source + ": audio_processor", "name", std::string("cascades"));
    if (auto c = it->find("config"); c != it->end()) {
      std::string s = source + ": audio_processor.config";
      expect_value(*c, s, "time_reduction", 8);
      expect_value(*c, s, "input_size", 80);
      expect_value(*c, s, "input_layer", std::string("nemo_conv"));
    }
  }
}

void validate_native_towers(const json& j, const std::string& source) {
  if (auto v = j.find("vision_config"); v != j.end() && v->is_object())
    expect_value(*v, source + ": vision_config", "crop_size", 448);
  if (auto a = j.find("audio_config"); a != j.end() && a->is_object()) {
    expect_value(*a, source + ": audio_config", "time_reduction", 8);
    expect_value(*a, source + ": audio_config", "input_size", 80);
  }
}

json read_json_file(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("{}: invalid JSON: {}", path, e.what()));
  }
}

}  // namespace

double TextConfig::rope_mscale() const {
  if (rope_attention_factor) return *rope_attention_factor;
  double scale = double(max_position_embeddings) / double(original_max_position_embeddings);
  if (scale <= 1.0) return 1.0;
  return std::sqrt(1.0 + std::log(scale) / std::log(double(original_max_position_embeddings)));
}

GenerationConfig parse_generation_config(const json& j, const std::string& source) {
  if (!j.is_object()) throw std::runtime_error(source + ": expected a JSON object");
  GenerationConfig g;
  g.bos_token_id = get_int(j, source, "bos_token_id", g.bos_token_id);
  g.pad_token_id = get_int(j, source, "pad_token_id", g.pad_token_id);
  g.eos_token_ids = get_id_list(j, source, "eos_token_id", g.eos_token_ids);
  return g;
}

Config parse_config(const json& j, const std::string& source) {
  if (!j.is_object()) throw std::runtime_error(source + ": expected a JSON object");
  Config c;
  c.raw = j;
  auto mt = j.find("model_type");
  if (mt == j.end() || !mt->is_string())
    fail(source, "model_type", "missing (expected \"phi4mm\" or \"phi4_multimodal\")");
  if (*mt == "phi4mm")
    c.layout = Layout::original;
  else if (*mt == "phi4_multimodal")
    c.layout = Layout::native;
  else
    fail(source, "model_type",
         fmt::format("unsupported {} (expected \"phi4mm\" or \"phi4_multimodal\")", mt->dump()));

  TextConfig& t = c.text;
  t.vocab_size = get_positive(j, source, "vocab_size", kMaxVocabSize);
  t.hidden_size = get_positive(j, source, "hidden_size", kMaxWidth);
  t.intermediate_size = get_positive(j, source, "intermediate_size", kMaxWidth);
  t.num_hidden_layers = get_positive(j, source, "num_hidden_layers", kMaxLayers);
  t.num_attention_heads = get_positive(j, source, "num_attention_heads", kMaxWidth);
  t.num_key_value_heads = get_positive(j, source, "num_key_value_heads", kMaxWidth, t.num_attention_heads);
  t.rms_norm_eps = get_positive_number(j, source, "rms_norm_eps", 1e-5);
  t.max_position_embeddings = get_positive(j, source, "max_position_embeddings", kMaxPositions);
  t.tie_word_embeddings = j.value("tie_word_embeddings", true);
  t.bos_token_id = get_int(j, source, "bos_token_id", 199999);
  t.pad_token_id = get_int(j, source, "pad_token_id", 199999);
  t.eos_token_ids = get_id_list(j, source, "eos_token_id", {199999});
  check_token_ids(source, t.bos_token_id, t.pad_token_id, t.eos_token_ids, t.vocab_size);
  if (auto it = j.find("hidden_act"); it != j.end() && *it != "silu")
    fail(source, "hidden_act", fmt::format("unsupported {} (only \"silu\")", it->dump()));
  if (j.contains("head_dim") && !j["head_dim"].is_null() &&
      get_int(j, source, "head_dim") != t.hidden_size / t.num_attention_heads)
    fail(source, "head_dim",
         fmt::format("{} must equal hidden_size / num_attention_heads = {} / {}", j["head_dim"].dump(),
                     t.hidden_size, t.num_attention_heads));
  if (!t.tie_word_embeddings)
    fail(source, "tie_word_embeddings", "must be true (the released model ties lm_head to embed_tokens)");
  if (t.hidden_size % t.num_attention_heads != 0)
    fail(source, "num_attention_heads",
         fmt::format("hidden_size {} is not divisible by num_attention_heads {}", t.hidden_size,
                     t.num_attention_heads));
  if (t.num_attention_heads % t.num_key_value_heads != 0)
    fail(source, "num_key_value_heads",
         fmt::format("num_attention_heads {} is not divisible by num_key_value_heads {}",
                     t.num_attention_heads, t.num_key_value_heads));

  // Rope: original layout has top-level rope_theta / partial_rotary_factor and
  // rope_scaling {type, short_factor, long_factor}; newer native configs move
  // them into rope_parameters {rope_type, rope_theta, partial_rotary_factor, ...}.
  const json empty = json::object();
  std::string rope_key = "rope_scaling";
  const json* rope = &empty;
  if (auto it = j.find("rope_parameters"); it != j.end() && it->is_object()) {
    rope = &*it;
    rope_key = "rope_parameters";
  } else if (auto it2 = j.find("rope_scaling"); it2 != j.end() && !it2->is_null()) {
    if (!it2->is_object()) fail(source, "rope_scaling", "expected an object");
    rope = &*it2;
  }
  t.rope_theta = get_positive_number(*rope, source + ": " + rope_key, "rope_theta",
                                     get_positive_number(j, source, "rope_theta", 10000.0));
  t.partial_rotary_factor = get_number(*rope, source + ": " + rope_key, "partial_rotary_factor",
                                       get_number(j, source, "partial_rotary_factor", 1.0));
  if (!(t.partial_rotary_factor > 0 && t.partial_rotary_factor <= 1))
    fail(source, "partial_rotary_factor", "must be in (0, 1]");
  if (t.rotary_dim() < 2 || t.rotary_dim() % 2 != 0)
    fail(source, "partial_rotary_factor",
         fmt::format("head_dim {} * {} gives {} rotary dims; an even number >= 2 is required",
                     t.head_dim(), t.partial_rotary_factor, t.rotary_dim()));
  t.original_max_position_embeddings = get_positive(
      *rope, source + ": " + rope_key, "original_max_position_embeddings", kMaxPositions,
      get_positive(j, source, "original_max_position_embeddings", kMaxPositions, t.max_position_embeddings));
  std::string type;
  if (rope->contains("rope_type"))
    type = (*rope)["rope_type"].is_string() ? (*rope)["rope_type"].get<std::string>() : "?";
  else if (rope->contains("type"))
    type = (*rope)["type"].is_string() ? (*rope)["type"].get<std::string>() : "?";
  else
    type = rope->empty() ? "default" : "?";
  const int64_t nfreq = t.rotary_dim() / 2;
  if (type == "longrope" || type == "su") {
    t.short_factor = get_factors(*rope, source + ": " + rope_key, "short_factor", nfreq);
    t.long_factor = get_factors(*rope, source + ": " + rope_key, "long_factor", nfreq);
    if (rope->contains("attention_factor") && !(*rope)["attention_factor"].is_null())
      t.rope_attention_factor = get_positive_number(*rope, source + ": " + rope_key, "attention_factor");
    if (rope->contains("factor") && !(*rope)["factor"].is_null())
      fail(source, rope_key + ".factor",
           "an explicit LongRoPE factor is not supported (the released model derives it from "
           "max_position_embeddings / original_max_position_embeddings)");
  } else if (type == "default") {
    // Plain RoPE: both tables are unscaled and there is no mscale.
    t.short_factor.assign(size_t(nfreq), 1.0);
    t.long_factor = t.short_factor;
    t.rope_attention_factor = 1.0;
  } else {
    fail(source, rope_key + ".type",
         fmt::format("unsupported rope scaling type \"{}\" (expected \"longrope\")", type));
  }

  if (c.layout == Layout::original) {
    c.vision_lora = parse_lora(j, source, "vision_lora");
    c.speech_lora = parse_lora(j, source, "speech_lora");
    c.user_lora = parse_user_lora(j, source);
    validate_original_towers(j, source);
  } else {
    validate_native_towers(j, source);
  }
  // The tower sizes (explicit keys, or the released ones) must make sense too.
  try {
    c.vision = vision_config_from(j, source);
  } catch (const std::exception& e) {
    throw std::runtime_error(e.what());
  }
  try {
    c.audio = audio_config_from(j);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: {}", source, e.what()));
  }
  // Defaults for generation come from config.json until generation_config.json says otherwise.
  c.generation.bos_token_id = t.bos_token_id;
  c.generation.pad_token_id = t.pad_token_id;
  return c;
}

Config load_config(const std::string& dir) {
  std::string path = dir + "/config.json";
  Config c = parse_config(read_json_file(path), path);
  std::string gpath = dir + "/generation_config.json";
  if (std::filesystem::exists(gpath)) {
    c.generation = parse_generation_config(read_json_file(gpath), gpath);
    check_token_ids(gpath, c.generation.bos_token_id, c.generation.pad_token_id, c.generation.eos_token_ids,
                    c.text.vocab_size);
  }
  const std::string ppath = dir + "/preprocessor_config.json";
  if (std::filesystem::exists(ppath)) {
    const json p = read_json_file(ppath);
    if (!p.is_object()) throw std::runtime_error(fmt::format("{}: must be a JSON object", ppath));
    if (p.contains("dynamic_hd")) c.vision.dynamic_hd = parse_dynamic_hd(p["dynamic_hd"], ppath + ": dynamic_hd");
  }
  return c;
}

int64_t parse_dynamic_hd(const json& v, const std::string& where) {
  if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > kMaxDynamicHd)
    throw std::runtime_error(fmt::format("{}: must be an integer from 1 to {} (got {})", where, kMaxDynamicHd, v.dump()));
  return v.get<int64_t>();
}

json to_original_json(const Config& c) {
  json j = c.layout == Layout::original ? c.raw : json::object();
  const TextConfig& t = c.text;
  if (c.layout == Layout::native) {
    // Keys the original layout has and the native one dropped or renamed.
    j["architectures"] = {"Phi4MMForCausalLM"};
    j["hidden_act"] = "silu";
  }
  j["model_type"] = "phi4mm";
  j["vocab_size"] = t.vocab_size;
  j["hidden_size"] = t.hidden_size;
  j["intermediate_size"] = t.intermediate_size;
  j["num_hidden_layers"] = t.num_hidden_layers;
  j["num_attention_heads"] = t.num_attention_heads;
  j["num_key_value_heads"] = t.num_key_value_heads;
  j["rms_norm_eps"] = t.rms_norm_eps;
  j["max_position_embeddings"] = t.max_position_embeddings;
  j["original_max_position_embeddings"] = t.original_max_position_embeddings;
  j["rope_theta"] = t.rope_theta;
  j["partial_rotary_factor"] = t.partial_rotary_factor;
  j["rope_scaling"] = {{"type", "longrope"}, {"short_factor", t.short_factor}, {"long_factor", t.long_factor}};
  if (t.rope_attention_factor) j["rope_scaling"]["attention_factor"] = *t.rope_attention_factor;
  j.erase("rope_parameters");
  j["tie_word_embeddings"] = t.tie_word_embeddings;
  j["bos_token_id"] = t.bos_token_id;
  j["pad_token_id"] = t.pad_token_id;
  j["eos_token_id"] = t.eos_token_ids.size() == 1 ? json(t.eos_token_ids[0]) : json(t.eos_token_ids);
  auto lora_json = [](const LoraConfig& l) {
    return json{{"dp", l.dropout}, {"layer", l.layer_regex}, {"lora_alpha", l.alpha}, {"r", l.r}};
  };
  if (c.vision_lora) j["vision_lora"] = lora_json(*c.vision_lora);
  if (c.speech_lora) j["speech_lora"] = lora_json(*c.speech_lora);
  if (c.user_lora) {
    const LoraConfig& u = *c.user_lora;
    j["user_lora"] = json{{"dp", u.dropout}, {"lora_alpha", u.alpha}, {"r", u.r}, {"target_modules", u.targets}};
  } else {
    j.erase("user_lora");
  }
  return j;
}

std::vector<std::string> parse_lora_targets(const std::string& list, const std::string& what) {
  if (list == "all") return kLoraTargets;
  std::vector<bool> on(kLoraTargets.size(), false);
  size_t a = 0;
  for (;;) {
    const size_t b = std::min(list.find(',', a), list.size());
    const std::string name = list.substr(a, b - a);
    auto it = std::find(kLoraTargets.begin(), kLoraTargets.end(), name);
    if (it == kLoraTargets.end())
      throw std::invalid_argument(fmt::format("{}: '{}' is not one of qkv_proj, o_proj, gate_up_proj, down_proj "
                                              "(or all)", what, name));
    on[size_t(it - kLoraTargets.begin())] = true;
    if (b == list.size()) break;
    a = b + 1;
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < kLoraTargets.size(); ++i)
    if (on[i]) out.push_back(kLoraTargets[i]);
  return out;
}

void check_user_lora(const LoraConfig& l, const std::string& what) {
  if (l.r < 1 || l.r > 4096) throw std::invalid_argument(fmt::format("{}: rank {} is not in [1, 4096]", what, l.r));
  if (!(l.alpha > 0) || !std::isfinite(l.alpha))
    throw std::invalid_argument(fmt::format("{}: alpha must be positive and finite, got {}", what, l.alpha));
  if (!(l.dropout >= 0 && l.dropout < 1))
    throw std::invalid_argument(fmt::format("{}: dropout must be in [0, 1), got {}", what, l.dropout));
  if (l.targets.empty()) throw std::invalid_argument(fmt::format("{}: no target modules", what));
}

json to_generation_json(const GenerationConfig& g) {
  return json{{"bos_token_id", g.bos_token_id},
              {"eos_token_id", g.eos_token_ids},
              {"pad_token_id", g.pad_token_id}};
}

}  // namespace areno::phi4mm
