// SFT datasets (issue 14, "Data"): the four file formats, both row shapes,
// targets on the assistant turns, the same ids and media as a serving
// request, and every bad-row case named by file, line and field.
#include <doctest/doctest.h>

#include <fstream>

#include "models/phi4mm/processor/image_io.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "tests/test_util.h"
#include "train/dataset.h"

using namespace areno;
using namespace areno::train;
using nlohmann::json;
using testing::TempDir;

namespace {

const tok::Tokenizer& tokenizer() {
  static const tok::Tokenizer t = phi4mm::make_tokenizer();
  return t;
}

void write(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

void write_image(const std::string& path) {
  phi4mm::RgbImage im;
  im.width = 40, im.height = 30;
  for (int64_t i = 0; i < im.width * im.height * 3; ++i) im.rgb.push_back(uint8_t(i * 7));
  const auto ppm = phi4mm::encode_ppm(im);
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(ppm.data()), std::streamsize(ppm.size()));
}

std::string text_of(const std::vector<int64_t>& ids) {
  std::vector<tok::TokenId> t(ids.begin(), ids.end());
  return tokenizer().decode(t, false);
}

// The target tokens, decoded, one string per contiguous run.
std::vector<std::string> target_runs(const SftRow& r) {
  std::vector<std::string> out;
  std::vector<int64_t> run;
  for (size_t i = 0; i < r.targets.size(); ++i) {
    if (r.targets[i] >= 0) {
      CHECK(r.targets[i] == r.ids[i + 1]);  // the next token
      run.push_back(r.targets[i]);
    } else if (!run.empty()) {
      out.push_back(text_of(run));
      run.clear();
    }
  }
  if (!run.empty()) out.push_back(text_of(run));
  return out;
}

const json kMessages = json::array(
    {{{"role", "system"}, {"content", "Answer in one word."}},
     {{"role", "user"}, {"content", {{{"type", "image_url"}, {"image_url", {{"url", "pic.ppm"}}}},
                                     {{"type", "text"}, {"text", "Colour?"}}}}},
     {{"role", "assistant"}, {"content", "Blue."}},
     {{"role", "user"}, {"content", "Sure?"}},
     {{"role", "assistant"}, {"content", "Yes."}}});

}  // namespace

TEST_CASE("train/dataset: targets are the assistant turns; the prompt is the serving prompt") {
  TempDir dir;
  write_image(dir.str("pic.ppm"));
  write(dir.str("d.jsonl"), json{{"messages", kMessages}}.dump() + "\n");
  DatasetOptions o;
  SftDataset d = load_sft_dataset(dir.str("d.jsonl"), tokenizer(), o);
  REQUIRE(d.rows.size() == 1);
  const SftRow& r = d.rows[0];
  CHECK(r.line == 1);
  CHECK(r.adapter == phi4mm::Adapter::vision);
  REQUIRE(r.media.size() == 1);
  CHECK(r.media[0].image.width == 40);
  CHECK(target_runs(r) == std::vector<std::string>{"Blue.<|end|>", "Yes.<|end|>"});
  CHECK(r.target_tokens == int64_t(tokenizer().encode("Blue.").size() + tokenizer().encode("Yes.").size() + 2));
  // A serving request with the first two messages: the same ids up to the
  // first target, and the same media slots.
  phi4mm::ProcessorOptions po;
  po.source.media_root = dir.str();
  const phi4mm::ProcessedChat serving =
      phi4mm::process_chat(tokenizer(), json::array({kMessages[0], kMessages[1]}), nullptr, po);
  const std::vector<int64_t> want = serving.ids();
  REQUIRE(r.prompt_tokens == int64_t(want.size()));
  CHECK(std::vector<int64_t>(r.ids.begin(), r.ids.begin() + r.prompt_tokens) == want);
  CHECK(serving.media.size() == 1);
  CHECK(want.back() == phi4mm::kAssistant);
  // --train-on last: only the final turn.
  o.train_on = TrainOn::last;
  const SftRow last = load_sft_dataset(dir.str("d.jsonl"), tokenizer(), o).rows.at(0);
  CHECK(target_runs(last) == std::vector<std::string>{"Yes.<|end|>"});
  CHECK(last.ids == r.ids);
}

TEST_CASE("train/dataset: JSON, JSONL, CSV and TSV rows and the prompt/response shape agree") {
  TempDir dir;
  const std::string prompt = "Say \"hi\", then\nstop";
  const json msgs = json::array({{{"role", "user"}, {"content", prompt}}, {{"role", "assistant"}, {"content", "hi, ok"}}});
  write(dir.str("a.json"), json::array({{{"messages", msgs}}, {{"prompt", prompt}, {"response", "hi, ok"}}}).dump());
  write(dir.str("a.jsonl"), json{{"prompt", prompt}, {"response", "hi, ok"}}.dump() + "\n\n" +
                                json{{"messages", msgs}}.dump() + "\n");
  // CSV: quotes doubled, a comma and a newline inside quoted fields.
  write(dir.str("a.csv"), "prompt,response\n\"Say \"\"hi\"\", then\nstop\",\"hi, ok\"\r\n");
  write(dir.str("a.tsv"), "messages\n" + msgs.dump() + "\n");
  const DatasetOptions o;
  const SftRow ref = load_sft_dataset(dir.str("a.json"), tokenizer(), o).rows.at(0);
  CHECK(target_runs(ref) == std::vector<std::string>{"hi, ok<|end|>"});
  for (const char* f : {"a.json", "a.jsonl", "a.csv", "a.tsv"}) {
    CAPTURE(f);
    SftDataset d = load_sft_dataset(dir.str(f), tokenizer(), o);
    CHECK(d.rows.size() == (std::string(f) == "a.csv" || std::string(f) == "a.tsv" ? 1u : 2u));
    for (const SftRow& r : d.rows) {
      CHECK(r.ids == ref.ids);
      CHECK(r.targets == ref.targets);
    }
  }
  CHECK(load_sft_dataset(dir.str("a.jsonl"), tokenizer(), o).rows.at(1).line == 3);  // blank line 2 skipped
  CHECK(load_sft_dataset(dir.str("a.csv"), tokenizer(), o).rows.at(0).line == 2);
}

