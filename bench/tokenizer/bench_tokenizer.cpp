// Encode throughput of the Phi-4 tokenizer on the test corpus, one thread.
//
//   bench_tokenizer [CORPUS.jsonl] [RANK_FILE] [TOKENIZER_JSON]
//
// With TOKENIZER_JSON (the same vocabulary as tokenizer.json) it also prints
// "# areno tokenizer.json load <s>", the best of 3 loads.
// Prints one line per measurement: "areno <mode> <MB/s>". Modes:
//   ordinary_cold  encode_ordinary, piece cache cleared before each pass
//   ordinary_warm  encode_ordinary, cache kept across passes
//   full_warm      encode (added tokens matched), cache kept
// MB = 10^6 bytes of UTF-8 input. Best of 5 passes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"

namespace {

std::vector<std::string> read_corpus(const char* path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(std::string("cannot open corpus ") + path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line).get<std::string>());
  return lines;
}

template <class Fn>
double best_mb_per_s(size_t bytes, int passes, Fn&& pass) {
  double best = 0;
  for (int p = 0; p < passes; ++p) {
    const auto t0 = std::chrono::steady_clock::now();
    const size_t n = pass();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (n == 0) std::fprintf(stderr, "no tokens?\n");
    best = std::max(best, bytes / s / 1e6);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const char* corpus_path = argc > 1 ? argv[1] : "tests/data/tokenizer/corpus.jsonl";
    const char* rank_file = argc > 2 ? argv[2] : areno::phi4mm::kO200kRankFile;
    const auto lines = read_corpus(corpus_path);
    size_t bytes = 0;
    for (const auto& l : lines) bytes += l.size();

    const auto t0 = std::chrono::steady_clock::now();
    const auto tok = areno::phi4mm::make_tokenizer(rank_file);
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("# corpus %zu lines, %.3f MB; tokenizer build %.2f s\n", lines.size(), bytes / 1e6, load_s);
    if (argc > 3) {  // the same vocabulary as a Hugging Face tokenizer.json: best of 3 loads
      double best_s = 1e30;
      for (int k = 0; k < 3; ++k) {
        const auto t1 = std::chrono::steady_clock::now();
        const auto hf = areno::tok::Tokenizer::from_hf_file(argv[3]);
        best_s = std::min(best_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count());
      }
      std::printf("# areno tokenizer.json load %.3f s (best of 3)\n", best_s);
    }

    std::vector<areno::tok::TokenId> ids;
    const auto ordinary = [&] {
      size_t n = 0;
      for (const auto& l : lines) {
        ids.clear();
        tok.encode_ordinary_into(l, ids);
        n += ids.size();
      }
      return n;
    };
    const auto full = [&] {
      size_t n = 0;
      for (const auto& l : lines) n += tok.encode(l).size();
      return n;
    };
    const double cold = best_mb_per_s(bytes, 5, [&] { tok.clear_cache(); return ordinary(); });
    const double warm = best_mb_per_s(bytes, 5, ordinary);
    const double full_warm = best_mb_per_s(bytes, 5, full);
    std::printf("areno ordinary_cold %.2f\nareno ordinary_warm %.2f\nareno full_warm %.2f\n", cold, warm, full_warm);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
