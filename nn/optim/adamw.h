#pragma once
// AdamW (Loshchilov & Hutter): decoupled weight decay, bias-corrected moments.
// Moments are f32; bf16/f16 parameters keep an f32 master copy that the update
// applies to, and the parameter is the master rounded to its dtype. The update
// is the fused Backend::adamw_step kernel of the parameter's device.
#include "nn/optim/optimizer.h"
#include "tensor/backend.h"

namespace areno {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
};

class AdamW : public Optimizer {
 public:
  explicit AdamW(std::vector<ParamGroup> groups, AdamWOptions options = {});
  void step() override;
  const AdamWOptions& options() const { return options_; }

 protected:
  std::string kind() const override { return "AdamW"; }
  std::map<std::string, double> hyper() const override;
  void set_hyper(const std::map<std::string, double>& h) override;
  std::vector<std::pair<std::string, DType>> state_keys(const Tensor& param) const override;

 private:
  AdamWOptions options_;
};

// One AdamW update of `param` in place (checks the tensors, then runs the
// device's fused kernel). m, v: f32 of param's shape; master: f32 copy for a
// bf16/f16 param, undefined for f32/f64. Non-contiguous params are updated through
// a contiguous copy.
void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const Tensor& master, const AdamWArgs& args);

}  // namespace areno
