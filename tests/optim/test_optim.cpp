// Optimizers against PyTorch golden trajectories (tests/reference/optim/
// make_golden.py -> tests/data/optim/golden.safetensors), schedules, clipping,
// mixed precision, state save/load and an end-to-end MLP fit.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <numbers>
#include <string>
#include <vector>

#include "nn/io/safetensors.h"
#include "nn/optim/adamw.h"
#include "nn/optim/sgd.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tests/test_util.h"

using namespace areno;
using areno::testing::error_of;
namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 8;  // STEPS in make_golden.py

// The golden file; every load is a private copy (tests write into grads).
struct Golden {
  SafetensorsFile file{"tests/data/optim/golden.safetensors"};
  Tensor get(const std::string& name, Device device = Device::cpu(), DType dtype = DType::f32) const {
    return file.load_copy(name).to(device, dtype).contiguous().clone();
  }
  std::vector<double> values(const std::string& name) const {
    return file.load(name).to_vector<double>();
  }
};

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("areno_test_optim_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// Elementwise |got - want| <= rtol * max(|want|, floor); reports the worst element.
void check_close(const Tensor& got, const Tensor& want, double rtol, double floor = 1e-3) {
  std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  REQUIRE(g.size() == w.size());
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    double r = std::abs(g[i] - w[i]) / std::max(std::abs(w[i]), floor);
    if (!(r <= worst)) {
      worst = r;
      at = i;
    }
  }
  CHECK_MESSAGE(worst <= rtol, "element " << at << ": got " << g[at] << ", want " << w[at]
                                          << " (relative error " << worst << ")");
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor c = t.to(Device::cpu()).contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return std::vector<uint8_t>(p, p + c.nbytes());
}

Tensor leaf(const Tensor& t) {
  Tensor x = t.detach().clone();
  x.set_requires_grad(true);
  return x;
}

}  // namespace

DEVICE_TEST_CASE("optim/adamw matches torch with groups, schedule and clipping") {
  Golden gold;
  Tensor w = leaf(gold.get("init.w", device));
  Tensor b = leaf(gold.get("init.b", device));
  // the configuration of make_golden.py
  std::vector<ParamGroup> groups(2);
  groups[0].params = {w};
  groups[0].names = {"w"};
  groups[0].lr = 1e-2;
  groups[0].weight_decay = 0.1;
  groups[0].schedule = std::make_shared<WarmupCosineSchedule>(2, 8, 0.1);
  groups[1].params = {b};
  groups[1].names = {"b"};
  groups[1].lr = 5e-3;
  AdamW opt(groups, AdamWOptions{0.9, 0.95, 1e-8});
  const std::vector<double> lrs = gold.values("adamw.lrs");     // [STEPS, 2]
  const std::vector<double> norms = gold.values("adamw.norms");  // [STEPS]
  for (int k = 0; k < kSteps; ++k) {
    CAPTURE(k);
    const std::string s = std::to_string(k);
    w.set_grad(gold.get("grad." + s + ".w", device));
    b.set_grad(gold.get("grad." + s + ".b", device));
    const double norm = clip_grad_norm(opt.parameters(), 1.0);
    CHECK(norm == doctest::Approx(norms[k]).epsilon(1e-6));
    CHECK(opt.current_lr(0) == doctest::Approx(lrs[2 * k]).epsilon(1e-12));
    CHECK(opt.current_lr(1) == doctest::Approx(lrs[2 * k + 1]).epsilon(1e-12));
    opt.step();
    check_close(w, gold.get("adamw." + s + ".w"), 1e-6);
    check_close(b, gold.get("adamw." + s + ".b"), 1e-6);
  }
  CHECK(opt.step_count() == kSteps);
  CHECK(w.device() == device);
}

