#pragma once
// The inference engine (issue 7): continuous batching over the paged KV cache.
//
// One engine owns a model, its PagedKvCache and a scheduler. Requests are
// submitted from any thread; the engine thread (start()) or the caller
// (step() / run_until_idle(), for tests and offline use) runs steps. A step:
//   1. takes new requests and aborts from the inbox, and runs the served-LoRA
//      loads and unloads queued since the last step (load_lora);
//   2. schedules: every running sequence in decode gets its one pending token,
//      sequences still in prefill get chunks of at most prefill_chunk_tokens,
//      waiting requests are admitted (oldest first) while fewer than
//      max_running sequences run and the step's token budget lasts. A request
//      is admitted as one sequence; its media rows were computed once, by
//      submit() on the submitting thread (Request::media), and are sliced per
//      chunk so media slots stay aligned. With n > 1 the prompt is prefilled once and its cache copied
//      to the other samples when the prefill ends;
//   3. makes room: a sequence whose growth crosses the LongRoPE boundary
//      (original_max_position_embeddings) is released and re-prefilled with
//      the long table; when the cache lacks blocks the newest running
//      sequence is preempted (blocks freed, re-prefilled later from its
//      tokens and media). Neither changes any output;
//   4. runs forward_incremental once over all chunks, samples the sequences
//      whose last chunk ended, checks stops and reports RequestOutput events.
//
// Sampling (sampler.h) is per sequence and batch-independent: the random
// number of generated token k of sample j depends only on (seed, j, k), so a
// seeded request gives the same tokens alone, in any batch, and after
// preemption.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "models/phi4mm/kv_cache.h"
#include "models/phi4mm/processor/media.h"
#include "models/phi4mm/text.h"
#include "models/phi4mm/tokenizer/tokenizer.h"
#include "serve/sampler.h"

