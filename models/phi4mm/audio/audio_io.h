#pragma once
// Audio file decoding for the audio path (issue 6): WAV (PCM 8/16/24/32-bit,
// float 32/64, any channel count; also WAVEX, RF64, W64), FLAC, MP3 and
// OGG/Vorbis (and Opus), read from memory with Debian's libsndfile
// (sf_open_virtual). This is what the model card's `soundfile.read` does (it
// wraps the same library): integer PCM becomes float64 in [-1, 1) (int16 / 32768),
// float data is passed through, and several channels are averaged into mono as
// the released processor averages a soundfile [N, C] array (spec audio.md §2.1).
//
// Every problem is a std::runtime_error whose message starts with "audio:" and
// names it: empty input, an unknown format (its first bytes shown), a corrupt
// header of a format named from its magic bytes ("MP3 data is truncated or
// corrupt"), unsupported container or codec, truncated data, an absurd sample
// rate or channel count, non-finite samples or samples beyond
// kMaxAudioSampleMagnitude, a clip longer than the configured limit, or too short for one 25 ms analysis window (the
// extractor's rule, spec §3.2: at least 400 samples after its §2.2 rate step,
// 200 at 8 kHz; checked here so a request fails before any feature work).
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace areno::phi4mm {

// The largest sample magnitude accepted (80 dB above full scale). Float files
// may exceed 1.0; beyond this bound the float32 feature extractor could
// overflow (its power spectrum grows with the square), so such clips are
// refused rather than turned into NaN features.
inline constexpr double kMaxAudioSampleMagnitude = 1e4;

struct AudioDecodeOptions {
  double max_seconds = 600.0;      // longer clips are rejected (<= 0: no limit)
  int64_t min_sample_rate = 8000;  // the reference extractor rejects lower rates (§2.2)
  // Not a reference limit (the extractor accepts up to kAudioMaxSampleRate):
  // no consumer capture format goes higher, so anything above is treated as a
  // broken header.
  int64_t max_sample_rate = 192000;
  int64_t max_channels = 32;
  bool check_min_length = true;    // apply the one-analysis-window minimum
  double max_abs_sample = kMaxAudioSampleMagnitude;  // larger (or non-finite) samples are refused
  // Called with the frame count (all channels interleaved) before the decoded
  // samples grow to it; may throw to stop decoding (a caller's memory budget).
  std::function<void(int64_t frames)> reserve_frames;
};

// What a file's header declares, read without decoding its samples.
struct AudioInfo {
  std::string format;        // as DecodedAudio::format
  int64_t sample_rate = 0;
  int64_t channels = 0;
  int64_t frames = -1;       // declared frames; -1 when the header does not say
  bool exact = false;        // `frames` is exact (not MP3's estimate)
};

struct DecodedAudio {
  std::vector<double> samples;  // mono, float64 in [-1, 1) for PCM sources
  int64_t sample_rate = 0;
  int64_t channels = 0;         // of the source, before the mix-down
  std::string format;           // "WAV PCM_16", "FLAC PCM_24", "OGG VORBIS", "MPEG LAYER_III", ...
  double seconds() const { return sample_rate ? double(samples.size()) / double(sample_rate) : 0.0; }
};

// The header of a file held in memory, with the checks decode_audio makes
// before reading samples (format, codec, channels, rate, declared length,
// truncated WAV data). Errors as decode_audio's.
AudioInfo probe_audio(std::span<const uint8_t> bytes, const AudioDecodeOptions& opts = {},
                      const std::string& name = "audio data");

// Decodes a whole file held in memory. `name` only labels error messages
// (a file name, "input_audio[0]", ...).
DecodedAudio decode_audio(std::span<const uint8_t> bytes, const AudioDecodeOptions& opts = {},
                          const std::string& name = "audio data");
// Reads `path` and decodes it; errors name the path.
DecodedAudio decode_audio_file(const std::string& path, const AudioDecodeOptions& opts = {});

}  // namespace areno::phi4mm
