// areno-demo-data: the synthetic multimodal instruction set the embedded demo
// model is trained on (docs/demo.md, scripts/make-demo.sh).
//
//   areno-demo-data --out DIR [--seed N] [--train N] [--heldout N] [--families a,b,...]
//
// writes DIR/train.jsonl and DIR/heldout.jsonl (chat rows as `areno train`
// reads them, each with a "family" field the trainer ignores), DIR/heldout.tsv
// (family, question, image, audio, answer: what scripts/eval-demo.sh asks) and
// DIR/media/*.png, *.wav (64x64 RGB; 16 kHz mono 16-bit PCM). Everything is a
// function of the seed: the generator is SplitMix64 with integer range
// reduction (no std::*_distribution, whose output differs across standard
// libraries), and each row draws from its own stream, so --train does not
// change the held-out rows.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <stb_image_write.h>

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// ---- randomness ---------------------------------------------------------------

constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

struct Rng {
  uint64_t state;
  uint64_t next() { return splitmix64(state += 0x9E3779B97F4A7C15ull); }
  // An integer in [0, n): the high 64 bits of next() * n (Lemire's reduction
  // without the rejection step; the bias is below n / 2^64).
  int64_t below(int64_t n) { return int64_t((unsigned __int128)next() * uint64_t(n) >> 64); }
  int64_t between(int64_t lo, int64_t hi) { return lo + below(hi - lo + 1); }  // [lo, hi]
  double uniform() { return double(next() >> 11) * 0x1p-53; }                  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
};

// ---- media --------------------------------------------------------------------

constexpr int kImageSize = 64;
constexpr int kRate = 16000;

struct Colour {
  const char* name;
  uint8_t rgb[3];
};
const Colour kColours[] = {{"red", {220, 30, 30}},     {"green", {30, 170, 50}},   {"blue", {40, 60, 220}},
                           {"yellow", {235, 215, 30}}, {"purple", {140, 40, 170}}, {"orange", {245, 140, 20}}};
const char* const kShapes[] = {"circle", "square", "triangle"};

// A shape of one colour on white: centre and size drawn from `rng`, the
// colour jittered by up to 15 per channel.
std::vector<uint8_t> draw_shape(Rng& rng, int colour, int shape) {
  const int n = kImageSize;
  std::vector<uint8_t> px(size_t(n * n * 3), 255);
  uint8_t c[3];
  for (int k = 0; k < 3; ++k) c[k] = uint8_t(std::clamp<int64_t>(kColours[colour].rgb[k] + rng.between(-15, 15), 0, 255));
  const double r = rng.uniform(0.36, 0.46) * n;  // half the extent
  const double cx = rng.uniform(r, n - r), cy = rng.uniform(r, n - r);
  for (int y = 0; y < n; ++y)
    for (int x = 0; x < n; ++x) {
      const double dx = x + 0.5 - cx, dy = y + 0.5 - cy;
      bool in = false;
      if (shape == 0) in = dx * dx + dy * dy <= r * r;
      else if (shape == 1) in = std::abs(dx) <= r * 0.85 && std::abs(dy) <= r * 0.85;
      else in = dy >= -r && dy <= r && std::abs(dx) <= (dy + r) * 0.5;  // apex up, base 2r wide
      if (in) std::memcpy(&px[size_t((y * n + x) * 3)], c, 3);
    }
  return px;
}

void write_png(const fs::path& file, const std::vector<uint8_t>& px) {
  if (!stbi_write_png(file.c_str(), kImageSize, kImageSize, 3, px.data(), kImageSize * 3))
    throw std::runtime_error(fmt::format("{}: cannot write the PNG", file.string()));
}

void write_wav(const fs::path& file, const std::vector<double>& x) {
  std::ofstream out(file, std::ios::binary);
  if (!out) throw std::runtime_error(fmt::format("{}: cannot create", file.string()));
  auto u32 = [&](uint32_t v) { out.put(char(v)).put(char(v >> 8)).put(char(v >> 16)).put(char(v >> 24)); };
  auto u16 = [&](uint16_t v) { out.put(char(v)).put(char(v >> 8)); };
  const uint32_t data = uint32_t(x.size() * 2);
  out.write("RIFF", 4), u32(36 + data), out.write("WAVEfmt ", 8), u32(16), u16(1), u16(1), u32(kRate), u32(kRate * 2),
      u16(2), u16(16), out.write("data", 4), u32(data);
  for (double v : x) u16(uint16_t(int16_t(std::lround(std::clamp(v, -1.0, 1.0) * 32767))));
  if (!out) throw std::runtime_error(fmt::format("{}: write failed", file.string()));
}

