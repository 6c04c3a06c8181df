#pragma once
// The Phi-4-multimodal language model (spec text.md sections 2, 3 and 5).
//
// Module names equal the original checkpoint's tensor names, so a checkpoint
// loads by a name walk:
//   model.embed_tokens.weight
//   model.layers.N.input_layernorm.weight
//   model.layers.N.self_attn.qkv_proj.base_layer.weight
//   model.layers.N.self_attn.qkv_proj.lora_A.vision.weight   (and lora_B, speech)
//   model.layers.N.self_attn.o_proj.*, mlp.gate_up_proj.*, mlp.down_proj.*
//   model.layers.N.post_attention_layernorm.weight
//   model.norm.weight
// lm_head is tied to model.embed_tokens.weight and has no tensor of its own.
//
// Forward entry point (a): packed variable-length sequences. Tokens of several
// sequences are concatenated into one [T] row dimension; cu_seqlens gives the
// sequence offsets. Each sequence picks its modality adapter and its LongRoPE
// table, so one forward mixes text-only, vision and speech sequences.
// Attention never crosses a sequence boundary.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/phi4mm/config.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "tensor/ops.h"

namespace areno::phi4mm {

// Which LoRA a row uses (spec 3.3: mode 0 none, 1 vision, 2 speech, 3 vision).
enum class Adapter : uint8_t { none = 0, vision = 1, speech = 2 };
Adapter adapter_from_name(const std::string& name);  // "none" | "vision" | "speech"
const char* adapter_name(Adapter a);

// Which LongRoPE factor table a sequence uses (spec 2.5). `automatic` is the
// HF rule: long iff the sequence's last position + 1 > original_max_position_
// embeddings. Crossing the boundary re-computes the whole sequence with the
// long table (the engine re-prefills); `short_table`/`long_table` force one.
enum class RopeTable : uint8_t { automatic, short_table, long_table };

// Rotate-half rotary embedding on the first R dims of each head (spec 2.4):
// x [T, NH, D]; cos/sin [T, 1, R] (R <= D, even) -> [T, NH, D], dims >= R unchanged.
Tensor apply_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin);
// Causal GQA attention of one sequence: q [Lq, NQ, D], k/v [Lk, NKV, D] with
// Lk >= Lq (the last Lq keys are the queries' own positions, earlier keys are
// history) -> [Lq, NQ * D], heads in order. Scale 1/sqrt(D).
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v);

// A module holding one tensor named "weight" (norms, embedding, linear bases):
// the checkpoint's names end in ".weight" for all of them.
class Weight : public Module {
 public:
  Weight(const std::string& type, Shape shape, TensorOptions opts);
  Tensor weight;
};

// Rows of the packed batch that use each adapter (built once per forward).
struct AdapterRows {
  Tensor rows[3];          // i64 row indices on the model's device; [0] unused
  bool all[3] = {false, false, false};  // every row uses this adapter (no gather needed)
  bool any(Adapter a) const { return all[int(a)] || rows[int(a)].defined(); }
};

// A bias-free linear layer with optional vision and speech LoRA adapters:
//   y = x·Wᵀ + s_a · (x_a·A_aᵀ)·B_aᵀ  for the rows x_a that use adapter a.
class LoraLinear : public Module {
 public:
  LoraLinear(int64_t in, int64_t out, const std::optional<LoraConfig>& vision,
             const std::optional<LoraConfig>& speech, TensorOptions opts);
  // x: [T, in] -> [T, out]
  Tensor forward(const Tensor& x, const AdapterRows& rows) const;
  bool has(Adapter a) const { return lora_a_[int(a)].defined(); }

  int64_t in_features, out_features;
  std::shared_ptr<Weight> base_layer;

 private:
  Tensor lora_a_[3], lora_b_[3];  // [r, in], [out, r]
  double scaling_[3] = {0, 0, 0};
};

class Attention : public Module {
 public:
  Attention(const Config& c, TensorOptions opts);
  // x: [T, H]; cos/sin: [T, 1, R] in x's dtype -> [T, H]
  Tensor forward(const Tensor& x, const Tensor& cos, const Tensor& sin,
                 const std::vector<int64_t>& cu_seqlens, const AdapterRows& rows) const;
  // The packed qkv projection split into heads, rotary applied to q and k:
  // q [T, NQ, D], k and v [T, NKV, D]. Shared by forward() and the KV-cache path.
  struct Qkv {
    Tensor q, k, v;
  };
  Qkv rotary_qkv(const Tensor& x, const Tensor& cos, const Tensor& sin, const AdapterRows& rows) const;

