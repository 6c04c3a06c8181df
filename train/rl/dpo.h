#pragma once
// The DPO loop (issue 15, "Objectives"; docs/rl.md, "The DPO loop"): pairs of
// responses to one prompt, the preferred ("chosen") and the other
// ("rejected"), and one AdamW step per batch of pairs on dpo_loss, with the
// SFT trainer's groups, schedules and checkpoints (train/sft.h).
//
// Rows: {"prompt": string | messages, "chosen": string, "rejected": string,
// ...}. Each becomes two SFT rows, {"prompt", "response": chosen} and
// {"prompt", "response": rejected}, through make_sft_row (the serving
// processor; only the last assistant turn is a target), and is kept as one
// prompt (ids up to and including "<|assistant|>", media, adapter) with two
// completions (the response's tokens and its "<|end|>").
//
// A response's log-probability is the sum of its tokens' log-probabilities:
// policy_logp (one packed forward, the chunked head) then sequence_logp.
//
// Reference: the same sums under the starting policy, or under a separate
// reference model (--ref-ckpt), computed once when the trainer is built,
// without autograd, and kept per row.
//
// One step:
//   1. the next `loop.batch_size` rows of the epoch's order (as SFT);
//   2. micro-batches of `loop.mini_bs` pairs: one policy_logp over the pairs'
//      prompts with 2 completions each, dpo_loss with the kept reference
//      sums, backward;
//   3. the global gradient norm clipped, AdamW steps, gradients dropped.
//
// Accumulation: dpo_loss is a mean over the micro-batch's pairs; it is
// multiplied by (pairs in the micro-batch / pairs in the step) before
// backward, so the summed gradient is that of the mean over the step's pairs.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/text.h"
#include "models/phi4mm/tokenizer/tokenizer.h"
#include "nn/optim/adamw.h"
#include "train/dataset.h"
#include "train/metrics.h"
#include "train/rl/objectives.h"
#include "train/rl/policy_logp.h"
#include "train/sft.h"

