// `areno train` as a user runs it (issue 14, must-shows 4 and 7): bad input
// stops before the first step naming file, line and field; the loader command;
// a run interrupted and resumed from its save folder logs the same losses.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "app/commands_train.h"
#include "nn/io/files.h"
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
  CHECK_THROWS_WITH_AS(app::cmd_train({"--dataset-path", d, "--algo", "grpo"}), doctest::Contains("not supported"),
                       std::invalid_argument);
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
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    REQUIRE(app::cmd_train(a) == 0);
  };
  run({"--max-steps", "4", "--metrics-log-dir", dir.str("ma")});
  run({"--max-steps", "2", "--save-path", dir.str("save"), "--metrics-log-dir", dir.str("mb")});
  CHECK(read_file(dir.str("save/latest")) == "step-2\n");
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json", "preprocessor_config.json", "optimizer.safetensors", "trainer_state.json"})
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
