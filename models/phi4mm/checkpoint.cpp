#include "models/phi4mm/checkpoint.h"

#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "models/phi4mm/audio/audio_config.h"
#include "models/phi4mm/vision/vision_config.h"
#include "nn/io/atomic_file.h"
#include "nn/io/files.h"
#include "nn/io/finite.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"

namespace areno::phi4mm {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// Replaces the first `from` in `s` by `to`; returns s unchanged when absent.
std::string replace_once(std::string s, const std::string& from, const std::string& to) {
  auto pos = s.find(from);
  if (pos != std::string::npos) s.replace(pos, from.size(), to);
  return s;
}

// A PEFT adapter folder (spec 3.4 b/c): adapter_config.json + adapter_model.safetensors.
struct PeftAdapter {
  LoraConfig cfg;
  std::unique_ptr<SafetensorsFile> file;
  std::map<std::string, std::string> names;  // our name (".lora_A.vision.weight") -> stored name
};

// The adapter of the PEFT folder `sub` as adapter `adapter` (vision, speech, user).
PeftAdapter read_peft(const std::string& sub, const char* adapter);

std::optional<PeftAdapter> open_peft(const std::string& dir, const char* adapter) {
  const std::string sub = dir + "/" + adapter + "-lora";
  if (!fs::exists(sub + "/adapter_config.json")) return std::nullopt;
  return read_peft(sub, adapter);
}

// A PEFT folder given as the user adapter (LoadOptions::lora_dir): only what
// the user adapter computes is accepted, refused by key before any weight is
// read; the targets are the modules its tensors wrap, in every layer.
PeftAdapter open_user_peft(const std::string& sub, int64_t layers) {
  const std::string cfg_path = sub + "/adapter_config.json";
  if (!fs::exists(cfg_path))
    throw std::runtime_error(fmt::format("{}: no adapter_config.json (a PEFT LoRA adapter folder is expected)", sub));
  json j;
  try {
    j = json::parse(read_file(cfg_path));
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("{}: invalid JSON: {}", cfg_path, e.what()));
  }
  if (!j.is_object()) throw std::runtime_error(cfg_path + ": expected an object");
  auto refuse = [&](const std::string& key, const std::string& why) {
    throw std::runtime_error(fmt::format("{}: key '{}': {}", cfg_path, key, why));
  };
  if (j.value("peft_type", std::string("LORA")) != "LORA") refuse("peft_type", "only LORA adapters are supported");
  if (j.contains("bias") && j["bias"] != "none") refuse("bias", "LoRA biases are not supported (\"none\" only)");
  for (const char* flag : {"fan_in_fan_out", "lora_bias", "use_qalora"})
    if (j.contains(flag) && j[flag].is_boolean() && j[flag].get<bool>()) refuse(flag, "not supported");
  for (const char* key : {"modules_to_save", "layers_to_transform", "layer_replication", "trainable_token_indices"})
    if (j.contains(key) && !j[key].is_null() && !j[key].empty())
      refuse(key, "not supported (the user adapter wraps the decoder's linears of every layer, nothing else)");
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (j.contains(key) && !j[key].is_null() && !j[key].empty()) refuse(key, "per-module ranks or alphas are not supported");
  PeftAdapter p = read_peft(sub, "user");
  // The targets, from the tensors: <module>.lora_A / lora_B in every layer.
  std::vector<std::set<std::string>> per_layer(static_cast<size_t>(layers));
  for (const auto& [ours, stored] : p.names) {
    const std::string prefix = "model.layers.";
    size_t dot = std::string::npos;
    int64_t layer = -1;
    std::string module;
    if (ours.rfind(prefix, 0) == 0 && (dot = ours.find('.', prefix.size())) != std::string::npos) {
      try {
        layer = std::stoll(ours.substr(prefix.size(), dot - prefix.size()));
      } catch (const std::exception&) {
      }
      const std::string rest = ours.substr(dot + 1);
      for (const char* m : {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"})
        for (const char* ab : {".lora_A.user.weight", ".lora_B.user.weight"})
          if (rest == std::string(m) + ab) module = std::string(m).substr(std::string(m).find('.') + 1);
    }
    if (layer < 0 || layer >= layers || module.empty())
      throw std::runtime_error(fmt::format("{}/adapter_model.safetensors: tensor '{}' is not a LoRA weight of a decoder "
                                           "layer's qkv_proj, o_proj, gate_up_proj or down_proj (of {} layers)",
                                           sub, stored, layers));
    per_layer[size_t(layer)].insert(module);
  }
  for (const std::string& m : kLoraTargets)
    if (per_layer[0].count(m)) p.cfg.targets.push_back(m);
  if (p.cfg.targets.empty()) throw std::runtime_error(fmt::format("{}/adapter_model.safetensors: no LoRA weights", sub));
  for (int64_t l = 1; l < layers; ++l)
    if (per_layer[size_t(l)] != per_layer[0])
      throw std::runtime_error(fmt::format("{}: layer {} wraps other modules than layer 0; the user adapter wraps the "
                                           "same modules in every layer", sub, l));
  p.cfg.layer_regex.clear();
  check_user_lora(p.cfg, cfg_path);
  return p;
}

PeftAdapter read_peft(const std::string& sub, const char* adapter) {
  const std::string cfg_path = sub + "/adapter_config.json";
  json j;
  try {
    j = json::parse(read_file(cfg_path));
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("{}: invalid JSON: {}", cfg_path, e.what()));
  }
  PeftAdapter p;
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() <= 0)
    throw std::runtime_error(cfg_path + ": key 'r' must be a positive integer");
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number())
    throw std::runtime_error(cfg_path + ": key 'lora_alpha' must be a number");
  if (j.value("use_dora", false) || j.value("use_rslora", false))
    throw std::runtime_error(cfg_path + ": DoRA / rsLoRA adapters are not supported");
  p.cfg.r = j["r"].get<int64_t>();
  p.cfg.alpha = j["lora_alpha"].get<double>();
  p.cfg.dropout = j.value("lora_dropout", 0.0);
  p.cfg.layer_regex = std::string(adapter) == "vision" ? kVisionLoraRegex : std::string(adapter) == "speech" ? kSpeechLoraRegex : "";
  p.file = std::make_unique<SafetensorsFile>(sub + "/adapter_model.safetensors");
  for (const auto& stored : p.file->names()) {
    std::string n = stored;
    if (starts_with(n, "base_model.model.")) n = n.substr(17);
    // lora_A.weight or lora_A.<adapter>.weight -> lora_A.<adapter>.weight
    for (const char* ab : {".lora_A.", ".lora_B."}) {
      std::string plain = std::string(ab) + "weight";
      std::string named = std::string(ab) + adapter + ".weight";
      if (n.size() > plain.size() && n.compare(n.size() - plain.size(), plain.size(), plain) == 0)
        n = n.substr(0, n.size() - plain.size()) + named;
    }
    p.names[n] = stored;
  }
  return p;
}

