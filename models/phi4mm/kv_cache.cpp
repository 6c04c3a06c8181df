#include "models/phi4mm/kv_cache.h"

#include <algorithm>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include "tensor/autograd.h"

namespace areno::phi4mm {

namespace {

const char* table_name(RopeTable r) {
  switch (r) {
    case RopeTable::automatic: return "automatic";
    case RopeTable::short_table: return "short";
    case RopeTable::long_table: return "long";
  }
  return "?";
}

}  // namespace

// ---- BlockManager ----

BlockManager::BlockManager(int64_t num_blocks) {
  if (num_blocks <= 0)
    throw std::invalid_argument(fmt::format("BlockManager: num_blocks must be positive, got {}", num_blocks));
  in_use_.assign(size_t(num_blocks), 0);
  // Stack with block 0 on top, so a fresh pool hands out 0, 1, 2, ...
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

bool BlockManager::in_use(int64_t block) const {
  return block >= 0 && block < num_blocks() && in_use_[size_t(block)];
}

std::vector<int64_t> BlockManager::allocate(int64_t n) {
  if (n < 0) throw std::invalid_argument(fmt::format("BlockManager: cannot allocate {} blocks", n));
  if (!can_allocate(n))
    throw std::runtime_error(fmt::format("KV cache out of blocks: {} needed, {} free of {}", n, num_free(),
                                         num_blocks()));
  std::vector<int64_t> out;
  out.reserve(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(free_.back());
    free_.pop_back();
    in_use_[size_t(out.back())] = 1;
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
    in_use_[size_t(b)] = 0;
    free_.push_back(b);
  }
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
    : block_size_(block_size), manager_(num_blocks) {
  if (block_size <= 0)
    throw std::invalid_argument(fmt::format("PagedKvCache: block_size must be positive, got {}", block_size));
  const TextConfig& t = m.config().text;
  const Shape shape{num_blocks, block_size, t.num_key_value_heads, t.head_dim()};
  const TensorOptions o(m.dtype(), m.device());
  for (int64_t l = 0; l < t.num_hidden_layers; ++l) {
    // Zero-filled so that a bug reading an unwritten slot gives finite numbers
    // the tests can catch, not NaNs from garbage.
    k_.push_back(zeros(shape, o));
    v_.push_back(zeros(shape, o));
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

void PagedKvCache::copy_sequence(const KvSequence& src, KvSequence& dst) {
  if (dst.length != 0 || !dst.blocks.empty())
    throw std::invalid_argument("PagedKvCache::copy_sequence: the destination must be empty");
  reserve(dst, src.length);
  const int64_t n = blocks_for(src.length);
  NoGradGuard ng;
  for (size_t l = 0; l < k_.size(); ++l)
    for (int64_t i = 0; i < n; ++i) {
      k_[l].select(0, dst.blocks[size_t(i)]).copy_(k_[l].select(0, src.blocks[size_t(i)]));
      v_[l].select(0, dst.blocks[size_t(i)]).copy_(v_[l].select(0, src.blocks[size_t(i)]));
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

// ---- IncrementalBatch ----

void IncrementalBatch::add(KvSequence& s, const std::vector<int64_t>& ids, Adapter a, RopeTable r) {
  token_ids.insert(token_ids.end(), ids.begin(), ids.end());
  cu_seqlens.push_back(int64_t(token_ids.size()));
  seqs.push_back(&s);
  adapters.push_back(a);
  rope.push_back(r);
}

// ---- forward entry point (b) ----

namespace {

void check_incremental(const Phi4MMForCausalLM& m, const PagedKvCache& cache, const IncrementalBatch& b) {
  const int64_t T = int64_t(b.token_ids.size());
  const size_t S = b.seqs.size();
  const auto& cu = b.cu_seqlens;
  if (S == 0) throw std::invalid_argument("IncrementalBatch: no sequence");
  if (cu.size() != S + 1 || cu.front() != 0 || cu.back() != T)
    throw std::invalid_argument(fmt::format(
        "IncrementalBatch: cu_seqlens must have {} entries from 0 to the token count {}", S + 1, T));
  for (size_t i = 1; i < cu.size(); ++i)
    if (cu[i] <= cu[i - 1])
      throw std::invalid_argument("IncrementalBatch: cu_seqlens must be strictly increasing (no empty chunk)");
  if (!b.adapters.empty() && b.adapters.size() != S)
    throw std::invalid_argument(fmt::format("IncrementalBatch: {} adapters for {} sequences", b.adapters.size(), S));
  if (!b.rope.empty() && b.rope.size() != S)
    throw std::invalid_argument(fmt::format("IncrementalBatch: {} rope tables for {} sequences", b.rope.size(), S));
  for (Adapter a : b.adapters)
    if (!m.has_adapter(a))
      throw std::invalid_argument(
          fmt::format("IncrementalBatch: the model was loaded without the {} adapter", adapter_name(a)));
  std::set<const KvSequence*> distinct;
  for (const KvSequence* s : b.seqs) {
    if (!s) throw std::invalid_argument("IncrementalBatch: null sequence");
    if (!distinct.insert(s).second)
      throw std::invalid_argument("IncrementalBatch: a sequence appears twice in one step");
    if (s->length < 0 || cache.blocks_for(s->length) > int64_t(s->blocks.size()))
      throw std::invalid_argument(fmt::format("IncrementalBatch: a sequence of length {} has only {} blocks",
                                              s->length, s->blocks.size()));
  }
  for (int64_t r : b.logit_rows)
    if (r < 0 || r >= T)
      throw std::invalid_argument(fmt::format("IncrementalBatch: logit row {} outside the {} new tokens", r, T));
  if (b.media_mask.defined() != b.media_rows.defined())
    throw std::invalid_argument("IncrementalBatch: media_rows and media_mask go together");
  if (b.media_rows.defined() &&
      (b.media_rows.dim() != 2 || b.media_rows.size(1) != m.config().text.hidden_size ||
       b.media_mask.dim() != 1 || b.media_mask.size(0) != T))
    throw std::invalid_argument(fmt::format("IncrementalBatch: media_rows must be [M, {}] and media_mask [{}]",
                                            m.config().text.hidden_size, T));
  if (b.media_rows.defined()) {
    // Checked here so that a wrong slice fails before any block is taken.
    int64_t marked = 0;
    for (int64_t x : b.media_mask.to(DType::i64).to_vector<int64_t>()) marked += x != 0;
    if (marked != b.media_rows.size(0))
      throw std::invalid_argument(fmt::format(
          "IncrementalBatch: media_mask marks {} rows but media_rows has {}; slice the request's media rows to "
          "the placeholders inside this step's chunks",
          marked, b.media_rows.size(0)));
  }
  if (cache.num_layers() != m.config().text.num_hidden_layers || cache.keys(0).dtype() != m.dtype() ||
      cache.keys(0).device() != m.device() || cache.keys(0).size(2) != m.config().text.num_key_value_heads ||
      cache.keys(0).size(3) != m.config().text.head_dim())
    throw std::invalid_argument("forward_incremental: the KV cache was built for another model, dtype or device");
}

// The table each sequence's new keys are rotated with (see IncrementalBatch::rope).
RopeTable resolve_table(const Phi4MMForCausalLM& m, const KvSequence& s, RopeTable want, int64_t last, size_t i) {
  if (s.length == 0) return want == RopeTable::automatic ? rope_table_for_length(m, last + 1) : want;
  const RopeTable cached = s.rope;
  if (cached == RopeTable::automatic)
    throw std::invalid_argument(fmt::format("IncrementalBatch: sequence {} holds {} cached tokens but no table; "
                                            "was it filled outside forward_incremental?", i, s.length));
  if (want != RopeTable::automatic && want != cached)
    throw std::invalid_argument(fmt::format(
        "IncrementalBatch: sequence {} asks for the {} LongRoPE table but its cached keys use the {} table; "
        "release it and re-prefill", i, table_name(want), table_name(cached)));
  if (want == RopeTable::automatic && needs_reprefill(m, s, last + 1))
    throw std::invalid_argument(fmt::format(
        "IncrementalBatch: sequence {} grows to {} tokens, past original_max_position_embeddings = {}, but its "
        "cached keys use the short LongRoPE table; release it and re-prefill all its tokens with the long table",
        i, last + 1, m.config().text.original_max_position_embeddings));
  return cached;
}

}  // namespace

Tensor forward_incremental(const Phi4MMForCausalLM& m, PagedKvCache& cache, IncrementalBatch& b) {
  check_incremental(m, cache, b);
  NoGradGuard ng;
  const TextConfig& t = m.config().text;
  const Device dev = m.device();
  const TensorOptions idx_opts(DType::i64, dev);
  const auto& cu = b.cu_seqlens;
  const size_t S = b.seqs.size();
  const int64_t T = cu.back();

  // Per sequence: table, start position, chunk length.
  std::vector<RopeTable> tables(S);
  std::vector<int64_t> start(S), len(S), positions(static_cast<size_t>(T));
  for (size_t s = 0; s < S; ++s) {
    start[s] = b.seqs[s]->length;
    len[s] = cu[s + 1] - cu[s];
    const RopeTable want = b.rope.empty() ? RopeTable::automatic : b.rope[s];
    tables[s] = resolve_table(m, *b.seqs[s], want, start[s] + len[s] - 1, s);
    for (int64_t i = 0; i < len[s]; ++i) positions[size_t(cu[s] + i)] = start[s] + i;
  }

  // Rotary rows through the packed path's table builder (positions and explicit tables);
  // it also rejects positions past max_position_embeddings before anything is allocated.
  PackedBatch pb;
  pb.token_ids = from_vector(b.token_ids, {T});
  pb.cu_seqlens = cu;
  pb.positions = from_vector(positions, {T});
  pb.rope = tables;
  auto [cos, sin] = m.rope_tables(pb);  // [T, 1, R]

  // Blocks for the new tokens, all or nothing across the step.
  int64_t needed = 0;
  for (size_t s = 0; s < S; ++s)
    needed += std::max<int64_t>(0, cache.blocks_for(start[s] + len[s]) - int64_t(b.seqs[s]->blocks.size()));
  if (!cache.manager().can_allocate(needed))
    throw std::runtime_error(fmt::format("KV cache out of blocks: this step needs {} more, {} free of {}", needed,
                                         cache.manager().num_free(), cache.num_blocks()));
  for (size_t s = 0; s < S; ++s) cache.reserve(*b.seqs[s], start[s] + len[s]);

  // Rows per adapter, as in the packed forward.
  AdapterRows rows;
  for (Adapter a : {Adapter::vision, Adapter::speech}) {
    std::vector<int64_t> r;
    for (size_t s = 0; s < S && !b.adapters.empty(); ++s)
      if (b.adapters[s] == a)
        for (int64_t i = cu[s]; i < cu[s + 1]; ++i) r.push_back(i);
    if (r.empty()) continue;
    if (int64_t(r.size()) == T)
      rows.all[int(a)] = true;
    else
      rows.rows[int(a)] = from_vector(r, {int64_t(r.size())}, idx_opts);
  }

  // Slots of each sequence's whole history + chunk, shared by all layers.
  std::vector<Tensor> history(S);
  for (size_t s = 0; s < S; ++s) {
    const int64_t total = start[s] + len[s];
    history[s] = from_vector(cache.slots(b.seqs[s]->blocks, 0, total), {total}, idx_opts);
  }

  Tensor h = embedding(m.model->embed_tokens->weight, pb.token_ids.to(dev));  // [T, H]
  if (b.media_rows.defined()) {
    Tensor mask = b.media_mask.to(dev).unsqueeze(1).expand({-1, h.size(1)});
    h = masked_scatter(h, mask.contiguous(), b.media_rows.to(dev, m.dtype()));
  }
  const double eps = t.rms_norm_eps;
  for (size_t l = 0; l < m.model->layers->size(); ++l) {
    const auto layer = m.model->layers->at<DecoderLayer>(l);
    const Attention& attn = *layer->self_attn;
    // As Attention::forward, with the cache between rotary and attention.
    auto [q, k, v] = attn.rotary_qkv(rms_norm(h, layer->input_layernorm->weight, eps), cos, sin, rows);
    std::vector<Tensor> outs;
    for (size_t s = 0; s < S; ++s) {
      cache.write(int64_t(l), b.seqs[s]->blocks, start[s], k.narrow(0, cu[s], len[s]), v.narrow(0, cu[s], len[s]));
      auto [kc, vc] = cache.gather(int64_t(l), history[s]);  // [start + len, NKV, D]
      outs.push_back(causal_attention(q.narrow(0, cu[s], len[s]), kc, vc));
    }
    Tensor o = outs.size() == 1 ? outs[0] : cat(outs, 0);
    h = add(h, attn.o_proj->forward(o, rows));
    h = add(h, layer->mlp->forward(rms_norm(h, layer->post_attention_layernorm->weight, eps), rows));
  }

  for (size_t s = 0; s < S; ++s) {
    b.seqs[s]->length = start[s] + len[s];
    b.seqs[s]->rope = tables[s];
  }

  // The head only for the rows asked for (the vocabulary is 200k wide).
  std::vector<int64_t> want = b.logit_rows;
  if (want.empty())
    for (size_t s = 0; s < S; ++s) want.push_back(cu[s + 1] - 1);
  Tensor hs = index_select(h, 0, from_vector(want, {int64_t(want.size())}, idx_opts));
  return linear(rms_norm(hs, m.model->norm->weight, eps), m.model->embed_tokens->weight);
}

}  // namespace areno::phi4mm
