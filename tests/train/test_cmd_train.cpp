// `areno train` as a user runs it (issue 14, must-shows 4 and 7): bad input
// stops before the first step naming file, line and field; the loader command;
// a run interrupted and resumed from its save folder logs the same losses.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/commands_serve.h"
#include "app/commands_train.h"
#include "app/served_model.h"
#include "models/phi4mm/processor/image_io.h"
#include "nn/io/files.h"
#include "nn/io/safetensors.h"
#include "tests/test_util.h"
#include "train/dataset.h"

using namespace areno;
using nlohmann::json;
using testing::TempDir;
namespace fs = std::filesystem;

namespace {

void write(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// Sixteen short arithmetic rows as JSONL.
std::string arithmetic_rows() {
  std::string out;
  for (int a = 0; a < 8; ++a)
    for (int b = 0; b < 2; ++b)
      out += json{{"messages", {{{"role", "user"}, {"content", "What is " + std::to_string(a) + " + " + std::to_string(b) + "?"}},
                                {{"role", "assistant"}, {"content", std::to_string(a + b)}}}}}.dump() + "\n";
  return out;
}

// (step, loss) of every line of metrics.jsonl.
std::vector<std::pair<int64_t, double>> losses(const fs::path& dir) {
  std::vector<std::pair<int64_t, double>> out;
  std::ifstream in(dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    json j = json::parse(line);
    out.emplace_back(j["step"].get<int64_t>(), j["train/loss"].get<double>());
  }
  return out;
}

// A solid-colour 32x32 image as PPM.
void write_ppm(const fs::path& path, uint8_t r, uint8_t g, uint8_t b) {
  phi4mm::RgbImage im;
  im.width = im.height = 32;
  for (int i = 0; i < 32 * 32; ++i) im.rgb.insert(im.rgb.end(), {r, g, b});
  const auto bytes = phi4mm::encode_ppm(im);
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// One second of `beeps` 880 Hz beeps at 16 kHz as a 16-bit PCM WAV.
void write_beeps(const fs::path& path, int beeps) {
  const int rate = 16000, n = rate;
  std::vector<int16_t> s(n, 0);
  for (int b = 0; b < beeps; ++b)
    for (int i = 0; i < rate * 12 / 100; ++i) {
      const int at = rate * (5 + 22 * b) / 100 + i;
      if (at < n) s[size_t(at)] = int16_t(16000 * std::sin(2 * M_PI * 880.0 * i / rate));
    }
  std::string h;
  auto put = [&h](uint32_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) h.push_back(char(v >> (8 * i)));
  };
  h += "RIFF";
  put(36 + 2 * n, 4);
  h += "WAVEfmt ";
  put(16, 4), put(1, 2), put(1, 2), put(rate, 4), put(rate * 2, 4), put(2, 2), put(16, 2);
  h += "data";
  put(2 * n, 4);
  std::ofstream out(path, std::ios::binary);
  out << h;
  out.write(reinterpret_cast<const char*>(s.data()), std::streamsize(2 * n));
}

// `areno train` with `common` then `extra`; it must succeed.
void train_ok(std::vector<std::string> common, const std::vector<std::string>& extra) {
  common.insert(common.end(), extra.begin(), extra.end());
  REQUIRE(app::cmd_train(common) == 0);
}

// What a command prints on stdout; it must succeed.
std::string stdout_of(const std::function<int()>& run) {
  int rc = -1;
  const std::string out = testing::captured_stdout([&] { rc = run(); });
  REQUIRE(rc == 0);
  return out;
}

}  // namespace

TEST_CASE("areno train: a dataset with a missing image fails before the first step, naming file, line and field") {
  TempDir dir;
  std::string rows = arithmetic_rows();
  rows += json{{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}, {"image_url", {{"url", "gone.png"}}}},
                                                               {{"type", "text"}, {"text", "Colour?"}}}}},
                             {{"role", "assistant"}, {"content", "red"}}}}}.dump() + "\n";
  write(dir.path / "d.jsonl", rows);
  try {
    app::cmd_train({"--dataset-path", dir.str("d.jsonl"), "--save-path", dir.str("save"), "--metrics-log-dir",
                    dir.str("metrics")});
    FAIL("no error");
  } catch (const train::DatasetError& e) {
    CHECK(e.line() == 17);
    CHECK(e.file().find("d.jsonl") != std::string::npos);
    CHECK(e.field().find("image_url") != std::string::npos);
    CHECK(std::string(e.what()).find("gone.png") != std::string::npos);
  }
  CHECK_FALSE(fs::exists(dir.path / "save"));
  CHECK_FALSE(fs::exists(dir.path / "metrics"));
  // --skip-bad-rows trains on the other sixteen.
  CHECK(app::cmd_train({"--dataset-path", dir.str("d.jsonl"), "--skip-bad-rows", "--max-steps", "1", "--batch-size", "2",
                        "--metrics-log-dir", dir.str("metrics")}) == 0);
  CHECK(losses(dir.path / "metrics").size() == 1);
}

