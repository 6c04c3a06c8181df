// The whole model (models/phi4mm/model.h): a preset with every component
// saves and reloads bit-identically, towers load from their prefixes, the
// media rows come out in prompt order with the processors' token counts, and
// a bad tower config fails before any weight is read.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "model_fixtures.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/processor/chat_processor.h"
#include "models/phi4mm/processor/image_io.h"
#include "models/phi4mm/processor/media_source.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "nn/io/files.h"
#include "nn/io/safetensors.h"
#include "tensor/autograd.h"

using namespace areno;
using namespace areno::phi4mm;
using areno::testing::TempDir;

namespace {

RgbImage test_image(int64_t w, int64_t h, int seed) {
  RgbImage im;
  im.width = w, im.height = h;
  im.rgb.resize(size_t(w * h * 3));
  for (size_t i = 0; i < im.rgb.size(); ++i) im.rgb[i] = uint8_t((i * 7 + size_t(seed) * 31) % 251);
  return im;
}

std::vector<double> tone(int64_t n, int64_t rate, double hz) {
  std::vector<double> s(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) s[size_t(i)] = 0.3 * std::sin(2 * M_PI * hz * double(i) / double(rate));
  return s;
}

}  // namespace

TEST_CASE("phi4mm: a tiny preset with towers saves and reloads bit-identically") {
  auto m = init_phi4mm("tiny", 5, DType::f32);
  REQUIRE(m->image_embed());
  REQUIRE(m->audio_embed());
  TempDir dir;
  save_model(*m, dir.str());
  LoadReport rep;
  auto r = load_model(dir.str(), {}, &rep);
  REQUIRE(r->image_embed());
  REQUIRE(r->audio_embed());
  const int64_t total = int64_t(m->named_parameters().size());
  const int64_t towers =
      int64_t(m->image_embed()->named_parameters().size() + m->audio_embed()->named_parameters().size());
  CHECK(towers > 0);
  CHECK(rep.consumed == total);
  CHECK(rep.expected == total);
  CHECK(rep.skipped == 0);
  // One module named like the checkpoint: the towers sit under model.embed_tokens_extend.
  auto pa = m->named_parameters(), pb = r->named_parameters();
  REQUIRE(pa.size() == pb.size());
  int64_t under_extend = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    CAPTURE(pa[i].first);
    CHECK(pa[i].first == pb[i].first);
    CHECK(max_abs_diff(pa[i].second, pb[i].second) == 0.0);
    under_extend += pa[i].first.rfind("model.embed_tokens_extend.", 0) == 0;
  }
  CHECK(under_extend == towers);

  // Text only: the towers are skipped, not read.
  LoadOptions text_only;
  text_only.vision = text_only.audio = false;
  LoadReport rep2;
  auto t = load_model(dir.str(), text_only, &rep2);
  CHECK(!t->image_embed());
  CHECK(!t->audio_embed());
  CHECK(rep2.skipped == towers);
}

TEST_CASE("phi4mm: one load reads config.json once and opens each shard once") {
  auto m = init_phi4mm("tiny", 5, DType::f32);
  TempDir dir;
  SaveOptions so;
  so.max_shard_bytes = 20'000'000;  // several shards and an index
  save_model(*m, dir.str(), so);
  std::map<std::string, int> opens;
  set_open_hook([&](const std::string& path) { ++opens[std::filesystem::path(path).filename().string()]; });
  LoadReport rep;
  auto r = load_model(dir.str(), {}, &rep);
  set_open_hook(nullptr);
  REQUIRE(r->image_embed());
  REQUIRE(r->audio_embed());
  CHECK(opens["config.json"] == 1);
  CHECK(opens["generation_config.json"] == 1);
  CHECK(opens["model.safetensors.index.json"] == 1);
  int shards = 0;
  for (auto& [name, n] : opens)
    if (name.rfind("model-", 0) == 0) {
      const std::string& param = name;  // clang 14 cannot capture a structured binding
      CAPTURE(param);
      CHECK(n == 1);
      ++shards;
    }
  CHECK(shards >= 2);
  CHECK(opens.size() == size_t(shards + 3));  // nothing else is read
}

