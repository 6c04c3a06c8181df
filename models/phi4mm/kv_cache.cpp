#include "models/phi4mm/kv_cache.h"

#include <algorithm>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include "tensor/autograd.h"

namespace areno::phi4mm {


// ---- BlockManager ----

BlockManager::BlockManager(int64_t num_blocks) {
  if (num_blocks <= 0)
    throw std::invalid_argument(fmt::format("BlockManager: num_blocks must be positive, got {}", num_blocks));
  refs_.assign(size_t(num_blocks), 0);
  digest_.assign(size_t(num_blocks), BlockDigest{});
  remembered_.assign(size_t(num_blocks), 0);
  by_digest_.reserve(size_t(num_blocks));
  lru_at_.assign(size_t(num_blocks), lru_.end());
  // Stack with block 0 on top, so a fresh pool hands out 0, 1, 2, ...
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

bool BlockManager::in_use(int64_t block) const {
  return block >= 0 && block < num_blocks() && refs_[size_t(block)] > 0;
}

std::vector<int64_t> BlockManager::allocate(int64_t n) {
  if (n < 0) throw std::invalid_argument(fmt::format("BlockManager: cannot allocate {} blocks", n));
  if (!can_allocate(n))
    throw std::runtime_error(fmt::format("KV cache out of blocks: {} needed, {} free of {}", n, num_free(),
                                         num_blocks()));
  std::vector<int64_t> out;
  out.reserve(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    int64_t b;
    if (!free_.empty()) {
      b = free_.back();
      free_.pop_back();
      touched_ = std::max(touched_, b + 1);
    } else {  // the least recently freed cached block: forgotten
      b = lru_.front();
      lru_.pop_front();
      lru_at_[size_t(b)] = lru_.end();
      by_digest_.erase(digest_[size_t(b)]);
      remembered_[size_t(b)] = 0;
    }
    refs_[size_t(b)] = 1;
    out.push_back(b);
  }
  return out;
}

void BlockManager::free(const std::vector<int64_t>& blocks) {
  // Validate everything first: a bad id must not leave the pool half-updated.
  std::set<int64_t> seen;
  for (int64_t b : blocks)
    if (!in_use(b) || !seen.insert(b).second)
      throw std::invalid_argument(fmt::format("BlockManager: block {} is not in use (double free or foreign id)", b));
  for (int64_t b : blocks) {
    if (--refs_[size_t(b)] > 0) continue;
    if (!remembered_[size_t(b)]) free_.push_back(b);
    else lru_at_[size_t(b)] = lru_.insert(lru_.end(), b);
  }
}

int64_t BlockManager::lookup(const BlockDigest& digest) const {
  const auto it = by_digest_.find(digest);
  return it == by_digest_.end() ? -1 : it->second;
}

void BlockManager::hold(int64_t block) {
  if (block < 0 || block >= num_blocks() || (refs_[size_t(block)] == 0 && !remembered_[size_t(block)]))
    throw std::invalid_argument(fmt::format("BlockManager: block {} is neither held nor cached", block));
  if (refs_[size_t(block)] == 0) {
    lru_.erase(lru_at_[size_t(block)]);
    lru_at_[size_t(block)] = lru_.end();
  }
  ++refs_[size_t(block)];
}

void BlockManager::remember(int64_t block, const BlockDigest& digest) {
  if (!in_use(block)) throw std::invalid_argument(fmt::format("BlockManager: block {} is not in use", block));
  if (remembered_[size_t(block)] || by_digest_.count(digest)) return;
  digest_[size_t(block)] = digest;
  remembered_[size_t(block)] = 1;
  by_digest_.emplace(digest, block);
}

std::string BlockManager::audit() const {
  const int64_t n = num_blocks();
  std::vector<int> seen(size_t(n), 0);
  for (int64_t b : free_) {
    if (b < 0 || b >= n) return fmt::format("free list holds id {}", b);
    if (refs_[size_t(b)] != 0 || remembered_[size_t(b)]) return fmt::format("free block {} is held or remembered", b);
    seen[size_t(b)]++;
  }
  for (int64_t b : lru_) {
    if (b < 0 || b >= n) return fmt::format("LRU holds id {}", b);
    if (refs_[size_t(b)] != 0 || !remembered_[size_t(b)])
      return fmt::format("evictable block {} is held or not remembered", b);
    if (lru_at_[size_t(b)] == lru_.end() || *lru_at_[size_t(b)] != b) return fmt::format("block {}: LRU position", b);
    seen[size_t(b)]++;
  }
  for (int64_t b = 0; b < n; ++b) {
    if (refs_[size_t(b)] < 0) return fmt::format("block {} has {} holds", b, refs_[size_t(b)]);
    if (refs_[size_t(b)] > 0) {
      seen[size_t(b)]++;
      if (lru_at_[size_t(b)] != lru_.end()) return fmt::format("held block {} is in the LRU", b);
    }
    if (seen[size_t(b)] != 1) return fmt::format("block {} is accounted {} times", b, seen[size_t(b)]);
    if (remembered_[size_t(b)]) {
      const auto it = by_digest_.find(digest_[size_t(b)]);
      if (it == by_digest_.end() || it->second != b) return fmt::format("block {}: digest not mapped back", b);
    }
  }
  for (const auto& [d, b] : by_digest_)
    if (b < 0 || b >= n || !remembered_[size_t(b)] || digest_[size_t(b)] != d)
      return fmt::format("digest of block {} mapped wrongly", b);
  return {};
}

// ---- LongRoPE table choice ----

RopeTable rope_table_for_length(const Phi4MMForCausalLM& m, int64_t total_length) {
  return m.uses_long_table(total_length - 1, RopeTable::automatic) ? RopeTable::long_table : RopeTable::short_table;
}

bool needs_reprefill(const Phi4MMForCausalLM& m, const KvSequence& s, int64_t new_length) {
  return s.length > 0 && s.rope == RopeTable::short_table &&
         m.uses_long_table(new_length - 1, RopeTable::automatic);
}

// ---- PagedKvCache ----

PagedKvCache::PagedKvCache(const Phi4MMForCausalLM& m, int64_t num_blocks, int64_t block_size)
    : block_size_(block_size), block_bytes_(0), manager_(num_blocks) {
  if (block_size <= 0)
    throw std::invalid_argument(fmt::format("PagedKvCache: block_size must be positive, got {}", block_size));
  block_bytes_ = int64_t(bytes_per_block(m.config().text, block_size, m.dtype()));
  const TextConfig& t = m.config().text;
  const Shape shape{num_blocks, block_size, t.num_key_value_heads, t.head_dim()};
  const TensorOptions o(m.dtype(), m.device());
  for (int64_t l = 0; l < t.num_hidden_layers; ++l) {
    // Zeros, so that a bug reading an unwritten slot gives finite numbers the
    // tests can catch, not NaNs from garbage; lazily (on the CPU the pool's
    // pages are committed as blocks are first written, not all at start).
    k_.push_back(lazy_zeros(shape, o));
    v_.push_back(lazy_zeros(shape, o));
  }
}

size_t PagedKvCache::bytes_per_block(const TextConfig& t, int64_t block_size, DType dtype) {
  return size_t(2 * t.num_hidden_layers * block_size * t.num_key_value_heads * t.head_dim()) * dtype_size(dtype);
}

int64_t PagedKvCache::blocks_for_budget(const Phi4MMForCausalLM& m, size_t bytes, int64_t block_size) {
  if (block_size <= 0)
    throw std::invalid_argument(fmt::format("PagedKvCache: block_size must be positive, got {}", block_size));
  const size_t per = bytes_per_block(m.config().text, block_size, m.dtype());
  if (bytes < per)
    throw std::invalid_argument(fmt::format(
        "KV cache budget of {} bytes holds no block ({} bytes per block of {} tokens)", bytes, per, block_size));
  return int64_t(bytes / per);
}

bool PagedKvCache::can_grow(const KvSequence& s, int64_t new_length) const {
  return manager_.can_allocate(std::max<int64_t>(0, blocks_for(new_length) - int64_t(s.blocks.size())));
}

void PagedKvCache::reserve(KvSequence& s, int64_t new_length) {
  const int64_t missing = blocks_for(new_length) - int64_t(s.blocks.size());
  if (missing <= 0) return;
  std::vector<int64_t> got = manager_.allocate(missing);
  s.blocks.insert(s.blocks.end(), got.begin(), got.end());
}

void PagedKvCache::release(KvSequence& s) {
  manager_.free(s.blocks);
  s.blocks.clear();
  s.length = 0;
  s.rope = RopeTable::automatic;
}

void PagedKvCache::truncate(KvSequence& s, int64_t length) {
  if (length < 1 || length > s.length)
    throw std::invalid_argument(
        fmt::format("PagedKvCache::truncate: {} tokens for a sequence of {}", length, s.length));
  const int64_t keep = blocks_for(length);
  if (length % block_size_ != 0) {
    const int64_t b = s.blocks[size_t(keep - 1)];
    if (manager_.holds(b) != 1 || manager_.remembered(b))
      throw std::logic_error(fmt::format("PagedKvCache::truncate: block {} (shared or cached) would change", b));
  }
  if (keep < int64_t(s.blocks.size())) {
    manager_.free(std::vector<int64_t>(s.blocks.begin() + keep, s.blocks.end()));
    s.blocks.resize(size_t(keep));
  }
  s.length = length;
}

int64_t PagedKvCache::attach_prefix(KvSequence& s, const std::vector<BlockDigest>& digests, RopeTable table) {
  if (s.length != 0 || !s.blocks.empty())
    throw std::invalid_argument("PagedKvCache::attach_prefix: the sequence must be empty");
  for (const BlockDigest& d : digests) {
    const int64_t b = manager_.lookup(d);
    if (b < 0) break;
    manager_.hold(b);
    s.blocks.push_back(b);
  }
  if (!s.blocks.empty()) {
    s.length = int64_t(s.blocks.size()) * block_size_;
    s.rope = table;
  }
  return int64_t(s.blocks.size());
}

int64_t PagedKvCache::cached_prefix(const std::vector<BlockDigest>& digests, int64_t& idle) const {
  int64_t cached = 0;
  idle = 0;
  for (const BlockDigest& d : digests) {
    const int64_t b = manager_.lookup(d);
    if (b < 0) break;
    ++cached;
    idle += manager_.holds(b) == 0;
  }
  return cached;
}

void PagedKvCache::remember(const KvSequence& s, int64_t i, const BlockDigest& digest) {
  if (i < 0 || (i + 1) * block_size_ > s.length)
    throw std::invalid_argument(fmt::format("PagedKvCache::remember: block {} of a sequence of {} tokens is not full",
                                            i, s.length));
  manager_.remember(s.blocks[size_t(i)], digest);
}

std::vector<int64_t> PagedKvCache::slots(const std::vector<int64_t>& blocks, int64_t start, int64_t n) const {
  if (blocks_for(start + n) > int64_t(blocks.size()))
    throw std::invalid_argument(fmt::format("PagedKvCache: a table of {} blocks cannot hold {} tokens",
                                            blocks.size(), start + n));
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = start + i;
    out[size_t(i)] = blocks[size_t(p / block_size_)] * block_size_ + p % block_size_;
  }
  return out;
}

void PagedKvCache::write(int64_t layer, const std::vector<int64_t>& blocks, int64_t start, const Tensor& k,
                         const Tensor& v) {
  const int64_t n = k.size(0);
  if (blocks_for(start + n) > int64_t(blocks.size()))
    throw std::invalid_argument(fmt::format("PagedKvCache: a table of {} blocks cannot hold {} tokens",
                                            blocks.size(), start + n));
  Tensor& kc = k_.at(size_t(layer));
  Tensor& vc = v_.at(size_t(layer));
  // One copy per run of consecutive slots inside a block.
  for (int64_t r = 0; r < n;) {
    const int64_t p = start + r, blk = blocks[size_t(p / block_size_)], off = p % block_size_;
    const int64_t len = std::min(block_size_ - off, n - r);
    kc.select(0, blk).narrow(0, off, len).copy_(k.narrow(0, r, len));
    vc.select(0, blk).narrow(0, off, len).copy_(v.narrow(0, r, len));
    r += len;
  }
}

void PagedKvCache::fork_sequence(const KvSequence& src, KvSequence& dst) {
  if (dst.length != 0 || !dst.blocks.empty())
    throw std::invalid_argument("PagedKvCache::fork_sequence: the destination must be empty");
  if (blocks_for(src.length) > int64_t(src.blocks.size()))
    throw std::invalid_argument("PagedKvCache::fork_sequence: the source's table is shorter than its length");
  const int64_t full = src.length / block_size_;
  std::vector<int64_t> copy;
  if (fork_blocks(src)) copy = manager_.allocate(1);  // first: a failure leaves everything as it was
  for (int64_t i = 0; i < full; ++i) {
    manager_.hold(src.blocks[size_t(i)]);
    dst.blocks.push_back(src.blocks[size_t(i)]);
  }
  if (!copy.empty()) {
    NoGradGuard ng;
    for (size_t l = 0; l < k_.size(); ++l) {
      k_[l].select(0, copy[0]).copy_(k_[l].select(0, src.blocks[size_t(full)]));
      v_[l].select(0, copy[0]).copy_(v_[l].select(0, src.blocks[size_t(full)]));
    }
    dst.blocks.push_back(copy[0]);
  }
  dst.length = src.length;
  dst.rope = src.rope;
}

std::pair<Tensor, Tensor> PagedKvCache::gather(int64_t layer, const Tensor& slot_ids) const {
  const Tensor& kc = k_.at(size_t(layer));
  const Tensor& vc = v_.at(size_t(layer));
  const Shape flat{kc.size(0) * kc.size(1), kc.size(2), kc.size(3)};  // [NB*BS, NKV, D]
  return {index_select(kc.view(flat), 0, slot_ids), index_select(vc.view(flat), 0, slot_ids)};
}

}  // namespace areno::phi4mm
