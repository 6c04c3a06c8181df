// Hostile media (issue 13, classes 5-8 and 10): remote media is not a
// scanner, local paths are not an existence oracle, a huge image is refused
// for context length before it is decoded, decoded bytes in flight are
// budgeted, audio samples and features stay finite, and decoder errors name
// the format and the reason. Servers under test listen on loopback only.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <httplib.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <stb_image_write.h>

#include "models/phi4mm/audio/audio_features.h"
#include "models/phi4mm/audio/audio_io.h"
#include "models/phi4mm/init.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/processor/chat_processor.h"
#include "models/phi4mm/processor/image_io.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "serve/engine.h"
#include "serve/http_server.h"
#include "serve/media_fetch.h"
#include "tests/serve/http_fixture.h"

using namespace areno;
using namespace areno::serve;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// ---- media bytes ---------------------------------------------------------

void append_to(void* ctx, void* data, int size) {
  auto* out = static_cast<std::vector<uint8_t>*>(ctx);
  out->insert(out->end(), static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + size);
}

std::vector<uint8_t> encoded(int w, int h, bool jpeg) {
  std::vector<uint8_t> px(size_t(w * h * 3));
  for (size_t i = 0; i < px.size(); ++i) px[i] = uint8_t((i * 31 + 5) % 256);
  std::vector<uint8_t> out;
  const int ok = jpeg ? stbi_write_jpg_to_func(append_to, &out, w, h, 3, px.data(), 90)
                      : stbi_write_png_to_func(append_to, &out, w, h, 3, px.data(), w * 3);
  REQUIRE(ok != 0);
  return out;
}

uint32_t crc32(const uint8_t* p, size_t n, uint32_t c = 0xFFFFFFFFu) {
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return c;
}

void put_chunk(std::vector<uint8_t>& png, const char* type, const std::vector<uint8_t>& data) {
  for (int k = 3; k >= 0; --k) png.push_back(uint8_t(data.size() >> (8 * k)));
  std::vector<uint8_t> body(type, type + 4);
  body.insert(body.end(), data.begin(), data.end());
  png.insert(png.end(), body.begin(), body.end());
  const uint32_t crc = ~crc32(body.data(), body.size());
  for (int k = 3; k >= 0; --k) png.push_back(uint8_t(crc >> (8 * k)));
}

// A valid, black, 8-bit grey PNG of side x side pixels: one fixed-Huffman
// deflate block of zeros (a literal, then matches of 258 at distance 1), about
// 13 bits per 258 pixels -- 1 MB for 13000 x 13000, 0.5 GB once decoded to RGB.
// `with_pixels` false: the header alone (no IDAT).
std::vector<uint8_t> black_png(uint32_t side, bool with_pixels = true) {
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
  std::vector<uint8_t> ihdr;
  for (uint32_t v : {side, side})
    for (int k = 3; k >= 0; --k) ihdr.push_back(uint8_t(v >> (8 * k)));
  ihdr.insert(ihdr.end(), {8, 0, 0, 0, 0});  // 8-bit grey, no interlace
  put_chunk(png, "IHDR", ihdr);
  if (with_pixels) {
    std::vector<uint8_t> z = {0x78, 0x01};
    uint32_t acc = 0;
    int bits = 0;
    auto put_bits = [&](uint32_t v, int n) {  // LSB first
      for (int i = 0; i < n; ++i) {
        acc |= ((v >> i) & 1u) << bits;
        if (++bits == 8) z.push_back(uint8_t(acc)), acc = 0, bits = 0;
      }
    };
    auto put_code = [&](uint32_t code, int n) {  // Huffman codes MSB first
      for (int i = n - 1; i >= 0; --i) put_bits((code >> i) & 1u, 1);
    };
    const uint64_t total = uint64_t(side) * (uint64_t(side) + 1);  // a filter byte per row
    put_bits(1, 1);                                                 // BFINAL
    put_bits(1, 2);                                                 // fixed Huffman
    put_code(0x30, 8);                                              // literal 0
    uint64_t left = total - 1;
    for (; left >= 258; left -= 258) {
      put_code(0xC5, 8);  // length 258 (symbol 285)
      put_code(0, 5);     // distance 1
    }
    for (; left > 0; --left) put_code(0x30, 8);
    put_code(0, 7);  // end of block
    if (bits) z.push_back(uint8_t(acc));
    const uint32_t adler = uint32_t(total % 65521) << 16 | 1u;
    for (int k = 3; k >= 0; --k) z.push_back(uint8_t(adler >> (8 * k)));
    put_chunk(png, "IDAT", z);
  }
  put_chunk(png, "IEND", {});
  return png;
}

