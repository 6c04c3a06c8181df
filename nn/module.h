#pragma once
// Module: a tree of named parameters, buffers and child modules, as in the
// libtorch C++ frontend. Names are dotted paths ("layers.0.mlp.weight") built
// from registration names, so a module tree whose names follow a checkpoint's
// tensor names loads by a plain name walk (load_state_dict).
//
// Parameter identity: a registered parameter is a Tensor handle; layer fields
// (e.g. Linear::weight) hold copies of the same handle. Module::to() converts
// each parameter and then writes the converted storage/geometry/dtype/device
// back into the parameter's existing TensorImpl (as torch's `param.data = ...`),
// so every handle — module fields, optimizer parameter lists taken before the
// move — keeps pointing at the live parameter. Views taken from a parameter
// before to() keep the old storage, as in PyTorch.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace areno {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
using StateDict = std::map<std::string, Tensor>;

class Module {
 public:
  explicit Module(std::string type_name = "Module") : type_name_(std::move(type_name)) {}
  virtual ~Module() = default;
  // Modules are shared through std::shared_ptr; copying one would silently
  // share its parameters, so it is not allowed.
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  const std::string& type_name() const { return type_name_; }

  // ---- registration (names: non-empty, no '.', unique within this module) ----
  // Returns the stored handle; `requires_grad` is set on it.
  Tensor register_parameter(const std::string& name, Tensor value, bool requires_grad = true);
  // Buffers are state that is not trained (running stats, rotary tables).
  // Non-persistent buffers are left out of state_dict().
  Tensor register_buffer(const std::string& name, Tensor value, bool persistent = true);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }

  // ---- lookup, in registration order, depth first ----
  NamedTensors named_parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  // This module first (name ""), then every descendant by dotted name.
  std::vector<std::pair<std::string, Module*>> named_modules();
  std::vector<std::pair<std::string, const Module*>> named_modules() const;
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& named_children() const {
    return children_;
  }
  std::vector<Tensor> parameters(bool recurse = true) const;
  // The parameter or buffer with this dotted name; throws naming it when absent.
  Tensor get(const std::string& dotted_name) const;
  int64_t num_parameters(bool only_trainable = false) const;

  // ---- mode ----
  void train(bool on = true);  // recursive
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Sets requires_grad on every parameter whose name is `prefix` or starts
  // with `prefix + "."` ("" = all). "layers.1" therefore does not touch
  // "layers.10". Returns how many parameters matched; throws when none did,
  // because a prefix that matches nothing is almost always a typo.
  int64_t freeze(const std::string& prefix = "");
  int64_t unfreeze(const std::string& prefix = "");

  // ---- conversion, in place (see the comment at the top) ----
  void to(Device device);
  // Floating parameters and buffers only; integer/bool buffers keep their dtype.
  void to(DType dtype);
  void to(Device device, DType dtype);

  // ---- checkpoints ----
  // Parameters and persistent buffers by dotted name. The tensors are the
  // live handles (no copy). A tied tensor (one handle registered in two
  // modules) appears under both names, as in torch; named_parameters() and
  // parameters() list it once.
  StateDict state_dict() const;
  // Copies each entry into the existing tensor (casting dtype and moving
  // device as needed). Throws std::runtime_error listing every missing,
  // unexpected and wrong-shape name. strict = false ignores missing and
  // unexpected names; a shape mismatch is always an error. Nothing is copied
  // when an error is thrown. A tied tensor needs only one of its names.
  void load_state_dict(const StateDict& state, bool strict = true);

  void zero_grad();  // drops accumulated gradients (recursive)

 protected:
  void add_child(const std::string& name, std::shared_ptr<Module> module);

 private:
  struct Entry {
    std::string name;
    Tensor value;
    bool persistent = true;
  };
  void check_new_name(const std::string& name, const char* what) const;
  template <typename F> void visit(const std::string& prefix, F&& f) const;
  void convert(const std::function<Tensor(const Tensor&)>& fn, bool floating_only);

  std::string type_name_;
  bool training_ = true;
  std::vector<Entry> params_;
  std::vector<Entry> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

// Replaces the data of `dst` (storage, geometry, dtype, device) with that of
// `src`, keeping dst's identity and autograd flag. Used by Module::to().
void replace_tensor_data(const Tensor& dst, const Tensor& src);

}  // namespace areno
