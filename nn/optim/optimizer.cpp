#include "nn/optim/optimizer.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "nn/io/safetensors.h"
#include "tensor/autograd.h"
#include "tensor/backend.h"
#include "tensor/ops.h"

namespace areno {

namespace {
constexpr const char* kStateFormat = "areno.optimizer.v1";
}

Optimizer::Optimizer(std::vector<ParamGroup> groups) : groups_(std::move(groups)) {
  std::set<std::string> seen_names;
  std::set<const TensorImpl*> seen_params;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const ParamGroup& grp = groups_[g];
    const std::string where = "optimizer parameter group " + std::to_string(g);
    if (!grp.names.empty() && grp.names.size() != grp.params.size())
      throw std::invalid_argument(where + ": " + std::to_string(grp.names.size()) + " names for " +
                                  std::to_string(grp.params.size()) + " parameters");
    if (!(grp.lr >= 0.0)) throw std::invalid_argument(where + ": lr must be >= 0");
    if (!(grp.weight_decay >= 0.0)) throw std::invalid_argument(where + ": weight_decay must be >= 0");
    names_.emplace_back();
    for (size_t i = 0; i < grp.params.size(); ++i) {
      std::string name;
      if (grp.names.empty()) {
        // built by append: GCC 12 warns (-Wrestrict, falsely) on "g" + to_string(g)
        name.append("g").append(std::to_string(g)).append(".p").append(std::to_string(i));
      } else {
        name = grp.names[i];
      }
      const Tensor& p = grp.params[i];
      if (!p.defined()) throw std::invalid_argument(where + ": parameter '" + name + "' is undefined");
      if (!is_floating(p.dtype()))
        throw std::invalid_argument(where + ": parameter '" + name + "' has dtype " +
                                    std::string(dtype_name(p.dtype())) + ", expected floating");
      if (!seen_params.insert(p.impl().get()).second)
        throw std::invalid_argument(where + ": parameter '" + name + "' appears twice");
      if (!seen_names.insert(name).second)
        throw std::invalid_argument(where + ": parameter name '" + name + "' is used twice");
      names_.back().push_back(std::move(name));
    }
    state_.emplace_back(grp.params.size());
  }
}

void Optimizer::zero_grad() {
  for (auto& grp : groups_)
    for (auto& p : grp.params) p.zero_grad();
}

double Optimizer::current_lr(size_t g) const {
  const ParamGroup& grp = groups_.at(g);
  return grp.schedule ? grp.lr * grp.schedule->factor(schedule_step_ >= 0 ? schedule_step_ : step_) : grp.lr;
}

std::vector<Tensor> Optimizer::parameters() const {
  std::vector<Tensor> out;
  for (const auto& grp : groups_) out.insert(out.end(), grp.params.begin(), grp.params.end());
  return out;
}

void Optimizer::save_state(const std::string& path) const {
  using json = nlohmann::json;
  std::vector<std::pair<std::string, Tensor>> tensors;
  json groups = json::array();
  for (size_t g = 0; g < groups_.size(); ++g) {
    json params = json::array();
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      const ParamState& st = state_[g][i];
      params.push_back({{"name", names_[g][i]}, {"step", st.step}});
      for (const auto& [key, t] : st.tensors) tensors.emplace_back(names_[g][i] + "." + key, t);
    }
    groups.push_back({{"lr", groups_[g].lr},
                      {"weight_decay", groups_[g].weight_decay},
                      {"params", std::move(params)}});
  }
  json state = {{"step", step_}, {"hyper", hyper()}, {"groups", std::move(groups)}};
  save_safetensors(path, tensors,
                   {{"format", kStateFormat}, {"optimizer", kind()}, {"state", state.dump()}});
}