// A mono 32-bit float WAV at 16 kHz.
std::vector<uint8_t> float_wav(const std::vector<float>& samples) {
  auto u32 = [](std::vector<uint8_t>& b, uint32_t v) {
    for (int k = 0; k < 4; ++k) b.push_back(uint8_t(v >> (8 * k)));
  };
  auto u16 = [](std::vector<uint8_t>& b, uint16_t v) { b.insert(b.end(), {uint8_t(v), uint8_t(v >> 8)}); };
  const uint32_t data = uint32_t(samples.size() * 4);
  std::vector<uint8_t> b = {'R', 'I', 'F', 'F'};
  u32(b, 36 + data);
  b.insert(b.end(), {'W', 'A', 'V', 'E', 'f', 'm', 't', ' '});
  u32(b, 16);
  u16(b, 3);  // IEEE float
  u16(b, 1);
  u32(b, 16000);
  u32(b, 16000 * 4);
  u16(b, 4);
  u16(b, 32);
  b.insert(b.end(), {'d', 'a', 't', 'a'});
  u32(b, data);
  for (float f : samples) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u32(b, u);
  }
  return b;
}

std::string data_url(const std::vector<uint8_t>& b, const char* type) {
  return fmt::format("data:{};base64,{}", type, phi4mm::encode_base64(b.data(), b.size()));
}

json image_part(const std::string& url) { return {{"type", "image_url"}, {"image_url", {{"url", url}}}}; }

json chat_with(const json& part, int max_tokens = 2) {
  return {{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "see"}}, part}}}}},
          {"max_tokens", max_tokens},
          {"temperature", 0}};
}

std::string error_text(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// Peak resident memory of this process (VmHWM), in KiB.
int64_t peak_rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6));
  return -1;
}

// ---- servers ---------------------------------------------------------------

// The tiny model with both towers on an engine, shared by the server tests.
struct Towers {
  std::shared_ptr<const tok::Tokenizer> tokenizer;
  std::unique_ptr<Engine> engine;
  Towers() {
    std::signal(SIGPIPE, SIG_IGN);
    auto model = phi4mm::init_phi4mm("tiny", 0);
    tokenizer = tokenizer_for(*model);
    EngineOptions eo;
    eo.kv_blocks = 512;
    engine = std::make_unique<Engine>(model, tokenizer, eo);
    engine->start();
  }
  ~Towers() { engine->stop(false); }
  static Towers& shared() {
    static Towers t;
    return t;
  }
};

struct Answer {
  int status = 0;
  json body;
  std::string message() const { return body.contains("error") ? body["error"].value("message", "") : ""; }
};

Answer post_chat(int port, const json& body) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(120, 0);
  auto r = cli.Post("/v1/chat/completions", body.dump(), "application/json");
  REQUIRE_MESSAGE(r, httplib::to_string(r.error()));
  return {r->status, json::parse(r->body, nullptr, false)};
}

// A loopback port nothing listens on.
int closed_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  ::close(fd);
  return ntohs(a.sin_port);
}

// Media host on loopback: an image, a 404, redirect chains, a slow and a dripping body.
struct MediaHost {
  httplib::Server srv;
  std::thread thread;
  int port = 0;
  std::vector<uint8_t> image = encoded(16, 12, false);
  MediaHost() {
    srv.Get("/img.png", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(std::string(image.begin(), image.end()), "image/png");
    });
    // /chain/N redirects N times before the image (relative and absolute Locations).
    srv.Get(R"(/chain/(\d+))", [this](const httplib::Request& q, httplib::Response& r) {
      const int n = std::stoi(q.matches[1]);
      r.status = 302;
      r.set_header("Location", n <= 1 ? fmt::format("http://127.0.0.1:{}/img.png", port) : fmt::format("{}", n - 1));
    });
    srv.Get("/slow", [](const httplib::Request&, httplib::Response& r) {
      std::this_thread::sleep_for(std::chrono::seconds(4));
      r.set_content("late", "image/png");
    });
    srv.Get("/drip", [](const httplib::Request&, httplib::Response& r) {
      r.set_chunked_content_provider("image/png", [](size_t offset, httplib::DataSink& sink) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        sink.write("x", 1);
        if (offset > 40) sink.done();
        return true;
      });
    });
    port = srv.bind_to_any_port("127.0.0.1");
    thread = std::thread([this] { srv.listen_after_bind(); });
  }
  ~MediaHost() {
    srv.stop();
    thread.join();
  }
  std::string url(const std::string& path, const std::string& host = "127.0.0.1") const {
    return fmt::format("http://{}:{}{}", host, port, path);
  }
};

}  // namespace

