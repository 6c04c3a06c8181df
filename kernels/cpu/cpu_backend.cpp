// The CPU backend: forwards the kernel table to kernels/cpu/*.cpp.
#include "kernels/cpu/cpu_kernels.h"

namespace areno {

namespace {

class CpuBackend final : public Backend {
 public:
  std::shared_ptr<Storage> allocate(size_t nbytes, Device device) override {
    return Storage::allocate(nbytes, device);
  }
  void copy(const Tensor& src, const Tensor& dst) override { cpu::copy(src, dst); }
  void fill(const Tensor& dst, double value) override { cpu::fill(dst, value); }
  void arange(const Tensor& dst, double start, double step) override { cpu::arange(dst, start, step); }
  void random(const Tensor& dst, RandomKind kind, double a, double b, uint64_t seed, uint64_t offset) override {
    cpu::random(dst, kind, a, b, seed, offset);
  }
  void synchronize(Device) override {}
  void unary(UnaryOp op, const Tensor& x, const Tensor& out, double p0, double p1) override {
    cpu::unary(op, x, out, p0, p1);
  }
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out, double alpha) override {
    cpu::binary(op, a, b, out, alpha);
  }
  void where(const Tensor& c, const Tensor& a, const Tensor& b, const Tensor& out) override {
    cpu::where(c, a, b, out);
  }
  void reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t n, int64_t inner, const Tensor& out) override {
    cpu::reduce(op, x, outer, n, inner, out);
  }
  void cumsum(const Tensor& x, int64_t outer, int64_t n, int64_t inner, const Tensor& out) override {
    cpu::cumsum(x, outer, n, inner, out);
  }
  void softmax(const Tensor& x, const Tensor& out, bool log) override { cpu::softmax(x, out, log); }
  bool attention_inference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, double scale,
                           bool causal) override {
    return cpu::attention_inference(q, k, v, out, scale, causal);
  }
  void softmax_backward(const Tensor& y, const Tensor& dy, const Tensor& dx, bool log) override {
    cpu::softmax_backward(y, dy, dx, log);
  }
  void sort(const Tensor& x, int64_t k, bool descending, const Tensor& values, const Tensor& indices) override {
    cpu::sort(x, k, descending, values, indices);
  }
  void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, const Tensor& y,
                  const Tensor& mean, const Tensor& rstd) override {
    cpu::layer_norm(x, w, b, eps, y, mean, rstd);
  }
  void layer_norm_backward(const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd,
                           const Tensor& dy, const Tensor& dx, const Tensor& dw, const Tensor& db) override {
    cpu::layer_norm_backward(x, w, mean, rstd, dy, dx, dw, db);
  }
  void rms_norm(const Tensor& x, const Tensor& w, double eps, const Tensor& y, const Tensor& rstd) override {
    cpu::rms_norm(x, w, eps, y, rstd);
  }
  void rms_norm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                         const Tensor& dx, const Tensor& dw) override {
    cpu::rms_norm_backward(x, w, rstd, dy, dx, dw);
  }
  void matmul(const Tensor& a, const Tensor& b, const Tensor& out, double alpha, double beta) override {
    cpu::matmul(a, b, out, alpha, beta);
  }
  void index_select(const Tensor& x, const Tensor& index, const Tensor& out) override {
    cpu::index_select(x, index, out);
  }
  void index_add(const Tensor& out, const Tensor& index, const Tensor& src) override {
    cpu::index_add(out, index, src);
  }
  void gather(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out) override {
    cpu::gather(x, dim, index, out);
  }
  void scatter(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src, bool accumulate) override {
    cpu::scatter(out, dim, index, src, accumulate);
  }
  void masked_scatter(const Tensor& out, const Tensor& mask, const Tensor& src) override {
    cpu::masked_scatter(out, mask, src);
  }
  void im2col(const Tensor& x, const ConvGeom& g, const Tensor& cols) override { cpu::im2col(x, g, cols); }
  void col2im(const Tensor& cols, const ConvGeom& g, const Tensor& dx) override { cpu::col2im(cols, g, dx); }
  void avg_pool2d(const Tensor& x, const PoolGeom& g, const Tensor& out) override { cpu::avg_pool2d(x, g, out); }
  void avg_pool2d_backward(const Tensor& dy, const PoolGeom& g, const Tensor& dx) override {
    cpu::avg_pool2d_backward(dy, g, dx);
  }
  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const Tensor& master, const AdamWArgs& args) override {
    cpu::adamw_step(param, grad, m, v, master, args);
  }
};

}  // namespace

Backend& cpu_backend() {
  static CpuBackend b;
  return b;
}

}  // namespace areno
