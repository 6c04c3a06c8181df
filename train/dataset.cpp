#include "train/dataset.h"

#include <sstream>

#include <fmt/format.h>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "nn/io/files.h"
#include "serve/openai.h"

namespace areno::train {

namespace fs = std::filesystem;
using nlohmann::json;

TrainOn train_on_from_name(const std::string& name) {
  if (name == "all") return TrainOn::all;
  if (name == "last") return TrainOn::last;
  throw std::invalid_argument(fmt::format("--train-on: expected all or last, got '{}'", name));
}

DatasetError::DatasetError(std::string file, int64_t line, std::string field, const std::string& message)
    : std::runtime_error(fmt::format("{}:{}: {}: {}", file, line, field, message)),
      file_(std::move(file)),
      line_(line),
      field_(std::move(field)) {}

namespace {

// Splits CSV/TSV text into records of fields (RFC 4180 quoting: "..." with ""
// for a quote; a quoted field may span lines). Each record keeps its first line.
std::vector<std::pair<int64_t, std::vector<std::string>>> split_delimited(const std::string& text, char sep) {
  std::vector<std::pair<int64_t, std::vector<std::string>>> out;
  std::vector<std::string> fields;
  std::string field;
  bool quoted = false, any = false;
  int64_t line = 1, start = 1;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < text.size() && text[i + 1] == '"') {
          field += '"';
          ++i;
        } else {
          quoted = false;
        }
      } else {
        if (c == '\n') ++line;
        field += c;
      }
      continue;
    }
    if (c == '"' && field.empty()) {
      quoted = any = true;
    } else if (c == sep) {
      fields.push_back(std::move(field));
      field.clear();
      any = true;
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      if (any || !field.empty()) {
        fields.push_back(std::move(field));
        out.emplace_back(start, std::move(fields));
      }
      fields.clear();
      field.clear();
      any = false;
      start = ++line;
    } else {
      field += c;
      any = true;
    }
  }
  if (quoted) throw std::runtime_error(fmt::format("a quoted field opened on line {} never closes", start));
  if (any || !field.empty()) {
    fields.push_back(std::move(field));
    out.emplace_back(start, std::move(fields));
  }
  return out;
}

std::string read_text(const fs::path& file) {
  try {
    return read_file(file.string());
  } catch (const std::exception& e) {
    throw DatasetError(file.string(), 0, "file", e.what());
  }
}

RawRow unparseable(int64_t line, const std::string& why) { return {line, nullptr, "unparseable: " + why}; }

// JSON nested at most `depth` deep (what walks a row later recurses no deeper).
json bounded_json(const std::string& text, int depth) {
  try {
    return serve::parse_json_bounded(text, depth);
  } catch (const serve::ApiError& e) {
    throw std::runtime_error(e.what());
  }
}

// The messages of a row through the serving processor (the one path from
// messages to ids and media, for SFT and RL rows alike).
phi4mm::ProcessedChat process_row(const tok::Tokenizer& tokenizer, const json& messages, const json& v, int64_t line,
                                  const std::string& file, const DatasetOptions& options, bool generation_prompt) {
  phi4mm::ProcessorOptions po;
  po.image = options.image;
  po.audio = options.audio;
  po.image_max_crops = options.image_max_crops;
  po.add_generation_prompt = generation_prompt;
  po.source.media_root =
      options.media_root.empty() ? fs::absolute(fs::path(file)).parent_path().string() : options.media_root;
  try {
    return phi4mm::process_chat(tokenizer, messages, v.value("tools", json()), po);
  } catch (const phi4mm::ProcessorError& e) {
    throw DatasetError(file, line, e.field(), e.what());
  }
}

// A row's "prompt" field as messages: a string is one user turn.
json prompt_messages(const json& p, int64_t line, const std::string& file) {
  if (p.is_string()) return json::array({{{"role", "user"}, {"content", p}}});
  if (p.is_array()) return p;
  throw DatasetError(file, line, "prompt", "must be a string or an array of messages");
}

}  // namespace

std::vector<RawRow> read_rows(const fs::path& file) {
  return read_rows_text(read_text(file), file.string(), file.extension().string());
}

std::vector<RawRow> read_rows_text(const std::string& text, const std::string& name, const std::string& ext) {
  std::vector<RawRow> rows;
  if (ext == ".json") {
    json j;
    try {
      j = bounded_json(text, kMaxRowJsonDepth + 1);  // (the array around the rows)
    } catch (const std::exception& e) {
      throw DatasetError(name, 0, "file", fmt::format("invalid JSON: {}", e.what()));
    }
    if (!j.is_array()) throw DatasetError(name, 0, "file", "a .json dataset must be an array of rows");
    for (size_t i = 0; i < j.size(); ++i) rows.push_back({int64_t(i + 1), std::move(j[i]), {}});
  } else if (ext == ".jsonl") {
    std::istringstream in(text);
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      try {
        rows.push_back({n, bounded_json(line, kMaxRowJsonDepth), {}});
      } catch (const std::exception& e) {
        rows.push_back(unparseable(n, e.what()));
      }
    }
  } else if (ext == ".csv" || ext == ".tsv") {
    std::vector<std::pair<int64_t, std::vector<std::string>>> recs;
    try {
      recs = split_delimited(text, ext == ".csv" ? ',' : '\t');
    } catch (const std::exception& e) {
      throw DatasetError(name, 0, "file", e.what());
    }
    if (recs.empty()) throw DatasetError(name, 1, "header", "the file is empty");
    const std::vector<std::string> header = recs[0].second;
    for (size_t r = 1; r < recs.size(); ++r) {
      const auto& [line, fields] = recs[r];
      if (fields.size() != header.size()) {
        rows.push_back(unparseable(line, fmt::format("{} fields where the header has {}", fields.size(), header.size())));
        continue;
      }
      RawRow row{line, json::object(), {}};
      for (size_t c = 0; c < header.size() && row.error.empty(); ++c) {
        if (header[c] == "messages" || (header[c] == "prompt" && !fields[c].empty() && fields[c][0] == '[')) {
          try {
            row.value[header[c]] = bounded_json(fields[c], kMaxRowJsonDepth - 1);
          } catch (const std::exception& e) {
            row = unparseable(line, header[c] + ": " + e.what());
          }
        } else {
          row.value[header[c]] = fields[c];
        }
      }
      rows.push_back(std::move(row));
    }
  } else {
    throw DatasetError(name, 0, "file", fmt::format("unknown dataset format '{}' (expected .json, .jsonl, .csv or .tsv)",
                                                    ext));
  }
  return rows;
}

