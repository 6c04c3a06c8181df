// Training benchmark (issue 14, "Benchmarks"): SftTrainer steps on a preset
// model built in memory, text rows of random ids, and the figures the issue
// asks for: tokens/s, seconds per step, peak RSS, the loss of every step.
//
// Rows: `--rows` rows (default batch_size x (warmup + steps), so no row is
// read twice) of `--seq` ids each, ids from the xorshift of bench/model
// (bench_ids: seed 1000 + row, ids in [3, 199999)); bench/train/torch_train.py
// builds the same rows. Targets (--targets):
//   half  (default) the second half of the row is the "response": positions
//         L/2-1 .. L-2 predict ids L/2 .. L-1 (L/2 target tokens per row),
//         as an SFT row with a prompt as long as its answer
//   all   every position but the last predicts the next id (L-1 targets)
// Loss = sum of the step's target cross-entropies / its target tokens (the
// trainer's). The data order is the rows' order (no shuffle): step k reads
// rows k*B .. k*B+B-1. The lr schedule is constant (no effect on speed; it
// keeps the per-step losses comparable with the peer's).
//
// --lm-trainable all: the rows have no adapter (the base decoder, LoRA
// branches not computed) and the whole decoder trains (the LoRA weights are
// in the group but get no gradient). lora: the rows use the vision adapter and
// only the LoRA branches train. user: a user adapter of --lora-rank R (alpha
// 2R, on the four projections; `areno train --lora-rank`) is added, the rows
// have no modality adapter and only the user adapter trains. Its A is the
// bench's own deterministic sin(k + 1) / sqrt(in) (k the row-major index) and
// B is 0, as torch_train.py sets them, so both peers start from the same weights.
//
// After the measured steps, once: the time of one micro-batch's forward
// (decoder layers, then the loss, which also takes the head's gradient
// products) and of its backward, and of one optimizer step; the GEMM FLOPs
// of a step (model FLOPs: 2 x multiply-adds of the forward, x3 for forward +
// backward; plus what activation checkpointing runs again) against a GEMM
// peak measured here the way bench/core does it (best of N matmuls, 1024^3 and 4096x4096x512) and the
// head GEMM's own shape ([1024, H] x [V, H]^T).
//
// Prints one JSON object. OMP_NUM_THREADS sets the threads.
//
// usage: bench_train [--preset small] [--seed 1] [--seq 2048] [--batch-size 2]
//   [--mini-bs 1] [--warmup 1] [--steps 3] [--rows N] [--activation-checkpointing on|off]
//   [--lm-trainable all|lora|user] [--lora-rank 16] [--targets half|all] [--lr 1e-5] [--weight-decay 0.1]
//   [--phases on|off] [--gemm-peak on|off] [--perf-fifo PATH]
//   [--device cpu|cuda[:N]] [--dtype f32|bf16] [--peak-tflops X] [--loss-only REPS]
// --loss-only REPS: no training steps; times chunked_cross_entropy_sum alone
// (train/loss.h) on the model's head and random hidden states of
// batch_size x (targets per row) rows, forward and backward separately, one
// warm-up then REPS repetitions (best and median), and reports peak RSS.
// --device cuda: the model is built on the host in --dtype and moved; every
// step ends with a device synchronize (its time is the wall time); peak RSS
// is then the host's, "peak_gpu_bytes" the caching allocator's high-water mark
// of live device tensors, and "mfu" = model FLOPs/s / --peak-tflops (the GEMM
// peak below is measured on the host CPU only). First run on an H200 on
// 2026-12-04 (docs/perf.md).
// --perf-fifo: the control fifo of `perf record --control=fifo:PATH -D -1`;
// "enable" is written to it after the warm-up steps, "disable" after the
// measured ones, so the profile holds the measured steps only.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/phi4mm/model.h"
#include "tensor/autograd.h"
#include "tensor/backend.h"
#include "tensor/ops.h"
#include "train/loss.h"
#include "train/metrics.h"
#include "train/sft.h"

