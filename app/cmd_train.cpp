// `areno train --algo sft|grpo|gspo|dpo|ppo` (issues 14 and 15): supervised
// fine-tuning and RL post-training of the model `areno serve` runs, through
// the library in train/ and train/rl/.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "app/commands_train.h"
#include "app/flags.h"
#include "app/served_model.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "train/dataset.h"
#include "train/metrics.h"
#include "train/param_groups.h"
#include "train/rl/dpo.h"
#include "train/rl/grpo.h"
#include "train/rl/ppo.h"
#include "train/rl/rewards.h"
#include "train/sft.h"

extern char** environ;

namespace areno::app {

namespace fs = std::filesystem;

namespace {

constexpr const char* kTrainUsage =
    "usage: areno train --algo sft --dataset-path FILE [--ckpt DIR] [options]\n"
    "       areno train --algo grpo|gspo --dataset-path FILE (--reward R | --reward-cmd CMD) [options]\n"
    "       areno train --algo grpo|gspo|ppo --dataset-path FILE --agent-cmd CMD [--reward R | --reward-cmd CMD]\n"
    "       areno train --algo dpo --dataset-path FILE [--dpo-beta X] [--ref-ckpt DIR] [options]\n"
    "       areno train --algo ppo --dataset-path FILE (--reward R | --reward-cmd CMD) [--critic-ckpt DIR] [options]\n"
    "\n"
    "Fine-tunes the model in --ckpt (the released layout; without it the embedded\n"
    "demo model) on chat rows (sft), by RL on prompts rolled out through the\n"
    "inference engine and scored by a reward (grpo, gspo, ppo), or on preference\n"
    "pairs (dpo), and saves checkpoints that `areno serve --model-path` loads as they are.\n"
    "\n"
    "data:\n"
    "  --dataset-path FILE       .json (array), .jsonl, .csv or .tsv: rows {\"messages\": [...]}\n"
    "                            or {\"prompt\": ..., \"response\": ...}\n"
    "  --dataset-loader-cmd CMD  run `CMD FILE` and read its stdout as JSONL rows\n"
    "  --media-root DIR          media paths resolve under DIR (default: the dataset's folder)\n"
    "  --train-on all|last       assistant turns that are targets (default all; dpo: last)\n"
    "  --skip-bad-rows           count and skip bad rows instead of stopping\n"
    "  --max-prompt-tokens N     drop (and count) rows with a longer prompt\n"
    "  --max-new-tokens N        drop (and count) rows with more target tokens\n"
    "                            (grpo/gspo/ppo: tokens per completion, default 256;\n"
    "                            dpo: pairs with a longer chosen or rejected response)\n"
    "\n"
    "loop:\n"
    "  --ckpt DIR, --model-path DIR   the checkpoint to start from\n"
    "  --algo sft|grpo|gspo|dpo|ppo   the algorithm (default sft)\n"
    "  --epochs N                passes over the data (default 1)\n"
    "  --max-steps N             stop after N optimizer steps (default: the epochs)\n"
    "  --batch-size N            rows per optimizer step (default 8; grpo/gspo/ppo: prompts;\n"
    "                            dpo: pairs)\n"
    "  --mini-bs N               rows per micro-batch, packed into one forward (default 1;\n"
    "                            grpo/gspo/ppo: completions; dpo: pairs)\n"
    "  --gradient-accumulation-steps N   micro-batches per step: --mini-bs = --batch-size / N\n"
    "  --lr X, --min-lr X        learning rate of the lm group and its floor (default 1e-5, 0)\n"
    "  --lr-decay-steps N        steps of the decay (default: all steps)\n"
    "  --lr-decay-style S        cosine (default), linear or constant\n"
    "  --warmup-steps N          linear warm-up steps (default 0)\n"
    "  --adam-beta1 X, --adam-beta2 X, --adam-eps X   (default 0.9, 0.999, 1e-8)\n"
    "  --weight-decay X          AdamW decay, not on biases, norms, separators (default 0)\n"
    "  --grad-clip-norm X        global gradient norm limit, 0 = none (default 1)\n"
    "  --activation-checkpointing / --no-activation-checkpointing\n"
    "                            recompute each decoder layer in backward, and each tower\n"
    "                            layer when the towers train (default on)\n"
    "  --seed N                  data order and dropout (default 42)\n"
    "  --no-shuffle              keep the dataset's order\n"
    "  --loss-chunk-rows N       logit rows per chunk of the loss (default 1024)\n"
    "  --device cpu|cuda[:N], --dtype f32|bf16   (bf16 keeps f32 master weights)\n"
    "  --threads N               compute threads (default: OMP_NUM_THREADS, else the physical cores)\n"
    "\n"
    "groups (towers and projectors are frozen by default):\n"
    "  --lm-trainable all|lora|user|none   the decoder: everything, every LoRA branch, only the\n"
    "                            user LoRA, nothing (default all; user with --lora-rank)\n"
    "  --lora-rank N             add a LoRA of rank N (the user adapter) to the decoder's\n"
    "                            linears, on every row beside the vision/speech adapter; the\n"
    "                            base weights stay frozen; saved in the checkpoint (docs/training.md)\n"
    "  --lora-alpha X            its scaling is X / N (default 2N)\n"
    "  --lora-dropout P          its dropout (default 0)\n"
    "  --lora-targets LIST       all (default) or a comma list of qkv_proj, o_proj,\n"
    "                            gate_up_proj, down_proj\n"
    "  --lora DIR                start the user LoRA from a PEFT folder (adapter_config.json,\n"
    "                            adapter_model.safetensors) instead of --lora-rank's fresh one\n"
    "                            (a resumed run takes its step folder's, which must be like it)\n"
    "  --embed-rows all|data|none   rows of the tied embedding/head that train with the lm group:\n"
    "                            all (default), only the token ids the dataset's rows use, none\n"
    "  --unfreeze-mm-projector   train the image/audio projections and separators\n"
    "  --mm-projector-lr X       their learning rate (default --lr)\n"
    "  --unfreeze-mm-tower       train SigLIP and the Conformer encoder\n"
    "  --mm-tower-lr X           their learning rate (default --lr)\n"
    "\n"
    "checkpoints and metrics:\n"
    "  --save-path DIR           write DIR/step-N/ (released layout + optimizer and data\n"
    "                            state) and DIR/latest; always after the last step\n"
    "  --save-interval N         also every N steps\n"
    "  --resume DIR              continue from DIR/latest (or a step folder) exactly; repeat the\n"
    "                            run's options (those that shape its data and rollouts are checked;\n"
    "                            docs/training.md, docs/rl.md \"Resuming a run\")\n"
    "  --metrics-log-dir DIR     metrics.jsonl and TensorBoard event files\n"
    "\n"
    "grpo/gspo/ppo (rows {\"prompt\": string or messages, ...fields the reward reads}):\n"
    "  --n-samples N             completions per prompt, the group (default 4; ppo: 1)\n"
    "  --temperature X, --top-k N, --top-p X   rollout sampling (default 1, off, 1)\n"
    "  --greedy                  greedy rollouts (temperature 0)\n"
    "  --max-running-prompts N   completions the rollout engine decodes together (default\n"
    "                            --batch-size x --n-samples)\n"
    "  --max-context-len N       prompt + completion limit of a rollout (default: the model's)\n"
    "  --reward exact|math|regex:PATTERN   a built-in reward (docs/rl.md)\n"
    "  --reward-cmd CMD          a program: one JSON record per line in, one number per line out\n"
    "  --reward-timeout-s X      per record of --reward-cmd (default 30)\n"
    "  --overlong-buffer-len N   DAPO's soft overlong penalty: from --max-new-tokens - N tokens\n"
    "                            on, the reward falls linearly to -factor at --max-new-tokens\n"
    "  --overlong-penalty-factor X   that factor (default 1)\n"
    "  --grpo-clip-eps X         GRPO token ratio clip (default 0.2)\n"
    "  --grpo-clip-eps-high X    the upper clip, 1 + X (DAPO's clip-higher; default --grpo-clip-eps)\n"
    "  --loss-agg-mode MODE      GRPO: token-mean (default), seq-mean-token-mean, or\n"
    "                            seq-mean-token-sum-norm (Dr. GRPO: / (N x --max-new-tokens))\n"
    "  --scale-rewards group|batch|none   advantages divided by the group's reward std\n"
    "                            (default), the batch's, or not at all (Dr. GRPO)\n"
    "  --adv-estimator NAME      grpo (default), rloo (leave-one-out baseline),\n"
    "                            reinforce_plus_plus (rewards whitened over the batch's tokens) or\n"
    "                            reinforce_plus_plus_baseline (group mean subtracted, then\n"
    "                            whitened): verl's algorithm.adv_estimator; grpo/gspo\n"
    "  --filter-groups           DAPO's dynamic sampling (grpo/gspo): drop the groups whose\n"
    "                            samples all scored alike and roll out the next prompts until\n"
    "                            --batch-size groups remain\n"
    "  --max-num-gen-batches N   batches of prompts a step may roll out for it (default 10); a\n"
    "                            step with no group left after them stops the run\n"
    "  --gspo-clip-eps X         GSPO sequence ratio clip (default 3e-4)\n"
    "  --drop-rollout-state      free the engine and its KV cache after each rollout\n"
    "  --agent-cmd CMD           agentic rollouts: run `/bin/sh -c CMD` per prompt and sample with\n"
    "                            the row on stdin and ARENO_BASE_URL (an OpenAI-compatible server\n"
    "                            over the policy on 127.0.0.1) and ARENO_TRAJECTORY_ID in its\n"
    "                            environment; requests sent with the header X-Areno-Trajectory: ID\n"
    "                            are recorded; its last stdout line is {\"trajectory_id\": \"ID\",\n"
    "                            \"reward\": X, \"turn_rewards\": [X, ...]} (reward optional: else\n"
    "                            --reward/--reward-cmd scores the last answer; turn_rewards\n"
    "                            optional, one per recorded request: grpo/gspo add them to the\n"
    "                            reward, ppo puts each on its turn's last token); grpo/gspo/ppo.\n"
    "                            docs/rl.md, \"Agentic rollouts\"\n"
    "  --agent-timeout-s X       per agent run; it is killed after (default 300)\n"
    "  --agent-concurrency N     agents running at once (default 0: all of the step's)\n"
    "  --train-tool-results      also train on the context between an agent's answers (tool\n"
    "                            results, later prompts); default: masked\n"
    "  --skip-failed-agents      a failed agent run (exit status, signal, timeout, bad last line,\n"
    "                            unrecorded id) is reported on stderr and left out of the step\n"
    "                            (its group normalised over the runs that finished) instead of\n"
    "                            stopping the run; a step whose runs all failed still stops it\n"
    "\n"
    "dpo (rows {\"prompt\": string or messages, \"chosen\": string, \"rejected\": string}):\n"
    "  --dpo-beta X              the DPO temperature beta (default 0.1)\n"
    "  --dpo-loss-type NAME      sigmoid (default), robust, hinge or ipo (TRL's loss_type;\n"
    "                            ipo on log-probabilities averaged over each response)\n"
    "  --dpo-label-smoothing X   conservative labels in [0, 0.5) for sigmoid (cDPO) and\n"
    "                            robust (default 0)\n"
    "  --ref-ckpt DIR            the reference model (default: the starting policy); its\n"
    "                            log-probabilities are computed once, before the first step\n"
    "\n"
    "ppo (rows as grpo; docs/rl.md \"The PPO loop\"):\n"
    "  --gamma X, --lam X        GAE discount and lambda (default 1, 1)\n"
    "  --clip-eps X              policy ratio clip (default 0.2)\n"
    "  --clip-ratio-c X          dual clip for negative advantages, 0 = off (default 3)\n"
    "  --value-clip-eps X        value clip around the rollout's values (default 0.5)\n"
    "  --value-loss-coef X       weight of the value loss (default 1)\n"
    "  --ppo-epochs N            passes over each batch (default 1)\n"
    "  --ppo-mini-batch-size N   prompts per optimizer step within a pass (default: the\n"
    "                            batch, one step per pass); the learning rate moves once\n"
    "                            per training step however many updates it takes\n"
    "  --critic-ckpt DIR         a separate critic model (and DIR/value_head.safetensors when\n"
    "                            present); default: a value head on the policy's hidden states\n"
    "                            (loaded from --ckpt's value_head.safetensors when present)\n"
    "  --critic-lr X             the critic's learning rate (default --lr)\n"
    "  --critic-warmup-steps N   the first N steps train only the critic (default 0)\n"
    "  --use-kl-loss             add a KL loss to a frozen copy of the starting policy\n"
    "  --kl-loss-coef X          its weight (default 0.001)\n"
    "  --kl-loss-type low_var_kl the KL estimator (only low_var_kl)\n"
    "  --use-kl-in-reward        subtract beta x a per-token KL penalty to a frozen copy of the\n"
    "                            starting policy from the token rewards (verl's use_kl_in_reward)\n"
    "  --kl-penalty NAME         kl (k1, default), abs, mse (k2) or low_var_kl (k3)\n"
    "  --kl-coef X               beta (the adaptive controller's start; default 0.001)\n"
    "  --kl-ctrl fixed|adaptive  keep beta, or steer it towards --kl-target (default fixed)\n"
    "  --kl-target X             the adaptive controller's KL target (default 0.1)\n"
    "  --kl-horizon N            the adaptive controller's horizon (default 10000)\n";

// Runs `CMD FILE` through /bin/sh with FILE as "$1" (no quoting of the path
// into the command) and writes its stdout to `out`.
void run_loader(const std::string& cmd, const fs::path& dataset, const fs::path& out) {
  const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error(fmt::format("{}: cannot create: {}", out.string(), std::strerror(errno)));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd, STDOUT_FILENO);
  const std::string script = cmd + " \"$1\"";
  const std::string path = dataset.string();
  const char* argv[] = {"/bin/sh", "-c", script.c_str(), "areno-dataset-loader", path.c_str(), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/bin/sh", &fa, nullptr, const_cast<char* const*>(argv), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fd);
  if (rc != 0) throw std::runtime_error(fmt::format("--dataset-loader-cmd: cannot start /bin/sh: {}", std::strerror(rc)));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw std::runtime_error(fmt::format("--dataset-loader-cmd: waitpid: {}", std::strerror(errno)));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error(fmt::format("--dataset-loader-cmd '{}' on {} failed ({})", cmd, path,
                                         WIFEXITED(status) ? fmt::format("exit status {}", WEXITSTATUS(status))
                                                           : fmt::format("signal {}", WTERMSIG(status))));
}

// A temporary file removed when it goes out of scope.
struct TempFile {
  fs::path path;
  ~TempFile() {
    std::error_code ec;
    if (!path.empty()) fs::remove(path, ec);
  }
};

// What a save writes besides the model: the demo's tokenizer files.
std::function<void(const fs::path&)> extra_files(const ServedModel& sm) {
  return [&sm](const fs::path& tmp) {
    if (sm.demo) phi4mm::write_tokenizer_files(*sm.tokenizer, tmp);
  };
}

// Where a run starts from and what it writes.
struct RunDirs {
  std::string ckpt;   // --ckpt: the checkpoint the run started from ("": the demo model)
  fs::path step_dir;  // --resume: the step folder the run continues from ("": a fresh run)
  std::string metrics_dir, save_path;
  int64_t save_interval = 0;
  // Where a save copies tokenizer and processor files from.
  fs::path source() const { return step_dir.empty() ? fs::path(ckpt) : step_dir; }
};

// A folder as a resumed run compares it: absolute and normalised ("" stays "").
std::string run_path(const std::string& dir) {
  return dir.empty() ? std::string() : fs::weakly_canonical(fs::absolute(dir)).string();
}

// After a trainer loaded its state from dirs.step_dir.
template <typename Trainer>
void report_resume(const Trainer& trainer, const RunDirs& dirs) {
  fmt::print(stderr, "resumed from {} at step {}\n", dirs.step_dir.string(), trainer.state().step);
}

// `--lora-rank`: adds the user adapter, or checks that the checkpoint's (a
// resumed or continued run) is the one asked for.
void add_user_lora(phi4mm::Phi4MMForCausalLM& m, const phi4mm::LoraConfig& l, uint64_t seed,
                   const std::string& dir) {
  if (const auto& have = m.config().user_lora) {
    if (have->r != l.r || have->alpha != l.alpha || have->dropout != l.dropout || have->targets != l.targets)
      throw std::invalid_argument(fmt::format(
          "--lora-rank: {} has a user LoRA already (rank {}, alpha {}, dropout {}, targets {}) and these flags ask "
          "for another; repeat its settings to train it on", dir.empty() ? "the model" : dir, have->r,
          have->alpha, have->dropout, fmt::join(have->targets, ",")));
    return;
  }
  m.add_user_lora(l, seed);
  int64_t n = 0;
  for (auto& [name, p] : m.named_parameters())
    if (train::is_user_lora(name)) n += p.numel();
  fmt::print(stderr, "user LoRA: rank {}, alpha {}, dropout {}, on {} ({} parameters)\n", l.r, l.alpha, l.dropout,
             fmt::join(l.targets, ","), n);
}

struct RlFlags {
  train::rl::RlOptions options;
  train::rl::PpoTrainOptions ppo;
  std::string reward, reward_cmd, critic_ckpt, kl_loss_type = "low_var_kl";
  std::optional<phi4mm::LoraConfig> user_lora;  // --lora-rank: the separate critic gets one too
  double reward_timeout_s = 30;
  int64_t overlong_buffer_len = 0;  // 0: no overlong penalty
  double overlong_penalty_factor = 1.0;
  // The reward options a resumed run must repeat.
  nlohmann::json reward_keys() const {
    nlohmann::json k = {{"--reward", reward}, {"--reward-cmd", reward_cmd}};
    if (overlong_buffer_len > 0)
      k["--overlong-buffer-len"] = fmt::format("{} x {}", overlong_buffer_len, overlong_penalty_factor);
    return k;
  }
};

// --skip-failed-agents: each run the step left out, on stderr before its progress line.
void report_skipped_agents(const train::rl::RlStepStats& st) {
  for (const std::string& m : st.agent_failures) fmt::print(stderr, "skipped: {}\n", m);
}

// The prompt rows of grpo/gspo/ppo, reported.
train::PromptDataset load_prompts(const ServedModel& sm, const fs::path& dataset, const train::DatasetOptions& dopts) {
  train::PromptDataset data = train::load_prompt_dataset(dataset, *sm.tokenizer, dopts);
  fmt::print(stderr, "dataset {}: {} prompts ({} bad rows skipped, {} too long dropped)\n", dataset.string(),
             data.rows.size(), data.bad_rows, data.too_long);
  return data;
}

// --reward or --reward-cmd; null with neither (--agent-cmd, whose agents print rewards).
std::unique_ptr<train::rl::RewardFn> make_rl_reward(const RlFlags& f) {
  std::unique_ptr<train::rl::RewardFn> r;
  if (!f.reward_cmd.empty()) {
    train::rl::RewardProcessOptions ro;
    ro.timeout_s = f.reward_timeout_s;
    r = std::make_unique<train::rl::RewardProcess>(f.reward_cmd, ro);
  } else if (!f.reward.empty()) {
    r = train::rl::make_reward(f.reward);
  }
  if (r && f.overlong_buffer_len > 0)
    r = train::rl::with_overlong_penalty(std::move(r), f.options.rollout.max_new_tokens, f.overlong_buffer_len,
                                         f.overlong_penalty_factor);
  return r;
}

int64_t trainable_numel(const AdamW& optimizer) {
  int64_t n = 0;
  for (const ParamGroup& g : optimizer.param_groups())
    for (const Tensor& p : g.params) n += p.numel();
  return n;
}

// One step of an RL trainer as the command reports it.
struct StepReport {
  int64_t step;
  std::string line;
  double loss;
  train::Scalars scalars;
};

// The step loop every RL trainer shares: progress line, a finite loss,
// metrics, checkpoints. `step()` runs one step and returns its StepReport.
template <typename Trainer, typename Step>
int run_rl_loop(Trainer& trainer, Step step, const ServedModel& sm, const RunDirs& dirs) {
  std::optional<train::MetricsWriter> metrics;
  // A resumed run keeps the metrics up to its step and appends.
  if (!dirs.metrics_dir.empty()) metrics.emplace(dirs.metrics_dir, trainer.state().step);
  while (!trainer.done()) {
    const StepReport r = step();
    fmt::print("{}\n", r.line);
    std::fflush(stdout);
    if (!std::isfinite(r.loss))
      throw std::runtime_error(fmt::format("step {}: the loss is not finite ({}); stopping", r.step, r.loss));
    if (metrics) metrics->write(r.step, r.scalars);
    if (!dirs.save_path.empty() && (trainer.done() || (dirs.save_interval > 0 && r.step % dirs.save_interval == 0)))
      fmt::print(stderr, "saved {}\n", trainer.save_checkpoint(dirs.save_path, dirs.source(), extra_files(sm)).string());
  }
  return 0;
}

// --algo grpo|gspo: prompts, rollouts, rewards, GrpoTrainer steps.
int train_rl(RlFlags f, const ServedModel& sm, const fs::path& dataset, const train::DatasetOptions& dopts,
             const RunDirs& dirs) {
  train::PromptDataset data = load_prompts(sm, dataset, dopts);
  f.options.run_keys = f.reward_keys();
  train::rl::GrpoTrainer trainer(sm.model, sm.tokenizer, std::move(data.rows), f.options, make_rl_reward(f));
  if (!dirs.step_dir.empty()) {
    trainer.load_state(dirs.step_dir);
    report_resume(trainer, dirs);
  }
  fmt::print(stderr, "{}: training {} of {} parameters for {} steps ({} per epoch), {} {} per prompt\n",
             train::rl::rl_algo_name(f.options.algo), trainable_numel(trainer.optimizer()),
             sm.model->num_parameters(), trainer.total_steps(), trainer.steps_per_epoch(), f.options.rollout.n_samples,
             f.options.agent.cmd.empty() ? "completions" : "agent runs");
  return run_rl_loop(
      trainer,
      [&] {
        const train::rl::RlStepStats st = trainer.step();
        report_skipped_agents(st);
        return StepReport{st.step, train::rl::format_rl_progress(st, trainer.total_steps()), st.loss,
                          train::rl::rl_scalars(st)};
      },
      sm, dirs);
}

// --algo ppo: prompts, rollouts, rewards, a critic (a value head on the
// policy, or --critic-ckpt), a frozen reference only with --use-kl-loss, PpoTrainer steps.
int train_ppo(RlFlags f, const ServedModel& sm, const fs::path& dataset, const train::DatasetOptions& dopts,
              const std::string& device, const std::string& dtype, const RunDirs& dirs) {
  train::PromptDataset data = load_prompts(sm, dataset, dopts);
  const bool resuming = !dirs.step_dir.empty();
  ModelNeeds needs;
  needs.tokenizer = false;
  // A resumed run's separate critic is the one its step folder saved.
  std::shared_ptr<phi4mm::Phi4MMForCausalLM> critic;
  if (!f.critic_ckpt.empty())
    critic = load_served_model(resuming ? (dirs.step_dir / "critic").string() : f.critic_ckpt, device, dtype, needs).model;
  if (critic && f.user_lora) add_user_lora(*critic, *f.user_lora, f.ppo.loop.seed + 1, f.critic_ckpt);
  // The KL reference is the starting policy, --ckpt, also when resuming.
  std::shared_ptr<const phi4mm::Phi4MMForCausalLM> reference;
  f.ppo.run_keys = f.reward_keys();
  if (f.ppo.ppo.use_kl_loss || f.ppo.use_kl_in_reward) {
    reference = load_served_model(dirs.ckpt, device, dtype, needs).model;  // frozen: no optimizer
    f.ppo.run_keys["--ckpt"] = run_path(dirs.ckpt);
  }
  train::rl::PpoTrainer trainer(sm.model, sm.tokenizer, std::move(data.rows), f.ppo, make_rl_reward(f), critic,
                                reference);
  // The value head of a step folder this run starts from (a critic folder or
  // the policy's); a resumed run's comes with its state.
  const fs::path head_dir = !f.critic_ckpt.empty() ? fs::path(f.critic_ckpt) : fs::path(dirs.ckpt);
  const fs::path head_file = head_dir / train::rl::kValueHeadFile;
  const bool head_loaded = !resuming && !head_dir.empty() && fs::exists(head_file);
  if (head_loaded) trainer.value_head().load(head_file);
  if (resuming) {
    trainer.load_state(dirs.step_dir);
    report_resume(trainer, dirs);
  }
  std::vector<std::string> kl_uses;
  if (f.ppo.ppo.use_kl_loss) kl_uses.push_back("KL loss");
  if (f.ppo.use_kl_in_reward) kl_uses.push_back("KL in the reward");
  const std::string kl_note =
      kl_uses.empty() ? "" : fmt::format("; {} to a frozen copy of the starting policy", fmt::join(kl_uses, " and "));
  fmt::print(stderr, "ppo: training {} of {} parameters for {} steps ({} per epoch), {} {} per prompt; "
             "critic: {} ({} parameters, value head {}){}{}\n",
             trainable_numel(trainer.optimizer()), sm.model->num_parameters(), trainer.total_steps(),
             trainer.steps_per_epoch(), f.ppo.rollout.n_samples, f.ppo.agent.cmd.empty() ? "completions" : "agent runs",
             critic ? "the model of " + f.critic_ckpt : std::string("a value head on the policy"),
             trainable_numel(trainer.critic_optimizer()),
             resuming ? "from the step folder" : head_loaded ? "from " + head_file.string() : "zero-initialised",
             f.ppo.critic_warmup_steps > 0 ? fmt::format("; critic warm-up {} steps", f.ppo.critic_warmup_steps) : "",
             kl_note);
  return run_rl_loop(
      trainer,
      [&] {
        const train::rl::PpoStepStats st = trainer.step();
        report_skipped_agents(st.rl);
        return StepReport{st.rl.step, train::rl::format_ppo_progress(st, trainer.total_steps()), st.rl.loss,
                          train::rl::ppo_scalars(st)};
      },
      sm, dirs);
}

// --algo dpo: preference pairs, reference sums once, DpoTrainer steps.
int train_dpo(train::rl::DpoTrainOptions o, const ServedModel& sm, const fs::path& dataset,
              const train::DatasetOptions& dopts, const std::string& ref_ckpt, const std::string& device,
              const std::string& dtype, const RunDirs& dirs) {
  train::rl::DpoDataset data = train::rl::load_dpo_dataset(dataset, *sm.tokenizer, dopts);
  fmt::print(stderr, "dataset {}: {} pairs ({} bad rows skipped, {} too long dropped)\n", dataset.string(),
             data.rows.size(), data.bad_rows, data.too_long);
  o.run_keys = {{"--ref-ckpt", run_path(ref_ckpt)}};
  std::optional<train::rl::DpoTrainer> trainer;
  if (!dirs.step_dir.empty()) {
    // The reference sums come from the step folder (computed when the run started).
    trainer.emplace(sm.model, std::move(data.rows), o, nullptr, dirs.step_dir);
    report_resume(*trainer, dirs);
  } else if (ref_ckpt.empty()) {
    trainer.emplace(sm.model, std::move(data.rows), o);
  } else {
    // Loaded as the policy is, used once for the reference sums, then dropped.
    ModelNeeds needs;
    needs.tokenizer = false;
    const ServedModel ref = load_served_model(ref_ckpt, device, dtype, needs);
    trainer.emplace(sm.model, std::move(data.rows), o, ref.model.get());
  }
  fmt::print(stderr, "dpo: training {} of {} parameters for {} steps ({} per epoch), {} loss, beta {}{}; reference ({}) "
             "log-probabilities {}\n", trainable_numel(trainer->optimizer()), sm.model->num_parameters(), trainer->total_steps(),
             trainer->steps_per_epoch(), train::rl::dpo_loss_type_name(o.dpo.loss_type), o.dpo.beta,
             o.dpo.label_smoothing > 0 ? fmt::format(", label smoothing {}", o.dpo.label_smoothing) : "",
             ref_ckpt.empty() ? "the starting policy" : ref_ckpt,
             dirs.step_dir.empty() ? fmt::format("in {:.2f}s", trainer->reference_seconds())
                                   : std::string("from the step folder"));
  return run_rl_loop(
      *trainer,
      [&] {
        const train::rl::DpoStepStats st = trainer->step();
        return StepReport{st.step, train::rl::format_dpo_progress(st, trainer->total_steps()), st.dpo.loss,
                          train::rl::dpo_scalars(st)};
      },
      sm, dirs);
}

}  // namespace

int cmd_train(const Args& args) {
  std::string ckpt, algo = "sft", dataset, loader_cmd, media_root, train_on = "all", device = "cpu", dtype;
  std::string lm_trainable, embed_rows = "all", lora_targets = "all", lora_dir;
  int64_t lora_rank = 0;
  std::optional<double> lora_alpha;
  double lora_dropout = 0;
  std::string decay_style = "cosine", save_path, resume, metrics_dir;
  std::string ref_ckpt;
  bool skip_bad = false;
  int64_t max_prompt = 0, max_new = 0, save_interval = 0, grad_accum = 0;
  std::optional<int64_t> mini_bs;
  train::SftOptions o;
  auto num = [](const std::string& flag, double& dst, double min) {
    return [&dst, flag, min](const std::string& v) { dst = parse_double_flag(flag, v, min); };
  };
  Flags flags("train", kTrainUsage);
  flags.value("--ckpt", ckpt).value("--model-path", ckpt).value("--algo", algo).value("--dataset-path", dataset);
  flags.value("--dataset-loader-cmd", loader_cmd).value("--media-root", media_root).value("--train-on", train_on);
  flags.toggle("--skip-bad-rows", skip_bad);
  flags.compute_threads();
  flags.integer("--max-prompt-tokens", max_prompt, 1).integer("--max-new-tokens", max_new, 1);
  flags.integer("--epochs", o.epochs, 1).integer("--max-steps", o.max_steps, 1).integer("--batch-size", o.batch_size, 1);
  flags.value("--mini-bs", [&](const std::string& v) { mini_bs = parse_int_flag("--mini-bs", v, 1); });
  flags.integer("--gradient-accumulation-steps", grad_accum, 1);
  flags.value("--lr", num("--lr", o.lr, 0)).value("--min-lr", num("--min-lr", o.min_lr, 0));
  flags.integer("--lr-decay-steps", o.lr_decay_steps, 1).value("--lr-decay-style", decay_style);
  flags.integer("--warmup-steps", o.warmup_steps, 0);
  flags.value("--adam-beta1", num("--adam-beta1", o.adam_beta1, 0)).value("--adam-beta2", num("--adam-beta2", o.adam_beta2, 0));
  flags.value("--adam-eps", num("--adam-eps", o.adam_eps, 0)).value("--weight-decay", num("--weight-decay", o.weight_decay, 0));
  flags.value("--grad-clip-norm", num("--grad-clip-norm", o.grad_clip_norm, 0));
  flags.toggle("--activation-checkpointing", o.activation_checkpointing, true);
  flags.toggle("--no-activation-checkpointing", o.activation_checkpointing, false);
  flags.integer("--seed", o.seed, 0).toggle("--no-shuffle", o.shuffle, false);
  flags.integer("--loss-chunk-rows", o.loss_chunk_rows, 1);
  flags.value("--device", device).value("--dtype", dtype).value("--lm-trainable", lm_trainable);
  flags.value("--embed-rows", embed_rows);
  flags.integer("--lora-rank", lora_rank, 1).value("--lora-targets", lora_targets).value("--lora", lora_dir);
  flags.value("--lora-alpha", [&](const std::string& v) { lora_alpha = parse_double_flag("--lora-alpha", v, 0); });
  flags.value("--lora-dropout", num("--lora-dropout", lora_dropout, 0));
  flags.toggle("--unfreeze-mm-projector", o.groups.projector, true).toggle("--unfreeze-mm-tower", o.groups.tower, true);
  flags.value("--mm-projector-lr", num("--mm-projector-lr", o.mm_projector_lr, 0));
  flags.value("--mm-tower-lr", num("--mm-tower-lr", o.mm_tower_lr, 0));
  flags.value("--save-path", save_path).integer("--save-interval", save_interval, 1).value("--resume", resume);
  flags.value("--metrics-log-dir", metrics_dir);
  RlFlags rl;
  train::rl::RolloutOptions& ro = rl.options.rollout;
  std::optional<int64_t> n_samples;
  flags.value("--n-samples", [&](const std::string& v) { n_samples = parse_int_flag("--n-samples", v, 1); });
  flags.value("--temperature", num("--temperature", ro.temperature, 0));
  std::optional<int64_t> max_running;
  flags.value("--max-running-prompts",
              [&](const std::string& v) { max_running = parse_int_flag("--max-running-prompts", v, 1); });
  flags.integer("--max-context-len", ro.max_context_len, 1);
  flags.integer("--top-k", ro.top_k, 0).value("--top-p", num("--top-p", ro.top_p, 0)).toggle("--greedy", ro.greedy);
  flags.value("--reward", rl.reward).value("--reward-cmd", rl.reward_cmd);
  flags.value("--reward-timeout-s", num("--reward-timeout-s", rl.reward_timeout_s, 0));
  flags.integer("--overlong-buffer-len", rl.overlong_buffer_len, 1);
  flags.value("--overlong-penalty-factor", num("--overlong-penalty-factor", rl.overlong_penalty_factor, 0));
  flags.value("--grpo-clip-eps", num("--grpo-clip-eps", rl.options.grpo.clip_eps, 0));
  flags.value("--gspo-clip-eps", num("--gspo-clip-eps", rl.options.gspo.clip_eps, 0));
  flags.value("--grpo-clip-eps-high", num("--grpo-clip-eps-high", rl.options.grpo.clip_eps_high, 0));
  std::optional<std::string> loss_agg, scale_rewards, adv_estimator;
  flags.value("--adv-estimator", [&](const std::string& v) { adv_estimator = v; });
  flags.value("--loss-agg-mode", [&](const std::string& v) { loss_agg = v; });
  flags.value("--scale-rewards", [&](const std::string& v) { scale_rewards = v; });
  std::optional<int64_t> max_gen_batches;
  flags.toggle("--filter-groups", rl.options.filter_groups);
  flags.value("--max-num-gen-batches",
              [&](const std::string& v) { max_gen_batches = parse_int_flag("--max-num-gen-batches", v, 1); });
  flags.toggle("--drop-rollout-state", ro.drop_rollout_state);
  train::rl::AgentOptions& ag = rl.options.agent;
  flags.value("--agent-cmd", ag.cmd).value("--agent-timeout-s", num("--agent-timeout-s", ag.timeout_s, 0));
  flags.integer("--agent-concurrency", ag.concurrency, 0).toggle("--train-tool-results", ag.train_context);
  flags.toggle("--skip-failed-agents", ag.skip_failed);
  train::rl::PpoOptions& ppo = rl.ppo.ppo;
  flags.value("--gamma", num("--gamma", rl.ppo.gamma, 0)).value("--lam", num("--lam", rl.ppo.lam, 0));
  flags.value("--clip-eps", num("--clip-eps", ppo.clip_eps, 0)).value("--clip-ratio-c", num("--clip-ratio-c", ppo.clip_ratio_c, 0));
  flags.value("--value-clip-eps", num("--value-clip-eps", ppo.value_clip_eps, 0));
  flags.value("--value-loss-coef", num("--value-loss-coef", ppo.value_loss_coef, 0));
  flags.integer("--ppo-epochs", rl.ppo.ppo_epochs, 1).value("--critic-ckpt", rl.critic_ckpt);
  flags.value("--critic-lr", num("--critic-lr", rl.ppo.critic_lr, 0));
  flags.integer("--critic-warmup-steps", rl.ppo.critic_warmup_steps, 0);
  flags.toggle("--use-kl-loss", ppo.use_kl_loss).value("--kl-loss-coef", num("--kl-loss-coef", ppo.kl_loss_coef, 0));
  flags.value("--kl-loss-type", rl.kl_loss_type);
  flags.integer("--ppo-mini-batch-size", rl.ppo.ppo_mini_batch_size, 1);
  std::string kl_penalty = "kl", kl_ctrl = "fixed";
  flags.toggle("--use-kl-in-reward", rl.ppo.use_kl_in_reward).value("--kl-penalty", kl_penalty);
  flags.value("--kl-coef", num("--kl-coef", rl.ppo.kl_ctrl.value, 0)).value("--kl-ctrl", kl_ctrl);
  flags.value("--kl-target", num("--kl-target", rl.ppo.kl_ctrl.target, 0));
  flags.integer("--kl-horizon", rl.ppo.kl_ctrl.horizon, 1);
  train::rl::DpoTrainOptions dpo;
  flags.value("--dpo-beta", num("--dpo-beta", dpo.dpo.beta, 0)).value("--ref-ckpt", ref_ckpt);
  std::string dpo_loss_type = "sigmoid";
  std::optional<double> dpo_label_smoothing;
  flags.value("--dpo-loss-type", dpo_loss_type);
  flags.value("--dpo-label-smoothing",
              [&](const std::string& v) { dpo_label_smoothing = parse_double_flag("--dpo-label-smoothing", v, 0); });
  if (auto rc = flags.parse(args)) return *rc;

  const bool is_ppo = algo == "ppo", is_rl = algo == "grpo" || algo == "gspo" || is_ppo, is_dpo = algo == "dpo";
  if (algo != "sft" && !is_rl && !is_dpo)
    throw std::invalid_argument(fmt::format("--algo: '{}' is not supported (sft, grpo, gspo, dpo, ppo)", algo));
  if (!is_dpo && !ref_ckpt.empty()) throw std::invalid_argument("--ref-ckpt: only with --algo dpo");
  dpo.dpo.loss_type = train::rl::parse_dpo_loss_type(dpo_loss_type, "--dpo-loss-type");
  dpo.dpo.label_smoothing = dpo_label_smoothing.value_or(0.0);
  if (!is_dpo && (dpo_loss_type != "sigmoid" || dpo_label_smoothing))
    throw std::invalid_argument("--dpo-loss-type, --dpo-label-smoothing: only with --algo dpo");
  if (!is_ppo && !rl.critic_ckpt.empty()) throw std::invalid_argument("--critic-ckpt: only with --algo ppo");
  if (!is_ppo && ppo.use_kl_loss)
    throw std::invalid_argument("--use-kl-loss: only with --algo ppo (grpo/gspo run without a KL term)");
  if (!is_ppo && rl.ppo.use_kl_in_reward) throw std::invalid_argument("--use-kl-in-reward: only with --algo ppo");
  if ((loss_agg || scale_rewards || adv_estimator) && !(is_rl && !is_ppo))
    throw std::invalid_argument("--loss-agg-mode, --scale-rewards, --adv-estimator: only with --algo grpo|gspo");
  if (adv_estimator) rl.options.adv_estimator = train::rl::parse_adv_estimator(*adv_estimator, "--adv-estimator");
  if (loss_agg) rl.options.grpo.agg = train::rl::parse_loss_agg(*loss_agg, "--loss-agg-mode");
  if (scale_rewards) rl.options.scale_rewards = train::rl::parse_reward_scale(*scale_rewards, "--scale-rewards");
  if ((rl.options.filter_groups || max_gen_batches) && !(is_rl && !is_ppo))
    throw std::invalid_argument("--filter-groups, --max-num-gen-batches: only with --algo grpo|gspo");
  if (max_gen_batches && !rl.options.filter_groups)
    throw std::invalid_argument("--max-num-gen-batches: only with --filter-groups");
  if (max_gen_batches) rl.options.max_num_gen_batches = *max_gen_batches;
  rl.ppo.kl_penalty = train::rl::parse_kl_penalty(kl_penalty, "--kl-penalty");
  if (kl_ctrl != "fixed" && kl_ctrl != "adaptive")
    throw std::invalid_argument(fmt::format("--kl-ctrl: '{}' is not a controller (fixed, adaptive)", kl_ctrl));
  rl.ppo.kl_ctrl.adaptive = kl_ctrl == "adaptive";
  if (rl.kl_loss_type != "low_var_kl")
    throw std::invalid_argument(fmt::format("--kl-loss-type: '{}' is not supported (low_var_kl)", rl.kl_loss_type));
  // (A resumed run's critic comes from its step folder.)
  if (!rl.critic_ckpt.empty() && resume.empty() && !fs::is_directory(rl.critic_ckpt))
    throw std::invalid_argument(fmt::format("--critic-ckpt {}: no such folder", rl.critic_ckpt));
  ro.n_samples = n_samples.value_or(is_ppo ? 1 : 4);
  if (!is_rl && (max_running || ro.max_context_len > 0))
    throw std::invalid_argument("--max-running-prompts, --max-context-len: only with --algo grpo|gspo|ppo (rollouts)");
  ro.engine.max_running = max_running.value_or(o.batch_size * ro.n_samples);
  if (is_rl) {
    if (!rl.reward.empty() && !rl.reward_cmd.empty())
      throw std::invalid_argument("--reward and --reward-cmd: give one of them, not both");
    if (ag.train_context && ag.cmd.empty())
      throw std::invalid_argument("--train-tool-results: only with --agent-cmd");
    if (ag.skip_failed && ag.cmd.empty())
      throw std::invalid_argument("--skip-failed-agents: only with --agent-cmd");
    if (rl.reward.empty() && rl.reward_cmd.empty() && ag.cmd.empty())
      throw std::invalid_argument(fmt::format("--algo {} needs exactly one of --reward exact|math|regex:PATTERN and "
                                              "--reward-cmd CMD{}", algo,
                                              " (optional with --agent-cmd, whose agents may print rewards)"));
    if (!(rl.reward_timeout_s > 0)) throw std::invalid_argument("--reward-timeout-s: must be positive");
    if (!(ag.timeout_s > 0)) throw std::invalid_argument("--agent-timeout-s: must be positive");
  } else if (!ag.cmd.empty() || ag.train_context || ag.skip_failed) {
    throw std::invalid_argument("--agent-cmd, --train-tool-results, --skip-failed-agents: only with --algo "
                                "grpo|gspo|ppo");
  }
  if (dataset.empty()) {
    fmt::print(stderr, "areno train: --dataset-path is required\n\n{}", kTrainUsage);
    return 2;
  }
  if (!fs::exists(dataset)) throw std::runtime_error(fmt::format("--dataset-path {}: no such file", dataset));
  // grpo/gspo/ppo micro-batches count completions: --batch-size x --n-samples per step.
  const int64_t step_items = is_rl ? o.batch_size * ro.n_samples : o.batch_size;
  if (grad_accum > 0) {
    if (step_items % grad_accum != 0)
      throw std::invalid_argument(fmt::format("--gradient-accumulation-steps {} does not divide --batch-size {}{}",
                                              grad_accum, o.batch_size, is_rl ? " x --n-samples" : ""));
    if (mini_bs && *mini_bs != step_items / grad_accum)
      throw std::invalid_argument(fmt::format("--mini-bs {} contradicts --batch-size {} / --gradient-accumulation-steps {}",
                                              *mini_bs, o.batch_size, grad_accum));
    o.mini_bs = step_items / grad_accum;
  } else if (mini_bs) {
    o.mini_bs = *mini_bs;
  }
  o.mini_bs = std::min(o.mini_bs, step_items);
  o.decay = train::decay_style_from_name(decay_style);
  // The user adapter, checked before any weight is read.
  std::optional<phi4mm::LoraConfig> user_lora;
  if (lora_rank > 0) {
    phi4mm::LoraConfig l;
    l.r = lora_rank;
    l.alpha = lora_alpha.value_or(2.0 * double(lora_rank));
    l.dropout = lora_dropout;
    l.targets = phi4mm::parse_lora_targets(lora_targets, "--lora-targets");
    phi4mm::check_user_lora(l, "--lora-rank/--lora-alpha/--lora-dropout");
    user_lora = l;
  } else if (lora_alpha || lora_dropout != 0 || lora_targets != "all") {
    throw std::invalid_argument("--lora-alpha, --lora-dropout, --lora-targets: only with --lora-rank");
  }
  if (user_lora && !lora_dir.empty())
    throw std::invalid_argument("--lora-rank and --lora: give one (a fresh adapter, or one from a PEFT folder)");
  const bool user_adapter = user_lora || !lora_dir.empty();
  o.groups.lm = train::lm_trainable_from_name(lm_trainable.empty() ? (user_adapter ? "user" : "all") : lm_trainable);
  o.groups.embed_rows = train::embed_rows_from_name(embed_rows);
  const train::TrainOn on = train::train_on_from_name(train_on);
  if (is_ppo) {
    if (max_new > 0) ro.max_new_tokens = max_new;
    rl.ppo.loop = o;
    rl.ppo.rollout = ro;
    rl.ppo.agent = ag;
    train::rl::validate(rl.ppo);
  } else if (is_rl) {
    rl.options.algo = train::rl::rl_algo_from_name(algo);
    rl.options.loop = o;
    if (max_new > 0) ro.max_new_tokens = max_new;
    train::rl::validate(rl.options);
  } else if (is_dpo) {
    dpo.loop = o;
    train::rl::validate(dpo);
  } else {
    train::validate(o);
  }
  // DAPO's overlong penalty adjusts the reward's scores up to the rollouts' --max-new-tokens.
  if (rl.overlong_buffer_len > 0) {
    if (!is_rl) throw std::invalid_argument("--overlong-buffer-len: only with --algo grpo|gspo|ppo");
    if (rl.reward.empty() && rl.reward_cmd.empty())
      throw std::invalid_argument("--overlong-buffer-len: needs --reward or --reward-cmd (it adjusts their scores)");
    train::rl::validate_overlong_penalty(ro.max_new_tokens, rl.overlong_buffer_len, rl.overlong_penalty_factor);
  }
  if (save_path.empty()) fmt::print(stderr, "areno train: no --save-path: the trained weights will not be saved\n");

  // The model: a step folder to resume, the checkpoint, or the demo.
  fs::path step_dir;
  if (!resume.empty()) step_dir = train::resolve_resume_dir(resume);
  const std::string model_dir = !step_dir.empty() ? step_dir.string() : ckpt;
  ModelNeeds needs;
  if (step_dir.empty()) needs.lora_dir = lora_dir;  // a resumed run's step folder holds the adapter
  ServedModel sm = load_served_model(model_dir, device, dtype, needs);
  if (!step_dir.empty() && !lora_dir.empty()) {
    // Resumed: the step folder's adapter continues; the flag must name one like it.
    const phi4mm::LoraConfig want = phi4mm::peft_lora_config(lora_dir, sm.model->config().text.num_hidden_layers);
    const std::optional<phi4mm::LoraConfig>& have = sm.model->config().user_lora;
    if (!have || have->r != want.r || have->alpha != want.alpha || have->targets != want.targets)
      throw std::invalid_argument(fmt::format(
          "--lora {}: the resumed run's adapter ({}) is not this folder's (rank {}, alpha {}, targets {}); resume with "
          "the flags of the run", lora_dir,
          have ? fmt::format("rank {}, alpha {}, targets {}", have->r, have->alpha, fmt::join(have->targets, ","))
               : std::string("none"),
          want.r, want.alpha, fmt::join(want.targets, ",")));
  }
  if (user_lora) add_user_lora(*sm.model, *user_lora, uint64_t(o.seed), model_dir);
  rl.user_lora = sm.model->config().user_lora;  // a separate PPO critic gets a fresh one like it

  // The rows, through the serving processor.
  train::DatasetOptions dopts;
  dopts.train_on = on;
  dopts.media_root = media_root;
  dopts.skip_bad_rows = skip_bad;
  dopts.max_prompt_tokens = max_prompt;
  dopts.max_new_tokens = max_new;
  dopts.image = sm.model->image_embed() != nullptr;
  dopts.image_max_crops = sm.model->config().vision.dynamic_hd;
  dopts.audio = sm.model->audio_embed() != nullptr;
  TempFile loaded;
  fs::path rows_file = dataset;
  if (!loader_cmd.empty()) {
    loaded.path = fs::temp_directory_path() / fmt::format("areno-loader-{}.jsonl", ::getpid());
    run_loader(loader_cmd, dataset, loaded.path);
    rows_file = loaded.path;
    if (dopts.media_root.empty()) dopts.media_root = fs::absolute(dataset).parent_path().string();
  }
  const RunDirs dirs{ckpt, step_dir, metrics_dir, save_path, save_interval};
  if (is_rl) {
    dopts.max_new_tokens = 0;  // the rollout's length, not a filter
    if (is_ppo) return train_ppo(rl, sm, rows_file, dopts, device, dtype, dirs);
    return train_rl(rl, sm, rows_file, dopts, dirs);
  }
  if (is_dpo) return train_dpo(dpo, sm, rows_file, dopts, ref_ckpt, device, dtype, dirs);
  train::SftDataset data = train::load_sft_dataset(rows_file, *sm.tokenizer, dopts);
  fmt::print(stderr, "dataset {}: {} rows ({} bad rows skipped, {} too long dropped)\n", dataset, data.rows.size(),
             data.bad_rows, data.too_long);

  train::SftTrainer trainer(sm.model, std::move(data.rows), o);
  if (!step_dir.empty()) {
    trainer.load_state(step_dir);
    report_resume(trainer, dirs);
  }
  int64_t trainable = 0;
  for (const ParamGroup& g : trainer.optimizer().param_groups())
    for (const Tensor& p : g.params) trainable += p.numel();
  fmt::print(stderr, "training {} of {} parameters for {} steps ({} per epoch)\n", trainable,
             sm.model->num_parameters(), trainer.total_steps(), trainer.steps_per_epoch());
  if (const int64_t rows = trainer.embed_rows_trained())
    fmt::print(stderr, "--embed-rows data: {} of the embedding's {} rows train (the dataset's token ids)\n", rows,
               sm.model->model->embed_tokens->weight.size(0));

  std::optional<train::MetricsWriter> metrics;
  if (!metrics_dir.empty()) metrics.emplace(metrics_dir, trainer.state().step);
  auto save = [&] {
    fmt::print(stderr, "saved {}\n", trainer.save_checkpoint(save_path, dirs.source(), extra_files(sm)).string());
  };
  const auto t0 = std::chrono::steady_clock::now();
  while (!trainer.done()) {
    const train::StepStats st = trainer.step();
    const double elapsed = train::seconds_since(t0);
    const double tps = st.seconds > 0 ? double(st.tokens) / st.seconds : 0;
    train::ProgressInfo pi;
    pi.step = st.step, pi.total_steps = trainer.total_steps(), pi.loss = st.loss, pi.lrs = st.lrs;
    pi.grad_norm = st.grad_norm, pi.tokens_per_s = tps, pi.elapsed_s = elapsed;
    // ETA from this run's steps only (a resumed run starts its clock at the resume step).
    fmt::print("{}\n", train::format_progress(pi));
    std::fflush(stdout);
    if (!std::isfinite(st.loss))
      throw std::runtime_error(fmt::format("step {}: the loss is not finite ({}); stopping", st.step, st.loss));
    if (metrics) {
      train::Scalars s = {{"train/loss", st.loss}, {"train/grad_norm", st.grad_norm}};
      for (auto& [g, lr] : st.lrs) s.emplace_back("train/lr/" + g, lr);
      s.insert(s.end(), {{"train/tokens", double(st.tokens)},
                         {"train/target_tokens", double(st.target_tokens)},
                         {"train/tokens_per_s", tps},
                         {"time/step_s", st.seconds},
                         {"memory/peak_rss_bytes", double(train::peak_rss_bytes())}});
      metrics->write(st.step, s);
    }
    if (!save_path.empty() && (trainer.done() || (save_interval > 0 && st.step % save_interval == 0))) save();
  }
  return 0;
}

}  // namespace areno::app
