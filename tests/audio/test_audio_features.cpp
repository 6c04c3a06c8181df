// Audio feature extractor (issue 6) against the golden outputs of the released
// Phi4MMAudioFeatureExtractor (tests/data/audio/audio-golden.json, a copy of
// shared/data/audio-golden.json) and the worked examples of shared/spec/audio.md.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/phi4mm/audio/audio_features.h"
#include "tests/sha256.h"

using namespace areno;
using namespace areno::phi4mm;
using json = nlohmann::json;

// The golden signal formulas are defined without fused multiply-add.
#pragma GCC optimize("fp-contract=off")

namespace {

const json& golden() {
  static const json g = [] {
    const char* path = "tests/data/audio/audio-golden.json";
    std::ifstream f(path);
    if (!f) throw std::runtime_error(std::string("cannot open ") + path + " (run from the source root)");
    return json::parse(f);
  }();
  return g;
}

int16_t quantise(double v) { return int16_t(std::clamp(std::rint(v), -32768.0, 32767.0)); }

// The golden file's int16 test signals ("clip.formulas"), evaluated in double
// exactly as written there.
std::vector<int16_t> make_signal(const json& s, int64_t n_samples, int64_t sr_i) {
  const std::string kind = s.at("kind");
  const double sr = double(sr_i), pi = std::numbers::pi;
  std::vector<int16_t> x(size_t(n_samples), 0);
  if (kind == "sine") {
    const double f = s.at("f"), A = s.at("A"), C = s.value("C", 0.0);
    for (int64_t n = 0; n < n_samples; ++n) x[size_t(n)] = quantise(C + A * std::sin((((2.0 * pi) * f) * double(n)) / sr));
  } else if (kind == "two_tone") {
    const double f1 = s.at("f1"), A1 = s.at("A1"), f2 = s.at("f2"), A2 = s.at("A2");
    for (int64_t n = 0; n < n_samples; ++n)
      x[size_t(n)] = quantise(A1 * std::sin((((2.0 * pi) * f1) * double(n)) / sr) +
                              A2 * std::sin((((2.0 * pi) * f2) * double(n)) / sr));
  } else if (kind == "chirp") {
    const double f0 = s.at("f0"), f1 = s.at("f1"), D = s.at("D"), A = s.at("A");
    const double k = (f1 - f0) / (2.0 * D);
    for (int64_t n = 0; n < n_samples; ++n) {
      const double t = double(n) / sr;
      x[size_t(n)] = quantise(A * std::sin((2.0 * pi) * (f0 * t + (k * t) * t)));
    }
  } else if (kind == "noise_lcg") {
    uint32_t st = s.at("seed").get<uint32_t>();
    const int shift = s.at("shift");
    for (int64_t n = 0; n < n_samples; ++n) {
      st = 1664525u * st + 1013904223u;
      const int32_t u = int32_t(st >> 16);
      x[size_t(n)] = int16_t((u - 32768) >> shift);
    }
  } else if (kind == "square") {
    const int64_t P = s.at("P");
    const int16_t A = s.at("A");
    for (int64_t n = 0; n < n_samples; ++n) x[size_t(n)] = (n % P) < P / 2 ? A : int16_t(-A);
  } else if (kind == "impulse") {
    x[size_t(s.at("n0").get<int64_t>())] = s.at("A").get<int16_t>();
  } else if (kind != "silence") {
    throw std::runtime_error("unknown golden signal kind " + kind);
  }
  return x;
}

struct Clip {
  std::vector<int16_t> pcm;  // interleaved
  int64_t channels = 1;
  std::vector<double> mono;  // what the extractor receives
};

Clip make_clip(const json& c) {
  const int64_t n = c.at("num_samples"), sr = c.at("sample_rate");
  Clip clip;
  if (c.contains("channels")) {
    const auto& chans = c.at("channels");
    clip.channels = int64_t(chans.size());
    std::vector<std::vector<int16_t>> per;
    for (const auto& s : chans) per.push_back(make_signal(s, n, sr));
    clip.pcm.resize(size_t(n * clip.channels));
    std::vector<double> inter(clip.pcm.size());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t ch = 0; ch < clip.channels; ++ch) {
        clip.pcm[size_t(i * clip.channels + ch)] = per[size_t(ch)][size_t(i)];
        inter[size_t(i * clip.channels + ch)] = double(per[size_t(ch)][size_t(i)]) / 32768.0;
      }
    clip.mono = mix_to_mono(inter, clip.channels);
  } else {
    clip.pcm = make_signal(c.at("signal"), n, sr);
    clip.mono.resize(clip.pcm.size());
    for (size_t i = 0; i < clip.pcm.size(); ++i) clip.mono[i] = double(clip.pcm[i]) / 32768.0;
  }
  return clip;
}

