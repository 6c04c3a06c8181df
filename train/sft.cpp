#include "train/sft.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/processor/processor_config.h"
#include "nn/io/atomic_file.h"
#include "nn/io/files.h"
#include "tensor/autograd.h"
#include "train/metrics.h"

namespace areno::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

uint64_t mix(uint64_t a, uint64_t b) { return splitmix64(a ^ splitmix64(b + 0x632be59bd9b4e019ull)); }

void require(bool ok, const char* flag, const std::string& what) {
  if (!ok) throw std::invalid_argument(fmt::format("{}: {}", flag, what));
}

// A dropout the forward does not implement, asked for by a part that trains.
void check_dropouts(const phi4mm::Phi4MMForCausalLM& m, const GroupOptions& g) {
  const json& raw = m.config().raw;
  auto refuse = [](const std::string& key, double v, const char* part) {
    throw std::invalid_argument(fmt::format(
        "config.json: {} = {}: dropout in the {} is not implemented for training; set it to 0 or keep the "
        "group frozen", key, v, part));
  };
  auto number = [](const json& j, const char* key) {
    auto it = j.find(key);
    return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
  };
  // The decoder layers run in training mode as soon as any of their
  // parameters (the LoRA branches included) train.
  if (g.lm != LmTrainable::none)
    for (const char* key : {"embd_pdrop", "resid_pdrop", "attention_dropout"})
      if (double v = number(raw, key); v != 0) refuse(key, v, "decoder");
  if (!g.tower) return;
  if (auto it = raw.find("img_processor"); it != raw.end() && it->is_object())
    if (double v = number(*it, "attention_dropout"); v != 0) refuse("img_processor.attention_dropout", v, "vision tower");
  if (auto it = raw.find("audio_processor"); it != raw.end() && it->is_object())
    if (auto c = it->find("config"); c != it->end() && c->is_object())
      if (double v = number(*c, "dropout_rate"); v != 0)
        refuse("audio_processor.config.dropout_rate", v, "audio encoder");
}

}  // namespace

int64_t disable_dropout(phi4mm::Phi4MMForCausalLM& model) {
  int64_t n = 0;
  for (auto& [name, m] : model.named_modules())
    if (auto* l = dynamic_cast<phi4mm::LoraLinear*>(m)) {
      for (phi4mm::Adapter a : {phi4mm::Adapter::vision, phi4mm::Adapter::speech}) n += l->dropout_p(a) > 0;
      n += l->user_dropout_p() > 0;
      l->disable_dropout();
    }
  return n;
}

namespace {

const char* decay_name(DecayStyle d) {
  switch (d) {
    case DecayStyle::cosine: return "cosine";
    case DecayStyle::linear: return "linear";
    case DecayStyle::constant: return "constant";
  }
  return "?";
}

}  // namespace

DecayStyle decay_style_from_name(const std::string& name) {
  if (name == "cosine") return DecayStyle::cosine;
  if (name == "linear") return DecayStyle::linear;
  if (name == "constant") return DecayStyle::constant;
  throw std::invalid_argument(fmt::format("--lr-decay-style: '{}' is not cosine, linear or constant", name));
}

std::shared_ptr<LrSchedule> make_schedule(DecayStyle style, int64_t warmup, int64_t decay_steps, double min_ratio) {
  switch (style) {
    case DecayStyle::cosine: return std::make_shared<WarmupCosineSchedule>(warmup, decay_steps, min_ratio);
    case DecayStyle::linear: return std::make_shared<WarmupLinearSchedule>(warmup, decay_steps, min_ratio);
    case DecayStyle::constant: return std::make_shared<WarmupConstantSchedule>(warmup);
  }
  throw std::invalid_argument("unknown decay style");
}