// Where one parameter's weights are stored.
struct Source {
  const SafetensorsFile* file = nullptr;
  std::string name;
};

// The one place that maps a parameter name to its stored tensor (see checkpoint.h).
class WeightResolver {
 public:
  WeightResolver(const SafetensorsCheckpoint& ckpt, const std::optional<PeftAdapter>* peft,
                 const std::optional<PeftAdapter>& user)
      : ckpt_(ckpt), peft_(peft), user_(user) {}

  std::optional<Source> find(const std::string& name) const {
    if (ckpt_.contains(name)) return Source{&ckpt_.file_of(name), name};
    if (name.find(".base_layer.weight") != std::string::npos) {  // native layout
      const std::string native = replace_once(name, ".base_layer.weight", ".weight");
      if (ckpt_.contains(native)) return Source{&ckpt_.file_of(native), native};
    }
    for (Adapter a : {Adapter::vision, Adapter::speech}) {
      const std::optional<PeftAdapter>& p = peft_[int(a)];
      if (!p) continue;
      if (auto it = p->names.find(name); it != p->names.end()) return Source{p->file.get(), it->second};
    }
    if (user_)
      if (auto it = user_->names.find(name); it != user_->names.end()) return Source{user_->file.get(), it->second};
    return std::nullopt;
  }

 private:
  const SafetensorsCheckpoint& ckpt_;
  const std::optional<PeftAdapter>* peft_;
  const std::optional<PeftAdapter>& user_;
};

