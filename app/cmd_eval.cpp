// areno eval: greedy exact-match accuracy of a checkpoint on chat rows
// (train/evaluate.h), per group of rows.
#include <cstdio>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/commands_train.h"
#include "app/flags.h"
#include "app/served_model.h"
#include "train/dataset.h"
#include "train/evaluate.h"

namespace areno::app {

namespace fs = std::filesystem;

namespace {

constexpr const char* kEvalUsage =
    "usage: areno eval --dataset-path FILE [--model-path DIR] [--group-by FIELD] [--show-wrong]\n"
    "                  [--media-root DIR] [--device cpu|cuda[:N]] [--dtype f32|bf16] [--quantize int8]\n"
    "                  [--lora DIR]\n"
    "                  [--json] [--threads N]\n"
    "\n"
    "Answers every row's prompt greedily and counts the rows whose answer equals the\n"
    "row's first assistant turn token for token (and ends there). Rows are read as\n"
    "`areno train` reads them (JSON, JSONL, CSV, TSV; messages or prompt/response).\n"
    "  --model-path DIR   checkpoint (default: the embedded demo model, docs/demo.md)\n"
    "  --group-by FIELD   also count per value of this row field (e.g. family)\n"
    "  --show-wrong       print each wrong answer (line, expected, got) to stderr\n"
    "  --media-root DIR   media paths resolve under DIR (default: the dataset's folder)\n"
    "  --lora DIR         a PEFT LoRA folder run beside the vision/speech adapter (docs/training.md)\n"
    "  --quantize int8    weight-only int8 for the decoder and the tied head (per output channel\n"
    "                     scales, f32 activations; CPU only)\n"
    "  --json             print the counts as one JSON object instead of the table\n"
    "  --threads N        compute threads (default: OMP_NUM_THREADS, else the physical cores)\n";

}  // namespace

int cmd_eval(const Args& args) {
  std::string dataset, model_path, group_by, media_root, device = "cpu", dtype;
  bool show_wrong = false, as_json = false;
  Flags flags("eval", kEvalUsage);
  flags.value("--dataset-path", dataset).value("--model-path", model_path).value("--group-by", group_by);
  flags.value("--media-root", media_root).value("--device", device).value("--dtype", dtype);
  flags.compute_threads();
  flags.toggle("--show-wrong", show_wrong).toggle("--json", as_json);
  ModelNeeds needs;
  add_model_flags(flags, needs);
  if (auto rc = flags.parse(args)) return *rc;
  if (dataset.empty()) {
    fmt::print(stderr, "areno eval: --dataset-path is required\n\n{}", kEvalUsage);
    return 2;
  }
  if (!fs::exists(dataset)) throw std::runtime_error(fmt::format("--dataset-path {}: no such file", dataset));
  ServedModel sm = load_served_model(model_path, device, dtype, needs);
  train::DatasetOptions dopts;
  dopts.media_root = media_root;
  dopts.image = sm.model->image_embed() != nullptr;
  dopts.image_max_crops = sm.model->config().vision.dynamic_hd;
  dopts.audio = sm.model->audio_embed() != nullptr;
  const train::SftDataset data = train::load_sft_dataset(dataset, *sm.tokenizer, dopts);
  std::map<int64_t, std::string> group_of_line;
  if (!group_by.empty())
    for (const train::RawRow& r : train::read_rows(dataset)) {
      const auto it = r.value.is_object() ? r.value.find(group_by) : r.value.end();
      if (it == r.value.end())
        throw train::DatasetError(dataset, r.line, group_by, "--group-by: the row has no such field");
      group_of_line[r.line] = it->is_string() ? it->get<std::string>() : it->dump();
    }
  const std::vector<train::AnswerCheck> checks = train::greedy_exact_match(sm.model, sm.tokenizer, data.rows);

  std::vector<std::string> order;  // groups in order of appearance
  std::map<std::string, std::pair<int64_t, int64_t>> counts;  // group -> (right, total)
  int64_t right = 0;
  for (const train::AnswerCheck& c : checks) {
    right += c.correct;
    if (!group_by.empty()) {
      const std::string& g = group_of_line.at(c.line);
      if (!counts.count(g)) order.push_back(g);
      counts[g].first += c.correct;
      counts[g].second += 1;
    }
    if (show_wrong && !c.correct) {
      std::vector<tok::TokenId> e(c.expected.begin(), c.expected.end()), g(c.generated.begin(), c.generated.end());
      fmt::print(stderr, "wrong: {} line {}: expected {:?}, got {:?}{}\n", dataset, c.line, sm.tokenizer->decode(e, true),
                 sm.tokenizer->decode(g, true), c.finished ? "" : " (no end of turn)");
    }
  }
  const int64_t total = int64_t(checks.size());
  auto pct = [](int64_t r, int64_t t) { return t > 0 ? 100.0 * double(r) / double(t) : 0.0; };
  if (as_json) {
    nlohmann::json j = {{"rows", total}, {"correct", right}, {"accuracy", total > 0 ? double(right) / total : 0.0}};
    for (const std::string& g : order)
      j["groups"][g] = {{"rows", counts[g].second},
                        {"correct", counts[g].first},
                        {"accuracy", double(counts[g].first) / double(counts[g].second)}};
    fmt::print("{}\n", j.dump());
    return 0;
  }
  for (const std::string& g : order)
    fmt::print("{:<16} {:>4} / {:<4} {:6.1f}%\n", g, counts[g].first, counts[g].second, pct(counts[g].first, counts[g].second));
  fmt::print("{:<16} {:>4} / {:<4} {:6.1f}%\n", "all", right, total, pct(right, total));
  return 0;
}

}  // namespace areno::app
