// `areno preprocess`: a messages file through the tokenizer and the image and
// audio processors, written as the released processor's tensors.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "app/commands_model.h"
#include "app/flags.h"
#include "models/phi4mm/audio/audio_features.h"
#include "models/phi4mm/processor/image_processor.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "nn/io/safetensors.h"

namespace areno::app {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kPreprocessUsage =
    "usage: areno preprocess [--model-path DIR] --messages FILE.json --out FILE.safetensors\n"
    "\n"
    "Builds the prompt of an OpenAI chat request (a JSON array of messages, or an\n"
    "object with \"messages\") and runs the image and audio processors on its media\n"
    "parts, writing the released processor's outputs (spec text.md 5.3):\n"
    "  input_ids [1, S] i64, input_mode [1] i64 (0 text, 1 vision, 2 speech, 3 both),\n"
    "  input_image_embeds [n, 1 + max crops, 3, 448, 448] f32, image_sizes [n, 2] i64,\n"
    "  image_attention_mask [n, 1 + max crops, 32, 32] f32, num_img_tokens [n] i64,\n"
    "  input_audio_embeds [m, T, 80] f32, audio_frames [m] i64, audio_embed_sizes [m] i64,\n"
    "  audio_attention_mask [m, T] bool (only when m > 1, as the released processor).\n"
    "Media parts: image_url / audio_url with data URLs, or paths relative to the\n"
    "messages file's folder (nothing outside it); input_audio with base64 data.\n"
    "  --model-path  checkpoint whose tokenizer to use (default: the built-in one)\n";

}  // namespace

phi4mm::ProcessedChat read_messages_file(const std::string& path, const tok::Tokenizer& tokenizer,
                                         phi4mm::ProcessorOptions options) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error(fmt::format("--messages: cannot open {}", path));
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("{}: invalid JSON: {}", path, e.what()));
  }
  json messages = j.is_object() && j.contains("messages") ? j["messages"] : j;
  json tools = j.is_object() && j.contains("tools") ? j["tools"] : json();
  options.source.media_root = fs::absolute(path).parent_path().string();
  try {
    return phi4mm::process_chat(tokenizer, messages, tools, options);
  } catch (const phi4mm::ProcessorError& e) {
    throw std::runtime_error(fmt::format("{}: {}", path, e.what()));
  }
}

int cmd_preprocess(const Args& args) {
  std::string model_path, messages_path, out;
  Flags flags("preprocess", kPreprocessUsage);
  flags.value("--model-path", model_path).value("--messages", messages_path).value("--out", out);
  if (auto rc = flags.parse(args)) return *rc;
  if (messages_path.empty() || out.empty()) {
    fmt::print(stderr, "areno preprocess: --messages and --out are required\n\n{}", kPreprocessUsage);
    return 2;
  }
  const tok::Tokenizer tokenizer = model_path.empty() ? phi4mm::make_tokenizer() : phi4mm::load_tokenizer(model_path);
  const phi4mm::ProcessedChat pc = read_messages_file(messages_path, tokenizer);

  std::vector<std::pair<std::string, Tensor>> tensors;
  const std::vector<int64_t> ids = pc.ids();
  tensors.emplace_back("input_ids", from_vector(ids, {1, int64_t(ids.size())}));
  tensors.emplace_back("input_mode", from_vector(std::vector<int64_t>{int64_t(pc.prompt.mode)}, {1}));
  std::vector<phi4mm::RgbImage> images;
  std::vector<phi4mm::AudioClip> clips;
  for (const auto& m : pc.media) {
    if (m.kind == phi4mm::MediaKind::kImage) images.push_back(m.image);
    else clips.push_back({m.samples, m.sample_rate});
  }
  if (!images.empty()) {
    phi4mm::ImageBatch b = phi4mm::process_images(images);
    tensors.emplace_back("input_image_embeds", b.input_image_embeds);
    tensors.emplace_back("image_sizes", b.image_sizes);
    tensors.emplace_back("image_attention_mask", b.image_attention_mask);
    tensors.emplace_back("num_img_tokens", from_vector(b.num_img_tokens, {int64_t(b.num_img_tokens.size())}));
  }
  if (!clips.empty()) {
    phi4mm::AudioBatch b = phi4mm::audio_features_batch(clips);
    tensors.emplace_back("input_audio_embeds", b.features);
    tensors.emplace_back("audio_frames", from_vector(b.frames, {int64_t(b.frames.size())}));
    tensors.emplace_back("audio_embed_sizes", from_vector(b.tokens, {int64_t(b.tokens.size())}));
    if (b.mask.defined()) tensors.emplace_back("audio_attention_mask", b.mask);
  }
  save_safetensors(out, tensors, {{"prompt", pc.prompt.text}, {"input_mode", phi4mm::input_mode_name(pc.prompt.mode)}});
  fmt::print("wrote {} ({} tokens, mode {}, {} image(s), {} audio clip(s))\n", out, ids.size(),
             phi4mm::input_mode_name(pc.prompt.mode), images.size(), clips.size());
  return 0;
}

}  // namespace areno::app