void validate(const SftOptions& o) {
  require(o.epochs >= 1, "--epochs", "must be at least 1");
  require(o.max_steps >= 0, "--max-steps", "must be >= 0");
  require(o.batch_size >= 1, "--batch-size", "must be at least 1");
  require(o.mini_bs >= 1 && o.mini_bs <= o.batch_size, "--mini-bs",
          fmt::format("must be between 1 and --batch-size ({}), got {}", o.batch_size, o.mini_bs));
  auto lr_ok = [](double v) { return std::isfinite(v) && v >= 0 && v < 1e3; };
  require(lr_ok(o.lr) && o.lr > 0, "--lr", "must be a positive finite number");
  require(lr_ok(o.min_lr) && o.min_lr <= o.lr, "--min-lr", "must be in [0, --lr]");
  require(lr_ok(o.mm_projector_lr), "--mm-projector-lr", "must be a finite number >= 0 (0: --lr)");
  require(lr_ok(o.mm_tower_lr), "--mm-tower-lr", "must be a finite number >= 0 (0: --lr)");
  require(o.lr_decay_steps >= 0, "--lr-decay-steps", "must be >= 0");
  require(o.warmup_steps >= 0, "--warmup-steps", "must be >= 0");
  require(o.adam_beta1 >= 0 && o.adam_beta1 < 1, "--adam-beta1", "must be in [0, 1)");
  require(o.adam_beta2 >= 0 && o.adam_beta2 < 1, "--adam-beta2", "must be in [0, 1)");
  require(std::isfinite(o.adam_eps) && o.adam_eps > 0, "--adam-eps", "must be positive");
  require(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "--weight-decay", "must be a finite number >= 0");
  require(std::isfinite(o.grad_clip_norm) && o.grad_clip_norm >= 0, "--grad-clip-norm",
          "must be a finite number >= 0 (0: no clipping)");
  require(o.loss_chunk_rows >= 1, "--loss-chunk-rows", "must be at least 1");
}

std::unique_ptr<AdamW> make_training_optimizer(phi4mm::Phi4MMForCausalLM& model, const SftOptions& o,
                                               int64_t total_steps) {
  check_dropouts(model, o.groups);
  apply_trainable(model, o.groups);
  // Activation checkpointing reaches into the towers when they train (a
  // frozen tower records nothing to recompute); here, so that every trainer
  // (SFT, GRPO/GSPO, DPO, PPO) sets it with its groups.
  const bool tower_ckpt = o.activation_checkpointing && o.groups.tower;
  if (auto v = model.image_embed()) v->recompute_layers = tower_ckpt;
  if (auto a = model.audio_embed()) a->recompute_layers = tower_ckpt;
  const int64_t decay = o.lr_decay_steps > 0 ? o.lr_decay_steps : total_steps;
  if (o.warmup_steps > decay)
    throw std::invalid_argument(fmt::format("--warmup-steps ({}) exceeds the decay steps ({})",
                                            o.warmup_steps, decay));
  GroupHyper h;
  h.lr[int(Group::lm)] = o.lr;
  h.lr[int(Group::projector)] = o.mm_projector_lr > 0 ? o.mm_projector_lr : o.lr;
  h.lr[int(Group::tower)] = o.mm_tower_lr > 0 ? o.mm_tower_lr : o.lr;
  h.weight_decay = o.weight_decay;
  h.schedule = make_schedule(o.decay, o.warmup_steps, decay, o.min_lr / o.lr);
  AdamWOptions ao;
  ao.beta1 = o.adam_beta1;
  ao.beta2 = o.adam_beta2;
  ao.eps = o.adam_eps;
  return std::make_unique<AdamW>(make_param_groups(model, h), ao);
}

std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch, bool shuffle) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  if (!shuffle) return order;
  // Fisher-Yates on our own stream: the same order on every platform.
  uint64_t s = mix(seed, uint64_t(epoch));
  for (size_t i = order.size(); i > 1; --i) {
    s = splitmix64(s);
    std::swap(order[i - 1], order[size_t(s % i)]);
  }
  return order;
}

double clip_and_step(AdamW& optimizer, double grad_clip_norm) {
  const double clip = grad_clip_norm > 0 ? grad_clip_norm : std::numeric_limits<double>::infinity();
  const double norm = clip_grad_norm(optimizer.parameters(), clip);
  optimizer.step();
  optimizer.zero_grad();
  return norm;
}