  std::shared_ptr<LoraLinear> qkv_proj, o_proj;

 private:
  TextConfig cfg_;
};

class Mlp : public Module {
 public:
  Mlp(const Config& c, TensorOptions opts);
  // x: [T, H] -> [T, H]; gate_up rows: gate first, then up (spec 2.6).
  Tensor forward(const Tensor& x, const AdapterRows& rows) const;

  std::shared_ptr<LoraLinear> gate_up_proj, down_proj;

 private:
  int64_t intermediate_;
};

class DecoderLayer : public Module {
 public:
  DecoderLayer(const Config& c, TensorOptions opts);
  Tensor forward(const Tensor& h, const Tensor& cos, const Tensor& sin,
                 const std::vector<int64_t>& cu_seqlens, const AdapterRows& rows) const;

  std::shared_ptr<Weight> input_layernorm, post_attention_layernorm;
  std::shared_ptr<Attention> self_attn;
  std::shared_ptr<Mlp> mlp;

 private:
  double eps_;
};

// The inner "model" (embedding, layers, final norm).
class TextModel : public Module {
 public:
  TextModel(const Config& c, TensorOptions opts);

  std::shared_ptr<Weight> embed_tokens;
  std::shared_ptr<ModuleList> layers;
  std::shared_ptr<Weight> norm;
};

// A packed batch for entry point (a).
struct PackedBatch {
  Tensor token_ids;                  // [T] integer ids (any device)
  std::vector<int64_t> cu_seqlens;   // [S + 1]: 0 = cu[0] < cu[1] < ... < cu[S] = T
  // [T] positions (host integer tensor); undefined = 0..len-1 in each sequence.
  Tensor positions;
  std::vector<Adapter> adapters;     // [S]; empty = none for every sequence
  std::vector<RopeTable> rope;       // [S]; empty = automatic for every sequence
  // Media rows (spec 5.4): rows where media_mask is true take consecutive
  // rows of media_rows instead of the token embedding.
  Tensor media_rows;                 // [M, H] or undefined
  Tensor media_mask;                 // [T] bool with M true entries, or undefined

  // One sequence, all tokens.
  static PackedBatch single(const std::vector<int64_t>& ids, Adapter a = Adapter::none,
                            RopeTable r = RopeTable::automatic);
  // Several sequences packed back to back.
  static PackedBatch pack(const std::vector<std::vector<int64_t>>& seqs,
                          const std::vector<Adapter>& adapters = {});
};

// The causal LM: Phi4MMForCausalLM's language part, root of the checkpoint names.
class Phi4MMForCausalLM : public Module {
 public:
  // The adapters present follow the config (vision_lora / speech_lora blocks);
  // `with_lora = false` builds the base model only. Parameters are allocated
  // uninitialised: load a checkpoint or call init_weights (init.h).
  Phi4MMForCausalLM(const Config& c, TensorOptions opts = {}, bool with_lora = true);

  const Config& config() const { return cfg_; }
  DType dtype() const;
  Device device() const;
  bool has_adapter(Adapter a) const;

  // Final-norm hidden states: [T, H].
  Tensor hidden_states(const PackedBatch& b) const;
  // Logits of every row: [T, V] in the model dtype.
  Tensor logits(const PackedBatch& b) const;
  // Logits of selected rows only (the vocabulary is large): rows [N] i64 -> [N, V].
  Tensor logits_at(const PackedBatch& b, const std::vector<int64_t>& rows) const;
  // log p(targets[t] | tokens <= t) per row, f32 [T]; targets < 0 give 0.
  Tensor token_logprobs(const PackedBatch& b, const Tensor& targets) const;

  // cos/sin rows [T, 1, R] for the batch's positions and tables (model dtype, device).
  std::pair<Tensor, Tensor> rope_tables(const PackedBatch& b) const;
  // Whether a sequence whose last position is `last_position` uses the long
  // LongRoPE table under `r` (automatic: last_position + 1 > original_max).
  bool uses_long_table(int64_t last_position, RopeTable r) const;

  std::shared_ptr<TextModel> model;

 private:
  void check_batch(const PackedBatch& b) const;
  AdapterRows adapter_rows(const PackedBatch& b) const;

  Config cfg_;
};

// Parameter counts of the text part (spec 4.3), for tests and reports.
int64_t text_parameter_count(const TextConfig& t);

}  // namespace areno::phi4mm
