// `areno merge-lora`: a checkpoint's user adapter folded into its base
// weights; `areno export-lora`: the adapter alone as a PEFT folder.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>

#include "app/commands_model.h"
#include "app/flags.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/processor/processor_config.h"

namespace areno::app {

namespace {

namespace fs = std::filesystem;

constexpr const char* kMergeUsage =
    "usage: areno merge-lora --model-path DIR [--lora PEFT_DIR] --out DIR [--dtype f32|bf16]\n"
    "\n"
    "Folds the user LoRA of a checkpoint trained with `areno train --lora-rank`\n"
    "(config.json \"user_lora\") into its base weights, W + s·B·A computed in f32\n"
    "and rounded once to the saved dtype, and writes a checkpoint with only the\n"
    "released tensor names and config keys: for tools that do not know the user\n"
    "adapter (transformers' port, the released remote code, vLLM), which would\n"
    "load the unmerged checkpoint without it. areno serves the unmerged\n"
    "checkpoint as it is. Tokenizer, processor and remote-code files are copied;\n"
    "every file is written to a temporary, synced and renamed.\n"
    "  --model-path DIR  the checkpoint with a user LoRA\n"
    "  --lora PEFT_DIR   or a checkpoint without one and a PEFT LoRA folder to fold into it\n"
    "                    (adapter_config.json, adapter_model.safetensors, as peft saves it)\n"
    "  --out DIR         the merged checkpoint (created; not DIR itself)\n"
    "  --dtype           f32 or bf16 (default: the checkpoint's)\n";

constexpr const char* kExportUsage =
    "usage: areno export-lora --model-path DIR --out PEFT_DIR\n"
    "\n"
    "Writes the user LoRA of a checkpoint trained with `areno train --lora-rank`\n"
    "as peft saves an adapter for transformers' port: PEFT_DIR/adapter_config.json\n"
    "(r, lora_alpha, lora_dropout, target_modules as a regex over the decoder's\n"
    "layers) and PEFT_DIR/adapter_model.safetensors (base_model.model.<module>\n"
    ".lora_A.weight, ...), each written to a temporary, synced and renamed. peft's\n"
    "PeftModel.load_adapter opens it beside the released vision/speech adapters;\n"
    "areno's --lora loads it onto the base checkpoint.\n"
    "  --model-path DIR  the checkpoint with a user LoRA\n"
    "  --out PEFT_DIR    the adapter folder (created)\n";

}  // namespace

int cmd_export_lora(const Args& args) {
  std::string model_path, out;
  Flags flags("export-lora", kExportUsage);
  flags.value("--model-path", model_path).value("--out", out);
  if (auto rc = flags.parse(args)) return *rc;
  if (model_path.empty() || out.empty()) {
    fmt::print(stderr, "areno export-lora: --model-path and --out are required\n\n{}", kExportUsage);
    return 2;
  }
  if (!phi4mm::load_config(model_path).user_lora)
    throw std::invalid_argument(fmt::format("{}/config.json: no \"user_lora\": nothing to export (the checkpoint "
                                            "was not trained with --lora-rank)", model_path));
  phi4mm::LoadOptions lo;
  lo.vision = lo.audio = false;  // only the adapter is written
  const auto model = phi4mm::load_model(model_path, lo);
  phi4mm::save_user_lora_peft(*model, out);
  const phi4mm::LoraConfig& u = *model->config().user_lora;
  fmt::print(stderr, "exported the user LoRA (rank {}, alpha {}, on {}) to {}\n", u.r, u.alpha,
             fmt::join(u.targets, ","), out);
  return 0;
}

int cmd_merge_lora(const Args& args) {
  std::string model_path, out, dtype, lora_dir;
  Flags flags("merge-lora", kMergeUsage);
  flags.value("--model-path", model_path).value("--out", out).value("--dtype", dtype).value("--lora", lora_dir);
  if (auto rc = flags.parse(args)) return *rc;
  if (model_path.empty() || out.empty()) {
    fmt::print(stderr, "areno merge-lora: --model-path and --out are required\n\n{}", kMergeUsage);
    return 2;
  }
  std::error_code ec;
  if (fs::exists(out) && fs::equivalent(model_path, out, ec))
    throw std::invalid_argument(fmt::format("--out {}: the checkpoint itself; write the merged one elsewhere", out));
  // The config first: a checkpoint without a user adapter fails before any weight is read.
  if (lora_dir.empty() && !phi4mm::load_config(model_path).user_lora)
    throw std::invalid_argument(fmt::format("{}/config.json: no \"user_lora\": nothing to merge (the checkpoint "
                                            "was not trained with --lora-rank; give a PEFT folder with --lora)",
                                            model_path));
  phi4mm::LoadOptions lo;
  if (!dtype.empty()) lo.dtype = parse_dtype_flag(dtype);
  lo.lora_dir = lora_dir;
  const auto model = phi4mm::load_model(model_path, lo);
  const phi4mm::LoraConfig u = *model->config().user_lora;
  phi4mm::SaveOptions so;
  so.merge_user_lora = true;
  phi4mm::save_model(*model, out, so);
  phi4mm::copy_side_files(model_path, out);
  if (!fs::exists(fs::path(out) / "preprocessor_config.json"))
    phi4mm::write_preprocessor_config(out, phi4mm::image_options(model->config().vision.dynamic_hd));
  fmt::print(stderr, "merged the user LoRA (rank {}, scaling {}, on {}) into {} ({})\n", u.r, u.scaling(),
             fmt::join(u.targets, ","), out, dtype_name(model->dtype()));
  return 0;
}

}  // namespace areno::app