DEVICE_TEST_CASE("optim/sgd with momentum and nesterov matches torch") {
  Golden gold;
  for (bool nesterov : {false, true}) {
    CAPTURE(nesterov);
    const std::string tag = nesterov ? "sgd_nesterov" : "sgd";
    Tensor w = leaf(gold.get("init.w", device));
    Tensor b = leaf(gold.get("init.b", device));
    ParamGroup g;
    g.params = {w, b};
    g.lr = 0.1;
    g.weight_decay = 0.01;
    SGD opt({g}, SGDOptions{0.9, nesterov ? 0.0 : 0.1, nesterov});
    for (int k = 0; k < kSteps; ++k) {
      CAPTURE(k);
      const std::string s = std::to_string(k);
      w.set_grad(gold.get("grad." + s + ".w", device));
      b.set_grad(gold.get("grad." + s + ".b", device));
      opt.step();
      check_close(w, gold.get(tag + "." + s + ".w"), 1e-6);
      check_close(b, gold.get(tag + "." + s + ".b"), 1e-6);
    }
  }
}

TEST_CASE("optim/schedules match torch's LambdaLR and CosineAnnealingLR") {
  Golden gold;
  auto check_trace = [&](const std::string& name, const LrSchedule& s, double base) {
    CAPTURE(name);
    const std::vector<double> want = gold.values(name);
    REQUIRE(want.size() > 8);
    for (size_t k = 0; k < want.size(); ++k) {
      CAPTURE(k);
      CHECK(base * s.factor(int64_t(k)) == doctest::Approx(want[k]).epsilon(1e-12).scale(1e-3));
    }
  };
  check_trace("sched.warmup_constant", WarmupConstantSchedule(4), 1.0);
  check_trace("sched.warmup_cosine", WarmupCosineSchedule(3, 10, 0.1), 1.0);
  check_trace("sched.cosine_annealing", WarmupCosineSchedule(0, 10, 0.1), 0.5);
  CHECK(ConstantSchedule().factor(12345) == 1.0);
  // held at the minimum after the end (torch's CosineAnnealingLR would rise again)
  CHECK(WarmupCosineSchedule(3, 10, 0.1).factor(50) == doctest::Approx(0.1));
  CHECK(WarmupConstantSchedule(0).factor(0) == 1.0);
  CHECK(error_of([] { WarmupCosineSchedule(5, 4); }).find("warmup <= total") != std::string::npos);
  CHECK(error_of([] { WarmupCosineSchedule(0, 4, 1.5); }).find("min_ratio") != std::string::npos);

  // the optimizer applies a group's schedule to that group's lr only
  Tensor p = leaf(zeros({2}));
  Tensor q = leaf(zeros({2}));
  std::vector<ParamGroup> groups(2);
  groups[0].params = {p};
  groups[0].lr = 0.5;
  groups[0].schedule = std::make_shared<WarmupConstantSchedule>(4);
  groups[1].params = {q};
  groups[1].lr = 0.25;
  SGD opt(groups);
  for (int k = 0; k < 6; ++k) {
    CHECK(opt.current_lr(0) == doctest::Approx(0.5 * std::min(1.0, k / 4.0)));
    CHECK(opt.current_lr(1) == 0.25);
    opt.step();  // no grads: nothing moves, but the step count advances
  }
  CHECK(p.to_vector<double>() == std::vector<double>{0, 0});
}

DEVICE_TEST_CASE("optim/clip_grad_norm returns the global norm and scales to max_norm") {
  Tensor a = leaf(zeros({2}, TensorOptions(device)));
  Tensor b = leaf(zeros({1, 1}, TensorOptions(device)));
  Tensor c = leaf(zeros({3}, TensorOptions(device)));  // no grad: skipped
  Tensor h = leaf(zeros({1}, TensorOptions(DType::bf16, device)));
  a.set_grad(from_vector(std::vector<float>{3, 4}, {2}).to(device));
  b.set_grad(from_vector(std::vector<float>{12}, {1, 1}).to(device));
  h.set_grad(zeros({1}, TensorOptions(DType::bf16, device)));
  CHECK(clip_grad_norm({a, b, c, h}, 100.0) == doctest::Approx(13.0).epsilon(1e-7));
  CHECK(a.grad().to_vector<double>() == std::vector<double>{3, 4});  // below max: untouched
  CHECK(clip_grad_norm({a, b, c, h}, 6.5) == doctest::Approx(13.0).epsilon(1e-7));
  check_close(a.grad(), from_vector(std::vector<float>{1.5, 2}, {2}), 1e-6);
  check_close(b.grad(), from_vector(std::vector<float>{6}, {1, 1}), 1e-6);
  CHECK(clip_grad_norm({a, b, c, h}, 100.0) == doctest::Approx(6.5).epsilon(1e-6));
  CHECK(!c.grad().defined());
  // bf16 gradients are summed in f32: 256 * 0.5^2 = 64 would lose nothing, but
  // 2^10 elements of 1 must give 32 exactly
  Tensor big = leaf(zeros({1024}, TensorOptions(DType::bf16, device)));
  big.set_grad(ones({1024}, TensorOptions(DType::bf16, device)));
  CHECK(clip_grad_norm({big}, 1e9) == doctest::Approx(32.0).epsilon(1e-9));
}

