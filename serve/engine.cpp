#include "serve/engine.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <stdexcept>
#include <unordered_map>

#include <fmt/format.h>
#include <openssl/sha.h>

#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "tensor/autograd.h"
#include "tensor/backend.h"

namespace areno::serve {

using phi4mm::KvSequence;
using phi4mm::RopeTable;

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::abort: return "abort";
    case FinishReason::none: break;
  }
  return nullptr;
}

// ---- digests (prefix and media caches) ----

namespace {

phi4mm::BlockDigest block_digest(std::string_view bytes) {
  static_assert(sizeof(phi4mm::BlockDigest) == SHA256_DIGEST_LENGTH);
  phi4mm::BlockDigest d;
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), d.data());
  return d;
}

std::string sha256(std::string_view bytes) {
  const phi4mm::BlockDigest d = block_digest(bytes);
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

// The media cache's key of one item: the salt's digest, its kind and size,
// the digest of its pixels or samples, for an image its crop limit (the
// model's when the item names none), and for a clip whether its request has
// an image (the clip's rows then come from the vision projector; an image's
// rows do not depend on the other items).
std::string media_item_key(const std::string& salt_digest, const phi4mm::Media& m, bool with_image,
                           int64_t default_crops) {
  std::string buf = salt_digest;
  const bool image = m.kind == phi4mm::MediaKind::kImage;
  const int64_t dims[4] = {int64_t(m.kind), image ? m.image.width : m.sample_rate,
                           image ? m.image.height : int64_t(m.samples.size()),
                           image ? (m.max_crops > 0 ? m.max_crops : default_crops) : int64_t(with_image)};
  buf.append(reinterpret_cast<const char*>(dims), sizeof dims);
  buf += image ? sha256({reinterpret_cast<const char*>(m.image.rgb.data()), m.image.rgb.size()})
               : sha256({reinterpret_cast<const char*>(m.samples.data()), m.samples.size() * sizeof(double)});
  return sha256(buf);
}

// The digests of each row of `rows` (prefix caching keys blocks by them).
std::vector<std::string> row_digests(const Tensor& rows) {
  const Tensor host = rows.to(Device::cpu()).contiguous();
  const auto* p = static_cast<const char*>(host.data_ptr());
  const size_t row_bytes = size_t(host.size(1)) * dtype_size(host.dtype());
  std::vector<std::string> out(size_t(host.size(0)));
  for (size_t m = 0; m < out.size(); ++m) out[m] = sha256({p + m * row_bytes, row_bytes});
  return out;
}

}  // namespace

// ---- state ----

struct Engine::Seq {
  Req* req = nullptr;
  int64_t sample = 0;
  std::vector<int64_t> tokens;  // prompt + generated
  int64_t generated = 0;
  KvSequence kv;
  int64_t order = 0;  // admission order (for "preempt the newest")
  bool finished = false;
  bool pending_fork = false;  // waits for sample 0's prompt prefill
  tok::IncrementalDecoder dec;
  std::string text;      // decoded completion so far (stop strings included until cut)
  size_t emitted = 0;    // bytes of `text` already reported
  std::unordered_map<int64_t, int64_t> counts;  // generated token counts (penalties)
  // Prefix caching: the digests of the first full blocks of `tokens` (for
  // the rotary table of kv, fixed until release), and how many of kv's
  // blocks are remembered (or came from the cache).
  std::vector<phi4mm::BlockDigest> digests;
  int64_t remembered = 0;
  explicit Seq(const tok::Tokenizer& t, bool skip) : dec(t, skip) {}
};

struct Engine::Req {
  int64_t id = 0;
  Request r;
  OutputCallback cb;
  uint64_t seed = 0;
  int64_t prompt_len = 0;
  int64_t max_context = 0;
  Tensor media_rows;                  // computed at submit, on the submitting thread
  std::vector<int64_t> media_before;  // [prompt_len + 1] placeholders before position i
  std::vector<std::string> media_digest;  // prefix caching: SHA-256 of each media row's bytes
  std::string salt_digest;  // the first block's chain start: zeros, or SHA-256 of Request::cache_salt
  std::vector<int64_t> stop_ids;      // stop_token_ids, plus the eos ids unless ignore_eos
  std::vector<std::unique_ptr<Seq>> seqs;
  std::vector<std::optional<TokenLogprob>> prompt_lp;
  bool prompt_lp_sent = false;
  bool aborted = false, done = false;
  int64_t finished = 0;
  int64_t cached_tokens = -1;  // prompt tokens its first admission found in the prefix cache (-1: not admitted)
  std::string cb_error;  // the output callback threw: the request is stopped with this error
};

Engine::Engine(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::shared_ptr<const tok::Tokenizer> tokenizer,
               EngineOptions opts)
    : model_(std::move(model)), tok_(std::move(tokenizer)), opts_(std::move(opts)), seed_state_(opts_.seed) {
  if (!model_ || !tok_) throw std::invalid_argument("Engine: model and tokenizer are required");
  if (opts_.max_running < 1) throw std::invalid_argument("Engine: max_running must be at least 1");
  if (opts_.max_batch_tokens < 1) throw std::invalid_argument("Engine: max_batch_tokens must be at least 1");
  if (opts_.prefill_chunk_tokens < 1) throw std::invalid_argument("Engine: prefill_chunk_tokens must be at least 1");
  if (opts_.speculative_tokens < 0 || opts_.prompt_lookup_min < 1 || opts_.prompt_lookup_max < opts_.prompt_lookup_min)
    throw std::invalid_argument("Engine: speculative_tokens must be >= 0 and 1 <= prompt_lookup_min <= prompt_lookup_max");
  const int64_t blocks = opts_.kv_blocks > 0
                             ? opts_.kv_blocks
                             : phi4mm::PagedKvCache::blocks_for_budget(*model_, opts_.kv_cache_bytes, opts_.block_size);
  cache_ = std::make_unique<phi4mm::PagedKvCache>(*model_, blocks, opts_.block_size);
  stats_.kv_blocks_total = blocks;
  for (const phi4mm::ServedLora& l : model_->served_loras())
    if (!l.removed) loras_.push_back(l);
}

Engine::~Engine() {
  try {
    stop(false);
  } catch (...) {
  }
}

int64_t Engine::max_context() const { return model_->config().text.max_position_embeddings; }