void check_golden_case(const json& c) {
  const std::string name = c.at("name");
  INFO("golden case " << name);
  const int64_t sr = c.at("sample_rate");
  const Clip clip = make_clip(c);

  // The generator must reproduce the reference's int16 samples first.
  int64_t pcm_sum = 0;
  for (int16_t v : clip.pcm) pcm_sum += v;
  CHECK(pcm_sum == c.at("pcm_sum").get<int64_t>());
  CHECK(areno::testing::sha256_hex(clip.pcm.data(), clip.pcm.size() * 2) == c.at("pcm_sha256").get<std::string>());

  const AudioPlan p = plan_audio(int64_t(clip.mono.size()), sr);
  CHECK((p.analysis == AudioAnalysis::k16k ? "16k" : "8k_fillzero") == c.at("analysis").get<std::string>());
  CHECK(p.resample_down == (c.at("resample_down").is_null() ? 1 : c.at("resample_down").get<int64_t>()));
  CHECK(p.num_samples_processed == c.at("num_samples_processed").get<int64_t>());
  CHECK(p.frames == c.at("frames").get<int64_t>());
  CHECK(p.tokens == c.at("audio_tokens").get<int64_t>());
  CHECK(audio_token_count(int64_t(clip.mono.size()), sr) == c.at("audio_tokens").get<int64_t>());

  if (c.contains("processed_waveform")) {
    const auto& pw = c.at("processed_waveform");
    const std::vector<double> y = resample_poly(clip.mono, 1, p.resample_down);
    REQUIRE(int64_t(y.size()) == p.num_samples_processed);
    double s = 0.0;
    for (double v : y) s += v;
    CHECK(std::abs(s - pw.at("sum").get<double>()) <= 1e-11);
    for (const auto& [idx, val] : pw.at("values").items())
      CHECK(std::abs(y[size_t(std::stoll(idx))] - val.get<double>()) <= 1e-14);
  }

  const Tensor F = audio_features(std::span<const double>(clip.mono), sr);
  REQUIRE(F.dim() == 2);
  REQUIRE(F.size(0) == c.at("shape")[0].get<int64_t>());
  REQUIRE(F.size(1) == c.at("shape")[1].get<int64_t>());
  const std::vector<float> f = F.to_vector<float>();
  const int64_t T = F.size(0);

  // Tolerances of the golden file: 1e-4 absolute per value, sum to 1e-4 * T * 80.
  double sum = 0.0;
  float mn = f[0], mx = f[0];
  for (float v : f) sum += v, mn = std::min(mn, v), mx = std::max(mx, v);
  CHECK(std::abs(sum - c.at("sum").get<double>()) <= 1e-4 * double(T) * 80.0);
  CHECK(std::abs(mn - c.at("min").get<double>()) <= 1e-4);
  CHECK(std::abs(mx - c.at("max").get<double>()) <= 1e-4);
  for (const auto& [t, rs] : c.at("row_sums").items()) {
    const int64_t row = std::stoll(t);
    double r = 0.0;
    for (int64_t m = 0; m < 80; ++m) r += f[size_t(row * 80 + m)];
    CHECK(std::abs(r - rs.get<double>()) <= 1e-4 * 80.0);
  }
  for (const auto& sp : c.at("spot")) {
    const int64_t t = sp.at("frame"), m = sp.at("bin");
    INFO("F[" << t << "][" << m << "]");
    CHECK(std::abs(f[size_t(t * 80 + m)] - sp.at("value").get<double>()) <= 1e-4);
  }
  if (p.analysis == AudioAnalysis::k8kFillZero)  // mel channels 62..79 see no energy (§3.6)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t m = 62; m < 80; ++m) CHECK_MESSAGE(f[size_t(t * 80 + m)] == 0.0f, "frame " << t << " bin " << m);

  // Bit-exact against the reference's 'libm' variant (glibc hypotf/logf, the
  // same algorithm step by step).
  const std::string hash = areno::testing::sha256_hex(f.data(), f.size() * sizeof(float));
  CHECK(hash == c.at("features_f32_sha256").at("libm").get<std::string>());
}

}  // namespace

