#pragma once
// Supervised fine-tuning (issue 14, "Loop" and "Checkpoints"): the loop that
// updates the same Phi4MMForCausalLM object `areno serve` runs, through its one
// packed forward.
//
// A step takes the next `batch_size` rows of the epoch's order (shuffled per
// epoch from the seed; the last step of an epoch may be shorter), splits them
// into micro-batches of `mini_bs` rows, each packed into one variable-length
// forward (no padding; text, image, audio and image+audio rows mixed, each
// with its own adapter), and accumulates the gradient of
//   loss = sum of target-token cross-entropies / target tokens of the step,
// so splitting a step into micro-batches does not change it. Then the global
// gradient norm is clipped, AdamW steps every group with its learning rate and
// the shared schedule, and the gradients are dropped.
//
// save_checkpoint writes <save>/step-N/ in the released layout (weights,
// config, tokenizer and processor files copied from the source checkpoint)
// plus optimizer/optimizer.safetensors (moments, master weights, step counts;
// in a subfolder, so tools that read every *.safetensors of the folder as
// weights do not see it) and
// trainer_state.json (step, epoch, data position, seed, dataset fingerprint),
// all in a temporary folder that is synced and renamed, then <save>/latest.
// A run resumed from it (load the model from the step folder, then
// load_state) continues exactly as the uninterrupted run.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/text.h"
#include "nn/optim/adamw.h"
#include "train/dataset.h"
#include "train/loss.h"
#include "train/param_groups.h"

namespace areno::train {

enum class DecayStyle { cosine, linear, constant };
DecayStyle decay_style_from_name(const std::string& name);  // "cosine" | "linear" | "constant"

// The learning-rate factor every group shares: linear warm-up over `warmup`
// steps, then the decay style down to `min_ratio` (min_lr / lr) at step
// `decay_steps`, held there (constant: 1 after warm-up).
std::shared_ptr<LrSchedule> make_schedule(DecayStyle style, int64_t warmup, int64_t decay_steps, double min_ratio);

struct SftOptions {
  int64_t epochs = 1;
  int64_t max_steps = 0;    // > 0: stop after this many steps (epochs repeat as needed)
  int64_t batch_size = 8;   // rows per optimizer step
  int64_t mini_bs = 1;      // rows per micro-batch (one packed forward)
  double lr = 1e-5;         // lm group
  double min_lr = 0.0;      // lm group's floor; the other groups keep the same ratio
  double mm_projector_lr = 0.0;  // 0: lr
  double mm_tower_lr = 0.0;      // 0: lr
  int64_t lr_decay_steps = 0;    // 0: the run's total steps
  DecayStyle decay = DecayStyle::cosine;
  int64_t warmup_steps = 0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;
  double weight_decay = 0.0;     // not on biases, norm weights, separators
  double grad_clip_norm = 1.0;   // 0: no clipping
  bool activation_checkpointing = true;
  uint64_t seed = 42;            // data order and dropout
  bool shuffle = true;
  GroupOptions groups;
  int64_t loss_chunk_rows = kDefaultLossChunkRows;
};

// Checks option values (throws std::invalid_argument naming the flag).
void validate(const SftOptions& o);

// Shared by the SFT and RL trainers.

// Checks that no trained part asks for a dropout the forward does not
// implement, applies the trainable groups to `model` (requires_grad,
// train/eval mode, activation checkpointing inside a trained tower) and
// builds AdamW over make_param_groups with the groups'
// learning rates and the schedule of `o` over `total_steps`. Throws
// std::invalid_argument naming the flag or config key.
std::unique_ptr<AdamW> make_training_optimizer(phi4mm::Phi4MMForCausalLM& model, const SftOptions& o,
                                               int64_t total_steps);

// Turns the adapters' dropout off in every LoraLinear of `model` (training
// mode included); returns how many adapters had one. The RL trainers call it:
// a rollout samples from the policy the training forward scores (verl and
// TRL's disable_dropout do the same).
int64_t disable_dropout(phi4mm::Phi4MMForCausalLM& model);

// The order of `n` items in `epoch`: 0..n-1, shuffled from (seed, epoch)
// with our own Fisher-Yates stream (the same on every platform).
std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch, bool shuffle);

// The end of a step: clips the global gradient norm to `grad_clip_norm` (0:
// no clipping), AdamW steps, drops the gradients. Returns the norm before clipping.
double clip_and_step(AdamW& optimizer, double grad_clip_norm);

// The learning rate each trained group uses at the optimizer's next step.
std::vector<std::pair<std::string, double>> group_lrs(const AdamW& optimizer);

// Writes save_path/step-<step> (the released layout of `model`, tokenizer and
// processor files copied from `source`, what `add_files` writes, the
// optimizer state in optimizer/ and `trainer_state` as trainer_state.json) in
// a temporary folder that is synced and renamed, then save_path/latest.
// Returns the step folder.
std::filesystem::path save_step_folder(const phi4mm::Phi4MMForCausalLM& model, const AdamW& optimizer, int64_t step,
                                       const std::filesystem::path& save_path, const std::filesystem::path& source,
                                       const nlohmann::json& trainer_state,
                                       const std::function<void(const std::filesystem::path&)>& add_files = {});

// Where the run is: optimizer steps done, and the next row to read.
struct TrainerState {
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t position = 0;  // index into the epoch's order
};

// After a step that read `taken` rows of a dataset of `rows`: the next
// position, and the next epoch when this one is done.
void advance(TrainerState& state, int64_t taken, int64_t rows);
// The same without counting a step (a step that reads several batches:
// GRPO's --filter-groups).
void advance_position(TrainerState& state, int64_t taken, int64_t rows);