void advance(TrainerState& state, int64_t taken, int64_t rows) {
  state.step += 1;
  advance_position(state, taken, rows);
}

void advance_position(TrainerState& state, int64_t taken, int64_t rows) {
  state.position += taken;
  if (state.position >= rows) {
    state.epoch += 1;
    state.position = 0;
  }
}

std::vector<std::pair<std::string, double>> group_lrs(const AdamW& optimizer) {
  std::vector<std::pair<std::string, double>> lrs;
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    const char* name = group_name(group_of_param_group(optimizer.param_groups()[g]));
    if (lrs.empty() || lrs.back().first != name) lrs.emplace_back(name, optimizer.current_lr(g));
  }
  return lrs;
}

SftTrainer::SftTrainer(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::vector<SftRow> rows,
                       SftOptions options)
    : model_(std::move(model)), rows_(std::move(rows)), options_(options) {
  validate(options_);
  if (rows_.empty()) throw std::invalid_argument("the dataset has no rows to train on");
  for (const SftRow& r : rows_) {
    if (r.target_tokens <= 0)
      throw std::invalid_argument(fmt::format("row {}: no target token", r.line));
    if (!model_->has_adapter(r.adapter))
      throw std::invalid_argument(fmt::format("row {}: the model has no {} adapter", r.line,
                                              phi4mm::adapter_name(r.adapter)));
    for (const phi4mm::Media& m : r.media) {
      if (m.kind == phi4mm::MediaKind::kImage && !model_->image_embed())
        throw std::invalid_argument(fmt::format("row {}: an image, but the model has no vision tower", r.line));
      if (m.kind == phi4mm::MediaKind::kAudio && !model_->audio_embed())
        throw std::invalid_argument(fmt::format("row {}: audio, but the model has no audio encoder", r.line));
    }
  }
  optimizer_ = make_training_optimizer(*model_, options_, total_steps());
  Tensor& embed = model_->model->embed_tokens->weight;
  if (options_.groups.embed_rows == EmbedRows::data && embed.requires_grad()) {
    // Weight decay would move the rows the mask keeps still.
    if (options_.weight_decay > 0)
      throw std::invalid_argument("--embed-rows data: needs --weight-decay 0 (decay would change the frozen rows)");
    const int64_t vocab = embed.size(0);
    // Every target is also an id of its row (the next one), so the ids are enough.
    std::vector<float> mask(size_t(vocab), 0.0f);
    for (const SftRow& r : rows_)
      for (int64_t id : r.ids)
        if (id >= 0 && id < vocab && mask[size_t(id)] == 0.0f) {
          mask[size_t(id)] = 1.0f;
          ++embed_rows_trained_;
        }
    embed_row_mask_ = from_vector(mask, {vocab, 1}).to(embed.device()).to(embed.dtype());
  }
}

int64_t loop_steps_per_epoch(int64_t rows, const SftOptions& o) { return (rows + o.batch_size - 1) / o.batch_size; }

int64_t loop_total_steps(int64_t rows, const SftOptions& o) {
  return o.max_steps > 0 ? o.max_steps : o.epochs * loop_steps_per_epoch(rows, o);
}

std::vector<int64_t> next_step_rows(const TrainerState& state, int64_t rows, const SftOptions& o) {
  const std::vector<int64_t> order = epoch_order(rows, o.seed, state.epoch, o.shuffle);
  const int64_t end = std::min<int64_t>(int64_t(order.size()), state.position + o.batch_size);
  return std::vector<int64_t>(order.begin() + std::min(state.position, end), order.begin() + end);
}

json trainer_state_json(const TrainerState& state, int64_t total_steps, uint64_t seed) {
  return {{"format", 1},
          {"step", state.step},
          {"epoch", state.epoch},
          {"position", state.position},
          {"total_steps", total_steps},
          {"seed", seed}};
}

int64_t SftTrainer::steps_per_epoch() const { return loop_steps_per_epoch(int64_t(rows_.size()), options_); }

