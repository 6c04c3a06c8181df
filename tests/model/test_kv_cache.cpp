// Forward entry point (b): the paged KV cache and the incremental forward
// (chunked prefill and decode) against the packed forward (a) on the tiny
// checkpoint (f32), plus block accounting and the LongRoPE re-prefill rule.
// Tiny config: 2 layers, 4 query heads, 2 KV heads, head_dim 8, vocab 128,
// original_max_position_embeddings 16, max_position_embeddings 64.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <set>
#include <vector>

#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/kv_cache.h"
#include "models/phi4mm/text.h"
#include "tensor/autograd.h"
#include "tests/model/model_fixtures.h"
#include "tests/test_util.h"

using namespace areno;
using namespace areno::phi4mm;
using areno::testing::gold;
using areno::testing::gold_ids;
using areno::testing::rel_err;

namespace {

std::shared_ptr<Phi4MMForCausalLM> tiny_on(Device device) {
  LoadOptions o;
  o.device = device;
  return load_model(testing::kTinyDir, o);
}

const Phi4MMForCausalLM& tiny_cpu() {
  static auto m = tiny_on(Device::cpu());
  return *m;
}

// Deterministic token ids in [0, 128).
std::vector<int64_t> make_ids(size_t n, uint32_t seed) {
  std::vector<int64_t> v(n);
  for (auto& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = int64_t((seed >> 16) % 128);
  }
  return v;
}

std::vector<int64_t> range(const std::vector<int64_t>& v, size_t b, size_t e) {
  return {v.begin() + std::ptrdiff_t(b), v.begin() + std::ptrdiff_t(e)};
}

std::vector<int64_t> iota_rows(size_t n) {
  std::vector<int64_t> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = int64_t(i);
  return r;
}

// Packed-forward logits (entry point (a)) of the given rows of one sequence, f32 on the CPU.
Tensor packed(const Phi4MMForCausalLM& m, const std::vector<int64_t>& ids, Adapter a, std::vector<int64_t> rows,
              RopeTable r = RopeTable::automatic) {
  NoGradGuard ng;
  return m.logits_at(PackedBatch::single(ids, a, r), rows).to(Device::cpu(), DType::f32);
}
// [V]
Tensor packed_last(const Phi4MMForCausalLM& m, const std::vector<int64_t>& ids, Adapter a,
                   RopeTable r = RopeTable::automatic) {
  return packed(m, ids, a, {int64_t(ids.size()) - 1}, r).select(0, 0);
}

// One sequence, one chunk, the logits of every row of the chunk.
Tensor step_all_rows(const Phi4MMForCausalLM& m, PagedKvCache& c, KvSequence& s, const std::vector<int64_t>& chunk,
                     Adapter a, RopeTable r) {
  IncrementalBatch b;
  b.add(s, chunk, a, r);
  for (int64_t i = 0; i < int64_t(chunk.size()); ++i) b.logit_rows.push_back(i);
  return forward_incremental(m, c, b).to(Device::cpu(), DType::f32);
}

// One sequence, one chunk, the logits of the last row [V].
Tensor step_last(const Phi4MMForCausalLM& m, PagedKvCache& c, KvSequence& s, const std::vector<int64_t>& chunk,
                 Adapter a = Adapter::none, RopeTable r = RopeTable::automatic) {
  IncrementalBatch b;
  b.add(s, chunk, a, r);
  return forward_incremental(m, c, b).to(Device::cpu(), DType::f32).select(0, 0);
}

int64_t argmax_id(const Tensor& row) { return int64_t(argmax(row, 0).item()); }

// A digest named by a short label (its bytes, zero-padded).
BlockDigest dg(const char* label) {
  BlockDigest d{};
  std::memcpy(d.data(), label, std::min(std::strlen(label), d.size()));
  return d;
}

}  // namespace

TEST_CASE("phi4mm/kv cache: block manager allocates all or nothing, frees and rejects double frees") {
  BlockManager bm(5);
  CHECK(bm.num_free() == 5);
  auto a = bm.allocate(3);
  CHECK(a == std::vector<int64_t>{0, 1, 2});
  CHECK(bm.num_used() == 3);
  CHECK(bm.in_use(1));
  CHECK_THROWS_WITH_AS(bm.allocate(3), doctest::Contains("out of blocks: 3 needed, 2 free of 5"), std::runtime_error);
  CHECK(bm.num_free() == 2);  // the failed allocation took nothing
  bm.free({1});
  CHECK_FALSE(bm.in_use(1));
  CHECK(bm.allocate(1) == std::vector<int64_t>{1});  // the freed block comes back first
  CHECK(bm.num_touched() == 3);                        // so the touched blocks stay a prefix
  CHECK_THROWS_WITH_AS(bm.free({3}), doctest::Contains("block 3 is not in use"), std::invalid_argument);
  CHECK_THROWS_AS(bm.free({0, 0}), std::invalid_argument);
  CHECK(bm.num_used() == 3);  // a rejected free changes nothing
  bm.free(a);
  CHECK(bm.num_free() == 5);
  CHECK_THROWS_AS(BlockManager(0), std::invalid_argument);
}

