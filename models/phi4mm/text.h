#pragma once
// The Phi-4-multimodal language model (spec text.md sections 2, 3 and 5).
//
// Module names equal the original checkpoint's tensor names, so a checkpoint
// loads by a name walk:
//   model.embed_tokens.weight
//   model.layers.N.input_layernorm.weight
//   model.layers.N.self_attn.qkv_proj.base_layer.weight
//   model.layers.N.self_attn.qkv_proj.lora_A.vision.weight   (and lora_B, speech; user: config "user_lora")
//   model.layers.N.self_attn.o_proj.*, mlp.gate_up_proj.*, mlp.down_proj.*
//   model.layers.N.post_attention_layernorm.weight
//   model.norm.weight
// lm_head is tied to model.embed_tokens.weight and has no tensor of its own.
//
// One forward: packed variable-length sequences. Tokens of several sequences
// are concatenated into one [T] row dimension; cu_seqlens gives the sequence
// offsets. Each sequence picks its modality adapter and its LongRoPE table, so
// one forward mixes text-only, image, audio and image+audio sequences.
// Attention never crosses a sequence boundary. The same layer loop serves
// training and scoring (whole sequences, PackedBatch alone) and the engine's
// chunked prefill and decode (PackedBatch plus a KvStep: each chunk appends to
// its sequence's cached keys and values and attends to all of them; see
// forward_incremental and kv_cache.h for the block bookkeeping).
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/phi4mm/config.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "tensor/ops.h"
#include "tensor/quantized.h"

namespace areno::phi4mm {

class PagedKvCache;
struct KvSequence;
class ImageEmbed;  // vision/vision.h
class AudioEmbed;  // audio/encoder.h

// Media placeholder ids (spec tokens-api.md): the k-th image (audio) token of a
// prompt takes the k-th row of that prompt's image (audio) rows.
inline constexpr int64_t kImageTokenId = 200010;  // <|endoftext10|>
inline constexpr int64_t kAudioTokenId = 200011;  // <|endoftext11|>
inline bool is_media_token(int64_t id) { return id == kImageTokenId || id == kAudioTokenId; }

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
//
// A linear base or the tied embedding may instead hold its weight in int8
// (`--quantize int8`, tensor/quantized.h): then `int8` is set and `weight`
// keeps its dtype and device but no data (shape [0, in]). linear() and rows()
// read whichever form the weight has, so the forward is one for both.
class Weight : public Module {
 public:
  Weight(const std::string& type, Shape shape, TensorOptions opts);
  // x · weightᵀ: [..., in] -> [..., out].
  Tensor linear(const Tensor& x) const;
  // Rows `ids` of the weight (the embedding lookup): [..., in] in the weight's dtype.
  Tensor rows(const Tensor& ids) const;
  // Replaces the weight by its int8 form `q` (same [out, in]) and drops its data.
  void set_int8(Int8Weight q);

