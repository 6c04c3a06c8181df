// Issue 12, must show 5: does an image request stall a stream that is
// decoding? One text stream decodes on the engine thread; after --warm tokens
// a 1344x896 image request is submitted from another thread (as an HTTP worker
// would). Engine::submit runs the image processor and the vision tower there,
// so the stream's inter-token gaps should grow by the image's prefill chunks
// (which share steps with the decode, as in any continuous batcher) and by CPU
// contention, not by the tower time.
//
// Prints one JSON line: the stream's gap p50 / max before the image arrived,
// the max gap while the image was being encoded and prefilled, the tower time
// (EngineStats::media_seconds_total), the time submit() took, and the image's
// prompt tokens.
//
// usage: bench_media_gap [--preset tiny|small] [--tokens N] [--warm N] [--chunk N]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/engine.h"

using namespace areno;
using namespace areno::serve;
using Clock = std::chrono::steady_clock;

namespace {

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

phi4mm::RgbImage pattern(int64_t w, int64_t h) {
  phi4mm::RgbImage im;
  im.width = w;
  im.height = h;
  im.rgb.resize(size_t(w * h * 3));
  for (size_t i = 0; i < im.rgb.size(); ++i) im.rgb[i] = uint8_t((i * 2654435761u) >> 24);
  return im;
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "small";
  int64_t tokens = 160, warm = 40, chunk = 512;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--preset") preset = v;
    else if (a == "--tokens") tokens = std::atoll(v.c_str());
    else if (a == "--warm") warm = std::atoll(v.c_str());
    else if (a == "--chunk") chunk = std::atoll(v.c_str());
    else {
      fmt::print(stderr, "usage: bench_media_gap [--preset tiny|small] [--tokens N] [--warm N] [--chunk N]\n");
      return 2;
    }
  }
  auto model = phi4mm::init_phi4mm(preset, 0);
  auto tokenizer = phi4mm::padded_tokenizer(phi4mm::make_tokenizer(), model->config().text.vocab_size);
  auto ids = [&](const std::string& s) {
    std::vector<int64_t> out;
    for (tok::TokenId id : tokenizer->encode(s)) out.push_back(id);
    return out;
  };
  EngineOptions eo;
  eo.kv_cache_bytes = size_t(512) << 20;
  eo.prefill_chunk_tokens = chunk;
  eo.max_batch_tokens = std::max<int64_t>(chunk + 16, 2048);
  Engine engine(model, tokenizer, eo);
  engine.start();

  std::mutex mu;
  std::vector<Clock::time_point> stamps;
  Clock::time_point image_submitted, image_queued, image_first_token;
  bool image_done = false;
  Request text;
  text.prompt = ids("<|user|>Tell me a long story.<|end|><|assistant|>");
  text.params.max_tokens = tokens;
  text.params.temperature = 0;
  text.params.ignore_eos = true;
  std::thread image_client;
  Request image;
  const phi4mm::RgbImage im = pattern(1344, 896);
  image.prompt = ids("<|user|>");
  image.prompt.insert(image.prompt.end(), size_t(phi4mm::num_image_tokens(im.width, im.height)), phi4mm::kImageToken);
  for (int64_t id : ids("What is in this image?<|end|><|assistant|>")) image.prompt.push_back(id);
  image.adapter = phi4mm::Adapter::vision;
  image.media = {phi4mm::Media::of_image(im)};
  image.params.max_tokens = 1;
  image.params.temperature = 0;
  bool launched = false, text_done = false;
  std::condition_variable cv;
  engine.submit(text, [&](const RequestOutput& o) {
    std::lock_guard<std::mutex> lk(mu);
    if (o.done) {
      text_done = true;
      cv.notify_all();
    }
    if (o.tokens.empty()) return;
    stamps.push_back(Clock::now());
    if (int64_t(stamps.size()) == warm && !launched) {
      launched = true;
      image_client = std::thread([&] {
        const auto t0 = Clock::now();
        engine.submit(image, [&](const RequestOutput& io) {
          std::lock_guard<std::mutex> lk2(mu);
          if (!io.tokens.empty() && !image_done) {
            image_first_token = Clock::now();
            image_done = true;
            cv.notify_all();
          }
        });
        std::lock_guard<std::mutex> lk2(mu);
        image_submitted = t0;
        image_queued = Clock::now();
      });
    }
  });
  {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return text_done && (image_done || !launched); });
  }
  if (image_client.joinable()) image_client.join();
  engine.stop(true);
  const EngineStats st = engine.stats();

  // Gaps ending before the image arrived; overlapping its encoding (submit);
  // overlapping its prefill (queued -> first token).
  std::vector<double> before, during, encoding, prefill;
  for (size_t i = 1; i < stamps.size(); ++i) {
    const double g = ms_between(stamps[i - 1], stamps[i]);
    if (stamps[i] <= image_submitted) {
      before.push_back(g);
      continue;
    }
    if (stamps[i - 1] > image_first_token) continue;
    during.push_back(g);
    if (stamps[i - 1] < image_queued) encoding.push_back(g);
    if (stamps[i] > image_queued) prefill.push_back(g);
  }
  auto max_of = [](const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); };
  std::sort(before.begin(), before.end());
  const double before_p50 = before.empty() ? 0 : before[before.size() / 2];
  const double before_max = before.empty() ? 0 : before.back();
  const double during_max = during.empty() ? 0 : *std::max_element(during.begin(), during.end());
  fmt::print(
      "{{\"bench\": \"media_gap\", \"preset\": \"{}\", \"image\": \"1344x896\", \"image_prompt_tokens\": {}, "
      "\"prefill_chunk\": {}, \"gap_before_p50_ms\": {:.2f}, \"gap_before_max_ms\": {:.2f}, "
      "\"gap_during_image_max_ms\": {:.2f}, \"gap_during_encoding_max_ms\": {:.2f}, "
      "\"gap_during_prefill_max_ms\": {:.2f}, \"tower_ms\": {:.1f}, \"submit_ms\": {:.1f}, "
      "\"image_ttft_ms\": {:.1f}, \"gaps_during_image\": {}, \"stream_tokens\": {}}}\n",
      preset, image.prompt.size(), chunk, before_p50, before_max, during_max, max_of(encoding), max_of(prefill),
      st.media_seconds_total * 1e3,
      ms_between(image_submitted, image_queued), ms_between(image_submitted, image_first_token), during.size(),
      stamps.size());
  return 0;
}
