// Log-mel feature extractor of Phi-4-multimodal (shared/spec/audio.md §2-§4).
// Every step keeps the reference's precision (§3.9): frames in float32,
// window x frame in float64, float64 FFT (FFTW), complex rounded to float32,
// float32 magnitude/power/mel product/log. Changing the order or width of any
// step breaks bit-exactness with the released extractor.
#include "models/phi4mm/audio/audio_features.h"

#include <fftw3.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <numeric>
#include <numbers>
#include <stdexcept>
#include <string>

// Bit-exactness needs every float/double multiply and add rounded separately,
// as numpy does: the project builds for FMA-capable CPUs (-march=native or
// x86-64-v3), where GCC would
// otherwise fuse a*b+c into FMA (pre-emphasis, window, mel sums) and change the
// last bits of almost every feature.
#pragma GCC optimize("fp-contract=off")

namespace areno::phi4mm {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// FFTW's planner is not thread-safe (its execute is); plans are made per call
// under this lock, with FFTW_ESTIMATE so planning costs microseconds.
std::mutex& fftw_planner_mutex() {
  static std::mutex m;
  return m;
}

// A real-to-complex double FFT of size n with its own aligned buffers.
class RealFft {
 public:
  explicit RealFft(int n) : n_(n) {
    in_ = fftw_alloc_real(size_t(n));
    out_ = fftw_alloc_complex(size_t(n / 2 + 1));
    if (!in_ || !out_) throw std::runtime_error("audio_features: FFTW buffer allocation failed");
    std::lock_guard<std::mutex> lock(fftw_planner_mutex());
    plan_ = fftw_plan_dft_r2c_1d(n, in_, out_, FFTW_ESTIMATE);
    if (!plan_) throw std::runtime_error("audio_features: FFTW could not plan a real FFT of size " +
                                         std::to_string(n));
  }
  ~RealFft() {
    {
      std::lock_guard<std::mutex> lock(fftw_planner_mutex());
      if (plan_) fftw_destroy_plan(plan_);
    }
    fftw_free(in_);
    fftw_free(out_);
  }
  RealFft(const RealFft&) = delete;
  RealFft& operator=(const RealFft&) = delete;

  double* in() { return in_; }
  const fftw_complex* out() const { return out_; }
  void run() { fftw_execute(plan_); }

 private:
  int n_;
  double* in_ = nullptr;
  fftw_complex* out_ = nullptr;
  fftw_plan plan_ = nullptr;
};

// Symmetric Hamming window in float64, evaluated as the golden file states
// reproduces the reference: 0.54 - 0.46 * cos(((2 * pi) * n) / (win - 1)).
std::vector<double> hamming(int64_t win) {
  std::vector<double> w(static_cast<size_t>(win));
  for (int64_t n = 0; n < win; ++n)
    w[size_t(n)] = 0.54 - 0.46 * std::cos(2.0 * std::numbers::pi * double(n) / double(win - 1));
  return w;
}

std::vector<float> build_mel_filterbank() {
  // speechlib_mel(16000, 512, 80, fmin=0, fmax=7690), all in float64 (§3.7).
  const double sr = 16000.0, n_fft = 512.0, fmax = 7690.0;
  auto mel = [](double f) { return 1127.0 * std::log(1.0 + f / 700.0); };
  auto f2bin = [&](double f) { return int64_t(std::floor(f * n_fft / sr + 0.5)); };
  const int64_t klo = f2bin(0.0) + 1;                 // 1
  const int64_t khi = std::max(f2bin(fmax), klo);     // 246
  const double mlo = mel(0.0), mhi = mel(fmax);
  const int64_t n_points = kAudioMelBins + 2;         // 82
  const double ms = (mhi - mlo) / double(n_points - 1);
  std::vector<double> c(static_cast<size_t>(n_points));
  for (int64_t i = 0; i < n_points; ++i) c[size_t(i)] = mlo + double(i) * ms;
  c[size_t(n_points - 1)] = mhi;  // linspace includes the end point exactly
  std::vector<float> w(size_t(kAudioMelBins * kAudioSpecBins), 0.0f);
  for (int64_t k = klo; k < khi; ++k) {
    const double b = mel(double(k) * sr / n_fft);
    for (int64_t m = 0; m < kAudioMelBins; ++m) {
      if (c[size_t(m)] < b && b < c[size_t(m + 2)])
        w[size_t(m * kAudioSpecBins + k)] = float(1.0 - std::abs(c[size_t(m + 1)] - b) / ms);
    }
  }
  return w;
}

// Non-zero column range [lo, hi) of each mel filter: skipping zero weights
// leaves the float32 sums unchanged (adding +0 to a non-negative sum is exact).
struct MelRange {
  int64_t lo, hi;
};
const std::vector<MelRange>& mel_ranges() {
  static const std::vector<MelRange> ranges = [] {
    const auto& w = audio_mel_filterbank();
    std::vector<MelRange> r(static_cast<size_t>(kAudioMelBins), MelRange{0, 0});
    for (int64_t m = 0; m < kAudioMelBins; ++m) {
      int64_t lo = kAudioSpecBins, hi = 0;
      for (int64_t k = 0; k < kAudioSpecBins; ++k)
        if (w[size_t(m * kAudioSpecBins + k)] != 0.0f) lo = std::min(lo, k), hi = k + 1;
      r[size_t(m)] = lo < hi ? MelRange{lo, hi} : MelRange{0, 0};
    }
    return r;
  }();
  return ranges;
}

}  // namespace

