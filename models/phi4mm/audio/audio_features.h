#pragma once
// Phi-4-multimodal audio feature extractor: waveform -> 80-bin log-mel
// features [T, 80] f32, as the released Phi4MMAudioFeatureExtractor
// (processing_phi4mm.py) computes them. Ground truth: shared/spec/audio.md §2-§4.
//
// Pipeline (§0):
//   mono float64 samples in [-1, 1) @ sample_rate
//   -> sample-rate rule (§2.2): decimate by sr//16000 (sr > 16 kHz), keep 16 kHz,
//      or analyse as 8 kHz with the "fillzero" trick (8000 <= sr < 16000)
//   -> frames (win 400 / hop 160, or 200 / 80 at 8 kHz), in-frame pre-emphasis 0.97,
//      x32768, symmetric Hamming, real FFT (512 or 256), magnitude, power
//   -> 80 mel filters over 0..7690 Hz, floor 1.0, natural log.
// The precision chain of the reference (§3.9) is reproduced step by step so the
// output matches its 'libm' variant bit for bit on the golden clips.
#include <cstdint>
#include <span>
#include <vector>

#include "tensor/tensor.h"

namespace areno::phi4mm {

inline constexpr int64_t kAudioMelBins = 80;
inline constexpr int64_t kAudioSpecBins = 257;        // n_fft 512 / 2 + 1
inline constexpr int64_t kAudioCompressionRate = 8;   // audio tokens = ceil(T / 8) (§4)
inline constexpr int64_t kAudioMinSampleRate = 8000;  // the reference rejects lower rates
// Not a reference limit: above this the decimation filter (20*q+1 taps) grows
// without bound and no real capture device produces such rates.
inline constexpr int64_t kAudioMaxSampleRate = 768000;

enum class AudioAnalysis { k16k, k8kFillZero };

// What the reference does with a clip of `num_samples` mono samples at
// `sample_rate` Hz (§2.2, §3.2, §4). Throws std::invalid_argument for rates
// outside [kAudioMinSampleRate, kAudioMaxSampleRate] and clips too short for
// one analysis window (including empty ones).
struct AudioPlan {
  AudioAnalysis analysis = AudioAnalysis::k16k;
  int64_t resample_down = 1;          // decimation factor q (1 = samples used as they are)
  int64_t num_samples_processed = 0;  // ceil(num_samples / q)
  int64_t win = 400, hop = 160, n_fft = 512;
  int64_t frames = 0;                 // T = (N - win) // hop + 1
  int64_t tokens = 0;                 // ceil(T / 8)
};
AudioPlan plan_audio(int64_t num_samples, int64_t sample_rate);

// Number of audio placeholder tokens for a clip (= plan_audio(...).tokens).
int64_t audio_token_count(int64_t num_samples, int64_t sample_rate);

// scipy.signal.resample_poly(x, up, down) with its defaults (Kaiser beta 5 FIR,
// zero edges), in float64 (§2.3). Output length ceil(n * up' / down') after
// reducing up/down by their gcd.
std::vector<double> resample_poly(std::span<const double> x, int64_t up, int64_t down);

// True rational resampling of any supported rate to 16 kHz (what newer vLLM does
// before calling the processor, spec §2.4): resample_poly(x, 16000/g, sr/g),
// g = gcd(sr, 16000). Not the reference rule: feed the result to
// audio_features(..., 16000) only when correct pitch matters more than matching
// the released extractor (for sr = 16000 * k both agree bit for bit).
std::vector<double> resample_to_16k(std::span<const double> x, int64_t sample_rate);

// Averages interleaved channels ([N, C], sample-major) into mono in float64, as the
// reference averages a soundfile [N, C] array over its channel axis (§2.1).
std::vector<double> mix_to_mono(std::span<const double> interleaved, int64_t channels);

// The normative mel filterbank W [80, 257] f32, row-major (§3.7).
const std::vector<float>& audio_mel_filterbank();

// Log-mel features [T, 80] f32 (CPU) of a mono clip. Samples are floats in [-1, 1)
// (int16 PCM / 32768), NOT raw integer PCM.
Tensor audio_features(std::span<const double> samples, int64_t sample_rate);
Tensor audio_features(std::span<const float> samples, int64_t sample_rate);
// Same, written into a caller-provided buffer of plan.frames * 80 floats.
void audio_features_into(std::span<const double> samples, int64_t sample_rate, float* out);

// Several clips featurised independently and stacked as the reference processor
// does (§3.10): features [B, T_max, 80] zero-padded at the end (0.0 = the log
// floor), tokens[i] = ceil(T_i / 8), and mask [B, T_max] (bool, t < T_i) only
// when B > 1 (undefined for a single clip, as in the reference).
struct AudioClip {
  std::span<const double> samples;
  int64_t sample_rate = 16000;
};
struct AudioBatch {
  Tensor features;              // [B, T_max, 80] f32
  Tensor mask;                  // [B, T_max] bool, or undefined when B == 1
  std::vector<int64_t> frames;  // T_i
  std::vector<int64_t> tokens;  // ceil(T_i / 8)
};
AudioBatch audio_features_batch(std::span<const AudioClip> clips);

}  // namespace areno::phi4mm
