// A request body as the server sees it: bounded JSON parsing, the chat,
// completion and Responses request parsers, and the chat processor (flattening, template,
// tools, data-URL media decoded and counted, prompt built) with the built-in
// tokenizer. No files or network: no media root, no remote fetcher.
#include <exception>
#include <string>

#include "models/phi4mm/processor/chat_processor.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/conversations.h"
#include "serve/openai.h"
#include "serve/responses.h"
#include "tests/fuzz/fuzz_common.h"

using namespace areno;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const tok::Tokenizer tokenizer = phi4mm::make_tokenizer();
  if (size > (1 << 20)) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    nlohmann::json body = serve::parse_json_bounded(text, serve::kDefaultMaxJsonDepth);
    // A Responses API body (serve/responses.h) becomes the chat body it amounts to.
    if (body.is_object() && body.contains("input") && !body.contains("messages")) {
      // With previous_response_id or conversation, the body's own input
      // stands for the stored conversation (or the conversation's items).
      const nlohmann::ordered_json obody = serve::parse_ordered_json_bounded(text, serve::kDefaultMaxJsonDepth);
      const nlohmann::ordered_json* previous =
          (obody.contains("previous_response_id") || obody.contains("conversation")) && obody["input"].is_array()
              ? &obody["input"]
              : nullptr;
      // The same body as a Conversations API one: its input as the items.
      if (obody["input"].is_array()) {
        nlohmann::ordered_json cbody = {{"items", obody["input"]}};
        if (obody.contains("metadata")) cbody["metadata"] = obody["metadata"];
        try {
          (void)serve::parse_new_conversation(cbody, 0);
          (void)serve::item_list(serve::parse_conversation_items(cbody));
        } catch (const serve::ApiError&) {
        }
      }
      const serve::ResponsesRequest rr = serve::parse_responses_request(obody, previous);
      // Kept and listed as the store does, with the body's paging fields.
      static serve::ResponsesStore store(size_t(8) << 20);
      if (store.put("resp_fuzz", nlohmann::json::object(), rr.items, nlohmann::json::array())) {
        auto field = [&](const char* key) {
          return obody.contains(key) && obody[key].is_string() ? obody[key].get<std::string>() : std::string();
        };
        try {
          (void)serve::input_items_page(*store.get("resp_fuzz"), field("limit"), field("order"), field("after"));
        } catch (const serve::ApiError&) {
        }
      }
      try {
        body = serve::parse_json_bounded(rr.chat.dump(), serve::kDefaultMaxJsonDepth);
        (void)serve::parse_chat_request(body, {});
      } catch (const serve::ApiError& e) {
        (void)serve::responses_error(e, rr);
        throw;
      }
    }
    const bool chat = body.is_object() && body.contains("messages");
    serve::ApiRequest r = chat ? serve::parse_chat_request(body, {}) : serve::parse_completion_request(body, {});
    if (chat) {
      phi4mm::ProcessorOptions po;
      po.limits.max_image_pixels = 1 << 22;  // keep the fuzzer's memory small
      po.limits.max_audio_seconds = 30;
      po.add_generation_prompt = r.add_generation_prompt;
      po.continue_final_message = r.continue_final_message;
      const phi4mm::ProcessedChat pc = phi4mm::process_chat(tokenizer, r.messages, r.tools, po);
      (void)pc.ids();
    } else {
      (void)serve::completion_prompt_ids(r, tokenizer, 200064);
    }
  } catch (const std::exception&) {
  }
  return 0;
}
