#include <doctest/doctest.h>

#include <filesystem>
#include <random>
#include <thread>
#include <sstream>

#include <nlohmann/json.hpp>

#include "models/phi4mm/tokenizer/byte_level.h"
#include "models/phi4mm/tokenizer/utf8.h"
#include "tests/tokenizer/fixtures.h"

using areno::tok::TokenId;
using Ids = std::vector<TokenId>;
namespace fs = std::filesystem;
namespace phi4mm = areno::phi4mm;
namespace tok = areno::tok;
namespace test = areno::test;

namespace {

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("areno_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// The text encode() sees after added-token extraction, with swallowed
// whitespace removed: what decode(encode(x)) must give back.
std::string expected_roundtrip(const tok::Tokenizer& t, const std::string& x) {
  std::string out;
  for (const tok::Segment& s : t.split_added_tokens(x)) {
    out += s.token >= 0 ? t.added_token(s.token)->content : x.substr(s.begin, s.end - s.begin);
  }
  return out;
}

void check_corpus_against_golden(const tok::Tokenizer& t, bool check_ordinary) {
  const auto& lines = test::corpus();
  const auto& gold = test::golden();
  REQUIRE(lines.size() == gold.size());
  REQUIRE(lines.size() > 1000);
  size_t bytes = 0, bad_ord = 0, bad_full = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    bytes += lines[i].size();
    if (check_ordinary) {
      const Ids ord = t.encode_ordinary(lines[i]);
      if (ord.size() != gold[i].n_ord || test::fnv1a64(ord) != gold[i].hash_ord) {
        if (++bad_ord <= 5) MESSAGE("ordinary ids differ from tiktoken on corpus line " << i);
      }
    }
    const Ids full = t.encode(lines[i]);
    if (full.size() != gold[i].n_hf || test::fnv1a64(full) != gold[i].hash_hf) {
      if (++bad_full <= 5) MESSAGE("ids differ from HF tokenizers on corpus line " << i);
    }
  }
  CHECK(bytes >= 1'000'000);
  CHECK(bad_ord == 0);
  CHECK(bad_full == 0);
}

}  // namespace

TEST_CASE("tokenizer/spec 1.1 sanity vectors (o200k ids, no BOS)") {
  const auto& t = test::phi4();
  CHECK(t.encode("hello world") == Ids{24912, 2375});
  CHECK(t.encode(" 日本語とEnglish 12345!\n") == Ids{17428, 40909, 5330, 28881, 220, 7633, 2548, 4175});
  CHECK(t.encode("\x1c" "a") == Ids{216, 64});
  CHECK(t.encode("a\n\n") == Ids{64, 279});
  CHECK(t.encode("a\xEF\xBF\xBD" "b") == Ids{64, 3251, 65});  // lone surrogate after U+FFFD replacement
  CHECK(t.encode_ordinary("<|endoftext|>") == Ids{27, 91, 419, 1440, 919, 91, 29});
  CHECK(t.encode("<|endoftext|>") == Ids{199999});
  // Single bytes (spec 1.1): '!' -> 0, 'a' -> 64, '\n' -> 198, ' ' -> 220.
  CHECK(t.encode("!") == Ids{0});
  CHECK(t.encode("\n") == Ids{198});
  CHECK(t.encode(" ") == Ids{220});
}

TEST_CASE("tokenizer/added tokens: leftmost-longest, rstrip swallows whitespace, lstrip is off") {
  const auto& t = test::phi4();
  const Ids hi = t.encode_ordinary("Hi");
  Ids want = {phi4mm::kUser};
  want.insert(want.end(), hi.begin(), hi.end());
  CHECK(t.encode("<|user|> Hi") == want);
  CHECK(t.encode("<|user|>\n\t Hi") == want);
  CHECK(t.encode("<|end|>\n<|user|>") == Ids{phi4mm::kEnd, phi4mm::kUser});
  // 200010 / 200011 have rstrip=false: the "\n" survives as 198.
  CHECK(t.encode("<|endoftext10|>\n<|endoftext11|>\n") == Ids{200010, 198, 200011, 198});
  // Longest match: <|endoftext10|> is not <|endoftext|> + "10|>".
  CHECK(t.encode("<|endoftext10|>") == Ids{200010});
  // Whitespace before a token stays (lstrip=false): " " -> 220.
  CHECK(t.encode("a <|end|>") == Ids{64, 220, phi4mm::kEnd});
  // Near misses are plain text.
  CHECK(t.encode("<|endoftext1|>") == t.encode_ordinary("<|endoftext1|>"));
  CHECK(t.encode("<|image_1|>") == t.encode_ordinary("<|image_1|>"));
  // Unicode whitespace (U+3000) is swallowed too (Rust char::is_whitespace).
  CHECK(t.encode("<|tool|>\xE3\x80\x80x") == Ids{phi4mm::kTool, 87});
}

