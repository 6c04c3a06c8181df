#include "app/flags.h"

#include <fmt/format.h>

#include <omp.h>
#include <sched.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <stdexcept>
#include <utility>

namespace areno::app {

int64_t parse_int_flag(const std::string& flag, const std::string& value, int64_t min_value) {
  try {
    size_t used = 0;
    const long long v = std::stoll(value, &used);
    if (used == value.size() && v >= min_value) return v;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(fmt::format("{}: expected an integer >= {}, got '{}'", flag, min_value, value));
}

std::optional<DType> parse_dtype_flag(const std::string& dtype) {
  if (dtype.empty()) return std::nullopt;
  if (dtype == "f32") return DType::f32;
  if (dtype == "bf16") return DType::bf16;
  throw std::invalid_argument(fmt::format("--dtype: expected f32 or bf16, got '{}'", dtype));
}

int physical_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return std::max(1, omp_get_num_procs());
  std::set<std::pair<int, int>> cores;  // (package, core) of each CPU we may run on
  int cpus = 0;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &set)) continue;
    ++cpus;
    const std::string dir = fmt::format("/sys/devices/system/cpu/cpu{}/topology/", c);
    int package = -1, core = -1;
    std::ifstream(dir + "physical_package_id") >> package;
    std::ifstream(dir + "core_id") >> core;
    cores.emplace(package, core < 0 ? c : core);  // no topology: count the CPU itself
  }
  return std::max<int>(1, cores.empty() ? cpus : int(cores.size()));
}

void apply_threads(int64_t threads) {
  if (threads > 0) {
    omp_set_num_threads(int(threads));
    return;
  }
  const char* env = std::getenv("OMP_NUM_THREADS");
  if (env != nullptr && *env != '\0') return;  // OpenMP already took it
  omp_set_num_threads(physical_cores());
}

namespace {

// The whole of `value` as a finite number, or nothing.
std::optional<double> parse_number(const std::string& value) {
  try {
    size_t used = 0;
    const double v = std::stod(value, &used);
    if (used == value.size() && std::isfinite(v)) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

}  // namespace

double parse_double_flag(const std::string& flag, const std::string& value, double min_value) {
  const std::optional<double> v = parse_number(value);
  if (v && *v >= min_value) return *v;
  throw std::invalid_argument(fmt::format("{}: expected a number >= {}, got '{}'", flag, min_value, value));
}

double parse_bounded_flag(const std::string& flag, const std::string& value, const serve::Bound& b) {
  const std::optional<double> v = parse_number(value);
  if (v && b.contains(*v)) return *v;
  throw std::invalid_argument(fmt::format("{}: expected a number in {}, got '{}'", flag, b.range(), value));
}

Flags::Flags(std::string command, const char* usage, OnUnknown on_unknown)
    : command_(std::move(command)), usage_(usage), on_unknown_(on_unknown) {}

Flags& Flags::value(std::string name, std::string& dst) {
  return value(std::move(name), [&dst](const std::string& v) { dst = v; });
}

Flags& Flags::value(std::string name, std::function<void(const std::string&)> set) {
  flags_.push_back({std::move(name), std::move(set), nullptr});
  return *this;
}

Flags& Flags::values(std::string name, std::function<void(const std::string&)> set) {
  flags_.push_back({std::move(name), std::move(set), nullptr, true});
  return *this;
}

Flags& Flags::toggle(std::string name, bool& dst, bool to) {
  return toggle(std::move(name), [&dst, to]() { dst = to; });
}

Flags& Flags::toggle(std::string name, std::function<void()> set) {
  flags_.push_back({std::move(name), nullptr, std::move(set)});
  return *this;
}

std::optional<int> Flags::parse(const Args& args) const {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      fmt::print("{}", usage_);
      return 0;
    }
    const Flag* flag = nullptr;
    for (const Flag& f : flags_)
      if (f.name == a) flag = &f;
    if (!flag) {
      if (on_unknown_ == OnUnknown::usage)
        fmt::print(stderr, "areno {}: unknown option '{}'\n\n{}", command_, a, usage_);
      else
        fmt::print(stderr, "areno {}: unknown option '{}'\n", command_, a);
      return 2;
    }
    if (flag->set_value) {
      if (i + 1 >= args.size()) throw std::invalid_argument(a + " needs a value");
      flag->set_value(args[++i]);
      while (flag->several && i + 1 < args.size() && !args[i + 1].starts_with('-')) flag->set_value(args[++i]);
    } else {
      flag->set();
    }
  }
  if (compute_threads_) apply_threads(*threads_);
  return std::nullopt;
}

Flags& Flags::compute_threads() {
  compute_threads_ = true;
  return integer("--threads", *threads_, 1);
}

}  // namespace areno::app