int64_t Engine::submit(Request r, OutputCallback on_output) {
  const int64_t V = model_->config().text.vocab_size;
  if (!r.params.bad_words.empty() && r.params.bad_words_ids.empty())
    r.params.bad_words_ids = encode_bad_words(r.params.bad_words, [this](const std::string& text) {
      const std::vector<tok::TokenId> ids = tok_->encode(text);
      return std::vector<int64_t>(ids.begin(), ids.end());
    });
  validate(r.params, V);
  if (r.prompt.empty()) throw std::invalid_argument("prompt: must contain at least one token");
  int64_t n_media = 0;
  for (int64_t id : r.prompt) {
    if (id < 0 || id >= V) throw std::invalid_argument(fmt::format("prompt: token id {} is outside [0, {})", id, V));
    n_media += phi4mm::is_media_token(id);
  }
  if (!r.media.empty() && r.media_rows.defined())
    throw std::invalid_argument("media: give either the media items or their rows, not both");
  const int64_t H = model_->config().text.hidden_size;
  if (r.media_rows.defined() &&
      (r.media_rows.dim() != 2 || r.media_rows.size(0) != n_media || r.media_rows.size(1) != H))
    throw std::invalid_argument(fmt::format("media_rows: {} do not match the prompt's {} placeholders (hidden {})",
                                            shape_str(r.media_rows.shape()), n_media, H));
  if (n_media > 0 && r.media.empty() && !r.media_rows.defined())
    throw std::invalid_argument(fmt::format("prompt: {} media placeholder ids but no media were given", n_media));
  if (n_media == 0 && !r.media.empty())
    throw std::invalid_argument(fmt::format("media: {} items but the prompt has no media placeholder ids", r.media.size()));
  const int64_t ctx = r.max_context > 0 ? std::min(r.max_context, max_context()) : max_context();
  const int64_t P = int64_t(r.prompt.size());
  if (P >= ctx)
    throw std::invalid_argument(fmt::format(
        "prompt: this model's maximum context length is {} tokens; the prompt has {} tokens", ctx, P));
  const int64_t capacity = cache_->num_blocks() * cache_->block_size();
  if (P + 1 > capacity)
    throw std::invalid_argument(fmt::format(
        "prompt: {} tokens do not fit in the KV cache ({} tokens); raise the cache size", P, capacity));

  // Refusals that need the lock (shutdown, full queue).
  auto check_accepting = [this] {
    if (stopping_) throw std::runtime_error("engine: shutting down");
    if (int64_t(inbox_.size() + waiting_.size()) >= opts_.max_queue)
      throw QueueFull(fmt::format("engine: {} requests are waiting; try again later", opts_.max_queue));
  };
  auto q = std::make_unique<Req>();
  q->media_rows = std::move(r.media_rows);
  q->salt_digest = r.cache_salt.empty() ? std::string(SHA256_DIGEST_LENGTH, '\0') : sha256(r.cache_salt);
  if (!r.media.empty()) encode_media(*q, r.media, n_media, check_accepting);
  r.media.clear();  // the rows are what the engine keeps
  if (opts_.prefix_caching && q->media_rows.defined() && q->media_digest.empty())
    q->media_digest = row_digests(q->media_rows);  // rows the caller gave
  q->r = std::move(r);
  // A callback that throws (a client that cannot take its outputs) stops its
  // own request at the next step; the step's other requests go on.
  q->cb = [this, qp = q.get(), cb = std::move(on_output)](const RequestOutput& o) {
    try {
      cb(o);
    } catch (const std::exception& e) {
      if (!qp->cb_error.empty()) return;
      qp->cb_error = fmt::format("engine error: the output callback failed: {}", e.what());
      fmt::print(stderr, "engine: request {}: {}\n", qp->id, qp->cb_error);
      abort(qp->id);
    }
  };
  q->stop_ids = q->r.params.stop_token_ids;
  if (!q->r.params.ignore_eos) q->stop_ids.insert(q->stop_ids.end(), opts_.eos_token_ids.begin(), opts_.eos_token_ids.end());
  q->prompt_len = P;
  q->max_context = ctx;
  std::lock_guard<std::mutex> lk(mu_);
  check_accepting();
  // Under the lock that unload_lora checks the inbox under: a request either
  // gets in before an unload (which then refuses) or sees it unloaded.
  if (q->r.served_lora != 0) {
    const auto l = std::find_if(loras_.begin(), loras_.end(), [&](const phi4mm::ServedLora& l) {
      return l.number == q->r.served_lora && (q->r.served_lora_uid == 0 || l.uid == q->r.served_lora_uid);
    });
    if (l == loras_.end())
      throw std::invalid_argument(fmt::format("served_lora: {} is not a loaded served LoRA ({} loaded){}",
                                              q->r.served_lora, loras_.size(),
                                              q->r.served_lora_uid ? "; the adapter it named was unloaded" : ""));
    q->r.served_lora_uid = l->uid;  // the block digests' key
  }
  q->id = next_id_++;
  seed_state_ = splitmix64(seed_state_);
  q->seed = q->r.params.seed.value_or(seed_state_);
  const int64_t id = q->id;
  inbox_.push_back(std::move(q));
  requests_total_++;
  cv_.notify_all();
  return id;
}

void Engine::run_between_steps(std::function<void()> fn) {
  std::packaged_task<void()> task(std::move(fn));
  std::future<void> done = task.get_future();
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (stopping_) throw std::runtime_error("engine: shutting down");
    if (thread_.joinable()) {
      controls_.push_back(std::move(task));
      cv_.notify_all();
    } else {
      lk.unlock();
      task();
    }
  }
  done.get();  // rethrows what fn threw
}

void Engine::run_controls() {
  std::deque<std::packaged_task<void()>> tasks;
  {
    std::lock_guard<std::mutex> lk(mu_);
    tasks.swap(controls_);
  }
  for (auto& t : tasks) t();  // each keeps its own exception for its caller
}

int32_t Engine::load_lora(const std::string& name, const std::string& dir, size_t max_live, const std::string& source) {
  int32_t number = 0;
  run_between_steps([&] {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (const phi4mm::ServedLora& l : loras_)
        if (l.name == name) throw std::invalid_argument(fmt::format("a served LoRA is named '{}' already", name));
      if (max_live > 0 && loras_.size() >= max_live)
        throw std::length_error(fmt::format("{} served LoRAs are loaded, the most this server holds; unload one first",
                                            loras_.size()));
    }
    number = phi4mm::load_served_lora(*model_, name, dir, source);  // between steps: no forward reads the adapters
    std::lock_guard<std::mutex> lk(mu_);
    loras_.push_back(model_->served_loras()[size_t(number - 1)]);
  });
  return number;
}

void Engine::unload_lora(const std::string& name) {
  run_between_steps([&] {
    const std::optional<phi4mm::ServedLora> l = find_lora(name);
    if (!l) throw std::out_of_range(fmt::format("no served LoRA is named '{}'", name));
    const int32_t number = l->number;
    int64_t users = 0;
    for (const auto& q : waiting_) users += q && !q->done && q->r.served_lora == number;
    for (const auto& q : active_) users += !q->done && q->r.served_lora == number;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (const auto& q : inbox_) users += q->r.served_lora == number;
      if (users > 0)
        throw LoraInUse(fmt::format("the served LoRA '{}' is in use by {} request(s); unload it when they finish",
                                    name, users));
      std::erase_if(loras_, [&](const phi4mm::ServedLora& l) { return l.number == number; });
    }
    model_->remove_served_lora(number);
  });
}

