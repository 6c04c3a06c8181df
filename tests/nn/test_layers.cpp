// Layers against torch.nn (tests/data/core/nn_golden.json from
// tests/reference/core/make_nn_golden.py): outputs, parameter and input
// gradients, on every device; initialisation statistics; option errors;
// scaled-dot-product attention with GQA, causal masking, bias and key padding.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/layers.h"
#include "nn/module.h"
#include "tensor/autograd.h"
#include "tests/core/golden.h"
#include "tests/core/op_harness.h"
#include "tests/nn/tiny_model.h"
#include "tests/test_util.h"

using namespace areno;
using namespace areno::testing;

namespace {

const char* kGolden = "tests/data/core/nn_golden.json";

using Make = std::function<std::shared_ptr<Module>(Generator&)>;
using Forward = std::function<Tensor(Module&, const Tensor&)>;

template <typename L>
Forward fwd() {
  return [](Module& m, const Tensor& x) { return dynamic_cast<L&>(m).forward(x); };
}

struct LayerCase {
  std::string name;
  Make make;
  Forward forward;
};

std::vector<LayerCase> layer_table() {
  const TensorOptions f64(DType::f64);
  return {
      {"linear", [=](Generator& g) { return std::make_shared<Linear>(LinearOptions(5, 3).tensor_options(f64), g); }, fwd<Linear>()},
      {"linear_nobias", [=](Generator& g) { return std::make_shared<Linear>(LinearOptions(5, 3).bias(false).tensor_options(f64), g); }, fwd<Linear>()},
      {"embedding", [=](Generator& g) { return std::make_shared<Embedding>(EmbeddingOptions(10, 4).tensor_options(f64), g); }, fwd<Embedding>()},
      {"rmsnorm", [=](Generator&) { return std::make_shared<RMSNorm>(RMSNormOptions(6).eps(1e-6).tensor_options(f64)); }, fwd<RMSNorm>()},
      {"layernorm", [=](Generator&) { return std::make_shared<LayerNorm>(LayerNormOptions(6).eps(1e-5).tensor_options(f64)); }, fwd<LayerNorm>()},
      {"conv1d", [=](Generator& g) { return std::make_shared<Conv1d>(Conv1dOptions(4, 6, 3).stride(2).padding(1).groups(2).tensor_options(f64), g); }, fwd<Conv1d>()},
      {"conv2d", [=](Generator& g) {
         return std::make_shared<Conv2d>(Conv2dOptions(3, 6, IntPair{3, 2}).stride(IntPair{2, 1}).padding(IntPair{1, 0})
                                             .dilation(IntPair{1, 2}).groups(3).tensor_options(f64), g);
       }, fwd<Conv2d>()},
      {"conv2d_depthwise", [=](Generator& g) {
         return std::make_shared<Conv2d>(Conv2dOptions(4, 4, 3).padding(1).groups(4).bias(false).tensor_options(f64), g);
       }, fwd<Conv2d>()},
      {"gelu", [](Generator&) { return std::make_shared<GELU>(); }, fwd<GELU>()},
      {"gelu_tanh", [](Generator&) { return std::make_shared<GELU>("tanh"); }, fwd<GELU>()},
      {"silu", [](Generator&) { return std::make_shared<SiLU>(); }, fwd<SiLU>()},
      {"glu", [](Generator&) { return std::make_shared<GLU>(-1); }, fwd<GLU>()},
      {"tiny", [=](Generator& g) { return std::make_shared<TinyModel>(g, f64); }, fwd<TinyModel>()},
  };
}

// The golden parameters of a case, by their state_dict names.
StateDict golden_state(const Golden& gold, const std::string& name) {
  StateDict sd;
  const std::string prefix = name + ".";
  for (const auto& key : gold.names(prefix)) {
    std::string rest = key.substr(prefix.size());
    if (rest == "x" || rest == "y" || rest == "w" || rest.rfind("grad.", 0) == 0) continue;
    sd[rest] = gold.tensor(key);
  }
  return sd;
}

std::vector<DType> dtypes_for(Device d) {
  if (d.is_cpu()) return {DType::f64, DType::f32};
  return {DType::f32};
}

double tol_for(DType dt) { return dt == DType::f64 ? 1e-10 : 2e-5; }

}  // namespace