TEST_CASE("train/dataset: every bad row names file, line and field; --skip-bad-rows counts them") {
  TempDir dir;
  write_image(dir.str("pic.ppm"));
  write(dir.str("../outside_" + std::to_string(::getpid()) + ".ppm"), "P6\n1 1\n255\nabc");
  const json good = {{"prompt", "2+2?"}, {"response", "4"}};
  struct Bad {
    std::string line;
    std::string field;
    std::string needle;
  };
  const std::vector<Bad> bads = {
      {"{not json", "row", "unparseable"},
      // nested past kMaxRowJsonDepth: refused while parsing (nothing later recurses that deep)
      {"{\"prompt\": " + std::string(100, '[') + std::string(100, ']') + ", \"response\": \"x\"}", "row",
       "levels deep"},
      {"[1, 2]", "row", "must be an object"},
      {json{{"messages", {{{"role", "wizard"}, {"content", "x"}}}}}.dump(), "messages", "unknown role"},
      {json{{"messages", {{{"role", "user"}, {"content", "no answer"}}}}}.dump(), "messages", "no target"},
      {json{{"prompt", "x"}}.dump(), "messages", "needs"},
      {json{{"prompt", "x"}, {"response", 3}}.dump(), "response", "string"},
      {json{{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}, {"image_url", {{"url", "missing.png"}}}}}}},
                          {{"role", "assistant"}, {"content", "a"}}}}}.dump(),
       "messages[0].content", "media file"},
      {json{{"messages", {{{"role", "user"},
                           {"content", {{{"type", "image_url"},
                                         {"image_url", {{"url", "../outside_" + std::to_string(::getpid()) + ".ppm"}}}}}}},
                          {{"role", "assistant"}, {"content", "a"}}}}}.dump(),
       "messages[0].content", "media file"},
  };
  for (size_t i = 0; i < bads.size(); ++i) {
    CAPTURE(bads[i].line);
    const std::string path = dir.str("bad" + std::to_string(i) + ".jsonl");
    write(path, good.dump() + "\n" + bads[i].line + "\n" + good.dump() + "\n");
    try {
      load_sft_dataset(path, tokenizer(), {});
      FAIL("no error");
    } catch (const DatasetError& e) {
      CHECK(e.file() == path);
      CHECK(e.line() == 2);
      CHECK(e.field().rfind(bads[i].field, 0) == 0);
      CHECK(std::string(e.what()).find(bads[i].needle) != std::string::npos);
      CHECK(std::string(e.what()).rfind(path + ":2: ", 0) == 0);
    }
    DatasetOptions skip;
    skip.skip_bad_rows = true;
    SftDataset d = load_sft_dataset(path, tokenizer(), skip);
    CHECK(d.rows.size() == 2);
    CHECK(d.bad_rows == 1);
  }
  std::filesystem::remove(dir.path.parent_path() / ("outside_" + std::to_string(::getpid()) + ".ppm"));
  // Too long: dropped and counted, never truncated.
  write(dir.str("long.jsonl"), good.dump() + "\n" + json{{"prompt", std::string(400, 'a') + " b"}, {"response", "4"}}.dump() +
                                   "\n" + json{{"prompt", "2+2?"}, {"response", "four four four four four four"}}.dump() + "\n");
  DatasetOptions lim;
  lim.max_prompt_tokens = 40;
  lim.max_new_tokens = 4;
  SftDataset d = load_sft_dataset(dir.str("long.jsonl"), tokenizer(), lim);
  CHECK(d.rows.size() == 1);
  CHECK(d.too_long == 2);
  CHECK(d.rows[0].line == 1);
  // Whole-file problems.
  write(dir.str("x.json"), "{\"messages\": []}");
  CHECK_THROWS_AS(load_sft_dataset(dir.str("x.json"), tokenizer(), {}), DatasetError);
  write(dir.str("x.parquet"), "");
  CHECK_THROWS_WITH(load_sft_dataset(dir.str("x.parquet"), tokenizer(), {}), doctest::Contains("unknown dataset format"));
  CHECK_THROWS_AS(load_sft_dataset(dir.str("nope.jsonl"), tokenizer(), {}), DatasetError);
  CHECK(train_on_from_name("last") == TrainOn::last);
  CHECK_THROWS(train_on_from_name("first"));
}
