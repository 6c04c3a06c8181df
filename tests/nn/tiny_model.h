#pragma once
// The small model of tests/reference/core/make_nn_golden.py ("tiny"): an
// embedding, two residual blocks (RMSNorm -> Linear -> SiLU) in a ModuleList,
// a LayerNorm and an untied head. Its dotted names equal torch's state_dict.
#include <memory>

#include "nn/layers.h"
#include "nn/module.h"

namespace areno::testing {

struct TinyBlock : Module {
  std::shared_ptr<RMSNorm> norm;
  std::shared_ptr<Linear> proj;
  TinyBlock(int64_t d, Generator& gen, TensorOptions to) : Module("TinyBlock") {
    norm = register_module("norm", std::make_shared<RMSNorm>(RMSNormOptions(d).eps(1e-6).tensor_options(to)));
    proj = register_module("proj", std::make_shared<Linear>(LinearOptions(d, d).tensor_options(to), gen));
  }
  // x: [B, T, C]
  Tensor forward(const Tensor& x) const { return add(x, silu(proj->forward(norm->forward(x)))); }
};

struct TinyModel : Module {
  static constexpr int64_t vocab = 11, dim = 6;
  std::shared_ptr<Embedding> embed;
  std::shared_ptr<ModuleList> layers;
  std::shared_ptr<LayerNorm> final_norm;
  std::shared_ptr<Linear> head;
  explicit TinyModel(Generator& gen, TensorOptions to = {}) : Module("TinyModel") {
    embed = register_module("embed", std::make_shared<Embedding>(EmbeddingOptions(vocab, dim).tensor_options(to), gen));
    layers = register_module("layers", std::make_shared<ModuleList>());
    for (int i = 0; i < 2; ++i) layers->push_back(std::make_shared<TinyBlock>(dim, gen, to));
    final_norm = register_module("final_norm", std::make_shared<LayerNorm>(LayerNormOptions(dim).tensor_options(to)));
    head = register_module("head", std::make_shared<Linear>(LinearOptions(dim, vocab).bias(false).tensor_options(to), gen));
  }
  // ids: [B, T] -> logits [B, T, vocab]
  Tensor forward(const Tensor& ids) const {
    Tensor h = embed->forward(ids);
    for (size_t i = 0; i < layers->size(); ++i) h = layers->at<TinyBlock>(i)->forward(h);
    return head->forward(final_norm->forward(h));
  }
};

}  // namespace areno::testing