// ---- class 5: remote media ---------------------------------------------------

TEST_CASE("serve/media_fetch non-public addresses: IPv4, IPv6 and IPv4 inside IPv6") {
  const std::vector<std::pair<const char*, const char*>> table = {
      {"127.0.0.1", "loopback"},        {"127.255.0.9", "loopback"},     {"10.1.2.3", "private"},
      {"172.16.0.1", "private"},        {"172.31.255.1", "private"},     {"172.32.0.1", ""},
      {"192.168.1.1", "private"},       {"169.254.169.254", "link-local"}, {"0.0.0.0", "unspecified"},
      {"224.0.0.1", "multicast"},       {"239.1.1.1", "multicast"},      {"255.255.255.255", "reserved"},
      {"100.64.0.1", "shared"},         {"8.8.8.8", ""},                 {"93.184.216.34", ""},
      {"::1", "loopback"},              {"::", "unspecified"},           {"fe80::1", "link-local"},
      {"fc00::1", "private"},           {"fd12:3456::1", "private"},     {"ff02::1", "multicast"},
      {"::ffff:127.0.0.1", "loopback"}, {"::ffff:10.0.0.1", "private"},  {"::ffff:8.8.8.8", ""},
      {"::127.0.0.1", "loopback"},      {"64:ff9b::7f00:1", "loopback"}, {"2002:a00:1::", "private"},
      {"2001:db8::1", "reserved"},      {"2001:4860:4860::8888", ""},    {"2606:4700::1111", ""}};
  for (const auto& [ip, kind] : table) {
    const auto& ip_ = ip;  // clang 14 cannot capture a structured binding
    CAPTURE(ip_);
    CHECK(non_public_address_kind(ip) == kind);
  }
  CHECK_THROWS_AS(non_public_address_kind("localhost"), std::invalid_argument);
}

