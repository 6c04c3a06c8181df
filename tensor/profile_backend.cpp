// ARENO_PROFILE_OPS=1: every backend call is timed and counted by kernel
// family, and a table goes to stderr at exit. On a GPU each call ends with a
// synchronize of its device, so a call's time is its own work (launch, host
// side and device side) and the sum over calls is the wall time spent in
// kernels; the program runs slower (no overlap of host and device work) but
// the shares show where a step goes. There is no GPU timeline tool on the
// lent machines (no nsys), so this is the profile a `--device cuda`
// benchmark can print. Keys: the method, the op for unary / binary / reduce,
// the dtype, and for matmul the M, N, K class.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tensor/backend.h"
#include "tensor/tensor.h"

namespace areno {
namespace {

using Clock = std::chrono::steady_clock;

struct Entry {
  int64_t calls = 0;
  double seconds = 0;
};

class Profile {
 public:
  void add(const std::string& key, double s) {
    std::lock_guard<std::mutex> lock(mutex_);
    Entry& e = entries_[key];
    ++e.calls;
    e.seconds += s;
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.clear();
  }
  void print() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<std::string, Entry>> rows(entries_.begin(), entries_.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
    double total = 0;
    int64_t calls = 0;
    for (const auto& [k, e] : rows) total += e.seconds, calls += e.calls;
    std::fprintf(stderr, "ARENO_PROFILE_OPS: %lld backend calls, %.3f s in them\n", (long long)calls, total);
    std::fprintf(stderr, "%10s %10s %7s %10s  %s\n", "seconds", "calls", "share", "mean us", "kernel");
    for (const auto& [k, e] : rows) {
      if (e.seconds < total * 1e-4) continue;
      std::fprintf(stderr, "%10.4f %10lld %6.1f%% %10.1f  %s\n", e.seconds, (long long)e.calls,
                   100.0 * e.seconds / std::max(total, 1e-12), 1e6 * e.seconds / double(e.calls), k.c_str());
    }
  }

 private:
  std::mutex mutex_;
  std::map<std::string, Entry> entries_;
};

// Never destroyed (backend calls may come from other static destructors); the
// table is printed by an atexit handler registered at the first call.
Profile* profile_instance = nullptr;
void print_profile() { profile_instance->print(); }
Profile& profile() {
  static Profile* p = [] {
    profile_instance = new Profile();
    std::atexit(print_profile);
    return profile_instance;
  }();
  return *p;
}

const char* const kUnary[] = {"neg", "exp", "log", "sqrt", "rsqrt", "abs", "sin", "cos", "square", "reciprocal",
                              "relu", "silu", "sigmoid", "tanh", "gelu", "gelu_tanh", "logical_not", "affine",
                              "pow_scalar", "clamp"};
const char* const kBinary[] = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt",
                               "ge", "logical_and", "logical_or", "relu_backward", "silu_backward",
                               "sigmoid_backward", "tanh_backward", "gelu_backward", "gelu_tanh_backward"};
const char* const kReduce[] = {"sum", "max", "min", "argmax", "argmin", "sum_squares"};
template <size_t N>
std::string op_name(const char* const (&names)[N], int op) {
  return op >= 0 && size_t(op) < N ? names[op] : std::to_string(op);
}

// Powers of 4 name a size class: "1", "<=4", ..., so keys stay few.
std::string size_class(int64_t n) {
  int64_t c = 1;
  while (c < n) c *= 4;
  return c == 1 ? "1" : fmt::format("<={}", c);
}

class ProfilingBackend final : public Backend {
 private:
  static std::string key(const std::string& name, const Tensor& t) {
    return t.defined() ? name + " " + std::string(dtype_name(t.dtype())) : name;
  }
  template <typename F>
  auto timed(const std::string& k, Device device, F&& f) {
    const auto t0 = Clock::now();
    auto done = [&] {
      if (device.is_cuda()) inner_.synchronize(device);
      profile().add(k, std::chrono::duration<double>(Clock::now() - t0).count());
    };
    if constexpr (std::is_void_v<decltype(f())>) {
      f();
      done();
    } else {
      auto r = f();
      done();
      return r;
    }
  }