TEST_CASE("tokenizer/corpus (>= 1 MB) ids equal tiktoken o200k_base and HF tokenizers goldens") {
  check_corpus_against_golden(test::phi4(), /*check_ordinary=*/true);
}

TEST_CASE("tokenizer/full ids of sampled corpus lines equal the references") {
  const auto& t = test::phi4();
  std::istringstream in(test::read_text_file(std::string(test::kDataDir) + "/golden_sample.jsonl"));
  size_t n = 0;
  for (std::string line; std::getline(in, line); ++n) {
    const auto j = nlohmann::json::parse(line);
    const std::string& text = test::corpus().at(j["line"].get<size_t>());
    CHECK(t.encode_ordinary(text) == j["ord"].get<Ids>());
    CHECK(t.encode(text) == j["hf"].get<Ids>());
  }
  CHECK(n > 40);
}

TEST_CASE("tokenizer/written tokenizer.json (both merge formats) loads back to identical ids") {
  const fs::path dir = temp_dir("phi4tok");
  phi4mm::write_tokenizer_files(test::phi4(), dir);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"}) {
    CHECK(fs::exists(dir / f));
  }
  const tok::Tokenizer loaded = phi4mm::load_tokenizer(dir);
  CHECK(loaded.ignore_merges());
  CHECK(loaded.pattern() == tok::kO200kPattern);
  CHECK(loaded.vocab_size() == 200029);
  CHECK(loaded.padded_vocab_size() == phi4mm::kVocabSize);
  CHECK(loaded.model().num_merges() == loaded.model().num_tokens() - 256);
  check_corpus_against_golden(loaded, /*check_ordinary=*/true);

  // Older tokenizers format: merges as "a b" strings.
  const tok::Tokenizer old_format = tok::Tokenizer::from_hf_text(test::phi4().to_hf_json(true), "string merges");
  for (size_t i = 0; i < test::corpus().size(); i += 7) {
    CHECK(old_format.encode(test::corpus()[i]) == test::phi4().encode(test::corpus()[i]));
  }

  const auto config = nlohmann::json::parse(test::read_text_file((dir / "tokenizer_config.json").string()));
  CHECK(config["chat_template"] == phi4mm::kChatTemplateJinja);
  CHECK(config["eos_token"] == "<|endoftext|>");
  CHECK(config["model_max_length"] == 131072);
  CHECK(config["added_tokens_decoder"]["200020"]["rstrip"] == true);
  CHECK(config["added_tokens_decoder"]["200023"]["special"] == false);
  CHECK(config["added_tokens_decoder"]["200010"]["content"] == "<|endoftext10|>");
  fs::remove_all(dir);
}

TEST_CASE("tokenizer/decode(encode(x)) == x on every corpus line") {
  const auto& t = test::phi4();
  size_t bad = 0;
  for (const std::string& x : test::corpus()) {
    if (t.decode(t.encode_ordinary(x)) != x) ++bad;
    // With added tokens, whitespace after an rstrip token is consumed.
    if (t.decode(t.encode(x)) != expected_roundtrip(t, x)) ++bad;
  }
  CHECK(bad == 0);
  CHECK(expected_roundtrip(t, "<|user|>  Hi") == "<|user|>Hi");
}

TEST_CASE("tokenizer/incremental decode over random chunkings equals full decode") {
  const auto& t = test::phi4();
  std::mt19937 rng(1234);
  size_t checked = 0;
  for (size_t i = 0; i < test::corpus().size(); i += 3) {
    const Ids ids = t.encode(test::corpus()[i]);
    for (const bool skip : {false, true}) {
      tok::IncrementalDecoder dec(t, skip);
      std::string streamed;
      size_t pos = 0;
      while (pos < ids.size()) {
        const size_t n = std::min<size_t>(ids.size() - pos, 1 + rng() % 4);
        const std::string piece = dec.push(std::span<const TokenId>(ids.data() + pos, n));
        REQUIRE(tok::find_invalid_utf8(piece) == std::string::npos);
        streamed += piece;
        pos += n;
        CHECK(dec.pending_bytes() <= 3);
      }
      streamed += dec.flush();
      CHECK(streamed == t.decode(ids, skip));
      ++checked;
    }
  }
  CHECK(checked > 800);
}