TEST_CASE("areno train: flags that contradict each other or are out of range are refused") {
  TempDir dir;
  write(dir.path / "d.jsonl", arithmetic_rows());
  const std::string d = dir.str("d.jsonl");
  CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", d, "--batch-size", "6", "--gradient-accumulation-steps", "4"}),
                       doctest::Contains("does not divide"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", d, "--batch-size", "8", "--gradient-accumulation-steps", "4",
                                       "--mini-bs", "4"}),
                       doctest::Contains("contradicts"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", d, "--min-lr", "1", "--lr", "0.1"}), doctest::Contains("--min-lr"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", d, "--algo", "reinforce"}),
                       "--algo: 'reinforce' is not supported (sft, grpo, gspo, dpo, ppo)", std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", d, "--lm-trainable", "some"}), doctest::Contains("--lm-trainable"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", dir.str("none.jsonl")}), doctest::Contains("no such file"),
                       std::runtime_error);
}

TEST_CASE("areno train: --dataset-loader-cmd turns a raw file into rows; a failing loader is an error") {
  TempDir dir;
  write(dir.path / "raw.txt", "What is 1 + 1?|2\nWhat is 2 + 2?|4\n");
  write(dir.path / "loader.sh",
        "awk -F'|' '{printf \"{\\\"prompt\\\": \\\"%s\\\", \\\"response\\\": \\\"%s\\\"}\\n\", $1, $2}' \"$1\"\n");
  CHECK(app::cmd_train({"--dataset-path", dir.str("raw.txt"), "--dataset-loader-cmd", "sh " + dir.str("loader.sh"),
                        "--batch-size", "2", "--max-steps", "1", "--metrics-log-dir", dir.str("m")}) == 0);
  const auto l = losses(dir.path / "m");
  REQUIRE(l.size() == 1);
  CHECK(std::isfinite(l[0].second));
  CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", dir.str("raw.txt"), "--dataset-loader-cmd", "exit 3 #"}),
                       doctest::Contains("exit status 3"), std::runtime_error);
}

TEST_CASE("areno train: a run stopped after 2 steps and resumed from its save folder logs the same losses") {
  TempDir dir;
  write(dir.path / "d.jsonl", arithmetic_rows());
  const std::vector<std::string> common = {"--dataset-path", dir.str("d.jsonl"), "--batch-size", "3", "--mini-bs", "2",
                                           "--lr", "3e-3", "--warmup-steps", "1", "--lr-decay-steps", "4",
                                           "--weight-decay", "0.1", "--seed", "7"};
  auto run = [&](const std::vector<std::string>& extra) { train_ok(common, extra); };
  run({"--max-steps", "4", "--metrics-log-dir", dir.str("ma")});
  run({"--max-steps", "2", "--save-path", dir.str("save"), "--metrics-log-dir", dir.str("mb")});
  CHECK(read_file(dir.str("save/latest")) == "step-2\n");
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json", "preprocessor_config.json", "optimizer/optimizer.safetensors", "trainer_state.json"})
    CHECK(fs::exists(dir.path / "save" / "step-2" / f));
  run({"--max-steps", "4", "--resume", dir.str("save"), "--save-path", dir.str("save"), "--metrics-log-dir",
       dir.str("mb")});
  CHECK(read_file(dir.str("save/latest")) == "step-4\n");
  const auto a = losses(dir.path / "ma"), b = losses(dir.path / "mb");
  REQUIRE(a.size() == 4);
  REQUIRE(b.size() == 4);
  for (size_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    CHECK(b[i].first == int64_t(i + 1));
    CHECK(b[i].second == a[i].second);
  }
}