  Backend& inner_;

 public:
  explicit ProfilingBackend(Backend& inner) : inner_(inner) {}

  std::shared_ptr<Storage> allocate(size_t nbytes, Device device) override {
    return timed("allocate", device, [&] { return inner_.allocate(nbytes, device); });
  }
  std::shared_ptr<Storage> allocate_lazy_zeroed(size_t nbytes, Device device) override {
    return timed("allocate_lazy_zeroed", device, [&] { return inner_.allocate_lazy_zeroed(nbytes, device); });
  }
  void copy(const Tensor& src, const Tensor& dst) override {
    const std::string key = fmt::format("copy {}->{} {}->{} N{}", src.device().str(), dst.device().str(),
                                        dtype_name(src.dtype()), dtype_name(dst.dtype()), size_class(dst.numel()));
    timed(key, src.device().is_cuda() ? src.device() : dst.device(), [&] { inner_.copy(src, dst); });
  }
  void fill(const Tensor& dst, double value) override {
    timed(key("fill", dst), dst.device(), [&] { inner_.fill(dst, value); });
  }
  void arange(const Tensor& dst, double start, double step) override {
    timed(key("arange", dst), dst.device(), [&] { inner_.arange(dst, start, step); });
  }
  void random(const Tensor& dst, RandomKind kind, double a, double b, uint64_t seed, uint64_t offset) override {
    timed(key("random", dst), dst.device(), [&] { inner_.random(dst, kind, a, b, seed, offset); });
  }
  void synchronize(Device device) override { inner_.synchronize(device); }
  void unary(UnaryOp op, const Tensor& x, const Tensor& out, double p0, double p1) override {
    timed(key("unary " + op_name(kUnary, int(op)), out), out.device(), [&] { inner_.unary(op, x, out, p0, p1); });
  }
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out, double alpha) override {
    timed(key("binary " + op_name(kBinary, int(op)), out), out.device(), [&] { inner_.binary(op, a, b, out, alpha); });
  }
  void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) override {
    timed(key("where", out), out.device(), [&] { inner_.where(cond, a, b, out); });
  }
  void reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t n, int64_t inner, const Tensor& out) override {
    timed(key("reduce " + op_name(kReduce, int(op)), x), x.device(), [&] { inner_.reduce(op, x, outer, n, inner, out); });
  }
  void cumsum(const Tensor& x, int64_t outer, int64_t n, int64_t inner, const Tensor& out) override {
    timed(key("cumsum", x), x.device(), [&] { inner_.cumsum(x, outer, n, inner, out); });
  }
  void softmax(const Tensor& x, const Tensor& out, bool log) override {
    timed(key(log ? "log_softmax" : "softmax", x), x.device(), [&] { inner_.softmax(x, out, log); });
  }
  void softmax_backward(const Tensor& y, const Tensor& dy, const Tensor& dx, bool log) override {
    timed(key("softmax_backward", y), y.device(), [&] { inner_.softmax_backward(y, dy, dx, log); });
  }
  void scaled_softmax(const Tensor& x, const Tensor& out, double scale, int64_t tq) override {
    timed(key("scaled_softmax", x), x.device(), [&] { inner_.scaled_softmax(x, out, scale, tq); });
  }
  void scaled_softmax_backward(const Tensor& y, const Tensor& dy, const Tensor& dx, double scale) override {
    timed(key("scaled_softmax_backward", y), y.device(), [&] { inner_.scaled_softmax_backward(y, dy, dx, scale); });
  }
  bool cross_entropy_rows(const Tensor& logits, const Tensor& targets, const Tensor& loss) override {
    return timed(key("cross_entropy_rows", logits), logits.device(),
                 [&] { return inner_.cross_entropy_rows(logits, targets, loss); });
  }
  void sort(const Tensor& x, int64_t k, bool descending, const Tensor& values, const Tensor& indices) override {
    timed(key("sort", x), x.device(), [&] { inner_.sort(x, k, descending, values, indices); });
  }
  void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& y,
                  const Tensor& mean, const Tensor& rstd) override {
    timed(key("layer_norm", x), x.device(), [&] { inner_.layer_norm(x, weight, bias, eps, y, mean, rstd); });
  }
  void layer_norm_backward(const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                           const Tensor& dy, const Tensor& dx, const Tensor& dweight, const Tensor& dbias) override {
    timed(key("layer_norm_backward", x), x.device(),
          [&] { inner_.layer_norm_backward(x, weight, mean, rstd, dy, dx, dweight, dbias); });
  }
  void rms_norm(const Tensor& x, const Tensor& weight, double eps, const Tensor& y, const Tensor& rstd) override {
    timed(key("rms_norm", x), x.device(), [&] { inner_.rms_norm(x, weight, eps, y, rstd); });
  }
  void rms_norm_backward(const Tensor& x, const Tensor& weight, const Tensor& rstd, const Tensor& dy,
                         const Tensor& dx, const Tensor& dweight) override {
    timed(key("rms_norm_backward", x), x.device(), [&] { inner_.rms_norm_backward(x, weight, rstd, dy, dx, dweight); });
  }
  void silu_and_mul(const Tensor& x, const Tensor& out) override {
    timed(key("silu_and_mul", x), x.device(), [&] { inner_.silu_and_mul(x, out); });
  }
  void add_rms_norm(const Tensor& a, const Tensor& b, const Tensor& weight, double eps, const Tensor& sum,
                    const Tensor& y, const Tensor& rstd) override {
    timed(key("add_rms_norm", a), a.device(), [&] { inner_.add_rms_norm(a, b, weight, eps, sum, y, rstd); });
  }
  void rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& out, bool transpose) override {
    timed(key(transpose ? "rotary_transpose" : "rotary", x), x.device(),
          [&] { inner_.rotary(x, cos, sin, out, transpose); });
  }
  bool matmul_f32_out(const Tensor& a, const Tensor& b, const Tensor& out, double alpha, double beta) override {
    const std::string k = fmt::format("matmul {}->f32 B{} M{} N{} K{}", dtype_name(a.dtype()), size_class(out.size(0)),
                                      size_class(out.size(1)), size_class(out.size(2)), size_class(a.size(2)));
    return timed(k, out.device(), [&] { return inner_.matmul_f32_out(a, b, out, alpha, beta); });
  }
  void matmul(const Tensor& a, const Tensor& b, const Tensor& out, double alpha, double beta) override {
    const std::string k = fmt::format("matmul {} B{} M{} N{} K{}", dtype_name(out.dtype()), size_class(out.size(0)),
                                      size_class(out.size(1)), size_class(out.size(2)), size_class(a.size(2)));
    timed(k, out.device(), [&] { inner_.matmul(a, b, out, alpha, beta); });
  }
  bool linear_int8(const Tensor& x, const int8_t* w, const float* scales, const Tensor& out) override {
    return timed(key("linear_int8", out), out.device(), [&] { return inner_.linear_int8(x, w, scales, out); });
  }
  bool linear_pair(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& out1,
                   const Tensor& out2) override {
    const std::string k = fmt::format("linear_pair {} M{} N{}+{} K{}", dtype_name(x.dtype()), size_class(x.size(0)),
                                      size_class(w1.size(0)), size_class(w2.size(0)), size_class(x.size(1)));
    return timed(k, x.device(), [&] { return inner_.linear_pair(x, w1, w2, out1, out2); });
  }
  bool linear_bias(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out) override {
    const std::string k = fmt::format("linear_bias {} M{} N{} K{}", dtype_name(x.dtype()), size_class(x.size(0)),
                                      size_class(w.size(0)), size_class(x.size(1)));
    return timed(k, out.device(), [&] { return inner_.linear_bias(x, w, bias, out); });
  }
  bool attention_inference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, double scale,
                           bool causal) override {
    return timed(key("attention_inference", q), q.device(),
                 [&] { return inner_.attention_inference(q, k, v, out, scale, causal); });
  }
  bool attention_train(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                       double scale, bool causal) override {
    return timed(key("attention_train", q), q.device(),
                 [&] { return inner_.attention_train(q, k, v, out, lse, scale, causal); });
  }
  bool attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                          const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv, double scale,
                          bool causal) override {
    return timed(key("attention_backward", q), q.device(),
                 [&] { return inner_.attention_backward(q, k, v, out, lse, dout, dq, dk, dv, scale, causal); });
  }
  void index_select(const Tensor& x, const Tensor& index, const Tensor& out) override {
    timed(key("index_select", out), out.device(), [&] { inner_.index_select(x, index, out); });
  }
  void index_add(const Tensor& out, const Tensor& index, const Tensor& src) override {
    timed(key("index_add", out), out.device(), [&] { inner_.index_add(out, index, src); });
  }
  void gather(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out) override {
    timed(key("gather", out), out.device(), [&] { inner_.gather(x, dim, index, out); });
  }
  void scatter(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src, bool accumulate) override {
    timed(key("scatter", out), out.device(), [&] { inner_.scatter(out, dim, index, src, accumulate); });
  }
  void masked_scatter(const Tensor& out, const Tensor& mask, const Tensor& src) override {
    timed(key("masked_scatter", out), out.device(), [&] { inner_.masked_scatter(out, mask, src); });
  }
  void depthwise_conv2d_nhwc(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out, int64_t sh,
                             int64_t sw) override {
    timed(key("depthwise_conv2d_nhwc", x), x.device(), [&] { inner_.depthwise_conv2d_nhwc(x, w, bias, out, sh, sw); });
  }
  void im2col(const Tensor& x, const ConvGeom& g, const Tensor& cols) override {
    timed(key("im2col", x), x.device(), [&] { inner_.im2col(x, g, cols); });
  }
  void col2im(const Tensor& cols, const ConvGeom& g, const Tensor& dx) override {
    timed(key("col2im", dx), dx.device(), [&] { inner_.col2im(cols, g, dx); });
  }
  void avg_pool2d(const Tensor& x, const PoolGeom& g, const Tensor& out) override {
    timed(key("avg_pool2d", x), x.device(), [&] { inner_.avg_pool2d(x, g, out); });
  }
  void avg_pool2d_backward(const Tensor& dy, const PoolGeom& g, const Tensor& dx) override {
    timed(key("avg_pool2d_backward", dx), dx.device(), [&] { inner_.avg_pool2d_backward(dy, g, dx); });
  }
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& master,
                  const AdamWArgs& args) override {
    timed(key("adamw_step", param), param.device(), [&] { inner_.adamw_step(param, grad, m, v, master, args); });
  }

};

}  // namespace

bool op_profile_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("ARENO_PROFILE_OPS");
    return v && *v && std::string(v) != "0";
  }();
  return on;
}

void op_profile_reset() {
  if (op_profile_enabled()) profile().reset();
}

void op_profile_print(const std::string& heading) {
  if (!op_profile_enabled()) return;
  std::fprintf(stderr, "-- %s\n", heading.c_str());
  profile().print();
  profile().reset();
}

Backend& profiled_backend(Device device) {
  if (device.is_cuda()) {
    static ProfilingBackend cuda(cuda_backend());
    return cuda;
  }
  static ProfilingBackend cpu(cpu_backend());
  return cpu;
}

}  // namespace areno
