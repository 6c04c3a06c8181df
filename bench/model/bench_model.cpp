// Language-model benchmarks (issue 3, "Benchmarks") on a checkpoint directory,
// normally the `small` preset in f32:
//   load          load_model() of the text model (base weights; page cache warm)
//   prefill_512   packed forward of one 512-token sequence, logits of the last
//                 row only (as inference does) and final hidden states only
//   train_512     forward + next-token cross-entropy + backward (no optimizer)
//   decode_bN     one decode step of N sequences with the paged KV cache after
//                 a 32-token prompt each; tokens/s = N / step time
// Prints one JSON object per line like bench/core: {"bench", "device", "ms", ...}.
// Timing: best of several repetitions after one warm-up run.
//
// usage: bench_model CHECKPOINT_DIR [--reps N]
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/kv_cache.h"
#include "models/phi4mm/text.h"
#include "tensor/autograd.h"
#include "tensor/backend.h"
#include "tensor/ops.h"

using namespace areno;
using namespace areno::phi4mm;

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double best_ms(const std::function<void()>& f, Device d, int reps) {
  f();  // warm-up: first-touch of buffers, allocator pools
  backend(d).synchronize(d);
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    double t0 = now_ms();
    f();
    backend(d).synchronize(d);
    best = std::min(best, now_ms() - t0);
  }
  return best;
}

// Deterministic token ids in [3, vocab): the benchmark does not depend on the
// ids, but the same ids are used by peer_torch.py (same formula).
std::vector<int64_t> bench_ids(int64_t n, int64_t vocab, int64_t seed) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  uint64_t x = 0x9E3779B97F4A7C15ull * uint64_t(seed + 1);
  for (auto& id : ids) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    id = 3 + int64_t(x % uint64_t(vocab - 3));
  }
  return ids;
}

// Time of one decode step of `batch` sequences, averaged over `steps` steps
// after a `prompt`-token prefill of each; best of `reps` runs (plus warm-up).
// `first` receives the first 8 greedy tokens of sequence 0 (compared with the
// PyTorch peer's: equal tokens show both ran the same weights and math).
double decode_step_ms(const Phi4MMForCausalLM& m, int64_t batch, int64_t prompt, int64_t steps, int reps,
                      std::vector<int64_t>& first) {
  const int64_t vocab = m.config().text.vocab_size;
  const int64_t bs = 16;
  PagedKvCache cache(m, batch * ((prompt + steps + bs) / bs + 1), bs);
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {
    std::vector<KvSequence> seqs(static_cast<size_t>(batch));
    IncrementalBatch pre;
    for (int64_t s = 0; s < batch; ++s) pre.add(seqs[size_t(s)], bench_ids(prompt, vocab, 100 + s));
    std::vector<int64_t> next = argmax(forward_incremental(m, cache, pre), -1).to_vector<int64_t>();
    std::vector<int64_t> toks{next[0]};
    backend(m.device()).synchronize(m.device());
    double t0 = now_ms();
    for (int64_t t = 0; t < steps; ++t) {
      IncrementalBatch b;
      for (int64_t s = 0; s < batch; ++s) b.add(seqs[size_t(s)], {next[size_t(s)]});
      // Greedy sampling on the host, as a generate loop does.
      next = argmax(forward_incremental(m, cache, b), -1).to_vector<int64_t>();
      toks.push_back(next[0]);
    }
    backend(m.device()).synchronize(m.device());
    double ms = (now_ms() - t0) / double(steps);
    if (r > 0) best = std::min(best, ms);  // r == 0 is the warm-up
    first.assign(toks.begin(), toks.begin() + std::min<size_t>(8, toks.size()));
    for (auto& s : seqs) cache.release(s);
  }
  return best;
}

