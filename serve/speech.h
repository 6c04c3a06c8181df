#pragma once
// OpenAI's speech-to-text routes, as vLLM serves them for Phi-4-multimodal:
// POST /v1/audio/transcriptions and /v1/audio/translations, independent of
// HTTP (serve/http_server.cpp hands the multipart/form-data fields in).
//
// A request amounts to one chat turn with the audio and the model card's
// instruction (spec tokens-api.md 2.7), the placeholder written in the text so
// the prompt is the card's exactly:
//   transcribe  <|user|><|audio_1|>Transcribe the audio clip into text.<|end|><|assistant|>
//   translate   <|user|><|audio_1|>Translate the audio to {language}.<|end|><|assistant|>
// It runs through the chat path (parse_chat_request, the processor, the
// engine), so every check and limit of a chat request holds; only the form
// and the response shapes are this file's.
//
// Form fields (text, except `file`):
//   file             the audio (WAV, FLAC, MP3 or OGG; the decoder sniffs the bytes), required
//   model            as in chat (the served model or a served LoRA)
//   language         ISO-639-1 code of the speech, one of the model's speech
//                    languages (en zh de fr it ja es pt); reported, the prompt is unchanged
//   to_language      translations only: ISO-639-1 code of the output (default en)
//   prompt           extra guidance, appended to the instruction on a new line
//   response_format  json (default) | text | verbose_json | srt | vtt
//   timestamp_granularities[]  segment only (the model gives no word timings)
//   temperature (default 0), top_p, top_k, min_p, seed, frequency_penalty,
//   presence_penalty, repetition_penalty, max_completion_tokens (default: what
//   the context leaves), stream, stream_include_usage (vLLM's)
// Other fields are ignored, as in JSON requests. A known field sent twice is
// refused.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/openai.h"

namespace areno::serve {

enum class SpeechTask { transcribe, translate };

// One part of a multipart/form-data body; `value` is a text field's text or
// a file's bytes (the caller keeps them alive).
struct FormField {
  std::string name;
  std::string_view value;
  std::string filename;  // empty for a text field
};

struct SpeechRequest {
  SpeechTask task = SpeechTask::transcribe;
  std::string response_format = "json";
  std::string language;     // "" or a code of kSpeechLanguages
  std::string to_language;  // translations: the output language's code
  bool stream = false;
  nlohmann::json chat;      // the /v1/chat/completions body it amounts to
};

// Validates the form. Throws ApiError 400 naming the field.
SpeechRequest parse_speech_request(SpeechTask task, const std::vector<FormField>& form);

// The user turn's text: the placeholder, the instruction, the client's prompt.
std::string speech_instruction(SpeechTask task, const std::string& to_language, const std::string& prompt);

// The English name of a language code ("en" -> "English"); "" if unknown.
std::string language_name(const std::string& code);

// What the engine produced for the request.
struct SpeechOutput {
  std::string text;
  std::vector<int64_t> tokens;          // sampled ids, a stop token included
  std::vector<TokenLogprob> logprobs;   // of `tokens`
  FinishReason finish = FinishReason::none;
  double duration_s = 0;                // the decoded audio
  double temperature = 0;
  int64_t prompt_tokens = 0, audio_tokens = 0;
};

// The response body and its content type for r.response_format.
struct SpeechBody {
  std::string body;
  std::string content_type;
};
SpeechBody speech_response(const SpeechRequest& r, const SpeechOutput& out);

// OpenAI's usage of a token-billed transcription:
// {"type": "tokens", "input_tokens", "input_token_details": {"text_tokens", "audio_tokens"}, "output_tokens", "total_tokens"}.
nlohmann::json speech_usage(const SpeechOutput& out);

// Streaming (stream true, json or text): each event carries OpenAI's fields
// and vLLM's chunk fields together, so either client reads it:
//   delta  {"type": "transcript.text.delta", "delta": D, "object": "transcription.chunk",
//           "id", "created", "model", "choices": [{"index": 0, "delta": {"content": D}, "finish_reason": null}]}
//   done   {"type": "transcript.text.done", "text": T, "usage": speech_usage, "object": "transcription.chunk",
//           ..., "choices": [{"index": 0, "delta": {}, "finish_reason": "stop" | "length"}]}
// then, with stream_include_usage, vLLM's usage chunk ("choices": [], "usage":
// {"prompt_tokens", "completion_tokens", "total_tokens"}), then [DONE].
nlohmann::json speech_delta_event(const ResponseHeader& h, const std::string& delta);
nlohmann::json speech_done_event(const ResponseHeader& h, const SpeechOutput& out);
nlohmann::json speech_usage_chunk(const ResponseHeader& h, const SpeechOutput& out);

// "HH:MM:SS,mmm" (srt) or "HH:MM:SS.mmm" (vtt).
std::string subtitle_time(double seconds, char decimal);

}  // namespace areno::serve