TEST_CASE("phi4mm/kv cache: remembered blocks are shared by holders, cached when free, evicted least recent first") {
  BlockManager bm(4);
  CHECK(bm.num_touched() == 0);
  auto a = bm.allocate(2);  // 0, 1
  CHECK(bm.num_touched() == 2);
  bm.remember(a[0], dg("d0"));
  bm.remember(a[1], dg("d1"));
  bm.remember(a[1], dg("other"));  // already remembered: unchanged
  CHECK(bm.lookup(dg("d1")) == 1);
  CHECK(bm.lookup(dg("other")) == -1);
  CHECK(bm.num_cached() == 2);
  bm.hold(0);  // a second sequence shares block 0
  bm.free({0, 1});
  CHECK(bm.in_use(0));       // still held by the second
  CHECK_FALSE(bm.in_use(1));  // cached, evictable
  CHECK(bm.num_free() == 3);
  CHECK(bm.lookup(dg("d1")) == 1);
  bm.free({0});
  CHECK(bm.num_free() == 4);
  CHECK(bm.num_used() == 0);
  // Never-remembered blocks go first (2, 3), then the least recently freed cached one (1), forgotten.
  CHECK(bm.allocate(3) == std::vector<int64_t>{2, 3, 1});
  CHECK(bm.num_touched() == 4);
  CHECK(bm.lookup(dg("d1")) == -1);
  CHECK(bm.lookup(dg("d0")) == 0);
  bm.hold(0);  // taken back from the cache
  CHECK(bm.num_free() == 0);
  CHECK_THROWS_WITH_AS(bm.allocate(1), doctest::Contains("out of blocks"), std::runtime_error);
  bm.hold(2);  // a held block that was never remembered is shared too (a forked sequence)
  CHECK(bm.holds(2) == 2);
  CHECK(bm.audit().empty());
  bm.free({0, 1, 2, 3});
  CHECK(bm.in_use(2));
  bm.free({2});
  CHECK(bm.num_free() == 4);
  CHECK(bm.num_cached() == 1);
  CHECK(bm.audit().empty());
  CHECK_THROWS_WITH_AS(bm.hold(2), doctest::Contains("neither held nor cached"), std::invalid_argument);
  CHECK_THROWS_AS(bm.free({0}), std::invalid_argument);  // cached but held by no one
  CHECK(bm.audit().empty());  // the rejected calls changed nothing
}

TEST_CASE("phi4mm/kv cache: capacity from a byte budget, storage shape and slot mapping") {
  const auto& m = tiny_cpu();
  // 2 layers x (K + V) x 16 tokens x 2 KV heads x 8 dims x 4 bytes
  CHECK(PagedKvCache::bytes_per_block(m.config().text, 16, DType::f32) == 2 * 2 * 16 * 2 * 8 * 4);
  CHECK(PagedKvCache::bytes_per_block(m.config().text, 16, DType::bf16) == 2 * 2 * 16 * 2 * 8 * 2);
  CHECK(PagedKvCache::blocks_for_budget(m, 10 * 4096 + 100, 16) == 10);
  CHECK_THROWS_WITH_AS(PagedKvCache::blocks_for_budget(m, 100, 16), doctest::Contains("holds no block"),
                       std::invalid_argument);
  PagedKvCache c(m, 6, 4);
  CHECK(c.num_layers() == 2);
  CHECK(c.keys(1).shape() == Shape{6, 4, 2, 8});
  CHECK(c.values(0).dtype() == DType::f32);
  CHECK(c.blocks_for(0) == 0);
  CHECK(c.blocks_for(4) == 1);
  CHECK(c.blocks_for(5) == 2);
  // Block table [5, 2]: positions 0..3 in block 5, 4..7 in block 2.
  CHECK(c.slots({5, 2}, 2, 4) == std::vector<int64_t>{22, 23, 8, 9});
  CHECK_THROWS_AS(c.slots({5}, 2, 4), std::invalid_argument);
  // The resident part of the lazily committed pool: blocks ever handed out.
  CHECK(c.touched_bytes() == 0);
  KvSequence s;
  c.reserve(s, 9);  // 3 blocks of 4 tokens
  CHECK(c.touched_bytes() == 3 * 2 * 2 * 4 * 2 * 8 * 4);
  c.release(s);
  CHECK(c.touched_bytes() == 3 * 2 * 2 * 4 * 2 * 8 * 4);
}