TEST_CASE("serve/media_fetch refuses loopback with the same client text as a closed port, a 404 and a long redirect "
          "chain; redirects, deadline and byte cap") {
  MediaHost host;
  Towers& t = Towers::shared();
  ServerOptions remote;
  remote.media.allow_remote = true;
  Served strict(*t.engine, remote);
  remote.media.allow_private = true;
  remote.media.timeout_seconds = 1;
  Served open(*t.engine, remote);

  const std::string uniform = std::string("messages[0].content.image_url.url: ") + kMediaFetchFailed;
  auto refused = [&](int port, const std::string& url) {
    CAPTURE(url);
    const Answer a = post_chat(port, chat_with(image_part(url)));
    CHECK(a.status == 400);
    CHECK(a.message() == uniform);
  };
  // Without --allow-private-media: the loopback host in every spelling, and a
  // redirect hop (also to loopback) is never reached.
  for (const std::string h : {"127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "0.0.0.0", "[::1]", "127.1"})
    refused(strict.port, host.url("/img.png", h));
  refused(strict.port, host.url("/chain/1"));
  // With it: a closed port, a 404, four redirects, an unsupported scheme in a
  // Location, a body that arrives after the deadline, one that drips past it.
  refused(open.port, fmt::format("http://127.0.0.1:{}/img.png", closed_port()));
  refused(open.port, host.url("/missing.png"));
  refused(open.port, host.url("/chain/4"));
  const auto t0 = std::chrono::steady_clock::now();
  refused(open.port, host.url("/slow"));
  refused(open.port, host.url("/drip"));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 4.5);  // two fetches, each cut at the 1 s deadline (the slow one answers after 4 s)

  // Fetched: directly and through three redirects (relative and absolute).
  for (const std::string path : {"/img.png", "/chain/3", "/chain/1"}) {
    CAPTURE(path);
    const Answer a = post_chat(open.port, chat_with(image_part(host.url(path))));
    CHECK(a.status == 200);
    CHECK(a.body["usage"]["prompt_tokens"].get<int64_t>() > phi4mm::num_image_tokens(16, 12));
  }
  // The byte cap gives the same text too.
  MediaFetchOptions small;
  small.allow_remote = small.allow_private = true;
  CHECK(error_text([&] { fetch_remote_media(host.url("/img.png"), 10, "f", small); }) ==
        std::string("f: ") + kMediaFetchFailed);
  CHECK(fetch_remote_media(host.url("/img.png"), 1 << 20, "f", small) == host.image);
}

// ---- class 6: local paths -----------------------------------------------------

TEST_CASE("processor/media_source one error for missing, outside, escaping, directory and unreadable paths") {
  const fs::path base = fs::temp_directory_path() / fmt::format("areno_oracle_{}", ::getpid());
  const fs::path root = base / "root";
  fs::create_directories(root / "sub");
  const std::vector<uint8_t> png = encoded(4, 4, false);
  for (const fs::path& p : {base / "secret.png", root / "ok.png", root / "locked.png"})
    std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(png.data()), std::streamsize(png.size()));
  fs::create_symlink(base / "secret.png", root / "escape.png");
  fs::permissions(root / "locked.png", fs::perms::none);

  phi4mm::MediaSource src;
  src.media_root = root.string();
  auto read = [&](const std::string& path) {
    return phi4mm::read_media_part(image_part(path), phi4mm::MediaKind::kImage, "m", src);
  };
  CHECK(read("ok.png") == png);
  CHECK(read((root / "sub" / ".." / "ok.png").string()) == png);
  std::vector<std::string> refused = {(base / "secret.png").string(),   // exists, outside
                                      (base / "missing.png").string(),  // missing, outside
                                      "missing.png",                    // missing, inside
                                      "escape.png",                     // symlink out of the root
                                      "../secret.png",
                                      "sub",                            // a directory
                                      "file://" + (base / "secret.png").string(),
                                      "file://" + (root / "nothing.png").string()};
  if (::geteuid() != 0) refused.push_back("locked.png");  // root reads it anyway
  for (const std::string& p : refused) {
    CAPTURE(p);
    const std::string shown = p.rfind("file://", 0) == 0 ? p.substr(7) : p;
    CHECK(error_text([&] { read(p); }) ==
          fmt::format("m.image_url.url: media file '{}' is not a readable file under the media root", shown));
  }
  fs::permissions(root / "locked.png", fs::perms::owner_all);
  fs::remove_all(base);
}

// ---- class 7: decode budget -----------------------------------------------------

TEST_CASE("processor/process_chat refuses a prompt over max_prompt_tokens from the media headers, before decoding") {
  Towers& t = Towers::shared();
  phi4mm::ProcessorOptions po;
  po.max_prompt_tokens = 2000;
  // Only a header: decoding would fail ("PNG data is truncated"), so the
  // refusal proves nothing was decoded.
  const json messages = {{{"role", "user"},
                          {"content", {image_part(data_url(black_png(13000, false), "image/png"))}}}};
  bool refused = false;
  try {
    phi4mm::process_chat(*t.tokenizer, messages, json(), po);
  } catch (const phi4mm::PromptTooLong& e) {
    refused = true;
    CHECK(e.tokens() > phi4mm::num_image_tokens(13000, 13000));
    CHECK(e.limit() == 2000);
  }
  CHECK(refused);
  po.max_prompt_tokens = 0;
  CHECK(error_text([&] { phi4mm::process_chat(*t.tokenizer, messages, json(), po); })
            .find("messages[0].content: PNG data is truncated or corrupt") != std::string::npos);
}

