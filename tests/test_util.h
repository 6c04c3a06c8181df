#pragma once
// Shared helpers for doctest executables: device lists and device-parametrised
// test cases. A case for a device that is not present is registered as
// skipped, so the summary counts it as skipped rather than passed.
#include <doctest/doctest.h>

#include <exception>
#include <string>
#include <vector>

#include "tensor/backend.h"
#include "tensor/tensor.h"

namespace areno::testing {

inline bool has_cuda() {
  static const bool v = cuda_device_count() > 0;
  return v;
}

// The message of the std::exception `f` throws; "" when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Every device this machine can run tests on (CPU first).
inline std::vector<Device> available_devices() {
  std::vector<Device> d{Device::cpu()};
  if (has_cuda()) d.push_back(Device::cuda(0));
  return d;
}

}  // namespace areno::testing

// DEVICE_TEST_CASE("ops/add broadcasts") { ... uses `device` ... }
// registers "ops/add broadcasts [cpu]" and "ops/add broadcasts [cuda]".
#define ARENO_CAT2(a, b) a##b
#define ARENO_CAT(a, b) ARENO_CAT2(a, b)
#define DEVICE_TEST_CASE_IMPL(fn, name)                                                   \
  static void fn(::areno::Device device);                                                \
  TEST_CASE(name " [cpu]") { fn(::areno::Device::cpu()); }                               \
  TEST_CASE(name " [cuda]" * doctest::skip(!::areno::testing::has_cuda())) {             \
    fn(::areno::Device::cuda(0));                                                        \
  }                                                                                      \
  static void fn([[maybe_unused]] ::areno::Device device)
#define DEVICE_TEST_CASE(name) DEVICE_TEST_CASE_IMPL(ARENO_CAT(areno_device_test_, __LINE__), name)