TEST_CASE("audio: golden clips of the released extractor") {
  const auto& cases = golden().at("cases");
  REQUIRE(cases.size() >= 20);
  for (const auto& c : cases) {
    SUBCASE(c.at("name").get<std::string>().c_str()) { check_golden_case(c); }
  }
}

TEST_CASE("audio: mel filterbank check values (spec 3.7)") {
  const auto& W = audio_mel_filterbank();
  REQUIRE(W.size() == size_t(80 * 257));
  auto w = [&](int m, int k) { return double(W[size_t(m * 257 + k)]); };
  CHECK(w(0, 1) == doctest::Approx(0.57564998).epsilon(1e-7));
  CHECK(w(1, 1) == doctest::Approx(0.42435002).epsilon(1e-7));
  CHECK(w(1, 2) == doctest::Approx(0.21091399).epsilon(1e-7));
  CHECK(w(2, 2) == doctest::Approx(0.78908598).epsilon(1e-7));
  CHECK(w(40, 54) == doctest::Approx(0.012900893).epsilon(1e-6));
  CHECK(w(40, 56) == doctest::Approx(0.85564625).epsilon(1e-7));
  CHECK(w(40, 58) == doctest::Approx(0.32283849).epsilon(1e-7));
  CHECK(w(79, 231) == doctest::Approx(0.11476812).epsilon(1e-7));
  CHECK(w(79, 238) == doctest::Approx(0.99655479).epsilon(1e-7));
  CHECK(w(79, 245) == doctest::Approx(0.13145284).epsilon(1e-7));
  double s = 0.0;
  for (float v : W) s += v;
  CHECK(s == doctest::Approx(241.49891740555).epsilon(1e-9));
  // Only bins 1..245 may carry weight: DC and >= 7687.5 Hz never contribute.
  for (int m = 0; m < 80; ++m) {
    CHECK(w(m, 0) == 0.0);
    for (int k = 246; k < 257; ++k) CHECK(w(m, k) == 0.0);
  }
  // Non-zero ranges of a few filters (spec table, inclusive).
  auto range = [&](int m) {
    int lo = -1, hi = -1;
    for (int k = 0; k < 257; ++k)
      if (w(m, k) != 0.0) hi = k, lo = lo < 0 ? k : lo;
    return std::pair{lo, hi};
  };
  CHECK(range(0) == std::pair{1, 1});
  CHECK(range(2) == std::pair{2, 2});
  CHECK(range(12) == std::pair{10, 12});
  CHECK(range(61) == std::pair{124, 132});
  CHECK(range(62) == std::pair{128, 137});
  CHECK(range(79) == std::pair{231, 245});
}