DEVICE_TEST_CASE("nn/layers match torch.nn outputs and gradients") {
  Golden gold(kGolden);
  for (const auto& c : layer_table()) {
    for (DType dt : dtypes_for(device)) {
      const std::string label = c.name + " " + std::string(dtype_name(dt)) + " on " + device.str();
      CAPTURE(label);
      try {
        Generator gen(0);
        auto m = c.make(gen);
        // Loading is strict, so every torch name must exist here and vice versa.
        m->load_state_dict(golden_state(gold, c.name));
        m->to(device);
        m->to(dt);
        Tensor x = gold.tensor(c.name + ".x");
        bool float_in = is_floating(x.dtype());
        x = x.to(device, float_in ? dt : x.dtype());
        if (float_in) x.set_requires_grad(true);
        Tensor y = c.forward(*m, x);
        CHECK(y.dtype() == dt);
        Mismatch my = compare(y, gold.tensor(c.name + ".y"), tol_for(dt));
        CHECK_MESSAGE(my.ok, label << " output: " << my.message);
        sum(mul(y, gold.tensor(c.name + ".w").to(device, dt))).backward();
        for (auto& [pname, p] : m->named_parameters()) {
          if (!p.grad().defined()) {
            FAIL_CHECK(label << ": no gradient for " << pname);
            continue;
          }
          Mismatch mg = compare(p.grad(), gold.tensor(c.name + ".grad." + pname), tol_for(dt) * 10);
          CHECK_MESSAGE(mg.ok, label << " gradient of " << pname << ": " << mg.message);
        }
        if (float_in) {
          Mismatch mx = compare(x.grad(), gold.tensor(c.name + ".grad.x"), tol_for(dt) * 10);
          CHECK_MESSAGE(mx.ok, label << " input gradient: " << mx.message);
        }
      } catch (const std::exception& e) {
        FAIL_CHECK(label << " threw: " << std::string(e.what()));
      }
    }
  }
}

DEVICE_TEST_CASE("nn/scaled_dot_product_attention matches torch with GQA, causal, bias and key padding") {
  Golden gold(kGolden);
  struct SdpaCase {
    const char* name;
    bool causal;
    double scale;
  };
  const SdpaCase cases[] = {{"sdpa_plain", false, 0.0},         {"sdpa_causal", true, 0.0},
                            {"sdpa_causal_kv_cache", true, 0.0}, {"sdpa_gqa", false, 0.0},
                            {"sdpa_bias", false, 0.3},           {"sdpa_key_padding", false, 0.0},
                            {"sdpa_all", true, 0.0}};
  for (const auto& c : cases) {
    for (DType dt : dtypes_for(device)) {
      const std::string name = c.name;
      const std::string label = name + " " + std::string(dtype_name(dt)) + " on " + device.str();
      CAPTURE(label);
      try {
        ScaledDotProductAttention attn(ScaledDotProductAttentionOptions().causal(c.causal).scale(c.scale));
        auto load = [&](const std::string& t) {
          return gold.tensor(name + "." + t).to(device, dt).set_requires_grad(true);
        };
        Tensor q = load("q"), k = load("k"), v = load("v");
        Tensor bias = gold.has(name + ".bias") ? gold.tensor(name + ".bias").to(device, dt) : Tensor();
        Tensor kpm = gold.has(name + ".key_padding_mask")
                         ? gold.tensor(name + ".key_padding_mask").to(device, DType::boolean)
                         : Tensor();
        Tensor y = attn.forward(q, k, v, bias, kpm);
        Mismatch my = compare(y, gold.tensor(name + ".y"), tol_for(dt));
        CHECK_MESSAGE(my.ok, label << " output: " << my.message);
        sum(mul(y, gold.tensor(name + ".w").to(device, dt))).backward();
        for (auto [t, tn] : {std::pair{q, "q"}, std::pair{k, "k"}, std::pair{v, "v"}}) {
          REQUIRE(t.grad().defined());
          Mismatch mg = compare(t.grad(), gold.tensor(name + ".grad." + tn), tol_for(dt) * 10);
          CHECK_MESSAGE(mg.ok, label << " gradient of " << std::string(tn) << ": " << mg.message);
        }
      } catch (const std::exception& e) {
        FAIL_CHECK(label << " threw: " << std::string(e.what()));
      }
    }
  }
}

TEST_CASE("nn/Linear and Conv init is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), seeded") {
  Generator g1(42), g2(42), g3(43);
  Linear a(LinearOptions(256, 512), g1), b(LinearOptions(256, 512), g2), c(LinearOptions(256, 512), g3);
  CHECK(max_abs_diff(a.weight, b.weight) == 0.0);
  CHECK(max_abs_diff(a.bias, b.bias) == 0.0);
  CHECK(max_abs_diff(a.weight, c.weight) > 0.01);
  auto w = a.weight.to_vector<double>();
  double bound = 1.0 / 16.0, s = 0, ss = 0, mx = 0;
  for (double x : w) s += x, ss += x * x, mx = std::max(mx, std::abs(x));
  double mean = s / double(w.size()), var = ss / double(w.size()) - mean * mean;
  CHECK(mx <= bound);
  CHECK(mx > 0.99 * bound);
  CHECK(std::abs(mean) < 1e-3);
  CHECK(var == doctest::Approx(bound * bound / 3).epsilon(0.02));
  for (double x : a.bias.to_vector<double>()) CHECK(std::abs(x) <= bound);
  CHECK(a.weight.shape() == Shape{512, 256});
  CHECK(a.weight.requires_grad());

  // Conv2d with groups: fan_in = in/groups * kh * kw = 4 * 9.
  Conv2d conv(Conv2dOptions(8, 16, 3).groups(2), g1);
  CHECK(conv.weight.shape() == Shape{16, 4, 3, 3});
  double cmax = 0;
  for (double x : conv.weight.to_vector<double>()) cmax = std::max(cmax, std::abs(x));
  CHECK(cmax <= 1.0 / 6.0);
  CHECK(cmax > 0.9 / 6.0);
  Conv1d conv1(Conv1dOptions(3, 5, 4).bias(false), g1);
  CHECK(conv1.weight.shape() == Shape{5, 3, 4});
  CHECK(conv1.named_parameters().size() == 1);

  Embedding e(EmbeddingOptions(1000, 64), g1);
  auto ev = e.weight.to_vector<double>();
  s = ss = 0;
  for (double x : ev) s += x, ss += x * x;
  mean = s / double(ev.size());
  CHECK(std::abs(mean) < 0.02);
  CHECK(std::sqrt(ss / double(ev.size()) - mean * mean) == doctest::Approx(1.0).epsilon(0.02));
}

