// The areno side of bench/peers/llama_cpp.sh (issue 16, must-show 1): the
// measures llama-bench and llama-batched-bench report, on the text decoder of
// a checkpoint (its stored dtype), through the serving path (the paged KV
// cache and forward_incremental, logits of each sequence's last row only):
//
//   ppN       prefill of one N-token prompt into an empty cache (llama-bench
//             -p N); tok/s = N / time
//   tgN       N decode steps of one sequence from an empty cache, one token
//             each (llama-bench -n N); tok/s = N / time
//   tgN_bB    B sequences of a P-token prompt each, prefilled, then N decode
//             steps of all B (llama-batched-bench -npp P -ntg N -npl B, its
//             S_TG); tok/s = B * N / decode time
//   gemm      the machine's GEMM rate for the decoder's own shapes: each
//             distinct layer weight times 512 rows of activations through
//             the matmul op (the prefill shape), GFLOP/s; "peak" is the best
//   read_bw   a streaming sum over 1 GiB (read bandwidth, GB/s) on the same
//             threads (read_bandwidth below)
//   read_bw_step  the same over the model's own weight memory (every byte
//             one decode step reads): the bound of a decode step is weight
//             bytes / read_bw_step. Where the weights fit in the last-level cache
//             (the small preset: 103 MB in bf16, 480 MiB of L3 here) this is
//             the cache's bandwidth, as it is for the decode step
//
// Greedy next tokens are computed as a generate loop does (argmax on the
// host). Timing: best of --reps runs after one warm-up run. One JSON object
// per line: {"bench": ..., "ms": ..., "tok_s": ...}.
//
// ppN also reports GFLOP/s: 2 x tokens x the decoder's matrix parameters
// (the head for the last row only) plus the causal attention's 2 x 2 x
// T^2 / 2 x heads x head_dim per layer.
//
// --quantize int8 loads the decoder and the tied head in int8 (LoadOptions::
// quantize, as `areno serve --quantize int8`): the weight bytes, the GEMM
// shapes and every measure are then those of the int8 model.
//
// usage: bench_llm CHECKPOINT_DIR [--reps N] [--pp 512,4096] [--tg 128]
//                  [--batched 8,32] [--npp 128] [--only pp|tg|batched|bw|bw_step|gemm]
//                  [--quantize none|int8] [--gemm-rows 512]
// (--gemm-rows: the rows of x in the `gemm` measures, layer 0's linear layers.)
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/kv_cache.h"
#include "models/phi4mm/text.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"

using namespace areno;
using namespace areno::phi4mm;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<int64_t> ids_of(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
  for (auto& id : ids) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    id = 3 + int64_t(x % uint64_t(vocab - 3));
  }
  return ids;
}

// A comma-separated list of sizes; 0 (or nothing) leaves the measure out.
std::vector<int64_t> list_of(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    const int64_t x = std::stoll(item);
    if (x < 0) throw std::invalid_argument(fmt::format("'{}': sizes must not be negative", s));
    if (x > 0) v.push_back(x);
  }
  return v;
}

// Seconds of the best of `reps` runs of f (after one warm-up run); f returns
// the seconds of its timed part.
double best_of(int reps, const std::function<double()>& f) {
  f();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) best = std::min(best, f());
  return best;
}

// B sequences of a P-token prompt (P = 0: none, decoding starts from an empty
// cache as llama-bench's tg does), then N decode steps of all B. Returns
// {prefill seconds, decode seconds}.
std::pair<double, double> run_sequences(const Phi4MMForCausalLM& m, int64_t B, int64_t P, int64_t N) {
  const int64_t vocab = m.config().text.vocab_size, bs = 16;
  PagedKvCache cache(m, B * ((P + N + bs) / bs + 1), bs);
  std::vector<KvSequence> seqs(static_cast<size_t>(B));
  std::vector<int64_t> next(static_cast<size_t>(B));
  double t0 = now_s(), pre = 0;
  if (P > 0) {
    IncrementalBatch b;
    for (int64_t s = 0; s < B; ++s) b.add(seqs[size_t(s)], ids_of(P, vocab, 100 + uint64_t(s)));
    next = argmax(forward_incremental(m, cache, b), -1).to_vector<int64_t>();
    pre = now_s() - t0;
  } else {
    for (int64_t s = 0; s < B; ++s) next[size_t(s)] = 3 + s;
  }
  t0 = now_s();
  for (int64_t t = 0; t < N; ++t) {
    IncrementalBatch b;
    for (int64_t s = 0; s < B; ++s) b.add(seqs[size_t(s)], {next[size_t(s)]});
    next = argmax(forward_incremental(m, cache, b), -1).to_vector<int64_t>();
  }
  const double dec = now_s() - t0;
  for (auto& s : seqs) cache.release(s);
  return {pre, dec};
}

