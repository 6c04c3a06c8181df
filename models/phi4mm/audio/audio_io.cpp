#include "models/phi4mm/audio/audio_io.h"

#include <sndfile.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>

#include <fmt/format.h>

#include "models/phi4mm/audio/audio_features.h"

namespace areno::phi4mm {

namespace {

// libsndfile reads through these callbacks from a memory buffer.
struct MemoryReader {
  std::span<const uint8_t> data;
  sf_count_t pos = 0;
};

sf_count_t vio_length(void* user) { return sf_count_t(static_cast<MemoryReader*>(user)->data.size()); }

sf_count_t vio_seek(sf_count_t offset, int whence, void* user) {
  auto* r = static_cast<MemoryReader*>(user);
  const sf_count_t size = sf_count_t(r->data.size());
  sf_count_t base = whence == SEEK_CUR ? r->pos : whence == SEEK_END ? size : 0;
  r->pos = std::clamp<sf_count_t>(base + offset, 0, size);
  return r->pos;
}

sf_count_t vio_read(void* ptr, sf_count_t count, void* user) {
  auto* r = static_cast<MemoryReader*>(user);
  const sf_count_t n = std::clamp<sf_count_t>(count, 0, sf_count_t(r->data.size()) - r->pos);
  if (n > 0) std::memcpy(ptr, r->data.data() + r->pos, size_t(n));
  r->pos += n;
  return n;
}

sf_count_t vio_write(const void*, sf_count_t, void*) { return 0; }
sf_count_t vio_tell(void* user) { return static_cast<MemoryReader*>(user)->pos; }

std::string container_name(int major) {
  switch (major) {
    case SF_FORMAT_WAV: return "WAV";
    case SF_FORMAT_WAVEX: return "WAVEX";
    case SF_FORMAT_RF64: return "RF64";
    case SF_FORMAT_W64: return "W64";
    case SF_FORMAT_AIFF: return "AIFF";
    case SF_FORMAT_FLAC: return "FLAC";
    case SF_FORMAT_OGG: return "OGG";
    case SF_FORMAT_MPEG: return "MPEG";
    default: return "";  // not accepted
  }
}

std::string codec_name(int sub) {
  switch (sub) {
    case SF_FORMAT_PCM_S8: return "PCM_S8";
    case SF_FORMAT_PCM_U8: return "PCM_U8";
    case SF_FORMAT_PCM_16: return "PCM_16";
    case SF_FORMAT_PCM_24: return "PCM_24";
    case SF_FORMAT_PCM_32: return "PCM_32";
    case SF_FORMAT_FLOAT: return "FLOAT";
    case SF_FORMAT_DOUBLE: return "DOUBLE";
    case SF_FORMAT_ULAW: return "ULAW";
    case SF_FORMAT_ALAW: return "ALAW";
    case SF_FORMAT_IMA_ADPCM: return "IMA_ADPCM";
    case SF_FORMAT_MS_ADPCM: return "MS_ADPCM";
    case SF_FORMAT_VORBIS: return "VORBIS";
    case SF_FORMAT_OPUS: return "OPUS";
    case SF_FORMAT_MPEG_LAYER_I: return "LAYER_I";
    case SF_FORMAT_MPEG_LAYER_II: return "LAYER_II";
    case SF_FORMAT_MPEG_LAYER_III: return "LAYER_III";
    default: return "";
  }
}

// Declared size of the first "data" chunk of a RIFF/WAVE file and the bytes
// actually present after its header, or {-1, -1} when the layout is not a plain
// RIFF WAVE. libsndfile silently shortens a truncated data chunk; the reference
// (soundfile) would also read the short clip, but a cut-off upload is almost
// always a transport error, so we report it.
std::pair<int64_t, int64_t> wav_data_chunk(std::span<const uint8_t> b) {
  auto u32 = [&](size_t at) {
    return uint32_t(b[at]) | uint32_t(b[at + 1]) << 8 | uint32_t(b[at + 2]) << 16 | uint32_t(b[at + 3]) << 24;
  };
  if (b.size() < 12 || std::memcmp(b.data(), "RIFF", 4) != 0 || std::memcmp(b.data() + 8, "WAVE", 4) != 0)
    return {-1, -1};
  size_t at = 12;
  while (at + 8 <= b.size()) {
    const uint32_t size = u32(at + 4);
    if (std::memcmp(b.data() + at, "data", 4) == 0) {
      if (size == 0xFFFFFFFFu) return {-1, -1};  // streaming writers: size unknown
      return {int64_t(size), int64_t(b.size() - (at + 8))};
    }
    at += 8 + size_t(size) + (size & 1);
  }
  return {-1, -1};
}

// The format tag of a RIFF/WAVE file's fmt chunk, or -1.
int wav_format_tag(std::span<const uint8_t> b) {
  if (b.size() < 12 || std::memcmp(b.data(), "RIFF", 4) != 0 || std::memcmp(b.data() + 8, "WAVE", 4) != 0) return -1;
  size_t at = 12;
  while (at + 10 <= b.size()) {
    const uint32_t size = uint32_t(b[at + 4]) | uint32_t(b[at + 5]) << 8 | uint32_t(b[at + 6]) << 16 |
                          uint32_t(b[at + 7]) << 24;
    if (std::memcmp(b.data() + at, "fmt ", 4) == 0) return int(b[at + 8]) | int(b[at + 9]) << 8;
    at += 8 + size_t(size) + (size & 1);
  }
  return -1;
}

struct SndfileCloser {
  void operator()(SNDFILE* f) const { sf_close(f); }
};

// The longest clip `opts` accepts, in frames at `rate`.
int64_t max_frames(const AudioDecodeOptions& opts, int64_t rate) {
  return opts.max_seconds > 0 ? int64_t(opts.max_seconds * double(rate)) : INT64_MAX;
}

bool has_magic(std::span<const uint8_t> b, const char* magic, size_t at = 0) {
  const size_t n = std::strlen(magic);
  return b.size() >= at + n && std::memcmp(b.data() + at, magic, n) == 0;
}

// The container the magic bytes name ("" when none known): libsndfile's own
// reason for refusing a buffer is often a leftover of an unrelated call ("File
// does not exist"), so errors name the format from here.
std::string sniff_container(std::span<const uint8_t> b) {
  if (has_magic(b, "RIFF") && has_magic(b, "WAVE", 8)) return "WAV";
  if (has_magic(b, "RF64")) return "RF64";
  if (has_magic(b, "riff")) return "W64";
  if (has_magic(b, "fLaC")) return "FLAC";
  if (has_magic(b, "OggS")) return "OGG";
  if (has_magic(b, "ID3") || (b.size() >= 2 && b[0] == 0xFF && (b[1] & 0xE0) == 0xE0)) return "MP3";
  if (has_magic(b, "FORM") && (has_magic(b, "AIFF", 8) || has_magic(b, "AIFC", 8))) return "AIFF";
  return "";
}

// " (libsndfile: why)", or nothing when `why` is a leftover that does not
// apply to a memory buffer.
std::string libsndfile_reason(const std::string& why) {
  if (why.empty() || why.find("does not exist") != std::string::npos || why == "No Error.") return "";
  return " (libsndfile: " + why + ")";
}

// An open file and the reader it reads from (which must outlive it).
struct OpenAudio {
  MemoryReader reader;
  SF_INFO info{};
  std::unique_ptr<SNDFILE, SndfileCloser> file;
  AudioInfo header;
};

// Opens `bytes` and applies every check that needs only the header.
void open_audio(std::span<const uint8_t> bytes, const AudioDecodeOptions& opts, const std::string& name, OpenAudio& a) {
  if (bytes.empty()) throw std::runtime_error(fmt::format("audio: {} is empty (0 bytes)", name));
  a.reader = MemoryReader{bytes, 0};
  SF_VIRTUAL_IO vio{vio_length, vio_seek, vio_read, vio_write, vio_tell};
  SF_INFO& info = a.info;
  a.file.reset(sf_open_virtual(&vio, SFM_READ, &info, &a.reader));
  if (!a.file) {
    const std::string why = sf_strerror(nullptr);
    // WAV codecs libsndfile knows: PCM, IEEE float, A-law, mu-law, MS/IMA ADPCM,
    // GSM 6.10, extensible. Name any other tag as the codec problem it is.
    const int tag = wav_format_tag(bytes);
    static const int kKnown[] = {0x0001, 0x0002, 0x0003, 0x0006, 0x0007, 0x0011, 0x0031, 0xFFFE};
    if (tag >= 0 && std::find(std::begin(kKnown), std::end(kKnown), tag) == std::end(kKnown))
      throw std::runtime_error(fmt::format("audio: {}: unsupported codec in a WAV file (format tag 0x{:04x}; "
                                           "expected PCM or IEEE float)", name, tag));
    const std::string sniffed = sniff_container(bytes);
    if (sniffed.empty()) {
      std::string first;
      for (size_t i = 0; i < std::min<size_t>(bytes.size(), 4); ++i) first += fmt::format("{}{:02x}", i ? " " : "", bytes[i]);
      throw std::runtime_error(fmt::format(
          "audio: {}: not a supported audio format (first bytes {}; expected WAV, FLAC, MP3 or OGG)", name, first));
    }
    throw std::runtime_error(
        fmt::format("audio: {}: {} data is truncated or corrupt{}", name, sniffed, libsndfile_reason(why)));
  }
  const int major = info.format & SF_FORMAT_TYPEMASK, sub = info.format & SF_FORMAT_SUBMASK;
  const std::string container = container_name(major), codec = codec_name(sub);
  if (container.empty())
    throw std::runtime_error(fmt::format("audio: {}: unsupported container (libsndfile format 0x{:x}); "
                                         "expected WAV, FLAC, MP3 or OGG", name, major));
  if (codec.empty())
    throw std::runtime_error(fmt::format("audio: {}: unsupported codec 0x{:x} in a {} file", name, sub, container));
  AudioInfo& h = a.header;
  h.format = container + " " + codec;
  h.sample_rate = info.samplerate;
  h.channels = info.channels;
  const bool declared = info.frames > 0 && info.frames != SF_COUNT_MAX;
  h.frames = declared ? int64_t(info.frames) : -1;
  h.exact = declared && major != SF_FORMAT_MPEG;
  if (info.channels < 1 || info.channels > opts.max_channels)
    throw std::runtime_error(fmt::format("audio: {}: {} channels (expected 1 to {})", name, info.channels,
                                         opts.max_channels));
  if (info.samplerate < opts.min_sample_rate || info.samplerate > opts.max_sample_rate)
    throw std::runtime_error(fmt::format("audio: {}: unsupported sample rate {} Hz (expected {} to {} Hz)", name,
                                         info.samplerate, opts.min_sample_rate, opts.max_sample_rate));
  // A header's frame count is a claim, not a promise (MP3 estimates it): check
  // it early, then enforce the limit while reading.
  if (declared && h.frames > max_frames(opts, info.samplerate))
    throw std::runtime_error(fmt::format("audio: {}: {:.1f} s long, more than the {:.1f} s limit", name,
                                         double(info.frames) / info.samplerate, opts.max_seconds));
  if (major == SF_FORMAT_WAV || major == SF_FORMAT_WAVEX) {
    auto [declared_bytes, present] = wav_data_chunk(bytes);
    if (declared_bytes >= 0 && present < declared_bytes)
      throw std::runtime_error(fmt::format("audio: {}: truncated data ({} of the {} bytes the WAV header declares)",
                                           name, present, declared_bytes));
  }
}

}  // namespace

AudioInfo probe_audio(std::span<const uint8_t> bytes, const AudioDecodeOptions& opts, const std::string& name) {
  OpenAudio a;
  open_audio(bytes, opts, name, a);
  return a.header;
}

DecodedAudio decode_audio(std::span<const uint8_t> bytes, const AudioDecodeOptions& opts, const std::string& name) {
  OpenAudio a;
  open_audio(bytes, opts, name, a);
  const SF_INFO& info = a.info;
  SNDFILE* f = a.file.get();
  const int major = info.format & SF_FORMAT_TYPEMASK;
  const int64_t max_frames_read = max_frames(opts, info.samplerate);
  DecodedAudio out;
  out.format = a.header.format;
  out.sample_rate = info.samplerate;
  out.channels = info.channels;

  // Interleaved [N, C] float64, in blocks (never sized from the header alone).
  const int64_t c = info.channels;
  std::vector<double> interleaved, block(size_t(4096 * c));
  int64_t frames = 0;
  for (;;) {
    const sf_count_t got = sf_readf_double(f, block.data(), 4096);
    if (got <= 0) break;
    frames += got;
    if (frames > max_frames_read)
      throw std::runtime_error(fmt::format("audio: {}: longer than the {:.1f} s limit", name, opts.max_seconds));
    if (opts.reserve_frames) opts.reserve_frames(frames);
    interleaved.insert(interleaved.end(), block.begin(), block.begin() + got * c);
  }
  if (sf_error(f) != SF_ERR_NO_ERROR)
    throw std::runtime_error(fmt::format("audio: {}: {} data is corrupt or truncated after {} frames{}", name,
                                         a.header.format, frames, libsndfile_reason(sf_strerror(f))));
  if (info.frames > 0 && info.frames != SF_COUNT_MAX && frames < info.frames && major != SF_FORMAT_MPEG)
    throw std::runtime_error(fmt::format("audio: {}: truncated data ({} of the {} frames the header declares)", name,
                                         frames, info.frames));
  if (frames == 0)
    throw std::runtime_error(fmt::format(
        "audio: {}: no audio samples (a zero-length clip, or data cut off before the first samples)", name));
  for (double v : interleaved) {
    if (!std::isfinite(v))
      throw std::runtime_error(fmt::format("audio: {}: non-finite sample values (corrupt float data)", name));
    if (std::abs(v) > opts.max_abs_sample)
      throw std::runtime_error(fmt::format("audio: {}: sample value {:g} is beyond the accepted magnitude {:g} "
                                           "(float data far outside [-1, 1] is refused, not clipped)",
                                           name, v, opts.max_abs_sample));
  }

  out.samples = c == 1 ? std::move(interleaved) : mix_to_mono(interleaved, c);
  if (opts.check_min_length) {
    try {
      plan_audio(int64_t(out.samples.size()), out.sample_rate);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(fmt::format("{} ({})", e.what(), name));
    }
  }
  return out;
}

DecodedAudio decode_audio_file(const std::string& path, const AudioDecodeOptions& opts) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("audio: cannot open {}", path));
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return decode_audio(bytes, opts, path);
}

}  // namespace areno::phi4mm
