#include "models/phi4mm/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

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

std::optional<PeftAdapter> open_peft(const std::string& dir, const char* adapter) {
  const std::string sub = dir + "/" + adapter + "-lora";
  const std::string cfg_path = sub + "/adapter_config.json";
  if (!fs::exists(cfg_path)) return std::nullopt;
  std::ifstream f(cfg_path);
  json j;
  try {
    j = json::parse(f);
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
  p.cfg.layer_regex = std::string(adapter) == "vision" ? kVisionLoraRegex : kSpeechLoraRegex;
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

}  // namespace

std::string LoadReport::summary() const {
  return fmt::format("{} of {} tensors consumed, {} missing, 0 unexpected ({} skipped)", consumed, expected,
                     expected - consumed, skipped);
}

std::vector<std::string> load_prefixed(Module& m, const SafetensorsCheckpoint& ckpt, const std::string& prefix,
                                       const std::string& source) {
  auto params = m.named_parameters();
  std::vector<std::string> names, missing, bad_shape;
  for (auto& [name, t] : params) {
    const std::string stored = prefix + name;
    if (!ckpt.contains(stored)) {
      missing.push_back(stored);
      continue;
    }
    const auto& e = ckpt.entry(stored);
    if (e.shape != t.shape())
      bad_shape.push_back(fmt::format("{} (stored {}, expected {})", stored, shape_str(e.shape), shape_str(t.shape())));
    names.push_back(stored);
  }
  if (!missing.empty() || !bad_shape.empty()) {
    std::string msg = fmt::format("{}: {} of {} tensors under '{}' missing, {} with a wrong shape", source,
                                  missing.size(), params.size(), prefix, bad_shape.size());
    for (size_t i = 0; i < missing.size() && i < 10; ++i) msg += "\n  missing " + missing[i];
    for (size_t i = 0; i < bad_shape.size() && i < 10; ++i) msg += "\n  wrong shape " + bad_shape[i];
    throw std::runtime_error(msg);
  }
  NoGradGuard ng;
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].second.copy_(ckpt.load(names[i]));
    ckpt.file_of(names[i]).release_pages(names[i]);
  }
  return names;
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
  // 1. Config first: every unsupported field fails before a weight is touched.
  Config cfg = load_config(dir);
  // 2. Map the shards (headers only).
  SafetensorsCheckpoint ckpt(dir);
  std::optional<PeftAdapter> peft[3];
  if (opts.with_lora) {
    peft[int(Adapter::vision)] = open_peft(dir, "vision");
    peft[int(Adapter::speech)] = open_peft(dir, "speech");
    if (peft[1] && !cfg.vision_lora) cfg.vision_lora = peft[1]->cfg;
    if (peft[2] && !cfg.speech_lora) cfg.speech_lora = peft[2]->cfg;
  }
  if (!ckpt.contains("model.embed_tokens.weight"))
    throw std::runtime_error(fmt::format("{}: no tensor model.embed_tokens.weight (is this a Phi-4-multimodal "
                                         "checkpoint?)", dir));
  const DType dtype = opts.dtype.value_or(ckpt.entry("model.embed_tokens.weight").dtype);
  auto model = std::make_shared<Phi4MMForCausalLM>(cfg, TensorOptions(dtype), opts.with_lora);

  // 3. Name walk: find each parameter's source, check every shape before copying.
  struct Source {
    const SafetensorsFile* file = nullptr;
    std::string name;
  };
  std::vector<std::pair<std::string, Tensor>> params = model->named_parameters();
  std::vector<Source> sources(params.size());
  std::set<std::string> used;
  std::vector<std::string> missing, bad_shape;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].first;
    std::vector<std::string> candidates{name};
    if (name.find(".base_layer.weight") != std::string::npos)
      candidates.push_back(replace_once(name, ".base_layer.weight", ".weight"));  // native layout
    const SafetensorsEntry* e = nullptr;
    for (auto& c : candidates)
      if (ckpt.contains(c)) {
        e = &ckpt.entry(c);
        sources[i] = {&ckpt.file_of(c), c};
        used.insert(c);
        break;
      }
    if (!e)
      for (Adapter a : {Adapter::vision, Adapter::speech}) {
        auto& p = peft[int(a)];
        if (!p) continue;
        auto it = p->names.find(name);
        if (it == p->names.end()) continue;
        e = &p->file->entry(it->second);
        sources[i] = {p->file.get(), it->second};
        break;
      }
    if (!e) {
      missing.push_back(name);
      continue;
    }
    if (e->shape != params[i].second.shape())
      bad_shape.push_back(fmt::format("{} (stored {} as {}, expected {})", name, shape_str(e->shape),
                                      sources[i].name, shape_str(params[i].second.shape())));
  }
  std::vector<std::string> unexpected;
  int64_t skipped = 0;
  for (const auto& n : ckpt.names()) {
    if (used.count(n)) continue;
    // Towers are read by their own loaders; a tied lm_head copy is redundant.
    if (starts_with(n, "model.embed_tokens_extend.") || n == "lm_head.weight" ||
        (!opts.with_lora && n.find(".lora_") != std::string::npos)) {
      ++skipped;
      continue;
    }
    unexpected.push_back(n);
  }
  if (!missing.empty() || !unexpected.empty() || !bad_shape.empty()) {
    auto list = [](const std::vector<std::string>& v) {
      std::string s;
      for (size_t i = 0; i < v.size() && i < 10; ++i) s += "\n  " + v[i];
      if (v.size() > 10) s += fmt::format("\n  ... and {} more", v.size() - 10);
      return s;
    };
    std::string msg = fmt::format("{}: checkpoint does not match the model: {} of {} tensors found, {} missing, "
                                  "{} unexpected, {} with a wrong shape",
                                  dir, params.size() - missing.size(), params.size(), missing.size(),
                                  unexpected.size(), bad_shape.size());
    if (!missing.empty()) msg += "\nmissing:" + list(missing);
    if (!unexpected.empty()) msg += "\nunexpected:" + list(unexpected);
    if (!bad_shape.empty()) msg += "\nwrong shape:" + list(bad_shape);
    throw std::runtime_error(msg);
  }
  {
    NoGradGuard ng;
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].second.copy_(sources[i].file->load(sources[i].name));
      sources[i].file->release_pages(sources[i].name);  // peak memory: the copies, not copies + file
    }
  }
  model->eval();
  if (opts.device != Device::cpu()) model->to(opts.device);
  if (report) {
    report->expected = int64_t(params.size());
    report->consumed = int64_t(params.size());
    report->skipped = skipped;
  }
  return model;
}

void save_model(const Phi4MMForCausalLM& model, const std::string& dir, const SaveOptions& opts,
                const std::vector<std::pair<std::string, Tensor>>& extra) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot create {}: {}", dir, ec.message()));
  std::vector<std::pair<std::string, Tensor>> tensors;
  const DType dtype = opts.dtype.value_or(model.dtype());
  for (auto& [name, t] : model.named_parameters())
    tensors.emplace_back(name, t.dtype() == dtype ? t.detach() : t.detach().to(dtype));
  tensors.insert(tensors.end(), extra.begin(), extra.end());
  save_safetensors_sharded(dir, tensors, opts.max_shard_bytes, {{"format", "pt"}});
  Config c = model.config();
  json j = to_original_json(c);
  j["torch_dtype"] = dtype == DType::bf16 ? "bfloat16" : dtype == DType::f16 ? "float16" : "float32";
  std::ofstream(dir + "/config.json") << j.dump(2) << "\n";
  std::ofstream(dir + "/generation_config.json") << to_generation_json(c.generation).dump(2) << "\n";
  if (!fs::exists(dir + "/config.json")) throw std::runtime_error("cannot write " + dir + "/config.json");
}

}  // namespace areno::phi4mm