TEST_CASE("audio: spec 3.12 float64 worked vectors") {
  SUBCASE("(a) 440 Hz at 16 kHz") {
    std::vector<double> x(16000);
    for (size_t n = 0; n < x.size(); ++n) x[n] = 0.5 * std::sin(2 * std::numbers::pi * 440.0 * double(n) / 16000.0);
    const auto f = audio_features(std::span<const double>(x), 16000).to_vector<float>();
    REQUIRE(f.size() == 98 * 80);
    const double row0[8] = {11.461669, 12.030835, 12.810290, 13.193143, 12.314034, 11.607764, 12.454888, 13.738289};
    for (int m = 0; m < 8; ++m) CHECK(std::abs(f[size_t(m)] - row0[m]) <= 1e-4);
    const double row50[6] = {15.833533, 21.671085, 24.451645, 25.201714, 24.098820, 20.347532};
    for (int m = 0; m < 6; ++m) CHECK(std::abs(f[size_t(50 * 80 + 12 + m)] - row50[m]) <= 1e-4);
    double s = 0.0, s50 = 0.0;
    for (float v : f) s += v;
    for (int m = 0; m < 80; ++m) s50 += f[size_t(50 * 80 + m)];
    CHECK(s50 == doctest::Approx(1093.0945).epsilon(1e-6));
    CHECK(s == doctest::Approx(103629.275).epsilon(1e-6));
  }
  SUBCASE("(b) 440 Hz at 8 kHz, fill-zero") {
    std::vector<double> x(8000);
    for (size_t n = 0; n < x.size(); ++n) x[n] = 0.5 * std::sin(2 * std::numbers::pi * 440.0 * double(n) / 8000.0);
    const auto f = audio_features(std::span<const double>(x), 8000).to_vector<float>();
    REQUIRE(f.size() == 98 * 80);
    const double row50[6] = {15.833813, 21.647427, 24.420713, 25.166481, 24.068777, 20.341280};
    for (int m = 0; m < 6; ++m) CHECK(std::abs(f[size_t(50 * 80 + 12 + m)] - row50[m]) <= 1e-4);
    CHECK(std::abs(f[50 * 80 + 60] - 12.957500) <= 1e-4);
    CHECK(std::abs(f[50 * 80 + 61] - 11.969409) <= 1e-4);
    double s = 0.0;
    for (float v : f) s += v;
    CHECK(s == doctest::Approx(84369.243).epsilon(1e-6));
  }
  SUBCASE("(c) chirp 1.5 s at 16 kHz") {
    std::vector<double> x(24000);
    const double D = 1.5;
    for (size_t n = 0; n < x.size(); ++n) {
      const double t = double(n) / 16000.0;
      x[n] = 0.5 * std::sin(2 * std::numbers::pi * (100.0 * t + (7000.0 - 100.0) / (2 * D) * t * t));
    }
    const auto f = audio_features(std::span<const double>(x), 16000).to_vector<float>();
    REQUIRE(f.size() == 148 * 80);
    CHECK(std::abs(f[40] - 10.989751) <= 1e-4);
    CHECK(std::abs(f[79] - 9.797456) <= 1e-4);
    CHECK(std::abs(f[74 * 80 + 40] - 15.869894) <= 1e-4);
    CHECK(std::abs(f[147 * 80 + 79] - 20.529938) <= 1e-4);
    double s = 0.0;
    for (float v : f) s += v;
    CHECK(s == doctest::Approx(185612.167).epsilon(1e-6));
  }
  SUBCASE("(d) digital silence is exactly 0") {
    std::vector<double> x(16000, 0.0);
    const auto f = audio_features(std::span<const double>(x), 16000).to_vector<float>();
    REQUIRE(f.size() == 98 * 80);
    CHECK(std::all_of(f.begin(), f.end(), [](float v) { return v == 0.0f; }));
  }
}

TEST_CASE("audio: frame and token counts (spec 3.11, 4)") {
  struct Row {
    int64_t n, sr, frames, tokens;
  };
  const Row rows[] = {
      {16000, 16000, 98, 13},     {160000, 16000, 998, 125},  {480000, 16000, 2998, 375},
      {640000, 16000, 3998, 500}, {656000, 16000, 4098, 513}, {960000, 16000, 5998, 750},
      {8000, 8000, 98, 13},       {48000, 48000, 98, 13},     {44100, 44100, 136, 17},
      {400, 16000, 1, 1},         {11025, 11025, 136, 17},    {22050, 22050, 136, 17},
      {480000 * 3, 48000, 2998, 375}, {441000, 44100, 1376, 172}, {200, 8000, 1, 1},
      {32000, 32000, 98, 13},     {24000, 24000, 148, 19},    {96000, 96000, 98, 13},
  };
  for (const Row& r : rows) {
    INFO(r.n << " samples at " << r.sr << " Hz");
    const AudioPlan p = plan_audio(r.n, r.sr);
    CHECK(p.frames == r.frames);
    CHECK(p.tokens == r.tokens);
    CHECK(audio_token_count(r.n, r.sr) == r.tokens);
  }
  // 8 kHz and 16 kHz give the same frame count for the same duration.
  for (int64_t n8 = 200; n8 < 3000; n8 += 37) CHECK(plan_audio(n8, 8000).frames == plan_audio(2 * n8, 16000).frames);
}

