#pragma once
// The OpenAI API surface of `areno serve` (spec tokens-api.md sections 3 and
// 5.2), independent of HTTP: request JSON -> validated ApiRequest (sampling
// parameters, messages or prompts), engine outputs -> response objects and
// SSE chunks, errors -> OpenAI error bodies.
//
// Field semantics follow OpenAI, with vLLM's extensions (top_k, min_p,
// repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
// skip_special_tokens, include_stop_str_in_output, return_tokens_as_token_ids,
// guided_json, guided_choice, structured_outputs). Unknown fields are
// ignored, as vLLM does, except vLLM's guided-decoding fields this server
// does not enforce (guided_whitespace_pattern, ...): those are refused.
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/tokenizer.h"
#include "serve/engine.h"
#include "serve/json_schema.h"

namespace areno::serve {

// A request the API refuses: HTTP status plus OpenAI's error body
// {"error": {"message", "type", "param", "code"}}.
struct ApiError : std::runtime_error {
  ApiError(int status, const std::string& message, std::string param = {}, std::string code = {});
  int status;
  std::string param;  // the offending field ("messages[0].content"); empty: null
  std::string code;   // "model_not_found", "context_length_exceeded"...; empty: null
};

// OpenAI error "type" for an HTTP status: invalid_request_error (400, 404,
// 413), authentication_error (401), rate_limit_error (429), server_error
// (500), service_unavailable_error (503).
const char* error_type(int status);
nlohmann::json error_body(const ApiError& e);

// Serialises without ever throwing on invalid UTF-8 (replaced by U+FFFD).
std::string dump_json(const nlohmann::json& j);

// Request JSON nests at most this deep unless --max-json-depth says otherwise.
inline constexpr int kDefaultMaxJsonDepth = 64;
// Parses `text`, refusing arrays and objects nested more than `max_depth`
// levels deep while parsing, so nothing that later prints or walks the value
// recurses deeper than that. Throws ApiError 400 for malformed JSON and for
// nesting past the limit.
nlohmann::json parse_json_bounded(const std::string& text, int max_depth);
// The same, keeping objects' keys in the order they were written (the JSON
// schemas of structured output: properties are written in that order).
nlohmann::ordered_json parse_ordered_json_bounded(const std::string& text, int max_depth);

enum class ApiKind { chat, completion };

// Server-side defaults and caps applied while parsing.
struct ApiLimits {
  int64_t default_max_tokens = 1024;             // chat, when neither max_completion_tokens nor max_tokens
  int64_t completion_default_max_tokens = 16;    // /v1/completions (OpenAI's default)
  int64_t max_n = 16;                            // choices per prompt
  int64_t max_logprobs = bounds::kMaxLogprobs;   // top_logprobs / logprobs cap
  int64_t max_prompts = 64;                      // /v1/completions prompt list length
  int64_t vocab_size = 200064;                   // ids in logit_bias, stop_token_ids, prompts
};

struct ApiRequest {
  ApiKind kind = ApiKind::chat;
  std::string model;                // as sent (empty: not sent)
  SamplingParams params;
  bool max_tokens_given = false;    // false: params.max_tokens is the server default (may be clamped)
  bool stream = false;
  bool include_usage = false;       // stream_options.include_usage
  bool continuous_usage = false;    // vLLM's stream_options.continuous_usage_stats (with include_usage): usage in every chunk
  bool return_tokens_as_token_ids = false;
  // vLLM's: the prompt's log-probabilities with their ranks and the top k
  // (-1: not asked; not with stream), and the prompt's and each choice's token ids.
  int64_t prompt_logprobs = -1;
  bool return_token_ids = false;
  std::string cache_salt;           // vLLM's: the prefix and media caches only shared within a salt
  int64_t image_max_crops = 0;      // vLLM's mm_processor_kwargs {"dynamic_hd": N}; 0: the server's