int64_t SftTrainer::total_steps() const { return loop_total_steps(int64_t(rows_.size()), options_); }

std::vector<const SftRow*> SftTrainer::next_batch() const {
  std::vector<const SftRow*> batch;
  for (int64_t i : next_step_rows(state_, int64_t(rows_.size()), options_)) batch.push_back(&rows_[size_t(i)]);
  return batch;
}

double SftTrainer::accumulate(const std::vector<const SftRow*>& rows, int64_t normaliser, uint64_t dropout_seed) {
  if (normaliser <= 0) {
    normaliser = 0;
    for (const SftRow* r : rows) normaliser += r->target_tokens;
  }
  double total = 0;
  const Tensor& head = model_->model->embed_tokens->weight;
  for (size_t b = 0, micro = 0; b < rows.size(); b += size_t(options_.mini_bs), ++micro) {
    const size_t e = std::min(rows.size(), b + size_t(options_.mini_bs));
    std::vector<int64_t> ids, targets;
    phi4mm::PackedBatch pb;
    pb.cu_seqlens = {0};
    std::vector<Tensor> media;
    for (size_t i = b; i < e; ++i) {
      const SftRow& r = *rows[i];
      ids.insert(ids.end(), r.ids.begin(), r.ids.end());
      targets.insert(targets.end(), r.targets.begin(), r.targets.end());
      pb.cu_seqlens.push_back(int64_t(ids.size()));
      pb.adapters.push_back(r.adapter);
      // Each row's media rows with its own projector choice (audio beside an image uses the vision one).
      if (!r.media.empty()) media.push_back(phi4mm::media_rows(*model_, r.media));
    }
    const int64_t T = int64_t(ids.size());
    pb.token_ids = from_vector(ids, {T});
    if (!media.empty()) pb.media_rows = media.size() == 1 ? media[0] : cat(media, 0);
    pb.recompute_layers = options_.activation_checkpointing;
    pb.dropout_seed = mix(dropout_seed, micro);
    Tensor hidden = model_->hidden_states(pb);
    Tensor loss = mul(chunked_cross_entropy_sum(hidden, head, from_vector(targets, {T}), options_.loss_chunk_rows),
                      1.0 / double(normaliser));
    total += loss.item();
    if (loss.requires_grad()) loss.backward();
  }
  return total;
}

StepStats SftTrainer::step() {
  if (done()) throw std::logic_error(fmt::format("the run is done ({} steps)", total_steps()));
  const auto t0 = std::chrono::steady_clock::now();
  StepStats st;
  st.step = state_.step + 1;
  const std::vector<const SftRow*> batch = next_batch();
  for (const SftRow* r : batch) {
    st.rows += 1;
    st.tokens += int64_t(r->ids.size());
    st.target_tokens += r->target_tokens;
  }
  st.lrs = group_lrs(*optimizer_);
  st.loss = accumulate(batch, st.target_tokens, mix(options_.seed ^ 0x5eedull, uint64_t(state_.step)));
  if (embed_row_mask_.defined()) {
    // --embed-rows data: only the rows of the dataset's token ids get a
    // gradient; with no gradient and no moments AdamW leaves the others as they are.
    NoGradGuard no_grad;
    Tensor g = model_->model->embed_tokens->weight.grad();
    if (g.defined()) model_->model->embed_tokens->weight.set_grad(mul(g, embed_row_mask_));
  }
  st.grad_norm = clip_and_step(*optimizer_, options_.grad_clip_norm);
  advance(state_, int64_t(batch.size()), int64_t(rows_.size()));
  st.seconds = seconds_since(t0);
  return st;
}

void Fingerprint::add(int64_t v) {
  for (int i = 0; i < 8; ++i) {
    h_ ^= uint64_t(v >> (8 * i)) & 0xff;
    h_ *= 1099511628211ull;
  }
}

void Fingerprint::add(const std::string& s) {
  add(int64_t(s.size()));
  for (unsigned char c : s) {
    h_ ^= c;
    h_ *= 1099511628211ull;
  }
}

