// Audio bytes: WAV/FLAC/MP3/OGG through libsndfile, then the log-mel
// features of what decoded.
#include <exception>
#include <span>

#include "models/phi4mm/audio/audio_features.h"
#include "models/phi4mm/audio/audio_io.h"
#include "tests/fuzz/fuzz_common.h"

using namespace areno;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    phi4mm::AudioDecodeOptions o;
    o.max_seconds = 10;
    const phi4mm::DecodedAudio a = phi4mm::decode_audio(std::span<const uint8_t>(data, size), o, "fuzz");
    if (a.samples.size() <= 16000 * 2) (void)phi4mm::audio_features(a.samples, a.sample_rate);
  } catch (const std::exception&) {
  }
  return 0;
}
