// Automatic prefix caching (serve/engine.h EngineOptions::prefix_caching):
// time to first token of chat requests that share a long system prompt, one
// request at a time, with the cache off and on, on the same model in one run.
// Each request asks a different question after the same system prompt and
// generates one token (greedy), so its time is its prefill. Prints one JSON
// line per setting: the first request's seconds (nothing cached yet), the
// mean of the others, and the prompt tokens found in the cache.
//
// With --image WxH each request also carries the same generated image (the
// media cache, EngineOptions::media_cache_bytes, on with the prefix cache):
// a later request then skips the vision tower too.
//
// usage: bench_prefix_cache CHECKPOINT_DIR | --preset tiny|small [--system-tokens N] [--requests N]
//                           [--image WxH]
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/init.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/processor/image_processor.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/engine.h"
#include "tensor/autograd.h"

using namespace areno;
using namespace areno::serve;

int main(int argc, char** argv) {
  std::string dir, preset;
  int64_t system_tokens = 1024, requests = 5, width = 0, height = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--preset" && has_value) preset = argv[++i];
    else if (a == "--system-tokens" && has_value) system_tokens = std::atoll(argv[++i]);
    else if (a == "--requests" && has_value) requests = std::max<int64_t>(2, std::atoll(argv[++i]));
    else if (a == "--image" && has_value && std::sscanf(argv[++i], "%ldx%ld", &width, &height) == 2 && width > 0 &&
             height > 0) {
    }
    else if (a[0] != '-' && dir.empty()) dir = a;
    else {
      fmt::print(stderr, "usage: bench_prefix_cache CHECKPOINT_DIR | --preset tiny|small [--system-tokens N] "
                         "[--requests N] [--image WxH]\n");
      return 2;
    }
  }
  if (dir.empty() == preset.empty()) {
    fmt::print(stderr, "bench_prefix_cache: give a checkpoint directory or --preset\n");
    return 2;
  }
  auto model = dir.empty() ? phi4mm::init_phi4mm(preset, 0) : phi4mm::load_model(dir);
  auto tokenizer = phi4mm::padded_tokenizer(phi4mm::make_tokenizer(), model->config().text.vocab_size);
  auto ids = [&](const std::string& s) {
    std::vector<int64_t> out;
    for (tok::TokenId id : tokenizer->encode(s)) out.push_back(id);
    return out;
  };
  // A system prompt of about system_tokens tokens, then distinct questions.
  std::string system = "<|system|>";
  for (int k = 0; int64_t(ids(system).size()) < system_tokens; ++k)
    system += fmt::format("Rule {}: answer briefly, cite the document, and say when you do not know. ", k);
  system += "<|end|>";
  const std::vector<int64_t> sys_ids = ids(system);
  phi4mm::RgbImage image;
  image.width = width, image.height = height;
  image.rgb.resize(size_t(width * height * 3));
  for (size_t i = 0; i < image.rgb.size(); ++i) image.rgb[i] = uint8_t((i * 2654435761u) >> 24);
  for (bool cache : {false, true}) {
    EngineOptions eo;
    eo.prefix_caching = cache;
    eo.media_cache_bytes = cache ? size_t(256) << 20 : 0;
    eo.kv_cache_bytes = size_t(1) << 30;
    Engine engine(model, tokenizer, eo);
    std::vector<double> secs;
    for (int64_t r = 0; r < requests; ++r) {
      Request q;
      q.prompt = sys_ids;
      if (width > 0) {
        const auto user = ids("<|user|>");
        q.prompt.insert(q.prompt.end(), user.begin(), user.end());
        q.prompt.insert(q.prompt.end(), size_t(phi4mm::num_image_tokens(width, height)), phi4mm::kImageToken);
        q.media.push_back(phi4mm::Media::of_image(image));
        q.adapter = phi4mm::Adapter::vision;
      }
      const auto tail = ids(fmt::format("<|user|>Question {}: what does rule {} say?<|end|><|assistant|>", r, r * 7 + 3));
      q.prompt.insert(q.prompt.end(), tail.begin(), tail.end());
      q.params.max_tokens = 1;
      q.params.temperature = 0;
      const auto t0 = std::chrono::steady_clock::now();
      generate(engine, {q});
      secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    double rest = 0;
    for (size_t k = 1; k < secs.size(); ++k) rest += secs[k] / double(secs.size() - 1);
    const EngineStats st = engine.stats();
    fmt::print("{{\"bench\": \"prefix_cache\", \"cache\": {}, \"system_tokens\": {}, \"image\": \"{}x{}\", "
               "\"requests\": {}, \"first_s\": {:.4f}, \"rest_mean_s\": {:.4f}, \"prompt_tokens\": {}, "
               "\"cached_tokens\": {}, \"media_cache_hits\": {}, \"tower_s\": {:.3f}}}\n",
               cache, sys_ids.size(), width, height, requests, secs[0], rest, st.prefix_cache_queries,
               st.prefix_cache_hits, st.media_cache_hits, st.media_seconds_total);
    std::fflush(stdout);
  }
  return 0;
}
