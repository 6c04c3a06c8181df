// The Phi-4-multimodal tokenizer: o200k_base BPE plus Phi's added tokens at
// the ids of spec tokens-api.md 1.2 / 1.7, and the files a model directory
// carries (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
// added_tokens.json).
#pragma once

#include <filesystem>
#include <memory>

#include "models/phi4mm/tokenizer/tokenizer.h"

namespace areno::phi4mm {

using tok::TokenId;

// Ids (tokens-api.md 1.7).
inline constexpr TokenId kEndOfText = 199999;    // <|endoftext|>: bos = eos = pad = unk
inline constexpr TokenId kImageToken = 200010;   // <|endoftext10|>, expanded per image
inline constexpr TokenId kAudioToken = 200011;   // <|endoftext11|>, expanded per audio
inline constexpr TokenId kEndOfPrompt = 200018;  // <|endofprompt|>
inline constexpr TokenId kAssistant = 200019;
inline constexpr TokenId kEnd = 200020;  // <|end|>: end of turn, stop token
inline constexpr TokenId kUser = 200021;
inline constexpr TokenId kSystem = 200022;
inline constexpr TokenId kTool = 200023;
inline constexpr TokenId kToolEnd = 200024;
inline constexpr TokenId kToolCall = 200025;
inline constexpr TokenId kToolCallEnd = 200026;
inline constexpr TokenId kToolResponse = 200027;
inline constexpr TokenId kTag = 200028;
// Rows of the embedding / LM head (config.json vocab_size).
inline constexpr size_t kVocabSize = 200064;
// First id that is neither a BPE token nor a named token (padding rows).
inline constexpr TokenId kFirstPaddingId = 200029;
inline constexpr size_t kModelMaxLength = 131072;

// Generation stops on these ids (tokens-api.md 1.7).
inline constexpr TokenId kStopIds[] = {kEnd, kEndOfText};

// The repository copy of o200k_base (relative to the repository root).
inline constexpr const char* kO200kRankFile = "models/phi4mm/tokenizer/o200k_base.tiktoken";

// Phi-4-MM's added tokens with their flags.
std::vector<tok::AddedToken> added_tokens();

// True for ids the sampler must never produce: unnamed reserved ids
// (199998, 200000..200017 except 200010/200011) and padding rows >= 200029.
bool is_unused_id(TokenId id);

// Builds the tokenizer from the o200k_base rank file compiled into the library
// (so `areno` runs from any directory), or from a rank file on disk.
tok::Tokenizer make_tokenizer();
tok::Tokenizer make_tokenizer(const std::filesystem::path& rank_file);
// `t` padded to a model's vocabulary (its embedding rows: ids past the
// tokenizer's own decode to nothing), shared, as the engine, the trainers and
// the server take it.
std::shared_ptr<const tok::Tokenizer> padded_tokenizer(tok::Tokenizer t, int64_t vocab_size);
// The embedded copy of models/phi4mm/tokenizer/o200k_base.tiktoken.
std::string_view embedded_o200k_ranks();

// Loads `model_dir`/tokenizer.json. Throws with a clear message if absent.
tok::Tokenizer load_tokenizer(const std::filesystem::path& model_dir);

// Writes tokenizer.json, tokenizer_config.json (with the chat template),
// special_tokens_map.json and added_tokens.json into `model_dir` (created if
// needed), through one FileSet (nn/io/atomic_file.h): all four are written and
// synced before any replaces an older one; a failure names the file and why.
void write_tokenizer_files(const tok::Tokenizer& tokenizer, const std::filesystem::path& model_dir);

// The chat template of tokenizer_config.json (Jinja source, tokens-api.md 2.1).
extern const char* const kChatTemplateJinja;

}  // namespace areno::phi4mm