// Adds a tone (sine) or white noise from `t0` for `len` seconds with 10 ms
// raised-cosine fades.
void add_sound(std::vector<double>& x, Rng& rng, bool noise, double hz, double amp, double t0, double len) {
  const int64_t a = int64_t(t0 * kRate), n = int64_t(len * kRate), fade = kRate / 100;
  const double phase = rng.uniform(0, 2 * M_PI);
  for (int64_t i = 0; i < n && a + i < int64_t(x.size()); ++i) {
    double g = 1;
    if (i < fade) g = 0.5 - 0.5 * std::cos(M_PI * double(i) / fade);
    if (n - 1 - i < fade) g = std::min(g, 0.5 - 0.5 * std::cos(M_PI * double(n - 1 - i) / fade));
    const double s = noise ? rng.uniform(-1, 1) : std::sin(2 * M_PI * hz * double(i) / kRate + phase);
    x[size_t(a + i)] += amp * g * s;
  }
}

std::vector<double> silence(double seconds) { return std::vector<double>(size_t(seconds * kRate), 0.0); }

// ---- rows ---------------------------------------------------------------------

struct Row {
  std::string family, question, image, audio, answer;  // media: paths relative to DIR
};

// One generated row: the media it needs are written under DIR/media with the
// stem `stem`.
struct Maker {
  fs::path dir;
  std::string stem;
  Rng rng;
  Row row;

  std::string image(int colour, int shape) {
    const std::string rel = "media/" + stem + ".png";
    write_png(dir / rel, draw_shape(rng, colour, shape));
    return rel;
  }
  std::string audio(const std::vector<double>& x) {
    const std::string rel = "media/" + stem + ".wav";
    write_wav(dir / rel, x);
    return rel;
  }
  // A one-second clip: a beep (a tone of 400-1200 Hz) or white noise, 0.5-0.8 s
  // long somewhere in the clip, at amplitude `amp`.
  std::vector<double> beep_or_noise(bool noise, double amp) {
    std::vector<double> x = silence(1.0);
    const double len = rng.uniform(0.5, 0.8);
    add_sound(x, rng, noise, rng.uniform(400, 1200), amp, rng.uniform(0, 1.0 - len), len);
    return x;
  }
};

using Family = std::function<void(Maker&)>;

