#include "train/rl/dpo.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "nn/io/atomic_file.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "train/rl/rl_step.h"

namespace areno::train::rl {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// The row {"prompt", "response": row[field]} through make_sft_row (field is a string).
SftRow response_row(const tok::Tokenizer& tokenizer, const RawRow& row, const char* field, const std::string& file,
                    const DatasetOptions& options) {
  RawRow r{row.line, row.value, {}};
  r.value.erase("chosen");
  r.value.erase("rejected");
  r.value["response"] = row.value[field];
  return make_sft_row(tokenizer, r, file, options);
}

// The completion of a row whose one target turn starts at prompt_tokens.
std::vector<int64_t> completion_of(const SftRow& r) {
  std::vector<int64_t> out = first_answer_of(r);
  if (int64_t(out.size()) != r.target_tokens)
    throw std::logic_error(fmt::format("DPO row {}: the response's targets are not one run of tokens", r.line));
  return out;
}

}  // namespace

DpoRow make_dpo_row(const tok::Tokenizer& tokenizer, const RawRow& row, const std::string& file,
                    const DatasetOptions& options) {
  if (!row.error.empty()) throw DatasetError(file, row.line, "row", row.error);
  const json& v = row.value;
  if (!v.is_object())
    throw DatasetError(file, row.line, "row", fmt::format("a row must be an object (got {})", v.type_name()));
  if (!v.contains("prompt")) throw DatasetError(file, row.line, "prompt", "a DPO row needs a \"prompt\"");
  if (v.contains("messages"))
    throw DatasetError(file, row.line, "messages", "a DPO row gives its context as \"prompt\", not \"messages\"");
  for (const char* f : {"chosen", "rejected"})
    if (!v.contains(f) || !v[f].is_string())
      throw DatasetError(file, row.line, f, fmt::format("a DPO row needs \"{}\": a string", f));
  DatasetOptions o = options;
  o.train_on = TrainOn::last;
  SftRow c = response_row(tokenizer, row, "chosen", file, o);
  SftRow r = response_row(tokenizer, row, "rejected", file, o);
  // The processor renders the prompt the same way whatever the answer.
  if (c.prompt_tokens != r.prompt_tokens ||
      !std::equal(c.ids.begin(), c.ids.begin() + c.prompt_tokens, r.ids.begin()))
    throw std::logic_error(fmt::format("DPO row {}: the chosen and rejected rows have different prompt tokens", row.line));
  DpoRow out;
  out.chosen = completion_of(c);
  out.rejected = completion_of(r);
  out.prompt.ids = prompt_of(c);
  out.prompt.media = std::move(c.media);
  out.prompt.adapter = c.adapter;
  out.line = row.line;
  return out;
}

DpoDataset load_dpo_dataset(const fs::path& file, const tok::Tokenizer& tokenizer, const DatasetOptions& options) {
  return load_rows<DpoRow>(
      file, options, [&](const RawRow& raw) { return make_dpo_row(tokenizer, raw, file.string(), options); },
      [&](const DpoRow& row) {
        const int64_t longest = int64_t(std::max(row.chosen.size(), row.rejected.size()));
        return (options.max_prompt_tokens > 0 && int64_t(row.prompt.ids.size()) > options.max_prompt_tokens) ||
               (options.max_new_tokens > 0 && longest > options.max_new_tokens);
      });
}

PairLogp pair_logp(const phi4mm::Phi4MMForCausalLM& model, const std::vector<const DpoRow*>& rows,
                   const PolicyLogpOptions& options) {
  const int64_t R = int64_t(rows.size());
  std::vector<Prompt> prompts;
  std::vector<Sequence> seqs;
  prompts.reserve(rows.size());
  for (int64_t i = 0; i < R; ++i) {
    prompts.push_back(rows[size_t(i)]->prompt);
    seqs.push_back({i, rows[size_t(i)]->chosen, {}});
  }
  for (int64_t i = 0; i < R; ++i) seqs.push_back({i, rows[size_t(i)]->rejected, {}});
  const TokenLogp tl = policy_logp(model, prompts, seqs, options);
  const Tensor s = sequence_logp(tl.logp, tl.mask);  // [2R]: chosen, then rejected
  return {s.narrow(0, 0, R), s.narrow(0, R, R)};
}

void validate(const DpoTrainOptions& o) {
  train::validate(o.loop);
  if (o.loop.mini_bs > o.loop.batch_size)
    throw std::invalid_argument(fmt::format("--mini-bs: must be between 1 and --batch-size ({}), got {}",
                                            o.loop.batch_size, o.loop.mini_bs));
  if (o.loop.groups.embed_rows == EmbedRows::data)
    throw std::invalid_argument("--embed-rows data: not supported with --algo dpo (use all or none)");
  if (!(o.dpo.beta > 0)) throw std::invalid_argument("--dpo-beta: must be positive");
  if (!(o.dpo.label_smoothing >= 0 && o.dpo.label_smoothing < 0.5))
    throw std::invalid_argument("--dpo-label-smoothing: must be in [0, 0.5)");
  if (o.dpo.label_smoothing > 0 && o.dpo.loss_type != DpoLossType::sigmoid && o.dpo.loss_type != DpoLossType::robust)
    throw std::invalid_argument(fmt::format("--dpo-label-smoothing: only with --dpo-loss-type sigmoid or robust, not {}",
                                            dpo_loss_type_name(o.dpo.loss_type)));
}