TEST_CASE("phi4mm: media rows follow the prompt order and the processors' counts") {
  auto m = init_phi4mm("tiny", 6, DType::f32);
  NoGradGuard ng;
  // image, audio, image, audio
  const std::vector<Media> in = {Media::of_image(test_image(500, 300, 1)), Media::of_audio(tone(16000, 16000, 440.0), 16000),
                                 Media::of_image(test_image(120, 900, 2)), Media::of_audio(tone(8000, 8000, 300.0), 8000)};
  Tensor rows = media_rows(*m, in);
  const int64_t n0 = num_image_tokens(in[0].image.width, in[0].image.height);
  const int64_t n1 = num_image_tokens(in[2].image.width, in[2].image.height);
  const int64_t a0 = audio_token_count(int64_t(in[1].samples.size()), 16000);
  const int64_t a1 = audio_token_count(int64_t(in[3].samples.size()), 8000);
  CHECK(media_token_count(in[0]) == n0);
  CHECK(media_token_count(in[3]) == a1);
  CHECK(a0 == 13);  // 1 s -> 13 tokens (spec)
  REQUIRE(rows.dim() == 2);
  CHECK(rows.size(0) == n0 + a0 + n1 + a1);
  CHECK(rows.size(1) == m->config().text.hidden_size);

  // Each block equals the item computed alone (image rows do not depend on the
  // other image; audio rows use the vision projector because an image is present).
  Tensor r1 = media_rows(*m, std::vector<Media>{in[2]});
  CHECK(testing::rel_err(rows.narrow(0, n0 + a0, n1), r1) < 1e-5);
  Tensor speech = media_rows(*m, std::vector<Media>{in[1]});  // speech projector
  CHECK(speech.size(0) == a0);
  // Audio-only uses the speech projector, with an image the vision one: they differ.
  CHECK(testing::rel_err(rows.narrow(0, n0, a0), speech) > 1e-3);
}

TEST_CASE("phi4mm: dynamic_hd: the processor's placeholders and the tower's rows follow the model's setting") {
  auto m = init_phi4mm("tiny", 6, DType::f32);
  NoGradGuard ng;
  const Media img = Media::of_image(test_image(1000, 750, 1));
  const int64_t full = num_image_tokens(1000, 750);  // 36: a 3x2 grid
  m->set_dynamic_hd(2);
  const int64_t two = num_image_tokens(1000, 750, image_options(2));
  CHECK(two < full);
  // The chat processor counts what the tower gives.
  const ProcessorOptions po = processor_options_for(*m);
  CHECK(po.image_max_crops == 2);
  CHECK(media_token_count(img, "media", po.image_max_crops) == two);
  const std::vector<uint8_t> ppm = encode_ppm(img.image);
  const nlohmann::json messages = {{{"role", "user"},
                                    {"content", {{{"type", "image_url"},
                                                  {"image_url", {{"url", "data:image/x-portable-pixmap;base64," +
                                                                             encode_base64(ppm.data(), ppm.size())}}}}}}}};
  const ProcessedChat pc = process_chat(make_tokenizer(), messages, nullptr, po);
  CHECK(std::count(pc.prompt.ids.begin(), pc.prompt.ids.end(), kImageToken) == two);
  CHECK(media_rows(*m, pc.media).size(0) == two);
  // The processed image carries its limit; an image that names none follows the model.
  CHECK(pc.media[0].max_crops == 2);
  m->set_dynamic_hd(36);
  CHECK(media_rows(*m, pc.media).size(0) == two);
  CHECK(media_rows(*m, std::vector<Media>{img}).size(0) == full);
  CHECK_THROWS_AS(m->set_dynamic_hd(0), std::invalid_argument);
  CHECK_THROWS_AS(m->set_dynamic_hd(65), std::invalid_argument);
}

TEST_CASE("phi4mm: images with their own crop limits in one media list: each as encoded alone, in order") {
  auto m = init_phi4mm("tiny", 6, DType::f32);
  NoGradGuard ng;
  const Media a = Media::of_image(test_image(1000, 750, 1), 1);
  const Media b = Media::of_image(test_image(1000, 750, 1));  // the model's 36
  const Media c = Media::of_image(test_image(640, 900, 2), 2);
  const Media d = Media::of_image(test_image(500, 400, 3), 1);
  const std::vector<Media> all = {a, b, c, d};
  const std::vector<Tensor> rows = media_rows_each(*m, all);
  REQUIRE(rows.size() == 4);
  CHECK(rows[0].size(0) == num_image_tokens(1000, 750, image_options(1)));
  CHECK(rows[1].size(0) == num_image_tokens(1000, 750));
  CHECK(rows[2].size(0) == num_image_tokens(640, 900, image_options(2)));
  CHECK(rows[3].size(0) == num_image_tokens(500, 400, image_options(1)));
  for (size_t i = 0; i < all.size(); ++i) {
    CAPTURE(i);
    const Tensor alone = media_rows(*m, std::vector<Media>{all[i]});
    REQUIRE(alone.shape() == rows[i].shape());
    CHECK(testing::rel_err(rows[i], alone) < 1e-5);
  }
  // The same pixels under two limits give different rows.
  CHECK(rows[0].size(0) != rows[1].size(0));
}