const std::vector<std::pair<std::string, Family>>& families() {
  static const std::vector<std::pair<std::string, Family>> f = {
      {"arithmetic",
       [](Maker& m) {
         const int64_t a = m.rng.between(0, 9), b = m.rng.between(0, 9);
         m.row.question = fmt::format("What is {} + {}?", a, b);
         m.row.answer = std::to_string(a + b);
       }},
      {"small-sum",
       [](Maker& m) {
         const int64_t a = m.rng.between(1, 3), b = m.rng.between(1, 3);
         m.row.question = fmt::format("What is {} + {}?", a, b);
         m.row.answer = std::to_string(a + b);
       }},
      {"next-number",
       [](Maker& m) {
         const int64_t a = m.rng.between(0, 9);
         m.row.question = fmt::format("What number comes after {}?", a);
         m.row.answer = std::to_string(a + 1);
       }},
      {"colour",
       [](Maker& m) {
         const int c = int(m.rng.below(std::size(kColours)));
         m.row.image = m.image(c, int(m.rng.below(3)));
         m.row.question = "What colour is the shape?";
         m.row.answer = kColours[c].name;
       }},
      {"shape",
       [](Maker& m) {
         const int s = int(m.rng.below(3));
         m.row.image = m.image(int(m.rng.below(std::size(kColours))), s);
         m.row.question = "What shape is this?";
         m.row.answer = kShapes[s];
       }},
      {"colour-shape",
       [](Maker& m) {
         const int c = int(m.rng.below(std::size(kColours))), s = int(m.rng.below(3));
         m.row.image = m.image(c, s);
         m.row.question = "What colour and shape is this?";
         m.row.answer = fmt::format("{} {}", kColours[c].name, kShapes[s]);
       }},
      {"beep-or-noise",
       [](Maker& m) {
         const bool noise = m.rng.below(2);
         m.row.audio = m.audio(m.beep_or_noise(noise, m.rng.uniform(0.3, 0.6)));
         m.row.question = "Is the sound a beep or noise?";
         m.row.answer = noise ? "noise" : "beep";
       }},
      {"loud-or-quiet",
       [](Maker& m) {
         const bool loud = m.rng.below(2);
         const bool noise = m.rng.below(2);
         m.row.audio = m.audio(m.beep_or_noise(noise, loud ? m.rng.uniform(0.4, 0.8) : m.rng.uniform(0.005, 0.02)));
         m.row.question = "Is the sound loud or quiet?";
         m.row.answer = loud ? "loud" : "quiet";
       }},
      {"beep-count",
       [](Maker& m) {
         // 1-3 beeps of 0.25 s, 0.25 s apart, in a 2 s clip.
         const int64_t k = m.rng.between(1, 3);
         std::vector<double> x = silence(2.0);
         const double hz = m.rng.uniform(500, 1000), amp = m.rng.uniform(0.3, 0.6);
         const double start = m.rng.uniform(0.0, 2.0 - (0.5 * double(k) - 0.25));
         for (int64_t i = 0; i < k; ++i) add_sound(x, m.rng, false, hz, amp, start + 0.5 * double(i), 0.25);
         m.row.audio = m.audio(x);
         m.row.question = "How many beeps?";
         m.row.answer = k == 1 ? "one" : k == 2 ? "two" : "three";
       }},
      {"higher-tone",
       [](Maker& m) {
         // Two 0.4 s tones, one of 200-350 Hz and one of 1200-2000 Hz.
         const bool first = m.rng.below(2);
         const double lo = m.rng.uniform(200, 350), hi = m.rng.uniform(1200, 2000), amp = m.rng.uniform(0.3, 0.6);
         std::vector<double> x = silence(1.0);
         add_sound(x, m.rng, false, first ? hi : lo, amp, 0.05, 0.4);
         add_sound(x, m.rng, false, first ? lo : hi, amp, 0.55, 0.4);
         m.row.audio = m.audio(x);
         m.row.question = "Which tone is higher, the first or the second?";
         m.row.answer = first ? "first" : "second";
       }},
      {"colour+sound",
       [](Maker& m) {
         const int c = int(m.rng.below(std::size(kColours)));
         const bool noise = m.rng.below(2);
         m.row.image = m.image(c, int(m.rng.below(3)));
         m.row.audio = m.audio(m.beep_or_noise(noise, m.rng.uniform(0.3, 0.6)));
         m.row.question = "What colour is the shape, and is the sound a beep or noise?";
         m.row.answer = fmt::format("{}, {}", kColours[c].name, noise ? "noise" : "beep");
       }},
  };
  return f;
}

// The recipe's set (scripts/make-demo.sh, docs/demo.md): what the tiny model
// learns in a few minutes. arithmetic (0-9 + 0-9), shape, beep-count and higher-tone
// stay available; docs/demo.md says why the tiny model does not learn them.
const char* const kDefaultFamilies = "small-sum,next-number,colour,beep-or-noise,loud-or-quiet,colour+sound";

json chat_row(const Row& r) {
  // Image, then audio, then the text: the order `areno generate` builds.
  json content = json::array();
  if (!r.image.empty()) content.push_back({{"type", "image_url"}, {"image_url", {{"url", r.image}}}});
  if (!r.audio.empty()) content.push_back({{"type", "audio_url"}, {"audio_url", {{"url", r.audio}}}});
  content.push_back({{"type", "text"}, {"text", r.question}});
  return {{"family", r.family},
          {"messages", {{{"role", "user"}, {"content", content}}, {{"role", "assistant"}, {"content", r.answer}}}}};
}

// `n` rows of split `split`, the families taking turns; row i of a split draws
// from the stream splitmix64(seed, split, i) alone.
std::vector<Row> make_split(const fs::path& dir, const std::string& split, uint64_t seed, int64_t n,
                            const std::vector<std::string>& names) {
  std::map<std::string, Family> all(families().begin(), families().end());
  const uint64_t split_key = split == "train" ? 1 : 2;
  std::vector<Row> rows;
  for (int64_t i = 0; i < n; ++i) {
    Maker m{dir, fmt::format("{}-{:05d}", split, i),
            Rng{splitmix64(splitmix64(splitmix64(seed) ^ split_key) ^ uint64_t(i))}, {}};
    m.row.family = names[size_t(i) % names.size()];
    all.at(m.row.family)(m);
    rows.push_back(std::move(m.row));
  }
  return rows;
}