std::vector<phi4mm::ServedLora> Engine::loras() const {
  std::lock_guard<std::mutex> lk(mu_);
  return loras_;
}

std::optional<phi4mm::ServedLora> Engine::find_lora(const std::string& name) const {
  std::lock_guard<std::mutex> lk(mu_);
  for (const phi4mm::ServedLora& l : loras_)
    if (l.name == name) return l;
  return std::nullopt;
}

void Engine::abort(int64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  aborts_.push_back(id);
  cv_.notify_all();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  EngineStats s = published_;
  s.requests_total = requests_total_;
  s.media_items_total = media_items_total_;
  s.media_seconds_total = media_seconds_total_;
  s.media_cache_hits = media_cache_hits_;
  s.waiting += int64_t(inbox_.size());
  return s;
}

void Engine::take_inbox() {
  std::vector<int64_t> aborts;
  {
    std::lock_guard<std::mutex> lk(mu_);
    while (!inbox_.empty()) {
      waiting_.push_back(std::move(inbox_.front()));
      inbox_.pop_front();
    }
    aborts.swap(aborts_);
  }
  for (int64_t id : aborts) {
    for (auto& q : waiting_)
      if (q && q->id == id && !q->done) finish_request(*q, FinishReason::abort, q->cb_error);
    for (auto& q : active_)
      if (q->id == id && !q->done) finish_request(*q, FinishReason::abort, q->cb_error);
  }
  std::erase_if(waiting_, [](const std::unique_ptr<Req>& q) { return q->done; });
}

void Engine::release(Seq& s) {
  if (!s.kv.blocks.empty() || s.kv.length) cache_->release(s.kv);
  s.remembered = 0;
  s.digests.clear();
}

// The media rows of a request: each item from the media cache when it is
// there (same item, same salt, for a clip the same projector), the others
// encoded together here, on the submitting thread (an image never stalls the
// decode steps of the engine thread), then kept in the cache, least recently
// used out past its bytes. Sets q.media_rows and, with prefix caching,
// q.media_digest.
void Engine::encode_media(Req& q, const std::vector<phi4mm::Media>& media, int64_t n_media,
                          const std::function<void()>& check_accepting) {
  const int64_t H = model_->config().text.hidden_size;
  const size_t n = media.size();
  bool with_image = false;
  for (const phi4mm::Media& m : media) with_image |= m.kind == phi4mm::MediaKind::kImage;
  const bool cached = opts_.media_cache_bytes > 0;
  std::vector<std::string> keys(cached ? n : 0);
  std::vector<Tensor> parts(n);
  std::vector<std::vector<std::string>> digests(n);
  int64_t hits = 0;
  if (cached) {
    for (size_t i = 0; i < n; ++i)
      keys[i] = media_item_key(q.salt_digest, media[i], with_image, model_->config().vision.dynamic_hd);
    std::lock_guard<std::mutex> lk(media_mu_);
    for (size_t i = 0; i < n; ++i)
      if (auto it = media_by_key_.find(keys[i]); it != media_by_key_.end()) {
        media_lru_.splice(media_lru_.begin(), media_lru_, it->second);
        parts[i] = it->second->second.rows;
        digests[i] = it->second->second.row_digests;
        ++hits;
      }
  }
  std::vector<phi4mm::Media> misses;
  for (size_t i = 0; i < n; ++i)
    if (!parts[i].defined()) misses.push_back(media[i]);
  if (!misses.empty()) {
    // A request that would be refused anyway is refused before this work.
    {
      std::lock_guard<std::mutex> lk(mu_);
      check_accepting();
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<Tensor> encoded;
    try {
      NoGradGuard ng;
      encoded = phi4mm::media_rows_each(*model_, misses, with_image);
      release_cpu_threads();  // the towers' workers: this thread is done with ops
    } catch (const std::exception& e) {
      release_cpu_threads();
      throw std::runtime_error(fmt::format("media encoding failed: {}", e.what()));
    }
    if (encoded.size() != misses.size())
      throw std::runtime_error(fmt::format("media encoding failed: {} row sets for {} items", encoded.size(),
                                           misses.size()));
    for (size_t i = 0, k = 0; i < n; ++i)
      if (!parts[i].defined()) parts[i] = encoded[k++];
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard<std::mutex> lk(mu_);
    media_items_total_ += int64_t(misses.size());
    media_seconds_total_ += secs;
  }
  int64_t rows = 0;
  for (const Tensor& t : parts) {
    if (t.dim() != 2 || t.size(1) != H)
      throw std::runtime_error(fmt::format("media encoding failed: media rows {} (hidden {})", shape_str(t.shape()), H));
    rows += t.size(0);
  }
  if (rows != n_media)
    throw std::invalid_argument(fmt::format("prompt: {} media placeholder ids, but its media give {} rows", n_media, rows));
  q.media_rows = n == 1 ? parts[0] : cat(parts, 0);
  if (opts_.prefix_caching)
    for (size_t i = 0; i < n; ++i) {
      if (digests[i].empty()) digests[i] = row_digests(parts[i]);
      q.media_digest.insert(q.media_digest.end(), digests[i].begin(), digests[i].end());
    }
  if (hits) {
    std::lock_guard<std::mutex> lk(mu_);
    media_cache_hits_ += hits;
  }
  if (!cached) return;
  std::lock_guard<std::mutex> lk(media_mu_);
  for (size_t i = 0; i < n; ++i) {
    const size_t bytes = size_t(parts[i].numel()) * dtype_size(parts[i].dtype());
    if (bytes > opts_.media_cache_bytes || media_by_key_.count(keys[i])) continue;
    media_lru_.emplace_front(keys[i], MediaEntry{parts[i], digests[i], bytes});
    media_by_key_[keys[i]] = media_lru_.begin();
    media_bytes_ += bytes;
    while (media_bytes_ > opts_.media_cache_bytes) {
      media_bytes_ -= media_lru_.back().second.bytes;
      media_by_key_.erase(media_lru_.back().first);
      media_lru_.pop_back();
    }
  }
}

std::string Engine::audit() const {
  const phi4mm::BlockManager& bm = cache_->manager();
  if (std::string e = bm.audit(); !e.empty()) return e;
  std::vector<int32_t> named(size_t(bm.num_blocks()), 0);
  for (const auto& q : active_)
    for (const auto& s : q->seqs) {
      const KvSequence& kv = s->kv;
      if (s->finished && !kv.blocks.empty()) return fmt::format("request {}: a finished sample holds blocks", q->id);
      if (int64_t(kv.blocks.size()) < cache_->blocks_for(kv.length))
        return fmt::format("request {}: {} blocks for {} tokens", q->id, kv.blocks.size(), kv.length);
      if (s->remembered > int64_t(kv.blocks.size()) || s->remembered > int64_t(s->digests.size()))
        return fmt::format("request {}: {} blocks remembered", q->id, s->remembered);
      std::set<int64_t> distinct(kv.blocks.begin(), kv.blocks.end());
      if (distinct.size() != kv.blocks.size()) return fmt::format("request {}: a block twice in one table", q->id);
      for (int64_t b : kv.blocks) {
        if (b < 0 || b >= bm.num_blocks()) return fmt::format("request {}: block id {}", q->id, b);
        named[size_t(b)]++;
      }
    }
  for (int64_t b = 0; b < bm.num_blocks(); ++b)
    if (bm.holds(b) != named[size_t(b)])
      return fmt::format("block {}: {} holds, named by {} tables", b, bm.holds(b), named[size_t(b)]);
  return {};
}

void Engine::preempt(Seq& s) {
  release(s);
  std::erase(running_, &s);
  preempted_.push_back(&s);
  stats_.preemptions++;
}

// Marks `s` finished, frees its blocks, and sets o.done when it was its
// request's last sample (the request then counts as finished).
void Engine::end_sample(Seq& s, RequestOutput& o) {
  Req& q = *s.req;
  s.finished = true;
  release(s);
  std::erase(running_, &s);
  q.finished++;
  o.done = q.finished == int64_t(q.seqs.size());
  if (o.done) o.cached_tokens = std::max<int64_t>(0, q.cached_tokens);
  if (o.done && !q.done) {
    q.done = true;
    stats_.requests_finished++;
  }
}

// Ends every unfinished sample of the request with `why` and reports it.
void Engine::finish_request(Req& q, FinishReason why, const std::string& error) {
  for (auto& s : q.seqs) {
    if (s->finished) continue;
    s->finished = true;
    release(*s);
    std::erase(running_, s.get());
    std::erase(preempted_, s.get());
    q.finished++;
    RequestOutput o;
    o.sample = s->sample;
    o.finish = why;
    o.done = q.finished == int64_t(q.seqs.size());
    if (o.done) o.error = error;
    q.cb(o);
  }
  if (q.seqs.empty() && !q.done) {  // never admitted
    RequestOutput o;
    o.sample = -1;
    o.finish = why;
    o.error = error;
    o.done = true;
    q.cb(o);
  }
  if (!q.done) {
    q.done = true;
    if (!error.empty()) stats_.requests_failed++;
    else if (why == FinishReason::abort) stats_.requests_aborted++;
    else stats_.requests_finished++;
  }
}

bool Engine::step() {
  take_inbox();
  run_controls();
  const bool work = !waiting_.empty() || !running_.empty() || !preempted_.empty();
  if (work) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      schedule_and_run();
    } catch (const std::exception& e) {
      // The last line of defence: the forward and the picks fail only their
      // own requests; anything else thrown here fails every admitted
      // request, frees its blocks and keeps the engine (and server) alive.
      fail_admitted(fmt::format("engine error: {}", e.what()));
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats_.steps++;
    stats_.step_seconds_total += dt;
    stats_.last_step_seconds = dt;
  }
  std::erase_if(active_, [](const std::unique_ptr<Req>& q) { return q->done; });
  stats_.running = int64_t(running_.size());
  stats_.waiting = int64_t(waiting_.size() + preempted_.size());
  stats_.lora_running_waiting.clear();
  for (const Seq* s : running_)
    if (s->req->r.served_lora) stats_.lora_running_waiting[s->req->r.served_lora].first++;
  for (const Seq* s : preempted_)
    if (s->req->r.served_lora) stats_.lora_running_waiting[s->req->r.served_lora].second++;
  for (const auto& q : waiting_)
    if (q && q->r.served_lora) stats_.lora_running_waiting[q->r.served_lora].second++;
  stats_.kv_blocks_used = cache_->manager().num_used();
  stats_.kv_blocks_cached = cache_->manager().num_cached();
  stats_.kv_touched_bytes = cache_->touched_bytes();
  {
    std::lock_guard<std::mutex> lk(mu_);
    published_ = stats_;
  }
  return work;
}