std::string list_lines(const char* what, const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < 10; ++i) s += fmt::format("\n  {} {}", what, v[i]);
  if (v.size() > 10) s += fmt::format("\n  ... and {} more {}", v.size() - 10, what);
  return s;
}

// The stored tensors no parameter resolved to that are an error (given the
// names that were resolved); null: none are.
using UnexpectedOf = std::function<std::vector<std::string>(const std::set<std::string>& used)>;

// Takes parameter i's stored tensor instead of the copy (int8 quantization):
// true when it did. `where` names the file and the stored tensor for errors.
using TakeStored = std::function<bool(size_t i, const Tensor& stored, const std::string& where)>;

// The name walk: resolves every parameter once, checks presence and shape
// (and the stored tensors left over) before copying anything, then copies,
// converting to each parameter's dtype (or hands the stored tensor to `take`);
// with `check_weights`, a copied parameter holding NaN or inf fails naming
// the file and the stored tensor.
void walk(std::vector<std::pair<std::string, Tensor>>& params,
          const std::function<std::optional<Source>(const std::string&)>& find, const std::string& source,
          const UnexpectedOf& unexpected_of = nullptr, bool check_weights = false,
          const TakeStored& take = nullptr) {
  std::vector<Source> sources(params.size());
  std::vector<std::string> missing, bad_shape;
  std::set<std::string> used;
  for (size_t i = 0; i < params.size(); ++i) {
    auto src = find(params[i].first);
    if (!src) {
      missing.push_back(params[i].first);
      continue;
    }
    sources[i] = *src;
    used.insert(src->name);
    const SafetensorsEntry& e = src->file->entry(src->name);
    if (e.shape != params[i].second.shape())
      bad_shape.push_back(fmt::format("{} (stored {} as {}, expected {})", params[i].first, shape_str(e.shape),
                                      src->name, shape_str(params[i].second.shape())));
  }
  const std::vector<std::string> unexpected = unexpected_of ? unexpected_of(used) : std::vector<std::string>();
  if (!missing.empty() || !unexpected.empty() || !bad_shape.empty())
    throw std::runtime_error(fmt::format("{}: checkpoint does not match the model: {} of {} tensors found, "
                                         "{} missing, {} unexpected, {} with a wrong shape",
                                         source, params.size() - missing.size(), params.size(), missing.size(),
                                         unexpected.size(), bad_shape.size()) +
                             list_lines("missing", missing) + list_lines("unexpected", unexpected) +
                             list_lines("wrong shape", bad_shape));
  NoGradGuard ng;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor stored = sources[i].file->load(sources[i].name);
    if (take && take(i, stored, fmt::format("{}: {}", sources[i].file->path(), sources[i].name))) {
      sources[i].file->release_pages(sources[i].name);
      continue;
    }
    params[i].second.copy_(stored);
    sources[i].file->release_pages(sources[i].name);  // peak memory: the copies, not copies + file
    // After the copy, so that a value the conversion to the model's dtype overflows is caught too.
    if (check_weights) check_finite(params[i].second, sources[i].file->path(), sources[i].name);
  }
}

bool has_prefix(const SafetensorsCheckpoint& ckpt, const std::string& prefix) {
  for (const auto& n : ckpt.names())
    if (starts_with(n, prefix)) return true;
  return false;
}

}  // namespace

std::string LoadReport::summary() const {
  return fmt::format("{} of {} tensors consumed, {} missing, 0 unexpected ({} skipped)", consumed, expected,
                     expected - consumed, skipped) +
         (quantized > 0 ? fmt::format(", {} quantized to int8", quantized) : std::string());
}

void load_prefixed(Module& m, const SafetensorsCheckpoint& ckpt, const std::string& prefix,
                   const std::string& source) {
  std::vector<std::pair<std::string, Tensor>> params;
  for (auto& [name, t] : m.named_parameters()) params.emplace_back(prefix + name, t);
  walk(params, [&](const std::string& n) -> std::optional<Source> {
    if (!ckpt.contains(n)) return std::nullopt;
    return Source{&ckpt.file_of(n), n};
  }, source);
}