TEST_CASE("areno train --lora-rank: only the user adapter trains, it is saved in the step folder and resumes exactly") {
  TempDir dir;
  write(dir.path / "d.jsonl", arithmetic_rows());
  const std::vector<std::string> common = {"--dataset-path", dir.str("d.jsonl"), "--batch-size", "4", "--mini-bs", "2",
                                           "--lr", "1e-2", "--seed", "3", "--lora-rank", "4", "--lora-targets",
                                           "down_proj,qkv_proj", "--lora-dropout", "0.1", "--lr-decay-steps", "4"};
  auto run = [&](const std::vector<std::string>& extra) { train_ok(common, extra); };
  run({"--max-steps", "4", "--metrics-log-dir", dir.str("ma")});
  run({"--max-steps", "2", "--save-path", dir.str("save"), "--metrics-log-dir", dir.str("mb")});
  run({"--max-steps", "4", "--resume", dir.str("save"), "--save-path", dir.str("save"), "--metrics-log-dir",
       dir.str("mb")});
  const auto a = losses(dir.path / "ma"), b = losses(dir.path / "mb");
  REQUIRE(a.size() == 4);
  REQUIRE(b.size() == 4);
  for (size_t i = 0; i < 4; ++i) CHECK(b[i].second == a[i].second);

  // The step folder holds the adapter (config block and tensors); the base
  // weights are the demo's, bit for bit.
  const json cfg = json::parse(read_file(dir.str("save/step-4/config.json")));
  CHECK(cfg["user_lora"] == json{{"dp", 0.1}, {"lora_alpha", 8.0}, {"r", 4}, {"target_modules", {"qkv_proj", "down_proj"}}});
  const app::ServedModel demo = app::load_served_model("", "cpu", "");
  const app::ServedModel trained = app::load_served_model(dir.str("save/step-4"), "cpu", "");
  int64_t user = 0;
  std::map<std::string, Tensor> base;
  for (auto& [name, p] : demo.model->named_parameters()) base[name] = p;
  for (auto& [name, p] : trained.model->named_parameters()) {
    CAPTURE(name);
    if (name.find(".user.") != std::string::npos) {
      ++user;
      continue;
    }
    REQUIRE(base.count(name));
    CHECK(max_abs_diff(p, base[name]) == 0.0);
  }
  CHECK(user == 2 * 2 * demo.model->config().text.num_hidden_layers);

  // --lora DIR starts the adapter from a PEFT folder: the step's adapter
  // written as peft names it; one step at lr 1e-7 (AdamW moves each weight by
  // about the lr) saves tensors within that of the folder's.
  {
    const SafetensorsCheckpoint step(dir.str("save/step-4"));
    std::vector<std::pair<std::string, Tensor>> peft;
    for (const std::string& n : step.names())
      if (n.find(".user.") != std::string::npos) {
        std::string stored = "base_model.model." + n;
        stored.replace(stored.find(".user."), 6, ".");
        peft.emplace_back(stored, step.load(n));
      }
    fs::create_directories(dir.path / "peft");
    save_safetensors((dir.path / "peft" / "adapter_model.safetensors").string(), peft);
    write(dir.path / "peft" / "adapter_config.json",
          R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["qkv_proj", "down_proj"]})");
    REQUIRE(app::cmd_train({"--dataset-path", dir.str("d.jsonl"), "--batch-size", "2", "--max-steps", "1", "--lr", "1e-7",
                            "--lora", dir.str("peft"), "--save-path", dir.str("from_peft")}) == 0);
    const SafetensorsCheckpoint saved(dir.str("from_peft/step-1"));
    int64_t near = 0;
    for (const std::string& n : step.names())
      if (n.find(".user.") != std::string::npos) near += max_abs_diff(saved.load(n), step.load(n)) <= 2e-7;
    CHECK(near == int64_t(peft.size()));
    CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", dir.str("d.jsonl"), "--lora", dir.str("peft"), "--lora-rank", "2"}),
                         "--lora-rank and --lora: give one (a fresh adapter, or one from a PEFT folder)",
                         std::invalid_argument);
    // Resumed, the step folder's adapter continues: --lora must name one like it.
    fs::create_directories(dir.path / "peft2");
    fs::copy_file(dir.path / "peft" / "adapter_model.safetensors", dir.path / "peft2" / "adapter_model.safetensors");
    write(dir.path / "peft2" / "adapter_config.json",
          R"({"peft_type": "LORA", "r": 2, "lora_alpha": 8, "target_modules": ["qkv_proj", "down_proj"]})");
    CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", dir.str("d.jsonl"), "--resume", dir.str("save"), "--lora",
                                         dir.str("peft2"), "--max-steps", "5"}),
                         doctest::Contains("the resumed run's adapter (rank 4, alpha 8, targets qkv_proj,down_proj) is "
                                           "not this folder's (rank 2"),
                         std::invalid_argument);
  }

  // Another adapter over the saved one, or adapter flags without a rank, are refused.
  std::vector<std::string> other = common;
  other[11] = "8";
  other.insert(other.end(), {"--resume", dir.str("save"), "--max-steps", "5"});
  CHECK_THROWS_WITH_AS(app::cmd_train(other), doctest::Contains("has a user LoRA already (rank 4"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", dir.str("d.jsonl"), "--lora-alpha", "3"}),
                       "--lora-alpha, --lora-dropout, --lora-targets: only with --lora-rank", std::invalid_argument);
  CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", dir.str("d.jsonl"), "--lora-rank", "2", "--lora-targets", "k_proj"}),
                       doctest::Contains("--lora-targets: 'k_proj' is not one of"), std::invalid_argument);
}