void Optimizer::load_state(const std::string& path) {
  using json = nlohmann::json;
  SafetensorsFile file(path);
  auto fail = [&](const std::string& what) {
    throw std::runtime_error("optimizer state '" + path + "': " + what);
  };
  const auto& md = file.metadata();
  auto get = [&](const char* key) -> const std::string& {
    auto it = md.find(key);
    if (it == md.end()) fail(std::string("metadata has no \"") + key + "\" (not an optimizer state file?)");
    return it->second;
  };
  if (get("format") != kStateFormat)
    fail("format is '" + get("format") + "', expected '" + kStateFormat + "'");
  if (get("optimizer") != kind())
    fail("was saved by " + get("optimizer") + ", cannot load into " + kind());

  json state;
  int64_t step = 0;
  std::map<std::string, double> hyp;
  std::vector<std::pair<double, double>> lr_wd;
  try {
    state = json::parse(get("state"));
    step = state.at("step").get<int64_t>();
    hyp = state.at("hyper").get<std::map<std::string, double>>();
    const json& gs = state.at("groups");
    if (gs.size() != groups_.size())
      fail("has " + std::to_string(gs.size()) + " parameter groups, this optimizer has " +
           std::to_string(groups_.size()));
    for (const json& gj : gs) {
      lr_wd.emplace_back(gj.at("lr").get<double>(), gj.at("weight_decay").get<double>());
      if (!gj.at("params").is_array()) fail("malformed \"state\" metadata: group params is not an array");
    }
  } catch (const json::exception& e) {
    fail(std::string("malformed \"state\" metadata: ") + e.what());
  }

  for (const auto& kv : hyper())
    if (!hyp.count(kv.first)) fail("hyper-parameter \"" + kv.first + "\" is missing");

  std::vector<std::vector<ParamState>> next(groups_.size());
  size_t used = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const json& pj = state["groups"][g]["params"];
    if (pj.size() != groups_[g].params.size())
      fail("group " + std::to_string(g) + " has " + std::to_string(pj.size()) +
           " parameters in the file, " + std::to_string(groups_[g].params.size()) + " here");
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      const Tensor& p = groups_[g].params[i];
      const std::string& name = names_[g][i];
      ParamState st;
      try {
        if (pj[i].at("name").get<std::string>() != name)
          fail("group " + std::to_string(g) + " parameter " + std::to_string(i) + " is '" +
               pj[i].at("name").get<std::string>() + "' in the file, '" + name + "' here");
        st.step = pj[i].at("step").get<int64_t>();
      } catch (const json::exception& e) {
        fail(std::string("malformed \"state\" metadata: ") + e.what());
      }
      if (st.step > 0) {
        for (const auto& [key, dtype] : state_keys(p)) {
          const std::string tname = name + "." + key;
          if (!file.contains(tname)) fail("missing state tensor '" + tname + "'");
          const SafetensorsEntry& e = file.entry(tname);
          if (e.shape != p.shape())
            fail("state tensor '" + tname + "' has shape " + shape_str(e.shape) +
                 ", parameter '" + name + "' has " + shape_str(p.shape()));
          if (e.dtype != dtype)
            fail("state tensor '" + tname + "' has dtype " + std::string(dtype_name(e.dtype)) +
                 ", expected " + std::string(dtype_name(dtype)));
          st.tensors[key] = file.load_copy(tname).to(p.device());
          ++used;
        }
      }
      next[g].push_back(std::move(st));
    }
  }
  if (used != file.names().size())
    fail("holds " + std::to_string(file.names().size()) + " state tensors, " +
         std::to_string(used) + " match this optimizer's parameters");

  set_hyper(hyp);
  for (size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].lr = lr_wd[g].first;
    groups_[g].weight_decay = lr_wd[g].second;
  }
  state_ = std::move(next);
  step_ = step;
}

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  NoGradGuard no_grad;
  // One f32 sum of squares per gradient (one pass, no f32 copy of a 16-bit
  // gradient), stacked per device so that a GPU needs one host round trip
  // rather than one per parameter.
  std::vector<std::pair<Device, std::vector<Tensor>>> parts;
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined() || g.numel() == 0) continue;
    grads.push_back(g);
    Tensor s = sum_squares(g).to(DType::f32);  // f64 gradients too: one stack
    size_t k = 0;
    while (k < parts.size() && parts[k].first != g.device()) ++k;
    if (k == parts.size()) parts.push_back({g.device(), {}});
    parts[k].second.push_back(s);
  }
  double total_sq = 0.0;
  for (auto& [dev, sums] : parts) {
    for (double x : stack(sums).to_vector<float>()) total_sq += x;
  }
  const double total = std::sqrt(total_sq);
  const double coef = max_norm / (total + 1e-6);
  // In place, the bits of mul(g, coef).
  if (coef < 1.0)
    for (Tensor& g : grads) backend(g.device()).unary(UnaryOp::affine, g, g, coef, 0.0);
  return total;
}

}  // namespace areno