AudioPlan plan_audio(int64_t num_samples, int64_t sample_rate) {
  if (sample_rate < kAudioMinSampleRate || sample_rate > kAudioMaxSampleRate)
    throw std::invalid_argument("audio: unsupported sample rate " + std::to_string(sample_rate) +
                                " Hz (expected " + std::to_string(kAudioMinSampleRate) + " to " +
                                std::to_string(kAudioMaxSampleRate) + " Hz)");
  if (num_samples <= 0)
    throw std::invalid_argument("audio: the clip is empty (0 samples); at least 25 ms of audio is needed");
  AudioPlan p;
  // §2.2: the reference's integer-division rules, quirks included.
  if (sample_rate >= 16000) {
    p.analysis = AudioAnalysis::k16k;
    p.resample_down = sample_rate > 16000 ? sample_rate / 16000 : 1;
  } else if (sample_rate > 8000) {
    p.analysis = AudioAnalysis::k8kFillZero;
    p.resample_down = sample_rate / 8000;  // always 1 in (8000, 16000)
  } else {
    p.analysis = AudioAnalysis::k8kFillZero;
    p.resample_down = 1;
  }
  if (p.analysis == AudioAnalysis::k8kFillZero) p.win = 200, p.hop = 80, p.n_fft = 256;
  p.num_samples_processed = ceil_div(num_samples, p.resample_down);
  if (p.num_samples_processed < p.win)
    throw std::invalid_argument(
        "audio: clip too short: " + std::to_string(num_samples) + " samples at " +
        std::to_string(sample_rate) + " Hz give " + std::to_string(p.num_samples_processed) +
        " analysis samples, fewer than one " + std::to_string(p.win) + "-sample (25 ms) window");
  p.frames = (p.num_samples_processed - p.win) / p.hop + 1;
  p.tokens = ceil_div(p.frames, kAudioCompressionRate);
  return p;
}

int64_t audio_token_count(int64_t num_samples, int64_t sample_rate) {
  return plan_audio(num_samples, sample_rate).tokens;
}