int run(int argc, char** argv) {
  if (argc < 2) throw std::invalid_argument("usage: bench_model CHECKPOINT_DIR [--reps N]");
  const std::string dir = argv[1];
  int reps = 5;
  std::string only;  // run just this benchmark (and load), for profiling
  for (int i = 2; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--reps") reps = std::atoi(argv[i + 1]);
    else if (std::string(argv[i]) == "--only") only = argv[i + 1];
    else throw std::invalid_argument(fmt::format("unknown option '{}' (expected --reps N, --only prefill|train|decode)", argv[i]));
  }
  auto want = [&](const char* name) { return only.empty() || only == name; };
  const Device cpu = Device::cpu();
  LoadOptions lo;
  lo.with_lora = false;  // the base model, as the PyTorch peer builds it
  lo.vision = lo.audio = false;

  // (d) load time: best of reps (first load warms the page cache).
  std::shared_ptr<Phi4MMForCausalLM> model;
  double ms = best_ms([&] { model = load_model(dir, lo); }, cpu, std::max(1, reps / 2));
  size_t weight_bytes = 0;
  for (const auto& p : model->parameters()) weight_bytes += p.nbytes();
  fmt::print("{{\"bench\": \"load\", \"device\": \"cpu\", \"ms\": {:.3f}, \"weight_bytes\": {}, \"params\": {}}}\n",
             ms, weight_bytes, model->num_parameters());
  std::fflush(stdout);
  const Phi4MMForCausalLM& m = *model;
  const int64_t vocab = m.config().text.vocab_size;
  const int64_t T = 512;
  const PackedBatch b = PackedBatch::single(bench_ids(T, vocab, 0));

  // (a) prefill, inference mode.
  if (want("prefill")) {
    NoGradGuard ng;
    Tensor last;
    ms = best_ms([&] { last = m.logits_at(b, {T - 1}); }, cpu, reps);
    // The first logits of the last row, compared with the PyTorch peer's by run.sh.
    std::vector<float> head = last.narrow(1, 0, 4).to_vector<float>();
    fmt::print("{{\"bench\": \"prefill_512_last_logits\", \"device\": \"cpu\", \"ms\": {:.3f}, \"tok_s\": {:.1f}, "
               "\"logits0_3\": [{:.6f}]}}\n",
               ms, T / ms * 1e3, fmt::join(head, ", "));
    std::fflush(stdout);
    ms = best_ms([&] { m.hidden_states(b); }, cpu, reps);
    fmt::print("{{\"bench\": \"prefill_512_hidden\", \"device\": \"cpu\", \"ms\": {:.3f}, \"tok_s\": {:.1f}}}\n",
               ms, T / ms * 1e3);
    std::fflush(stdout);
  }

  // (b) training step without optimizer: all logits, mean next-token loss, backward.
  if (want("train")) {
    model->unfreeze();
    std::vector<int64_t> ids = bench_ids(T, vocab, 0), tgt(ids.begin() + 1, ids.end());
    tgt.push_back(-100);  // the last row has no next token
    const Tensor target = from_vector(tgt, Shape{T});
    ms = best_ms(
        [&] {
          model->zero_grad();
          Tensor loss = cross_entropy(m.logits(b), target);
          loss.backward();
        },
        cpu, std::max(1, reps / 2));
    fmt::print("{{\"bench\": \"train_fwd_bwd_512\", \"device\": \"cpu\", \"ms\": {:.3f}, \"tok_s\": {:.1f}}}\n", ms,
               T / ms * 1e3);
    std::fflush(stdout);
    model->zero_grad();
    model->freeze();
  }

  // (c) decode with the paged KV cache after a 32-token prompt.
  if (want("decode")) {
    NoGradGuard ng;
    for (int64_t batch : {1, 8}) {
      std::vector<int64_t> first;
      ms = decode_step_ms(m, batch, 32, 32, std::max(1, reps / 2), first);
      fmt::print("{{\"bench\": \"decode_b{}\", \"device\": \"cpu\", \"ms\": {:.3f}, \"tok_s\": {:.1f}, "
                 "\"first_tokens\": [{}]}}\n",
                 batch, ms, double(batch) / ms * 1e3, fmt::join(first, ", "));
      std::fflush(stdout);
    }
  }

  // Memory bandwidth for the decode bound: a 256 MiB copy (read + write).
  if (want("decode")) {
    NoGradGuard ng;
    Tensor src = empty({int64_t(1) << 26}, TensorOptions(DType::f32, cpu));
    src.fill_(1.0);
    Tensor dst = empty_like(src);
    ms = best_ms([&] { dst.copy_(src); }, cpu, reps);
    fmt::print("{{\"bench\": \"copy_256MiB\", \"device\": \"cpu\", \"ms\": {:.3f}, \"gbps\": {:.2f}}}\n", ms,
               2.0 * double(src.nbytes()) / ms / 1e6);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_model: {}\n", e.what());
    return 1;
  }
}
