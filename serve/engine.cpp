#include "serve/engine.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <unordered_map>

#include <fmt/format.h>

#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "tensor/autograd.h"

namespace areno::serve {

using phi4mm::KvSequence;
using phi4mm::RopeTable;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The uniform number of generated token `step` of sample `sample`: a pure
// function of its arguments, so batching and preemption cannot change it.
double uniform01(uint64_t seed, int64_t sample, int64_t step) {
  uint64_t h = splitmix64(seed ^ splitmix64(uint64_t(sample) * 0xD1B54A32D192ED03ull ^ splitmix64(uint64_t(step))));
  return double(h >> 11) * 0x1.0p-53;
}

// Ids the sampler never produces: unused/padding rows and the media placeholders.
const std::vector<uint8_t>& banned_ids(int64_t V) {
  static const std::vector<uint8_t> ban = [V] {
    std::vector<uint8_t> b(static_cast<size_t>(V));
    for (int64_t id = 0; id < V; ++id) b[size_t(id)] = phi4mm::is_unused_id(tok::TokenId(id)) || phi4mm::is_media_token(id);
    return b;
  }();
  if (int64_t(ban.size()) != V) throw std::logic_error("banned_ids: one vocabulary size per process");
  return ban;
}

// exp(x) for x <= 0, as tensor kernels compute it without a call so the
// sampler's loop vectorises: 2^t with t = x log2(e) split into an integer and
// a fraction in [-0.5, 0.5], a degree-6 Taylor polynomial for 2^f (relative
// error about 1e-7). x below -87 gives 2^-125.5 (close to 0; callers mask
// banned ids explicitly).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.4426950408889634f;
  const float n = std::nearbyint(t);
  const float f = (t - n) * 0.6931471805599453f;  // ln(2^(t-n)) in [-0.347, 0.347]
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  return p * std::bit_cast<float>((int32_t(n) + 127) << 23);
}

// log-sum-exp of a row (finite entries).
double log_sum_exp(const float* x, int64_t n) {
  float mx = kNegInf;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  if (mx == kNegInf) return double(kNegInf);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(double(x[i]) - double(mx));
  return double(mx) + std::log(s);
}

// The k largest entries of x (ties: lower id first), best first.
std::vector<int64_t> top_ids(const float* x, int64_t n, int64_t k) {
  k = std::min(k, n);
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [x](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  idx.resize(size_t(k));
  return idx;
}

TokenLogprob make_logprob(const float* row, int64_t n, double lse, int64_t token, int64_t k) {
  TokenLogprob t;
  t.token = token;
  t.logprob = float(double(row[token]) - lse);
  if (k > 0)
    for (int64_t id : top_ids(row, n, k)) t.top.emplace_back(id, float(double(row[id]) - lse));
  return t;
}

}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::abort: return "abort";
    case FinishReason::none: break;
  }
  return nullptr;
}

