#pragma once
// Optimizer base: parameter groups with their own learning rate, weight decay
// and schedule; per-parameter state tensors; zero_grad; state save/load to a
// safetensors file. AdamW and SGD (adamw.h, sgd.h) implement step().
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nn/optim/schedule.h"
#include "tensor/tensor.h"

namespace areno {

struct ParamGroup {
  std::string name;  // for reports and checks ("lm", "lm.no_decay"); may be empty
  std::vector<Tensor> params;
  // Names used as keys in state files; "g<group>.p<index>" when left empty.
  // Giving Module::named_parameters() names makes state files readable and
  // robust to reordering.
  std::vector<std::string> names;
  double lr = 1e-3;  // base learning rate; the schedule scales it
  double weight_decay = 0.0;
  std::shared_ptr<LrSchedule> schedule;  // null: constant
};

class Optimizer {
 public:
  explicit Optimizer(std::vector<ParamGroup> groups);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Updates every parameter that has a gradient, then advances the step count.
  virtual void step() = 0;
  // Drops every parameter's gradient (torch's set_to_none = true).
  void zero_grad();

  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  // Number of step() calls so far (what schedules see, unless set below).
  int64_t step_count() const { return step_; }
  // Schedules see `k` instead of step_count() from now on: a trainer that
  // takes several optimizer steps per training step (PPO's passes and
  // mini-batches) keeps one learning rate per training step, as verl steps
  // its scheduler once per update. Not saved; the trainer sets it each step.
  void set_schedule_step(int64_t k) { schedule_step_ = k; }
  // The learning rate group `g` uses at the next step.
  double current_lr(size_t g) const;
  // All parameters of all groups.
  std::vector<Tensor> parameters() const;

  // Saves state tensors ("<param name>.<key>") and, as metadata, the
  // optimizer kind, step counts and hyper-parameters.
  void save_state(const std::string& path) const;
  // Restores what save_state wrote, hyper-parameters included (as torch's
  // load_state_dict does); schedules are code and stay as constructed. Checks
  // the kind, the groups, names and shapes; throws naming the file and the
  // offending parameter, and leaves this optimizer unchanged on failure.
  void load_state(const std::string& path);

 protected:
  struct ParamState {
    int64_t step = 0;  // updates this parameter received (bias correction)
    std::map<std::string, Tensor> tensors;
  };
  virtual std::string kind() const = 0;
  // Optimizer-specific hyper-parameters as key -> value, saved and restored.
  virtual std::map<std::string, double> hyper() const = 0;
  virtual void set_hyper(const std::map<std::string, double>& h) = 0;
  // State tensors (key, dtype) a parameter that has taken a step must have.
  virtual std::vector<std::pair<std::string, DType>> state_keys(const Tensor& param) const = 0;

  const std::string& param_name(size_t g, size_t i) const { return names_[g][i]; }

  std::vector<ParamGroup> groups_;
  std::vector<std::vector<ParamState>> state_;  // [group][param]
  int64_t step_ = 0;
  int64_t schedule_step_ = -1;  // -1: step_

 private:
  std::vector<std::vector<std::string>> names_;  // resolved names
};

// Scales all gradients so that their global L2 norm is at most max_norm and
// returns the norm before scaling (accumulated in f32 per tensor, f64 across
// tensors). Parameters without a gradient are skipped. As torch's
// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), applied when below 1.
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm);

}  // namespace areno