DEVICE_TEST_CASE("optim/bf16 and f16 parameters with f32 master weights follow the f32 trajectory") {
  Golden gold;
  for (DType half : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(half));
    // the same (16-bit representable) start and gradients for both runs
    Tensor w32 = leaf(gold.get("init.w", device, half).to(DType::f32));
    Tensor w16 = leaf(gold.get("init.w", device, half));
    auto make = [&](const Tensor& w) {
      ParamGroup g;
      g.params = {w};
      g.names = {"w"};
      g.lr = 1e-2;
      g.weight_decay = 0.1;
      g.schedule = std::make_shared<WarmupCosineSchedule>(2, 8, 0.1);
      return g;
    };
    AdamW ref({make(w32)}, AdamWOptions{0.9, 0.95, 1e-8});
    AdamW opt({make(w16)}, AdamWOptions{0.9, 0.95, 1e-8});
    TempDir dir("master");
    for (int k = 0; k < kSteps; ++k) {
      CAPTURE(k);
      Tensor g16 = gold.get("grad." + std::to_string(k) + ".w", device, half);
      w32.set_grad(g16.to(DType::f32));
      w16.set_grad(g16);
      ref.step();
      opt.step();
      CHECK(w16.dtype() == half);
      // the parameter is the f32 trajectory rounded to its dtype
      CHECK(bytes_of(w16) == bytes_of(w32.to(half)));
    }
    // and the master copy is the f32 trajectory itself
    opt.save_state(dir.file("state.safetensors"));
    SafetensorsFile st(dir.file("state.safetensors"));
    REQUIRE(st.contains("w.master"));
    check_close(st.load("w.master"), w32, 1e-6);
    // updates far below the 16-bit resolution still accumulate in the master:
    // the parameter moves although each step alone rounds to no change
    Tensor one = leaf(ones({4}, TensorOptions(half, device)));
    ParamGroup g;
    g.params = {one};
    g.lr = 1e-4;  // bf16 spacing at 1 is 2^-7, f16 2^-10
    AdamW tiny({g}, AdamWOptions{});
    for (int k = 0; k < 100; ++k) {
      one.set_grad(ones({4}, TensorOptions(half, device)));
      tiny.step();
    }
    for (double x : one.to_vector<double>()) CHECK(x < 1.0 - 0.005);
  }
}

