#include "models/phi4mm/tokenizer/bpe.h"

#include <cstring>
#include <queue>
#include <stdexcept>

#include <fmt/format.h>

namespace areno::tok {

uint64_t hash_bytes(std::string_view s) {
  // Short keys dominate (BPE pieces average ~4 bytes): read 8-byte words and
  // mix with a multiply-xorshift; quality is ample for an open-addressing map.
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t h = 0xCBF29CE484222325ull ^ (s.size() * kMul);
  const char* p = s.data();
  size_t n = s.size();
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * kMul;
    h ^= h >> 32;
    p += 8;
    n -= 8;
  }
  if (n > 0) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w) * kMul;
    h ^= h >> 32;
  }
  h *= kMul;
  return h ^ (h >> 29);
}

// ---- ByteStringMap ----------------------------------------------------------

void ByteStringMap::reserve(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  if (cap <= slots_.size()) return;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  for (const Slot& s : old) {
    if (s.value < 0) continue;
    const std::string_view key(arena_.data() + s.offset, s.len);
    size_t i = hash_bytes(key) & mask_;
    while (slots_[i].value >= 0) i = (i + 1) & mask_;
    slots_[i] = s;
  }
}

void ByteStringMap::grow() { reserve(std::max<size_t>(16, slots_.size())); }

bool ByteStringMap::insert(std::string_view key, TokenId value) {
  if (value < 0) throw std::invalid_argument("ByteStringMap: negative value");
  if ((size_ + 1) * 2 > slots_.size()) grow();
  const uint64_t h = hash_bytes(key);
  const uint32_t tag = static_cast<uint32_t>(h >> 32);
  size_t i = h & mask_;
  for (;;) {
    Slot& s = slots_[i];
    if (s.value < 0) {
      s.tag = tag;
      s.offset = static_cast<uint32_t>(arena_.size());
      s.len = static_cast<uint32_t>(key.size());
      s.value = value;
      arena_.append(key);
      ++size_;
      return true;
    }
    if (s.tag == tag && s.len == key.size() &&
        std::memcmp(arena_.data() + s.offset, key.data(), key.size()) == 0) {
      return false;
    }
    i = (i + 1) & mask_;
  }
}

// ---- PairMap ----------------------------------------------------------------

void PairMap::reserve(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  if (cap <= slots_.size()) return;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  for (const Slot& s : old) {
    if (s.merge.merged < 0) continue;
    size_t i = mix(s.key) & mask_;
    while (slots_[i].merge.merged >= 0) i = (i + 1) & mask_;
    slots_[i] = s;
  }
}

void PairMap::grow() { reserve(std::max<size_t>(16, slots_.size())); }

bool PairMap::insert(TokenId left, TokenId right, Merge m) {
  if ((size_ + 1) * 2 > slots_.size()) grow();
  const uint64_t key = pack(left, right);
  size_t i = mix(key) & mask_;
  for (;;) {
    Slot& s = slots_[i];
    if (s.merge.merged < 0) {
      s.key = key;
      s.merge = m;
      ++size_;
      return true;
    }
    if (s.key == key) return false;
    i = (i + 1) & mask_;
  }
}

// ---- BpeModel ---------------------------------------------------------------

void BpeModel::add_token(TokenId id, std::string_view bytes) {
  if (id < 0) throw std::runtime_error(fmt::format("token id {} is negative", id));
  if (bytes.empty()) throw std::runtime_error(fmt::format("token id {} has empty content", id));
  if (!by_bytes_.insert(bytes, id)) {
    throw std::runtime_error(fmt::format("token id {} duplicates the bytes of token id {}", id,
                                         by_bytes_.find(bytes)));
  }
  if (static_cast<size_t>(id) >= offsets_.size()) offsets_.resize(static_cast<size_t>(id) + 1, ~0ull);
  if (offsets_[id] != ~0ull) throw std::runtime_error(fmt::format("token id {} is defined twice", id));
  offsets_[id] = (static_cast<uint64_t>(arena_.size()) << 24) | bytes.size();
  arena_.append(bytes);
}

bool BpeModel::has_token(TokenId id) const {
  return id >= 0 && static_cast<size_t>(id) < offsets_.size() && offsets_[id] != ~0ull;
}

std::string_view BpeModel::token_bytes(TokenId id) const {
  if (!has_token(id)) return {};
  const uint64_t o = offsets_[id];
  return std::string_view(arena_.data() + (o >> 24), o & 0xFFFFFF);
}