void validate(const SamplingParams& p, int64_t vocab_size) {
  auto bad = [](const char* field, const std::string& why) {
    throw std::invalid_argument(fmt::format("{}: {}", field, why));
  };
  if (p.n < 1) bad("n", "must be at least 1");
  if (!(p.temperature >= 0 && p.temperature <= 100)) bad("temperature", "must be in [0, 100]");
  if (!(p.top_p > 0 && p.top_p <= 1)) bad("top_p", "must be in (0, 1]");
  if (!(p.min_p >= 0 && p.min_p <= 1)) bad("min_p", "must be in [0, 1]");
  if (!(p.presence_penalty >= -2 && p.presence_penalty <= 2)) bad("presence_penalty", "must be in [-2, 2]");
  if (!(p.frequency_penalty >= -2 && p.frequency_penalty <= 2)) bad("frequency_penalty", "must be in [-2, 2]");
  if (!(p.repetition_penalty > 0 && std::isfinite(p.repetition_penalty)))
    bad("repetition_penalty", "must be a positive number");
  if (p.max_tokens < 0) bad("max_tokens", "must be at least 0");
  if (p.min_tokens < 0 || p.min_tokens > p.max_tokens) bad("min_tokens", "must be in [0, max_tokens]");
  if (p.logprobs > 20 || p.logprobs < -1) bad("logprobs", "must be in [0, 20]");
  if (p.prompt_logprobs > 20 || p.prompt_logprobs < -1) bad("prompt_logprobs", "must be in [0, 20]");
  for (auto& s : p.stop)
    if (s.empty()) bad("stop", "stop strings must not be empty");
  for (int64_t id : p.stop_token_ids)
    if (id < 0 || id >= vocab_size) bad("stop_token_ids", fmt::format("id {} is outside [0, {})", id, vocab_size));
  for (auto& [id, b] : p.logit_bias) {
    if (id < 0 || id >= vocab_size) bad("logit_bias", fmt::format("id {} is outside [0, {})", id, vocab_size));
    if (!(b >= -100 && b <= 100)) bad("logit_bias", "values must be in [-100, 100]");
  }
}

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
  std::vector<std::unique_ptr<Seq>> seqs;
  std::vector<std::optional<TokenLogprob>> prompt_lp;
  bool prompt_lp_sent = false;
  bool aborted = false, done = false;
  int64_t finished = 0;
};

Engine::Engine(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::shared_ptr<const tok::Tokenizer> tokenizer,
               EngineOptions opts)
    : model_(std::move(model)), tok_(std::move(tokenizer)), opts_(std::move(opts)), seed_state_(opts_.seed) {
  if (!model_ || !tok_) throw std::invalid_argument("Engine: model and tokenizer are required");
  if (opts_.max_running < 1) throw std::invalid_argument("Engine: max_running must be at least 1");
  if (opts_.max_batch_tokens < 1) throw std::invalid_argument("Engine: max_batch_tokens must be at least 1");
  if (opts_.prefill_chunk_tokens < 1) throw std::invalid_argument("Engine: prefill_chunk_tokens must be at least 1");
  const int64_t blocks = opts_.kv_blocks > 0
                             ? opts_.kv_blocks
                             : phi4mm::PagedKvCache::blocks_for_budget(*model_, opts_.kv_cache_bytes, opts_.block_size);
  cache_ = std::make_unique<phi4mm::PagedKvCache>(*model_, blocks, opts_.block_size);
  stats_.kv_blocks_total = blocks;
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
  if (!r.media.empty()) {
    // The processors and towers run here, on the submitting thread, so an
    // image never stalls the decode steps of the engine thread. A request
    // that would be refused anyway is refused before this work.
    {
      std::lock_guard<std::mutex> lk(mu_);
      check_accepting();
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      NoGradGuard ng;
      q->media_rows = phi4mm::media_rows(*model_, r.media);
    } catch (const std::exception& e) {
      throw std::runtime_error(fmt::format("media encoding failed: {}", e.what()));
    }
    if (q->media_rows.dim() != 2 || q->media_rows.size(0) != n_media || q->media_rows.size(1) != H)
      throw std::runtime_error(fmt::format("media encoding failed: media rows {} do not match the prompt's {} "
                                           "placeholders", shape_str(q->media_rows.shape()), n_media));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard<std::mutex> lk(mu_);
    media_items_total_ += int64_t(r.media.size());
    media_seconds_total_ += secs;
    r.media.clear();  // the rows are what the engine keeps
  }
  q->r = std::move(r);
  q->cb = std::move(on_output);
  q->prompt_len = P;
  q->max_context = ctx;
  std::lock_guard<std::mutex> lk(mu_);
  check_accepting();
  q->id = next_id_++;
  seed_state_ = splitmix64(seed_state_);
  q->seed = q->r.params.seed.value_or(seed_state_);
  const int64_t id = q->id;
  inbox_.push_back(std::move(q));
  requests_total_++;
  cv_.notify_all();
  return id;
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
      if (q && q->id == id && !q->done) finish_request(*q, FinishReason::abort);
    for (auto& q : active_)
      if (q->id == id && !q->done) finish_request(*q, FinishReason::abort);
  }
  std::erase_if(waiting_, [](const std::unique_ptr<Req>& q) { return q->done; });
}

