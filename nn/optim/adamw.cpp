#include "nn/optim/adamw.h"

#include <stdexcept>

#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace areno {

namespace {
bool is_16bit_float(DType t) { return t == DType::bf16 || t == DType::f16; }
}  // namespace

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const Tensor& master, const AdamWArgs& args) {
  auto bad = [&](const std::string& what) {
    throw std::invalid_argument("adamw_update (param " + param.str() + "): " + what);
  };
  if (!is_floating(param.dtype())) bad("parameters must be floating point");
  if (grad.shape() != param.shape()) bad("grad has shape " + shape_str(grad.shape()));
  if (grad.device() != param.device()) bad("grad is on " + grad.device().str());
  for (const Tensor* t : {&m, &v}) {
    if (t->dtype() != DType::f32 || t->shape() != param.shape() || t->device() != param.device() ||
        !t->is_contiguous())
      bad("moments must be contiguous f32 of the parameter's shape and device, got " + t->str());
  }
  if (is_16bit_float(param.dtype())) {
    if (!master.defined() || master.dtype() != DType::f32 || master.shape() != param.shape() ||
        master.device() != param.device() || !master.is_contiguous())
      bad("a 16-bit parameter needs a contiguous f32 master copy of its shape");
  } else if (master.defined()) {
    bad("an f32/f64 parameter takes no master copy");
  }
  if (args.step < 1) bad("step must be >= 1 (it drives bias correction)");

  NoGradGuard no_grad;
  // The kernel takes the gradient in the parameter's dtype, contiguous.
  Tensor g = grad.dtype() == param.dtype() ? grad.contiguous() : grad.to(param.dtype());
  if (param.is_contiguous()) {
    backend(param.device()).adamw_step(param, g, m, v, master, args);
  } else {
    Tensor p = param.contiguous();
    backend(param.device()).adamw_step(p, g, m, v, master, args);
    Tensor(param).copy_(p);
  }
}

AdamW::AdamW(std::vector<ParamGroup> groups, AdamWOptions options)
    : Optimizer(std::move(groups)), options_(options) {
  if (!(options.beta1 >= 0.0 && options.beta1 < 1.0) || !(options.beta2 >= 0.0 && options.beta2 < 1.0))
    throw std::invalid_argument("AdamW: betas must be in [0, 1)");
  if (!(options.eps >= 0.0)) throw std::invalid_argument("AdamW: eps must be >= 0");
}

void AdamW::step() {
  NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const ParamGroup& grp = groups_[g];
    const double lr = current_lr(g);
    for (size_t i = 0; i < grp.params.size(); ++i) {
      const Tensor& p = grp.params[i];
      Tensor grad = p.grad();
      if (!grad.defined()) continue;
      ParamState& st = state_[g][i];
      if (st.tensors.empty()) {
        TensorOptions f32(DType::f32, p.device());
        st.tensors["exp_avg"] = zeros(p.shape(), f32);
        st.tensors["exp_avg_sq"] = zeros(p.shape(), f32);
        if (is_16bit_float(p.dtype())) st.tensors["master"] = p.to(DType::f32).contiguous();
      }
      st.step += 1;
      auto master = st.tensors.find("master");
      adamw_update(p, grad, st.tensors.at("exp_avg"), st.tensors.at("exp_avg_sq"),
                   master == st.tensors.end() ? Tensor() : master->second,
                   AdamWArgs{lr, options_.beta1, options_.beta2, options_.eps, grp.weight_decay,
                             st.step});
    }
  }
  ++step_;
}

std::map<std::string, double> AdamW::hyper() const {
  return {{"beta1", options_.beta1}, {"beta2", options_.beta2}, {"eps", options_.eps}};
}

void AdamW::set_hyper(const std::map<std::string, double>& h) {
  options_.beta1 = h.at("beta1");
  options_.beta2 = h.at("beta2");
  options_.eps = h.at("eps");
}

std::vector<std::pair<std::string, DType>> AdamW::state_keys(const Tensor& param) const {
  std::vector<std::pair<std::string, DType>> keys{{"exp_avg", DType::f32}, {"exp_avg_sq", DType::f32}};
  if (is_16bit_float(param.dtype())) keys.emplace_back("master", DType::f32);
  return keys;
}

}  // namespace areno