  // chat
  nlohmann::json messages;
  nlohmann::json tools = nullptr;   // null when none
  std::string tool_choice = "none"; // none | auto | required | the forced function's name
  // The tools a reply must call one of (tool_choice "required": every tool;
  // a named function: that one); empty when the model may answer in text.
  std::vector<std::string> forced_tools;
  // tool_choice "auto" (with no other constraint): every tool's name, for
  // serve/grammar.h's AutoToolCall; empty otherwise.
  std::vector<std::string> auto_tools;
  bool json_object = false;         // response_format json_object, structured_outputs.json_object
  // Where the output's JSON schema stands in the body, dotted
  // ("response_format.json_schema.schema", "guided_json",
  // "structured_outputs.json"); empty: none. The value is a schema object,
  // or (guided_json, structured_outputs.json) a string of its JSON.
  std::string schema_field;
  // guided_choice / structured_outputs.choice: the output is one of these.
  std::vector<std::string> choices;
  // guided_regex / structured_outputs.regex: the output matches it whole
  // (serve/regex.h); `has_regex` because the empty pattern is one.
  std::string regex;
  bool has_regex = false;
  // guided_grammar / structured_outputs.grammar: a GBNF grammar the output
  // is one sentence of (serve/cfg.h).
  std::string grammar;
  bool has_grammar = false;
  // The field that asked for a constrained output (errors name it); empty: none.
  std::string constraint_field;
  // Compiled by compile_output_schemas: the output schema, and each forced
  // tool's `parameters` (parallel to forced_tools).
  std::shared_ptr<const JsonSchema> output_schema;
  std::vector<std::shared_ptr<const JsonSchema>> forced_schemas;
  // Each auto tool's `parameters` (parallel to auto_tools; null: any object).
  std::vector<std::shared_ptr<const JsonSchema>> auto_schemas;
  bool add_generation_prompt = true;
  // vLLM's: the last message left open for the model to continue (needs
  // add_generation_prompt false); chat `echo`: the reply prefixed with the
  // last message's text when that message is the assistant's.
  bool continue_final_message = false;
  bool chat_echo = false;
  std::string echo_prefix;
  bool logprobs = false;            // chat: per-token logprobs requested
  int64_t top_logprobs = 0;

  // completions
  std::vector<nlohmann::json> prompts;  // each a string or an array of token ids
  bool echo = false;
  int64_t completion_logprobs = -1;     // legacy `logprobs` int; -1: none
};

// Validate the body of POST /v1/chat/completions or /v1/completions. Throws
// ApiError (400) naming the field.
ApiRequest parse_chat_request(const nlohmann::json& body, const ApiLimits& limits);
ApiRequest parse_completion_request(const nlohmann::json& body, const ApiLimits& limits);
// After parse_chat_request / parse_completion_request, for a request with an
// output schema (schema_field) or a forced tool call: compiles the schemas
// from the body read in key order (a tool without `parameters` takes none:
// its arguments are {}; a tool whose parameters fall outside the subset gets
// a null schema, any object, unless it is `strict`, which is a 400).
// Throws ApiError 400 naming the field, with the schema path and keyword it
// refuses.
void compile_output_schemas(const nlohmann::ordered_json& body, ApiRequest& r);

// The token ids of each completion prompt: strings are encoded with added
// tokens matched (as vLLM does), id lists are range-checked. Throws ApiError.
std::vector<std::vector<int64_t>> completion_prompt_ids(const ApiRequest& req, const tok::Tokenizer& tokenizer,
                                                        int64_t vocab_size);

// Everything one sample produced, accumulated from RequestOutput events.
struct ChoiceOutput {
  std::vector<int64_t> tokens;
  std::string text;
  std::vector<TokenLogprob> logprobs;
  FinishReason finish = FinishReason::none;
  std::string stop_reason;
  void add(const RequestOutput& o);
};

struct Usage {
  int64_t prompt_tokens = 0;      // expanded prompt(s), once per prompt whatever n
  int64_t completion_tokens = 0;  // all choices, stop tokens included
  int64_t cached_tokens = 0;      // prompt tokens the prefix cache gave (prompt_tokens_details)
  nlohmann::json to_json() const;
};

// What every response object and chunk of one request shares.
struct ResponseHeader {
  std::string id;   // "chatcmpl-..." / "cmpl-..."
  int64_t created = 0;
  std::string model;
};
// vLLM's per-request `mm_processor_kwargs`: {"dynamic_hd": N} (1..64, at
// most N HD crops per image of this request) or {}; another key is a 400
// naming it. Returns N, or 0 when absent or empty.
int64_t parse_mm_processor_kwargs(const nlohmann::json& body);

// prefix + 32 hex digits of 128 random bits from the kernel (getrandom).
std::string new_response_id(const std::string& prefix);

// The JSON `stop_reason`: the stop string, the stop token id as a number, or null.
nlohmann::json stop_reason_json(const ChoiceOutput& c, const SamplingParams& p);

// Chat logprobs object (spec 3.3) for `lps`: {"content": [...], "refusal": null}.
nlohmann::json chat_logprobs_json(const tok::Tokenizer& tokenizer, const std::vector<TokenLogprob>& lps,
                                  int64_t top_k, bool tokens_as_ids);

// Legacy completions logprobs {"tokens", "token_logprobs", "top_logprobs",
// "text_offset"} over prompt entries (echo; the first one is null) followed by
// generated ones. Each top_logprobs dict holds the chosen token and the top k,
// as vLLM's. `text_offset0` is the offset of the first token in the choice's
// text.
nlohmann::json completion_logprobs_json(const tok::Tokenizer& tokenizer,
                                        const std::vector<int64_t>& prompt_ids,
                                        const std::vector<std::optional<TokenLogprob>>& prompt_lps,
                                        const std::vector<TokenLogprob>& lps, bool tokens_as_ids,
                                        int64_t text_offset0 = 0);

// vLLM's `prompt_logprobs` of one prompt: null for the first token, then per
// token an object keyed by token id (as a string) holding the prompt token
// and the top k: {"logprob", "rank", "decoded_token"} (ranks 1..k for the top).
nlohmann::json prompt_logprobs_json(const tok::Tokenizer& tokenizer, const std::vector<int64_t>& prompt_ids,
                                    const std::vector<std::optional<TokenLogprob>>& prompt_lps, int64_t top_k,
                                    bool tokens_as_ids);

// Tool calls in a completion (spec 5.2): `<|tool_call|>[...]<|/tool_call|>`
// or `functools[...]`, each element {"name", "arguments" | "parameters"};
// names must be among `tools`. On any parse failure nothing is found and the
// text stays content.
struct ToolCallParse {
  bool found = false;
  nlohmann::json content = nullptr;     // leftover text, or null
  nlohmann::json tool_calls = nlohmann::json::array();
};
ToolCallParse parse_tool_calls(const std::string& text, const nlohmann::json& tools);
// Streaming with tools: one choice's text as it arrives, split into content
// to send now and a tool call (either form above, anywhere in the reply)
// held until the choice ends. Text that could still begin a call (a proper
// prefix of a marker) and the whitespace before it are held back until the
// next piece decides; the content before a call is sent right-trimmed, as
// parse_tool_calls trims it.
class ToolCallStreamer {
 public:
  // The content to send now, after appending `text`.
  std::string push(std::string_view text);
  // At the choice's end: the held text parsed. found: the calls, and the text
  // after them as content (or null); else everything held as content.
  ToolCallParse finish(const nlohmann::json& tools);