void Engine::fail_admitted(const std::string& why) {
  for (auto& q : active_)
    while (!q->done) {
      // Whatever throws inside (the callbacks cannot: submit wraps them),
      // each call makes progress: finish_request marks a sample finished
      // before it frees or reports it.
      try {
        finish_request(*q, FinishReason::abort, why);
      } catch (const std::exception&) {
      }
    }
}

void Engine::run_until_idle() {
  while (step()) {
  }
}

void Engine::start() {
  if (thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = false;
  }
  thread_ = std::thread([this] {
    // Inference only: a model whose parameters require grad (a trainer's,
    // served to its agents) records no autograd graph here.
    NoGradGuard ng;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [this] {
          return stopping_ || !inbox_.empty() || !aborts_.empty() || !controls_.empty() || !running_.empty() ||
                 !waiting_.empty() || !preempted_.empty();
        });
        if (stopping_ && (!drain_ || (inbox_.empty() && running_.empty() && waiting_.empty() &&
                                      preempted_.empty())))
          break;
      }
      step();
    }
  });
}

void Engine::stop(bool drain) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    drain_ = drain;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  {
    // Whatever is left (not drained, or never stepped) ends as aborted; a
    // load or unload still queued runs here (its caller waits for it).
    take_inbox();
    run_controls();
    for (auto& q : waiting_)
      if (!q->done) finish_request(*q, FinishReason::abort);
    for (auto& q : active_)
      if (!q->done) finish_request(*q, FinishReason::abort);
    waiting_.clear();
    active_.clear();
  }
}

// ---- scheduling and sampling ----

// ---- one step: plan, run, emit ----

// One sequence's chunk in a step.
struct Engine::StepItem {
  Seq* s;
  int64_t start, len;
  RopeTable table;
  bool sample;        // the chunk ends the sequence's tokens: sample the next one
  bool prompt_rows;   // logits of every row for prompt logprobs
  // Speculative decoding: tokens proposed after the sequence's last one (the
  // chunk's last draft.size() tokens; every row's logits come back).
  std::vector<int64_t> draft = {};
};

// A logits row of the step: its item and its position in the sequence.
struct Engine::RowRef {
  size_t item;
  int64_t pos;
};

// ---- prefix caching ----

