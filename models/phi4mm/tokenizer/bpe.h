// Byte-pair encoding over raw bytes (spec tokens-api.md 1.6).
//
// Tokens are stored as raw byte strings (the byte-level alphabet is only a
// file format). A merge is a pair of token ids (left, right) with a rank; the
// merge loop repeatedly merges the adjacent pair of lowest rank, leftmost on
// ties, exactly like tiktoken's byte_pair_merge and HF tokenizers' BPE.
//
// tiktoken rank files define the pair rank as the rank of the merged token;
// HF tokenizer.json files give it as the position in the `merges` list.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace areno::tok {

using TokenId = int32_t;

uint64_t hash_bytes(std::string_view s);

// Open-addressing map from byte strings to token ids. Keys live in one arena.
class ByteStringMap {
 public:
  void reserve(size_t n);
  // Returns false (and keeps the old value) when the key already exists.
  bool insert(std::string_view key, TokenId value);
  // -1 when absent.
  TokenId find(std::string_view key) const {
    if (slots_.empty()) return -1;
    const uint64_t h = hash_bytes(key);
    size_t i = h & mask_;
    const uint32_t tag = static_cast<uint32_t>(h >> 32);
    for (;;) {
      const Slot& s = slots_[i];
      if (s.value < 0) return -1;
      if (s.tag == tag && s.len == key.size() &&
          (key.empty() || __builtin_memcmp(arena_.data() + s.offset, key.data(), key.size()) == 0)) {
        return s.value;
      }
      i = (i + 1) & mask_;
    }
  }
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint32_t tag = 0;
    uint32_t offset = 0;
    uint32_t len = 0;
    TokenId value = -1;
  };
  void grow();
  std::vector<Slot> slots_;
  std::string arena_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

// Open-addressing map from (left id, right id) to (rank, merged id).
class PairMap {
 public:
  struct Merge {
    uint32_t rank;
    TokenId merged;
  };
  void reserve(size_t n);
  bool insert(TokenId left, TokenId right, Merge m);
  // nullptr when the pair has no merge.
  const Merge* find(TokenId left, TokenId right) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = pack(left, right);
    size_t i = mix(key) & mask_;
    for (;;) {
      const Slot& s = slots_[i];
      if (s.merge.merged < 0) return nullptr;
      if (s.key == key) return &s.merge;
      i = (i + 1) & mask_;
    }
  }
  size_t size() const { return size_; }

 private:
  static uint64_t pack(TokenId l, TokenId r) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32) | static_cast<uint32_t>(r);
  }
  static uint64_t mix(uint64_t k) {
    k ^= k >> 31;
    k *= 0x9E3779B97F4A7C15ull;
    return k ^ (k >> 29);
  }
  struct Slot {
    uint64_t key = 0;
    Merge merge{0, -1};
  };
  void grow();
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

// The BPE model: token byte strings, byte -> single-byte token, pair merges.
class BpeModel {
 public:
  // Pieces longer than this (in bytes) use the heap-based merge, whose cost
  // grows as n log n instead of n^2. Exposed for tests.
  static constexpr size_t kHeapMergeThreshold = 256;

  // Registers token `id` with raw bytes `bytes`. Throws on duplicates.
  void add_token(TokenId id, std::string_view bytes);
  // Adds a merge (left, right) -> merged with `rank`; returns false when the
  // pair already had a merge (the earlier one is kept, as in HF tokenizers).
  bool add_merge(TokenId left, TokenId right, TokenId merged, uint32_t rank) {
    return pairs_.insert(left, right, {rank, merged});
  }
  // tiktoken semantics: every split of a token into two tokens is a merge
  // whose rank is the merged token's id (rank). Call after all add_token.
  void derive_merges_from_ranks();
  // Checks that all 256 single bytes are tokens. Throws otherwise.
  void finalize(std::string_view source);

  TokenId token_id(std::string_view bytes) const { return by_bytes_.find(bytes); }
  std::string_view token_bytes(TokenId id) const;
  bool has_token(TokenId id) const;
  TokenId max_id() const { return static_cast<TokenId>(offsets_.size()) - 1; }
  size_t num_tokens() const { return by_bytes_.size(); }
  size_t num_merges() const { return pairs_.size(); }
  const PairMap& pairs() const { return pairs_; }

  // Appends the ids of one pre-tokenized piece. `ignore_merges`: a piece that
  // is itself a token is emitted whole (tiktoken always does this).
  void encode_piece(std::string_view piece, bool ignore_merges, std::vector<TokenId>& out) const;
  // Merge loops (public for tests comparing the two).
  void merge_quadratic(std::string_view piece, std::vector<TokenId>& out) const;
  void merge_heap(std::string_view piece, std::vector<TokenId>& out) const;

 private:
  ByteStringMap by_bytes_;
  std::string arena_;
  std::vector<uint64_t> offsets_;  // id -> (offset << 24 | len), ~0 when absent
  TokenId byte_ids_[256];
  PairMap pairs_;
};

}  // namespace areno::tok
