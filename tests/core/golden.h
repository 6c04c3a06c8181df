#pragma once
// Golden tensors written by the scripts in tests/reference/core/ (PyTorch) as
// JSON: {"tensors": {name: {"shape": [...], "dtype": "f64", "data": [...]}}}.
// JSON keeps the test independent of nn/io (safetensors) and is small for the
// few-KB tensors we store; f64 values are printed with 17 significant digits.
#include <nlohmann/json.hpp>

#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace areno::testing {

class Golden {
 public:
  explicit Golden(const std::string& path) : path_(path) {
    std::ifstream f(path);
    if (!f) throw std::runtime_error("cannot open golden file " + path);
    j_ = nlohmann::json::parse(f);
  }

  bool has(const std::string& name) const { return j_.at("tensors").contains(name); }

  // Every stored name that starts with `prefix`.
  std::vector<std::string> names(const std::string& prefix = "") const {
    std::vector<std::string> out;
    for (const auto& [k, v] : j_.at("tensors").items())
      if (k.compare(0, prefix.size(), prefix) == 0) out.push_back(k);
    return out;
  }

  Shape shape(const std::string& name) const {
    return entry(name).at("shape").get<std::vector<int64_t>>();
  }
  std::vector<double> values(const std::string& name) const {
    return entry(name).at("data").get<std::vector<double>>();
  }
  // The tensor on the CPU in its stored dtype (or `as` when given).
  Tensor tensor(const std::string& name, std::optional<DType> as = std::nullopt) const {
    DType dt = dtype_from_name(entry(name).at("dtype").get<std::string>());
    return from_vector<double>(values(name), shape(name), as.value_or(dt));
  }
  double scalar(const std::string& name) const { return values(name).at(0); }
  const nlohmann::json& meta() const { return j_.at("meta"); }

 private:
  const nlohmann::json& entry(const std::string& name) const {
    const auto& t = j_.at("tensors");
    if (!t.contains(name))
      throw std::runtime_error("golden file " + path_ + " has no tensor '" + name + "'");
    return t.at(name);
  }
  std::string path_;
  nlohmann::json j_;
};

}  // namespace areno::testing
