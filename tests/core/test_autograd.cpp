// The tape itself: gradient accumulation, no_grad, detach, checkpoint, and a
// check that gradcheck does reject a wrong backward.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "autograd/checkpoint.h"
#include "autograd/gradcheck.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tests/core/op_harness.h"

using namespace areno;
using namespace areno::testing;

namespace {

Tensor leaf(Shape shape, uint64_t seed) {
  Tensor t = make_input(In(std::move(shape)), DType::f64, Device::cpu(), seed);
  t.set_requires_grad(true);
  return t;
}

// y = x^2 with a hand-written backward (`factor` 2 is right, 1 is wrong).
Tensor square_with_backward(const Tensor& x, double factor) {
  Tensor y;
  {
    NoGradGuard g;
    y = mul(x, x);
  }
  if (needs_grad({x}))
    record(y, "test_square", {x}, [x, factor](const Tensor& gy) -> std::vector<Tensor> {
      return {mul(mul(gy, x), factor)};
    });
  return y;
}

}  // namespace

TEST_CASE("autograd/gradcheck accepts a right backward and rejects a wrong one") {
  Tensor x = leaf({5}, 1);
  auto right = gradcheck([](const std::vector<Tensor>& v) { return square_with_backward(v[0], 2.0); }, {x});
  CHECK_MESSAGE(right.ok, right.message);
  auto wrong = gradcheck([](const std::vector<Tensor>& v) { return square_with_backward(v[0], 1.0); }, {x});
  CHECK_FALSE(wrong.ok);
  CHECK(wrong.max_abs_err > 1e-3);
  CHECK(!wrong.message.empty());
}

TEST_CASE("autograd/backward gives d(sum x^2 w)/dx = 2 x w and dw = x^2") {
  Tensor x = leaf({4}, 2), w = leaf({4}, 3);
  sum(mul(mul(x, x), w)).backward();
  auto xv = x.to_vector<double>(), wv = w.to_vector<double>();
  auto gx = x.grad().to_vector<double>(), gw = w.grad().to_vector<double>();
  for (size_t i = 0; i < 4; ++i) {
    CHECK(gx[i] == doctest::Approx(2 * xv[i] * wv[i]).epsilon(1e-12));
    CHECK(gw[i] == doctest::Approx(xv[i] * xv[i]).epsilon(1e-12));
  }
}

TEST_CASE("autograd/a shared subexpression gets the sum of both paths") {
  Tensor x = leaf({3}, 4);
  Tensor y = mul(x, x);
  sum(add(y, mul(y, 3.0))).backward();  // d/dx 4 x^2 = 8 x
  auto xv = x.to_vector<double>(), gx = x.grad().to_vector<double>();
  for (size_t i = 0; i < 3; ++i) CHECK(gx[i] == doctest::Approx(8 * xv[i]).epsilon(1e-12));
}

TEST_CASE("autograd/gradients accumulate over two backward calls until zero_grad") {
  Tensor x = leaf({2, 3}, 5);
  Tensor w = leaf({3}, 6);
  sum(mul(x, w)).backward();
  auto g1 = x.grad().to_vector<double>();
  sum(mul(x, w)).backward();
  auto g2 = x.grad().to_vector<double>();
  auto wv = w.to_vector<double>();
  for (size_t i = 0; i < g1.size(); ++i) {
    CHECK(g1[i] == doctest::Approx(wv[i % 3]).epsilon(1e-12));
    CHECK(g2[i] == doctest::Approx(2 * wv[i % 3]).epsilon(1e-12));
  }
  x.zero_grad();
  CHECK_FALSE(x.grad().defined());
  sum(mul(x, w)).backward();
  CHECK(x.grad().to_vector<double>()[0] == doctest::Approx(wv[0]).epsilon(1e-12));
}

TEST_CASE("autograd/backward with an explicit output gradient") {
  Tensor x = leaf({3}, 7);
  Tensor y = mul(x, 2.0);
  y.backward(from_vector<double>({1.0, -1.0, 0.5}, {3}));
  auto g = x.grad().to_vector<double>();
  CHECK(g[0] == doctest::Approx(2.0));
  CHECK(g[1] == doctest::Approx(-2.0));
  CHECK(g[2] == doctest::Approx(1.0));
}

