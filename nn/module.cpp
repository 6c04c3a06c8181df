#include "nn/module.h"

#include <set>
#include <stdexcept>

#include "tensor/autograd.h"

namespace areno {

void replace_tensor_data(const Tensor& dst, const Tensor& src) {
  TensorImpl& d = *dst.impl();
  const TensorImpl& s = *src.impl();
  d.storage = s.storage;
  d.offset = s.offset;
  d.shape = s.shape;
  d.strides = s.strides;
  d.dtype = s.dtype;
  d.device = s.device;
}

void Module::check_new_name(const std::string& name, const char* what) const {
  if (name.empty() || name.find('.') != std::string::npos)
    throw std::invalid_argument(type_name_ + ": " + what + " name '" + name +
                                "' must be non-empty and contain no '.'");
  auto taken = [&](const auto& list) {
    for (const auto& e : list)
      if (e.name == name) return true;
    return false;
  };
  bool dup = taken(params_) || taken(buffers_);
  for (const auto& c : children_) dup = dup || c.first == name;
  if (dup)
    throw std::invalid_argument(type_name_ + ": cannot register " + what + " '" + name +
                                "': the name is already used in this module");
}

Tensor Module::register_parameter(const std::string& name, Tensor value, bool requires_grad) {
  check_new_name(name, "parameter");
  if (!value.defined())
    throw std::invalid_argument(type_name_ + ": parameter '" + name + "' is an undefined tensor");
  if (requires_grad && !is_floating(value.dtype()))
    throw std::invalid_argument(type_name_ + ": parameter '" + name + "' has dtype " +
                                std::string(dtype_name(value.dtype())) +
                                "; only floating tensors can require grad");
  // A parameter is a leaf: strip any history the initialiser may have built.
  if (!value.is_leaf()) value = value.detach();
  value.set_requires_grad(requires_grad);
  params_.push_back({name, value, true});
  return value;
}

Tensor Module::register_buffer(const std::string& name, Tensor value, bool persistent) {
  check_new_name(name, "buffer");
  if (!value.defined())
    throw std::invalid_argument(type_name_ + ": buffer '" + name + "' is an undefined tensor");
  buffers_.push_back({name, value, persistent});
  return value;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> module) {
  check_new_name(name, "module");
  if (!module) throw std::invalid_argument(type_name_ + ": child module '" + name + "' is null");
  children_.emplace_back(name, std::move(module));
}

template <typename F>
void Module::visit(const std::string& prefix, F&& f) const {
  f(prefix, *this);
  for (const auto& [name, child] : children_)
    child->visit(prefix.empty() ? name : prefix + "." + name, f);
}

static std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  std::set<const TensorImpl*> seen;  // a shared module contributes its parameters once
  auto add = [&](const std::string& prefix, const Module& m) {
    for (const auto& e : m.params_)
      if (seen.insert(e.value.impl().get()).second) out.emplace_back(join(prefix, e.name), e.value);
  };
  if (recurse)
    visit("", add);
  else
    add("", *this);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  std::set<const TensorImpl*> seen;
  auto add = [&](const std::string& prefix, const Module& m) {
    for (const auto& e : m.buffers_)
      if (seen.insert(e.value.impl().get()).second) out.emplace_back(join(prefix, e.name), e.value);
  };
  if (recurse)
    visit("", add);
  else
    add("", *this);
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out;
  visit("", [&](const std::string& name, const Module& m) {
    out.emplace_back(name, const_cast<Module*>(&m));  // visit is const; we own the tree here
  });
  return out;
}