std::string SftTrainer::fingerprint() const {
  // Every row's ids, targets and adapter, then the options that decide which
  // rows a step reads and which parameters train.
  Fingerprint f;
  for (const SftRow& r : rows_) {
    f.add(int64_t(r.ids.size()));
    for (int64_t v : r.ids) f.add(v);
    for (int64_t v : r.targets) f.add(v);
    f.add(int64_t(r.adapter));
  }
  const GroupOptions& g = options_.groups;
  return fmt::format("rows={} data={:016x} batch={} seed={} shuffle={} lm={} projector={} tower={}{}", rows_.size(),
                     f.value(), options_.batch_size, options_.seed, options_.shuffle, int(g.lm), g.projector, g.tower,
                     g.embed_rows == EmbedRows::all ? "" : fmt::format(" embed_rows={}", embed_rows_name(g.embed_rows)));
}

json loop_run_keys(const SftOptions& o, const std::string& algo, const std::string& dataset) {
  return {{"--algo", algo},
          {"dataset", dataset},
          {"--batch-size", o.batch_size},
          {"--seed", o.seed},
          {"--no-shuffle", !o.shuffle},
          {"--lm-trainable", lm_trainable_name(o.groups.lm)},
          {"--embed-rows", embed_rows_name(o.groups.embed_rows)},
          {"--unfreeze-mm-projector", o.groups.projector},
          {"--unfreeze-mm-tower", o.groups.tower}};
}

void check_run_keys(const json& saved, const json& now, const std::string& file) {
  auto run = saved.find("run");
  if (run == saved.end() || !run->is_object())
    throw std::runtime_error(fmt::format(
        "{}: no \"run\" field: this {} step folder was saved before such runs could resume (start a new run from "
        "its weights with --ckpt instead)", file, saved.value("algo", std::string("sft"))));
  for (const auto& [key, value] : now.items()) {
    auto it = run->find(key);
    if (it == run->end())
      throw std::runtime_error(fmt::format(
          "{}: {} differs from the saved run's (not given there, {} now; or the folder is of another version): a "
          "resumed run repeats the options that decide its data, rollouts and trained groups", file, key,
          value.dump()));
    if (*it != value)
      throw std::runtime_error(fmt::format(
          "{}: {} differs from the saved run's ({} there, {} now): a resumed run repeats the options that decide its "
          "data, rollouts and trained groups", file, key, it->dump(), value.dump()));
  }
  for (const auto& [key, value] : run->items())  // an option the saved run had and this one drops
    if (!now.contains(key))
      throw std::runtime_error(fmt::format(
          "{}: {} differs from the saved run's ({} there, not given now): a resumed run repeats the options that "
          "decide its data, rollouts and trained groups", file, key, value.dump()));
}

SavedState load_step_state(const fs::path& step_dir, const std::string& algo, int64_t rows, AdamW& optimizer,
                           const std::function<void(const json&, const std::string&)>& check) {
  const fs::path file = step_dir / "trainer_state.json";
  SavedState out;
  json& st = out.json;
  try {
    st = json::parse(read_file(file.string()));
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("{}: {}", file.string(), e.what()));
  }
  if (!st.is_object()) throw std::runtime_error(fmt::format("{}: not a JSON object", file.string()));
  const std::string saved_algo = st.value("algo", std::string("sft"));
  if (saved_algo != algo)
    throw std::runtime_error(fmt::format("{}: --algo differs: the step folder is from an --algo {} run, this is --algo {}",
                                         file.string(), saved_algo, algo));
  if (check) check(st, file.string());
  auto get = [&](const char* key) -> int64_t {
    auto it = st.find(key);
    if (it == st.end() || !it->is_number_integer() || it->get<int64_t>() < 0)
      throw std::runtime_error(fmt::format("{}: {} must be a non-negative integer", file.string(), key));
    return it->get<int64_t>();
  };
  out.state = TrainerState{get("step"), get("epoch"), get("position")};
  if (out.state.position >= rows)
    throw std::runtime_error(fmt::format("{}: position {} is past the dataset's {} rows", file.string(),
                                         out.state.position, rows));
  optimizer.load_state((step_dir / "optimizer" / "optimizer.safetensors").string());
  return out;
}