// The digest of block i of a sequence chains those before it: SHA-256 of
// block i-1's digest, the rotary table and the adapters (they change every
// key: the row adapter and the served LoRA's uid), the block's token ids
// (prompt or generated) and the digests of the media rows its placeholders
// take. Extends s.digests to n blocks.
void Engine::extend_digests(Seq& s, RopeTable table, int64_t n) const {
  const Req& q = *s.req;
  const int64_t BS = cache_->block_size(), P = q.prompt_len;
  std::string buf;
  for (int64_t i = int64_t(s.digests.size()); i < n; ++i) {
    if (i) buf.assign(reinterpret_cast<const char*>(s.digests.back().data()), s.digests.back().size());
    else buf.assign(q.salt_digest);
    buf += char(table == RopeTable::long_table ? 2 : 1);
    buf += char(int(q.r.adapter));
    buf.append(reinterpret_cast<const char*>(&q.r.served_lora_uid), sizeof q.r.served_lora_uid);  // 0: none
    buf.append(reinterpret_cast<const char*>(s.tokens.data() + i * BS), size_t(BS) * sizeof(int64_t));
    for (int64_t m = q.media_before[size_t(std::min(i * BS, P))]; m < q.media_before[size_t(std::min((i + 1) * BS, P))];
         ++m)
      buf += q.media_digest.at(size_t(m));
    s.digests.push_back(block_digest(buf));
  }
}

bool Engine::caches_prefix(const Seq& s) const {
  return opts_.prefix_caching && s.req->r.params.prompt_logprobs < 0;
}

// An empty sequence (new, or back from preemption) takes the cached blocks
// its tokens start with, all but the last token's (the step that samples
// needs one row to compute). Returns whether it looked.
bool Engine::attach_cached(Seq& s) {
  if (!caches_prefix(s) || s.kv.length != 0 || !s.kv.blocks.empty() || s.pending_fork) return false;
  const RopeTable table = table_for(s);
  lookup_digests(s, table);
  s.remembered = cache_->attach_prefix(s.kv, s.digests, table);
  return true;
}

// The digests an empty sequence looks up: its full blocks before its last
// token (the step that samples computes at least that one).
void Engine::lookup_digests(Seq& s, RopeTable table) const {
  extend_digests(s, table, (int64_t(s.tokens.size()) - 1) / cache_->block_size());
}

// Whether a new request's first sequence (empty) can take its first chunk:
// with prefix caching, the chunk after the cached blocks it will attach (a
// request that shares a long cached prefix needs only its new tokens'
// blocks), else the chunk from its start.
bool Engine::first_chunk_fits(Seq& s) {
  const int64_t n = int64_t(s.tokens.size());
  if (!caches_prefix(s)) return cache_->can_grow(s.kv, std::min<int64_t>(n, opts_.prefill_chunk_tokens));
  const int64_t BS = cache_->block_size();
  lookup_digests(s, table_for(s));
  int64_t idle = 0;
  const int64_t cached = cache_->cached_prefix(s.digests, idle);
  const int64_t chunk = std::min<int64_t>(n - cached * BS, opts_.prefill_chunk_tokens);
  return cache_->manager().can_allocate(idle + cache_->blocks_for(cached * BS + chunk) - cached);
}

// After a forward: the full blocks each sequence has filled, prompt and
// generated tokens alike, are remembered (a next chat turn starts with them).
void Engine::remember_blocks(const std::vector<StepItem>& items) {
  const int64_t BS = cache_->block_size();
  for (const StepItem& it : items) {
    Seq& s = *it.s;
    if (!caches_prefix(s)) continue;
    // Full blocks of kept tokens only (a speculative chunk's drafts are not
    // in s.tokens until they are accepted).
    const int64_t n = std::min<int64_t>(s.kv.length, int64_t(s.tokens.size())) / BS;
    if (s.remembered >= n) continue;
    extend_digests(s, s.kv.rope, n);
    for (; s.remembered < n; ++s.remembered) cache_->remember(s.kv, s.remembered, s.digests[size_t(s.remembered)]);
  }
}

void Engine::schedule_and_run() {
  std::vector<StepItem> items = plan_step();
  if (items.empty()) return;
  // The rows of one adapter next to each other: a served LoRA (and the
  // vision or speech adapter) then costs one run of rows per step instead of
  // one per sequence (LoraLinear::forward: two small GEMMs a run). Nothing
  // else depends on the order: a row's results do not depend on its place
  // in the batch, sampling is seeded per request, and the items of one
  // request keep their order.
  std::stable_sort(items.begin(), items.end(), [](const StepItem& a, const StepItem& b) {
    const Request& ra = a.s->req->r;
    const Request& rb = b.s->req->r;
    return std::pair(ra.served_lora, int(ra.adapter)) < std::pair(rb.served_lora, int(rb.adapter));
  });
  std::vector<RowRef> rows;
  const Tensor logits = run_step(items, rows);
  if (!logits.defined()) return;  // the batch failed; its requests were failed
  remember_blocks(items);
  emit_step(items, rows, static_cast<const float*>(logits.data_ptr()));
}

RopeTable Engine::table_for(const Seq& s) const {
  return s.kv.length == 0 ? phi4mm::rope_table_for_length(*model_, int64_t(s.tokens.size())) : s.kv.rope;
}

int64_t Engine::chunk_for(const Seq& s, int64_t budget) const {
  int64_t pending = int64_t(s.tokens.size()) - s.kv.length;
  int64_t c = std::min({pending, opts_.prefill_chunk_tokens, budget});
  // Prompt logprobs need every row's logits: keep those chunks small.
  if (s.req->r.params.prompt_logprobs >= 0 && !s.req->prompt_lp_sent && s.sample == 0) c = std::min<int64_t>(c, 64);
  return c;
}

// Makes room for `s` to grow to `new_len`, preempting the newest sequences.
// Returns false when `s` itself was preempted (or cannot fit at all).
bool Engine::make_room(Seq& s, int64_t new_len, const std::vector<StepItem>& items) {
  while (!cache_->can_grow(s.kv, new_len)) {
    Seq* newest = nullptr;
    for (Seq* r : running_)
      if (!newest || r->order > newest->order) newest = r;
    bool in_batch = false;
    for (auto& it : items) in_batch |= it.s == newest;
    if (!newest || newest == &s || in_batch) {
      if (running_.size() == 1 && running_[0] == &s) {
        // Alone and still too big: the sequence has filled the whole cache.
        finish_request(*s.req, FinishReason::length);
        return false;
      }
      if (std::find(running_.begin(), running_.end(), &s) != running_.end()) preempt(s);
      return false;
    }
    preempt(*newest);
  }
  cache_->reserve(s.kv, new_len);
  return true;
}

// Admits `s` with its first chunk when the cache has room.
bool Engine::admit_seq(Seq& s, std::vector<StepItem>& items, int64_t& budget) {
  const bool looked = attach_cached(s);
  const int64_t c = chunk_for(s, budget);
  if (c <= 0 || !cache_->can_grow(s.kv, s.kv.length + c)) {
    if (looked) release(s);  // the cached blocks it took go back to the cache
    return false;
  }
  if (s.req->cached_tokens < 0) s.req->cached_tokens = looked ? s.kv.length : 0;
  if (looked) {  // counted once per admission
    stats_.prefix_cache_queries += int64_t(s.tokens.size());
    stats_.prefix_cache_hits += s.kv.length;
  }
  const RopeTable table = table_for(s);
  cache_->reserve(s.kv, s.kv.length + c);
  s.order = ++admit_counter_;
  running_.push_back(&s);
  const bool ends = s.kv.length + c == int64_t(s.tokens.size());
  items.push_back({&s, s.kv.length, c, table, ends,
                   s.req->r.params.prompt_logprobs >= 0 && !s.req->prompt_lp_sent && s.sample == 0});
  budget -= c;
  return true;
}