std::vector<std::pair<std::string, Tensor>> prefixed_tensors(const Module& m, const std::string& prefix,
                                                             DType dtype) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, t] : m.named_parameters())
    out.emplace_back(prefix + name, t.dtype() == dtype ? t.detach() : t.detach().to(dtype));
  return out;
}

std::shared_ptr<Phi4MMForCausalLM> load_model(const std::string& dir, const LoadOptions& opts,
                                              LoadReport* report) {
  // 1. Config first (read once, towers included): every unsupported field
  //    fails before a weight is touched.
  Config cfg = load_config(dir);
  // 2. Map the shards (headers only, each opened once) and the PEFT folders.
  SafetensorsCheckpoint ckpt(dir);
  std::optional<PeftAdapter> peft[3];
  if (opts.with_lora) {
    peft[int(Adapter::vision)] = open_peft(dir, "vision");
    peft[int(Adapter::speech)] = open_peft(dir, "speech");
    if (peft[1] && !cfg.vision_lora) cfg.vision_lora = peft[1]->cfg;
    if (peft[2] && !cfg.speech_lora) cfg.speech_lora = peft[2]->cfg;
  }
  std::optional<PeftAdapter> user;
  if (!opts.lora_dir.empty()) {
    if (cfg.user_lora)
      throw std::runtime_error(fmt::format("--lora {}: {} holds a user LoRA already (config.json \"user_lora\"); "
                                           "fold it into the base weights first (areno merge-lora)",
                                           opts.lora_dir, dir));
    user = open_user_peft(opts.lora_dir, cfg.text.num_hidden_layers);
    cfg.user_lora = user->cfg;
  }
  if (!ckpt.contains("model.embed_tokens.weight"))
    throw std::runtime_error(fmt::format("{}: no tensor model.embed_tokens.weight (is this a Phi-4-multimodal "
                                         "checkpoint?)", dir));
  // The config's sizes against the stored embedding before anything is
  // allocated: a config.json that does not describe these weights (a vocab_size
  // of 2^40) fails here by name, not in the allocator.
  const Shape embed = ckpt.entry("model.embed_tokens.weight").shape;
  if (embed != Shape{cfg.text.vocab_size, cfg.text.hidden_size})
    throw std::runtime_error(fmt::format("{}/config.json: vocab_size {} and hidden_size {} do not match the stored "
                                         "model.embed_tokens.weight {}",
                                         dir, cfg.text.vocab_size, cfg.text.hidden_size, shape_str(embed)));
  const DType dtype = opts.dtype.value_or(ckpt.entry("model.embed_tokens.weight").dtype);
  if (opts.quantize == Quantize::int8) {
    if (!opts.device.is_cpu())
      throw std::invalid_argument(fmt::format("--quantize int8 runs on the CPU only for now (asked for {}); drop "
                                              "--quantize or load to the CPU", opts.device.str()));
    if (dtype != DType::f32 && dtype != DType::bf16)
      throw std::invalid_argument(fmt::format("--quantize int8 needs f32 or bf16 compute, not {} (pass --dtype)",
                                              dtype_name(dtype)));
  }
  ModelParts parts;
  parts.lora = opts.with_lora;
  parts.vision = opts.vision && has_prefix(ckpt, kImageEmbedPrefix);
  parts.audio = opts.audio && has_prefix(ckpt, kAudioEmbedPrefix);
  auto model = std::make_shared<Phi4MMForCausalLM>(cfg, TensorOptions(dtype), parts);

  // 3. One name walk over every part; stored tensors of parts not built are
  //    skipped unread, a tied lm_head copy is redundant, anything else is unexpected.
  const WeightResolver resolver(ckpt, peft, user);
  std::vector<std::pair<std::string, Tensor>> params = model->named_parameters();
  // int8: each quantizable weight is quantized from its stored values as it
  // is read; its full-precision parameter is never filled.
  std::map<std::string, Weight*> to_quantize;
  if (opts.quantize == Quantize::int8)
    for (auto& [name, w] : model->quantizable_weights()) to_quantize[name + ".weight"] = w;
  int64_t quantized = 0;
  const TakeStored take = [&](size_t i, const Tensor& stored, const std::string& where) {
    auto it = to_quantize.find(params[i].first);
    if (it == to_quantize.end()) return false;
    try {
      it->second->set_int8(quantize_int8(stored, dtype));
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(fmt::format("{}: {}", where, e.what()));
    }
    ++quantized;
    return true;
  };
  int64_t skipped = 0;
  walk(params, [&](const std::string& n) { return resolver.find(n); }, dir, [&](const std::set<std::string>& used) {
    std::vector<std::string> unexpected;
    for (const auto& n : ckpt.names()) {
      if (used.count(n)) continue;
      if ((!parts.vision && starts_with(n, kImageEmbedPrefix)) ||
          (!parts.audio && starts_with(n, kAudioEmbedPrefix)) || n == "lm_head.weight" ||
          (!opts.with_lora && n.find(".lora_") != std::string::npos && !is_user_lora_param(n))) {
        ++skipped;
        continue;
      }
      unexpected.push_back(n);
    }
    return unexpected;
  }, opts.check_weights, take);
  model->eval();
  if (opts.device != Device::cpu()) model->to(opts.device);
  if (report) {
    report->expected = int64_t(params.size());
    report->consumed = int64_t(params.size());
    report->skipped = skipped;
    report->quantized = quantized;
  }
  return model;
}

