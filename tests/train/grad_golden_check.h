#pragma once
// Every parameter gradient of the tiny model against a golden written by
// tests/reference/train/make_train_golden.py's gradient_tensors (the SFT
// golden, and the GRPO golden of tests/reference/rl/make_grpo_golden.py):
// `grad.<name>` per parameter, the embedding reduced to `embed_grad.rows /
// values / colsum / sqsum`, and the metadata `no_grad` (outside the graph) and
// `zero_by_math` (attention key biases, exactly 0 in f64).
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "models/phi4mm/model.h"
#include "nn/io/safetensors.h"
#include "tensor/ops.h"
#include "train/param_groups.h"

namespace areno::testing {

inline std::set<std::string> split_names(const std::string& s) {
  std::set<std::string> out;
  std::stringstream in(s);
  for (std::string n; std::getline(in, n, ',');)
    if (!n.empty()) out.insert(n);
  return out;
}

inline double max_abs(const Tensor& t) { return max(abs(t.to(DType::f64))).item(); }

struct GradCheck {
  int64_t compared = 0;  // tensors compared, the embedding included
  double worst = 0;      // worst error of a tensor other than the embedding (scale below)
  std::string worst_name;
  double embed_worst = 0;  // worst of the embedding's rows and column sums, on their own max
};

// Checks every parameter's gradient to `tol`. Each tensor is measured against
// the larger of its own and 0.1 x its group's largest gradient: torch's own f32
// gradients of the Conformer's small q/k tensors are 1.2e-5 from f64 on their
// own scale (tests/reference/train/README.md), 1e-6 on the group's. The audio
// CMVN statistics must not require grad; every other parameter must.
inline GradCheck check_golden_grads(const phi4mm::Phi4MMForCausalLM& model, const SafetensorsFile& g,
                                    double tol = 1e-5) {
  const std::set<std::string> no_grad = split_names(g.metadata().at("no_grad"));
  const std::set<std::string> zero_by_math = split_names(g.metadata().at("zero_by_math"));
  std::map<train::Group, double> group_max;
  for (auto& [name, p] : model.named_parameters())
    if (g.contains("grad." + name)) {
      double& m = group_max[train::group_of(name)];
      m = std::max(m, max_abs(g.load_copy("grad." + name)));
    }
  GradCheck r;
  for (auto& [name, p] : model.named_parameters()) {
    CAPTURE(name);
    if (name.find(".encoder_embedding.global_") != std::string::npos) {
      CHECK_FALSE(p.requires_grad());
      continue;
    }
    REQUIRE(p.requires_grad());
    const Tensor ours = p.grad();
    if (name == "model.embed_tokens.weight") {
      REQUIRE(ours.defined());
      Tensor picked = index_select(ours, 0, g.load_copy("embed_grad.rows"));
      Tensor gold = g.load_copy("embed_grad.values");
      const double rows_err = max_abs_diff(picked, gold) / max_abs(gold);
      Tensor gold_colsum = g.load_copy("embed_grad.colsum");
      const double colsum_err = max_abs_diff(sum(ours.to(DType::f64), {0}), gold_colsum) / max_abs(gold_colsum);
      CHECK(rows_err < tol);
      CHECK(colsum_err < tol);
      const double sq = sum(square(ours.to(DType::f64))).item();
      CHECK(sq == doctest::Approx(g.load_copy("embed_grad.sqsum").item()).epsilon(tol));
      r.embed_worst = std::max(rows_err, colsum_err);
      ++r.compared;
      continue;
    }
    if (no_grad.count(name)) {  // SigLIP's last layer, post_layernorm, head: outside the graph
      CHECK((!ours.defined() || max_abs(ours) == 0.0));
      continue;
    }
    REQUIRE(g.contains("grad." + name));
    REQUIRE(ours.defined());
    Tensor gold = g.load_copy("grad." + name);
    const double gm = group_max[train::group_of(name)];
    const double scale = zero_by_math.count(name) ? gm : std::max(max_abs(gold), gm * 1e-1);
    const double err = max_abs_diff(ours, gold) / scale;
    CHECK(err < tol);
    if (err > r.worst) r.worst = err, r.worst_name = name;
    ++r.compared;
  }
  return r;
}

}  // namespace areno::testing