typedef float V16 __attribute__((vector_size(64)));

// Adds the n floats at p (any alignment) into 8 vector accumulators, 512
// bytes a step, with a software prefetch 8 KiB ahead as the skinny GEMM asks
// for its weight rows.
void sum_into(const float* p, size_t n, V16 (&acc)[8]) {
  size_t i = 0;
  for (; i + 128 <= n; i += 128)
    for (size_t v = 0; v < 8; ++v) {
      __builtin_prefetch(p + i + 16 * v + 8192 / sizeof(float));
      V16 x;
      std::memcpy(&x, p + i + 16 * v, sizeof x);
      acc[v] += x;
    }
  for (; i < n; ++i) acc[0][0] += p[i];
}

// GB/s of a streaming sum over the regions (read as f32 words; int8 and bf16
// weights too) on the OpenMP threads: each thread reads its own contiguous
// share of the regions front to back. Best of `reps`.
double read_bandwidth(const std::vector<std::pair<const float*, size_t>>& regions, int reps) {
  size_t total = 0;
  for (const auto& r : regions) total += r.second;
  volatile float sink = 0;
  const double s = best_of(reps, [&] {
    const double t0 = now_s();
    float sum = 0;
#pragma omp parallel reduction(+ : sum)
    {
      const size_t nt = size_t(omp_get_num_threads()), t = size_t(omp_get_thread_num());
      const size_t lo = total * t / nt, hi = total * (t + 1) / nt;
      V16 acc[8] = {};
      size_t at = 0;  // start of the region in the concatenation
      for (const auto& [p, n] : regions) {
        const size_t b = std::max(lo, at), e = std::min(hi, at + n);
        if (b < e) sum_into(p + (b - at), e - b, acc);
        at += n;
      }
      for (const V16& v : acc)
        for (size_t k = 0; k < 16; ++k) sum += v[k];
    }
    sink = sum;
    return now_s() - t0;
  });
  (void)sink;
  return double(total * sizeof(float)) / s / 1e9;
}