fs::path save_step_folder(const phi4mm::Phi4MMForCausalLM& model, const AdamW& optimizer, int64_t step,
                          const fs::path& save_path, const fs::path& source, const json& trainer_state,
                          const std::function<void(const fs::path&)>& add_files) {
  fs::create_directories(save_path);
  const std::string name = fmt::format("step-{}", step);
  const fs::path final_dir = save_path / name;
  const fs::path tmp = save_path / fmt::format(".{}.tmp-{}", name, ::getpid());
  fs::remove_all(tmp);
  phi4mm::save_model(model, tmp.string());
  // Tokenizer, processor and remote-code files of the checkpoint the run started from.
  phi4mm::copy_side_files(source, tmp);
  if (!fs::exists(tmp / "preprocessor_config.json"))
    phi4mm::write_preprocessor_config(tmp, phi4mm::image_options(model.config().vision.dynamic_hd));
  if (add_files) add_files(tmp);
  // In a subfolder: tools that read every *.safetensors of a checkpoint
  // folder as weights (the port's conversion script, vLLM) must not see it.
  fs::create_directories(tmp / "optimizer");
  optimizer.save_state((tmp / "optimizer" / "optimizer.safetensors").string());
  sync_dir((tmp / "optimizer").string());
  write_file_atomic((tmp / "trainer_state.json").string(), trainer_state.dump(2) + "\n");
  sync_dir(tmp.string());
  // Put the folder in place; a folder of the same step (a rerun) is replaced
  // only once the new one is complete.
  if (fs::exists(final_dir)) {
    const fs::path old = save_path / fmt::format(".{}.old-{}", name, ::getpid());
    fs::remove_all(old);
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fs::remove_all(old);
  } else {
    fs::rename(tmp, final_dir);
  }
  sync_dir(save_path.string());
  write_file_atomic((save_path / "latest").string(), name + "\n");
  return final_dir;
}

fs::path SftTrainer::save_checkpoint(const fs::path& save_path, const fs::path& source,
                                     const std::function<void(const fs::path&)>& add_files) const {
  json st = trainer_state_json(state_, total_steps(), options_.seed);
  st["lr_decay_style"] = decay_name(options_.decay);
  st["fingerprint"] = fingerprint();
  return save_step_folder(*model_, *optimizer_, state_.step, save_path, source, st, add_files);
}

void SftTrainer::load_state(const fs::path& step_dir) {
  state_ = load_step_state(step_dir, "sft", int64_t(rows_.size()), *optimizer_, [&](const json& st, const std::string& file) {
             if (st.value("fingerprint", std::string()) != fingerprint())
               throw std::runtime_error(fmt::format(
                   "{}: the checkpoint was trained on another dataset or with another --batch-size, --seed or "
                   "trainable groups ({} there, {} now)", file, st.value("fingerprint", std::string("none")),
                   fingerprint()));
           }).state;
}

fs::path resolve_resume_dir(const fs::path& dir) {
  if (fs::exists(dir / "trainer_state.json")) return dir;
  const fs::path latest = dir / "latest";
  if (!fs::exists(latest))
    throw std::runtime_error(fmt::format("--resume {}: neither a step folder (trainer_state.json) nor a save folder "
                                         "(latest)", dir.string()));
  std::string name = read_file(latest.string());
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
  if (name.rfind("step-", 0) != 0 || name.find('/') != std::string::npos || name.size() > 32)
    throw std::runtime_error(fmt::format("{}: '{}' is not a step folder name", latest.string(), name));
  const fs::path step = dir / name;
  if (!fs::exists(step / "trainer_state.json"))
    throw std::runtime_error(fmt::format("{} names {}, which holds no trainer_state.json", latest.string(), step.string()));
  return step;
}

}  // namespace areno::train