void load_user_lora(Phi4MMForCausalLM& m, const std::string& dir) {
  if (m.config().user_lora)
    throw std::runtime_error(fmt::format("--lora {}: the model holds a user LoRA already", dir));
  const PeftAdapter p = open_user_peft(dir, m.config().text.num_hidden_layers);
  m.add_user_lora(p.cfg, 0);
  std::vector<std::pair<std::string, Tensor>> params;
  for (auto& [name, t] : m.named_parameters())
    if (is_user_lora_param(name)) params.emplace_back(name, t);
  walk(params, [&](const std::string& n) -> std::optional<Source> {
    auto it = p.names.find(n);
    if (it == p.names.end()) return std::nullopt;
    return Source{p.file.get(), it->second};
  }, dir);
}

LoraConfig peft_lora_config(const std::string& dir, int64_t layers) { return open_user_peft(dir, layers).cfg; }

int32_t load_served_lora(Phi4MMForCausalLM& m, const std::string& name, const std::string& dir,
                         const std::string& source) {
  const PeftAdapter p = open_user_peft(dir, m.config().text.num_hidden_layers);
  return m.add_served_lora(name, source.empty() ? dir : source, p.cfg, [&](std::vector<std::pair<std::string, Tensor>>& params) {
    walk(params, [&](const std::string& n) -> std::optional<Source> {
      // "<module>.lora_A.weight" is "<module>.lora_A.user.weight" in the folder's names (read_peft).
      auto it = p.names.find(n.substr(0, n.size() - std::string(".weight").size()) + ".user.weight");
      if (it == p.names.end()) return std::nullopt;
      return Source{p.file.get(), it->second};
    }, dir);
  });
}

void save_user_lora_peft(const Phi4MMForCausalLM& m, const std::string& dir) {
  const std::optional<LoraConfig>& u = m.config().user_lora;
  if (!u) throw std::invalid_argument("the model has no user LoRA (config.json \"user_lora\")");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot create {}: {}", dir, ec.message()));
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (auto& [name, t] : m.named_parameters()) {
    if (!is_user_lora_param(name)) continue;
    const size_t at = name.find(".user.");
    tensors.emplace_back("base_model.model." + name.substr(0, at) + "." + name.substr(at + 6), t.detach());
  }
  // A regex over the decoder's layers: the towers have linears of these names too.
  std::string modules;
  for (const std::string& t : u->targets)
    modules += (modules.empty() ? "" : "|") + std::string(t == "qkv_proj" || t == "o_proj" ? "self_attn\\." : "mlp\\.") + t;
  const json cfg = {{"peft_type", "LORA"},        {"r", u->r},
                    {"lora_alpha", u->alpha},     {"lora_dropout", u->dropout},
                    {"target_modules", "model\\.layers\\.\\d+\\.(" + modules + ")"},
                    {"bias", "none"},             {"fan_in_fan_out", false},
                    {"use_dora", false},          {"use_rslora", false},
                    {"modules_to_save", nullptr}, {"layers_to_transform", nullptr},
                    {"init_lora_weights", true},  {"inference_mode", true},
                    {"task_type", nullptr},       {"base_model_name_or_path", nullptr}};
  FileSet files;
  const std::vector<std::string> written = stage_safetensors_sharded(
      files, dir, tensors, std::numeric_limits<uint64_t>::max(), {{"format", "pt"}}, "adapter_model");
  files.add(dir + "/adapter_config.json").write(cfg.dump(2) + "\n");
  files.commit();
  remove_stale_shards(dir, written, "adapter_model");
}