// A loop over `rows` rows with o.batch_size rows a step: steps per epoch (the
// last may be shorter) and in the run (o.max_steps, else o.epochs epochs).
int64_t loop_steps_per_epoch(int64_t rows, const SftOptions& o);
int64_t loop_total_steps(int64_t rows, const SftOptions& o);

// The indices of the next step's rows: up to o.batch_size from
// state.position in the epoch's order (epoch_order); does not advance.
std::vector<int64_t> next_step_rows(const TrainerState& state, int64_t rows, const SftOptions& o);

// trainer_state.json's fields every trainer writes: format, step, epoch,
// position, total_steps, seed.
nlohmann::json trainer_state_json(const TrainerState& state, int64_t total_steps, uint64_t seed);

// FNV-1a over 64-bit values (8 bytes each) and strings: the dataset
// fingerprints a resumed run is checked against.
class Fingerprint {
 public:
  void add(int64_t v);
  void add(const std::string& s);
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

// The options a resumed run of `algo` must repeat, by the flag that sets
// each: "--algo", "dataset" (`dataset`, the rows' fingerprint),
// "--batch-size", "--seed", "--no-shuffle", "--lm-trainable", "--embed-rows",
// "--unfreeze-mm-projector", "--unfreeze-mm-tower". The RL trainers save
// theirs (these and their own) as trainer_state.json's "run".
nlohmann::json loop_run_keys(const SftOptions& o, const std::string& algo, const std::string& dataset);

// Checks the options of a resuming run (`now`, as loop_run_keys) against the
// "run" object of a saved trainer_state.json (`saved`, read from `file`).
// Throws std::runtime_error naming the first flag whose value differs (given
// in one and not the other included), or saying that the folder was saved
// before its algorithm could resume (no "run").
void check_run_keys(const nlohmann::json& saved, const nlohmann::json& now, const std::string& file);

// A step folder's trainer_state.json, read for a run of `algo` that resumes
// from it: refuses a folder of another algorithm ("algo"; absent: "sft"),
// lets `check` refuse it (the trainer's comparison of the options a resume
// must repeat; it gets the JSON and the file's path), reads the position
// (inside `rows`), then loads optimizer/optimizer.safetensors into
// `optimizer`. Nothing is loaded when a check throws (std::runtime_error
// naming the file).
struct SavedState {
  TrainerState state;
  nlohmann::json json;
};
SavedState load_step_state(const std::filesystem::path& step_dir, const std::string& algo, int64_t rows,
                           AdamW& optimizer,
                           const std::function<void(const nlohmann::json&, const std::string&)>& check);

struct StepStats {
  int64_t step = 0;           // this step's number (1-based)
  double loss = 0;            // mean cross-entropy over the step's target tokens
  double grad_norm = 0;       // global norm before clipping
  int64_t rows = 0, tokens = 0, target_tokens = 0;
  double seconds = 0;
  std::vector<std::pair<std::string, double>> lrs;  // learning rate used, per trained group
};

class SftTrainer {
 public:
  // Applies the trainable groups to `model` (requires_grad, train/eval mode)
  // and builds the optimizer. Throws when a trained group's config asks for
  // a dropout the forward does not implement, or when no row has a target.
  SftTrainer(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::vector<SftRow> rows, SftOptions options);

  int64_t steps_per_epoch() const;
  int64_t total_steps() const;
  bool done() const { return state_.step >= total_steps(); }
  const TrainerState& state() const { return state_; }
  const SftOptions& options() const { return options_; }
  AdamW& optimizer() { return *optimizer_; }
  // --embed-rows data: how many embedding rows train (0 otherwise).
  int64_t embed_rows_trained() const { return embed_rows_trained_; }
  phi4mm::Phi4MMForCausalLM& model() { return *model_; }

  // One optimizer step.
  StepStats step();

  // Forward and backward of `rows` as micro-batches of mini_bs rows,
  // gradients accumulated into the parameters, each micro-batch's loss
  // divided by `normaliser` (0: the rows' own target tokens). Returns the
  // summed loss. `dropout_seed` seeds the dropout masks. For step() and tests.
  double accumulate(const std::vector<const SftRow*>& rows, int64_t normaliser, uint64_t dropout_seed);

  // The rows of the next step, in order (does not advance).
  std::vector<const SftRow*> next_batch() const;

  // Writes save_path/step-N (see the top) and save_path/latest; tokenizer and
  // processor files are copied from `source` (the checkpoint the run started
  // from; empty: none), then `add_files` may write more into the temporary
  // folder before it is renamed. Returns the step folder.
  std::filesystem::path save_checkpoint(
      const std::filesystem::path& save_path, const std::filesystem::path& source,
      const std::function<void(const std::filesystem::path&)>& add_files = {}) const;
  // Restores the optimizer and the data position from a step folder written
  // by save_checkpoint (the model's weights are loaded by the caller from the
  // same folder). Refuses a folder from another dataset or other options
  // that change the run (batch size, seed, groups).
  void load_state(const std::filesystem::path& step_dir);

 private:
  std::string fingerprint() const;

  std::shared_ptr<phi4mm::Phi4MMForCausalLM> model_;
  std::vector<SftRow> rows_;
  SftOptions options_;
  std::unique_ptr<AdamW> optimizer_;
  TrainerState state_;
  Tensor embed_row_mask_;  // [vocab, 1] 0/1, --embed-rows data only
  int64_t embed_rows_trained_ = 0;  // its ones
};

// The step folder a --resume argument names: DIR itself when it holds
// trainer_state.json, else DIR/<name in DIR/latest>.
std::filesystem::path resolve_resume_dir(const std::filesystem::path& dir);

}  // namespace areno::train