  Tensor weight;
  std::shared_ptr<const Int8Weight> int8;  // null unless quantized
};

// Weight-only quantization of the decoder for CPU inference (issue 16).
enum class Quantize : uint8_t { none, int8 };
// "none" | "int8"; anything else throws std::invalid_argument listing them.
Quantize quantize_from_name(const std::string& name);
const char* quantize_name(Quantize q);

// A LoRA adapter served beside the model (`areno serve --lora-modules
// NAME=DIR`, vLLM's): inference only, held outside the module tree (never
// trained, saved or counted as a parameter), selected per sequence by its
// number (PackedBatch::served_lora) and added after the row and user adapters.
// Its tensors are made on the model's device and dtype when it is added;
// Module::to does not move them (add served adapters after moving the model).
struct ServedLora {
  std::string name;    // what requests name it by (their "model")
  std::string source;  // where it was loaded from
  LoraConfig cfg;      // targets as for a user adapter
  uint64_t uid = 0;    // unique in the process: cached keys of one adapter never serve another
  int32_t number = 0;  // its place in served_loras(), from 1
  bool removed = false;  // unloaded (remove_served_lora): the next adapter added takes its number
};

// Rows of the packed batch that use each adapter (built once per forward).
struct AdapterRows {
  Tensor rows[3];          // i64 row indices on the model's device; [0] unused
  bool all[3] = {false, false, false};  // every row uses this adapter (no gather needed)
  bool any(Adapter a) const { return all[int(a)] || rows[int(a)].defined(); }
  // Served adapter j (numbered from 1) at index j - 1: its rows (or all),
  // and the same rows as (first, count) runs of consecutive rows.
  struct Served {
    Tensor rows;
    bool all = false;
    std::vector<std::pair<int64_t, int64_t>> runs;
  };
  std::vector<Served> served;
  // Seed of this forward's LoRA dropout masks (PackedBatch::dropout_seed).
  uint64_t dropout_seed = 0;
};

// Whether a parameter name is a weight of the user adapter
// (…lora_A.user.weight / …lora_B.user.weight).
bool is_user_lora_param(const std::string& name);

// A bias-free linear layer with optional vision and speech LoRA adapters and
// an optional user adapter (config "user_lora", `areno train --lora-rank`):
//   y = x·Wᵀ + s_a · (drop_a(x_a)·A_aᵀ)·B_aᵀ  for the rows x_a that use adapter a
//         + s_u · (drop_u(x)·A_uᵀ)·B_uᵀ          for every row,
// added in that order (PEFT's with the adapters [a, user] active).
// drop_a is the adapter's dropout (config "dp", PEFT's lora_dropout), applied
// only in training mode; its mask is a function of (dropout_seed, salt,
// adapter), so a recomputed forward (activation checkpointing) draws the same.
// Parameter names: lora_A.<vision|speech|user>.weight, lora_B.<…>.weight.
class LoraLinear : public Module {
 public:
  LoraLinear(int64_t in, int64_t out, const std::optional<LoraConfig>& vision,
             const std::optional<LoraConfig>& speech, TensorOptions opts);
  // x: [T, in] -> [T, out]
  Tensor forward(const Tensor& x, const AdapterRows& rows) const;
  bool has(Adapter a) const { return lora_a_[int(a)].defined(); }
  bool has_user() const { return lora_a_[kUser].defined(); }
  double dropout_p(Adapter a) const { return dropout_[int(a)]; }
  double user_dropout_p() const { return dropout_[kUser]; }
  // No adapter dropout from now on, in training mode too (RL: a rollout and
  // the training forward must see the same policy). The config keeps its "dp".
  void disable_dropout() { std::fill(std::begin(dropout_), std::end(dropout_), 0.0); }
  // Adds the user adapter (uninitialised: load it or call init_user).
  void add_user(const LoraConfig& cfg, TensorOptions opts);
  // PEFT's initialisation of a new adapter: A uniform in ±1/sqrt(in) (kaiming
  // uniform, a = sqrt(5)), B zero, so the layer's output is unchanged.
  void init_user(Generator& g);
  // Sets served adapter number j (ServedLora, from 1): a [r, in] and b
  // [out, r] in the model's dtype and device, or both undefined where that
  // adapter does not wrap this linear (then it adds nothing here).
  void set_served(int32_t j, Tensor a, Tensor b, double scaling);

  int64_t in_features, out_features;
  std::shared_ptr<Weight> base_layer;
  uint64_t salt = 0;  // this layer's place in the model (distinct dropout masks per layer)

 private:
  static constexpr int kUser = 3;  // index of the user adapter (after Adapter's values)
  void register_adapter(int k, const char* name, const LoraConfig& cfg, TensorOptions opts);
  Tensor adapter_input(int k, const Tensor& x, const AdapterRows& rows) const;
  Tensor adapter_delta(int k, const Tensor& xs, const AdapterRows& rows) const;
  Tensor accumulate(int k, const Tensor& y, const Tensor& xa) const;
  bool pow2(int k) const { return pow2(scaling_[k]); }
  // A power-of-two scaling (it then scales the r-wide product, see adapter_delta).
  static bool pow2(double scaling);
  // s·(x·Aᵀ)·Bᵀ in PEFT's rounding order.
  static Tensor product(const Tensor& x, const Tensor& a, const Tensor& b, double s);