void save_model(const Phi4MMForCausalLM& model, const std::string& dir, const SaveOptions& opts) {
  if (model.is_quantized())
    throw std::invalid_argument(fmt::format("cannot save {}: the model holds int8 weights (--quantize int8); save "
                                            "an unquantized model", dir));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot create {}: {}", dir, ec.message()));
  std::vector<std::pair<std::string, Tensor>> tensors;
  const DType dtype = opts.dtype.value_or(model.dtype());
  Config c = model.config();
  const bool merge = opts.merge_user_lora && c.user_lora;
  const std::map<std::string, Tensor> params = [&] {
    std::map<std::string, Tensor> out;
    if (merge)
      for (auto& [name, t] : model.named_parameters()) out[name] = t.detach();
    return out;
  }();
  for (auto& [name, t] : model.named_parameters()) {
    Tensor v = t.detach();
    if (merge) {
      if (is_user_lora_param(name)) continue;
      const std::string suffix = ".base_layer.weight";
      if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
        const std::string m = name.substr(0, name.size() - suffix.size());
        auto a = params.find(m + ".lora_A.user.weight"), b = params.find(m + ".lora_B.user.weight");
        if (a != params.end() && b != params.end()) {
          NoGradGuard ng;
          const Tensor delta = mul(matmul(b->second.to(DType::f32), a->second.to(DType::f32)), c.user_lora->scaling());
          v = add(v.to(DType::f32), delta.to(v.device()));
        }
      }
    }
    tensors.emplace_back(name, v.dtype() == dtype ? v : v.to(dtype));
  }
  if (merge) c.user_lora.reset();
  json j = to_original_json(c);
  j["torch_dtype"] = dtype == DType::bf16 ? "bfloat16" : dtype == DType::f16 ? "float16" : "float32";
  // Every file is written and synced before the first rename: a failure
  // (disk full) leaves the folder's previous checkpoint loadable.
  FileSet files;
  const std::vector<std::string> written =
      stage_safetensors_sharded(files, dir, tensors, opts.max_shard_bytes, {{"format", "pt"}});
  files.add(dir + "/config.json").write(j.dump(2) + "\n");
  files.add(dir + "/generation_config.json").write(to_generation_json(c.generation).dump(2) + "\n");
  files.commit();
  // Then the files of an older layout go: stale shards and index, and PEFT
  // adapter folders (the loader would otherwise add their adapters).
  remove_stale_shards(dir, written);
  for (const char* adapter : {"vision-lora", "speech-lora"}) {
    const fs::path sub = fs::path(dir) / adapter;
    for (const char* f : {"adapter_config.json", "adapter_model.safetensors"}) {
      fs::remove(sub / f, ec);
      if (ec) throw std::runtime_error(fmt::format("cannot remove the stale {}: {}", (sub / f).string(), ec.message()));
    }
    if (fs::is_directory(sub, ec) && fs::is_empty(sub, ec)) fs::remove(sub, ec);
  }
}

void copy_side_files(const fs::path& from, const fs::path& to) {
  if (from.empty() || !fs::is_directory(from)) return;
  for (const auto& entry : fs::directory_iterator(from)) {
    if (!entry.is_regular_file()) continue;
    const std::string f = entry.path().filename().string();
    if (f == "config.json" || f == "generation_config.json" || f == "model.safetensors.index.json" ||
        f == "trainer_state.json" || f == "latest" || entry.path().extension() == ".safetensors" ||
        f.find(".tmp-") != std::string::npos)
      continue;
    write_file_atomic((to / f).string(), read_file(entry.path().string()));
  }
}

}  // namespace areno::phi4mm