DEVICE_TEST_CASE("optim/state save and load resumes bitwise") {
  Golden gold;
  TempDir dir("resume_" + device.str().substr(0, 3));
  auto grads_at = [&](int k) {
    const std::string s = std::to_string(k);
    return std::make_pair(gold.get("grad." + s + ".w", device), gold.get("grad." + s + ".b", device));
  };
  for (const std::string kind : {"AdamW", "SGD"}) {
    CAPTURE(kind);
    // w in bf16 (AdamW keeps a master copy), b in f32
    auto make_params = [&]() {
      return std::make_pair(leaf(gold.get("init.w", device, DType::bf16)), leaf(gold.get("init.b", device)));
    };
    auto make_opt = [&](Tensor w, Tensor b) -> std::unique_ptr<Optimizer> {
      std::vector<ParamGroup> groups(2);
      groups[0].params = {w};
      groups[0].names = {"layer.w"};
      groups[0].lr = 1e-2;
      groups[0].weight_decay = 0.1;
      groups[0].schedule = std::make_shared<WarmupCosineSchedule>(1, 6, 0.2);
      groups[1].params = {b};
      groups[1].names = {"layer.b"};
      groups[1].lr = 3e-3;
      if (kind == "AdamW") return std::make_unique<AdamW>(groups, AdamWOptions{0.8, 0.9, 1e-6});
      return std::make_unique<SGD>(groups, SGDOptions{0.9, 0.0, true});
    };
    auto run = [&](Optimizer& opt, Tensor w, Tensor b, int from, int to) {
      for (int k = from; k < to; ++k) {
        auto [gw, gb] = grads_at(k);
        w.set_grad(gw.to(w.dtype()));
        b.set_grad(gb);
        clip_grad_norm(opt.parameters(), 2.0);
        opt.step();
      }
    };
    auto [w, b] = make_params();
    auto opt = make_opt(w, b);
    run(*opt, w, b, 0, 3);
    const std::string state = dir.file(kind + ".state.safetensors");
    const std::string params = dir.file(kind + ".params.safetensors");
    opt->save_state(state);
    save_safetensors(params, {{"w", w}, {"b", b}});
    run(*opt, w, b, 3, 6);

    // a fresh process would do this: parameters and state from the files
    SafetensorsFile pf(params);
    Tensor w2 = leaf(pf.load("w").to(device));
    Tensor b2 = leaf(pf.load("b").to(device));
    auto opt2 = make_opt(w2, b2);
    opt2->load_state(state);
    CHECK(opt2->step_count() == 3);
    CHECK(opt2->current_lr(0) == opt->param_groups()[0].lr * WarmupCosineSchedule(1, 6, 0.2).factor(3));
    run(*opt2, w2, b2, 3, 6);
    CHECK(bytes_of(w2) == bytes_of(w));
    CHECK(bytes_of(b2) == bytes_of(b));
    CHECK(opt2->step_count() == opt->step_count());
  }
}

TEST_CASE("optim/load_state rejects mismatched state with a clear message") {
  TempDir dir("mismatch");
  Tensor w = leaf(ones({2, 3}));
  Tensor b = leaf(ones({3}));
  auto group = [](std::vector<Tensor> ps, std::vector<std::string> names) {
    ParamGroup g;
    g.params = std::move(ps);
    g.names = std::move(names);
    g.lr = 0.1;
    return g;
  };
  AdamW opt({group({w, b}, {"w", "b"})});
  w.set_grad(ones({2, 3}));
  b.set_grad(ones({3}));
  opt.step();
  const std::string path = dir.file("adamw.safetensors");
  opt.save_state(path);

  auto msg_of = [&](Optimizer& o) { return error_of([&] { o.load_state(path); }); };
  {
    SGD sgd({group({leaf(ones({2, 3})), leaf(ones({3}))}, {"w", "b"})}, SGDOptions{0.9});
    const std::string m = msg_of(sgd);
    CHECK(m.find(path) != std::string::npos);
    CHECK(m.find("saved by AdamW, cannot load into SGD") != std::string::npos);
  }
  {
    AdamW other({group({leaf(ones({2, 3})), leaf(ones({3}))}, {"w", "bias"})});
    CHECK(msg_of(other).find("is 'b' in the file, 'bias' here") != std::string::npos);
  }
  {
    AdamW other({group({leaf(ones({3, 2})), leaf(ones({3}))}, {"w", "b"})});
    const std::string m = msg_of(other);
    CHECK(m.find("'w.exp_avg' has shape [2, 3]") != std::string::npos);
    CHECK(m.find("[3, 2]") != std::string::npos);
  }
  {
    AdamW other({group({leaf(ones({2, 3}))}, {"w"}), group({leaf(ones({3}))}, {"b"})});
    CHECK(msg_of(other).find("1 parameter groups, this optimizer has 2") != std::string::npos);
  }
  {
    // a bf16 parameter needs a master copy the f32 run never saved
    AdamW other({group({leaf(ones({2, 3}, DType::bf16)), leaf(ones({3}))}, {"w", "b"})});
    CHECK(msg_of(other).find("missing state tensor 'w.master'") != std::string::npos);
  }
  {
    Tensor x = leaf(ones({3}));
    AdamW other({group({x}, {"x"})});
    CHECK(error_of([&] { other.load_state(dir.file("none.safetensors")); }).find("cannot open") !=
          std::string::npos);
    save_safetensors(dir.file("plain.safetensors"), {{"x", ones({3})}});
    CHECK(error_of([&] { other.load_state(dir.file("plain.safetensors")); })
              .find("not an optimizer state file") != std::string::npos);
    // a failed load leaves the optimizer as it was
    x.set_grad(ones({3}));
    other.step();
    CHECK(other.step_count() == 1);
  }
  // and the matching optimizer loads it
  AdamW same({group({leaf(ones({2, 3})), leaf(ones({3}))}, {"w", "b"})});
  same.load_state(path);
  CHECK(same.step_count() == 1);
}

