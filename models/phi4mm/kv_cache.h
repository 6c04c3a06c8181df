#pragma once
// Paged KV cache: block bookkeeping and storage for the chunked prefill and
// decode steps of the one forward (forward_incremental in text.h; spec text.md
// sections 2.3-2.5 and 8).
//
// Storage: per layer one K and one V tensor [NB, BS, NKV, D] (NB blocks of BS
// token slots) in the model's dtype on the model's device. A sequence owns a
// block table: block i of the table holds positions [i*BS, (i+1)*BS), so
// position p lives in slot table[p / BS] * BS + p % BS of the flattened
// [NB*BS, NKV, D] view. Keys are stored after the rotary embedding (mscale
// included), as the reference does; the cache is therefore valid for one
// LongRoPE table only, and crossing original_max_position_embeddings means
// re-prefilling the whole sequence with the long table (needs_reprefill).
//
// Typical engine loop:
//   PagedKvCache cache(model, PagedKvCache::blocks_for_budget(model, bytes));
//   KvSequence s;
//   IncrementalBatch b;
//   b.add(s, chunk_ids, adapter, rope_table_for_length(model, prompt_len));  // ... more sequences
//   Tensor logits = forward_incremental(model, cache, b);  // [S, V]: last row of each chunk
//   ... if (needs_reprefill(model, s, s.length + 1)) { cache.release(s); re-prefill with long_table }
//   ... cache.release(s) when the request ends.
#include <array>
#include <cstdint>
#include <cstring>
#include <list>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "models/phi4mm/text.h"

namespace areno::phi4mm {

// A full block's content digest for prefix caching (the serving engine's SHA-256).
using BlockDigest = std::array<uint8_t, 32>;
// Its first 8 bytes: a uniform hash for a cryptographic digest (no one picks
// inputs to collide buckets without breaking SHA-256).
struct BlockDigestHash {
  size_t operator()(const BlockDigest& d) const noexcept {
    size_t h;
    std::memcpy(&h, d.data(), sizeof h);
    return h;
  }
};

// A pool of `num_blocks` block ids. A block is held by the sequences whose
// tables hold it (several, when a cached prefix is shared); allocation is
// all-or-nothing; freeing a block no one holds is an error (a double free
// would hand one block to two sequences).
//
// Prefix caching: a full block may be remembered under the digest of its
// content (the serving engine's chained SHA-256 of the tokens and media
// before and in it). Freed by its last holder it stays cached, evictable:
// allocate takes never-remembered blocks first, then evicts the least
// recently freed cached ones (forgetting their digest).
class BlockManager {
 public:
  explicit BlockManager(int64_t num_blocks);

  int64_t num_blocks() const { return int64_t(refs_.size()); }
  // Blocks an allocation may take: unused, or cached and held by no one.
  int64_t num_free() const { return int64_t(free_.size() + lru_.size()); }
  int64_t num_used() const { return num_blocks() - num_free(); }  // held
  int64_t num_cached() const { return int64_t(by_digest_.size()); }
  // Blocks handed out at least once: always blocks [0, num_touched()), since
  // a never-used block (the lowest) is taken only when no freed one is left.
  // On the CPU the pool's pages are committed as first written (lazy_zeros),
  // so this is the part of the pool that holds memory.
  int64_t num_touched() const { return touched_; }
  bool can_allocate(int64_t n) const { return n <= num_free(); }
  bool in_use(int64_t block) const;  // held by at least one sequence

  // `n` block ids, each held once; throws std::runtime_error (and allocates
  // nothing) when fewer are free.
  std::vector<int64_t> allocate(int64_t n);
  // Drops one hold of each block (distinct blocks, each held).
  void free(const std::vector<int64_t>& blocks);

  // The block remembered under `digest`, or -1.
  int64_t lookup(const BlockDigest& digest) const;
  // One more hold of a block that is held, or remembered and evictable (a
  // cached prefix taken back, or a forked sequence sharing a full block).
  void hold(int64_t block);
  int32_t holds(int64_t block) const { return refs_.at(size_t(block)); }
  bool remembered(int64_t block) const { return remembered_.at(size_t(block)) != 0; }
  // Remembers a held, full block under `digest`; a block already remembered,
  // or a digest another block has, is left as it is.
  void remember(int64_t block, const BlockDigest& digest);

  // The bookkeeping's invariants (every block exactly once: held, free, or
  // cached and evictable; the digest maps each other's inverse; the LRU
  // positions). "" when they hold, else the first that does not. For tests.
  std::string audit() const;