void Engine::release(Seq& s) {
  if (!s.kv.blocks.empty() || s.kv.length) cache_->release(s.kv);
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
  const bool work = !waiting_.empty() || !running_.empty() || !preempted_.empty();
  if (work) {
    const auto t0 = std::chrono::steady_clock::now();
    schedule_and_run();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats_.steps++;
    stats_.step_seconds_total += dt;
    stats_.last_step_seconds = dt;
  }
  std::erase_if(active_, [](const std::unique_ptr<Req>& q) { return q->done; });
  stats_.running = int64_t(running_.size());
  stats_.waiting = int64_t(waiting_.size() + preempted_.size());
  stats_.kv_blocks_used = cache_->manager().num_used();
  {
    std::lock_guard<std::mutex> lk(mu_);
    published_ = stats_;
  }
  return work;
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
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [this] {
          return stopping_ || !inbox_.empty() || !aborts_.empty() || !running_.empty() || !waiting_.empty() ||
                 !preempted_.empty();
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
    // Whatever is left (not drained, or never stepped) ends as aborted.
    take_inbox();
    for (auto& q : waiting_)
      if (!q->done) finish_request(*q, FinishReason::abort);
    for (auto& q : active_)
      if (!q->done) finish_request(*q, FinishReason::abort);
    waiting_.clear();
    active_.clear();
  }
}

// ---- scheduling and sampling ----

namespace {

struct Sampled {
  int64_t token;
  bool stop_token;
};

}  // namespace

