#include "nn/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>
#include <string>

namespace areno {

WarmupConstantSchedule::WarmupConstantSchedule(int64_t warmup) : warmup_(warmup) {
  if (warmup < 0)
    throw std::invalid_argument("WarmupConstantSchedule: warmup must be >= 0, got " +
                                std::to_string(warmup));
}

double WarmupConstantSchedule::factor(int64_t step) const {
  if (step < warmup_) return double(step) / double(std::max<int64_t>(1, warmup_));
  return 1.0;
}

namespace {

void check_decay(const char* what, int64_t warmup, int64_t total, double min_ratio) {
  if (warmup < 0 || total < warmup)
    throw std::invalid_argument(std::string(what) + ": need 0 <= warmup <= total, got warmup " +
                                std::to_string(warmup) + ", total " + std::to_string(total));
  if (!(min_ratio >= 0.0 && min_ratio <= 1.0))
    throw std::invalid_argument(std::string(what) + ": min_ratio must be in [0, 1], got " +
                                std::to_string(min_ratio));
}

// Fraction of the decay done at `step` (0 at the end of warm-up, 1 from `total` on).
double decay_progress(int64_t step, int64_t warmup, int64_t total) {
  return std::min(1.0, double(step - warmup) / double(std::max<int64_t>(1, total - warmup)));
}

}  // namespace

WarmupCosineSchedule::WarmupCosineSchedule(int64_t warmup, int64_t total, double min_ratio)
    : warmup_(warmup), total_(total), min_ratio_(min_ratio) {
  check_decay("WarmupCosineSchedule", warmup, total, min_ratio);
}

double WarmupCosineSchedule::factor(int64_t step) const {
  if (step < warmup_) return double(step) / double(std::max<int64_t>(1, warmup_));
  const double progress = decay_progress(step, warmup_, total_);
  return min_ratio_ + (1.0 - min_ratio_) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

WarmupLinearSchedule::WarmupLinearSchedule(int64_t warmup, int64_t total, double min_ratio)
    : warmup_(warmup), total_(total), min_ratio_(min_ratio) {
  check_decay("WarmupLinearSchedule", warmup, total, min_ratio);
}

double WarmupLinearSchedule::factor(int64_t step) const {
  if (step < warmup_) return double(step) / double(std::max<int64_t>(1, warmup_));
  return min_ratio_ + (1.0 - min_ratio_) * (1.0 - decay_progress(step, warmup_, total_));
}

}  // namespace areno
