#include "app/served_model.h"

#include <chrono>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "app/flags.h"
#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/demo/demo.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"

namespace areno::app {

ServedModel load_served_model(const std::string& model_path, const std::string& device, const std::string& dtype,
                              const ModelNeeds& needs) {
  const std::optional<DType> dt = parse_dtype_flag(dtype);
  Device dev;
  try {
    dev = Device::parse(device);
  } catch (const std::exception& e) {
    throw std::invalid_argument(fmt::format("--device: expected cpu or cuda[:N], got '{}' ({})", device, e.what()));
  }
  ServedModel m;
  if (model_path.empty()) {
    m.model = phi4mm::demo_model(dt.value_or(DType::f32));
    if (!needs.lora_dir.empty()) phi4mm::load_user_lora(*m.model, needs.lora_dir);
    if (needs.quantize != phi4mm::Quantize::none && !dev.is_cpu())
      throw std::invalid_argument(fmt::format("--quantize {} runs on the CPU only for now (asked for --device {})",
                                              phi4mm::quantize_name(needs.quantize), device));
    phi4mm::quantize_model(*m.model, needs.quantize);
    if (!dev.is_cpu()) m.model->to(dev);
    m.tokenizer = phi4mm::padded_tokenizer(phi4mm::make_tokenizer(), m.model->config().text.vocab_size);
    m.name = "areno-demo";
    m.demo = true;
    return m;
  }
  phi4mm::LoadOptions lo;
  lo.dtype = dt;
  lo.device = dev;
  lo.with_lora = needs.lora;
  lo.vision = lo.audio = needs.towers;
  lo.check_weights = needs.check_weights;
  lo.quantize = needs.quantize;
  lo.lora_dir = needs.lora_dir;
  phi4mm::LoadReport report;
  const auto t0 = std::chrono::steady_clock::now();
  m.model = phi4mm::load_model(model_path, lo, &report);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (needs.towers)
    fmt::print(stderr, "{}: vision tower {}, audio encoder {}\n", model_path,
               m.model->image_embed() ? "loaded" : "absent", m.model->audio_embed() ? "loaded" : "absent");
  fmt::print(stderr, "loaded {} in {:.1f} s: {}\n", model_path, load_s, report.summary());
  if (const auto& u = m.model->config().user_lora)
    fmt::print(stderr, "user LoRA{}: rank {}, scaling {}, on {}, every request\n",
               needs.lora_dir.empty() ? "" : " from " + needs.lora_dir, u->r, u->scaling(), fmt::join(u->targets, ","));
  if (needs.tokenizer) {
    m.tokenizer = phi4mm::padded_tokenizer(phi4mm::load_tokenizer(model_path), m.model->config().text.vocab_size);
  }
  m.name = model_path;
  return m;
}

void add_model_flags(Flags& flags, ModelNeeds& needs) {
  flags.value("--lora", needs.lora_dir);
  flags.value("--quantize", [&needs](const std::string& v) {
    try {
      needs.quantize = phi4mm::quantize_from_name(v);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(fmt::format("--quantize: {}", e.what()));
    }
  });
}

}  // namespace areno::app