TEST_CASE("areno train: the tiny model learns 16 mixed-modality rows until areno generate gives their answers") {
  // Must-show 6: text, image, audio and image+audio rows through the CLI, the
  // projector unfrozen; then greedy `areno generate` on the saved step.
  TempDir dir;
  struct Row {
    std::string prompt, image, audio, answer;
  };
  const char* colours[] = {"red", "green", "blue", "yellow"};
  const uint8_t rgb[4][3] = {{220, 30, 30}, {30, 200, 40}, {30, 40, 220}, {230, 220, 30}};
  const char* words[] = {"one", "two", "three", "four"};
  std::vector<Row> rows;
  const int sums[4][2] = {{2, 3}, {4, 1}, {5, 2}, {3, 3}};
  for (auto& ab : sums)
    rows.push_back({fmt::format("What is {} plus {}?", ab[0], ab[1]), "", "", std::to_string(ab[0] + ab[1])});
  for (int k = 0; k < 4; ++k) {
    write_ppm(dir.path / fmt::format("{}.ppm", colours[k]), rgb[k][0], rgb[k][1], rgb[k][2]);
    write_beeps(dir.path / fmt::format("beep{}.wav", k + 1), k + 1);
  }
  for (int k = 0; k < 4; ++k) rows.push_back({"What colour is this?", fmt::format("{}.ppm", colours[k]), "", colours[k]});
  // The tiny random Conformer's rows for these clips differ by a few percent
  // (docs/training.md, known limits), too little to learn in this budget;
  // each clip's question names it.
  for (int k = 0; k < 4; ++k)
    rows.push_back({fmt::format("Clip {}: how many beeps?", k + 1), "", fmt::format("beep{}.wav", k + 1), words[k]});
  for (int k = 0; k < 4; ++k)
    rows.push_back({"Colour and beeps?", fmt::format("{}.ppm", colours[k]), fmt::format("beep{}.wav", k + 1),
                    fmt::format("{} {}", colours[k], words[k])});
  std::string jsonl;
  for (const Row& r : rows) {
    json content = json::array();
    if (!r.image.empty()) content.push_back({{"type", "image_url"}, {"image_url", {{"url", r.image}}}});
    if (!r.audio.empty()) content.push_back({{"type", "audio_url"}, {"audio_url", {{"url", r.audio}}}});
    content.push_back({{"type", "text"}, {"text", r.prompt}});
    jsonl += json{{"messages", {{{"role", "user"}, {"content", content}}, {{"role", "assistant"}, {"content", r.answer}}}}}
                 .dump() + "\n";
  }
  write(dir.path / "d.jsonl", jsonl);
  REQUIRE(app::cmd_train({"--dataset-path", dir.str("d.jsonl"), "--batch-size", "16", "--mini-bs", "16",
                          "--max-steps", "60", "--lr", "1e-2", "--min-lr", "1e-3", "--unfreeze-mm-projector",
                          "--save-path", dir.str("save"), "--metrics-log-dir", dir.str("m")}) == 0);
  const auto l = losses(dir.path / "m");
  REQUIRE(l.size() == 60);
  CHECK(l.back().second < 0.05 * l.front().second);
  int right = 0;
  for (const Row& r : rows) {
    std::vector<std::string> a = {"--model-path", dir.str("save/step-60"), "--prompt", r.prompt, "--max-tokens", "8",
                                  "--print-ids"};
    if (!r.image.empty()) a.insert(a.end(), {"--image", dir.str(r.image)});
    if (!r.audio.empty()) a.insert(a.end(), {"--audio", dir.str(r.audio)});
    const json out = json::parse(stdout_of([&] { return app::cmd_generate(a); }));
    CAPTURE(r.prompt);
    CHECK(out["text"] == r.answer);
    right += out["text"] == r.answer;
  }
  CHECK(right == 16);
}