TEST_CASE("audio: invalid clips and sample rates are rejected with clear errors") {
  std::vector<double> x(16000, 0.1);
  auto msg = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  auto feats = [&](size_t n, int64_t sr) { return audio_features(std::span<const double>(x.data(), n), sr); };
  CHECK(msg([&] { feats(0, 16000); }).find("empty") != std::string::npos);
  CHECK(msg([&] { feats(399, 16000); }).find("too short") != std::string::npos);
  CHECK(msg([&] { feats(199, 8000); }).find("too short") != std::string::npos);
  CHECK(msg([&] { feats(1197, 48000); }).find("too short") != std::string::npos);  // ceil(1197 / 3) = 399
  CHECK(msg([&] { feats(1198, 48000); }).empty());                                   // ceil(1198 / 3) = 400
  CHECK(msg([&] { feats(400, 16000); }).empty());
  CHECK(msg([&] { feats(16000, 7999); }).find("unsupported sample rate 7999") != std::string::npos);
  CHECK(msg([&] { feats(16000, 0); }).find("unsupported sample rate") != std::string::npos);
  CHECK(msg([&] { feats(16000, -16000); }).find("unsupported sample rate") != std::string::npos);
  CHECK(msg([&] { feats(16000, 1000000000); }).find("unsupported sample rate") != std::string::npos);
  CHECK(msg([&] { mix_to_mono(std::span<const double>(x.data(), 5), 2); }).find("2-channel") != std::string::npos);
  CHECK(msg([&] { mix_to_mono(std::span<const double>(x.data(), 4), 0); }).find("channel count") != std::string::npos);
  CHECK(msg([&] { resample_poly(std::span<const double>(x.data(), 4), 0, 2); }).find("resample_poly") != std::string::npos);
}

TEST_CASE("audio: resample_poly matches direct evaluation and passes DC") {
  // A constant far from the edges comes out unchanged (unit DC gain).
  std::vector<double> x(3000, 0.25);
  for (int64_t q : {2, 3, 6}) {
    const auto y = resample_poly(x, 1, q);
    CHECK(int64_t(y.size()) == (3000 + q - 1) / q);
    CHECK(y[y.size() / 2] == doctest::Approx(0.25).epsilon(1e-12));
  }
  // Upsampling by 2 then decimating by 2 keeps a low-frequency tone.
  std::vector<double> s(4000);
  for (size_t n = 0; n < s.size(); ++n) s[n] = std::sin(2 * std::numbers::pi * 0.01 * double(n));
  const auto up = resample_poly(s, 2, 1);
  CHECK(up.size() == 8000);
  for (size_t n = 1000; n < 3000; n += 111) CHECK(up[2 * n] == doctest::Approx(s[n]).epsilon(1e-3));
  // gcd reduction: 4/2 is the same as 2/1.
  const auto up2 = resample_poly(s, 4, 2);
  REQUIRE(up2.size() == up.size());
  for (size_t i = 0; i < up.size(); i += 97) CHECK(up2[i] == up[i]);
}

