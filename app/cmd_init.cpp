// `areno init`: a random-weight Phi-4-multimodal checkpoint in the released layout.
#include <fmt/format.h>

#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>

#include "app/commands_model.h"
#include "app/flags.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/init.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/processor/processor_config.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "nn/io/finite.h"

namespace areno::app {

namespace {

constexpr const char* kInitUsage =
    "usage: areno init --preset tiny|small|full --out DIR --seed N [--dtype bf16|f32]\n"
    "                  [--rank-file FILE | --no-tokenizer]\n"
    "\n"
    "Writes a random-weight checkpoint (config.json, generation_config.json,\n"
    "model*.safetensors (+ index when sharded), preprocessor_config.json,\n"
    "tokenizer files) with every\n"
    "component: the text model, both LoRA adapters, the SigLIP vision tower with\n"
    "its separators and projector, and the Conformer audio encoder with its\n"
    "speech and vision projectors. tiny/small write their smaller tower sizes\n"
    "into config.json (img_processor, audio_processor.config); full uses the\n"
    "released sizes (5.57 B parameters). Every file is written to a temporary,\n"
    "synced and renamed into place; a checkpoint of an older layout in DIR\n"
    "(stale shards, index, model.safetensors, *-lora/ adapters) is replaced and\n"
    "its leftover files removed; a failed write leaves DIR's previous checkpoint\n"
    "loadable. The weights written are read back and refused if any is NaN or\n"
    "infinite (as --check-weights does when loading).\n"
    "  --preset    tiny (tests), small (CPU benchmarks) or full (released sizes)\n"
    "  --out DIR   output directory (created; a checkpoint there is replaced)\n"
    "  --seed N    random seed (same seed, same weights on every machine)\n"
    "  --dtype     bf16 (default, as released) or f32\n"
    "  --rank-file o200k_base.tiktoken to build the tokenizer files from\n"
    "              (default: the copy compiled into areno)\n"
    "  --no-tokenizer  write no tokenizer files\n";

// --seed: a uint64 as std::stoull reads it (so "-1" wraps around to 2^64 - 1).
uint64_t parse_seed(const std::string& v) {
  try {
    size_t used = 0;
    const uint64_t seed = std::stoull(v, &used);
    if (used == v.size()) return seed;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(fmt::format("--seed: expected a non-negative integer, got '{}'", v));
}

}  // namespace

int cmd_init(const Args& args) {
  std::string preset, out, dtype = "bf16", rank_file;
  bool tokenizer = true;
  std::optional<uint64_t> seed;
  Flags flags("init", kInitUsage);
  flags.value("--preset", preset).value("--out", out).value("--dtype", dtype).value("--rank-file", rank_file);
  flags.value("--seed", [&](const std::string& v) { seed = parse_seed(v); });
  flags.toggle("--no-tokenizer", tokenizer, false);
  if (auto rc = flags.parse(args)) return *rc;
  if (preset.empty() || out.empty() || !seed) {
    fmt::print(stderr, "areno init: --preset, --out and --seed are required\n\n{}", kInitUsage);
    return 2;
  }
  const std::optional<DType> parsed = parse_dtype_flag(dtype);
  if (!parsed) throw std::invalid_argument("--dtype: expected f32 or bf16, got ''");
  const DType dt = *parsed;
  if (tokenizer && !rank_file.empty() && !std::filesystem::exists(rank_file))
    throw std::runtime_error(fmt::format("tokenizer rank file {} not found (pass an existing --rank-file FILE, "
                                         "or leave it out to use the built-in copy)", rank_file));
  auto model = phi4mm::init_phi4mm(preset, *seed, dt);
  phi4mm::save_model(*model, out);
  check_finite(SafetensorsCheckpoint(out));  // --check-weights is always on here
  phi4mm::write_preprocessor_config(out);
  if (tokenizer)
    phi4mm::write_tokenizer_files(rank_file.empty() ? phi4mm::make_tokenizer() : phi4mm::make_tokenizer(rank_file),
                                  out);
  fmt::print("wrote {} ({} preset, seed {}, {}, {} parameters: text+LoRA {}, vision {}, audio {})\n", out, preset,
             *seed, dtype,
             model->num_parameters(),
             model->num_parameters() - model->image_embed()->num_parameters() - model->audio_embed()->num_parameters(),
             model->image_embed()->num_parameters(), model->audio_embed()->num_parameters());
  return 0;
}

}  // namespace areno::app
