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

WarmupCosineSchedule::WarmupCosineSchedule(int64_t warmup, int64_t total, double min_ratio)
    : warmup_(warmup), total_(total), min_ratio_(min_ratio) {
  if (warmup < 0 || total < warmup)
    throw std::invalid_argument("WarmupCosineSchedule: need 0 <= warmup <= total, got warmup " +
                                std::to_string(warmup) + ", total " + std::to_string(total));
  if (!(min_ratio >= 0.0 && min_ratio <= 1.0))
    throw std::invalid_argument("WarmupCosineSchedule: min_ratio must be in [0, 1], got " +
                                std::to_string(min_ratio));
}

double WarmupCosineSchedule::factor(int64_t step) const {
  if (step < warmup_) return double(step) / double(std::max<int64_t>(1, warmup_));
  const double progress =
      std::min(1.0, double(step - warmup_) / double(std::max<int64_t>(1, total_ - warmup_)));
  return min_ratio_ + (1.0 - min_ratio_) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace areno