TEST_CASE("autograd/no_grad records nothing and restores the mode") {
  Tensor x = leaf({3}, 8);
  CHECK(grad_enabled());
  {
    NoGradGuard g;
    CHECK_FALSE(grad_enabled());
    Tensor y = exp(mul(x, x));
    CHECK_FALSE(y.requires_grad());
    CHECK(y.grad_fn() == nullptr);
    {
      EnableGradGuard e;
      Tensor z = mul(x, 2.0);
      CHECK(z.requires_grad());
      CHECK(z.grad_fn() != nullptr);
    }
    CHECK_FALSE(grad_enabled());
  }
  CHECK(grad_enabled());
  Tensor y = mul(x, x);
  CHECK(y.requires_grad());
  CHECK(y.grad_fn() != nullptr);
  // Inputs that do not require grad record nothing either.
  Tensor c = make_input(In({3}), DType::f64, Device::cpu(), 9);
  Tensor d = mul(c, c);
  CHECK_FALSE(d.requires_grad());
  CHECK(d.grad_fn() == nullptr);
}

TEST_CASE("autograd/detach shares storage and stops gradients") {
  Tensor x = leaf({4}, 10);
  Tensor y = mul(x, 3.0);
  Tensor d = y.detach();
  CHECK_FALSE(d.requires_grad());
  CHECK(d.grad_fn() == nullptr);
  CHECK(d.data_ptr() == y.data_ptr());
  // z = x * detach(3x): dz/dx = 3x only (the detached path contributes nothing).
  sum(mul(x, d)).backward();
  auto xv = x.to_vector<double>(), g = x.grad().to_vector<double>();
  for (size_t i = 0; i < 4; ++i) CHECK(g[i] == doctest::Approx(3 * xv[i]).epsilon(1e-12));
}

TEST_CASE("autograd/checkpoint gives the same gradients as the plain graph") {
  Tensor x = leaf({3, 4}, 11);
  Tensor w1 = leaf({4, 5}, 12);  // used by the block through its closure
  Tensor w2 = leaf({5, 2}, 13);
  auto block = [&](const std::vector<Tensor>& in) {
    return gelu(matmul(tanh(matmul(in[0], w1)), w2));
  };
  Tensor plain = sum(square(block({x})));
  plain.backward();
  auto gx = x.grad().to_vector<double>(), g1 = w1.grad().to_vector<double>(),
       g2 = w2.grad().to_vector<double>();
  x.zero_grad();
  w1.zero_grad();
  w2.zero_grad();

  Tensor out = checkpoint(block, {x});
  CHECK(out.requires_grad());
  Tensor ck = sum(square(out));
  CHECK(ck.item() == doctest::Approx(plain.item()).epsilon(1e-12));
  ck.backward();
  REQUIRE(x.grad().defined());
  REQUIRE(w1.grad().defined());
  REQUIRE(w2.grad().defined());
  auto cx = x.grad().to_vector<double>(), c1 = w1.grad().to_vector<double>(),
       c2 = w2.grad().to_vector<double>();
  for (size_t i = 0; i < gx.size(); ++i) CHECK(cx[i] == doctest::Approx(gx[i]).epsilon(1e-12));
  for (size_t i = 0; i < g1.size(); ++i) CHECK(c1[i] == doctest::Approx(g1[i]).epsilon(1e-12));
  for (size_t i = 0; i < g2.size(); ++i) CHECK(c2[i] == doctest::Approx(g2[i]).epsilon(1e-12));
}

TEST_CASE("autograd/gradients of a bf16 leaf have its dtype") {
  Tensor x = ones({4}, DType::bf16).set_requires_grad(true);
  sum(mul(x, 3.0)).backward();
  REQUIRE(x.grad().defined());
  CHECK(x.grad().dtype() == DType::bf16);
  CHECK(x.grad().to_vector<double>()[2] == 3.0);
}