using namespace areno;
using namespace areno::phi4mm;
using namespace areno::train;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// bench/model/bench_model.cpp's ids (xorshift64), in [3, vocab).
std::vector<int64_t> bench_ids(int64_t n, int64_t vocab, int64_t seed) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  uint64_t x = 0x9E3779B97F4A7C15ull * uint64_t(seed + 1);
  for (auto& id : ids) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    id = 3 + int64_t(x % uint64_t(vocab - 3));
  }
  return ids;
}

constexpr int64_t kIdLimit = 199999;  // ids below the special tokens

SftRow make_row(int64_t r, int64_t L, bool half, Adapter adapter) {
  SftRow row;
  row.ids = bench_ids(L, kIdLimit, 1000 + r);
  row.targets.assign(size_t(L), -1);
  const int64_t first = half ? L / 2 - 1 : 0;
  for (int64_t t = first; t + 1 < L; ++t) row.targets[size_t(t)] = row.ids[size_t(t + 1)];
  row.adapter = adapter;
  row.line = r + 1;
  row.prompt_tokens = first + 1;
  row.target_tokens = L - 1 - first;
  return row;
}

struct Args {
  std::string preset = "small";
  uint64_t seed = 1;
  int64_t seq = 2048, batch = 2, mini_bs = 1, warmup = 1, steps = 3, rows = 0;
  bool ckpt = true, phases = true, gemm_peak = true, half = true;
  std::string perf_fifo;  // perf record --control=fifo:PATH: enabled for the measured steps only
  std::string device = "cpu", dtype = "f32";
  double peak_tflops = 0;  // > 0: MFU against this peak (e.g. 989 for H200 dense bf16)
  int64_t loss_only = 0;   // > 0: time only the loss, this many repetitions
  std::string lm = "all";
  int64_t lora_rank = 16;  // --lm-trainable user
  double lr = 1e-5, weight_decay = 0.1;
};

bool on_off(const std::string& flag, const std::string& v) {
  if (v == "on") return true;
  if (v == "off") return false;
  throw std::invalid_argument(fmt::format("{}: expected on or off, got '{}'", flag, v));
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(fmt::format("{}: missing value", f));
    const std::string v = argv[++i];
    if (f == "--preset") a.preset = v;
    else if (f == "--seed") a.seed = std::stoull(v);
    else if (f == "--seq") a.seq = std::stoll(v);
    else if (f == "--batch-size") a.batch = std::stoll(v);
    else if (f == "--mini-bs") a.mini_bs = std::stoll(v);
    else if (f == "--warmup") a.warmup = std::stoll(v);
    else if (f == "--steps") a.steps = std::stoll(v);
    else if (f == "--rows") a.rows = std::stoll(v);
    else if (f == "--activation-checkpointing") a.ckpt = on_off(f, v);
    else if (f == "--lm-trainable") a.lm = v;
    else if (f == "--lora-rank") a.lora_rank = std::stoll(v);
    else if (f == "--targets") {
      if (v != "half" && v != "all") throw std::invalid_argument("--targets: expected half or all");
      a.half = v == "half";
    } else if (f == "--lr") a.lr = std::stod(v);
    else if (f == "--weight-decay") a.weight_decay = std::stod(v);
    else if (f == "--phases") a.phases = on_off(f, v);
    else if (f == "--gemm-peak") a.gemm_peak = on_off(f, v);
    else if (f == "--perf-fifo") a.perf_fifo = v;
    else if (f == "--device") a.device = v;
    else if (f == "--dtype") a.dtype = v;
    else if (f == "--peak-tflops") a.peak_tflops = std::stod(v);
    else if (f == "--loss-only") a.loss_only = std::stoll(v);
    else throw std::invalid_argument(fmt::format("unknown option '{}' (see the top of bench_train.cpp)", f));
  }
  if (a.lm != "all" && a.lm != "lora" && a.lm != "user")
    throw std::invalid_argument("--lm-trainable: expected all, lora or user");
  if (a.dtype != "f32" && a.dtype != "bf16") throw std::invalid_argument("--dtype: expected f32 or bf16");
  if (a.seq < 4 || a.batch < 1 || a.mini_bs < 1 || a.steps < 1 || a.warmup < 0)
    throw std::invalid_argument("--seq >= 4, --batch-size, --mini-bs, --steps >= 1, --warmup >= 0");
  if (a.rows <= 0) a.rows = a.batch * (a.warmup + a.steps);
  return a;
}