std::vector<double> resample_poly(std::span<const double> x, int64_t up, int64_t down) {
  if (up < 1 || down < 1)
    throw std::invalid_argument("resample_poly: up and down must be >= 1 (got " + std::to_string(up) +
                                ", " + std::to_string(down) + ")");
  const int64_t g = std::gcd(up, down);
  up /= g, down /= g;
  if (up == 1 && down == 1) return std::vector<double>(x.begin(), x.end());
  const int64_t n_in = int64_t(x.size());
  const int64_t n_out = ceil_div(n_in * up, down);

  // scipy firwin(2*half+1, 1/R, window=('kaiser', 5.0)), scaled to DC gain `up`.
  const int64_t R = std::max(up, down), half = 10 * R, L = 2 * half + 1;
  const double fc = 1.0 / double(R), beta = 5.0;
  const double i0_beta = std::cyl_bessel_i(0.0, beta);
  std::vector<double> h(static_cast<size_t>(L));
  double sum = 0.0;
  const double alpha = 0.5 * double(L - 1);
  for (int64_t j = 0; j < L; ++j) {
    const double m = double(j) - alpha;
    const double u = fc * m;
    const double sinc = u == 0.0 ? 1.0 : std::sin(std::numbers::pi * u) / (std::numbers::pi * u);
    const double r = (double(j) - alpha) / alpha;
    const double w = std::cyl_bessel_i(0.0, beta * std::sqrt(std::max(0.0, 1.0 - r * r))) / i0_beta;
    h[size_t(j)] = fc * sinc * w;
    sum += h[size_t(j)];
  }
  for (auto& v : h) v = double(up) * (v / sum);

  // y[m] = sum_j h[j] * xu[m*down + half - j], xu = x upsampled by zero insertion.
  std::vector<double> y(static_cast<size_t>(n_out), 0.0);
  for (int64_t m = 0; m < n_out; ++m) {
    const int64_t c = m * down + half;  // index into xu of tap j = 0
    // Only taps landing on i = c - j with i % up == 0 and 0 <= i/up < n_in contribute.
    const int64_t i_lo = std::max<int64_t>(0, c - (L - 1));
    const int64_t i_hi = std::min<int64_t>(c, (n_in - 1) * up);
    double acc = 0.0;
    for (int64_t i = i_lo + ((up - i_lo % up) % up); i <= i_hi; i += up)
      acc += h[size_t(c - i)] * x[size_t(i / up)];
    y[size_t(m)] = acc;
  }
  return y;
}

std::vector<double> resample_to_16k(std::span<const double> x, int64_t sample_rate) {
  if (sample_rate < kAudioMinSampleRate || sample_rate > kAudioMaxSampleRate)
    throw std::invalid_argument("audio: unsupported sample rate " + std::to_string(sample_rate) +
                                " Hz (expected " + std::to_string(kAudioMinSampleRate) + " to " +
                                std::to_string(kAudioMaxSampleRate) + " Hz)");
  const int64_t g = std::gcd(sample_rate, int64_t(16000));
  return resample_poly(x, 16000 / g, sample_rate / g);
}

std::vector<double> mix_to_mono(std::span<const double> interleaved, int64_t channels) {
  if (channels < 1)
    throw std::invalid_argument("audio: channel count must be >= 1 (got " + std::to_string(channels) + ")");
  if (int64_t(interleaved.size()) % channels != 0)
    throw std::invalid_argument("audio: " + std::to_string(interleaved.size()) +
                                " interleaved samples are not a whole number of " +
                                std::to_string(channels) + "-channel frames");
  const int64_t n = int64_t(interleaved.size()) / channels;
  std::vector<double> mono(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    double s = 0.0;
    for (int64_t c = 0; c < channels; ++c) s += interleaved[size_t(i * channels + c)];
    mono[size_t(i)] = s / double(channels);
  }
  return mono;
}

const std::vector<float>& audio_mel_filterbank() {
  static const std::vector<float> w = build_mel_filterbank();
  return w;
}