TEST_CASE("serve/http a declared 13000x13000 PNG over the context is refused before decoding: peak RSS grows < 100 MB") {
  Towers& t = Towers::shared();
  ServerOptions so;
  so.max_context_len = 2048;
  so.max_body_bytes = size_t(8) << 20;
  Served small(*t.engine, so);
  const std::vector<uint8_t> png = black_png(13000);
  CHECK(png.size() < size_t(2) << 20);
  CHECK(phi4mm::probe_image(png).width == 13000);
  const json body = chat_with(image_part(data_url(png, "image/png")), 16);
  const int64_t before = peak_rss_kib();
  REQUIRE(before > 0);
  const Answer a = post_chat(small.port, body);
  const int64_t grown_kib = peak_rss_kib() - before;
  MESSAGE("peak RSS growth: " << grown_kib / 1024 << " MiB");
  CHECK(a.status == 400);
  CHECK(a.body["error"]["code"] == "context_length_exceeded");
  CHECK(a.body["error"]["param"] == "messages");
  CHECK(a.message().find("This model's maximum context length is 2048 tokens. However, you requested") !=
        std::string::npos);
  CHECK(grown_kib < 100 * 1024);
}

TEST_CASE("processor/decode budget: reserved from the header, held while the media lives, 400 when too big, busy when full") {
  auto budget = std::make_shared<phi4mm::DecodeBudget>(100, std::chrono::milliseconds(50));
  {
    auto a = budget->reserve(60, "a");
    CHECK(budget->in_use() == 60);
    CHECK_THROWS_AS(budget->reserve(50, "b"), phi4mm::MediaBusy);
    a->resize(20, "a");
    auto b = budget->reserve(50, "b");
    CHECK(budget->in_use() == 70);
  }
  CHECK(budget->in_use() == 0);
  const std::string too_big = error_text([&] { budget->reserve(101, "c"); });
  CHECK(too_big.find("c: decoding this item needs about") != std::string::npos);
  CHECK(too_big.find("--max-media-decode-mb") != std::string::npos);

  // An image holds 10 bytes per pixel while it decodes, 3 (its RGB) after.
  const std::vector<uint8_t> png = encoded(40, 30, false);
  auto roomy = std::make_shared<phi4mm::DecodeBudget>(40 * 30 * 10, std::chrono::milliseconds(50));
  {
    phi4mm::Media m = phi4mm::decode_media(phi4mm::MediaKind::kImage, png, "i", {}, roomy);
    CHECK(roomy->in_use() == 40 * 30 * 3);
    // The rest is too little for the next image's peak: busy, then free again.
    CHECK_THROWS_AS(phi4mm::decode_media(phi4mm::MediaKind::kImage, png, "j", {}, roomy), phi4mm::MediaBusy);
  }
  CHECK(roomy->in_use() == 0);
  auto tight = std::make_shared<phi4mm::DecodeBudget>(40 * 30 * 10 - 1, std::chrono::milliseconds(50));
  CHECK_THROWS_WITH(phi4mm::decode_media(phi4mm::MediaKind::kImage, png, "k", {}, tight),
                    doctest::Contains("media decode budget"));

  // Through the server: an image larger than --max-media-decode-mb is a 400.
  Towers& t = Towers::shared();
  ServerOptions so;
  so.max_media_decode_bytes = 40 * 30 * 10 - 1;
  Served s(*t.engine, so);
  const Answer a = post_chat(s.port, chat_with(image_part(data_url(png, "image/png"))));
  CHECK(a.status == 400);
  CHECK(a.message().find("messages[0].content: decoding this item needs about") != std::string::npos);
  const Answer ok = post_chat(s.port, chat_with(image_part(data_url(encoded(8, 8, false), "image/png"))));
  CHECK(ok.status == 200);
}

// ---- class 8: audio stays finite ----------------------------------------------

