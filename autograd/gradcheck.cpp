#include "autograd/gradcheck.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace areno {

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, double eps, double atol, double rtol) {
  for (auto& t : inputs)
    if (t.defined() && t.requires_grad() && (t.dtype() != DType::f64 || !t.device().is_cpu()))
      throw std::invalid_argument("gradcheck needs f64 CPU inputs, got " + t.str());

  // Analytic: gradient of sum(f(x) * w).
  std::vector<Tensor> xs;
  for (auto& t : inputs) {
    if (!t.defined()) {
      xs.push_back(t);
      continue;
    }
    Tensor c = t.detach().clone();
    if (t.requires_grad()) c.set_requires_grad(true);
    xs.push_back(c);
  }
  Tensor y = f(xs);
  Generator gen(1234);
  Tensor w = rand_uniform(y.shape(), gen, 0.5, 1.5, DType::f64);
  {
    Tensor loss = sum(mul(y.to(DType::f64), w));
    if (!loss.requires_grad()) {
      GradcheckResult r;
      r.ok = false;
      r.message = "output does not depend on any input that requires grad";
      return r;
    }
    loss.backward();
  }

  GradcheckResult res;
  NoGradGuard ng;
  auto eval = [&](const std::vector<Tensor>& in) {
    return sum(mul(f(in).to(DType::f64), w)).item();
  };
  for (size_t i = 0; i < xs.size(); ++i) {
    if (!xs[i].defined() || !xs[i].requires_grad()) continue;
    Tensor analytic = xs[i].grad().defined() ? xs[i].grad().contiguous()
                                             : zeros(xs[i].shape(), DType::f64);
    std::vector<double> ag = analytic.to_vector<double>();
    Tensor base = xs[i].detach().contiguous().clone();
    double* p = base.data<double>();
    std::vector<Tensor> probe = xs;
    probe[i] = base;
    for (int64_t j = 0; j < base.numel(); ++j) {
      double orig = p[j];
      p[j] = orig + eps;
      double fp = eval(probe);
      p[j] = orig - eps;
      double fm = eval(probe);
      p[j] = orig;
      double numeric = (fp - fm) / (2 * eps);
      double err = std::abs(numeric - ag[j]);
      double rel = err / std::max(std::abs(numeric), 1e-12);
      res.max_abs_err = std::max(res.max_abs_err, err);
      if (err > atol) res.max_rel_err = std::max(res.max_rel_err, rel);
      if (err > atol + rtol * std::abs(numeric) && res.ok) {
        res.ok = false;
        res.message = fmt::format("input {} element {}: numeric {:.10g} vs analytic {:.10g}", i, j,
                                  numeric, ag[j]);
      }
    }
  }
  return res;
}

}  // namespace areno
