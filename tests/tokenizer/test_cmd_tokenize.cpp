#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "app/cmd_tokenize.h"
#include "tests/tokenizer/fixtures.h"

namespace fs = std::filesystem;

namespace {

struct CliResult {
  int rc;
  std::string out;
};

CliResult run_cli(std::vector<std::string> args) {
  args.insert(args.begin(), "tokenize");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  std::ostringstream captured;
  std::streambuf* old = std::cout.rdbuf(captured.rdbuf());
  const int rc = areno::cmd_tokenize(static_cast<int>(argv.size()), argv.data());
  std::cout.rdbuf(old);
  return {rc, captured.str()};
}

}  // namespace

TEST_CASE("cli/areno tokenize prints ids, prompt and media spans as JSON") {
  const fs::path dir = fs::temp_directory_path() / ("areno_cli_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  areno::phi4mm::write_tokenizer_files(areno::test::phi4(), dir);

  CliResult r = run_cli({"--model-path", dir.string(), "--text", "hello world<|end|>", "--decode"});
  REQUIRE(r.rc == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["ids"] == std::vector<int>{24912, 2375, 200020});
  CHECK(j["decoded"] == "hello world<|end|>");
  CHECK(j["tokens"][1] == " world");

  const fs::path msgs = dir / "messages.json";
  std::ofstream(msgs) << R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
      {"type": "image_url", "image_url": {"url": "x"}}]}], "media_token_counts": {"image": [3]}})";
  r = run_cli({"--model-path", dir.string(), "--messages", msgs.string()});
  REQUIRE(r.rc == 0);
  j = nlohmann::json::parse(r.out);
  CHECK(j["prompt"] == "<|user|><|image_1|>\nWhat is this?<|end|><|assistant|>");
  CHECK(j["mode"] == "vision");
  CHECK(j["media"][0]["start"] == 1);
  CHECK(j["media"][0]["length"] == 3);
  CHECK(j["ids"] == std::vector<int>{200021, 200010, 200010, 200010, 198, 4827, 382, 495, 30, 200020, 200019});

  // Errors: usage (2), missing tokenizer / bad input (1).
  CHECK(run_cli({"--text", "x"}).rc == 2);
  CHECK(run_cli({"--model-path", dir.string()}).rc == 2);
  CHECK(run_cli({"--model-path", dir.string(), "--bogus"}).rc == 2);
  CHECK(run_cli({"--model-path", (dir / "nope").string(), "--text", "x"}).rc == 1);
  // The dispatcher form takes the arguments after "tokenize".
  CHECK(areno::app::cmd_tokenize({"--text", "x"}) == 2);
  std::ofstream(msgs) << R"([{"role": "robot", "content": "x"}])";
  CHECK(run_cli({"--model-path", dir.string(), "--messages", msgs.string()}).rc == 1);
  fs::remove_all(dir);
}
