// Served LoRAs (`areno serve --lora-modules`, phi4mm::ServedLora): what
// serving requests through adapters costs against the base model, on the
// same engine settings in one run. `requests` prompts of `prompt` tokens,
// each generating `gen` tokens (greedy, ignore_eos), all submitted at once,
// spread over 0 (the base), 1, or K distinct adapters (rank `rank`, every
// decoder linear). Prints one JSON line per setting: wall seconds, generated
// tokens/s and the ratio to the first base run (name 0 in --adapters to run
// the base again, e.g. last, to see the drift).
//
// usage: bench_lora_serving --preset tiny|small [--dtype f32|bf16] [--requests N] [--prompt N] [--gen N]
//                           [--rank R] [--adapters K,K,...]
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "models/phi4mm/init.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/engine.h"
#include "tensor/autograd.h"

using namespace areno;
using namespace areno::serve;

int main(int argc, char** argv) {
  std::string preset = "small", dtype = "f32", adapters_arg = "1,4,8";
  int64_t requests = 8, prompt = 128, gen = 64, rank = 16;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool v = i + 1 < argc;
    if (a == "--preset" && v) preset = argv[++i];
    else if (a == "--dtype" && v) dtype = argv[++i];
    else if (a == "--requests" && v) requests = std::max<int64_t>(1, std::atoll(argv[++i]));
    else if (a == "--prompt" && v) prompt = std::max<int64_t>(1, std::atoll(argv[++i]));
    else if (a == "--gen" && v) gen = std::max<int64_t>(1, std::atoll(argv[++i]));
    else if (a == "--rank" && v) rank = std::max<int64_t>(1, std::atoll(argv[++i]));
    else if (a == "--adapters" && v) adapters_arg = argv[++i];
    else {
      fmt::print(stderr, "usage: bench_lora_serving --preset tiny|small [--dtype f32|bf16] [--requests N] [--prompt N] "
                         "[--gen N] [--rank R] [--adapters K,K,...]\n");
      return 2;
    }
  }
  std::vector<int64_t> counts{0};
  std::stringstream ss(adapters_arg);
  for (std::string k; std::getline(ss, k, ',');) counts.push_back(std::max<int64_t>(0, std::atoll(k.c_str())));
  int64_t most = 0;
  for (int64_t k : counts) most = std::max(most, k);

  auto model = phi4mm::init_model(preset, 0, dtype == "bf16" ? DType::bf16 : DType::f32);
  phi4mm::LoraConfig cfg;
  cfg.r = rank;
  cfg.alpha = double(2 * rank);  // PEFT's common choice: scaling 2
  cfg.targets = phi4mm::kLoraTargets;
  Generator g(1);
  for (int64_t j = 0; j < most; ++j)
    model->add_served_lora(fmt::format("a{}", j), "random", cfg, [&](std::vector<std::pair<std::string, Tensor>>& ts) {
      NoGradGuard ng;
      for (auto& nt : ts) nt.second.copy_(rand_normal(nt.second.shape(), g, 0.0, 0.02).to(nt.second.dtype()));
    });
  auto tokenizer = phi4mm::padded_tokenizer(phi4mm::make_tokenizer(), model->config().text.vocab_size);
  const int64_t V = model->config().text.vocab_size;
  double base_tps = 0;
  for (int64_t k : counts) {
    EngineOptions eo;
    eo.max_running = requests;
    eo.kv_cache_bytes = size_t(1) << 30;
    Engine engine(model, tokenizer, eo);
    std::vector<Request> reqs;
    for (int64_t r = 0; r < requests; ++r) {
      Request q;
      for (int64_t t = 0; t < prompt; ++t) q.prompt.push_back(1000 + (r * 7919 + t * 104729) % (std::min<int64_t>(V, 100000) - 1000));
      q.served_lora = k == 0 ? 0 : int32_t(1 + r % k);
      q.params.max_tokens = gen;
      q.params.temperature = 0;
      q.params.ignore_eos = true;
      reqs.push_back(std::move(q));
    }
    const auto t0 = std::chrono::steady_clock::now();
    generate(engine, reqs);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tps = double(requests * gen) / s;
    if (k == 0 && base_tps == 0) base_tps = tps;
    fmt::print("{{\"bench\": \"lora_serving\", \"preset\": \"{}\", \"dtype\": \"{}\", \"rank\": {}, \"requests\": {}, "
               "\"prompt\": {}, \"gen\": {}, \"adapters\": {}, \"seconds\": {:.3f}, \"tokens_per_s\": {:.1f}, "
               "\"vs_base\": {:.3f}}}\n",
               preset, dtype, rank, requests, prompt, gen, k, s, tps, tps / base_tps);
    std::fflush(stdout);
  }
  return 0;
}
