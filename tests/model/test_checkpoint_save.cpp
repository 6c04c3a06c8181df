// save_model and `areno init` into a folder that holds an older checkpoint
// (stale index, shards, single file, PEFT adapters), and a save that runs out
// of disk: the previous checkpoint stays loadable and the error says why.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "app/commands_model.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "nn/io/atomic_file.h"
#include "nn/io/files.h"

#include <nlohmann/json.hpp>
#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tests/model/model_fixtures.h"
#include "tests/test_util.h"

using namespace areno;
using namespace areno::phi4mm;
using namespace areno::testing;  // TempDir, names_in, FileSizeLimit, error_of
namespace fs = std::filesystem;

namespace {

// The tiny model with every weight multiplied by `factor`.
std::shared_ptr<Phi4MMForCausalLM> scaled_tiny(double factor) {
  auto m = load_model(testing::kTinyDir);
  NoGradGuard ng;
  for (auto& [name, p] : m->named_parameters()) p.copy_(p * factor);
  return m;
}

// Every parameter of the model loaded from `dir` has the bits of `want`'s.
void check_loads_as(const std::string& dir, const Phi4MMForCausalLM& want) {
  auto got = load_model(dir);
  auto a = got->named_parameters(), b = want.named_parameters();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(a[i].first);
    Tensor x = a[i].second.contiguous(), y = b[i].second.contiguous();
    REQUIRE(x.nbytes() == y.nbytes());
    CHECK(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0);
  }
}

SaveOptions sharded() {
  SaveOptions so;
  so.max_shard_bytes = 50000;  // three shards of the tiny model
  return so;
}

const std::vector<std::string> kSingleLayout{"config.json", "generation_config.json", "model.safetensors"};

}  // namespace

TEST_CASE("phi4mm/save_model into a folder with an older checkpoint loads the new weights") {
  auto old_model = scaled_tiny(1.0), new_model = scaled_tiny(-2.0);
  SUBCASE("sharded, then a single file: the stale index and shards go") {
    TempDir tmp;
    save_model(*old_model, tmp.str(), sharded());
    REQUIRE(fs::exists(tmp.str("model.safetensors.index.json")));
    // PEFT adapter files of a native-layout checkpoint are an older layout too.
    fs::create_directories(tmp.str("vision-lora"));
    write_file_atomic(tmp.str("vision-lora/adapter_config.json"), "{\"r\": 8, \"lora_alpha\": 16}");
    write_file_atomic(tmp.str("vision-lora/adapter_model.safetensors"), "stale");
    save_model(*new_model, tmp.str());
    CHECK(names_in(tmp.str()) == kSingleLayout);
    check_loads_as(tmp.str(), *new_model);
  }
  SUBCASE("a single file, then sharded: the stale model.safetensors goes") {
    TempDir tmp;
    save_model(*old_model, tmp.str());
    save_model(*new_model, tmp.str(), sharded());
    CHECK(names_in(tmp.str()) == std::vector<std::string>{"config.json", "generation_config.json",
                                                          "model-00001-of-00003.safetensors",
                                                          "model-00002-of-00003.safetensors",
                                                          "model-00003-of-00003.safetensors",
                                                          "model.safetensors.index.json"});
    check_loads_as(tmp.str(), *new_model);
  }
}

TEST_CASE("phi4mm/areno init into a folder with an older sharded checkpoint") {
  TempDir tmp;
  save_model(*scaled_tiny(1.0), tmp.str(), sharded());  // vocabulary 128, three shards + index
  REQUIRE(app::cmd_init({"--preset", "tiny", "--out", tmp.str(), "--seed", "3", "--dtype", "f32",
                         "--no-tokenizer"}) == 0);
  CHECK(names_in(tmp.str()) == std::vector<std::string>{"config.json", "generation_config.json", "model.safetensors",
                                                        "preprocessor_config.json"});
  const auto pre = nlohmann::json::parse(read_file(tmp.str("preprocessor_config.json")));
  CHECK(pre["dynamic_hd"] == 36);
  CHECK(pre["processor_class"] == "Phi4MMProcessor");
  LoadOptions text_only;
  text_only.vision = text_only.audio = false;
  text_only.check_weights = true;
  auto m = load_model(tmp.str(), text_only);
  CHECK(m->get("model.embed_tokens.weight").shape() == Shape{200064, 64});  // the new preset's, not the old 128
}

TEST_CASE("phi4mm/a save_model that runs out of disk leaves the previous checkpoint loadable") {
  TempDir tmp;
  auto old_model = scaled_tiny(1.0);
  save_model(*old_model, tmp.str(), sharded());
  const std::vector<std::string> before = names_in(tmp.str());
  // A limit the first shard fits under and a later one does not: the writes
  // get that far before the disk is "full".
  std::vector<uintmax_t> sizes;
  for (int k = 1; k <= 3; ++k) sizes.push_back(fs::file_size(tmp.str("model-0000" + std::to_string(k) + "-of-00003.safetensors")));
  REQUIRE(*std::max_element(sizes.begin() + 1, sizes.end()) > sizes[0] + 100);
  std::string e;
  {
    FileSizeLimit limit(sizes[0] + 100);
    e = error_of([&] { save_model(*scaled_tiny(3.0), tmp.str(), sharded()); });
  }
  CAPTURE(e);
  CHECK(e.find(tmp.str("model-0000")) != std::string::npos);
  CHECK(e.find("-of-00003.safetensors") != std::string::npos);
  CHECK(e.find("File too large") != std::string::npos);
  CHECK(names_in(tmp.str()) == before);  // nothing replaced, no temporary left
  check_loads_as(tmp.str(), *old_model);
}

TEST_CASE("phi4mm/tokenizer files that run out of disk leave the previous ones loadable") {
  TempDir tmp;
  const tok::Tokenizer t = make_tokenizer();
  write_tokenizer_files(t, tmp.str());
  const std::vector<std::string> before = names_in(tmp.str());
  const uintmax_t size = fs::file_size(tmp.str("tokenizer.json"));
  std::string e;
  {
    FileSizeLimit limit(size / 2);
    e = error_of([&] { write_tokenizer_files(t, tmp.str()); });
  }
  CHECK(e.find(tmp.str("tokenizer.json")) != std::string::npos);
  CHECK(e.find("File too large") != std::string::npos);
  CHECK(names_in(tmp.str()) == before);
  CHECK(fs::file_size(tmp.str("tokenizer.json")) == size);
  CHECK(load_tokenizer(tmp.str()).encode("hello world") == t.encode("hello world"));
}