DEVICE_TEST_CASE("phi4mm/incremental forward: chunked prefill in chunks of 1, 7 and 64 then decode equals the packed forward") {
  auto mp = tiny_on(device);
  const auto& m = *mp;
  struct Case {
    size_t prompt, decode;
    Adapter adapter;
  };
  // 40 + 4 tokens: past original_max_position_embeddings (16), long table chosen
  // at admission from the prompt length; 10 + 4 tokens: short table throughout.
  for (Case cs : {Case{40, 4, Adapter::vision}, Case{10, 4, Adapter::speech}}) {
    const std::vector<int64_t> prompt = make_ids(cs.prompt, 7);
    const RopeTable table = rope_table_for_length(m, int64_t(cs.prompt + cs.decode));
    CHECK(table == (cs.prompt > 16 ? RopeTable::long_table : RopeTable::short_table));
    const Tensor ref_prompt = packed(m, prompt, cs.adapter, iota_rows(cs.prompt), table);
    for (int64_t block_size : {16, 5}) {
      for (size_t chunk : {1, 7, 64}) {
        CAPTURE(cs.prompt);
        CAPTURE(block_size);
        CAPTURE(chunk);
        PagedKvCache cache(m, 16, block_size);
        KvSequence s;
        std::vector<Tensor> rows;
        for (size_t b = 0; b < prompt.size(); b += chunk)
          rows.push_back(step_all_rows(m, cache, s, range(prompt, b, std::min(prompt.size(), b + chunk)), cs.adapter,
                                       table));
        CHECK(s.length == int64_t(cs.prompt));
        CHECK(s.rope == table);
        CHECK(int64_t(s.blocks.size()) == cache.blocks_for(s.length));
        Tensor all = cat(rows, 0);  // [prompt, V]
        CHECK(rel_err(all, ref_prompt) < 1e-5);
        // Decode greedily; every step equals the packed forward over all tokens so far,
        // which picks its table by the HF rule on the full length.
        std::vector<int64_t> ids = prompt;
        Tensor last = all.select(0, all.size(0) - 1);
        double worst = 0;
        for (size_t d = 0; d < cs.decode; ++d) {
          ids.push_back(argmax_id(last));
          last = step_last(m, cache, s, {ids.back()}, cs.adapter);  // automatic: keeps the cached table
          worst = std::max(worst, rel_err(last, packed_last(m, ids, cs.adapter)));
        }
        CHECK(worst < 1e-5);
        CHECK(s.length == int64_t(ids.size()));
        cache.release(s);
        CHECK(cache.manager().num_free() == 16);
      }
    }
  }
  // Anchor to transformers: ids_a (12 tokens) in chunks of 5 with the vision
  // adapter gives the reference logits of every row.
  auto ids_a = gold_ids("ids_a");
  PagedKvCache cache(m, 4, 4);
  KvSequence s;
  Tensor a0 = step_all_rows(m, cache, s, range(ids_a, 0, 5), Adapter::vision, RopeTable::automatic);
  Tensor a1 = step_all_rows(m, cache, s, range(ids_a, 5, 10), Adapter::vision, RopeTable::automatic);
  Tensor a2 = step_all_rows(m, cache, s, range(ids_a, 10, 12), Adapter::vision, RopeTable::automatic);
  CHECK(rel_err(cat({a0, a1, a2}, 0), gold("logits_a_vision")) < 1e-4);
}