// Plans a step: every running sequence gets its decode token or its next
// prefill chunk (oldest first, within the token budget, making room by
// preempting the newest), then preempted sequences and waiting requests are
// admitted while the budget and max_running last.
std::vector<Engine::StepItem> Engine::plan_step() {
  int64_t budget = opts_.max_batch_tokens;
  std::vector<StepItem> items;
  // 1. Running sequences: decode tokens and prefill chunks, oldest first.
  std::vector<Seq*> order = running_;
  for (Seq* s : order) {
    if (budget <= 0) break;
    if (std::find(running_.begin(), running_.end(), s) == running_.end()) continue;  // preempted meanwhile
    if (s->kv.length > 0 && phi4mm::needs_reprefill(*model_, s->kv, int64_t(s->tokens.size()))) {
      release(*s);  // LongRoPE boundary: recompute everything with the long table
      stats_.reprefills++;
    }
    if (int64_t(s->tokens.size()) <= s->kv.length) {
      // A running sequence always has its next token to compute; one without
      // would make every step report work and spin. Fail it instead.
      finish_request(*s->req, FinishReason::abort, "engine error: a running sequence has nothing to compute");
      continue;
    }
    int64_t c = chunk_for(*s, budget);
    if (c <= 0) continue;
    const RopeTable table = table_for(*s);
    std::vector<int64_t> draft = c == 1 ? draft_for(*s, budget) : std::vector<int64_t>{};
    c += int64_t(draft.size());
    if (!make_room(*s, s->kv.length + c, items)) continue;
    const bool ends = s->kv.length + c - int64_t(draft.size()) == int64_t(s->tokens.size());
    items.push_back({s, s->kv.length, c, table, ends,
                     s->req->r.params.prompt_logprobs >= 0 && !s->req->prompt_lp_sent && s->sample == 0,
                     std::move(draft)});
    budget -= c;
  }

  // 2. Admission: preempted sequences first, then new requests.
  while (!preempted_.empty() && budget > 0 && int64_t(running_.size()) < opts_.max_running) {
    Seq* s = preempted_.front();
    if (admit_seq(*s, items, budget)) {
      preempted_.pop_front();
      continue;
    }
    // Nothing else holds blocks and it still does not fit: its tokens exceed the cache.
    if (running_.empty() && items.empty()) finish_request(*s->req, FinishReason::length);
    else break;
  }
  while (preempted_.empty() && !waiting_.empty() && budget > 0 && int64_t(running_.size()) < opts_.max_running) {
    Req& q = *waiting_.front();
    if (q.seqs.empty()) {
      const bool skip = q.r.params.skip_special_tokens;
      for (int64_t j = 0; j < q.r.params.n; ++j) {
        auto s = std::make_unique<Seq>(*tok_, skip);
        s->req = &q;
        s->sample = j;
        s->tokens = q.r.prompt;
        s->pending_fork = j > 0;
        q.seqs.push_back(std::move(s));
      }
      q.media_before.assign(size_t(q.prompt_len + 1), 0);
      for (int64_t i = 0; i < q.prompt_len; ++i)
        q.media_before[size_t(i + 1)] = q.media_before[size_t(i)] + phi4mm::is_media_token(q.r.prompt[size_t(i)]);
      stats_.prompt_tokens += q.prompt_len;
    }
    if (!first_chunk_fits(*q.seqs[0])) break;
    std::unique_ptr<Req> owned = std::move(waiting_.front());
    waiting_.pop_front();
    Req* qp = owned.get();
    active_.push_back(std::move(owned));
    if (qp->r.params.prompt_logprobs >= 0) qp->prompt_lp.assign(size_t(qp->prompt_len), std::nullopt);
    if (!admit_seq(*qp->seqs[0], items, budget)) preempted_.push_back(qp->seqs[0].get());
  }
  return items;
}

// Runs one forward over every chunk of the step; returns the f32 host logits
// of the rows that need them (`rows`), or an undefined tensor when the batch
// failed (its requests are failed, the engine goes on).
Tensor Engine::run_step(const std::vector<StepItem>& items, std::vector<RowRef>& rows) {
  // 3. One forward over all chunks.
  phi4mm::IncrementalBatch b;
  std::vector<Tensor> media_parts;
  int64_t row0 = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const StepItem& it = items[i];
    Seq& s = *it.s;
    const int64_t d = int64_t(it.draft.size());
    std::vector<int64_t> ids(s.tokens.begin() + it.start, s.tokens.begin() + it.start + it.len - d);
    ids.insert(ids.end(), it.draft.begin(), it.draft.end());
    b.add(s.kv, ids, s.req->r.adapter, it.table, s.req->r.served_lora);
    const int64_t P = s.req->prompt_len;
    if (it.start < P && s.req->media_before.back() > 0) {
      const int64_t a = s.req->media_before[size_t(it.start)];
      const int64_t e = s.req->media_before[size_t(std::min(P, it.start + it.len))];
      if (e > a) media_parts.push_back(s.req->media_rows.narrow(0, a, e - a));
    }
    if (it.prompt_rows || d > 0) {
      for (int64_t r = 0; r < it.len; ++r) {
        b.logit_rows.push_back(row0 + r);
        rows.push_back({i, it.start + r});
      }
    } else if (it.sample) {
      b.logit_rows.push_back(row0 + it.len - 1);
      rows.push_back({i, it.start + it.len - 1});
    }
    row0 += it.len;
  }
  if (!media_parts.empty()) b.media_rows = media_parts.size() == 1 ? media_parts[0] : cat(media_parts, 0);
  if (b.logit_rows.empty()) b.logit_rows.push_back(row0 - 1);  // nothing to sample: keep the forward cheap

  try {
    // Read in place (a contiguous f32 host tensor): no per-step copy of [rows, vocab].
    return phi4mm::forward_incremental(*model_, *cache_, b).to(DType::f32).to(Device::cpu()).contiguous();
  } catch (const std::exception& e) {
    // The batch failed: fail its requests, keep the engine alive.
    std::vector<Req*> failed;
    for (auto& it : items)
      if (std::find(failed.begin(), failed.end(), it.s->req) == failed.end()) failed.push_back(it.s->req);
    for (Req* q : failed) finish_request(*q, FinishReason::abort, fmt::format("engine error: {}", e.what()));
    return Tensor();
  }
}