namespace areno::train::rl {

// One preference pair: the prompt as the model sees it and the two completions.
struct DpoRow {
  Prompt prompt;                  // ids end with <|assistant|>; media; adapter
  std::vector<int64_t> chosen;    // the response's tokens, <|end|> included
  std::vector<int64_t> rejected;
  int64_t line = 0;
};

// Throws DatasetError naming `file`, the line and the field ("prompt",
// "chosen", "rejected"). Uses options.image / audio / media_root; train_on
// is always `last` (earlier assistant turns of a messages prompt are context).
DpoRow make_dpo_row(const tok::Tokenizer& tokenizer, const RawRow& row, const std::string& file,
                    const DatasetOptions& options);

// too long: prompt over max_prompt_tokens, or a response over max_new_tokens
using DpoDataset = Dataset<DpoRow>;

DpoDataset load_dpo_dataset(const std::filesystem::path& file, const tok::Tokenizer& tokenizer,
                            const DatasetOptions& options);

// The summed log-probabilities of each row's chosen and rejected response
// under `model`: one packed forward over the rows (each prompt's towers once,
// for both completions). [R] f32 each, differentiable (unless under a NoGradGuard).
struct PairLogp {
  Tensor chosen, rejected;
};
PairLogp pair_logp(const phi4mm::Phi4MMForCausalLM& model, const std::vector<const DpoRow*>& rows,
                   const PolicyLogpOptions& options = {});

struct DpoTrainOptions {
  // The SFT loop's options: batch_size = pairs per step, mini_bs = pairs per
  // micro-batch (1 .. batch_size), lr, schedules, groups, clipping, seed,
  // epochs, max_steps. embed_rows must be all or none.
  SftOptions loop;
  DpoOptions dpo;  // --dpo-beta, --dpo-loss-type, --dpo-label-smoothing
  // The command's own options a resumed run must repeat ({"--ref-ckpt": DIR}),
  // saved with the trainer's (run_keys).
  nlohmann::json run_keys = nlohmann::json::object();
};

// Where a DPO step folder keeps the reference sums: tensors "chosen" and
// "rejected", [rows] f64 in the dataset's order (a subfolder: not weights).
inline constexpr const char* kDpoReferenceFile = "reference/dpo_reference.safetensors";

// Throws std::invalid_argument naming the flag.
void validate(const DpoTrainOptions& o);

struct DpoStepStats {
  int64_t step = 0;
  int64_t pairs = 0, response_tokens = 0;  // response_tokens: chosen + rejected
  DpoStats dpo;                            // loss, rewards, margin, accuracy (means over the step's pairs)
  double chosen_logp = 0, rejected_logp = 0;  // mean summed log-probability under the policy, before the update
  double grad_norm = 0;                    // before clipping
  std::vector<std::pair<std::string, double>> lrs;
  double step_s = 0;
};

// The step's scalars for MetricsWriter: loss, chosen_reward, rejected_reward,
// reward_margin, reward_accuracy, chosen_logp, rejected_logp, grad_norm,
// lr/<group>, pairs, response_tokens, time/step_s, memory/peak_rss_bytes.
Scalars dpo_scalars(const DpoStepStats& st);

// "step 3/10  loss 0.6512  margin 0.0813  accuracy 0.875  chosen 0.052  rejected -0.029  lr lm 1.00e-04  grad_norm 0.41  time step=0.80s"
std::string format_dpo_progress(const DpoStepStats& st, int64_t total_steps);

class DpoTrainer {
 public:
  // Applies the trainable groups to `model` and builds the optimizer (as
  // SftTrainer), then computes every row's reference sums under `reference`
  // (nullptr: `model` as it is now) in micro-batches of loop.mini_bs pairs.
  // The reference model is not kept.
  //
  // With `resume_from` (a step folder save_checkpoint wrote; the caller loads
  // `model` from it, `reference` must be null) nothing is computed: the
  // optimizer, the data position and the reference sums of the saved run
  // (kDpoReferenceFile) are loaded, so the run continues as the uninterrupted
  // one, whose reference was its starting policy or --ref-ckpt. Refuses
  // (std::runtime_error naming the flag) a folder whose run_keys differ.
  DpoTrainer(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::vector<DpoRow> rows, DpoTrainOptions options,
             const phi4mm::Phi4MMForCausalLM* reference = nullptr, const std::filesystem::path& resume_from = {});

  int64_t steps_per_epoch() const;
  int64_t total_steps() const;
  bool done() const { return state_.step >= total_steps(); }
  const TrainerState& state() const { return state_; }
  const DpoTrainOptions& options() const { return options_; }
  AdamW& optimizer() { return *optimizer_; }
  // The reference's summed log-probabilities, per row (the order of `rows`).
  const std::vector<double>& ref_chosen() const { return ref_chosen_; }
  const std::vector<double>& ref_rejected() const { return ref_rejected_; }
  double reference_seconds() const { return reference_s_; }

  // One optimizer step (see the top).
  DpoStepStats step();

  // save_path/step-N as SftTrainer::save_checkpoint writes it, with
  // "algo": "dpo" and "run": run_keys() in trainer_state.json, and the
  // reference sums in kDpoReferenceFile.
  std::filesystem::path save_checkpoint(const std::filesystem::path& save_path, const std::filesystem::path& source,
                                        const std::function<void(const std::filesystem::path&)>& add_files = {}) const;
  // The options a resumed run must repeat: loop_run_keys (the pairs'
  // fingerprint) and options.run_keys.
  nlohmann::json run_keys() const;

 private:
  PolicyLogpOptions logp_options(int64_t micro) const;
  void load_state(const std::filesystem::path& step_dir);

  std::shared_ptr<phi4mm::Phi4MMForCausalLM> model_;
  std::vector<DpoRow> rows_;
  DpoTrainOptions options_;
  std::unique_ptr<AdamW> optimizer_;
  TrainerState state_;
  std::vector<double> ref_chosen_, ref_rejected_;
  double reference_s_ = 0;
};

}  // namespace areno::train::rl
