#include "tests/tokenizer/fixtures.h"

#include <fstream>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace areno::test {

const tok::Tokenizer& phi4() {
  static const tok::Tokenizer t = phi4mm::make_tokenizer();
  return t;
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path + " (run tests from the repository root)");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> lines = [] {
    std::vector<std::string> out;
    std::istringstream in(read_text_file(std::string(kDataDir) + "/corpus.jsonl"));
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).get<std::string>());
    return out;
  }();
  return lines;
}

const std::vector<GoldenLine>& golden() {
  static const std::vector<GoldenLine> lines = [] {
    std::vector<GoldenLine> out;
    std::istringstream in(read_text_file(std::string(kDataDir) + "/golden.tsv"));
    for (std::string line; std::getline(in, line);) {
      GoldenLine g{};
      std::istringstream f(line);
      std::string h1, h2;
      f >> g.n_ord >> h1 >> g.n_hf >> h2;
      g.hash_ord = std::stoull(h1, nullptr, 16);
      g.hash_hf = std::stoull(h2, nullptr, 16);
      out.push_back(g);
    }
    return out;
  }();
  return lines;
}

uint64_t fnv1a64(const std::vector<tok::TokenId>& ids) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const tok::TokenId id : ids) {
    const auto u = static_cast<uint32_t>(id);
    for (int k = 0; k < 4; ++k) {
      h ^= (u >> (8 * k)) & 0xFF;
      h *= 0x100000001B3ull;
    }
  }
  return h;
}

}  // namespace areno::test