// Appends the picked token to `s` and reports it (text, stops, finish).
void Engine::report_token(Seq& s, const Picked& picked) {
  Req& q = *s.req;
  const SamplingParams& p = q.r.params;
  if (p.max_tokens == 0) {  // scoring only
    RequestOutput o;
    o.sample = s.sample;
    o.finish = FinishReason::length;
    end_sample(s, o);
    q.cb(o);
    return;
  }
  const std::vector<int64_t>& stop = q.stop_ids;
  const int64_t token = picked.token;

  s.tokens.push_back(token);
  s.generated++;
  s.counts[token]++;
  stats_.generated_tokens++;
  RequestOutput o;
  o.sample = s.sample;
  o.tokens = {token};
  if (picked.logprob) o.logprobs.push_back(*picked.logprob);

  const bool is_stop_token = std::find(stop.begin(), stop.end(), token) != stop.end();
  if (is_stop_token) {
    o.finish = FinishReason::stop;
    o.stop_reason = std::to_string(token);
    s.text += s.dec.flush();
  } else {
    s.text += s.dec.push(tok::TokenId(token));
  }
  // Stop strings: search the new text (with enough overlap for a match across tokens).
  size_t max_stop = 0;
  for (auto& st : p.stop) max_stop = std::max(max_stop, st.size());
  size_t cut = std::string::npos, cut_end = 0;
  if (!p.stop.empty() && o.finish == FinishReason::none) {
    const size_t from = s.emitted;
    for (auto& st : p.stop) {
      const size_t at = s.text.find(st, from);
      if (at != std::string::npos && at < cut) {
        cut = at;
        cut_end = at + st.size();
        o.stop_reason = st;
      }
    }
    if (cut != std::string::npos) o.finish = FinishReason::stop;
  }
  if (o.finish == FinishReason::none &&
      (s.generated >= p.max_tokens || int64_t(s.tokens.size()) >= q.max_context))
    o.finish = FinishReason::length;
  if (o.finish == FinishReason::length) s.text += s.dec.flush();

  size_t end = s.text.size();
  if (cut != std::string::npos) {
    end = p.include_stop_str_in_output ? cut_end : cut;
  } else if (o.finish == FinishReason::none && max_stop > 0) {
    // Hold back the longest suffix that could start a stop string.
    for (size_t h = std::min(max_stop - 1, s.text.size() - s.emitted); h > 0; --h) {
      bool starts = false;
      for (auto& st : p.stop)
        if (st.size() > h && s.text.compare(s.text.size() - h, h, st, 0, h) == 0) starts = true;
      if (starts) {
        end = s.text.size() - h;
        break;
      }
    }
  }
  if (end > s.emitted) {
    o.text = s.text.substr(s.emitted, end - s.emitted);
    s.emitted = end;
  }
  if (o.finish != FinishReason::none) end_sample(s, o);
  q.cb(o);
}

// Emits the step's results: prompt logprobs once a prompt is prefilled, then
// a token for every sequence whose chunk ended (forking n > 1 samples after
// the shared prompt), picked in parallel and reported in order.
void Engine::emit_step(const std::vector<StepItem>& items, const std::vector<RowRef>& rows, const float* host) {
  const int64_t V = model_->config().text.vocab_size;
  // A numerical fault (a non-finite logit: NaN or inf from the weights or the
  // media rows) fails that request with an error; nothing of the row reaches
  // the client as a token or a logprob, and the batch's other requests go on.
  for (size_t r = 0; r < rows.size(); ++r) {
    Req& q = *items[rows[r].item].s->req;
    if (q.done) continue;
    const float* row = host + size_t(r) * size_t(V);
    // NaN and inf have every exponent bit set: an integer OR over the row (a
    // loop the compiler vectorises), then a search only in a faulty row.
    uint32_t nonfinite = 0;
    for (int64_t id = 0; id < V; ++id)
      nonfinite |= uint32_t((std::bit_cast<uint32_t>(row[id]) & 0x7f800000u) == 0x7f800000u);
    if (!nonfinite) continue;
    int64_t bad = 0;
    while (bad < V && std::isfinite(row[bad])) ++bad;
    const std::string why = fmt::format(
        "numerical fault: the model produced a non-finite logit ({} for token {}) at position {} of request {}; "
        "the request was stopped", row[bad], bad, rows[r].pos, q.id);
    fmt::print(stderr, "engine: {}\n", why);
    stats_.numerical_faults++;
    finish_request(q, FinishReason::abort, why);
  }
  // 4. Prompt logprobs and sampling.
  std::unordered_map<const Seq*, const float*> last_row;
  std::unordered_map<size_t, std::vector<const float*>> draft_rows;  // a speculative chunk's rows, in order
  for (size_t r = 0; r < rows.size(); ++r) {
    const StepItem& it = items[rows[r].item];
    const float* row = host + size_t(r) * size_t(V);
    Seq& s = *it.s;
    Req& q = *s.req;
    if (q.done) continue;
    const int64_t p = rows[r].pos;
    if (it.prompt_rows && p + 1 < q.prompt_len) {
      const double lse = log_sum_exp(row, V);
      q.prompt_lp[size_t(p + 1)] =
          make_logprob(row, V, lse, q.r.prompt[size_t(p + 1)], q.r.params.prompt_logprobs, /*with_rank=*/true);
    }
    if (it.sample && p == it.start + it.len - 1) last_row[&s] = row;
    if (!it.draft.empty()) draft_rows[rows[r].item].push_back(row);
  }
  // Prompt logprobs go out once the prompt prefill is complete.
  for (auto& it : items) {
    Req& q = *it.s->req;
    if (!q.done && it.prompt_rows && it.start + it.len >= q.prompt_len && !q.prompt_lp_sent) {
      q.prompt_lp_sent = true;
      RequestOutput o;
      o.sample = -1;
      o.prompt_logprobs = q.prompt_lp;
      q.cb(o);
    }
  }

  // Forks first (n > 1: the prompt was prefilled once; the other samples
  // share its full blocks and copy the partial last one), then every token is picked in parallel, then reported in order.
  struct Job {
    Seq* s;
    const float* row;
    Picked picked;
    std::string error;  // the pick threw: only this request fails
  };
  std::vector<Job> jobs;
  for (auto& it : items) {
    if (!it.sample || !it.draft.empty()) continue;  // drafts: verify_draft below
    Seq& s = *it.s;
    if (s.finished || s.req->done) continue;
    const float* row = last_row.at(&s);
    Req& q = *s.req;
    jobs.push_back({&s, row, {}, {}});
    const bool fork = s.sample == 0 && s.generated == 0 && q.seqs.size() > 1 && q.seqs[1]->pending_fork;
    if (!fork) continue;
    for (size_t j = 1; j < q.seqs.size(); ++j) {
      Seq& c = *q.seqs[j];
      c.pending_fork = false;
      if (int64_t(running_.size()) < opts_.max_running &&
          cache_->manager().can_allocate(cache_->fork_blocks(s.kv))) {
        cache_->fork_sequence(s.kv, c.kv);
        c.order = ++admit_counter_;
        running_.push_back(&c);
        jobs.push_back({&c, row, {}, {}});
      } else {
        preempted_.push_back(&c);  // prefilled on its own later
      }
    }
  }
  const int64_t nj = int64_t(jobs.size());
#pragma omp parallel for schedule(dynamic, 1) if (nj > 1)
  for (int64_t j = 0; j < nj; ++j) {
    Seq& s = *jobs[size_t(j)].s;
    const SamplingParams& p = s.req->r.params;
    // Nothing may leave an OpenMP region: an exception here (a constraint
    // that cannot go on) would end the process.
    try {
      if (p.max_tokens > 0)
        jobs[size_t(j)].picked = pick_token(p, {s.tokens, &s.counts, s.generated, s.sample, s.req->seed},
                                            jobs[size_t(j)].row, V, s.req->stop_ids);
    } catch (const std::exception& e) {
      jobs[size_t(j)].error = e.what();
    }
  }
  for (auto& j : jobs) {
    if (j.s->finished || j.s->req->done) continue;
    if (!j.error.empty()) fail_sampling(*j.s->req, j.error);
    else report_token(*j.s, j.picked);
  }
  // Speculative chunks: their rows in order, each picked as plain decoding would.
  for (size_t i = 0; i < items.size(); ++i)
    if (!items[i].draft.empty()) verify_draft(items[i], draft_rows[i]);
}