TEST_CASE("nn/norm layers start at identity; LayerNorm without affine has no parameters") {
  RMSNorm r(RMSNormOptions(5));
  CHECK(max_abs_diff(r.weight, ones({5})) == 0.0);
  LayerNorm ln(LayerNormOptions(5));
  CHECK(max_abs_diff(ln.weight, ones({5})) == 0.0);
  CHECK(max_abs_diff(ln.bias, zeros({5})) == 0.0);
  LayerNorm plain(LayerNormOptions(7).elementwise_affine(false));
  CHECK(plain.named_parameters().empty());
  Generator g(1);
  Tensor x = rand_normal({3, 7}, g, 2.0, 3.0, DType::f64);
  Tensor y = plain.forward(x);
  auto m = mean(y, {-1}).to_vector<double>();
  auto v = var(y, {-1}, 0).to_vector<double>();
  for (int i = 0; i < 3; ++i) {
    CHECK(std::abs(m[size_t(i)]) < 1e-12);
    CHECK(v[size_t(i)] == doctest::Approx(1.0).epsilon(1e-4));  // eps 1e-5 against var 9
  }
  LayerNorm no_bias(LayerNormOptions(4).bias(false));
  CHECK(no_bias.named_parameters().size() == 1);
}

TEST_CASE("nn/dropout zeroes about p of the values and scales the rest by 1/(1-p)") {
  Dropout d(DropoutOptions(0.25).seed(11));
  Tensor x = ones({100000});
  auto y = d.forward(x).to_vector<double>();
  int64_t zeros_n = 0, badly_scaled = 0;
  for (double v : y) {
    if (v == 0.0) ++zeros_n;
    else if (std::abs(v - 1.0 / 0.75) > 1e-6) ++badly_scaled;
  }
  CHECK(badly_scaled == 0);
  CHECK(double(zeros_n) / 1e5 == doctest::Approx(0.25).epsilon(0.03));
  // The module's generator advances: the next mask differs.
  auto y2 = d.forward(x).to_vector<double>();
  CHECK(y != y2);
  // A caller's generator with the same seed reproduces the first mask.
  Generator g(11);
  CHECK(d.forward(x, g).to_vector<double>() == y);
  // Gradient flows through the kept positions only, with the same scale.
  Tensor xr = ones({1000}).set_requires_grad(true);
  Generator g2(5);
  Tensor yr = d.forward(xr, g2);
  sum(yr).backward();
  CHECK(max_abs_diff(xr.grad(), yr.detach()) == 0.0);
}

TEST_CASE("nn/layer options are validated with actionable messages") {
  Generator g(0);
  CHECK_THROWS_AS(Conv2d(Conv2dOptions(6, 4, 3).groups(4), g), std::invalid_argument);
  CHECK_THROWS_AS(Conv1d(Conv1dOptions(4, 4, 0), g), std::invalid_argument);
  CHECK_THROWS_AS(Linear(LinearOptions(0, 3), g), std::invalid_argument);
  CHECK_THROWS_AS(GELU("fast"), std::invalid_argument);
  CHECK_THROWS_AS(Dropout(DropoutOptions(1.5)), std::invalid_argument);
  GLU glu;
  CHECK_THROWS_AS(glu.forward(ones({2, 5})), std::invalid_argument);
  try {
    Conv2d(Conv2dOptions(6, 4, 3).groups(4), g);
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("groups") != std::string::npos);
  }
}

TEST_CASE("nn/GLU halves the chosen dim: a * sigmoid(b)") {
  GLU glu(0);
  Tensor x = from_vector<double>({1, 2, 3, -1, 0, 4}, {2, 3});
  auto y = glu.forward(x).to_vector<double>();
  const double a[] = {1, 2, 3}, b[] = {-1, 0, 4};
  REQUIRE(y.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(y[size_t(i)] == doctest::Approx(a[i] / (1 + std::exp(-b[i]))));
}