TEST_CASE("phi4mm: a bad tower config fails before any weight is read") {
  auto m = init_phi4mm("tiny", 7, DType::f32);
  TempDir dir;
  save_model(*m, dir.str());
  nlohmann::json j;
  std::ifstream(dir.str("config.json")) >> j;
  j["img_processor"]["num_attention_heads"] = 5;  // 32 wide: does not divide
  std::ofstream(dir.str("config.json")) << j.dump(2);
  // Corrupt the weights too: a load that read them would fail differently.
  std::filesystem::resize_file(dir.str("model.safetensors"), 100);
  CHECK_THROWS_WITH(load_model(dir.str()), doctest::Contains("num_attention_heads"));
}

#include "app/commands_model.h"
#include "models/phi4mm/processor/image_io.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"

TEST_CASE("phi4mm: areno preprocess and areno logits --messages with an image and an audio clip") {
  TempDir dir;
  // Media next to the messages file: a PPM image and a WAV clip.
  RgbImage im = test_image(90, 60, 3);
  {
    auto ppm = encode_ppm(im);
    std::ofstream(dir.str("pic.ppm"), std::ios::binary).write(reinterpret_cast<const char*>(ppm.data()),
                                                              std::streamsize(ppm.size()));
  }
  std::filesystem::copy_file("tests/data/audio/speech_16k_mono.wav", dir.str("clip.wav"));
  nlohmann::json messages = nlohmann::json::array(
      {{{"role", "user"},
        {"content", {{{"type", "image_url"}, {"image_url", {{"url", "pic.ppm"}}}},
                     {{"type", "audio_url"}, {"audio_url", {{"url", "clip.wav"}}}},
                     {{"type", "text"}, {"text", "What do you see and hear?"}}}}}});
  std::ofstream(dir.str("m.json")) << messages.dump();

  REQUIRE(app::cmd_preprocess({"--messages", dir.str("m.json"), "--out", dir.str("p.safetensors")}) == 0);
  SafetensorsFile p(dir.str("p.safetensors"));
  auto ids = p.load_copy("input_ids").to_vector<int64_t>();
  CHECK(p.load_copy("input_mode").to_vector<int64_t>()[0] == 3);
  int64_t n_img = 0, n_aud = 0;
  for (int64_t id : ids) n_img += id == kImageToken, n_aud += id == kAudioToken;
  CHECK(n_img == num_image_tokens(im.width, im.height));
  CHECK(p.load_copy("num_img_tokens").to_vector<int64_t>()[0] == n_img);
  CHECK(p.load_copy("audio_embed_sizes").to_vector<int64_t>()[0] == n_aud);
  ImageBatch ib = process_images({im});
  CHECK(max_abs_diff(p.load_copy("input_image_embeds"), ib.input_image_embeds) == 0.0);
  CHECK(max_abs_diff(p.load_copy("image_attention_mask"), ib.image_attention_mask) == 0.0);

  // logits --messages equals the model API on the same media.
  auto m = init_phi4mm("tiny", 9, DType::f32);
  save_model(*m, dir.str("ckpt"));
  write_tokenizer_files(make_tokenizer(), dir.str("ckpt"));
  REQUIRE(app::cmd_logits({"--model-path", dir.str("ckpt"), "--messages", dir.str("m.json"), "--out",
                           dir.str("l.safetensors")}) == 0);
  Tensor got = SafetensorsFile(dir.str("l.safetensors")).load_copy("logits");
  NoGradGuard ng;
  auto clip = decode_media(MediaKind::kAudio,
                                  [&] {
                                    std::ifstream f(dir.str("clip.wav"), std::ios::binary);
                                    return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)),
                                                                std::istreambuf_iterator<char>());
                                  }(),
                                  "clip");
  const std::vector<Media> in = {Media::of_image(im), clip};
  PackedBatch b = PackedBatch::single(ids, Adapter::vision);
  b.media_rows = media_rows(*m, in);
  CHECK(testing::rel_err(got, m->logits(b)) < 1e-6);
  CHECK_THROWS_WITH(app::cmd_logits({"--model-path", dir.str("ckpt"), "--messages", dir.str("m.json"), "--adapter",
                                     "none", "--out", dir.str("x.safetensors")}),
                    doctest::Contains("--adapter"));
}
