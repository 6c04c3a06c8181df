#pragma once
// CpuBackend: the kernel table of tensor/backend.h for the CPU, the
// reference every other backend is tested against. The methods are defined
// by topic across kernels/cpu/*.cpp (memory in allocator.cpp).
#include "tensor/backend.h"

namespace areno::cpu {

// Whether attention_train and attention_backward run for these operands (f32,
// the last dimension contiguous).
bool attention_train_supported(const Tensor& q, const Tensor& k, const Tensor& v);
// Adds to the FLOP counter `products` [B, HQ, TQ, D]-by-keys products over the
// (query, key) pairs the attention sees.
void count_attention_flops(const Tensor& q, const Tensor& k, bool causal, int products);

class CpuBackend final : public Backend {
 public:
  std::shared_ptr<Storage> allocate(size_t nbytes, Device device) override;
  std::shared_ptr<Storage> allocate_lazy_zeroed(size_t nbytes, Device device) override;
  void copy(const Tensor& src, const Tensor& dst) override;
  void fill(const Tensor& dst, double value) override;
  void arange(const Tensor& dst, double start, double step) override;
  void random(const Tensor& dst, RandomKind kind, double a, double b, uint64_t seed,
              uint64_t offset) override;
  void synchronize(Device device) override;

  void unary(UnaryOp op, const Tensor& x, const Tensor& out, double p0, double p1) override;
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out,
              double alpha) override;
  void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) override;

  void reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t n, int64_t inner,
              const Tensor& out) override;
  void cumsum(const Tensor& x, int64_t outer, int64_t n, int64_t inner,
              const Tensor& out) override;

  void softmax(const Tensor& x, const Tensor& out, bool log) override;
  void softmax_backward(const Tensor& y, const Tensor& dy, const Tensor& dx, bool log) override;
  void scaled_softmax(const Tensor& x, const Tensor& out, double scale, int64_t tq) override;
  void scaled_softmax_backward(const Tensor& y, const Tensor& dy, const Tensor& dx, double scale) override;
  bool cross_entropy_rows(const Tensor& logits, const Tensor& targets, const Tensor& loss) override;
  void sort(const Tensor& x, int64_t k, bool descending, const Tensor& values,
            const Tensor& indices) override;
  void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  const Tensor& y, const Tensor& mean, const Tensor& rstd) override;
  void layer_norm_backward(const Tensor& x, const Tensor& weight, const Tensor& mean,
                           const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                           const Tensor& dweight, const Tensor& dbias) override;
  void rms_norm(const Tensor& x, const Tensor& weight, double eps, const Tensor& y,
                const Tensor& rstd) override;
  void rms_norm_backward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                         const Tensor& dy, const Tensor& dx, const Tensor& dweight) override;
  void silu_and_mul(const Tensor& x, const Tensor& out) override;
  void add_rms_norm(const Tensor& a, const Tensor& b, const Tensor& weight, double eps, const Tensor& sum,
                    const Tensor& y, const Tensor& rstd) override;
  bool linear_pair(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& out1,
                   const Tensor& out2) override;
  void rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& out, bool transpose) override;

  void matmul(const Tensor& a, const Tensor& b, const Tensor& out, double alpha,
              double beta) override;
  bool matmul_f32_out(const Tensor& a, const Tensor& b, const Tensor& out, double alpha, double beta) override;

  bool linear_int8(const Tensor& x, const int8_t* w, const float* scales, const Tensor& out) override;
  bool linear_bias(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out) override;
  bool attention_inference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                           double scale, bool causal) override;
  bool attention_train(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                       double scale, bool causal) override;
  bool attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                          const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv, double scale,
                          bool causal) override;

  void index_select(const Tensor& x, const Tensor& index, const Tensor& out) override;
  void index_add(const Tensor& out, const Tensor& index, const Tensor& src) override;
  void gather(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out) override;
  void scatter(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src,
               bool accumulate) override;
  void masked_scatter(const Tensor& out, const Tensor& mask, const Tensor& src) override;

  void depthwise_conv2d_nhwc(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out, int64_t sh,
                             int64_t sw) override;
  void im2col(const Tensor& x, const ConvGeom& g, const Tensor& cols) override;
  void col2im(const Tensor& cols, const ConvGeom& g, const Tensor& dx) override;
  void avg_pool2d(const Tensor& x, const PoolGeom& g, const Tensor& out) override;
  void avg_pool2d_backward(const Tensor& dy, const PoolGeom& g, const Tensor& dx) override;

  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const Tensor& master, const AdamWArgs& args) override;
};

}  // namespace areno::cpu
