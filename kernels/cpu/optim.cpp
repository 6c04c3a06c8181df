// Fused AdamW step (decoupled weight decay), optionally through an f32 master copy.
#include <cmath>
#include <type_traits>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_common.h"

namespace areno::cpu {

void CpuBackend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                            const Tensor& v, const Tensor& master, const AdamWArgs& args) {
  int64_t n = param.numel();
  float* mp = static_cast<float*>(m.data_ptr());
  float* vp = static_cast<float*>(v.data_ptr());
  double bc1 = 1.0 - std::pow(args.beta1, double(args.step));
  double bc2 = 1.0 - std::pow(args.beta2, double(args.step));
  double step_size = args.lr / bc1;
  double decay = 1.0 - args.lr * args.weight_decay;
  const float b1 = float(args.beta1), b2 = float(args.beta2);
  const double eps = args.eps;
  auto run = [&](auto ptag, auto gtag) {
    using P = decltype(ptag);
    using G = decltype(gtag);
    P* __restrict pp = static_cast<P*>(param.data_ptr());
    const G* __restrict gp = static_cast<const G*>(grad.data_ptr());
    float* __restrict master_p = master.defined() ? static_cast<float*>(master.data_ptr()) : nullptr;
    // The moments' and the weight's new values; one loop per case, no
    // aliasing, so that the compiler vectorises it.
    parallel_for(n, 4096, [&](int64_t lo, int64_t hi) {
      float* __restrict m_ = mp;
      float* __restrict v_ = vp;
      if (master_p) {
        for (int64_t i = lo; i < hi; ++i) {
          const float g = float(gp[i]);
          const float mi = b1 * m_[i] + (1.0f - b1) * g, vi = b2 * v_[i] + (1.0f - b2) * g * g;
          m_[i] = mi, v_[i] = vi;
          const double w = double(master_p[i]) * decay - step_size * double(mi) / (std::sqrt(double(vi) / bc2) + eps);
          master_p[i] = float(w);
          pp[i] = P(float(w));
        }
      } else {
        for (int64_t i = lo; i < hi; ++i) {
          const float g = float(gp[i]);
          const float mi = b1 * m_[i] + (1.0f - b1) * g, vi = b2 * v_[i] + (1.0f - b2) * g * g;
          m_[i] = mi, v_[i] = vi;
          pp[i] = P(double(pp[i]) * decay - step_size * double(mi) / (std::sqrt(double(vi) / bc2) + eps));
        }
      }
    });
  };
  auto with_grad = [&](auto ptag) {
    switch (grad.dtype()) {
      case DType::f32: return run(ptag, float{});
      case DType::bf16: return run(ptag, BFloat16{});
      case DType::f16: return run(ptag, Half{});
      case DType::f64: return run(ptag, double{});
      default: throw std::invalid_argument("adamw_step: gradient must be floating point");
    }
  };
  switch (param.dtype()) {
    case DType::f32: return with_grad(float{});
    case DType::f64: return with_grad(double{});
    case DType::bf16: return with_grad(BFloat16{});
    case DType::f16: return with_grad(Half{});
    default: throw std::invalid_argument("adamw_step: parameter must be floating point");
  }
}

}  // namespace areno::cpu