SftRow make_sft_row(const tok::Tokenizer& tokenizer, const RawRow& row, const std::string& file,
                    const DatasetOptions& options) {
  auto bad = [&](const std::string& field, const std::string& message) {
    return DatasetError(file, row.line, field, message);
  };
  if (!row.error.empty()) throw bad("row", row.error);
  const json& v = row.value;
  if (!v.is_object()) throw bad("row", fmt::format("a row must be an object (got {})", v.type_name()));
  json messages;
  if (v.contains("messages")) {
    messages = v["messages"];
  } else if (v.contains("prompt") && v.contains("response")) {
    messages = prompt_messages(v["prompt"], row.line, file);
    if (!v["response"].is_string()) throw bad("response", "must be a string");
    messages.push_back({{"role", "assistant"}, {"content", v["response"]}});
  } else {
    throw bad("messages", "a row needs \"messages\", or \"prompt\" and \"response\"");
  }
  phi4mm::ProcessedChat pc = process_row(tokenizer, messages, v, row.line, file, options, false);
  SftRow out;
  out.ids = pc.ids();
  out.media = std::move(pc.media);
  out.adapter = pc.adapter;
  out.line = row.line;
  out.targets.assign(out.ids.size(), -1);
  // Assistant turns: after <|assistant|>, up to and including <|end|>.
  std::vector<std::pair<size_t, size_t>> turns;  // [first, last]
  for (size_t i = 0; i < out.ids.size(); ++i) {
    if (out.ids[i] != phi4mm::kAssistant) continue;
    size_t e = i + 1;
    while (e < out.ids.size() && out.ids[e] != phi4mm::kEnd) ++e;
    if (e >= out.ids.size()) break;  // an unfinished turn is context
    turns.emplace_back(i + 1, e);
    i = e;
  }
  if (turns.empty()) throw bad("messages", "no target: the row has no assistant turn");
  if (options.train_on == TrainOn::last) turns.erase(turns.begin(), turns.end() - 1);
  for (const auto& [a, b] : turns)
    for (size_t q = a; q <= b; ++q) out.targets[q - 1] = out.ids[q];
  out.prompt_tokens = int64_t(turns.front().first);
  for (int64_t t : out.targets) out.target_tokens += t >= 0;
  return out;
}

PromptRow make_prompt_row(const tok::Tokenizer& tokenizer, const RawRow& row, const std::string& file,
                          const DatasetOptions& options) {
  if (!row.error.empty()) throw DatasetError(file, row.line, "row", row.error);
  const json& v = row.value;
  if (!v.is_object())
    throw DatasetError(file, row.line, "row", fmt::format("a row must be an object (got {})", v.type_name()));
  if (!v.contains("prompt")) throw DatasetError(file, row.line, "prompt", "an RL row needs a \"prompt\"");
  PromptRow out;
  out.messages = prompt_messages(v["prompt"], row.line, file);
  phi4mm::ProcessedChat pc = process_row(tokenizer, out.messages, v, row.line, file, options, true);
  out.ids = pc.ids();
  out.media = std::move(pc.media);
  out.adapter = pc.adapter;
  out.line = row.line;
  out.row = v;
  return out;
}

std::vector<int64_t> prompt_of(const SftRow& row) {
  return std::vector<int64_t>(row.ids.begin(), row.ids.begin() + std::min<ptrdiff_t>(row.prompt_tokens, row.ids.size()));
}

std::vector<int64_t> first_answer_of(const SftRow& row) {
  std::vector<int64_t> out;
  for (size_t t = size_t(std::max<int64_t>(row.prompt_tokens - 1, 0)); t < row.targets.size() && row.targets[t] >= 0;
       ++t)
    out.push_back(row.targets[t]);
  return out;
}

PromptDataset load_prompt_dataset(const fs::path& file, const tok::Tokenizer& tokenizer,
                                  const DatasetOptions& options) {
  return load_rows<PromptRow>(
      file, options, [&](const RawRow& raw) { return make_prompt_row(tokenizer, raw, file.string(), options); },
      [&](const PromptRow& row) {
        return options.max_prompt_tokens > 0 && int64_t(row.ids.size()) > options.max_prompt_tokens;
      });
}

SftDataset load_sft_dataset(const fs::path& file, const tok::Tokenizer& tokenizer, const DatasetOptions& options) {
  return load_rows<SftRow>(
      file, options, [&](const RawRow& raw) { return make_sft_row(tokenizer, raw, file.string(), options); },
      [&](const SftRow& row) {
        return (options.max_prompt_tokens > 0 && row.prompt_tokens > options.max_prompt_tokens) ||
               (options.max_new_tokens > 0 && row.target_tokens > options.max_new_tokens);
      });
}

}  // namespace areno::train
