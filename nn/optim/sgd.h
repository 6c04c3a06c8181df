#pragma once
// SGD with momentum, dampening, Nesterov and (coupled, L2) weight decay, with
// torch.optim.SGD's update rule. Written with tensor ops, so it runs on every
// device; the momentum buffer has the parameter's dtype.
#include "nn/optim/optimizer.h"

namespace areno {

struct SGDOptions {
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  explicit SGD(std::vector<ParamGroup> groups, SGDOptions options = {});
  void step() override;
  const SGDOptions& options() const { return options_; }

 protected:
  std::string kind() const override { return "SGD"; }
  std::map<std::string, double> hyper() const override;
  void set_hyper(const std::map<std::string, double>& h) override;
  std::vector<std::pair<std::string, DType>> state_keys(const Tensor& param) const override;

 private:
  SGDOptions options_;
};

}  // namespace areno