std::vector<std::pair<std::string, const Module*>> Module::named_modules() const {
  std::vector<std::pair<std::string, const Module*>> out;
  visit("", [&](const std::string& name, const Module& m) { out.emplace_back(name, &m); });
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

Tensor Module::get(const std::string& dotted_name) const {
  for (auto& [name, t] : named_parameters())
    if (name == dotted_name) return t;
  for (auto& [name, t] : named_buffers())
    if (name == dotted_name) return t;
  throw std::invalid_argument(type_name_ + " has no parameter or buffer named '" + dotted_name +
                              "'");
}

int64_t Module::num_parameters(bool only_trainable) const {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters())
    if (!only_trainable || t.requires_grad()) n += t.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

static bool matches_prefix(const std::string& name, const std::string& prefix) {
  if (prefix.empty() || name == prefix) return true;
  return name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
         name[prefix.size()] == '.';
}

static int64_t set_requires_grad_by_prefix(const Module& m, const std::string& prefix, bool on,
                                           const char* verb) {
  int64_t n = 0;
  for (auto& [name, t] : m.named_parameters()) {
    if (!matches_prefix(name, prefix)) continue;
    Tensor p = t;
    p.set_requires_grad(on);
    if (!on) p.zero_grad();
    ++n;
  }
  if (n == 0)
    throw std::invalid_argument(std::string(verb) + ": no parameter of " + m.type_name() +
                                " is named '" + prefix + "' or starts with '" + prefix + ".'");
  return n;
}

int64_t Module::freeze(const std::string& prefix) {
  return set_requires_grad_by_prefix(*this, prefix, false, "freeze");
}
int64_t Module::unfreeze(const std::string& prefix) {
  return set_requires_grad_by_prefix(*this, prefix, true, "unfreeze");
}

void Module::convert(const std::function<Tensor(const Tensor&)>& fn, bool floating_only) {
  NoGradGuard no_grad;
  auto apply = [&](const Tensor& t) {
    if (floating_only && !is_floating(t.dtype())) return;
    Tensor c = fn(t);
    if (!c.same(t)) replace_tensor_data(t, c);
    Tensor g = t.grad();
    if (g.defined()) {
      Tensor gc = fn(g);
      Tensor(t).set_grad(gc.same(g) ? g : gc);
    }
  };
  for (auto& [name, t] : named_parameters()) apply(t);
  for (auto& [name, t] : named_buffers()) apply(t);
}

void Module::to(Device device) {
  convert([&](const Tensor& t) { return t.to(device); }, false);
}

void Module::to(DType dtype) {
  if (!is_floating(dtype))
    throw std::invalid_argument(type_name_ + ".to(" + std::string(dtype_name(dtype)) +
                                "): modules convert only to floating dtypes");
  convert([&](const Tensor& t) { return t.to(dtype); }, true);
}

void Module::to(Device device, DType dtype) {
  to(device);
  to(dtype);
}

StateDict Module::state_dict() const {
  // Unlike named_parameters(), a tied tensor appears under each of its names,
  // as in torch: a checkpoint may store either name.
  StateDict out;
  visit("", [&](const std::string& prefix, const Module& m) {
    for (const auto& e : m.params_) out[join(prefix, e.name)] = e.value;
    for (const auto& e : m.buffers_)
      if (e.persistent) out[join(prefix, e.name)] = e.value;
  });
  return out;
}

void Module::load_state_dict(const StateDict& state, bool strict) {
  StateDict own = state_dict();
  // A tied tensor is loaded when any of its names is present (checkpoints
  // usually store one name of a tied pair).
  std::set<const TensorImpl*> provided;
  for (const auto& [name, t] : own)
    if (state.count(name)) provided.insert(t.impl().get());
  std::vector<std::string> missing, unexpected, wrong_shape;
  for (const auto& [name, t] : own) {
    auto it = state.find(name);
    if (it == state.end()) {
      if (!provided.count(t.impl().get())) missing.push_back(name);
    } else if (!it->second.defined() || it->second.shape() != t.shape()) {
      wrong_shape.push_back(name + " (expected " + shape_str(t.shape()) + ", got " +
                            (it->second.defined() ? shape_str(it->second.shape()) : "undefined") +
                            ")");
    }
  }
  for (const auto& [name, t] : state)
    if (!own.count(name)) unexpected.push_back(name);

  std::string err;
  auto list = [&](const char* what, const std::vector<std::string>& names) {
    if (names.empty()) return;
    err += std::string(err.empty() ? "" : "; ") + what + ": ";
    for (size_t i = 0; i < names.size(); ++i) err += (i ? ", " : "") + names[i];
  };
  if (strict) list("missing", missing);
  if (strict) list("unexpected", unexpected);
  list("wrong shape", wrong_shape);
  if (!err.empty())
    throw std::runtime_error(type_name_ + ".load_state_dict: " + err);

  NoGradGuard no_grad;
  for (auto& [name, t] : own) {
    auto it = state.find(name);
    if (it == state.end()) continue;
    Tensor dst = t;
    dst.copy_(it->second);
  }
}

void Module::zero_grad() {
  for (auto& [name, t] : named_parameters()) {
    Tensor p = t;
    p.zero_grad();
  }
}

}  // namespace areno
