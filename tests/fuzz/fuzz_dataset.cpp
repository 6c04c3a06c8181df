// A training dataset file as `areno train` reads it (train/dataset.h): the
// first byte picks the format (.json, .jsonl, .csv, .tsv), the rest is the
// file's text; every row that parses is made into an SFT row (both
// train_on), an RL prompt row and a DPO row, through the serving processor
// with the built-in tokenizer. Media paths resolve under a folder that does
// not exist (no file is read); data URLs decode, with small limits.
#include <exception>
#include <string>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "tests/fuzz/fuzz_common.h"
#include "train/dataset.h"
#include "train/rl/dpo.h"

using namespace areno;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const tok::Tokenizer tokenizer = phi4mm::make_tokenizer();
  if (size < 1 || size > (1 << 20)) return 0;
  static const char* kExt[] = {".json", ".jsonl", ".csv", ".tsv"};
  const std::string ext = kExt[data[0] % 4];
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::string file = "/nonexistent-areno-fuzz/rows" + ext;
  train::DatasetOptions options;
  options.media_root = "/nonexistent-areno-fuzz";
  options.image_max_crops = 4;  // keep the fuzzer's memory small
  try {
    for (const train::RawRow& row : train::read_rows_text(text, file, ext)) {
      if (!row.error.empty()) continue;
      for (train::TrainOn on : {train::TrainOn::all, train::TrainOn::last}) {
        options.train_on = on;
        try {
          (void)train::make_sft_row(tokenizer, row, file, options);
        } catch (const std::exception&) {
        }
      }
      try {
        (void)train::make_prompt_row(tokenizer, row, file, options);
      } catch (const std::exception&) {
      }
      try {
        (void)train::rl::make_dpo_row(tokenizer, row, file, options);
      } catch (const std::exception&) {
      }
    }
  } catch (const std::exception&) {
  }
  return 0;
}