void BpeModel::derive_merges_from_ranks() {
  // o200k: ~446k splits for 200k tokens; a 2^20-slot table keeps the load < 0.5.
  pairs_.reserve(num_tokens() * 5 / 2);
  for (TokenId id = 0; id <= max_id(); ++id) {
    const std::string_view t = token_bytes(id);
    for (size_t k = 1; k < t.size(); ++k) {
      const TokenId l = token_id(t.substr(0, k));
      const TokenId r = token_id(t.substr(k));
      if (l >= 0 && r >= 0) add_merge(l, r, id, static_cast<uint32_t>(id));
    }
  }
}

void BpeModel::finalize(std::string_view source) {
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    byte_ids_[b] = token_id(std::string_view(&c, 1));
    if (byte_ids_[b] < 0) {
      throw std::runtime_error(fmt::format(
          "{}: the vocabulary has no token for byte 0x{:02X}; a byte-level BPE needs all 256 "
          "single-byte tokens", source, b));
    }
  }
}

void BpeModel::encode_piece(std::string_view piece, bool ignore_merges,
                            std::vector<TokenId>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_ids_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (ignore_merges) {
    const TokenId whole = token_id(piece);
    if (whole >= 0) {
      out.push_back(whole);
      return;
    }
  }
  if (piece.size() > kHeapMergeThreshold) {
    merge_heap(piece, out);
  } else {
    merge_quadratic(piece, out);
  }
}

void BpeModel::merge_quadratic(std::string_view piece, std::vector<TokenId>& out) const {
  // parts[i]: the token id of the i-th symbol and the rank of merging it with
  // its right neighbour (kNone when that pair has no merge).
  constexpr uint32_t kNone = UINT32_MAX;
  struct Part {
    TokenId id;
    uint32_t rank;
    TokenId merged;
  };
  thread_local std::vector<Part> parts;
  parts.clear();
  for (unsigned char b : piece) parts.push_back({byte_ids_[b], kNone, -1});
  const auto set_rank = [&](size_t i) {
    if (i + 1 >= parts.size()) {
      parts[i].rank = kNone;
      return;
    }
    const PairMap::Merge* m = pairs_.find(parts[i].id, parts[i + 1].id);
    parts[i].rank = m ? m->rank : kNone;
    parts[i].merged = m ? m->merged : -1;
  };
  for (size_t i = 0; i < parts.size(); ++i) set_rank(i);
  for (;;) {
    uint32_t best = kNone;
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (parts[i].rank < best) {
        best = parts[i].rank;
        at = i;
      }
    }
    if (best == kNone) break;
    parts[at].id = parts[at].merged;
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    set_rank(at);
    if (at > 0) set_rank(at - 1);
  }
  for (const Part& p : parts) out.push_back(p.id);
}

void BpeModel::merge_heap(std::string_view piece, std::vector<TokenId>& out) const {
  // Doubly linked symbols plus a min-heap of candidate merges keyed by
  // (rank, position); stale entries are skipped when popped (as HF does).
  const size_t n = piece.size();
  std::vector<TokenId> id(n);
  std::vector<int64_t> prev(n), next(n);
  std::vector<uint32_t> len(n, 1);  // symbol length in bytes; 0 = merged away
  for (size_t i = 0; i < n; ++i) {
    id[i] = byte_ids_[static_cast<unsigned char>(piece[i])];
    prev[i] = static_cast<int64_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int64_t>(i + 1) : -1;
  }
  struct Cand {
    uint32_t rank;
    uint32_t pos;  // byte position of the left symbol
    TokenId left, right, merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  const auto push = [&](int64_t i) {
    if (i < 0 || next[i] < 0) return;
    const PairMap::Merge* m = pairs_.find(id[i], id[next[i]]);
    if (m) heap.push({m->rank, static_cast<uint32_t>(i), id[i], id[next[i]], m->merged});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int64_t>(i));
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const int64_t i = c.pos;
    // Stale if the left symbol was merged away or either side changed.
    if (len[i] == 0 || next[i] < 0 || id[i] != c.left || id[next[i]] != c.right) continue;
    const int64_t j = next[i];
    id[i] = c.merged;
    len[i] += len[j];
    len[j] = 0;
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = i;
    push(prev[i]);
    push(i);
  }
  for (int64_t i = 0; i >= 0; i = next[i]) out.push_back(id[i]);
}

}  // namespace areno::tok
