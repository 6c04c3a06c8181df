// Tensor semantics the op table takes for granted: PyTorch type promotion,
// views that share storage, and argument errors that name what is wrong.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <unistd.h>

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

namespace {

// Resident memory of this process in bytes (/proc/self/statm, Linux).
size_t resident_bytes() {
  std::ifstream in("/proc/self/statm");
  size_t pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * size_t(sysconf(_SC_PAGESIZE));
}

}  // namespace

TEST_CASE("tensor/lazy_zeros: zeros on every device; on the CPU no memory is committed until written") {
  for (const Device d : testing::available_devices()) {
    CAPTURE(d.str());
    for (const DType t : {DType::f32, DType::bf16}) {
      for (const int64_t n : {int64_t(7), int64_t(3) << 20}) {  // below and above the mapping threshold
        Tensor z = lazy_zeros({n / 7 + 1, 7}, TensorOptions(t, d));
        CHECK(z.shape() == Shape{n / 7 + 1, 7});
        CHECK(z.dtype() == t);
        CHECK(sum(abs(z.to(DType::f32))).item() == 0.0);
        z.fill_(2.0);  // written, then read back
        CHECK(sum(z.to(DType::f32)).item() == doctest::Approx(2.0 * double(z.numel())));
      }
    }
  }
  // 512 MiB of f32 zeros on the CPU: the resident set grows by what is
  // written (one 4 MiB row here), not by the whole buffer.
  const size_t before = resident_bytes();
  Tensor big = lazy_zeros({128, int64_t(1) << 20}, DType::f32);
  big.select(0, 5).fill_(1.0);
  const size_t grown = resident_bytes() - std::min(before, resident_bytes());
  CHECK(grown < (size_t(64) << 20));
  CHECK(sum(big.select(0, 5)).item() == double(int64_t(1) << 20));
  CHECK(sum(big.select(0, 6)).item() == 0.0);
  CHECK_THROWS_AS(lazy_zeros({-1, 3}), std::invalid_argument);
}

namespace {
// Whether a file whose name contains `name` is mapped into this process.
bool mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(name) != std::string::npos) return true;
  return false;
}
}  // namespace

// libcublasLt's initializers cost a process 0.2 s and about 217 MB at start,
// so the CUDA backend opens cuBLAS when a product on a GPU first needs it
// (kernels/cuda/cublas_lib.h), never at load. Nothing here has touched a GPU
// when none is visible; with one, earlier tests may have loaded it.
TEST_CASE("backend/cuBLAS is not loaded until used") {
  if (testing::has_cuda()) return;
  CHECK_FALSE(mapped("libcublasLt"));
  CHECK_FALSE(mapped("libcublas.so"));
  const std::string version = cublas_version();  // the one use without a GPU: areno env
  if (cuda_compiled()) {
    CHECK(version.find('.') != std::string::npos);
    CHECK(version.find("not loadable") == std::string::npos);
    CHECK(mapped("libcublasLt"));
  } else {
    CHECK(version.empty());
  }
}

// Large host blocks (weights, activations) sit in transparent huge pages
// where the kernel has them (kernels/cpu/allocator.cpp): aligned to 2 MiB,
// and the mapping holding the block carries madvise's huge-page flag ("hg"
// in /proc/self/smaps; the kernel may still fall back to 4 KiB pages, so the
// advice, not the page size, is what is checked).
TEST_CASE("cpu allocator: blocks from 2 MiB are 2 MiB aligned and advised as huge pages") {
  if (const char* env = std::getenv("ARENO_CPU_HUGEPAGES"); env != nullptr && std::string(env) == "0") return;
  Tensor t = empty({int64_t(3) << 20}, DType::f32);  // 12 MiB
  const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr());
  CHECK(addr % (uintptr_t(2) << 20) == 0);
  std::ifstream smaps("/proc/self/smaps");
  std::string line, flags;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = lo <= addr && addr < hi;
      continue;
    }
    if (inside && line.rfind("VmFlags:", 0) == 0) flags = line + " ";
  }
  CAPTURE(flags);
  CHECK(flags.find(" hg ") != std::string::npos);
  t.fill_(1.0);
  CHECK(sum(t).item() == double(int64_t(3) << 20));
}
