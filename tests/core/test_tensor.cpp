// Tensor semantics the op table takes for granted: PyTorch type promotion,
// views that share storage, and argument errors that name what is wrong.
#include <doctest/doctest.h>

#include <string>

#include "tensor/ops.h"
#include "tests/test_util.h"

using namespace areno;

TEST_CASE("tensor/binary ops promote dtypes as PyTorch does") {
  auto out = [](DType a, DType b) { return add(ones({2}, a), ones({2}, b)).dtype(); };
  CHECK(out(DType::bf16, DType::f16) == DType::f32);
  CHECK(out(DType::bf16, DType::f32) == DType::f32);
  CHECK(out(DType::f32, DType::f64) == DType::f64);
  CHECK(out(DType::i32, DType::f16) == DType::f16);
  CHECK(out(DType::i64, DType::i32) == DType::i64);
  CHECK(out(DType::boolean, DType::i32) == DType::i32);
  CHECK(out(DType::bf16, DType::bf16) == DType::bf16);
  // A Python-style scalar does not widen a tensor.
  CHECK(add(ones({2}, DType::bf16), 2.5).dtype() == DType::bf16);
  CHECK(mul(ones({2}, DType::f16), 3.0).dtype() == DType::f16);
  // Comparisons give bool; argmax gives i64.
  CHECK(lt(ones({2}, DType::bf16), ones({2}, DType::f32)).dtype() == DType::boolean);
  CHECK(argmax(ones({2, 3}), 1).dtype() == DType::i64);
}

TEST_CASE("tensor/views share storage; contiguous copies only when needed") {
  Tensor x = arange(0.0, 12.0, 1.0, DType::f32).reshape({3, 4});
  Tensor t = x.t();
  CHECK_FALSE(t.is_contiguous());
  CHECK(t.storage() == x.storage());
  CHECK(x.contiguous().same(x));
  Tensor tc = t.contiguous();
  CHECK(tc.is_contiguous());
  CHECK(tc.storage() != x.storage());
  CHECK(tc.to_vector<float>() == std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});
  // A write through a view is visible in the base.
  x.select(0, 1).narrow(0, 1, 2).fill_(-1.0);
  CHECK(x.to_vector<float>()[5] == -1.0f);
  CHECK(x.to_vector<float>()[6] == -1.0f);
  CHECK(t.to_vector<float>()[4 * 0 + 1] == 4.0f);
  // Expanded dims have stride 0; a step slice multiplies the stride.
  Tensor e = x.narrow(0, 0, 1).expand({5, 3, 4});
  CHECK(e.stride(0) == 0);
  CHECK(e.stride(1) == 0);
  CHECK(x.slice(1, 0, 4, 2).stride(1) == 2);
  CHECK(x.slice(1, 1, 4, 2).to_vector<float>() == std::vector<float>{1, 3, -1, 7, 9, 11});
  // view() refuses a layout it cannot express; reshape() copies instead.
  CHECK_THROWS(t.view({12}));
  CHECK(t.reshape({12}).to_vector<float>()[1] == 4.0f);
}

TEST_CASE("tensor/shape errors name the shapes") {
  auto message = [](auto f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string m = message([] { add(ones({2, 3}), ones({4})); });
  CHECK(m.find("[2, 3]") != std::string::npos);
  CHECK(m.find("[4]") != std::string::npos);
  m = message([] { matmul(ones({2, 3}), ones({4, 5})); });
  CHECK(m.find("[2, 3]") != std::string::npos);
  CHECK(m.find("[4, 5]") != std::string::npos);
  CHECK_THROWS(cat({ones({2, 3}), ones({2, 4})}, 0));
  CHECK_THROWS(embedding(ones({5, 2}), from_vector<int64_t>({1, 7}, {2})));  // id 7 >= 5 rows
  CHECK_THROWS(gather(ones({3, 3}), 0, from_vector<int64_t>({-1, 0, 0}, {1, 3})));
  CHECK_THROWS(ones({2}).reshape({3}));
}
