// The fused AdamW step, mirroring kernels/cpu/optim.cpp operation for
// operation (moments in f32, the update in f64) so both devices agree.
#include <cmath>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

namespace areno::cuda {
namespace {

template <typename P>
__global__ void adamw_kernel(P* param, const void* grad, DType grad_dtype, float* m, float* v,
                             float* master, int64_t n, float b1, float b2, double bc2, double eps,
                             double step_size, double decay) {
  ARENO_GRID_STRIDE_LOOP(i, n) {
    // Explicitly rounded steps: no FMA contraction, so the CPU's results are reproduced.
    float g = load_as<float>(grad_dtype, grad, i);
    float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(1.0f - b1, g));
    float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(1.0f - b2, g), g));
    m[i] = mi;
    v[i] = vi;
    double denom = __dadd_rn(sqrt(__ddiv_rn(double(vi), bc2)), eps);
    double update = __ddiv_rn(__dmul_rn(step_size, double(mi)), denom);
    if (master) {
      double w = __dsub_rn(__dmul_rn(double(master[i]), decay), update);
      master[i] = float(w);
      param[i] = cast_value<P>(float(w));
    } else {
      double w = __dsub_rn(__dmul_rn(cast_value<double>(param[i]), decay), update);
      if constexpr (is_half_v<P>) param[i] = cast_value<P>(float(w));
      else param[i] = cast_value<P>(w);
    }
  }
}

void check_f32_like(const Tensor& t, int64_t n, const char* name) {
  require_contiguous(t, "adamw_step", name);
  if (t.dtype() != DType::f32 || t.numel() != n)
    throw std::invalid_argument(std::string("cuda adamw_step: ") + name + " " + t.str() +
                                " must be f32 with " + std::to_string(n) + " elements");
}

}  // namespace
}  // namespace areno::cuda

namespace areno {

using namespace cuda;

void CudaBackend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m,
                             const Tensor& v, const Tensor& master, const AdamWArgs& args) {
  int64_t n = param.numel();
  require_contiguous(param, "adamw_step", "param");
  require_contiguous(grad, "adamw_step", "grad");
  if (grad.numel() != n || !is_floating(grad.dtype()))
    throw std::invalid_argument("cuda adamw_step: grad " + grad.str() + " must be floating with " +
                                std::to_string(n) + " elements");
  check_f32_like(m, n, "m");
  check_f32_like(v, n, "v");
  if (master.defined()) check_f32_like(master, n, "master");
  if (n == 0) return;
  double bc1 = 1.0 - std::pow(args.beta1, double(args.step));
  double bc2 = 1.0 - std::pow(args.beta2, double(args.step));
  double step_size = args.lr / bc1;
  double decay = 1.0 - args.lr * args.weight_decay;
  Launch l(param);
  visit_floating(param.dtype(), "adamw_step", [&](auto tag) {
    using P = typename decltype(tag)::type;
    adamw_kernel<P><<<grid_for(n), kBlock, 0, l.stream>>>(
        ptr<P>(param), grad.data_ptr(), grad.dtype(), ptr<float>(m), ptr<float>(v),
        master.defined() ? ptr<float>(master) : nullptr, n, float(args.beta1), float(args.beta2), bc2,
        args.eps, step_size, decay);
    ARENO_LAUNCH_CHECK("adamw_kernel");
  });
}

}  // namespace areno