// Multiply-adds of one forward, per the model's GEMMs (the matmuls of the
// linears, attention's two products over the causal half, the head on the
// target rows). Elementwise work is not counted.
struct ForwardMacs {
  double layers = 0;     // projections (+ LoRA branches)
  double attention = 0;  // QK^T and PV, causal (visible pairs only)
  double head = 0;       // target rows x V x H
};

ForwardMacs forward_macs(const Config& c, int64_t rows_per_step, int64_t L, int64_t targets_per_row,
                         std::optional<int64_t> lora_rank) {
  const TextConfig& t = c.text;
  const double H = double(t.hidden_size), I = double(t.intermediate_size);
  const double T = double(rows_per_step) * double(L);
  ForwardMacs m;
  double per_token = H * double(t.qkv_size()) + double(t.q_size()) * H + H * 2 * I + I * H;
  if (lora_rank) {
    const double r = double(*lora_rank);
    // A: in x r, B: r x out, on the four projections.
    per_token += r * ((H + double(t.qkv_size())) + (double(t.q_size()) + H) + (H + 2 * I) + (I + H));
  }
  m.layers = per_token * T * double(t.num_hidden_layers);
  const double pairs = double(L) * double(L + 1) / 2.0;  // causal, per row
  m.attention = 2.0 * double(t.num_attention_heads) * double(t.head_dim()) * pairs * double(rows_per_step) *
                double(t.num_hidden_layers);
  m.head = double(targets_per_row) * double(rows_per_step) * double(t.vocab_size) * H;
  return m;
}

double best_ms(const std::function<void()>& f, int reps) {
  f();
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_s();
    f();
    best = std::min(best, (now_s() - t0) * 1e3);
  }
  return best;
}

double gemm_gflops(int64_t m, int64_t n, int64_t k, int reps, bool transposed_b) {
  NoGradGuard ng;
  Generator g(0);
  Tensor a = rand_normal({m, k}, g, 0, 1);
  Tensor b = transposed_b ? rand_normal({n, k}, g, 0, 1) : rand_normal({k, n}, g, 0, 1);
  const double ms = best_ms([&] { transposed_b ? linear(a, b) : matmul(a, b); }, reps);
  return 2.0 * double(m) * double(n) * double(k) / ms / 1e6;
}

std::string json_list(const std::vector<double>& v, int digits) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += fmt::format("{}{:.{}f}", i ? ", " : "", v[i], digits);
  return s + "]";
}

// --loss-only: the loss's forward and backward on their own.
int loss_only(const Args& a, Phi4MMForCausalLM& model, Device dev) {
  const int64_t H = model.config().text.hidden_size;
  const int64_t per_row = a.half ? a.seq / 2 : a.seq - 1;
  const int64_t N = a.batch * per_row;
  Tensor head = model.model->embed_tokens->weight;
  head.set_requires_grad(true);
  Generator g(a.seed);
  Tensor hidden = rand_normal({N, H}, g, 0.0, 1.0, TensorOptions(head.dtype(), dev));
  hidden.set_requires_grad(true);
  const std::vector<int64_t> tg = bench_ids(N, kIdLimit, 7);
  const Tensor targets = from_vector(tg, {N});
  std::vector<double> fwd, bwd;
  double value = 0;
  for (int64_t r = 0; r <= a.loss_only; ++r) {
    head.zero_grad();
    hidden.zero_grad();
    double t0 = now_s();
    Tensor loss = mul(chunked_cross_entropy_sum(hidden, head, targets), 1.0 / double(N));
    value = loss.item();
    const double tf = now_s() - t0;
    t0 = now_s();
    loss.backward();
    backend(dev).synchronize(dev);
    const double tb = now_s() - t0;
    if (r > 0) fwd.push_back(tf), bwd.push_back(tb);
  }
  auto best = [](std::vector<double> v) { return *std::min_element(v.begin(), v.end()); };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  fmt::print("{{\"impl\": \"areno\", \"bench\": \"loss_only\", \"rows\": {}, \"vocab\": {}, \"hidden\": {}, "
             "\"loss\": {:.6f}, \"forward_s\": {}, \"backward_s\": {}, \"forward_best_s\": {:.3f}, "
             "\"forward_median_s\": {:.3f}, \"backward_best_s\": {:.3f}, \"backward_median_s\": {:.3f}, "
             "\"peak_rss_bytes\": {}}}\n",
             N, head.size(0), H, value, json_list(fwd, 3), json_list(bwd, 3), best(fwd), median(fwd), best(bwd),
             median(bwd), peak_rss_bytes());
  return 0;
}

