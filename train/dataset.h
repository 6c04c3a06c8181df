#pragma once
// SFT data (issue 14, "Data"): rows of a JSON array, JSONL, CSV or TSV file
// become token rows for the trainer through the same processor that builds
// serving prompts (models/phi4mm/processor/chat_processor.h), so a training
// row and a serving request with the same messages give the same ids and
// media slots.
//
// Row shapes:
//   {"messages": [...]}                     chat messages as /v1/chat/completions takes them
//   {"prompt": string | messages, "response": string}
// CSV / TSV: a header row naming the columns "messages" (a JSON array as
// text) or "prompt" and "response".
//
// Targets: the tokens of the assistant turns after "<|assistant|>" up to and
// including their "<|end|>" (every assistant turn, or only the last one);
// everything else is context with no loss. Media paths resolve under the
// dataset file's folder (or --media-root) and may not leave it.
#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/processor/chat_processor.h"
#include "models/phi4mm/text.h"
#include "models/phi4mm/tokenizer/tokenizer.h"

namespace areno::train {

enum class TrainOn { all, last };
TrainOn train_on_from_name(const std::string& name);  // "all" | "last"

// A bad row: the file, its line (JSONL, CSV, TSV) or element (JSON array),
// and the field.
class DatasetError : public std::runtime_error {
 public:
  DatasetError(std::string file, int64_t line, std::string field, const std::string& message);
  const std::string& file() const { return file_; }
  int64_t line() const { return line_; }
  const std::string& field() const { return field_; }

 private:
  std::string file_;
  int64_t line_;
  std::string field_;
};

// One raw row and where it came from.
struct RawRow {
  int64_t line = 0;   // 1-based line (JSONL/CSV/TSV) or element index + 1 (JSON array)
  nlohmann::json value;
  std::string error;  // non-empty: the line did not parse (value is null)
};

// Reads every row of a .json / .jsonl / .csv / .tsv file (by extension).
// Throws DatasetError for a file that cannot be read or parsed as a whole;
// a JSONL or CSV line that does not parse is a row with `error` set, so it
// can be skipped.
std::vector<RawRow> read_rows(const std::filesystem::path& file);
// The same over a file's text: `name` for errors, `ext` picks the format.
std::vector<RawRow> read_rows_text(const std::string& text, const std::string& name, const std::string& ext);
// A row's JSON nests at most this deep (a deeper one is unparseable).
inline constexpr int kMaxRowJsonDepth = 64;

struct SftRow {
  std::vector<int64_t> ids;      // the whole conversation (placeholders expanded)
  std::vector<int64_t> targets;  // per position: the next token to learn, or -1 (no loss)
  std::vector<phi4mm::Media> media;
  phi4mm::Adapter adapter = phi4mm::Adapter::none;
  int64_t line = 0;              // source row
  int64_t prompt_tokens = 0;     // tokens before the first target
  int64_t target_tokens = 0;     // positions with a target
};

// The prompt of a row (the ids before its first target) and the target ids of
// its first assistant turn (including the end token).
std::vector<int64_t> prompt_of(const SftRow& row);
std::vector<int64_t> first_answer_of(const SftRow& row);

struct DatasetOptions {
  TrainOn train_on = TrainOn::all;
  std::string media_root;        // empty: the dataset file's folder
  bool skip_bad_rows = false;
  int64_t max_prompt_tokens = 0; // 0: no limit; longer rows are dropped and counted
  int64_t max_new_tokens = 0;    // 0: no limit; rows with more target tokens are dropped and counted
  bool image = true, audio = true;  // the model's modalities
  int64_t image_max_crops = 36;     // the model's dynamic_hd (an image's placeholder count)
};

// The token row of one raw row. Throws DatasetError naming `file`, the line and the field.
SftRow make_sft_row(const tok::Tokenizer& tokenizer, const RawRow& row, const std::string& file,
                    const DatasetOptions& options);

// A prompt-only row for RL (issue 15): {"prompt": string | messages, ...any
// other fields}, through the same processor as make_sft_row with the
// generation prompt added ("<|assistant|>" last), so the model continues
// with its answer. `messages` are the prompt messages as given to the model
// and `row` the whole raw row (the reward reads its fields).
struct PromptRow {
  std::vector<int64_t> ids;  // placeholders expanded, ends with <|assistant|>
  std::vector<phi4mm::Media> media;
  phi4mm::Adapter adapter = phi4mm::Adapter::none;
  int64_t line = 0;
  nlohmann::json messages;
  nlohmann::json row;
};

// Throws DatasetError naming `file`, the line and the field. Uses
// options.image / audio / media_root; not train_on or max_new_tokens.
PromptRow make_prompt_row(const tok::Tokenizer& tokenizer, const RawRow& row, const std::string& file,
                          const DatasetOptions& options);

// The rows of a dataset file and what was left out of them.
template <typename Row>
struct Dataset {
  std::vector<Row> rows;
  int64_t bad_rows = 0;   // skipped with skip_bad_rows
  int64_t too_long = 0;   // dropped for max_prompt_tokens / max_new_tokens
};

// Every row of `file` made by `make(raw)`: a DatasetError stops the load
// unless options.skip_bad_rows (then the row is counted and skipped); a row
// for which `too_long(row)` holds is counted and dropped. The loop the SFT,
// prompt (RL) and preference (DPO) loaders share.
template <typename Row, typename Make, typename TooLong>
Dataset<Row> load_rows(const std::filesystem::path& file, const DatasetOptions& options, Make&& make,
                       TooLong&& too_long) {
  Dataset<Row> d;
  for (const RawRow& raw : read_rows(file)) {
    Row row;
    try {
      row = make(raw);
    } catch (const DatasetError&) {
      if (!options.skip_bad_rows) throw;
      d.bad_rows++;
      continue;
    }
    if (too_long(row)) {
      d.too_long++;
      continue;
    }
    d.rows.push_back(std::move(row));
  }
  return d;
}

using PromptDataset = Dataset<PromptRow>;  // too long: prompt over max_prompt_tokens

PromptDataset load_prompt_dataset(const std::filesystem::path& file, const tok::Tokenizer& tokenizer,
                                  const DatasetOptions& options);

using SftDataset = Dataset<SftRow>;

// Every row of `file`: stops at the first bad row (DatasetError) unless
// skip_bad_rows; media are read and decoded here, so a missing image fails
// before any training step.
SftDataset load_sft_dataset(const std::filesystem::path& file, const tok::Tokenizer& tokenizer,
                            const DatasetOptions& options);

}  // namespace areno::train