void write_text(const fs::path& file, const std::string& text) {
  std::ofstream out(file, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error(fmt::format("{}: write failed", file.string()));
}

constexpr const char* kUsage =
    "usage: areno-demo-data --out DIR [--seed N] [--train N] [--heldout N] [--families a,b,...]\n"
    "\n"
    "Writes the demo model's synthetic instruction set: DIR/train.jsonl, DIR/heldout.jsonl,\n"
    "DIR/heldout.tsv and DIR/media/. Deterministic from --seed (default 1); --train and\n"
    "--heldout rows (default 480, 120), the families taking turns.\n"
    "  --families LIST   comma-separated, default {}\n"
    "                    NAME:W gives a family W turns per round (all: arithmetic, small-sum,\n"
    "                    next-number, colour, shape, colour-shape, beep-or-noise, loud-or-quiet,\n"
    "                    beep-count, higher-tone, colour+sound)\n";

int64_t parse_count(const std::string& flag, const std::string& v) {
  size_t used = 0;
  int64_t n = -1;
  try {
    n = std::stoll(v, &used);
  } catch (const std::exception&) {
  }
  if (used != v.size() || n < 0) throw std::invalid_argument(fmt::format("{}: expected a count, got '{}'", flag, v));
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string out, family_list = kDefaultFamilies;
    uint64_t seed = 1;
    int64_t n_train = 480, n_heldout = 120;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "-h" || a == "--help") {
        fmt::print(kUsage, kDefaultFamilies);
        return 0;
      }
      if (i + 1 >= argc) throw std::invalid_argument(fmt::format("{}: needs a value (or unknown flag)", a));
      const std::string v = argv[++i];
      if (a == "--out") out = v;
      else if (a == "--seed") seed = uint64_t(parse_count(a, v));
      else if (a == "--train") n_train = parse_count(a, v);
      else if (a == "--heldout") n_heldout = parse_count(a, v);
      else if (a == "--families") family_list = v;
      else throw std::invalid_argument(fmt::format("unknown flag '{}'", a));
    }
    if (out.empty()) {
      fmt::print(stderr, "areno-demo-data: --out is required\n\n");
      fmt::print(stderr, kUsage, kDefaultFamilies);
      return 2;
    }
    // NAME or NAME:W (W turns in each round; default 1).
    std::vector<std::string> names;
    for (size_t p = 0; p <= family_list.size();) {
      const size_t q = std::min(family_list.find(',', p), family_list.size());
      std::string name = family_list.substr(p, q - p);
      int64_t weight = 1;
      if (const size_t colon = name.find(':'); colon != std::string::npos) {
        weight = parse_count("--families " + name, name.substr(colon + 1));
        name.resize(colon);
      }
      bool known = false;
      for (const auto& [n, f] : families()) known |= n == name;
      if (!known) throw std::invalid_argument(fmt::format("--families: unknown family '{}'", name));
      names.insert(names.end(), size_t(weight), name);
      p = q + 1;
    }
    if (names.empty()) throw std::invalid_argument("--families: every weight is 0");
    const fs::path dir(out);
    fs::create_directories(dir / "media");
    std::string tsv;
    for (const char* split : {"train", "heldout"}) {
      std::string jsonl;
      const std::vector<Row> rows = make_split(dir, split, seed, split[0] == 't' ? n_train : n_heldout, names);
      for (const Row& r : rows) {
        jsonl += chat_row(r).dump() + "\n";
        if (split[0] == 'h') tsv += fmt::format("{}\t{}\t{}\t{}\t{}\n", r.family, r.question, r.image, r.audio, r.answer);
      }
      write_text(dir / fmt::format("{}.jsonl", split), jsonl);
    }
    write_text(dir / "heldout.tsv", tsv);
    fmt::print(stderr, "areno-demo-data: {} train and {} held-out rows of {} in {}\n", n_train, n_heldout, family_list,
               dir.string());
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "areno-demo-data: {}\n", e.what());
    return 1;
  }
}
