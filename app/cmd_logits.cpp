// `areno logits`: logits of every position of one token sequence.
#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "app/commands_model.h"
#include "autograd/autograd.h"
#include "models/phi4mm/checkpoint.h"
#include "nn/io/safetensors.h"

namespace areno::app {

namespace {

constexpr const char* kLogitsUsage =
    "usage: areno logits --model-path DIR --token-ids 1,2,3 [--adapter none|vision|speech]\n"
    "                    [--dtype f32|bf16] [--device cpu|cuda] --out FILE.safetensors\n"
    "\n"
    "Runs the language model on the token ids and writes \"logits\" [T, vocab] (f32)\n"
    "and \"token_ids\" [T] to FILE. LongRoPE uses the short table while the sequence\n"
    "holds at most original_max_position_embeddings tokens, the long table after.\n"
    "  --adapter   modality LoRA to apply (default none = text only)\n"
    "  --dtype     compute dtype (default: the checkpoint's)\n";

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

}  // namespace

int cmd_logits(const Args& args) {
  std::string model_path, ids_str, adapter = "none", dtype, out, device = "cpu";
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw std::invalid_argument(a + " needs a value");
      return args[++i];
    };
    if (a == "--help" || a == "-h") {
      fmt::print("{}", kLogitsUsage);
      return 0;
    } else if (a == "--model-path") {
      model_path = value();
    } else if (a == "--token-ids") {
      ids_str = value();
    } else if (a == "--adapter") {
      adapter = value();
    } else if (a == "--dtype") {
      dtype = value();
    } else if (a == "--device") {
      device = value();
    } else if (a == "--out") {
      out = value();
    } else {
      fmt::print(stderr, "areno logits: unknown option '{}'\n\n{}", a, kLogitsUsage);
      return 2;
    }
  }
  if (model_path.empty() || ids_str.empty() || out.empty()) {
    fmt::print(stderr, "areno logits: --model-path, --token-ids and --out are required\n\n{}", kLogitsUsage);
    return 2;
  }
  const std::vector<int64_t> ids = parse_ids(ids_str);
  const phi4mm::Adapter ad = phi4mm::adapter_from_name(adapter);
  phi4mm::LoadOptions lo;
  lo.with_lora = ad != phi4mm::Adapter::none;
  if (!dtype.empty()) {
    if (dtype != "f32" && dtype != "bf16")
      throw std::invalid_argument(fmt::format("--dtype: expected f32 or bf16, got '{}'", dtype));
    lo.dtype = dtype == "f32" ? DType::f32 : DType::bf16;
  }
  lo.device = Device::parse(device);
  phi4mm::LoadReport report;
  auto model = phi4mm::load_model(model_path, lo, &report);
  fmt::print(stderr, "loaded {}: {}\n", model_path, report.summary());
  const int64_t vocab = model->config().text.vocab_size;
  for (int64_t id : ids)
    if (id >= vocab)
      throw std::invalid_argument(fmt::format("--token-ids: id {} is outside the vocabulary (size {})", id, vocab));
  NoGradGuard ng;
  Tensor logits = model->logits(phi4mm::PackedBatch::single(ids, ad)).to(Device::cpu(), DType::f32);
  save_safetensors(out, {{"logits", logits}, {"token_ids", from_vector(ids, {int64_t(ids.size())})}},
                   {{"adapter", adapter}, {"model_path", model_path}});
  fmt::print("wrote {} (logits [{}, {}])\n", out, ids.size(), vocab);
  return 0;
}

}  // namespace areno::app