DEVICE_TEST_CASE("phi4mm/incremental forward: sequences of different adapters and lengths in one call equal their solo runs") {
  auto mp = tiny_on(device);
  const auto& m = *mp;
  struct Seq {
    std::vector<int64_t> ids;  // prompt, then the generated tokens
    Adapter adapter;
    RopeTable table;
    KvSequence kv;
  };
  std::vector<Seq> seqs(4);
  seqs[0] = {make_ids(30, 1), Adapter::none, RopeTable::long_table, {}};
  seqs[1] = {make_ids(9, 2), Adapter::vision, RopeTable::short_table, {}};
  seqs[2] = {make_ids(20, 3), Adapter::speech, RopeTable::long_table, {}};
  seqs[3] = {make_ids(3, 4), Adapter::vision, RopeTable::short_table, {}};
  PagedKvCache cache(m, 24, 4);
  const int64_t free0 = cache.manager().num_free();
  // Step plan: chunk lengths per sequence (0 = not in this step; a step after the
  // prompt is done decodes one greedy token).
  const std::vector<std::vector<size_t>> plan = {
      {7, 9, 1, 0},   // prefill chunks of different lengths
      {23, 0, 19, 3},  // the rest of two prompts, a new sequence joins
      {1, 1, 1, 1},   // decode, all four
      {1, 1, 0, 1},   // decode, one sequence sits out
      {1, 1, 1, 1},
  };
  std::vector<Tensor> last(4);
  double worst = 0;
  int compared = 0;
  for (const auto& step : plan) {
    IncrementalBatch b;
    std::vector<size_t> in_step;
    for (size_t i = 0; i < 4; ++i) {
      if (step[i] == 0) continue;
      Seq& q = seqs[i];
      const size_t have = size_t(q.kv.length);
      if (have >= q.ids.size()) q.ids.push_back(argmax_id(last[i]));  // decode: the greedy token
      REQUIRE(have + step[i] <= q.ids.size());
      b.add(q.kv, range(q.ids, have, have + step[i]), q.adapter, q.table);
      in_step.push_back(i);
    }
    Tensor out = forward_incremental(m, cache, b).to(Device::cpu(), DType::f32);
    REQUIRE(out.shape() == Shape{int64_t(in_step.size()), 128});
    for (size_t j = 0; j < in_step.size(); ++j) {
      Seq& q = seqs[in_step[j]];
      last[in_step[j]] = out.select(0, int64_t(j));
      const auto done = range(q.ids, 0, size_t(q.kv.length));
      worst = std::max(worst, rel_err(last[in_step[j]], packed_last(m, done, q.adapter, q.table)));
      ++compared;
    }
  }
  CHECK(compared == 17);
  CHECK(worst < 1e-5);
  // The adapters matter: sequence 1 under another adapter gives other logits.
  CHECK(rel_err(packed_last(m, seqs[1].ids, Adapter::speech), last[1]) > 1e-3);
  for (auto& q : seqs) cache.release(q.kv);
  CHECK(cache.manager().num_free() == free0);
}

TEST_CASE("phi4mm/incremental forward: media rows sliced per chunk equal the packed forward with media") {
  const auto& m = tiny_cpu();
  // Placeholders at positions 3..9 take 7 media rows; chunks of 4 split them 1/4/2.
  std::vector<int64_t> ids = make_ids(14, 9), mask(14, 0);
  for (size_t i = 3; i < 10; ++i) {
    ids[i] = kImageTokenId;
    mask[i] = 1;
  }
  Generator gen(3);
  Tensor media = rand_normal({7, 32}, gen);
  PackedBatch pb = PackedBatch::single(ids, Adapter::vision);
  pb.media_rows = media;
  NoGradGuard ng;
  Tensor ref = m.logits(pb);
  // A text-only sequence shares each step, placed before the media sequence so
  // the step's mask has rows of both.
  const std::vector<int64_t> other = make_ids(8, 10);
  PagedKvCache cache(m, 8, 4);
  KvSequence s, t;
  std::vector<Tensor> rows;
  int64_t used = 0;
  for (size_t c = 0; c < 14; c += 4) {
    const size_t e = std::min<size_t>(14, c + 4);
    IncrementalBatch b;
    if (c < 8) b.add(t, range(other, c, c + 4));
    const int64_t off = int64_t(b.token_ids.size());
    b.add(s, range(ids, c, e), Adapter::vision);
    int64_t n = 0;
    for (size_t i = c; i < e; ++i) n += mask[i];
    if (n > 0) {
      b.media_rows = media.narrow(0, used, n);
      used += n;
    }
    for (int64_t i = off; i < int64_t(b.token_ids.size()); ++i) b.logit_rows.push_back(i);
    rows.push_back(forward_incremental(m, cache, b));
  }
  CHECK(used == 7);
  CHECK(rel_err(cat(rows, 0), ref) < 1e-5);
  // The text-only neighbour's cache, written in the same steps, is intact.
  auto other_more = other;
  other_more.push_back(9);
  CHECK(rel_err(step_last(m, cache, t, {9}), packed_last(m, other_more, Adapter::none)) < 1e-5);
}

