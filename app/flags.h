#pragma once
// The command-line flags of one `areno` subcommand: register each flag with
// where its value goes, then parse the arguments in order (the last of a
// repeated flag wins). --help / -h print the usage; an unknown argument prints
// "areno <command>: unknown option '<arg>'" and the usage; a flag that takes a
// value and has none throws std::invalid_argument("<flag> needs a value").
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "app/commands.h"
#include "serve/sampler.h"
#include "tensor/dtype.h"

namespace areno::app {

// Flag value parsers that name the flag in their errors.
int64_t parse_int_flag(const std::string& flag, const std::string& value, int64_t min_value);
double parse_double_flag(const std::string& flag, const std::string& value, double min_value);
// A sampling parameter within its bound from the sampler's table (serve/sampler.h).
double parse_bounded_flag(const std::string& flag, const std::string& value, const serve::Bound& bound);
// --dtype: "" (the checkpoint's dtype: nullopt) | "f32" | "bf16".
std::optional<DType> parse_dtype_flag(const std::string& dtype);

// --threads N of the commands that run a model: the compute threads (the
// CPU kernels' OpenMP threads, oneDNN's). 0: OMP_NUM_THREADS when it is set,
// else the physical cores this process may run on (one thread per core: a
// second hyperthread on a core only contends for its vector units).
int physical_cores();
void apply_threads(int64_t threads);
inline constexpr const char* kThreadsHelp =
    "  --threads N               compute threads (default: OMP_NUM_THREADS, else the physical cores)\n";

class Flags {
 public:
  // What an unknown argument prints after its one-line message.
  enum class OnUnknown { usage, nothing };

  Flags(std::string command, const char* usage, OnUnknown on_unknown = OnUnknown::usage);

  // A flag that takes the next argument as its value.
  Flags& value(std::string name, std::string& dst);
  Flags& value(std::string name, std::function<void(const std::string&)> set);
  // A flag that takes one or more values: the arguments after it up to the
  // next one that starts with '-' (argparse's nargs='+', as vLLM's
  // --lora-modules A=X B=Y), `set` called with each in order.
  Flags& values(std::string name, std::function<void(const std::string&)> set);
  // A flag with an integer value (parse_int_flag).
  template <class T>
    requires std::is_arithmetic_v<T>
  Flags& integer(std::string name, T& dst, int64_t min_value) {
    return value(name, [&dst, name, min_value](const std::string& v) { dst = T(parse_int_flag(name, v, min_value)); });
  }
  // A flag without a value: sets dst to `to`, or calls `set`.
  Flags& toggle(std::string name, bool& dst, bool to = true);
  Flags& toggle(std::string name, std::function<void()> set);

  // --threads N (kThreadsHelp): parse() then calls apply_threads with it.
  Flags& compute_threads();

  // Applies the flags in order. nullopt: go on; otherwise the exit code to
  // return (0 after --help / -h, 2 after an unknown argument).
  std::optional<int> parse(const Args& args) const;

 private:
  struct Flag {
    std::string name;
    std::function<void(const std::string&)> set_value;  // flags with a value
    std::function<void()> set;                          // flags without one
    bool several = false;                               // values(): one or more
  };
  std::string command_;
  const char* usage_;
  OnUnknown on_unknown_;
  std::vector<Flag> flags_;
  bool compute_threads_ = false;
  std::shared_ptr<int64_t> threads_ = std::make_shared<int64_t>(0);
};

}  // namespace areno::app