TEST_CASE("optim/construction and zero_grad") {
  Tensor w = leaf(ones({2}));
  ParamGroup g;
  g.params = {w, w};
  CHECK(error_of([&] { AdamW o({g}); }).find("appears twice") != std::string::npos);
  g.params = {w};
  g.names = {"a", "b"};
  CHECK(error_of([&] { AdamW o({g}); }).find("2 names for 1 parameters") != std::string::npos);
  g.names = {};
  g.params = {ones({2}, DType::i64)};  // integers cannot require grad either
  CHECK(error_of([&] { SGD o({g}); }).find("expected floating") != std::string::npos);
  g.params = {w};
  CHECK(error_of([&] { SGD o({g}, SGDOptions{0.0, 0.0, true}); }).find("Nesterov") != std::string::npos);

  SGD opt({g});
  w.set_grad(ones({2}));
  opt.zero_grad();
  CHECK(!w.grad().defined());
  opt.step();  // parameters without a gradient are left alone
  CHECK(w.to_vector<double>() == std::vector<double>{1, 1});
}

DEVICE_TEST_CASE("optim/a 2-layer MLP fits sin(x) with AdamW") {
  // y = sin(x) on 256 points of [-pi, pi]; 1 -> 32 (tanh) -> 1.
  constexpr int64_t N = 256, H = 32;
  constexpr int kMaxSteps = 1500;
  constexpr double kBound = 1e-2;  // MSE
  TensorOptions f32(DType::f32, device);
  std::vector<float> xs(N), ys(N);
  for (int64_t i = 0; i < N; ++i) {
    xs[i] = float(-std::numbers::pi + 2 * std::numbers::pi * double(i) / double(N - 1));
    ys[i] = std::sin(xs[i]);
  }
  Tensor x = from_vector(xs, {N, 1}).to(device);
  Tensor y = from_vector(ys, {N, 1}).to(device);
  Generator gen(42);
  Tensor w1 = leaf(rand_normal({H, 1}, gen, 0.0, 1.0, f32));
  Tensor b1 = leaf(rand_uniform({H}, gen, -1.0, 1.0, f32));
  Tensor w2 = leaf(rand_normal({1, H}, gen, 0.0, 1.0 / std::sqrt(double(H)), f32));
  Tensor b2 = leaf(zeros({1}, f32));
  ParamGroup g;
  g.params = {w1, b1, w2, b2};
  g.names = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  g.lr = 1e-2;
  g.schedule = std::make_shared<WarmupCosineSchedule>(50, kMaxSteps, 0.1);
  AdamW opt({g});
  auto loss_fn = [&] {
    Tensor pred = linear(tanh(linear(x, w1, b1)), w2, b2);  // [N, 1]
    return mean(square(pred - y));
  };
  double first = 0, loss = 0;
  int steps = 0;
  for (; steps < kMaxSteps; ++steps) {
    opt.zero_grad();
    Tensor l = loss_fn();
    loss = l.item();
    if (steps == 0) first = loss;
    REQUIRE(std::isfinite(loss));
    if (loss < kBound / 10) break;
    l.backward();
    REQUIRE(w1.grad().defined());
    clip_grad_norm(opt.parameters(), 1.0);
    opt.step();
  }
  MESSAGE("MLP on " << device.str() << ": MSE " << first << " -> " << loss << " after " << steps
                    << " steps");
  CHECK(loss < kBound);
  CHECK(loss < first / 10);
}