  Tensor lora_a_[4], lora_b_[4];  // [r, in], [out, r]
  double scaling_[4] = {0, 0, 0, 0};
  double dropout_[4] = {0, 0, 0, 0};
  struct Served {
    Tensor a, b;  // undefined: the adapter does not wrap this linear
    double scaling = 0;
  };
  std::vector<Served> served_;
};

// The KV-cache side of a forward step. Sequence s's chunk (rows cu[s]..cu[s+1]
// of the batch) is written to the cache after its start[s] cached tokens, and
// its queries attend to all start[s] + len cached keys. Built by
// forward_incremental after the blocks are reserved.
struct KvStep {
  PagedKvCache* cache = nullptr;
  std::vector<const std::vector<int64_t>*> blocks;  // [S] block tables
  std::vector<int64_t> start;                        // [S] cached tokens before the chunk
  std::vector<Tensor> history;                       // [S] slot ids of positions [0, start + len), i64
};

class Attention : public Module {
 public:
  Attention(const Config& c, TensorOptions opts);
  // x: [T, H]; cos/sin: [T, 1, R] in x's dtype -> [T, H]. With `kv`, the keys
  // and values go through the cache's layer `layer` (see KvStep).
  Tensor forward(const Tensor& x, const Tensor& cos, const Tensor& sin, const std::vector<int64_t>& cu_seqlens,
                 const AdapterRows& rows, const KvStep* kv, int64_t layer) const;

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
  // `index`: the layer's place in model.layers (its KV-cache layer).
  DecoderLayer(const Config& c, int64_t index, TensorOptions opts);
  Tensor forward(const Tensor& h, const Tensor& cos, const Tensor& sin, const std::vector<int64_t>& cu_seqlens,
                 const AdapterRows& rows, const KvStep* kv) const;

  std::shared_ptr<Weight> input_layernorm, post_attention_layernorm;
  std::shared_ptr<Attention> self_attn;
  std::shared_ptr<Mlp> mlp;

 private:
  double eps_;
  int64_t index_;
};

// Which parts a model is built with: a load or an init may leave the LoRA
// adapters or a tower out (a text-only server, a checkpoint without audio).
struct ModelParts {
  bool lora = true;     // the vision/speech adapters the config declares
  bool vision = false;  // model.embed_tokens_extend.image_embed
  bool audio = false;   // model.embed_tokens_extend.audio_embed
};

// model.embed_tokens_extend: the image and audio embeddings (towers and
// projectors), each null when the model is built without it.
class MediaEmbed : public Module {
 public:
  MediaEmbed(const Config& c, const ModelParts& parts, TensorOptions opts);

  std::shared_ptr<ImageEmbed> image_embed;
  std::shared_ptr<AudioEmbed> audio_embed;
};

// The inner "model" (embedding, layers, final norm, media embeddings).
class TextModel : public Module {
 public:
  TextModel(const Config& c, const ModelParts& parts, TensorOptions opts);

  std::shared_ptr<Weight> embed_tokens;
  std::shared_ptr<ModuleList> layers;
  std::shared_ptr<Weight> norm;
  std::shared_ptr<MediaEmbed> embed_tokens_extend;  // null without towers
};

// A packed batch for entry point (a).
struct PackedBatch {
  Tensor token_ids;                  // [T] integer ids (any device)
  std::vector<int64_t> cu_seqlens;   // [S + 1]: 0 = cu[0] < cu[1] < ... < cu[S] = T
  // [T] positions (host integer tensor); undefined = 0..len-1 in each sequence.
  Tensor positions;
  std::vector<Adapter> adapters;     // [S]; empty = none for every sequence
  std::vector<RopeTable> rope;       // [S]; empty = automatic for every sequence
  // [S] the served adapter of each sequence (0: none; j: served_loras()[j - 1]);
  // empty = none for every sequence.
  std::vector<int32_t> served_lora;
  // Media rows (spec 5.4): when defined, the rows whose token is a media
  // placeholder (is_media_token) take consecutive rows of media_rows instead of
  // the token embedding; there must be exactly M placeholders. Undefined: every
  // row is a token embedding.
  Tensor media_rows;                 // [M, H] or undefined
  // The KV-cache step (set by forward_incremental), or null for whole sequences.
  const KvStep* kv = nullptr;
  // Training: recompute each decoder layer's activations in backward instead
  // of keeping them (activation checkpointing; only when recording autograd).
  bool recompute_layers = false;
  // Training: the seed of this forward's dropout masks (modules in training mode).
  uint64_t dropout_seed = 0;