TEST_CASE("audio: batch stacks, pads with zeros and masks only when B > 1") {
  std::vector<double> a(16000), b(8000);
  for (size_t n = 0; n < a.size(); ++n) a[n] = 0.3 * std::sin(0.05 * double(n));
  for (size_t n = 0; n < b.size(); ++n) b[n] = 0.2 * std::sin(0.11 * double(n));
  const AudioClip clips[] = {{a, 16000}, {b, 16000}};
  const AudioBatch batch = audio_features_batch(clips);
  REQUIRE(batch.features.shape() == Shape{2, 98, 80});
  CHECK(batch.frames == std::vector<int64_t>{98, 48});
  CHECK(batch.tokens == std::vector<int64_t>{13, 6});
  const auto fa = audio_features(std::span<const double>(a), 16000).to_vector<float>();
  const auto fb = audio_features(std::span<const double>(b), 16000).to_vector<float>();
  const auto fs = batch.features.to_vector<float>();
  for (size_t i = 0; i < fa.size(); ++i) REQUIRE(fs[i] == fa[i]);
  for (size_t i = 0; i < fb.size(); ++i) REQUIRE(fs[98 * 80 + i] == fb[i]);
  for (size_t i = 98 * 80 + fb.size(); i < fs.size(); ++i) REQUIRE(fs[i] == 0.0f);
  REQUIRE(batch.mask.defined());
  const auto m = batch.mask.to_vector<float>();
  for (int64_t t = 0; t < 98; ++t) {
    CHECK(m[size_t(t)] == 1.0f);
    CHECK(m[size_t(98 + t)] == (t < 48 ? 1.0f : 0.0f));
  }
  const AudioBatch single = audio_features_batch(std::span<const AudioClip>(clips, 1));
  CHECK_FALSE(single.mask.defined());
  CHECK(single.tokens == std::vector<int64_t>{13});
  // An invalid clip is named in the error.
  const AudioClip bad[] = {{a, 16000}, {std::span<const double>(b.data(), 10), 16000}};
  CHECK_THROWS_WITH_AS(audio_features_batch(bad), doctest::Contains("audio clip 1"), std::invalid_argument);
}

TEST_CASE("audio: channel mix-down and float input") {
  // [N, C] interleaved -> mean over C in double (spec 2.1).
  const std::vector<double> inter = {0.5, -0.25, 0.125, 0.0, 0.75, -0.5};
  CHECK(mix_to_mono(inter, 3) == std::vector<double>{0.375 / 3.0, 0.25 / 3.0});
  CHECK(mix_to_mono(inter, 2) == std::vector<double>{0.125, 0.0625, 0.125});
  CHECK(mix_to_mono(inter, 1) == inter);
  // float32 samples convert exactly to double: same features as the double path.
  std::vector<float> xf(4000);
  for (size_t n = 0; n < xf.size(); ++n) xf[n] = float(0.4 * std::sin(0.07 * double(n)));
  const std::vector<double> xd(xf.begin(), xf.end());
  const auto a = audio_features(std::span<const float>(xf), 16000).to_vector<float>();
  const auto b = audio_features(std::span<const double>(xd), 16000).to_vector<float>();
  REQUIRE(a.size() == size_t(23 * 80));
  CHECK(a == b);
}

TEST_CASE("audio: rational resampling to 16 kHz (optional 'correct' mode)") {
  // A 1 kHz tone keeps its pitch: after resampling, the 16 kHz features of a
  // 44.1 kHz clip peak in the same mel channel as a native 16 kHz clip.
  auto tone = [](int64_t sr, int64_t n) {
    std::vector<double> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[size_t(i)] = 0.5 * std::sin(2 * std::numbers::pi * 1000.0 * double(i) / double(sr));
    return x;
  };
  auto peak = [](const std::vector<float>& f, int64_t row) {
    return std::max_element(f.begin() + row * 80, f.begin() + row * 80 + 80) - (f.begin() + row * 80);
  };
  const auto ref = audio_features(std::span<const double>(tone(16000, 16000)), 16000).to_vector<float>();
  for (int64_t sr : {8000, 11025, 22050, 44100, 48000}) {
    INFO("sample rate " << sr);
    const auto x = tone(sr, sr);
    const auto y = resample_to_16k(x, sr);
    CHECK(int64_t(y.size()) == 16000);
    const auto f = audio_features(std::span<const double>(y), 16000).to_vector<float>();
    REQUIRE(f.size() == ref.size());
    CHECK(peak(f, 50) == peak(ref, 50));
    CHECK(std::abs(f[50 * 80 + peak(ref, 50)] - ref[50 * 80 + peak(ref, 50)]) < 0.05);
  }
  // 16 kHz multiples: identical to the reference rule's decimation.
  const auto x48 = tone(48000, 4800);
  CHECK(resample_to_16k(x48, 48000) == resample_poly(x48, 1, 3));
  CHECK_THROWS_AS(resample_to_16k(x48, 4000), std::invalid_argument);
}