// The token a sequence samples from its logits row (thread-safe: reads the
// sequence, writes only `work` and `probs`).
Engine::Picked Engine::pick(const Seq& s, const float* row, const std::vector<int64_t>& stop_ids,
                            std::vector<float>& work, std::vector<double>& probs) const {
  const int64_t V = model_->config().text.vocab_size;
  const SamplingParams& p = s.req->r.params;
  const uint64_t seed = s.req->seed;
  work.resize(size_t(V));
  // Processed logits.
  const std::vector<uint8_t>& ban = banned_ids(V);
  for (int64_t id = 0; id < V; ++id) work[size_t(id)] = ban[size_t(id)] ? kNegInf : row[id];
  for (auto& [id, bias] : p.logit_bias) work[size_t(id)] += float(bias);
  if (p.repetition_penalty != 1.0) {
    std::vector<uint8_t> seen(static_cast<size_t>(V), 0);
    for (int64_t t : s.tokens) seen[size_t(t)] = 1;
    for (int64_t id = 0; id < V; ++id)
      if (seen[size_t(id)]) {
        float& l = work[size_t(id)];
        l = l > 0 ? float(l / p.repetition_penalty) : float(l * p.repetition_penalty);
      }
  }
  if (p.presence_penalty != 0 || p.frequency_penalty != 0)
    for (auto& [id, c] : s.counts)
      work[size_t(id)] -= float(p.frequency_penalty * double(c) + p.presence_penalty);
  if (s.generated < p.min_tokens)
    for (int64_t id : stop_ids) work[size_t(id)] = kNegInf;

  int64_t token = 0;
  if (p.temperature == 0) {
    float best = kNegInf;
    for (int64_t id = 0; id < V; ++id)
      if (work[size_t(id)] > best) best = work[size_t(id)], token = id;
  } else {
    float mx = kNegInf;
    for (float x : work) mx = std::max(mx, x);
    const double inv_t = 1.0 / p.temperature;
    std::vector<double>& prob = probs;
    prob.resize(size_t(V));
    const float inv_tf = float(inv_t);
    const float* w = work.data();
    double* pr = prob.data();
    for (int64_t id = 0; id < V; ++id) pr[id] = w[id] == kNegInf ? 0.0f : exp_nonpositive((w[id] - mx) * inv_tf);
    double total = 0;
    for (int64_t id = 0; id < V; ++id) total += pr[id];
    for (double& x : prob) x /= total;
    const double u = uniform01(seed, s.sample, s.generated);
    const bool filter = p.top_k > 0 || p.top_p < 1 || p.min_p > 0;
    if (!filter) {
      double acc = 0;
      token = -1;
      for (int64_t id = 0; id < V; ++id) {
        if (prob[size_t(id)] == 0) continue;
        acc += prob[size_t(id)];
        token = id;
        if (u < acc) break;
      }
    } else {
      // Candidates best first; keep top_k, then the smallest prefix reaching top_p, then min_p.
      auto better = [&](int64_t a, int64_t b) {
        return prob[size_t(a)] > prob[size_t(b)] || (prob[size_t(a)] == prob[size_t(b)] && a < b);
      };
      // Only tokens with a non-zero probability are candidates.
      std::vector<int64_t> idx;
      for (int64_t id = 0; id < V; ++id)
        if (prob[size_t(id)] > 0) idx.push_back(id);
      const int64_t n = int64_t(idx.size());
      int64_t k = p.top_k > 0 ? std::min(p.top_k, n) : n;
      int64_t sorted = std::min<int64_t>(k, 1024);
      std::nth_element(idx.begin(), idx.begin() + (sorted - 1), idx.end(), better);
      std::sort(idx.begin(), idx.begin() + sorted, better);
      double cum = 0;
      for (int64_t i = 0; i < sorted; ++i) cum += prob[size_t(idx[size_t(i)])];
      if (sorted < k && cum < p.top_p) {
        std::sort(idx.begin(), idx.end(), better);
        sorted = k;
      }
      int64_t keep = 0;
      cum = 0;
      const double floor = p.min_p * prob[size_t(idx[0])];
      for (int64_t i = 0; i < sorted; ++i) {
        const double pr = prob[size_t(idx[size_t(i)])];
        if (pr <= 0 || pr < floor) break;
        cum += pr;
        ++keep;
        if (cum >= p.top_p) break;
      }
      keep = std::max<int64_t>(keep, 1);
      double acc = 0;
      token = idx[0];
      for (int64_t i = 0; i < keep; ++i) {
        acc += prob[size_t(idx[size_t(i)])];
        token = idx[size_t(i)];
        if (u * cum < acc) break;
      }
    }
    if (token < 0) token = 0;
  }
  Picked out;
  out.token = token;
  if (p.logprobs >= 0) out.logprob = make_logprob(row, V, log_sum_exp(row, V), token, p.logprobs);
  return out;
}