TEST_CASE("tokenizer/incremental decode holds bytes of an incomplete character") {
  const auto& t = test::phi4();
  // "😀" is split over byte tokens when encoded byte by byte.
  const std::string smile = "\xF0\x9F\x98\x80";
  Ids ids;
  for (unsigned char b : smile) ids.push_back(*t.token_to_id(std::string(1, static_cast<char>(b))));
  tok::IncrementalDecoder dec(t);
  CHECK(dec.push(ids[0]).empty());
  CHECK(dec.push(ids[1]).empty());
  CHECK(dec.push(ids[2]).empty());
  CHECK(dec.push(ids[3]) == smile);
  // A truncated character at the end is flushed as U+FFFD.
  CHECK(dec.push(ids[0]).empty());
  CHECK(dec.flush() == "\xEF\xBF\xBD");
}

TEST_CASE("tokenizer/decode: skip_special_tokens, reserved and out-of-range ids") {
  const auto& t = test::phi4();
  const Ids ids = t.encode("<|user|>Hi<|end|><|tool_call|>[1]<|/tool_call|><|endoftext|>");
  CHECK(t.decode(ids) == "<|user|>Hi<|end|><|tool_call|>[1]<|/tool_call|><|endoftext|>");
  // special:false tool markers stay in the text (spec 1.8).
  CHECK(t.decode(ids, true) == "Hi<|tool_call|>[1]<|/tool_call|>");
  CHECK(t.decode(Ids{64, 199998, 200005, 200063, 65}) == "ab");
  CHECK_THROWS_WITH_AS(t.decode(Ids{200064}), doctest::Contains("ids must be in [0, 200064)"), std::runtime_error);
  CHECK_THROWS_AS(t.decode(Ids{-1}), std::runtime_error);
  CHECK(phi4mm::is_unused_id(199998));
  CHECK(phi4mm::is_unused_id(200029));
  CHECK_FALSE(phi4mm::is_unused_id(200010));
  CHECK_FALSE(phi4mm::is_unused_id(200028));
  CHECK_FALSE(phi4mm::is_unused_id(199997));
}

TEST_CASE("tokenizer/heap merge equals quadratic merge on long pieces") {
  const auto& bpe = test::phi4().model();
  std::mt19937 rng(7);
  const std::string alphabet[] = {"a", "b", "ab", " ", "the", "ing", "\xE6\x97\xA5", "1", "!"};
  for (int trial = 0; trial < 50; ++trial) {
    std::string piece;
    const size_t len = 1 + rng() % 600;
    while (piece.size() < len) piece += alphabet[rng() % std::size(alphabet)];
    Ids a, b;
    bpe.merge_quadratic(piece, a);
    bpe.merge_heap(piece, b);
    REQUIRE(a == b);
    std::string back;
    for (TokenId id : a) back += bpe.token_bytes(id);
    CHECK(back == piece);
  }
  // A 20000-space run goes through the heap path and matches HF's ids.
  const std::string spaces(20000, ' ');
  const Ids ids = test::phi4().encode(spaces + "x");
  CHECK(test::phi4().decode(ids) == spaces + "x");
}