TEST_CASE("phi4mm/incremental forward: blocks are freed and reused, nothing leaks") {
  const auto& m = tiny_cpu();
  PagedKvCache cache(m, 8, 4);
  CHECK(cache.manager().num_free() == 8);
  const auto x_ids = make_ids(13, 21), y_ids = make_ids(6, 22), z_ids = make_ids(15, 23);
  KvSequence x, y, z, w;
  step_last(m, cache, x, x_ids);
  step_last(m, cache, y, y_ids, Adapter::speech);
  CHECK(x.blocks.size() == 4);  // 13 tokens in blocks of 4
  CHECK(y.blocks.size() == 2);
  CHECK(cache.manager().num_free() == 2);
  // Out of blocks: the step fails before anything is allocated or written.
  IncrementalBatch too_big;
  too_big.add(y, {1, 2, 3});                 // fits on its own (one more block)
  too_big.add(w, make_ids(9, 24));          // needs 3 blocks
  CHECK_THROWS_WITH_AS(forward_incremental(m, cache, too_big), doctest::Contains("out of blocks"), std::runtime_error);
  CHECK(cache.manager().num_free() == 2);
  CHECK(y.blocks.size() == 2);
  CHECK(y.length == 6);
  CHECK(w.blocks.empty());
  CHECK_FALSE(cache.can_grow(w, 9));
  CHECK(cache.can_grow(w, 8));
  // Free x; z reuses exactly its blocks, and their stale keys do not leak into z.
  const std::set<int64_t> x_blocks(x.blocks.begin(), x.blocks.end());
  cache.release(x);
  CHECK(x.blocks.empty());
  CHECK(x.length == 0);
  CHECK(cache.manager().num_free() == 6);
  Tensor zl = step_last(m, cache, z, z_ids, Adapter::vision);
  CHECK(std::set<int64_t>(z.blocks.begin(), z.blocks.end()) == x_blocks);
  CHECK(rel_err(zl, packed_last(m, z_ids, Adapter::vision)) < 1e-5);
  // y continues next to z and still equals its solo run.
  auto y_more = y_ids;
  y_more.push_back(77);
  CHECK(rel_err(step_last(m, cache, y, {77}, Adapter::speech), packed_last(m, y_more, Adapter::speech)) < 1e-5);
  // Release everything: the pool is whole again; a second release is an error.
  cache.release(y);
  cache.release(z);
  CHECK(cache.manager().num_free() == 8);
  KvSequence ghost;
  ghost.blocks = {3};
  CHECK_THROWS_AS(cache.release(ghost), std::invalid_argument);
  CHECK(cache.manager().num_free() == 8);
  // Many short-lived sequences cycle through the pool without growing it.
  for (int r = 0; r < 20; ++r) {
    KvSequence q;
    step_last(m, cache, q, make_ids(size_t(1 + r % 12), uint32_t(100 + r)));
    cache.release(q);
  }
  CHECK(cache.manager().num_free() == 8);
}

TEST_CASE("phi4mm/incremental forward: a fork shares the full blocks, copies the partial one, and both continue") {
  const auto& m = tiny_cpu();
  PagedKvCache cache(m, 8, 4);
  const auto ids = make_ids(10, 31);
  KvSequence a, b, c;
  step_last(m, cache, a, ids, Adapter::vision);
  REQUIRE(a.blocks.size() == 3);  // 4 + 4 + 2
  CHECK(cache.fork_blocks(a) == 1);
  cache.fork_sequence(a, b);
  CHECK(cache.manager().num_used() == 4);  // blocks 0 and 1 held twice, the partial one copied
  CHECK(b.length == 10);
  CHECK(b.blocks[0] == a.blocks[0]);
  CHECK(b.blocks[1] == a.blocks[1]);
  CHECK(b.blocks[2] != a.blocks[2]);
  CHECK(cache.manager().holds(a.blocks[0]) == 2);
  // Each continues with its own tokens, writing only into its own last block, and equals its solo run.
  auto a_ids = ids, b_ids = ids;
  for (int64_t t : {5, 6, 7}) {
    a_ids.push_back(t);
    b_ids.push_back(t + 40);
    CHECK(rel_err(step_last(m, cache, a, {t}, Adapter::vision), packed_last(m, a_ids, Adapter::vision)) < 1e-5);
    CHECK(rel_err(step_last(m, cache, b, {t + 40}, Adapter::vision), packed_last(m, b_ids, Adapter::vision)) <
          1e-5);
  }
  CHECK(cache.manager().num_used() == 6);  // positions 10, 11 in each one's own third block; 12 in a new fourth
  // A sequence of whole blocks forks without a new block.
  cache.release(b);
  KvSequence w;
  step_last(m, cache, w, make_ids(8, 32));
  CHECK(cache.fork_blocks(w) == 0);
  const int64_t used = cache.manager().num_used();
  cache.fork_sequence(w, c);
  CHECK(cache.manager().num_used() == used);
  CHECK(c.blocks == w.blocks);
  CHECK(cache.manager().audit().empty());
  // Out of blocks: the fork fails and takes nothing.
  KvSequence fill, d;
  step_last(m, cache, fill, make_ids(size_t(cache.manager().num_free() * 4), 33));
  CHECK_THROWS_WITH_AS(cache.fork_sequence(a, d), doctest::Contains("out of blocks"), std::runtime_error);
  CHECK(d.blocks.empty());
  CHECK(cache.manager().holds(a.blocks[0]) == 1);
  for (KvSequence* s : {&a, &c, &w, &fill}) cache.release(*s);
  CHECK(cache.manager().num_free() == 8);
  CHECK(cache.manager().audit().empty());
}