void Engine::schedule_and_run() {
  const auto& tc = model_->config().text;
  const int64_t V = tc.vocab_size;
  int64_t budget = opts_.max_batch_tokens;
  struct Item {
    Seq* s;
    int64_t start, len;
    RopeTable table;
    bool sample;        // the chunk ends the sequence's tokens: sample the next one
    bool prompt_rows;   // logits of every row for prompt logprobs
  };
  std::vector<Item> items;

  auto table_for = [&](Seq& s) {
    return s.kv.length == 0 ? phi4mm::rope_table_for_length(*model_, int64_t(s.tokens.size())) : s.kv.rope;
  };
  auto chunk_for = [&](Seq& s) {
    int64_t pending = int64_t(s.tokens.size()) - s.kv.length;
    int64_t c = std::min({pending, opts_.prefill_chunk_tokens, budget});
    // Prompt logprobs need every row's logits: keep those chunks small.
    if (s.req->r.params.prompt_logprobs >= 0 && !s.req->prompt_lp_sent && s.sample == 0) c = std::min<int64_t>(c, 64);
    return c;
  };
  // Makes room for `s` to grow to `new_len`, preempting the newest sequences.
  // Returns false when `s` itself was preempted (or cannot fit at all).
  auto make_room = [&](Seq& s, int64_t new_len) {
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
  };

  // 1. Running sequences: decode tokens and prefill chunks, oldest first.
  std::vector<Seq*> order = running_;
  for (Seq* s : order) {
    if (budget <= 0) break;
    if (std::find(running_.begin(), running_.end(), s) == running_.end()) continue;  // preempted meanwhile
    if (s->kv.length > 0 && phi4mm::needs_reprefill(*model_, s->kv, int64_t(s->tokens.size()))) {
      release(*s);  // LongRoPE boundary: recompute everything with the long table
      stats_.reprefills++;
    }
    const int64_t c = chunk_for(*s);
    if (c <= 0) continue;
    const RopeTable table = table_for(*s);
    if (!make_room(*s, s->kv.length + c)) continue;
    const bool ends = s->kv.length + c == int64_t(s->tokens.size());
    items.push_back({s, s->kv.length, c, table, ends,
                     s->req->r.params.prompt_logprobs >= 0 && !s->req->prompt_lp_sent && s->sample == 0});
    budget -= c;
  }

  // 2. Admission: preempted sequences first, then new requests.
  auto admit_seq = [&](Seq& s) {
    const int64_t c = chunk_for(s);
    if (c <= 0 || !cache_->can_grow(s.kv, s.kv.length + c)) return false;
    const RopeTable table = table_for(s);
    cache_->reserve(s.kv, s.kv.length + c);
    s.order = ++admit_counter_;
    running_.push_back(&s);
    const bool ends = s.kv.length + c == int64_t(s.tokens.size());
    items.push_back({&s, s.kv.length, c, table, ends,
                     s.req->r.params.prompt_logprobs >= 0 && !s.req->prompt_lp_sent && s.sample == 0});
    budget -= c;
    return true;
  };
  while (!preempted_.empty() && budget > 0 && int64_t(running_.size()) < opts_.max_running) {
    Seq* s = preempted_.front();
    if (admit_seq(*s)) {
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
    if (!cache_->can_grow(q.seqs[0]->kv, std::min<int64_t>(q.prompt_len, opts_.prefill_chunk_tokens))) break;
    std::unique_ptr<Req> owned = std::move(waiting_.front());
    waiting_.pop_front();
    Req* qp = owned.get();
    active_.push_back(std::move(owned));
    if (qp->r.params.prompt_logprobs >= 0) qp->prompt_lp.assign(size_t(qp->prompt_len), std::nullopt);
    if (!admit_seq(*qp->seqs[0])) preempted_.push_back(qp->seqs[0].get());
  }
  if (items.empty()) return;

  // 3. One forward over all chunks.
  phi4mm::IncrementalBatch b;
  std::vector<Tensor> media_parts;
  struct RowRef {
    size_t item;
    int64_t pos;  // position of the row in its sequence
  };
  std::vector<RowRef> rows;
  int64_t row0 = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    Item& it = items[i];
    Seq& s = *it.s;
    std::vector<int64_t> ids(s.tokens.begin() + it.start, s.tokens.begin() + it.start + it.len);
    b.add(s.kv, ids, s.req->r.adapter, it.table);
    const int64_t P = s.req->prompt_len;
    if (it.start < P && s.req->media_before.back() > 0) {
      const int64_t a = s.req->media_before[size_t(it.start)];
      const int64_t e = s.req->media_before[size_t(std::min(P, it.start + it.len))];
      if (e > a) media_parts.push_back(s.req->media_rows.narrow(0, a, e - a));
    }
    if (it.prompt_rows) {
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

  Tensor logits;
  try {
    logits = phi4mm::forward_incremental(*model_, *cache_, b);
  } catch (const std::exception& e) {
    // The batch failed: fail its requests, keep the engine alive.
    std::vector<Req*> failed;
    for (auto& it : items)
      if (std::find(failed.begin(), failed.end(), it.s->req) == failed.end()) failed.push_back(it.s->req);
    for (Req* q : failed) finish_request(*q, FinishReason::abort, fmt::format("engine error: {}", e.what()));
    return;
  }
  // Read in place (a contiguous f32 host tensor): no per-step copy of [rows, vocab].
  const Tensor host_logits = logits.to(DType::f32).to(Device::cpu()).contiguous();
  const float* host = static_cast<const float*>(host_logits.data_ptr());

  // 4. Prompt logprobs and sampling.
  std::unordered_map<const Seq*, const float*> last_row;
  for (size_t r = 0; r < rows.size(); ++r) {
    const Item& it = items[rows[r].item];
    const float* row = host + size_t(r) * size_t(V);
    Seq& s = *it.s;
    Req& q = *s.req;
    const int64_t p = rows[r].pos;
    if (it.prompt_rows && p + 1 < q.prompt_len) {
      const double lse = log_sum_exp(row, V);
      q.prompt_lp[size_t(p + 1)] = make_logprob(row, V, lse, q.r.prompt[size_t(p + 1)], q.r.params.prompt_logprobs);
    }
    if (it.sample && p == it.start + it.len - 1) last_row[&s] = row;
  }
  // Prompt logprobs go out once the prompt prefill is complete.
  for (auto& it : items) {
    Req& q = *it.s->req;
    if (it.prompt_rows && it.start + it.len >= q.prompt_len && !q.prompt_lp_sent) {
      q.prompt_lp_sent = true;
      RequestOutput o;
      o.sample = -1;
      o.prompt_logprobs = q.prompt_lp;
      q.cb(o);
    }
  }

  auto stop_ids_of = [this](const SamplingParams& p) {
    std::vector<int64_t> ids = p.stop_token_ids;
    if (!p.ignore_eos) ids.insert(ids.end(), opts_.eos_token_ids.begin(), opts_.eos_token_ids.end());
    return ids;
  };

  // Appends the picked token to `s` and reports it.
  auto sample_and_report = [&](Seq& s, const Picked& picked) {
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
    const std::vector<int64_t> stop_ids = stop_ids_of(p);
    const int64_t token = picked.token;

    s.tokens.push_back(token);
    s.generated++;
    s.counts[token]++;
    stats_.generated_tokens++;
    RequestOutput o;
    o.sample = s.sample;
    o.tokens = {token};
    if (picked.logprob) o.logprobs.push_back(*picked.logprob);

    const bool is_stop_token = std::find(stop_ids.begin(), stop_ids.end(), token) != stop_ids.end();
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
  };

  // Forks first (n > 1: the prompt was prefilled once; its cache is copied to
  // the other samples), then every token is picked in parallel, then reported in order.
  struct Job {
    Seq* s;
    const float* row;
    Picked picked;
  };
  std::vector<Job> jobs;
  for (auto& it : items) {
    if (!it.sample) continue;
    Seq& s = *it.s;
    if (s.finished || s.req->done) continue;
    const float* row = last_row.at(&s);
    Req& q = *s.req;
    jobs.push_back({&s, row, {}});
    const bool fork = s.sample == 0 && s.generated == 0 && q.seqs.size() > 1 && q.seqs[1]->pending_fork;
    if (!fork) continue;
    for (size_t j = 1; j < q.seqs.size(); ++j) {
      Seq& c = *q.seqs[j];
      c.pending_fork = false;
      if (int64_t(running_.size()) < opts_.max_running && cache_->can_grow(c.kv, s.kv.length)) {
        cache_->copy_sequence(s.kv, c.kv);
        c.order = ++admit_counter_;
        running_.push_back(&c);
        jobs.push_back({&c, row, {}});
      } else {
        preempted_.push_back(&c);  // prefilled on its own later
      }
    }
  }
  const int64_t nj = int64_t(jobs.size());
#pragma omp parallel for schedule(dynamic, 1) if (nj > 1)
  for (int64_t j = 0; j < nj; ++j) {
    thread_local std::vector<float> work;
    thread_local std::vector<double> probs;
    Seq& s = *jobs[size_t(j)].s;
    if (s.req->r.params.max_tokens > 0)
      jobs[size_t(j)].picked = pick(s, jobs[size_t(j)].row, stop_ids_of(s.req->r.params), work, probs);
  }
  for (auto& j : jobs)
    if (!j.s->finished && !j.s->req->done) sample_and_report(*j.s, j.picked);
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