DpoTrainer::DpoTrainer(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::vector<DpoRow> rows,
                       DpoTrainOptions options, const phi4mm::Phi4MMForCausalLM* reference,
                       const fs::path& resume_from)
    : model_(std::move(model)), rows_(std::move(rows)), options_(std::move(options)) {
  validate(options_);
  if (rows_.empty()) throw std::invalid_argument("the dataset has no preference pairs to train on");
  optimizer_ = make_training_optimizer(*model_, options_.loop, total_steps());
  disable_dropout(*model_);
  if (!resume_from.empty()) {
    if (reference) throw std::logic_error("DpoTrainer: a resumed run takes the saved reference sums, not a model");
    load_state(resume_from);
    return;
  }
  // The reference sums, once, in the dataset's order.
  const auto t0 = Clock::now();
  const phi4mm::Phi4MMForCausalLM& ref = reference ? *reference : *model_;
  PolicyLogpOptions po;
  po.chunk_rows = options_.loop.loss_chunk_rows;
  NoGradGuard ng;
  for (size_t b = 0; b < rows_.size(); b += size_t(options_.loop.mini_bs)) {
    std::vector<const DpoRow*> mb;
    for (size_t i = b; i < std::min(rows_.size(), b + size_t(options_.loop.mini_bs)); ++i) mb.push_back(&rows_[i]);
    const PairLogp p = pair_logp(ref, mb, po);
    for (double x : p.chosen.to_vector<double>()) ref_chosen_.push_back(x);
    for (double x : p.rejected.to_vector<double>()) ref_rejected_.push_back(x);
  }
  reference_s_ = seconds_since(t0);
}

int64_t DpoTrainer::steps_per_epoch() const { return loop_steps_per_epoch(int64_t(rows_.size()), options_.loop); }

int64_t DpoTrainer::total_steps() const { return loop_total_steps(int64_t(rows_.size()), options_.loop); }

PolicyLogpOptions DpoTrainer::logp_options(int64_t micro) const {
  return step_logp_options(options_.loop, state_.step, micro);
}

DpoStepStats DpoTrainer::step() {
  if (done()) throw std::logic_error(fmt::format("the run is done ({} steps)", total_steps()));
  const auto t0 = Clock::now();
  const SftOptions& lo = options_.loop;
  DpoStepStats st;
  st.step = state_.step + 1;
  st.lrs = group_lrs(*optimizer_);

  // The step's rows, in the epoch's order.
  const std::vector<int64_t> batch = next_step_rows(state_, int64_t(rows_.size()), lo);
  const int64_t B = int64_t(batch.size());
  st.pairs = B;

  // Micro-batches, each loss weighted by its share of the step's pairs (see dpo.h).
  for (int64_t b = 0, micro = 0; b < B; b += lo.mini_bs, ++micro) {
    const int64_t n = std::min(B, b + lo.mini_bs) - b;
    std::vector<const DpoRow*> mb;
    // IPO compares log-probabilities averaged over each response (TRL's), the reference's alike.
    const bool average = options_.dpo.loss_type == DpoLossType::ipo;
    std::vector<float> rc, rr, inv_c, inv_r;
    for (int64_t i = b; i < b + n; ++i) {
      const size_t r = size_t(batch[size_t(i)]);
      mb.push_back(&rows_[r]);
      const double lc = double(rows_[r].chosen.size()), lr = double(rows_[r].rejected.size());
      inv_c.push_back(float(average ? 1.0 / lc : 1.0));
      inv_r.push_back(float(average ? 1.0 / lr : 1.0));
      rc.push_back(float(ref_chosen_[r] * inv_c.back()));
      rr.push_back(float(ref_rejected_[r] * inv_r.back()));
      st.response_tokens += int64_t(rows_[r].chosen.size() + rows_[r].rejected.size());
    }
    const PairLogp p = pair_logp(*model_, mb, logp_options(micro));
    const Device dev = p.chosen.device();
    const Tensor pc = average ? mul(p.chosen, from_vector(inv_c, {n}).to(dev, p.chosen.dtype())) : p.chosen;
    const Tensor pr = average ? mul(p.rejected, from_vector(inv_r, {n}).to(dev, p.rejected.dtype())) : p.rejected;
    DpoLoss dl = dpo_loss(pc, pr, from_vector(rc, {n}).to(dev), from_vector(rr, {n}).to(dev), options_.dpo);
    const double w = double(n) / double(B);
    Tensor loss = mul(dl.loss, w);
    if (loss.requires_grad()) loss.backward();
    st.dpo.loss += w * dl.stats.loss;
    st.dpo.chosen_reward += w * dl.stats.chosen_reward;
    st.dpo.rejected_reward += w * dl.stats.rejected_reward;
    st.dpo.reward_margin += w * dl.stats.reward_margin;
    st.dpo.reward_accuracy += w * dl.stats.reward_accuracy;
    for (double x : p.chosen.to_vector<double>()) st.chosen_logp += x / double(B);
    for (double x : p.rejected.to_vector<double>()) st.rejected_logp += x / double(B);
  }

  st.grad_norm = clip_and_step(*optimizer_, lo.grad_clip_norm);
  advance(state_, B, int64_t(rows_.size()));
  st.step_s = seconds_since(t0);
  return st;
}