TEST_CASE("phi4mm/incremental forward: crossing the LongRoPE boundary re-prefills with the long table") {
  const auto& m = tiny_cpu();  // original_max_position_embeddings = 16
  auto ids = gold_ids("ids_b");  // 24 tokens
  PagedKvCache cache(m, 8, 4);
  const int64_t free0 = cache.manager().num_free();
  KvSequence s;
  // Short regime: a 12-token prompt, then 4 decode steps up to 16 tokens.
  Tensor last = step_last(m, cache, s, range(ids, 0, 12));
  CHECK(s.rope == RopeTable::short_table);
  CHECK(rel_err(last, packed_last(m, range(ids, 0, 12), Adapter::none)) < 1e-5);
  for (size_t n = 12; n < 16; ++n) {
    CHECK_FALSE(needs_reprefill(m, s, int64_t(n + 1)));
    last = step_last(m, cache, s, {ids[n]});
  }
  CHECK(rel_err(last, gold("logits_b16_none").select(0, 15)) < 1e-4);  // transformers, short table
  // Token 17 crosses: the cached keys are short-table keys.
  CHECK(needs_reprefill(m, s, 17));
  CHECK_THROWS_WITH_AS(step_last(m, cache, s, {ids[16]}), doctest::Contains("re-prefill"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(step_last(m, cache, s, {ids[16]}, Adapter::none, RopeTable::long_table),
                       doctest::Contains("re-prefill"), std::invalid_argument);
  CHECK(s.length == 16);  // the rejected steps changed nothing
  // Re-prefill the 17 tokens with the long table (in chunks of 7), then continue.
  cache.release(s);
  CHECK(cache.manager().num_free() == free0);
  for (size_t b = 0; b < 17; b += 7)
    last = step_last(m, cache, s, range(ids, b, std::min<size_t>(17, b + 7)), Adapter::none, RopeTable::long_table);
  CHECK(s.rope == RopeTable::long_table);
  CHECK_FALSE(needs_reprefill(m, s, 40));
  CHECK(rel_err(last, packed_last(m, range(ids, 0, 17), Adapter::none)) < 1e-5);
  // The re-prefill matters: the short-table run of 17 tokens differs.
  CHECK(rel_err(packed_last(m, range(ids, 0, 17), Adapter::none, RopeTable::short_table), last) > 1e-3);
  double worst = 0;
  for (size_t n = 17; n < 24; ++n) {
    last = step_last(m, cache, s, {ids[n]});
    worst = std::max(worst, rel_err(last, packed_last(m, range(ids, 0, n + 1), Adapter::none)));
  }
  CHECK(worst < 1e-5);
  CHECK(rel_err(last, gold("logits_b_none").select(0, 23)) < 1e-4);  // transformers, long table
  cache.release(s);
  CHECK(cache.manager().num_free() == free0);
}

TEST_CASE("phi4mm/incremental greedy decoding with re-prefill at the switch equals transformers' 32 tokens") {
  // HF generate() discards the cache and re-prefills when the sequence first
  // exceeds original_max_position_embeddings; the engine loop does the same.
  const auto& m = tiny_cpu();
  for (const auto& run_case : {std::pair{Adapter::none, "greedy_none"}, std::pair{Adapter::vision, "greedy_vision"}}) {
    const Adapter adapter = run_case.first;  // not a structured binding: clang 14 cannot use one in CAPTURE
    const char* key = run_case.second;
    CAPTURE(std::string(key));
    PagedKvCache cache(m, 10, 4);
    KvSequence s;
    std::vector<int64_t> ids = gold_ids("greedy_prompt"), out;
    Tensor ref_last = gold(std::string(key) + "_last_logits");  // [32, V]
    Tensor last = step_last(m, cache, s, ids, adapter);
    int reprefills = 0;
    double worst = 0;
    for (int step = 0; step < 32; ++step) {
      worst = std::max(worst, rel_err(last, ref_last.select(0, step)));
      out.push_back(argmax_id(last));
      ids.push_back(out.back());
      if (step == 31) break;
      if (needs_reprefill(m, s, int64_t(ids.size()))) {
        cache.release(s);
        last = step_last(m, cache, s, ids, adapter, RopeTable::long_table);
        ++reprefills;
      } else {
        last = step_last(m, cache, s, {ids.back()}, adapter);
      }
    }
    CHECK(reprefills == 1);
    CHECK(out == gold_ids(key));
    CHECK(worst < 1e-4);
    cache.release(s);
    CHECK(cache.manager().num_free() == 10);
  }
}

TEST_CASE("phi4mm/incremental forward errors are clear") {
  const auto& m = tiny_cpu();
  PagedKvCache cache(m, 4, 4);
  KvSequence s;
  IncrementalBatch b;
  CHECK_THROWS_WITH_AS(forward_incremental(m, cache, b), doctest::Contains("no sequence"), std::invalid_argument);
  b.add(s, {1, 2});
  b.add(s, {3});
  CHECK_THROWS_WITH_AS(forward_incremental(m, cache, b), doctest::Contains("appears twice"), std::invalid_argument);
  IncrementalBatch c;
  c.add(s, {1, 2});
  c.logit_rows = {2};
  CHECK_THROWS_WITH_AS(forward_incremental(m, cache, c), doctest::Contains("logit row 2"), std::invalid_argument);
  auto base = load_model(testing::kTinyDir, [] { LoadOptions o; o.with_lora = false; return o; }());
  PagedKvCache base_cache(*base, 4, 4);
  IncrementalBatch d;
  d.add(s, {1}, Adapter::speech);
  CHECK_THROWS_WITH_AS(forward_incremental(*base, base_cache, d), doctest::Contains("without the speech adapter"),
                       std::invalid_argument);
  LoadOptions bf;
  bf.dtype = DType::bf16;
  auto m16 = load_model(testing::kTinyDir, bf);
  IncrementalBatch e;
  e.add(s, {1});
  CHECK_THROWS_WITH_AS(forward_incremental(*m16, cache, e), doctest::Contains("another model, dtype or device"),
                       std::invalid_argument);
  // Positions past max_position_embeddings (64) are refused by the rotary tables.
  PagedKvCache big(m, 20, 4);
  IncrementalBatch f;
  f.add(s, make_ids(65, 1));
  CHECK_THROWS_WITH_AS(forward_incremental(m, big, f), doctest::Contains("max_position_embeddings"),
                       std::invalid_argument);
  CHECK(s.length == 0);
  CHECK(s.blocks.empty());  // refused before any block was taken
  // Media rows that do not match the marked placeholders.
  IncrementalBatch g;
  g.add(s, {kImageTokenId, kImageTokenId, 7});
  g.media_rows = zeros({1, 32});
  CHECK_THROWS_WITH_AS(forward_incremental(m, cache, g), doctest::Contains("2 media placeholders but media_rows has 1"),
                       std::invalid_argument);
  CHECK(s.blocks.empty());
}

TEST_CASE("phi4mm/incremental forward in bf16 equals the bf16 packed forward within bf16 rounding") {
  LoadOptions o;
  o.dtype = DType::bf16;
  auto m = load_model(testing::kTinyDir, o);
  PagedKvCache cache(*m, 4, 8);
  CHECK(cache.keys(0).dtype() == DType::bf16);  // K/V stored in the model dtype
  auto ids = gold_ids("ids_a");  // 12 tokens: prefill 7 + 5, then 3 decode steps
  KvSequence s;
  step_last(*m, cache, s, range(ids, 0, 7), Adapter::vision);
  Tensor last = step_last(*m, cache, s, range(ids, 7, 12), Adapter::vision);
  double worst = rel_err(last, packed_last(*m, ids, Adapter::vision));
  CHECK(rel_err(last, gold("logits_a_vision_bf16").select(0, 11)) < 2e-2);  // transformers in bf16
  for (int d = 0; d < 3; ++d) {
    ids.push_back(argmax_id(last));
    last = step_last(*m, cache, s, {ids.back()}, Adapter::vision);
    worst = std::max(worst, rel_err(last, packed_last(*m, ids, Adapter::vision)));
  }
  // Same rounding points as the packed path (bf16 K/V, f32 accumulation): at
  // most a few bf16 ulps apart, far from the f32 model's logits.
  CHECK(worst < 1e-2);
}

TEST_CASE("phi4mm/one forward: a mixed batch packed equals the same batch as chunked prefill and decode steps") {
  // Text, image, audio and image+audio sequences (placeholders with media rows,
  // each with its adapter) in one packed forward, then the same tokens through
  // the KV cache: prefill chunks that split the media spans, then one token a
  // step. Every row's logits must agree (f32 reassociation only).
  const auto& m = tiny_cpu();
  struct Seq {
    std::vector<int64_t> ids;
    Adapter adapter;
    Tensor media;  // rows for the placeholders, in order
    KvSequence kv;
    std::vector<Tensor> rows;  // incremental logits, in position order
    int64_t media_used = 0;
  };
  Generator gen(11);
  auto with_media = [&](std::vector<int64_t> ids, const std::vector<std::pair<size_t, int64_t>>& spans) {
    int64_t n = 0;
    for (auto [at, id] : spans) {
      ids[at] = id;
      ++n;
    }
    return std::make_pair(ids, n > 0 ? rand_normal({n, 32}, gen) : Tensor());
  };
  std::vector<Seq> seqs(4);
  auto [t0, m0] = with_media(make_ids(11, 21), {});
  auto [t1, m1] = with_media(make_ids(15, 22), {{2, kImageTokenId}, {3, kImageTokenId}, {4, kImageTokenId},
                                                {5, kImageTokenId}, {6, kImageTokenId}});
  auto [t2, m2] = with_media(make_ids(9, 23), {{1, kAudioTokenId}, {2, kAudioTokenId}, {3, kAudioTokenId}});
  auto [t3, m3] = with_media(make_ids(18, 24), {{1, kImageTokenId}, {2, kImageTokenId}, {3, kImageTokenId},
                                                {8, kAudioTokenId}, {9, kAudioTokenId}});
  seqs[0] = {t0, Adapter::none, m0, {}, {}, 0};
  seqs[1] = {t1, Adapter::vision, m1, {}, {}, 0};
  seqs[2] = {t2, Adapter::speech, m2, {}, {}, 0};
  seqs[3] = {t3, Adapter::vision, m3, {}, {}, 0};

  NoGradGuard ng;
  std::vector<std::vector<int64_t>> all_ids;
  std::vector<Adapter> adapters;
  std::vector<Tensor> media;
  for (auto& q : seqs) {
    all_ids.push_back(q.ids);
    adapters.push_back(q.adapter);
    if (q.media.defined()) media.push_back(q.media);
  }
  PackedBatch pb = PackedBatch::pack(all_ids, adapters);
  pb.media_rows = cat(media, 0);
  const Tensor packed_logits = m.logits(pb);  // [T, V]

  // Chunk lengths per step and sequence; 0 sits the step out. The prompts end
  // at different steps, after which the sequence decodes one token a step.
  const std::vector<std::vector<size_t>> plan = {
      {4, 3, 2, 2}, {3, 5, 0, 4}, {1, 4, 3, 5}, {1, 1, 1, 3}, {1, 1, 1, 1}, {1, 1, 1, 1}, {0, 0, 1, 1}, {0, 0, 1, 1}};
  PagedKvCache cache(m, 32, 4);
  for (const auto& step : plan) {
    IncrementalBatch b;
    std::vector<Tensor> step_media;
    std::vector<size_t> in_step;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& q = seqs[i];
      const size_t have = size_t(q.kv.length), n = std::min(step[i], q.ids.size() - have);
      if (n == 0) continue;
      const auto chunk = range(q.ids, have, have + n);
      const int64_t off = int64_t(b.token_ids.size());
      b.add(q.kv, chunk, q.adapter, rope_table_for_length(m, int64_t(q.ids.size())));
      int64_t k = 0;
      for (int64_t id : chunk) k += is_media_token(id);
      if (k > 0) step_media.push_back(q.media.narrow(0, q.media_used, k));
      q.media_used += k;
      for (int64_t r = 0; r < int64_t(n); ++r) b.logit_rows.push_back(off + r);
      in_step.push_back(i);
    }
    if (!step_media.empty()) b.media_rows = cat(step_media, 0);
    Tensor out = forward_incremental(m, cache, b);
    for (size_t j = 0; j < in_step.size(); ++j)
      seqs[in_step[j]].rows.push_back(out.narrow(0, b.cu_seqlens[j], b.cu_seqlens[j + 1] - b.cu_seqlens[j]));
  }
  double worst = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    REQUIRE(seqs[i].kv.length == int64_t(seqs[i].ids.size()));
    CHECK(seqs[i].media_used == (seqs[i].media.defined() ? seqs[i].media.size(0) : 0));
    Tensor inc = cat(seqs[i].rows, 0);
    Tensor ref = packed_logits.narrow(0, pb.cu_seqlens[i], int64_t(seqs[i].ids.size()));
    worst = std::max(worst, rel_err(inc, ref));
  }
  CHECK(worst < 1e-5);
  // The media rows matter: the image+audio sequence without them (its
  // placeholders then read a real token's embedding) gives other logits.
  std::vector<int64_t> plain = seqs[3].ids;
  for (auto& id : plain)
    if (is_media_token(id)) id = 7;
  CHECK(rel_err(m.logits(PackedBatch::single(plain, Adapter::vision)),
                packed_logits.narrow(0, pb.cu_seqlens[3], int64_t(plain.size()))) > 1e-3);
  for (auto& q : seqs) cache.release(q.kv);
  CHECK(cache.manager().num_used() == 0);
}
