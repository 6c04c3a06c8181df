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
  float b1 = float(args.beta1), b2 = float(args.beta2);
  auto run = [&](auto ptag, auto gtag) {
    using P = decltype(ptag);
    using G = decltype(gtag);
    P* pp = static_cast<P*>(param.data_ptr());
    const G* gp = static_cast<const G*>(grad.data_ptr());
    float* master_p = master.defined() ? static_cast<float*>(master.data_ptr()) : nullptr;
    parallel_for(n, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        float g = float(gp[i]);
        mp[i] = b1 * mp[i] + (1.0f - b1) * g;
        vp[i] = b2 * vp[i] + (1.0f - b2) * g * g;
        double denom = std::sqrt(double(vp[i]) / bc2) + args.eps;
        if (master_p) {
          double w = double(master_p[i]) * decay - step_size * double(mp[i]) / denom;
          master_p[i] = float(w);
          pp[i] = P(float(w));
        } else {
          double w = double(pp[i]) * decay - step_size * double(mp[i]) / denom;
          pp[i] = P(w);
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