namespace areno::serve {

using phi4mm::Adapter;

enum class FinishReason { none, stop, length, abort };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "abort" (none: nullptr)

struct Request {
  std::vector<int64_t> prompt;   // expanded prompt ids (media placeholders repeated)
  Adapter adapter = Adapter::none;  // the sequence's LoRA (vision when an image is present)
  // The served LoRA beside it (vLLM's --lora-modules): 0 none, j the model's
  // served_loras()[j - 1] (phi4mm::ServedLora), which must be loaded
  // (Engine::find_lora). With served_lora_uid non-zero, submit also checks
  // that number j still holds that adapter (its uid): a request resolved by
  // name before an unload never runs under the adapter loaded after it.
  // submit sets it to the adapter's uid (the prefix cache's key).
  int32_t served_lora = 0;
  uint64_t served_lora_uid = 0;
  // The prompt's media for its placeholder ids (200010 / 200011), in order of
  // appearance (phi4mm::ProcessedChat::media). Engine::submit runs the
  // processors and towers on them once, on the submitting thread (never the
  // engine thread, so an image does not stall running decodes).
  std::vector<phi4mm::Media> media;
  // Or their rows [M, H], computed already (a trainer holding them, tests).
  // At most one of media / media_rows; neither when the prompt has no media.
  Tensor media_rows;
  SamplingParams params;
  int64_t max_context = 0;       // 0: the model's max_position_embeddings
  // vLLM's cache_salt: the prefix and media caches share blocks and rows only
  // between requests with the same salt, so a tenant cannot time another's
  // prompts (empty: the shared, unsalted cache).
  std::string cache_salt;
};

// What a step reports for one request. `sample` < 0 marks request-level events
// (prompt logprobs, errors).
struct RequestOutput {
  int64_t sample = 0;
  std::vector<int64_t> tokens;          // new tokens of this sample
  std::string text;                     // new text (complete UTF-8; stop strings held back)
  std::vector<TokenLogprob> logprobs;   // for `tokens` when requested
  FinishReason finish = FinishReason::none;
  std::string stop_reason;              // the stop string matched, or the stop token id as text
  // Request-level:
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;  // once, when requested (first is null)
  std::string error;                    // non-empty: the request failed (engine error)
  bool done = false;                    // last event of the request (all samples finished)
  // With done: the prompt tokens its first admission took from the prefix
  // cache (vLLM's num_cached_tokens; 0 without prefix caching).
  int64_t cached_tokens = 0;
};

using OutputCallback = std::function<void(const RequestOutput&)>;

struct EngineOptions {
  int64_t max_running = 16;            // sequences in flight (samples count)
  int64_t max_batch_tokens = 2048;     // tokens per step (decode + prefill chunks)
  int64_t prefill_chunk_tokens = 512;  // per sequence per step
  int64_t kv_blocks = 0;               // 0: from kv_cache_bytes
  size_t kv_cache_bytes = size_t(1) << 30;
  int64_t block_size = 16;
  int64_t max_queue = 1024;            // waiting requests; submit() throws QueueFull beyond
  std::vector<int64_t> eos_token_ids{200020, 199999};
  uint64_t seed = 0;                   // for requests without a seed
  // Automatic prefix caching (vLLM's): a prompt's full KV blocks stay cached
  // under the SHA-256 of everything before and in them (tokens, the rotary
  // table, the adapters, the media rows' bytes); a later prompt with the same
  // start reuses them instead of computing them. Off by default: a trainer
  // changes the weights under the engine (areno serve turns it on).
  bool prefix_caching = false;
  // Media rows kept across requests per item, keyed by the SHA-256 of its
  // decoded pixels or samples and size (and, for a clip, whether its request
  // has an image): the same image or clip sent again, alone or beside other
  // items, skips its processor and tower. Least recently used out past this
  // many bytes; 0: off (the default: a trainer may change the towers).
  size_t media_cache_bytes = 0;
  // Speculative decoding by prompt lookup (vLLM's "ngram" method): a
  // sequence in decode whose last prompt_lookup_max .. prompt_lookup_min
  // tokens occurred before in its prompt or output proposes the up to
  // speculative_tokens tokens that followed them; one forward computes the
  // rows of its last token and the drafts, each row is picked as plain
  // decoding would pick it (the same sampling, penalties, constraints and
  // seeded draws) and the drafts are kept while they equal the picks. The
  // output is the plain decoder's; repeated text costs one step for several
  // tokens. 0: off.
  int64_t speculative_tokens = 0;
  int64_t prompt_lookup_max = 4, prompt_lookup_min = 2;
};

struct QueueFull : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct LoraInUse : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct EngineStats {
  int64_t requests_total = 0, requests_finished = 0, requests_aborted = 0, requests_failed = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0, preemptions = 0, reprefills = 0;
  int64_t numerical_faults = 0;  // requests failed for a non-finite logit
  int64_t running = 0, waiting = 0;
  int64_t kv_blocks_total = 0, kv_blocks_used = 0;
  // Prefix caching: prompt tokens looked up, and those found cached.
  int64_t prefix_cache_queries = 0, prefix_cache_hits = 0;
  int64_t kv_blocks_cached = 0;  // remembered blocks (held or evictable)
  int64_t kv_touched_bytes = 0;  // the pool's bytes written at least once (BlockManager::num_touched)
  int64_t media_cache_hits = 0;  // media items whose rows came from the media cache
  // Speculative decoding: draft tokens computed, and those kept.
  int64_t spec_draft_tokens = 0, spec_accepted_tokens = 0;
  int64_t steps = 0;
  double step_seconds_total = 0, last_step_seconds = 0;
  // Media items encoded by submit (on submitting threads) and the time spent.
  int64_t media_items_total = 0;
  double media_seconds_total = 0;
  // Per served LoRA (Request::served_lora, its number): sequences running
  // (preempted ones count as waiting) and requests waiting; only numbers with
  // one or the other.
  std::map<int32_t, std::pair<int64_t, int64_t>> lora_running_waiting;
};

class Engine {
 public:
  Engine(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model, std::shared_ptr<const tok::Tokenizer> tokenizer,
         EngineOptions opts = {});
  ~Engine();  // stops the thread; aborts what is left
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request; returns its id. Computes its media rows first (on the
  // calling thread). Callbacks run on the stepping thread and must not block.
  // Throws std::invalid_argument (bad params/prompt: empty, longer than the
  // context, ids out of range, media rows not matching the placeholders),
  // QueueFull, or std::runtime_error when the media cannot be encoded.
  // Thread-safe.
  int64_t submit(Request r, OutputCallback on_output);
  // Frees the request's sequences at the next step; its last event has
  // finish = abort. Unknown or finished ids are ignored. Thread-safe.
  void abort(int64_t id);

  // One scheduling step; returns false when there was nothing to do.
  bool step();
  void run_until_idle();
  // Background stepping thread.
  void start();
  // Stops admitting; with drain, finishes the running and waiting requests
  // first, else aborts them. Joins the thread.
  void stop(bool drain = true);
  bool running() const { return thread_.joinable(); }

  // Served LoRAs while serving (phi4mm::ServedLora; vLLM's
  // /v1/load_lora_adapter and /v1/unload_lora_adapter). Both run on the
  // stepping thread between two steps (at once on the calling thread when
  // start() was not called: then no other thread may step) and wait for it.
  // load_lora adds the PEFT folder `dir` as `name` (phi4mm::load_served_lora)
  // and returns its number; throws std::invalid_argument for a name in use,
  // std::length_error when `max_live` (0: no limit) are loaded already, and
  // std::runtime_error naming the folder's fault. unload_lora throws
  // std::out_of_range for a name not loaded and LoraInUse while a request
  // (waiting or running) uses it. The next load takes an unloaded number.
  // `source`: what ServedLora::source reports (default: `dir`).
  int32_t load_lora(const std::string& name, const std::string& dir, size_t max_live = 0,
                    const std::string& source = "");
  void unload_lora(const std::string& name);
  // The loaded served LoRAs, in load order, and the one named `name`
  // (nullopt: not loaded). Thread-safe.
  std::vector<phi4mm::ServedLora> loras() const;
  std::optional<phi4mm::ServedLora> find_lora(const std::string& name) const;

  EngineStats stats() const;
  // The KV bookkeeping's invariants, for tests: the block manager's own, and
  // each block held exactly as often as the live sequences' tables name it.
  // "" when they hold, else the first that does not. Between steps only (not
  // while start()ed).
  std::string audit() const;
  const EngineOptions& options() const { return opts_; }
  const phi4mm::Phi4MMForCausalLM& model() const { return *model_; }
  const tok::Tokenizer& tokenizer() const { return *tok_; }
  int64_t max_context() const;

 private:
  struct Seq;
  struct Req;
  void take_inbox();
  // Runs `fn` between steps on the stepping thread (see load_lora).
  void run_between_steps(std::function<void()> fn);
  void run_controls();
  // One step (step 2 to 4 above) in three named calls.
  struct StepItem;
  struct RowRef;
  void schedule_and_run();
  std::vector<StepItem> plan_step();
  Tensor run_step(const std::vector<StepItem>& items, std::vector<RowRef>& rows);
  void emit_step(const std::vector<StepItem>& items, const std::vector<RowRef>& rows, const float* logits);
  phi4mm::RopeTable table_for(const Seq& s) const;
  int64_t chunk_for(const Seq& s, int64_t budget) const;
  bool make_room(Seq& s, int64_t new_len, const std::vector<StepItem>& items);
  void extend_digests(Seq& s, phi4mm::RopeTable table, int64_t n) const;
  bool caches_prefix(const Seq& s) const;
  bool attach_cached(Seq& s);
  void lookup_digests(Seq& s, phi4mm::RopeTable table) const;
  bool first_chunk_fits(Seq& s);
  std::vector<int64_t> draft_for(const Seq& s, int64_t budget) const;
  std::vector<int64_t> propose_draft(const Seq& s, int64_t max_tokens) const;
  void verify_draft(const StepItem& it, const std::vector<const float*>& rows);
  void fail_sampling(Req& q, const std::string& why);
  void fail_admitted(const std::string& why);
  void remember_blocks(const std::vector<StepItem>& items);
  void encode_media(Req& q, const std::vector<phi4mm::Media>& media, int64_t n_media,
                    const std::function<void()>& check_accepting);
  bool admit_seq(Seq& s, std::vector<StepItem>& items, int64_t& budget);
  void report_token(Seq& s, const Picked& picked);
  void finish_request(Req& r, FinishReason why, const std::string& error = {});
  void preempt(Seq& s);
  void end_sample(Seq& s, RequestOutput& o);
  void release(Seq& s);

  std::shared_ptr<phi4mm::Phi4MMForCausalLM> model_;
  std::shared_ptr<const tok::Tokenizer> tok_;
  EngineOptions opts_;
  std::unique_ptr<phi4mm::PagedKvCache> cache_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Req>> inbox_;
  std::vector<int64_t> aborts_;
  std::deque<std::packaged_task<void()>> controls_;  // run_between_steps
  std::vector<phi4mm::ServedLora> loras_;              // the loaded served LoRAs (Request::served_lora)
  int64_t next_id_ = 1;
  uint64_t seed_state_;
  bool stopping_ = false, drain_ = true;
  std::thread thread_;

  // Stepping-thread state.
  std::deque<std::unique_ptr<Req>> waiting_;            // not yet admitted (FIFO)
  std::vector<std::unique_ptr<Req>> active_;            // admitted, unfinished
  std::vector<Seq*> running_;                           // in admission order
  std::deque<Seq*> preempted_;                          // re-prefill first, oldest first
  int64_t admit_counter_ = 0;
  EngineStats stats_;       // stepping thread
  EngineStats published_;   // copy under mu_, for stats()
  int64_t requests_total_ = 0;  // under mu_
  int64_t media_cache_hits_ = 0;  // under mu_
  // The media cache (EngineOptions::media_cache_bytes), under media_mu_.
  struct MediaEntry {
    Tensor rows;
    std::vector<std::string> row_digests;  // for prefix caching, when on
    size_t bytes = 0;
  };
  std::mutex media_mu_;
  std::list<std::pair<std::string, MediaEntry>> media_lru_;  // most recently used first
  std::unordered_map<std::string, std::list<std::pair<std::string, MediaEntry>>::iterator> media_by_key_;
  size_t media_bytes_ = 0;
  int64_t media_items_total_ = 0;      // under mu_
  double media_seconds_total_ = 0;     // under mu_
};

// Blocking batch API for offline use and the trainer (rollouts and scoring).
struct Completion {
  std::vector<int64_t> tokens;
  std::vector<float> logprobs;  // of `tokens` (raw distribution)
  std::string text;
  FinishReason finish = FinishReason::none;
};
// Runs every request to completion on `engine` (which must not be started):
// result[i][j] is sample j of request i.
std::vector<std::vector<Completion>> generate(Engine& engine, std::vector<Request> requests);

}  // namespace areno::serve
