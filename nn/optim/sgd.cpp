#include "nn/optim/sgd.h"

#include <stdexcept>

#include "tensor/autograd.h"
#include "tensor/ops.h"

namespace areno {

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions options)
    : Optimizer(std::move(groups)), options_(options) {
  if (!(options.momentum >= 0.0)) throw std::invalid_argument("SGD: momentum must be >= 0");
  if (options.nesterov && (options.momentum <= 0.0 || options.dampening != 0.0))
    throw std::invalid_argument("SGD: Nesterov momentum needs momentum > 0 and dampening = 0");
}

void SGD::step() {
  NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const ParamGroup& grp = groups_[g];
    const double lr = current_lr(g);
    for (size_t i = 0; i < grp.params.size(); ++i) {
      Tensor p = grp.params[i];
      Tensor d = p.grad();
      if (!d.defined()) continue;
      if (d.dtype() != p.dtype()) d = d.to(p.dtype());
      ParamState& st = state_[g][i];
      if (grp.weight_decay != 0.0) d = add_scaled(d, p, grp.weight_decay);
      if (options_.momentum != 0.0) {
        auto it = st.tensors.find("momentum_buffer");
        if (it == st.tensors.end()) {
          // torch starts the buffer at the first gradient, without dampening
          it = st.tensors.emplace("momentum_buffer", d.contiguous().clone()).first;
        } else {
          Tensor& buf = it->second;
          buf.copy_(add_scaled(mul(buf, options_.momentum), d, 1.0 - options_.dampening));
        }
        d = options_.nesterov ? add_scaled(d, it->second, options_.momentum) : it->second;
      }
      st.step += 1;
      p.copy_(add_scaled(p, d, -lr));
    }
  }
  ++step_;
}

std::map<std::string, double> SGD::hyper() const {
  return {{"momentum", options_.momentum},
          {"dampening", options_.dampening},
          {"nesterov", options_.nesterov ? 1.0 : 0.0}};
}

void SGD::set_hyper(const std::map<std::string, double>& h) {
  options_.momentum = h.at("momentum");
  options_.dampening = h.at("dampening");
  options_.nesterov = h.at("nesterov") != 0.0;
}

std::vector<std::pair<std::string, DType>> SGD::state_keys(const Tensor& param) const {
  if (options_.momentum == 0.0) return {};
  return {{"momentum_buffer", param.dtype()}};
}

}  // namespace areno