void audio_features_into(std::span<const double> samples, int64_t sample_rate, float* out) {
  const AudioPlan p = plan_audio(int64_t(samples.size()), sample_rate);
  std::vector<double> resampled;
  std::span<const double> x = samples;
  if (p.resample_down > 1) {
    resampled = resample_poly(samples, 1, p.resample_down);
    x = resampled;
  }
  const bool fillzero = p.analysis == AudioAnalysis::k8kFillZero;
  const std::vector<double> window = hamming(p.win);
  const auto& W = audio_mel_filterbank();
  const auto& ranges = mel_ranges();
  RealFft fft(int(p.n_fft));
  // 8 kHz: keep FFT bins 0..127 (31.25 Hz apart, as the 16 kHz 512-point bins)
  // and leave 128..256 at zero (§3.6).
  const int64_t kept_bins = fillzero ? 128 : kAudioSpecBins;
  std::vector<float> frame(size_t(p.win)), power(size_t(kAudioSpecBins), 0.0f);
  double* in = fft.in();
  std::fill(in, in + p.n_fft, 0.0);
  for (int64_t t = 0; t < p.frames; ++t) {
    const double* s64 = x.data() + t * p.hop;
    for (int64_t i = 0; i < p.win; ++i) frame[size_t(i)] = float(s64[i]);
    // Pre-emphasis inside the frame (the first sample is its own predecessor),
    // then x32768, all in float32 (§3.3).
    for (int64_t i = 0; i < p.win; ++i) {
      const float prev = frame[size_t(i > 0 ? i - 1 : 0)];
      const float pe = 0.97f * prev;
      const float d = frame[size_t(i)] - pe;
      const float e = d * 32768.0f;
      in[i] = window[size_t(i)] * double(e);
    }
    fft.run();  // zero padding win..n_fft stays zero
    const fftw_complex* S = fft.out();
    for (int64_t k = 0; k < kept_bins; ++k) {
      const float re = float(S[k][0]), im = float(S[k][1]);
      float mag;
      if (fillzero)  // the reference takes this magnitude in float64 (§3.6)
        mag = float(std::sqrt(double(re) * double(re) + double(im) * double(im)));
      else
        mag = std::hypot(re, im);
      power[size_t(k)] = mag * mag;
    }
    float* row = out + t * kAudioMelBins;
    for (int64_t m = 0; m < kAudioMelBins; ++m) {
      // The reference sgemm's order: increasing k, float accumulator, each
      // product rounded before the add.
      float acc = 0.0f;
      const float* wm = W.data() + m * kAudioSpecBins;
      for (int64_t k = ranges[size_t(m)].lo; k < ranges[size_t(m)].hi; ++k) {
        const float prod = power[size_t(k)] * wm[k];
        acc = acc + prod;
      }
      row[m] = std::log(std::max(acc, 1.0f));
      // float32 power overflows for samples far beyond full scale (decode_audio
      // refuses those); never hand the encoder a NaN or an infinity.
      if (!std::isfinite(row[m]))
        throw std::invalid_argument("audio features: a non-finite log-mel value at frame " + std::to_string(t) +
                                    " (sample magnitudes far beyond full scale)");
    }
  }
}

Tensor audio_features(std::span<const double> samples, int64_t sample_rate) {
  const AudioPlan p = plan_audio(int64_t(samples.size()), sample_rate);
  Tensor f = empty({p.frames, kAudioMelBins}, DType::f32);
  audio_features_into(samples, sample_rate, f.data<float>());
  return f;
}

Tensor audio_features(std::span<const float> samples, int64_t sample_rate) {
  const std::vector<double> x(samples.begin(), samples.end());
  return audio_features(std::span<const double>(x), sample_rate);
}

AudioBatch audio_features_batch(std::span<const AudioClip> clips) {
  if (clips.empty()) throw std::invalid_argument("audio_features_batch: no clips given");
  AudioBatch b;
  int64_t t_max = 0;
  for (size_t i = 0; i < clips.size(); ++i) {
    try {
      const AudioPlan p = plan_audio(int64_t(clips[i].samples.size()), clips[i].sample_rate);
      b.frames.push_back(p.frames);
      b.tokens.push_back(p.tokens);
      t_max = std::max(t_max, p.frames);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("audio clip " + std::to_string(i) + ": " + e.what());
    }
  }
  const int64_t B = int64_t(clips.size());
  b.features = zeros({B, t_max, kAudioMelBins}, DType::f32);
  float* base = b.features.data<float>();
  for (int64_t i = 0; i < B; ++i)
    audio_features_into(clips[size_t(i)].samples, clips[size_t(i)].sample_rate,
                        base + i * t_max * kAudioMelBins);
  if (B > 1) {
    b.mask = zeros({B, t_max}, DType::boolean);
    bool* m = b.mask.data<bool>();
    for (int64_t i = 0; i < B; ++i)
      for (int64_t t = 0; t < b.frames[size_t(i)]; ++t) m[i * t_max + t] = true;
  }
  return b;
}

}  // namespace areno::phi4mm