  // One sequence, all tokens.
  static PackedBatch single(const std::vector<int64_t>& ids, Adapter a = Adapter::none,
                            RopeTable r = RopeTable::automatic);
  // Several sequences packed back to back.
  static PackedBatch pack(const std::vector<std::vector<int64_t>>& seqs,
                          const std::vector<Adapter>& adapters = {});
};

// The whole model, root of the checkpoint names: the language model with its
// LoRA adapters and, when built with them, the image and audio embeddings
// under model.embed_tokens_extend (so loading and saving are one name walk,
// and training selects parameter groups by name prefix).
class Phi4MMForCausalLM : public Module {
 public:
  // The adapters present follow the config (vision_lora / speech_lora blocks)
  // unless parts.lora is false; the towers follow parts. Parameters are
  // allocated uninitialised: load a checkpoint or call the init functions (init.h).
  // Built in evaluation mode (no dropout); the trainer switches the parts it
  // trains to training mode.
  Phi4MMForCausalLM(const Config& c, TensorOptions opts = {}, const ModelParts& parts = {});

  const Config& config() const { return cfg_; }
  // Sets vision.dynamic_hd (vLLM's --mm-processor-kwargs '{"dynamic_hd": N}');
  // before serving or training, never while requests run. Throws
  // std::invalid_argument outside [1, kMaxDynamicHd].
  void set_dynamic_hd(int64_t n);
  // The compute dtype (that of the weights a quantized model stands for).
  DType dtype() const;
  Device device() const;
  bool has_adapter(Adapter a) const;
  // Adds the user adapter `cfg` (config "user_lora") to the decoder layers'
  // linears named in cfg.targets, on the model's device and dtype, initialised
  // as PEFT does (init_user) from `seed`: the model's outputs are unchanged
  // until it trains. Throws std::invalid_argument when the model has one
  // already or `cfg` is invalid (check_user_lora).
  void add_user_lora(const LoraConfig& cfg, uint64_t seed);
  // Served adapters (ServedLora), numbered from 1 in PackedBatch::served_lora.
  const std::vector<ServedLora>& served_loras() const { return served_; }
  // Adds a served adapter: allocates its tensors in the model's dtype and
  // device for the linears `cfg.targets` names (check_user_lora), has `fill`
  // write them (names "model.layers.N.<module>.lora_A.weight" / "lora_B"),
  // then attaches them. Nothing is attached when `fill` throws. Returns the
  // adapter's number: the lowest one an unloaded adapter left, else the next.
  // Throws std::invalid_argument for an empty or repeated name (of a loaded
  // adapter) or an invalid `cfg`.
  int32_t add_served_lora(const std::string& name, const std::string& source, const LoraConfig& cfg,
                          const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& fill);
  // Unloads served adapter `number`: frees its tensors and marks it removed
  // (a batch that asks for it is refused; the next adapter added takes the
  // number, with a new uid). Throws std::out_of_range for a number that is
  // not loaded.
  void remove_served_lora(int32_t number);
  // Whether the decoder's weights are int8 (quantize_int8, LoadOptions::quantize).
  bool is_quantized() const;
  // The modules weight-only quantization replaces, by dotted module name: the
  // base weight of every decoder layer's qkv_proj, o_proj, gate_up_proj and
  // down_proj, and model.embed_tokens (the tied head and embedding). The LoRA
  // adapters, norms and towers keep the model's dtype.
  std::vector<std::pair<std::string, Weight*>> quantizable_weights();
  // The media embeddings, null when the model has no such input.
  std::shared_ptr<ImageEmbed> image_embed() const;
  std::shared_ptr<AudioEmbed> audio_embed() const;

