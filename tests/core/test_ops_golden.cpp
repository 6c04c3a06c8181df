// Ops and their input gradients against PyTorch (f64), from
// tests/data/core/ops_golden.json written by tests/reference/core/make_ops_golden.py.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tests/core/golden.h"
#include "tests/core/op_harness.h"

using namespace areno;
using namespace areno::testing;

namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;
#define F(expr) [](const std::vector<Tensor>& x) -> Tensor { return expr; }

struct GoldenCase {
  std::string name;
  int n_inputs;
  Fn fn;
};

std::vector<GoldenCase> golden_table() {
  return {
      {"gelu", 1, F(gelu(x[0]))},
      {"gelu_tanh", 1, F(gelu_tanh(x[0]))},
      {"silu", 1, F(silu(x[0]))},
      {"sigmoid", 1, F(sigmoid(x[0]))},
      {"pow", 2, F(pow(x[0], x[1]))},
      {"softmax", 1, F(softmax(x[0], 1))},
      {"log_softmax", 1, F(log_softmax(x[0], -1))},
      {"var", 1, F(var(x[0], {0, 2}, 1))},
      {"cumsum", 1, F(cumsum(x[0], 0))},
      {"matmul_broadcast", 2, F(matmul(x[0], x[1]))},
      {"layer_norm", 3, F(layer_norm(x[0], x[1], x[2], 1e-5))},
      {"rms_norm", 2, F(rms_norm(x[0], x[1], 1e-6))},
      {"conv1d", 3, F(conv1d(x[0], x[1], x[2], 2, 2, 2, 2))},
      {"conv2d", 3, F(conv2d(x[0], x[1], x[2], {2, 1}, {1, 2}, {1, 2}, 3))},
      {"avg_pool2d", 1, F(avg_pool2d(x[0], {3, 3}, {2, 2}, {1, 1}))},
      {"cross_entropy", 2, F(cross_entropy(x[0], x[1], 2))},
      {"cross_entropy_sum", 2, F(cross_entropy(x[0], x[1], -100, "sum"))},
      {"gather", 2, F(gather(x[0], 1, x[1]))},
      {"scatter_add", 3, F(scatter_add(x[0], 0, x[1], x[2]))},
      {"pad", 1, F(pad(x[0], {2, 1, 0, 2}, -1.5))},
      {"topk", 1, F(topk(x[0], 3, -1).first)},
      {"masked_scatter", 3, F(masked_scatter(x[0], x[1], x[2]))},
  };
}

}  // namespace

TEST_CASE("ops/golden: outputs and input gradients match PyTorch in f64") {
  Golden gold("tests/data/core/ops_golden.json");
  int64_t run = 0;
  for (const GoldenCase& c : golden_table()) {
    CAPTURE(c.name);
    try {
      std::vector<Tensor> xs;
      for (int i = 0; i < c.n_inputs; ++i) {
        Tensor x = gold.tensor(c.name + ".in" + std::to_string(i));
        if (is_floating(x.dtype())) x.set_requires_grad(true);
        xs.push_back(x);
      }
      Tensor out = c.fn(xs);
      Mismatch m = compare(out, gold.tensor(c.name + ".out"), 1e-10);
      CHECK_MESSAGE(m.ok, c.name << " output: " << m.message);
      sum(mul(out, gold.tensor(c.name + ".w"))).backward();
      for (int i = 0; i < c.n_inputs; ++i) {
        std::string gname = c.name + ".grad" + std::to_string(i);
        if (!gold.has(gname)) continue;
        if (!xs[size_t(i)].grad().defined()) {
          FAIL_CHECK(c.name << ": input " << i << " got no gradient");
          continue;
        }
        Mismatch gm = compare(xs[size_t(i)].grad(), gold.tensor(gname), 1e-9);
        CHECK_MESSAGE(gm.ok, c.name << " gradient of input " << i << ": " << gm.message);
      }
      ++run;
    } catch (const std::exception& e) {
      FAIL_CHECK(c.name << " threw: " << std::string(e.what()));
    }
  }
  CHECK(run == int64_t(golden_table().size()));
}