fs::path DpoTrainer::save_checkpoint(const fs::path& save_path, const fs::path& source,
                                     const std::function<void(const fs::path&)>& add_files) const {
  json st = trainer_state_json(state_, total_steps(), options_.loop.seed);
  st["algo"] = "dpo";
  st["dpo_beta"] = options_.dpo.beta;
  st["dpo_loss_type"] = dpo_loss_type_name(options_.dpo.loss_type);
  st["dpo_label_smoothing"] = options_.dpo.label_smoothing;
  st["run"] = run_keys();
  return save_step_folder(*model_, *optimizer_, state_.step, save_path, source, st, [&](const fs::path& tmp) {
    if (add_files) add_files(tmp);
    const fs::path file = tmp / kDpoReferenceFile;
    fs::create_directories(file.parent_path());
    save_safetensors(file.string(), {{"chosen", from_vector(ref_chosen_, {int64_t(ref_chosen_.size())})},
                                         {"rejected", from_vector(ref_rejected_, {int64_t(ref_rejected_.size())})}});
    sync_dir(file.parent_path().string());
  });
}

json DpoTrainer::run_keys() const {
  Fingerprint f;
  for (const DpoRow& r : rows_) {
    for (const std::vector<int64_t>* v : {&r.prompt.ids, &r.chosen, &r.rejected}) {
      f.add(int64_t(v->size()));
      for (int64_t x : *v) f.add(x);
    }
    f.add(int64_t(r.prompt.adapter));
  }
  json k = loop_run_keys(options_.loop, "dpo", fmt::format("rows={} data={:016x}", rows_.size(), f.value()));
  if (options_.dpo.loss_type != DpoLossType::sigmoid)  // (only then: earlier checkpoints keep their keys)
    k["--dpo-loss-type"] = dpo_loss_type_name(options_.dpo.loss_type);
  k.update(options_.run_keys);
  return k;
}

void DpoTrainer::load_state(const fs::path& step_dir) {
  const json keys = run_keys();
  const TrainerState s = load_step_state(step_dir, "dpo", int64_t(rows_.size()), *optimizer_,
                                         [&](const json& st, const std::string& file) { check_run_keys(st, keys, file); })
                             .state;
  const fs::path file = step_dir / kDpoReferenceFile;
  if (!fs::exists(file)) throw std::runtime_error(fmt::format("{}: no such file (the reference sums of the run)", file.string()));
  const SafetensorsFile ref(file.string());
  for (auto [name, dst] : {std::pair<const char*, std::vector<double>*>{"chosen", &ref_chosen_}, {"rejected", &ref_rejected_}}) {
    if (!ref.contains(name)) throw std::runtime_error(fmt::format("{}: no tensor {}", file.string(), name));
    const Tensor t = ref.load_copy(name);
    if (t.dtype() != DType::f64 || t.shape() != Shape{int64_t(rows_.size())})
      throw std::runtime_error(fmt::format("{}: {} must be f64 [{}] (one per pair), got {} {}", file.string(), name,
                                           rows_.size(), dtype_name(t.dtype()), shape_str(t.shape())));
    *dst = t.to_vector<double>();
  }
  state_ = s;
}

Scalars dpo_scalars(const DpoStepStats& st) {
  Scalars s = {{"loss", st.dpo.loss},
               {"chosen_reward", st.dpo.chosen_reward},
               {"rejected_reward", st.dpo.rejected_reward},
               {"reward_margin", st.dpo.reward_margin},
               {"reward_accuracy", st.dpo.reward_accuracy},
               {"chosen_logp", st.chosen_logp},
               {"rejected_logp", st.rejected_logp},
               {"grad_norm", st.grad_norm}};
  for (const auto& [g, lr] : st.lrs) s.emplace_back("lr/" + g, lr);
  s.insert(s.end(), {{"pairs", double(st.pairs)},
                     {"response_tokens", double(st.response_tokens)},
                     {"time/step_s", st.step_s},
                     {"memory/peak_rss_bytes", double(peak_rss_bytes())}});
  return s;
}

std::string format_dpo_progress(const DpoStepStats& st, int64_t total_steps) {
  return fmt::format("step {}/{}  loss {:.4f}  margin {:.4f}  accuracy {:.3f}  chosen {:.4f}  rejected {:.4f}  "
                     "{}  grad_norm {:.3f}  time step={:.2f}s",
                     st.step, total_steps, st.dpo.loss, st.dpo.reward_margin, st.dpo.reward_accuracy,
                     st.dpo.chosen_reward, st.dpo.rejected_reward, format_group_lrs(st.lrs), st.grad_norm, st.step_s);
}

}  // namespace areno::train::rl
