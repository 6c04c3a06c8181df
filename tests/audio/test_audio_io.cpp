// Audio decoding (issue 6): WAV / FLAC / OGG / MP3 through libsndfile, PCM
// scaling and channel mix-down as soundfile + the released processor, features of
// espeak-ng speech clips against a transcription of the released extractor
// (tests/reference/audio/make_speech_clips.py), and clear errors for bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "models/phi4mm/audio/audio_features.h"
#include "models/phi4mm/audio/audio_io.h"
#include "nn/io/safetensors.h"
#include "tensor/ops.h"

using namespace areno;
using namespace areno::phi4mm;

namespace {

const std::string kDir = "tests/data/audio/";

const SafetensorsFile& speech_golden() {
  static SafetensorsFile f(kDir + "speech_golden.safetensors");
  return f;
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

double rel_err(const Tensor& a, const Tensor& b) {
  Tensor bf = b.to(DType::f64);
  return max_abs_diff(a.to(DType::f64), bf) / std::max(max(abs(bf)).item(), 1e-30);
}

// A RIFF/WAVE file: format tag 1 (PCM), 3 (IEEE float) or anything else;
// `payload` holds the data chunk bytes as given.
std::vector<uint8_t> wav_bytes(int format_tag, int channels, int rate, int bits, const std::vector<uint8_t>& payload,
                               int64_t declared_data = -1) {
  std::vector<uint8_t> b;
  auto put = [&](uint64_t v, int n) {
    for (int i = 0; i < n; ++i) b.push_back(uint8_t(v >> (8 * i)));
  };
  auto tag = [&](const char* s) { b.insert(b.end(), s, s + 4); };
  const uint32_t data_size = declared_data >= 0 ? uint32_t(declared_data) : uint32_t(payload.size());
  tag("RIFF");
  put(36 + data_size, 4);
  tag("WAVE");
  tag("fmt ");
  put(16, 4);
  put(uint16_t(format_tag), 2);
  put(uint16_t(channels), 2);
  put(uint32_t(rate), 4);
  put(uint32_t(rate) * uint32_t(channels) * uint32_t(bits / 8), 4);
  put(uint16_t(channels * bits / 8), 2);
  put(uint16_t(bits), 2);
  tag("data");
  put(data_size, 4);
  b.insert(b.end(), payload.begin(), payload.end());
  return b;
}

// Interleaved int16 PCM of `frames` x `channels` from a formula.
std::vector<uint8_t> pcm16(int64_t frames, int channels, int rate, double amp = 0.3) {
  std::vector<uint8_t> p;
  for (int64_t n = 0; n < frames; ++n)
    for (int c = 0; c < channels; ++c) {
      const int16_t s = int16_t(std::lrint(amp * 32767.0 * std::sin(2.0 * M_PI * (300.0 + 100.0 * c) * double(n) / rate)));
      p.push_back(uint8_t(uint16_t(s) & 0xff));
      p.push_back(uint8_t(uint16_t(s) >> 8));
    }
  return p;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

#define CHECK_ERROR(expr, text)                                                   \
  do {                                                                            \
    const std::string msg_ = error_of([&] { (void)(expr); });                     \
    CHECK_MESSAGE(msg_.find(text) != std::string::npos, "message: '" << msg_ << "'"); \
  } while (0)

}  // namespace

TEST_CASE("phi4mm/audio decodes espeak-ng speech (WAV, FLAC stereo, OGG, MP3) to the reference pipeline's features") {
  struct Clip {
    std::string file, format;
    double tol;
  };
  for (const Clip& c : {Clip{"speech_16k_mono.wav", "WAV PCM_16", 1e-4}, Clip{"speech_22k_stereo.flac", "FLAC PCM_16", 1e-4},
                        Clip{"speech_16k_mono.ogg", "OGG VORBIS", 1e-4}, Clip{"speech_44k_mono.mp3", "MPEG LAYER_III", 1e-4}}) {
    DecodedAudio a = decode_audio_file(kDir + c.file);
    auto meta = speech_golden().load_copy(c.file + ".samples").to_vector<int64_t>();
    CHECK(a.format == c.format);
    CHECK(int64_t(a.samples.size()) == meta[0]);
    CHECK(a.sample_rate == meta[1]);
    CHECK(a.channels == meta[2]);
    Tensor f = audio_features(a.samples, a.sample_rate);
    Tensor g = speech_golden().load_copy(c.file + ".features");
    REQUIRE(f.shape() == g.shape());
    const double err = rel_err(f, g);
    MESSAGE(c.file << ": " << f.size(0) << " frames, feature error " << err);
    CHECK(err < c.tol);
    CHECK(audio_token_count(int64_t(a.samples.size()), a.sample_rate) == (f.size(0) + 7) / 8);
  }
}

TEST_CASE("phi4mm/audio WAV PCM 8/16/24/32 and float 32/64 scale as soundfile; channels average to mono") {
  // One frame per value, 3 channels: (a, b, c) -> (a + b + c) / 3.
  const int ch = 3, rate = 16000;
  const int64_t frames = 800;
  auto expect_mono = [&](const std::vector<double>& inter) {
    std::vector<double> m;
    for (int64_t n = 0; n < frames; ++n) m.push_back((inter[size_t(n * ch)] + inter[size_t(n * ch + 1)] + inter[size_t(n * ch + 2)]) / 3.0);
    return m;
  };
  auto check = [&](int tag, int bits, auto encode, const char* format) {
    std::vector<uint8_t> payload;
    std::vector<double> values;
    for (int64_t i = 0; i < frames * ch; ++i) {
      const double v = 0.9 * std::sin(0.001 * double(i * i % 7919)) ;
      values.push_back(encode(v, payload));
    }
    DecodedAudio a = decode_audio(wav_bytes(tag, ch, rate, bits, payload));
    CHECK(a.format == std::string(format));
    CHECK(a.channels == 3);
    REQUIRE(int64_t(a.samples.size()) == frames);
    auto want = expect_mono(values);
    double worst = 0;
    for (int64_t n = 0; n < frames; ++n) worst = std::max(worst, std::abs(a.samples[size_t(n)] - want[size_t(n)]));
    CHECK_MESSAGE(worst < 1e-12, format << " worst " << worst);
  };
  auto le = [](std::vector<uint8_t>& p, uint64_t v, int n) {
    for (int i = 0; i < n; ++i) p.push_back(uint8_t(v >> (8 * i)));
  };
  check(1, 8, [&](double v, std::vector<uint8_t>& p) {
    const int q = int(std::lrint(v * 127.0));
    p.push_back(uint8_t(q + 128));
    return double(q) / 128.0;
  }, "WAV PCM_U8");
  check(1, 16, [&](double v, std::vector<uint8_t>& p) {
    const int32_t q = int32_t(std::lrint(v * 32767.0));
    le(p, uint32_t(q), 2);
    return double(q) / 32768.0;
  }, "WAV PCM_16");
  check(1, 24, [&](double v, std::vector<uint8_t>& p) {
    const int32_t q = int32_t(std::lrint(v * 8388607.0));
    le(p, uint32_t(q), 3);
    return double(q) / 8388608.0;
  }, "WAV PCM_24");
  check(1, 32, [&](double v, std::vector<uint8_t>& p) {
    const int32_t q = int32_t(std::lrint(v * 2147483647.0));
    le(p, uint32_t(q), 4);
    return double(q) / 2147483648.0;
  }, "WAV PCM_32");
  check(3, 32, [&](double v, std::vector<uint8_t>& p) {
    const float f = float(v);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    le(p, u, 4);
    return double(f);
  }, "WAV FLOAT");
  check(3, 64, [&](double v, std::vector<uint8_t>& p) {
    uint64_t u;
    std::memcpy(&u, &v, 8);
    le(p, u, 8);
    return v;
  }, "WAV DOUBLE");
}

TEST_CASE("phi4mm/audio token counts of decoded 1 s clips at 8, 11.025, 16, 22.05, 44.1 and 48 kHz") {
  struct Case {
    int rate;
    int64_t tokens;
  };
  // Spec 3.11: 8 kHz fill-zero 98 frames; 11.025 kHz analysed as 8 kHz; 22.05 kHz
  // analysed as 16 kHz (reference quirk); 44.1 kHz decimated by 2; 48 kHz by 3.
  for (Case c : {Case{8000, 13}, Case{11025, 17}, Case{16000, 13}, Case{22050, 17}, Case{44100, 17}, Case{48000, 13}}) {
    DecodedAudio a = decode_audio(wav_bytes(1, 2, c.rate, 16, pcm16(c.rate, 2, c.rate)));
    CHECK(a.sample_rate == c.rate);
    CHECK(int64_t(a.samples.size()) == c.rate);
    CHECK_MESSAGE(audio_token_count(int64_t(a.samples.size()), a.sample_rate) == c.tokens, c.rate << " Hz");
    Tensor f = audio_features(a.samples, a.sample_rate);
    CHECK((f.size(0) + 7) / 8 == c.tokens);
  }
  // 10 s and 30 s at 16 kHz (spec 4).
  CHECK(audio_token_count(int64_t(decode_audio(wav_bytes(1, 1, 16000, 16, pcm16(160000, 1, 16000))).samples.size()), 16000) == 125);
  CHECK(audio_token_count(int64_t(decode_audio(wav_bytes(1, 1, 16000, 16, pcm16(480000, 1, 16000))).samples.size()), 16000) == 375);
}

TEST_CASE("phi4mm/audio rejects bad input with clear messages") {
  const auto good = wav_bytes(1, 1, 16000, 16, pcm16(16000, 1, 16000));
  // Empty input and bytes that are no audio file at all.
  CHECK_ERROR(decode_audio({}), "is empty (0 bytes)");
  std::vector<uint8_t> text(2000, 'x');
  CHECK_ERROR(decode_audio(text), "not a supported audio format (first bytes 78 78 78 78; expected WAV, FLAC, MP3 or OGG)");
  // Corrupt header: a RIFF/WAVE whose fmt chunk is cut to 4 bytes.
  {
    auto bad = good;
    bad[16] = 4;  // fmt chunk size
    CHECK_ERROR(decode_audio(bad), "audio:");
    auto bad2 = good;
    std::memcpy(bad2.data() + 8, "WAVX", 4);
    CHECK_ERROR(decode_audio(bad2), "not a supported audio format (first bytes 52 49 46 46");
  }
  // Truncated data: the header declares more than the file holds.
  {
    auto cut = good;
    cut.resize(cut.size() / 2);
    CHECK_ERROR(decode_audio(cut), "truncated data");
    auto flac = read_file(kDir + "speech_22k_stereo.flac");
    flac.resize(flac.size() / 2);
    const std::string msg = error_of([&] { decode_audio(flac); });
    CHECK_MESSAGE((msg.find("truncated") != std::string::npos || msg.find("corrupt") != std::string::npos), msg);
  }
  // Zero-length and too-short clips (fewer than one 400-sample window at 16 kHz).
  CHECK_ERROR(decode_audio(wav_bytes(1, 1, 16000, 16, {})), "no audio samples");
  CHECK_ERROR(decode_audio(wav_bytes(1, 1, 16000, 16, pcm16(399, 1, 16000))), "clip too short: 399 samples");
  CHECK(decode_audio(wav_bytes(1, 1, 16000, 16, pcm16(400, 1, 16000))).samples.size() == 400);
  CHECK_ERROR(decode_audio(wav_bytes(1, 1, 8000, 16, pcm16(199, 1, 8000))), "clip too short");
  CHECK_ERROR(decode_audio(wav_bytes(1, 1, 48000, 16, pcm16(1197, 1, 48000))), "clip too short");
  // Unsupported codec: a WAV format tag nobody implements.
  CHECK_ERROR(decode_audio(wav_bytes(0x1234, 1, 16000, 16, pcm16(1000, 1, 16000))),
              "unsupported codec in a WAV file (format tag 0x1234");
  CHECK_ERROR(decode_audio(wav_bytes(0x0055, 1, 16000, 16, pcm16(1000, 1, 16000))), "unsupported codec");
  // An OGG cut in half: no complete audio page left.
  {
    auto ogg = read_file(kDir + "speech_16k_mono.ogg");
    ogg.resize(ogg.size() / 2);
    CHECK_ERROR(decode_audio(ogg), "cut off");
  }
  // Absurd sample rates and channel counts.
  CHECK_ERROR(decode_audio(wav_bytes(1, 1, 4000, 16, pcm16(4000, 1, 4000))), "unsupported sample rate 4000 Hz");
  CHECK_ERROR(decode_audio(wav_bytes(1, 1, 1000000, 16, pcm16(4000, 1, 16000))), "unsupported sample rate 1000000 Hz");
  CHECK_ERROR(decode_audio(wav_bytes(1, 1, 1, 16, pcm16(4000, 1, 16000))), "audio:");
  CHECK_ERROR(decode_audio(wav_bytes(1, 40, 16000, 16, pcm16(1000, 40, 16000))), "40 channels (expected 1 to 32)");
  CHECK_ERROR(decode_audio(wav_bytes(1, 0, 16000, 16, pcm16(1000, 1, 16000))), "audio:");
  // Configurable length limit.
  AudioDecodeOptions opts;
  opts.max_seconds = 0.5;
  CHECK_ERROR(decode_audio(good, opts), "more than the 0.5 s limit");
  CHECK_ERROR(decode_audio_file(kDir + "speech_16k_mono.ogg", opts), "limit");
  CHECK_ERROR(decode_audio_file(kDir + "no_such_file.wav"), "cannot open");
  // Non-finite float samples.
  {
    std::vector<uint8_t> p;
    for (int i = 0; i < 1000; ++i) {
      const float f = i == 500 ? NAN : 0.1f;
      uint32_t u;
      std::memcpy(&u, &f, 4);
      for (int k = 0; k < 4; ++k) p.push_back(uint8_t(u >> (8 * k)));
    }
    CHECK_ERROR(decode_audio(wav_bytes(3, 1, 16000, 32, p)), "non-finite");
  }
}

TEST_CASE("phi4mm/audio decoding never crashes on damaged files") {
  // Byte flips and cuts of every committed format: each decode either returns
  // audio or throws std::runtime_error.
  uint32_t st = 12345;
  auto next = [&] { return st = st * 1664525u + 1013904223u; };
  int decoded = 0, rejected = 0;
  for (std::string file : {"speech_16k_mono.wav", "speech_22k_stereo.flac", "speech_16k_mono.ogg", "speech_44k_mono.mp3"}) {
    const auto base = read_file(kDir + file);
    for (int trial = 0; trial < 25; ++trial) {
      auto b = base;
      const int flips = 1 + int(next() % 8);
      for (int i = 0; i < flips; ++i) b[next() % std::min<size_t>(b.size(), trial % 2 ? b.size() : 256)] ^= uint8_t(1 + next() % 255);
      if (trial % 3 == 0) b.resize(next() % b.size());
      try {
        decode_audio(b);
        ++decoded;
      } catch (const std::runtime_error&) {
        ++rejected;
      }
    }
  }
  MESSAGE("damaged files: " << decoded << " decoded, " << rejected << " rejected");
  CHECK(decoded + rejected == 100);
}