  // Throws std::invalid_argument naming the first inconsistency of `b`
  // (offsets, adapters, positions past max_position_embeddings, media rows
  // that do not match the placeholders). Every forward calls it first.
  void check_batch(const PackedBatch& b) const;

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
  AdapterRows adapter_rows(const PackedBatch& b) const;
  // The linears a user adapter with `cfg.targets` wraps, layer by layer, with
  // their dotted names.
  std::vector<std::pair<std::string, LoraLinear*>> user_lora_linears(const LoraConfig& cfg) const;
  // Served adapter `number` adds nothing in any linear (its tensors freed).
  void clear_served(int32_t number);
  // Embedding (with media rows) and every decoder layer: [T, H] before the final norm.
  Tensor decoder(const PackedBatch& b) const;

  Config cfg_;
  std::vector<ServedLora> served_;
};

// A step of the incremental forward: for each sequence, a chunk of new tokens
// (chunked prefill: any length; decode: 1) appended after its cached tokens.
struct IncrementalBatch {
  std::vector<int64_t> token_ids;      // [T] the chunks back to back
  std::vector<int64_t> cu_seqlens{0};  // [S + 1] chunk offsets in token_ids
  std::vector<KvSequence*> seqs;       // [S] distinct; chunk s starts at position seqs[s]->length
  std::vector<Adapter> adapters;       // [S]
  std::vector<int32_t> served_lora;    // [S] as PackedBatch::served_lora
  // [S] the table each sequence asks for: short/long must match what the cache
  // holds (when it holds anything); automatic takes the cached table, or for an
  // empty cache the HF rule on the chunk's last position. A chunk that would
  // need the long table over short cached keys is an error (needs_reprefill).
  std::vector<RopeTable> rope;
  // Media rows of this step (spec 5.4), as in PackedBatch: the placeholder
  // rows of token_ids take consecutive rows of media_rows. The caller slices
  // each request's media rows to the placeholders inside its chunk.
  Tensor media_rows;  // [M, H] or undefined
  // Rows of token_ids whose logits are returned, in this order; empty = the last
  // row of every chunk.
  std::vector<int64_t> logit_rows;

  // Appends one sequence's chunk (token_ids, cu_seqlens, seqs, adapters, rope, served_lora).
  void add(KvSequence& s, const std::vector<int64_t>& ids, Adapter a = Adapter::none,
           RopeTable r = RopeTable::automatic, int32_t served = 0);
  size_t num_seqs() const { return seqs.size(); }
};

// The forward with a KV cache (chunked prefill and decode): the packed forward
// of the chunks with a KvStep. Runs the decoder on the new tokens only: writes
// their post-rotary K and V into the cache, attends over each sequence's cached
// history plus its chunk (causal within the chunk), advances each sequence's
// length, and returns the logits of the requested rows [N, V] (model dtype).
// Inference only: runs without recording autograd history.
Tensor forward_incremental(const Phi4MMForCausalLM& m, PagedKvCache& cache, IncrementalBatch& b);

// Quantizes quantizable_weights() of a built CPU model in f32 or bf16 in place
// (the demo model; load_model quantizes each weight as it is read instead, so
// the full-precision weights are never all in memory). Throws
// std::invalid_argument naming what is not supported (another device or dtype).
void quantize_model(Phi4MMForCausalLM& m, Quantize q);

// Parameter counts of the text part (spec 4.3), for tests and reports.
int64_t text_parameter_count(const TextConfig& t);

// Per-token log-probabilities of `completion` after `prompt` (media rows for
// the prompt's placeholders), without sampling: entry t is
// log p(completion[t] | prompt, completion[< t]). The packed forward of the
// training path, under no-grad.
std::vector<float> score(const Phi4MMForCausalLM& model, const std::vector<int64_t>& prompt,
                         const std::vector<int64_t>& completion, Adapter adapter = Adapter::none,
                         const Tensor& media_rows = {});

}  // namespace areno::phi4mm
