// A speech-to-text form as the server sees it (serve/speech.h): the fields of
// a multipart/form-data body (the input is split at 0x1e into parts and each
// part at its first '=' into name and value; a name ending in '@' is a file
// part), the form's checks, the chat request it amounts to, the processor
// (the audio decoded and counted, the prompt built) and every response format
// over a made-up output.
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "models/phi4mm/processor/chat_processor.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/speech.h"
#include "tests/fuzz/fuzz_common.h"

using namespace areno;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const tok::Tokenizer tokenizer = phi4mm::make_tokenizer();
  if (size > (1 << 20)) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<serve::FormField> form;
  for (size_t at = 0; at <= text.size();) {
    size_t end = text.find('\x1e', at);
    if (end == std::string::npos) end = text.size();
    const std::string_view part(text.data() + at, end - at);
    const size_t eq = part.find('=');
    if (eq != std::string_view::npos) {
      std::string name(part.substr(0, eq));
      const bool file = !name.empty() && name.back() == '@';
      if (file) name.pop_back();
      form.push_back({name, part.substr(eq + 1), file ? "clip.wav" : ""});
    }
    at = end + 1;
  }
  for (serve::SpeechTask task : {serve::SpeechTask::transcribe, serve::SpeechTask::translate}) {
    try {
      serve::SpeechRequest r = serve::parse_speech_request(task, form);
      const serve::ApiRequest ar = serve::parse_chat_request(r.chat, {});
      phi4mm::ProcessorOptions po;
      po.limits.max_audio_seconds = 30;  // keep the fuzzer's memory small
      const phi4mm::ProcessedChat pc = phi4mm::process_chat(tokenizer, ar.messages, ar.tools, po);
      serve::SpeechOutput out;
      out.text = r.language + r.to_language;
      out.tokens = {1, 2};
      out.logprobs = {{1, -0.5f, {}}, {2, -1.0f, {}}};
      out.prompt_tokens = int64_t(pc.prompt.ids.size());
      for (const phi4mm::Media& m : pc.media)
        if (m.sample_rate > 0) out.duration_s = double(m.samples.size()) / double(m.sample_rate);
      for (const char* f : {"json", "text", "verbose_json", "srt", "vtt"}) {
        r.response_format = f;
        (void)serve::speech_response(r, out);
      }
      (void)serve::speech_done_event({"id", 0, "m"}, out);
    } catch (const std::exception&) {
    }
  }
  return 0;
}
