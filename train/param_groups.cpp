#include "train/param_groups.h"

#include <stdexcept>

#include <fmt/format.h>

namespace areno::train {

namespace {

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
bool contains(const std::string& s, const std::string& p) { return s.find(p) != std::string::npos; }

const std::string kExtend = "model.embed_tokens_extend.";

}  // namespace

const char* group_name(Group g) {
  switch (g) {
    case Group::lm: return "lm";
    case Group::projector: return "projector";
    case Group::tower: return "tower";
  }
  return "?";
}

Group group_of(const std::string& name) {
  if (!starts_with(name, kExtend)) return Group::lm;
  const std::string rest = name.substr(kExtend.size());
  if (starts_with(rest, "image_embed.img_processor.") || starts_with(rest, "audio_embed.encoder."))
    return Group::tower;
  if (starts_with(rest, "image_embed.img_projection.") || rest == "image_embed.glb_GN" ||
      rest == "image_embed.sub_GN" || starts_with(rest, "audio_embed.audio_projection."))
    return Group::projector;
  throw std::invalid_argument(fmt::format("parameter '{}' belongs to no training group (lm, projector, tower)", name));
}

bool is_lora(const std::string& name) { return contains(name, ".lora_A.") || contains(name, ".lora_B."); }

bool is_user_lora(const std::string& name) { return phi4mm::is_user_lora_param(name); }

LmTrainable lm_trainable_from_name(const std::string& name) {
  if (name == "all") return LmTrainable::all;
  if (name == "lora") return LmTrainable::lora;
  if (name == "user") return LmTrainable::user;
  if (name == "none") return LmTrainable::none;
  throw std::invalid_argument(fmt::format("--lm-trainable: '{}' is not all, lora, user or none", name));
}

const char* lm_trainable_name(LmTrainable l) {
  switch (l) {
    case LmTrainable::all: return "all";
    case LmTrainable::lora: return "lora";
    case LmTrainable::user: return "user";
    case LmTrainable::none: return "none";
  }
  return "?";
}

EmbedRows embed_rows_from_name(const std::string& name) {
  if (name == "all") return EmbedRows::all;
  if (name == "data") return EmbedRows::data;
  if (name == "none") return EmbedRows::none;
  throw std::invalid_argument(fmt::format("--embed-rows: '{}' is not all, data or none", name));
}

const char* embed_rows_name(EmbedRows e) {
  switch (e) {
    case EmbedRows::all: return "all";
    case EmbedRows::data: return "data";
    case EmbedRows::none: return "none";
  }
  return "?";
}

bool trains(const std::string& name, const GroupOptions& o) {
  switch (group_of(name)) {
    case Group::lm:
      if (o.embed_rows == EmbedRows::none && starts_with(name, "model.embed_tokens.")) return false;
      return o.lm == LmTrainable::all || (o.lm == LmTrainable::lora && is_lora(name)) ||
             (o.lm == LmTrainable::user && is_user_lora(name));
    case Group::projector: return o.projector;
    case Group::tower: return o.tower;
  }
  return false;
}

int64_t apply_trainable(phi4mm::Phi4MMForCausalLM& model, const GroupOptions& o) {
  if (model.is_quantized())
    throw std::invalid_argument("training needs an unquantized model: this one holds int8 weights (--quantize "
                                "int8 is for inference; load the checkpoint without it)");
  int64_t n = 0;
  for (auto& [name, p] : model.named_parameters()) {
    // The audio CMVN statistics are stored as parameters but never trained.
    const bool on = !contains(name, ".encoder_embedding.global_") && trains(name, o);
    p.set_requires_grad(on);
    p.zero_grad();
    n += on;
  }
  if (n == 0)
    throw std::invalid_argument(
        fmt::format("nothing to train: --lm-trainable {} with the projector and tower frozen (or a model without "
                    "the parts asked for{})",
                    lm_trainable_name(o.lm), o.lm == LmTrainable::user ? ": a user LoRA comes with --lora-rank" : ""));
  // Training mode exactly where parameters train: a module whose subtree
  // holds a trainable parameter. named_modules lists parents first, and
  // train() recurses, so each child is set after its parent.
  for (auto& [name, m] : model.named_modules()) {
    bool any = false;
    for (auto& [pn, p] : m->named_parameters())
      if (p.requires_grad()) {
        any = true;
        break;
      }
    m->train(any);
  }
  return n;
}

bool decays(const Tensor& param) {
  int64_t big = 0;
  for (int64_t d : param.shape()) big += d > 1;
  return big >= 2;
}

std::vector<ParamGroup> make_param_groups(const Module& model, const GroupHyper& h) {
  ParamGroup g[3][2];  // [group][decays]
  for (auto& [name, p] : model.named_parameters()) {
    if (!p.requires_grad()) continue;
    const int k = int(group_of(name));
    const int d = decays(p) ? 1 : 0;
    g[k][d].params.push_back(p);
    g[k][d].names.push_back(name);
  }
  std::vector<ParamGroup> out;
  for (Group grp : kGroups) {
    for (int d : {1, 0}) {
      ParamGroup& pg = g[int(grp)][d];
      if (pg.params.empty()) continue;
      pg.name = std::string(group_name(grp)) + (d ? "" : ".no_decay");
      pg.lr = h.lr[int(grp)];
      pg.weight_decay = d ? h.weight_decay : 0.0;
      pg.schedule = h.schedule;
      out.push_back(std::move(pg));
    }
  }
  return out;
}

Group group_of_param_group(const ParamGroup& g) {
  for (Group grp : kGroups)
    if (g.name == group_name(grp) || g.name == std::string(group_name(grp)) + ".no_decay") return grp;
  throw std::invalid_argument(fmt::format("'{}' is not a trainer parameter group", g.name));
}

}  // namespace areno::train