// ---- speculative decoding (prompt lookup) ----

// The drafts a sequence in decode proposes this step (none: decode as usual):
// prompt lookup (propose_draft) when speculation is on and the sequence has
// produced a token (the first one forks n > 1 samples), at most what its
// max_tokens, context, the step's budget and the free blocks allow (a draft
// never preempts), and never across the LongRoPE boundary (crossing it
// re-prefills).
std::vector<int64_t> Engine::draft_for(const Seq& s, int64_t budget) const {
  if (opts_.speculative_tokens <= 0 || s.generated < 1) return {};
  const Req& q = *s.req;
  const int64_t n = int64_t(s.tokens.size());
  if (n - s.kv.length != 1) return {};
  const int64_t k = std::min({opts_.speculative_tokens, budget - 1, q.r.params.max_tokens - s.generated - 1,
                              q.max_context - n - 1});
  if (k < 1) return {};
  std::vector<int64_t> d = propose_draft(s, k);
  while (!d.empty() && (!cache_->can_grow(s.kv, n + int64_t(d.size())) ||
                        phi4mm::needs_reprefill(*model_, s.kv, n + int64_t(d.size()))))
    d.pop_back();  // as many drafts as fit
  return d;
}

// The tokens that followed an earlier occurrence of the sequence's longest
// suffix of prompt_lookup_max .. prompt_lookup_min tokens (within its last
// 8192 tokens), at most `max_tokens` of them, cut at a media placeholder
// (whose rows come with the request). Of the occurrences of that length, the
// latest that `max_tokens` tokens follow, else the one most tokens follow (in
// a loop shorter than the draft, the latest match is followed by only a few).
// One backward pass: each position's common suffix with the sequence's end.
std::vector<int64_t> Engine::propose_draft(const Seq& s, int64_t max_tokens) const {
  const std::vector<int64_t>& t = s.tokens;
  const int64_t n = int64_t(t.size()), lo = std::max<int64_t>(0, n - 8192);
  const int64_t gmax = std::min(opts_.prompt_lookup_max, n - 1);
  int64_t best = -1, best_len = 0;  // the match ends at t[best]
  for (int64_t j = n - 2; j >= lo; --j) {
    int64_t m = 0;
    while (m < gmax && j - m >= 0 && t[size_t(j - m)] == t[size_t(n - 1 - m)]) ++m;
    if (m > best_len || (m == best_len && m > 0 && n - 1 - best < max_tokens)) best = j, best_len = m;
    if (best_len == gmax && n - 1 - best >= max_tokens) break;
  }
  std::vector<int64_t> d;
  if (best < 0 || best_len < opts_.prompt_lookup_min) return d;
  for (int64_t k = best + 1; k < n && int64_t(d.size()) < max_tokens && !phi4mm::is_media_token(t[size_t(k)]); ++k)
    d.push_back(t[size_t(k)]);
  return d;
}

// A pick that threw (a constrained output that cannot go on): the request
// fails with the reason, the others go on.
void Engine::fail_sampling(Req& q, const std::string& why) {
  finish_request(q, FinishReason::abort, fmt::format("engine error: sampling failed: {}", why));
}

// Picks the rows of a speculative chunk in order, as plain decoding would
// (row i is the distribution after the sequence's last token and drafts
// 0..i-1), reporting each pick; draft i is kept while it equals pick i. The
// K/V of the rejected drafts are dropped (the sequence's length is its last
// kept token's position + 1; its next chunk starts at the last pick).
void Engine::verify_draft(const StepItem& it, const std::vector<const float*>& rows) {
  Seq& s = *it.s;
  Req& q = *s.req;
  if (s.finished || q.done) return;
  const int64_t V = model_->config().text.vocab_size, d = int64_t(it.draft.size());
  stats_.spec_draft_tokens += d;
  int64_t kept = 0;
  for (int64_t i = 0; i <= d; ++i) {
    Picked picked;
    try {
      picked = pick_token(q.r.params, {s.tokens, &s.counts, s.generated, s.sample, q.seed}, rows[size_t(i)], V, q.stop_ids);
    } catch (const std::exception& e) {
      fail_sampling(q, e.what());
      return;
    }
    report_token(s, picked);
    if (s.finished || q.done || i == d || picked.token != it.draft[size_t(i)]) break;
    ++kept;
  }
  stats_.spec_accepted_tokens += kept;
  if (!s.finished && !q.done) cache_->truncate(s.kv, it.start + 1 + kept);
}

// ---- blocking helpers ----

std::vector<std::vector<Completion>> generate(Engine& engine, std::vector<Request> requests) {
  if (engine.running()) throw std::logic_error("generate: the engine is already stepping on its own thread");
  std::vector<std::vector<Completion>> out(requests.size());
  std::vector<std::string> errors(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    out[i].resize(size_t(requests[i].params.n));
    engine.submit(std::move(requests[i]), [&out, &errors, i](const RequestOutput& o) {
      if (!o.error.empty()) errors[i] = o.error;
      if (o.sample < 0) return;
      Completion& c = out[i][size_t(o.sample)];
      c.tokens.insert(c.tokens.end(), o.tokens.begin(), o.tokens.end());
      for (auto& lp : o.logprobs) c.logprobs.push_back(lp.logprob);
      c.text += o.text;
      if (o.finish != FinishReason::none) c.finish = o.finish;
    });
  }
  engine.run_until_idle();
  for (size_t i = 0; i < errors.size(); ++i)
    if (!errors[i].empty()) throw std::runtime_error(fmt::format("generate: request {}: {}", i, errors[i]));
  return out;
}

}  // namespace areno::serve