 private:
  std::vector<int64_t> free_;   // stack: the most recently freed block is reused first
  int64_t touched_ = 0;
  std::vector<int32_t> refs_;
  // Fixed-size records, allocated once (the map's buckets reserved for every
  // block): remembering and evicting allocate nothing but map nodes, so the
  // bookkeeping stays a small fixed cost per block.
  std::vector<BlockDigest> digest_;
  std::vector<uint8_t> remembered_;  // digest_[b] is valid
  std::unordered_map<BlockDigest, int64_t, BlockDigestHash> by_digest_;
  std::list<int64_t> lru_;           // remembered, held by no one: least recently freed first
  std::vector<std::list<int64_t>::iterator> lru_at_;
};

// One sequence's state in the cache. The caller owns it; the incremental
// forward appends to it (blocks, length) and PagedKvCache::release empties it.
struct KvSequence {
  std::vector<int64_t> blocks;  // block table
  int64_t length = 0;           // tokens whose K/V are cached (= position of the next token)
  // The LongRoPE table of the cached keys. `automatic` before the first write
  // means: decided by the first chunk's last position; it is then fixed to
  // short_table or long_table until release.
  RopeTable rope = RopeTable::automatic;
};

// The explicit table a sequence of `total_length` tokens uses (HF rule), for
// choosing the table at admission from the prompt length.
RopeTable rope_table_for_length(const Phi4MMForCausalLM& m, int64_t total_length);

// True when the sequence's cached keys were rotated with the short table and
// growing it to `new_length` tokens crosses original_max_position_embeddings:
// the caller must release it and re-prefill all its tokens with the long table.
bool needs_reprefill(const Phi4MMForCausalLM& m, const KvSequence& s, int64_t new_length);

class PagedKvCache {
 public:
  // Allocates K and V storage for every layer of `m` (its dtype and device).
  PagedKvCache(const Phi4MMForCausalLM& m, int64_t num_blocks, int64_t block_size = 16);

  // Bytes of K+V over all layers for one block.
  static size_t bytes_per_block(const TextConfig& t, int64_t block_size, DType dtype);
  // How many blocks fit in `bytes` (throws if not even one does).
  static int64_t blocks_for_budget(const Phi4MMForCausalLM& m, size_t bytes, int64_t block_size = 16);

  int64_t block_size() const { return block_size_; }
  int64_t num_layers() const { return int64_t(k_.size()); }
  int64_t num_blocks() const { return manager_.num_blocks(); }
  const BlockManager& manager() const { return manager_; }
  // Bytes of the pool written at least once (its blocks [0, num_touched())):
  // the part of the lazily committed pool that is resident.
  int64_t touched_bytes() const { return manager_.num_touched() * block_bytes_; }
  // [NB, BS, NKV, D]
  const Tensor& keys(int64_t layer) const { return k_.at(size_t(layer)); }
  const Tensor& values(int64_t layer) const { return v_.at(size_t(layer)); }

  // Blocks needed to hold `length` tokens.
  int64_t blocks_for(int64_t length) const { return (length + block_size_ - 1) / block_size_; }
  // Whether `s` can grow to `new_length` tokens with the blocks now free.
  bool can_grow(const KvSequence& s, int64_t new_length) const;
  // Allocates the blocks `s` lacks for `new_length` tokens (all or nothing;
  // throws std::runtime_error when the pool is exhausted). Does not change s.length.
  void reserve(KvSequence& s, int64_t new_length);
  // Returns every block of `s` to the pool and resets it (length 0, table automatic).
  void release(KvSequence& s);
  // Shortens `s` to `length` tokens (at most its length; at least 1) and
  // returns the blocks past blocks_for(length): speculative decoding keeps
  // the K/V of the accepted draft tokens only. The kept partial last block,
  // which later writes fill, must be held by `s` alone and not remembered
  // (std::logic_error otherwise: a shared or cached block would change).
  void truncate(KvSequence& s, int64_t length);

  // Prefix caching. attach_prefix gives the empty `s` the longest run of
  // cached blocks whose digests are digests[0..] (block i's digest covers
  // positions [0, (i+1) * block_size)), held once more each, and sets its
  // length and table (`table`: the digests were made for it). Returns the
  // blocks attached.
  int64_t attach_prefix(KvSequence& s, const std::vector<BlockDigest>& digests, RopeTable table);
  // The blocks attach_prefix(digests) would attach, and in `idle` how many
  // of them no one holds (attached, they stop counting as free).
  int64_t cached_prefix(const std::vector<BlockDigest>& digests, int64_t& idle) const;
  // Remembers block i of `s` (full: its length covers it) under `digest`.
  void remember(const KvSequence& s, int64_t i, const BlockDigest& digest);

  // Makes `dst` (empty) a fork of `src` (n > 1 samples share one prompt
  // prefill): src's full blocks are shared, held once more each (a full block
  // is never written again), and its partial last block, if any, is copied
  // into a new block; same length and table. Needs fork_blocks(src) free
  // blocks; throws std::runtime_error when the pool lacks them.
  void fork_sequence(const KvSequence& src, KvSequence& dst);
  int64_t fork_blocks(const KvSequence& src) const { return src.length % block_size_ ? 1 : 0; }

  // Slot ids of positions [start, start + n) of a sequence with block table `blocks`.
  std::vector<int64_t> slots(const std::vector<int64_t>& blocks, int64_t start, int64_t n) const;
  // Writes k/v [N, NKV, D] into the slots of positions [start, start + N).
  void write(int64_t layer, const std::vector<int64_t>& blocks, int64_t start, const Tensor& k,
             const Tensor& v);
  // K/V of the slots `slot_ids` ([L] i64 on the cache's device) -> [L, NKV, D] each.
  std::pair<Tensor, Tensor> gather(int64_t layer, const Tensor& slot_ids) const;

 private:
  int64_t block_size_;
  int64_t block_bytes_;  // bytes_per_block for this model
  BlockManager manager_;
  std::vector<Tensor> k_, v_;
};

}  // namespace areno::phi4mm