int run(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const char* threads = std::getenv("OMP_NUM_THREADS");
  const double t_build = now_s();
  const Device dev = Device::parse(a.device);
  const DType dt = a.dtype == "bf16" ? DType::bf16 : DType::f32;
  std::shared_ptr<Phi4MMForCausalLM> model = init_phi4mm(a.preset, a.seed, dt);
  if (!dev.is_cpu()) model->to(dev);
  const double build_s = now_s() - t_build;
  const int64_t rss_model = peak_rss_bytes();

  if (a.loss_only > 0) return loss_only(a, *model, dev);
  const bool lora = a.lm != "all";
  if (a.lm == "user") {
    LoraConfig u;
    u.r = a.lora_rank;
    u.alpha = 2.0 * double(a.lora_rank);
    u.targets = kLoraTargets;
    model->add_user_lora(u, a.seed);
    NoGradGuard ng;
    for (auto& [name, p] : model->named_parameters()) {
      if (name.find(".lora_A.user.") == std::string::npos) continue;
      const int64_t n = p.numel(), in = p.size(1);
      std::vector<float> v(static_cast<size_t>(n));
      for (int64_t k = 0; k < n; ++k) v[size_t(k)] = float(std::sin(double(k + 1)) / std::sqrt(double(in)));
      p.copy_(from_vector(v, p.shape()).to(p.dtype()).to(p.device()));
    }
  }
  std::vector<SftRow> rows;
  for (int64_t r = 0; r < a.rows; ++r)
    rows.push_back(make_row(r, a.seq, a.half, a.lm == "lora" ? Adapter::vision : Adapter::none));
  const int64_t targets_per_row = rows[0].target_tokens;

  SftOptions o;
  o.max_steps = a.warmup + a.steps;
  o.batch_size = a.batch;
  o.mini_bs = a.mini_bs;
  o.lr = a.lr;
  o.decay = DecayStyle::constant;
  o.weight_decay = a.weight_decay;
  o.activation_checkpointing = a.ckpt;
  o.shuffle = false;
  o.groups.lm = lm_trainable_from_name(a.lm);
  SftTrainer trainer(model, rows, o);
  int64_t trained_params = 0;
  for (const Tensor& p : trainer.optimizer().parameters()) trained_params += p.numel();

  std::vector<double> losses, seconds, norms;
  double measured_s = 0;
  int64_t measured_tokens = 0, measured_targets = 0;
  auto perf_ctl = [&](const char* cmd) {
    if (a.perf_fifo.empty()) return;
    std::FILE* f = std::fopen(a.perf_fifo.c_str(), "w");
    if (!f) throw std::runtime_error("--perf-fifo " + a.perf_fifo + ": cannot open");
    std::fputs(cmd, f);
    std::fclose(f);
  };
  for (int64_t s = 0; s < a.warmup + a.steps; ++s) {
    if (s == a.warmup) {
      perf_ctl("enable\n");
      op_profile_reset();  // ARENO_PROFILE_OPS=1: the table counts the measured steps only
    }
    const double t_step = now_s();
    StepStats st = trainer.step();
    backend(dev).synchronize(dev);
    st.seconds = now_s() - t_step;
    losses.push_back(st.loss);
    seconds.push_back(st.seconds);
    norms.push_back(st.grad_norm);
    if (s >= a.warmup) {
      measured_s += st.seconds;
      measured_tokens += st.tokens;
      measured_targets += st.target_tokens;
    }
    fmt::print(stderr, "bench_train: step {} loss {:.6f} grad_norm {:.4f} {:.2f} s {}\n", st.step, st.loss,
               st.grad_norm, st.seconds, s < a.warmup ? "(warm-up)" : "");
  }
  perf_ctl("disable\n");
  const int64_t peak_rss = peak_rss_bytes();  // before the phase timings below
  const double tok_s = double(measured_tokens) / measured_s;

  // GEMM FLOPs of one step.
  std::optional<int64_t> rank;
  if (a.lm == "lora" && model->config().vision_lora) rank = model->config().vision_lora->r;
  if (a.lm == "user") rank = a.lora_rank;
  const ForwardMacs fm = forward_macs(model->config(), a.batch, a.seq, targets_per_row, rank);
  const double fwd = 2.0 * (fm.layers + fm.attention + fm.head);
  // Backward: 2x forward when weights train (input and weight gradients); the
  // LoRA run skips the frozen weights' gradients (1x for those, 2x for LoRA and
  // attention); the model FLOPs of the step, no recompute.
  double model_flops;
  if (!lora) {
    model_flops = 3.0 * fwd;
  } else {
    // frozen projections and head: forward + input gradient; attention: 3x.
    model_flops = 2.0 * 2.0 * (fm.layers + fm.head) + 3.0 * 2.0 * fm.attention;
  }
  // What our step runs again: the layers (checkpointing). The loss takes its
  // gradient products in the forward (train/loss.cpp), so the head runs once.
  const double recompute_flops = a.ckpt ? 2.0 * (fm.layers + fm.attention) : 0.0;
  const double step_s = measured_s / double(a.steps);

  std::string out = fmt::format(
      "{{\"impl\": \"areno\", \"device\": \"{}\", \"dtype\": \"{}\", \"preset\": \"{}\", \"seq\": {}, \"batch_size\": {}, \"mini_bs\": {}, "
      "\"activation_checkpointing\": {}, \"lm_trainable\": \"{}\", \"lora_rank\": {}, \"targets\": \"{}\", \"threads\": \"{}\", "
      "\"warmup_steps\": {}, \"steps\": {}, \"trained_params\": {}, \"target_tokens_per_step\": {}, "
      "\"tokens_per_s\": {:.2f}, \"target_tokens_per_s\": {:.2f}, \"s_per_step\": {:.3f}, "
      "\"step_seconds\": {}, \"losses\": {}, \"grad_norms\": {}, "
      "\"peak_rss_bytes\": {}, \"peak_rss_after_model_bytes\": {}, \"model_build_s\": {:.2f}, "
      "\"forward_gflop_per_step\": {:.2f}, \"head_gflop_fwd\": {:.2f}, \"layers_gflop_fwd\": {:.2f}, "
      "\"attention_gflop_fwd\": {:.2f}, \"model_gflop_per_step\": {:.2f}, \"recompute_gflop_per_step\": {:.2f}, "
      "\"model_gflops_achieved\": {:.2f}",
      dev.str(), a.dtype, a.preset, a.seq, a.batch, a.mini_bs, a.ckpt, a.lm, a.lm == "user" ? a.lora_rank : 0, a.half ? "half" : "all", threads ? threads : "",
      a.warmup, a.steps, trained_params, measured_targets / a.steps, tok_s,
      double(measured_targets) / measured_s, step_s, json_list(seconds, 3), json_list(losses, 6),
      json_list(norms, 5), peak_rss, rss_model, build_s, fwd / 1e9, 2 * fm.head / 1e9, 2 * fm.layers / 1e9,
      2 * fm.attention / 1e9, model_flops / 1e9, recompute_flops / 1e9, model_flops / step_s / 1e9);

  if (a.peak_tflops > 0)
    out += fmt::format(", \"peak_tflops\": {:.1f}, \"mfu\": {:.4f}", a.peak_tflops,
                       model_flops / step_s / (a.peak_tflops * 1e12));
  // Device memory: the caching allocator's high-water mark of live tensors
  // over the steps (weights, optimizer state, activations; as torch's
  // max_memory_allocated), read before the phase timings.
  if (dev.is_cuda()) out += fmt::format(", \"peak_gpu_bytes\": {}", cuda_peak_allocated_bytes(dev.index));

  if (a.phases) {
    // One micro-batch as accumulate() runs it, timed piece by piece.
    std::vector<int64_t> ids, targets;
    PackedBatch pb;
    pb.cu_seqlens = {0};
    int64_t ntarget = 0;
    for (int64_t i = 0; i < a.mini_bs; ++i) {
      const SftRow& r = rows[size_t(i)];
      ids.insert(ids.end(), r.ids.begin(), r.ids.end());
      targets.insert(targets.end(), r.targets.begin(), r.targets.end());
      pb.cu_seqlens.push_back(int64_t(ids.size()));
      pb.adapters.push_back(r.adapter);
      ntarget += r.target_tokens;
    }
    const int64_t T = int64_t(ids.size());
    pb.token_ids = from_vector(ids, {T});
    pb.recompute_layers = a.ckpt;
    const Tensor tg = from_vector(targets, {T});
    const Tensor& head = model->model->embed_tokens->weight;
    auto elapsed = [&](double since) {
      backend(dev).synchronize(dev);
      return now_s() - since;
    };
    trainer.optimizer().zero_grad();
    double t0 = now_s();
    Tensor hidden = model->hidden_states(pb);
    const double t_layers = elapsed(t0);
    t0 = now_s();
    Tensor loss = mul(chunked_cross_entropy_sum(hidden, head, tg), 1.0 / double(ntarget));
    (void)loss.item();
    const double t_loss = elapsed(t0);
    t0 = now_s();
    loss.backward();
    const double t_bwd = elapsed(t0);
    t0 = now_s();
    clip_grad_norm(trainer.optimizer().parameters(), 1.0);
    trainer.optimizer().step();
    trainer.optimizer().zero_grad();
    const double t_opt = elapsed(t0);
    // The loss's own backward (since the loss takes its gradient products in
    // its forward, only their scaling), from a leaf copy of the hidden states.
    Tensor leaf = hidden.detach();
    leaf.set_requires_grad(true);
    Tensor loss2 = mul(chunked_cross_entropy_sum(leaf, head, tg), 1.0 / double(ntarget));
    backend(dev).synchronize(dev);  // the forward's device work is not the backward's
    t0 = now_s();
    loss2.backward();
    const double t_loss_bwd = elapsed(t0);
    trainer.optimizer().zero_grad();
    double t_nograd = 0;
    {
      NoGradGuard ng;
      t0 = now_s();
      Tensor h = model->hidden_states(pb);
      (void)chunked_cross_entropy_sum(h, head, tg).item();
      t_nograd = elapsed(t0);
    }
    out += fmt::format(
        ", \"phase_rows\": {}, \"phase_forward_layers_s\": {:.3f}, \"phase_forward_loss_s\": {:.3f}, "
        "\"phase_backward_s\": {:.3f}, \"phase_loss_backward_s\": {:.3f}, \"phase_optimizer_s\": {:.3f}, "
        "\"phase_forward_nograd_s\": {:.3f}",
        a.mini_bs, t_layers, t_loss, t_bwd, t_loss_bwd, t_opt, t_nograd);
  }
  if (a.gemm_peak && dev.is_cpu()) {
    const int64_t H = model->config().text.hidden_size, V = model->config().text.vocab_size;
    const double g1 = gemm_gflops(1024, 1024, 1024, 5, false);
    const double g2 = gemm_gflops(4096, 4096, 512, 3, false);
    const double gh = gemm_gflops(1024, V, H, 2, true);
    const double peak = std::max(g1, g2);
    out += fmt::format(
        ", \"gemm_gflops_1024\": {:.1f}, \"gemm_gflops_4096x4096x512\": {:.1f}, \"gemm_gflops_head_1024xVxH\": {:.1f}, "
        "\"gemm_peak_gflops\": {:.1f}, \"model_flops_vs_gemm_peak\": {:.3f}, \"hardware_flops_vs_gemm_peak\": {:.3f}",
        g1, g2, gh, peak, model_flops / step_s / 1e9 / peak,
        (model_flops + recompute_flops) / step_s / 1e9 / peak);
  }
  fmt::print("{}}}\n", out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_train: {}\n", e.what());
    return 1;
  }
}