TEST_CASE("audio/huge finite float samples are refused with the part named; features are never non-finite") {
  std::vector<float> loud(16000, 0.25f);
  loud[8000] = 1e30f;
  const std::string why = error_text([&] { phi4mm::decode_audio(float_wav(loud)); });
  CHECK(why.find("sample value 1e+30 is beyond the accepted magnitude 10000") != std::string::npos);
  std::vector<float> edge(16000, 0.25f);
  edge[100] = -1e4f;  // the bound itself is accepted and gives finite features
  const phi4mm::DecodedAudio ok = phi4mm::decode_audio(float_wav(edge));
  const Tensor f = phi4mm::audio_features(ok.samples, ok.sample_rate);
  const float* v = f.data<float>();
  for (int64_t i = 0; i < f.numel(); ++i) REQUIRE(std::isfinite(v[i]));
  // The extractor itself refuses to produce non-finite values.
  std::vector<double> direct(16000, 0.1);
  direct[4000] = 1e30;
  CHECK_THROWS_WITH_AS(phi4mm::audio_features(direct, 16000), doctest::Contains("non-finite log-mel"),
                       std::invalid_argument);

  Towers& t = Towers::shared();
  Served s(*t.engine, ServerOptions{});
  const std::vector<uint8_t> wav = float_wav(loud);
  const json part = {{"type", "input_audio"},
                     {"input_audio", {{"data", phi4mm::encode_base64(wav.data(), wav.size())}, {"format", "wav"}}}};
  const Answer a = post_chat(s.port, chat_with(part));
  CHECK(a.status == 400);
  CHECK(a.message().rfind("audio: messages[0].content: sample value 1e+30", 0) == 0);
}

// ---- class 10: decoder errors name the format and the reason ---------------------

TEST_CASE("processor/decoder errors name the format from the magic bytes and the real reason") {
  const std::vector<uint8_t> jpeg = encoded(64, 48, true);
  auto image_error = [](const std::vector<uint8_t>& b) {
    return error_text([&] { phi4mm::decode_media(phi4mm::MediaKind::kImage, b, "messages[0].content"); });
  };
  auto cut = [](std::vector<uint8_t> b, size_t n) {
    b.resize(n);
    return b;
  };
  for (size_t n : {size_t(40), jpeg.size() / 2}) {
    CAPTURE(n);
    const std::string e = image_error(cut(jpeg, n));
    CHECK(e.rfind("messages[0].content: JPEG ", 0) == 0);
    CHECK(e.find("truncated or corrupt") != std::string::npos);
    CHECK(e.find("png") == std::string::npos);
  }
  CHECK(image_error(cut(encoded(64, 48, false), 200)).rfind("messages[0].content: PNG data is truncated or corrupt", 0) ==
        0);
  const std::string hello = "hello world";
  CHECK(image_error({hello.begin(), hello.end()}) ==
        "messages[0].content: not a supported image format (first bytes 68 65 6c 6c; expected PNG, JPEG, BMP, GIF "
        "or binary PNM)");
  const std::string webp = std::string("RIFF\x10\0\0\0WEBPVP8 ", 16);
  CHECK(image_error({webp.begin(), webp.end()}) ==
        "messages[0].content: WebP images are not supported (expected PNG, JPEG, BMP, GIF or binary PNM)");
  const std::string gif = "GIF89a\x01";
  CHECK(image_error({gif.begin(), gif.end()}).rfind("messages[0].content: GIF header is truncated (7 bytes)", 0) == 0);

  // Audio: a garbage MP3 and a truncated FLAC name their format, never "File does not exist".
  auto audio_error = [](const std::vector<uint8_t>& b) {
    return error_text([&] { phi4mm::decode_media(phi4mm::MediaKind::kAudio, b, "a"); });
  };
  std::vector<uint8_t> mp3 = {'I', 'D', '3', 3, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < 4000; ++i) mp3.push_back(uint8_t((i * 97 + 13) % 251));
  const std::string e_mp3 = audio_error(mp3);
  CHECK(e_mp3.find("audio: a: MP3") != std::string::npos);
  CHECK(e_mp3.find("does not exist") == std::string::npos);
  std::vector<uint8_t> flac = {'f', 'L', 'a', 'C', 0, 0};
  CHECK(audio_error(flac).find("audio: a: FLAC data is truncated or corrupt") != std::string::npos);
  std::vector<uint8_t> junk(3000, 'x');
  CHECK(audio_error(junk).find("not a supported audio format (first bytes 78 78 78 78") != std::string::npos);

  // Through the server, the message names the part.
  Towers& t = Towers::shared();
  Served s(*t.engine, ServerOptions{});
  const Answer a = post_chat(s.port, chat_with(image_part(data_url(cut(jpeg, jpeg.size() / 2), "image/jpeg"))));
  CHECK(a.status == 400);
  CHECK(a.message().rfind("messages[0].content: JPEG data is truncated or corrupt", 0) == 0);
}
