#pragma once
// Learning-rate schedules: a factor on a group's base learning rate as a
// function of the number of optimizer steps already taken (0 for the first
// step), as torch.optim.lr_scheduler.LambdaLR applies one. Schedules are
// stateless, so resuming needs only the step count the optimizer saves.
#include <cstdint>
#include <memory>

namespace areno {

class LrSchedule {
 public:
  virtual ~LrSchedule() = default;
  virtual double factor(int64_t step) const = 0;
};

// Always 1.
class ConstantSchedule : public LrSchedule {
 public:
  double factor(int64_t) const override { return 1.0; }
};

// step / warmup for the first `warmup` steps (0 at step 0), then 1
// (transformers' get_constant_schedule_with_warmup).
class WarmupConstantSchedule : public LrSchedule {
 public:
  explicit WarmupConstantSchedule(int64_t warmup);
  double factor(int64_t step) const override;

 private:
  int64_t warmup_;
};

// Linear warm-up as above, then a half cosine from 1 down to `min_ratio` at
// step `total`, held there afterwards. With warmup = 0 this is
// torch's CosineAnnealingLR(T_max = total, eta_min = min_ratio * lr) up to
// step `total`.
class WarmupCosineSchedule : public LrSchedule {
 public:
  WarmupCosineSchedule(int64_t warmup, int64_t total, double min_ratio = 0.0);
  double factor(int64_t step) const override;

 private:
  int64_t warmup_, total_;
  double min_ratio_;
};

// Linear warm-up as above, then a straight line from 1 down to `min_ratio` at
// step `total`, held there afterwards (transformers'
// get_linear_schedule_with_warmup when min_ratio = 0).
class WarmupLinearSchedule : public LrSchedule {
 public:
  WarmupLinearSchedule(int64_t warmup, int64_t total, double min_ratio = 0.0);
  double factor(int64_t step) const override;

 private:
  int64_t warmup_, total_;
  double min_ratio_;
};

}  // namespace areno
