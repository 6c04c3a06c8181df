// `areno logits`: logits of every position of one token sequence.
#include <fmt/format.h>


#include <stdexcept>
#include <string>

#include "app/commands_model.h"
#include "app/served_model.h"
#include "app/flags.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"

namespace areno::app {

namespace {

constexpr const char* kLogitsUsage =
    "usage: areno logits --model-path DIR (--token-ids 1,2,3 | --messages FILE.json)\n"
    "                    [--adapter none|vision|speech] [--dtype f32|bf16] [--device cpu|cuda]\n"
    "                    [--check-weights] [--lora DIR] [--quantize int8] [--rows all|last|A:B] [--threads N]\n"
    "                    --out FILE.safetensors\n"
    "\n"
    "Runs the model and writes \"logits\" [R, vocab] (f32) of the rows asked for,\n"
    "\"rows\" [R] (their positions) and \"token_ids\" [T] to FILE. LongRoPE uses the short table while the sequence holds at most\n"
    "original_max_position_embeddings tokens, the long table after.\n"
    "  --token-ids  the language model on these ids\n"
    "  --messages   an OpenAI chat request (array of messages, or {\"messages\": ...})\n"
    "               with image_url / audio_url / input_audio parts (data URLs, or paths\n"
    "               relative to the file's folder): the chat template, the processors,\n"
    "               the towers and their rows merged at the placeholders; the adapter\n"
    "               follows the input mode (vision with an image, speech for audio only)\n"
    "  --adapter    modality LoRA for --token-ids (default none = text only)\n"
    "  --dtype      compute dtype (default: the checkpoint's)\n"
    "  --check-weights  refuse a checkpoint holding NaN or infinite weights, naming the tensor\n"
    "  --lora DIR   a PEFT LoRA folder run beside the modality adapter (docs/training.md)\n"
    "  --quantize int8  weight-only int8 for the decoder and the tied head (per output channel\n"
    "                   scales, f32 activations; CPU only)\n"
    "  --rows       positions whose logits are written: all (default), last, or A:B\n"
    "               (A inclusive, B exclusive); only those rows go through the head\n"
    "  --threads N  compute threads (default: OMP_NUM_THREADS, else the physical cores)\n";

std::vector<int64_t> parse_ids(const std::string& s) {
  std::vector<int64_t> ids;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    try {
      size_t used = 0;
      long long v = std::stoll(item, &used);
      if (used != item.size() || v < 0) throw std::invalid_argument("");
      ids.push_back(v);
    } catch (const std::exception&) {
      throw std::invalid_argument(fmt::format("--token-ids: '{}' is not a non-negative integer", item));
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return ids;
}

// --rows: all | last | A:B (0 <= A < B <= T).
std::vector<int64_t> parse_rows(const std::string& s, int64_t T) {
  std::vector<int64_t> rows;
  int64_t a = 0, b = T;
  if (s == "last") {
    a = T - 1;
  } else if (s != "all") {
    const size_t colon = s.find(':');
    try {
      if (colon == std::string::npos) throw std::invalid_argument("");
      size_t u1 = 0, u2 = 0;
      a = std::stoll(s.substr(0, colon), &u1);
      b = std::stoll(s.substr(colon + 1), &u2);
      if (u1 != colon || u2 != s.size() - colon - 1) throw std::invalid_argument("");
    } catch (const std::exception&) {
      throw std::invalid_argument(fmt::format("--rows: expected all, last or A:B, got '{}'", s));
    }
    if (a < 0 || a >= b || b > T)
      throw std::invalid_argument(fmt::format("--rows: {} is not a range inside the {} positions (0 <= A < B <= {})",
                                              s, T, T));
  }
  for (int64_t r = a; r < b; ++r) rows.push_back(r);
  return rows;
}

}  // namespace

int cmd_logits(const Args& args) {
  std::string model_path, ids_str, messages, adapter = "none", dtype, out, device = "cpu", rows_flag = "all";
  bool adapter_given = false;
  Flags flags("logits", kLogitsUsage);
  flags.value("--model-path", model_path).value("--token-ids", ids_str).value("--messages", messages);
  flags.value("--adapter", [&](const std::string& v) {
    adapter = v;
    adapter_given = true;
  });
  flags.value("--dtype", dtype).value("--device", device).value("--out", out).value("--rows", rows_flag);
  flags.compute_threads();
  ModelNeeds needs;
  flags.toggle("--check-weights", needs.check_weights);
  add_model_flags(flags, needs);
  if (auto rc = flags.parse(args)) return *rc;
  if (model_path.empty() || (ids_str.empty() == messages.empty()) || out.empty()) {
    fmt::print(stderr, "areno logits: --model-path, --out and one of --token-ids or --messages are required\n\n{}",
               kLogitsUsage);
    return 2;
  }
  if (!messages.empty() && adapter_given)
    throw std::invalid_argument("--adapter: with --messages the adapter follows the request's media");
  phi4mm::Adapter ad = phi4mm::adapter_from_name(adapter);
  needs.lora = !messages.empty() || ad != phi4mm::Adapter::none;
  needs.towers = needs.tokenizer = !messages.empty();
  const ServedModel served = load_served_model(model_path, device, dtype, needs);
  const phi4mm::Phi4MMForCausalLM& model = *served.model;
  const int64_t vocab = model.config().text.vocab_size;
  std::vector<int64_t> ids;
  phi4mm::PackedBatch batch;
  NoGradGuard ng;
  if (!messages.empty()) {
    phi4mm::ProcessedChat pc =
        read_messages_file(messages, *served.tokenizer, phi4mm::processor_options_for(*served.model));
    ids = pc.ids();
    ad = pc.adapter;
    adapter = phi4mm::adapter_name(ad);
    batch = phi4mm::PackedBatch::single(ids, ad);
    batch.media_rows = phi4mm::media_rows(model, pc.media);
  } else {
    ids = parse_ids(ids_str);
    for (int64_t id : ids)
      if (id >= vocab)
        throw std::invalid_argument(fmt::format("--token-ids: id {} is outside the vocabulary (size {})", id, vocab));
    batch = phi4mm::PackedBatch::single(ids, ad);
  }
  const std::vector<int64_t> rows = parse_rows(rows_flag, int64_t(ids.size()));
  Tensor logits = (rows_flag == "all" ? model.logits(batch) : model.logits_at(batch, rows)).to(Device::cpu(), DType::f32);
  save_safetensors(out,
                   {{"logits", logits},
                    {"rows", from_vector(rows, {int64_t(rows.size())})},
                    {"token_ids", from_vector(ids, {int64_t(ids.size())})}},
                   {{"adapter", adapter}, {"model_path", model_path}});
  fmt::print("wrote {} (logits [{}, {}])\n", out, rows.size(), vocab);
  return 0;
}

}  // namespace areno::app