 private:
  std::string held_;
  bool in_call_ = false;
};

// Non-streaming responses. `choices` for completions are prompt-major:
// choices[i * n + j] is sample j of prompt i; `prompt_ids[i]` and
// `prompt_lps[i]` are used with echo, prompt_logprobs and return_token_ids
// (chat: the one prompt's).
nlohmann::json chat_response(const ResponseHeader& h, const ApiRequest& req, const tok::Tokenizer& tokenizer,
                             const std::vector<ChoiceOutput>& choices, const Usage& usage,
                             const std::vector<int64_t>& prompt_ids = {},
                             const std::vector<std::optional<TokenLogprob>>& prompt_lps = {});
nlohmann::json completion_response(const ResponseHeader& h, const ApiRequest& req, const tok::Tokenizer& tokenizer,
                                   const std::vector<std::vector<int64_t>>& prompt_ids,
                                   const std::vector<std::vector<std::optional<TokenLogprob>>>& prompt_lps,
                                   const std::vector<ChoiceOutput>& choices, const Usage& usage);

// Streaming chunks (spec 3.5). `finish` null in all but the last chunk of a choice.
nlohmann::json chat_chunk(const ResponseHeader& h, int64_t index, const nlohmann::json& delta,
                          const nlohmann::json& logprobs = nullptr, const nlohmann::json& finish = nullptr,
                          const nlohmann::json& stop_reason = nullptr);
nlohmann::json completion_chunk(const ResponseHeader& h, int64_t index, const std::string& text,
                                const nlohmann::json& logprobs = nullptr, const nlohmann::json& finish = nullptr,
                                const nlohmann::json& stop_reason = nullptr);
// The last chunk with "choices": [] and the usage (stream_options.include_usage).
nlohmann::json usage_chunk(const ResponseHeader& h, ApiKind kind, const Usage& usage);

// One server-sent event: "data: <one-line JSON>\n\n".
std::string sse_event(const nlohmann::json& j);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

}  // namespace areno::serve
