#pragma once
// Parameter groups of the trainer (issue 14, "Loop"): every parameter of the
// model belongs to one of three groups, by checkpoint name:
//   lm         the decoder: model.embed_tokens, model.layers.*, model.norm,
//              the vision, speech and user LoRA branches (…lora_A.* / …lora_B.*)
//   projector  model.embed_tokens_extend.image_embed.img_projection.*,
//              …image_embed.glb_GN / sub_GN, …audio_embed.audio_projection.*
//              (speech and vision heads)
//   tower      model.embed_tokens_extend.image_embed.img_processor.* (SigLIP),
//              model.embed_tokens_extend.audio_embed.encoder.* (Conformer)
// Each group has its own learning rate; the towers and projectors are frozen
// by default, and `--lm-trainable all|lora|user|none` picks what of the decoder
// trains. A frozen parameter does not require grad (it gets no gradient and
// holds no optimizer state) and its modules run in evaluation mode (no dropout).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/phi4mm/text.h"
#include "nn/optim/optimizer.h"

namespace areno::train {

enum class Group { lm, projector, tower };
const char* group_name(Group g);  // "lm" | "projector" | "tower"
inline constexpr Group kGroups[] = {Group::lm, Group::projector, Group::tower};

// The group of a parameter by its checkpoint name; throws std::invalid_argument
// for a name under model.embed_tokens_extend that is neither (a part this code
// does not know must not be trained by accident).
Group group_of(const std::string& name);
// A LoRA branch weight (…lora_A.<adapter>.weight / …lora_B.<adapter>.weight).
bool is_lora(const std::string& name);
// A weight of the user adapter (…lora_A.user.weight / …lora_B.user.weight).
bool is_user_lora(const std::string& name);

// all: the whole decoder; lora: every LoRA branch (vision, speech and the
// user adapter); user: only the user adapter (`--lora-rank`); none: nothing.
enum class LmTrainable { all, lora, user, none };
LmTrainable lm_trainable_from_name(const std::string& name);  // "all" | "lora" | "user" | "none"
const char* lm_trainable_name(LmTrainable l);

enum class EmbedRows { all, data, none };
EmbedRows embed_rows_from_name(const std::string& name);  // "all" | "data" | "none"
const char* embed_rows_name(EmbedRows e);

struct GroupOptions {
  LmTrainable lm = LmTrainable::all;
  bool projector = false;  // --unfreeze-mm-projector
  bool tower = false;      // --unfreeze-mm-tower
  // --embed-rows: which rows of model.embed_tokens (the tied input embedding
  // and head) train when the lm group does: all, only the rows of token ids
  // that occur in the training rows (as peft's trainable_token_indices; the
  // trainer masks the other rows' gradient, so they stay bitwise unchanged),
  // or none.
  EmbedRows embed_rows = EmbedRows::all;
};

// Whether a parameter trains under `o`.
bool trains(const std::string& name, const GroupOptions& o);

// Sets requires_grad on every parameter (true exactly for those that train),
// puts the whole model in evaluation mode and then the modules whose
// parameters train in training mode (a LoraLinear trains when its LoRA
// branches do). Parameters registered as not trainable (the audio CMVN
// statistics) stay frozen. Returns how many parameters train; throws when none does.
int64_t apply_trainable(phi4mm::Phi4MMForCausalLM& model, const GroupOptions& o);

// Weight decay applies to tensors with at least two dimensions of size > 1
// (not to biases, norm weights, the separators glb_GN / sub_GN).
bool decays(const Tensor& param);

// Per group: base learning rate and the schedule all groups share.
struct GroupHyper {
  double lr[3] = {1e-5, 1e-5, 1e-5};  // by Group
  double weight_decay = 0.0;
  std::shared_ptr<LrSchedule> schedule;  // null: constant
};

// The optimizer's parameter groups from the model's trainable parameters, in
// named_parameters order: for each of lm, projector, tower that has trainable
// parameters, a decayed group and a non-decayed one (empty ones left out),
// named "<group>" and "<group>.no_decay". Parameter names are the checkpoint
// names (the keys of the optimizer state file).
std::vector<ParamGroup> make_param_groups(const Module& model, const GroupHyper& h);
// The group a ParamGroup built by make_param_groups belongs to (from its name).
Group group_of_param_group(const ParamGroup& g);

}  // namespace areno::train