TEST_CASE("tokenizer/invalid UTF-8 is rejected with the byte offset") {
  const auto& t = test::phi4();
  CHECK_THROWS_WITH_AS(t.encode("ab\xFF"), doctest::Contains("byte offset 2"), std::runtime_error);
  CHECK_THROWS_AS(t.encode("\xED\xA0\x80"), std::runtime_error);  // CESU surrogate
  CHECK_THROWS_AS(t.encode("\xC0\xAF"), std::runtime_error);      // overlong
  CHECK_THROWS_AS(t.encode_ordinary("\xE6\x97"), std::runtime_error);  // truncated
  CHECK(tok::replace_invalid_utf8("a\xFF" "b") == "a\xEF\xBF\xBD" "b");
  // Maximal subparts, as Python's errors="replace": E6 97 is one U+FFFD.
  CHECK(tok::replace_invalid_utf8("\xE6\x97" "a") == "\xEF\xBF\xBD" "a");
  CHECK(tok::replace_invalid_utf8("\xF0\x9F\x98") == "\xEF\xBF\xBD");
  CHECK(tok::replace_invalid_utf8("\xED\xA0\x80") == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  CHECK(tok::utf8_complete_prefix("ab\xF0\x9F") == 2);
  CHECK(tok::utf8_complete_prefix("ab\xF0\x9F\x98\x80") == 6);
  CHECK(tok::utf8_complete_prefix("ab\xFF") == 3);
}

TEST_CASE("tokenizer/byte-level alphabet (spec 1.5)") {
  CHECK(tok::byte_to_unicode(0x20) == 0x120);
  CHECK(tok::byte_to_unicode('\n') == 0x10A);
  CHECK(tok::byte_to_unicode('\t') == 0x109);
  CHECK(tok::byte_to_unicode(0x7F) == 0x121);
  CHECK(tok::byte_to_unicode(0xA0) == 0x142);
  CHECK(tok::byte_to_unicode(0xAD) == 0x143);
  CHECK(tok::byte_to_unicode('a') == 'a');
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  CHECK(tok::byte_level_to_bytes(tok::bytes_to_byte_level(all), "test") == all);
  CHECK_THROWS_AS(tok::byte_level_to_bytes("\xE6\x97\xA5", "test"), std::runtime_error);
}

TEST_CASE("tokenizer/load errors name the file and what was expected") {
  const fs::path empty = temp_dir("empty_model");
  CHECK_THROWS_WITH_AS(phi4mm::load_tokenizer(empty), doctest::Contains("has no tokenizer.json"), std::runtime_error);
  CHECK_THROWS_WITH_AS(phi4mm::load_tokenizer(empty / "missing"), doctest::Contains("does not exist"), std::runtime_error);
  fs::remove_all(empty);
  CHECK_THROWS_WITH_AS(phi4mm::make_tokenizer("/nonexistent/o200k.tiktoken"), doctest::Contains("not found"),
                       std::runtime_error);

  // A tiny but complete byte-level tokenizer.json, then broken variants.
  nlohmann::json j;
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[tok::bytes_to_byte_level(std::string(1, static_cast<char>(b)))] = b;
  vocab["he"] = 256;
  vocab["hel"] = 257;
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"h e", nlohmann::json::array({"he", "l"})}}};
  j["added_tokens"] = {{{"id", 258}, {"content", "<x>"}, {"special", true}, {"lstrip", true}}};
  const tok::Tokenizer tiny = tok::Tokenizer::from_hf_text(j.dump(), "tiny");
  CHECK(tiny.encode("hello") == Ids{257, 'l', 'o'});
  CHECK(tiny.encode("a  <x>b") == Ids{'a', 258, 'b'});  // lstrip swallows spaces before
  CHECK(tiny.decode(Ids{257, 258}, true) == "hel");

  auto broken = j;
  broken["normalizer"] = {{"type", "NFC"}};
  CHECK_THROWS_WITH_AS(tok::Tokenizer::from_hf_text(broken.dump(), "x"), doctest::Contains("normalizer 'NFC' is not supported"),
                       std::runtime_error);
  broken = j;
  broken["model"]["merges"].push_back("q zz");
  CHECK_THROWS_WITH_AS(tok::Tokenizer::from_hf_text(broken.dump(), "x"), doctest::Contains("merges[2] uses \"zz\""),
                       std::runtime_error);
  broken = j;
  broken["model"]["vocab"].erase("a");
  CHECK_THROWS_WITH_AS(tok::Tokenizer::from_hf_text(broken.dump(), "x"), doctest::Contains("no token for byte 0x61"),
                       std::runtime_error);
  broken = j;
  broken["model"]["type"] = "Unigram";
  CHECK_THROWS_AS(tok::Tokenizer::from_hf_text(broken.dump(), "x"), std::runtime_error);

  // The vocab and the merges are read by SAX into tables of their own: every
  // shape the DOM rejected is still rejected, by name.
  const auto refused = [](const nlohmann::json& v, const char* what) {
    CAPTURE(what);
    CHECK_THROWS_WITH_AS(tok::Tokenizer::from_hf_text(v.dump(), "x"), doctest::Contains(what), std::runtime_error);
  };
  broken = j;
  broken["model"]["vocab"]["zz"] = {{"id", 300}};
  refused(broken, "vocab entry \"zz\" must map to an integer id");
  broken = j;
  broken["model"]["vocab"]["zz"] = -3;
  refused(broken, "vocab entry \"zz\" has the negative id -3");
  broken = j;
  broken["model"]["vocab"]["zz"] = 99;
  refused(broken, "tokenizer.json 'x' model: vocab entry \"zz\": token id 99 is defined twice");
  broken = j;
  broken["model"]["vocab"] = nlohmann::json::array({1, 2});
  refused(broken, "'vocab' must be an object");
  broken = j;
  broken["model"]["merges"] = {{"h e", "x"}};
  refused(broken, "'merges' must be an array");
  broken = j;
  broken["model"]["merges"].push_back({{"a", "b"}});
  refused(broken, "merges[2] must be \"a b\" or [\"a\", \"b\"]");
  broken = j;
  broken["model"].erase("merges");
  refused(broken, "'merges' must be an array");
  // Tables elsewhere in the file (not root.model) are left alone.
  broken = j;
  broken["model"].erase("vocab");
  broken["other"] = {{"model", {{"vocab", j["model"]["vocab"]}}}};
  broken["model"]["extra"] = {{"vocab", j["model"]["vocab"]}};
  refused(broken, "'vocab' must be an object");
  // A vocab key written twice is an error (a DOM kept the last silently).
  std::string text = j.dump();
  const size_t at = text.find("\"hel\":257");
  REQUIRE(at != std::string::npos);
  text.insert(at, "\"hel\":300,");
  CHECK_THROWS_WITH_AS(tok::Tokenizer::from_hf_text(text, "x"), doctest::Contains("vocab entry \"hel\" appears twice"),
                       std::runtime_error);
  // A repeated "vocab" key keeps its last table, as a DOM does.
  text = j.dump();
  const size_t v = text.find("\"vocab\":");
  REQUIRE(v != std::string::npos);
  text.insert(v, "\"vocab\":{\"q\":5},");
  CHECK(tok::Tokenizer::from_hf_text(text, "x").encode("hello") == Ids{257, 'l', 'o'});
  // So does a repeated "model": the last one's tables, none of the first's.
  text = j.dump();
  const size_t m = text.find("\"model\":");
  REQUIRE(m != std::string::npos);
  text.insert(m, "\"model\":{\"type\":\"BPE\",\"vocab\":{\"q\":5},\"merges\":[]},");
  CHECK(tok::Tokenizer::from_hf_text(text, "x").encode("hello") == Ids{257, 'l', 'o'});
  text = j.dump();
  text.insert(text.size() - 1, ",\"model\":{\"type\":\"BPE\"}");
  CHECK_THROWS_WITH_AS(tok::Tokenizer::from_hf_text(text, "x"), doctest::Contains("'vocab' must be an object"),
                       std::runtime_error);
  // Not JSON, or nested 100000 deep: an error naming the file, no recursion.
  CHECK_THROWS_WITH_AS(tok::Tokenizer::from_hf_text(R"({"model": {"vocab": {"a": 1,}}})", "bad.json"),
                       doctest::Contains("'bad.json' is not valid JSON"), std::runtime_error);
  const std::string deep = "{\"x\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  CHECK_THROWS_WITH_AS(tok::Tokenizer::from_hf_text(deep, "deep.json"), doctest::Contains("'deep.json': pre_tokenizer is missing"),
                       std::runtime_error);
}

TEST_CASE("tokenizer/concurrent encode from several threads gives the same ids") {
  const auto& t = test::phi4();
  t.clear_cache();
  const auto& lines = test::corpus();
  std::vector<Ids> want;
  for (size_t i = 0; i < lines.size(); i += 5) want.push_back(t.encode(lines[i]));
  t.clear_cache();
  std::vector<size_t> bad(4, 0);
  std::vector<std::thread> threads;
  for (size_t k = 0; k < bad.size(); ++k) {
    threads.emplace_back([&, k] {
      for (size_t i = 0, j = 0; i < lines.size(); i += 5, ++j) {
        if (t.encode(lines[i]) != want[j]) ++bad[k];
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(bad == std::vector<size_t>(4, 0));
}