int run(int argc, char** argv) {
  if (argc < 2) throw std::invalid_argument("usage: bench_llm CHECKPOINT_DIR [--reps N] [--pp LIST] [--tg N] "
                                            "[--batched LIST] [--npp N] [--only pp|tg|batched|bw|bw_step|gemm] [--gemm-rows N] "
                                            "[--quantize none|int8]");
  const std::string dir = argv[1];
  int reps = 3;
  std::vector<int64_t> pps{512}, batched{8, 32};
  int64_t tg = 128, npp = 128, gemm_rows = 512;
  std::string only;
  Quantize quantize = Quantize::none;
  for (int i = 2; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(fmt::format("{}: needs a value", a));
    const std::string v = argv[i + 1];
    if (a == "--reps") reps = std::stoi(v);
    else if (a == "--pp") pps = list_of(v);
    else if (a == "--tg") tg = std::stoll(v);
    else if (a == "--batched") batched = list_of(v);
    else if (a == "--npp") npp = std::stoll(v);
    else if (a == "--gemm-rows") gemm_rows = std::max<int64_t>(1, std::stoll(v));
    else if (a == "--only") only = v;
    else if (a == "--quantize") quantize = quantize_from_name(v);
    else throw std::invalid_argument(fmt::format("unknown option '{}'", a));
  }
  auto want = [&](const char* name) { return only.empty() || only == name; };
  NoGradGuard ng;
  if (want("bw")) {
    std::vector<float> a((size_t(1) << 30) / sizeof(float));
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < a.size(); ++i) a[i] = float(i & 7);  // first touch by the reading thread
    const double gbps = read_bandwidth({{a.data(), a.size()}}, reps);
    fmt::print("{{\"bench\": \"read_bw\", \"gbps\": {:.2f}, \"threads\": {}}}\n", gbps, omp_get_max_threads());
    std::fflush(stdout);
  }
  if (only == "bw") return 0;

  LoadOptions lo;
  lo.with_lora = false;  // text serving reads the base weights only, as the GGUF holds them
  lo.vision = lo.audio = false;
  lo.quantize = quantize;
  auto model = load_model(dir, lo);
  const Phi4MMForCausalLM& m = *model;
  size_t weight_bytes = 0;
  for (const auto& p : model->parameters()) weight_bytes += p.nbytes();
  // The linear weights and the head (int8 or not), by module.
  const auto matrices = model->quantizable_weights();
  for (const auto& [name, w] : matrices)
    if (w->int8) weight_bytes += w->int8->nbytes();
  // Bytes one decode step reads: every decoder weight once, the tied head
  // (the embedding matrix) once; the embedding lookup itself reads one row.
  fmt::print("{{\"bench\": \"load\", \"dtype\": \"{}\", \"quantize\": \"{}\", \"weight_bytes\": {}, "
             "\"decode_read_bytes\": {}, \"threads\": {}}}\n",
             dtype_name(model->dtype()), quantize_name(quantize), weight_bytes, weight_bytes, omp_get_max_threads());
  std::fflush(stdout);
  if (want("bw_step")) {
    // The model's own weight memory, every byte a decode step reads.
    std::vector<std::pair<const float*, size_t>> regions;
    auto add = [&](const void* p, size_t bytes) {
      if (bytes >= sizeof(float)) regions.push_back({static_cast<const float*>(p), bytes / sizeof(float)});
    };
    for (const auto& p : model->parameters()) add(p.data_ptr(), p.nbytes());
    for (const auto& [name, w] : matrices)
      if (w->int8) {
        add(w->int8->values.data(), w->int8->values.size());
        add(w->int8->scales.data(), w->int8->scales.size() * sizeof(float));
      }
    size_t bytes = 0;
    for (const auto& r : regions) bytes += r.second * sizeof(float);
    fmt::print("{{\"bench\": \"read_bw_step\", \"gbps\": {:.2f}, \"bytes\": {}, \"threads\": {}}}\n",
               read_bandwidth(regions, reps), bytes, omp_get_max_threads());
    std::fflush(stdout);
  }

  // Matrix parameters of the decoder layers (not the embedding / head, not norms).
  const TextConfig& tc = m.config().text;
  double layer_matrix_params = 0;
  std::vector<const Weight*> layer0;
  auto rows_of = [](const Weight& w) { return w.int8 ? w.int8->rows : w.weight.size(0); };
  for (const auto& [name, w] : matrices)
    if (name != "model.embed_tokens") {
      layer_matrix_params += double(rows_of(*w) * w->weight.size(1));
      if (name.find("layers.0.") != std::string::npos) layer0.push_back(w);
    }
  auto prefill_flops = [&](int64_t T) {
    const double attn = 2.0 * 2.0 * double(T) * double(T) / 2.0 * double(tc.num_attention_heads * tc.head_dim()) *
                        double(tc.num_hidden_layers);
    return 2.0 * double(T) * layer_matrix_params + 2.0 * double(tc.hidden_size * tc.vocab_size) + attn;
  };
  if (want("gemm")) {
    double peak = 0;
    for (const Weight* w : layer0) {
      const int64_t T = gemm_rows, N = rows_of(*w), K = w->weight.size(1);
      Generator gen(1);
      const Tensor x = rand_normal({T, K}, gen, 0.0, 1.0).to(m.dtype());
      const double s = best_of(reps, [&] {
        const double t0 = now_s();
        Tensor y = w->linear(x);
        return now_s() - t0;
      });
      const double gf = 2.0 * double(T * N * K) / s / 1e9;
      peak = std::max(peak, gf);
      fmt::print("{{\"bench\": \"gemm_{}x{}x{}\", \"ms\": {:.3f}, \"gflops\": {:.1f}}}\n", T, N, K, s * 1e3, gf);
    }
    fmt::print("{{\"bench\": \"gemm_peak\", \"gflops\": {:.1f}}}\n", peak);
    std::fflush(stdout);
  }
  if (want("pp"))
    for (int64_t p : pps) {
      const double s = best_of(reps, [&] { return run_sequences(m, 1, p, 0).first; });
      fmt::print("{{\"bench\": \"pp{}\", \"ms\": {:.3f}, \"tok_s\": {:.2f}, \"gflops\": {:.1f}}}\n", p, s * 1e3,
                 double(p) / s, prefill_flops(p) / s / 1e9);
      std::fflush(stdout);
    }
  if (want("tg")) {
    const double s = best_of(reps, [&] { return run_sequences(m, 1, 0, tg).second; });
    fmt::print("{{\"bench\": \"tg{}\", \"ms\": {:.3f}, \"tok_s\": {:.2f}}}\n", tg, s * 1e3 / double(tg),
               double(tg) / s);
    std::fflush(stdout);
  }
  if (want("batched"))
    for (int64_t b : batched) {
      const double s = best_of(std::max(1, reps - 1), [&] { return run_sequences(m, b, npp, tg).second; });
      fmt::print("{{\"bench\": \"tg{}_b{}\", \"ms\": {:.3f}, \"tok_s\": {:.2f}}}\n", tg, b, s * 1e3 / double(tg),
                 double(b * tg) / s);
      std::fflush(stdout);
    }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_llm: {}\n", e.what());
    return 1;
  }
}
