#pragma once
// Shared helpers for doctest executables: device lists and device-parametrised
// test cases. A case for a device that is not present is registered as
// skipped, so the summary counts it as skipped rather than passed.
#include <doctest/doctest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <exception>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
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

// A fresh directory under the system temp dir, removed at scope exit.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           ("areno_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string str(const std::string& sub = "") const { return sub.empty() ? path.string() : (path / sub).string(); }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

// The names in `dir`, sorted.
inline std::vector<std::string> names_in(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A full disk, in-process: caps the size of every file this process writes
// (RLIMIT_FSIZE) with SIGXFSZ ignored, so a write past `bytes` fails with
// EFBIG ("File too large") as one fails with ENOSPC on a full disk. The limit
// and the signal's handler are restored at scope exit.
struct FileSizeLimit {
  rlimit old{};
  void (*old_handler)(int) = SIG_DFL;
  explicit FileSizeLimit(rlim_t bytes) {
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
    old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit capped = old;
    capped.rlim_cur = bytes;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &capped) == 0);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;
};

// Every device this machine can run tests on (CPU first).
inline std::vector<Device> available_devices() {
  std::vector<Device> d{Device::cpu()};
  if (has_cuda()) d.push_back(Device::cuda(0));
  return d;
}

// Runs `f` with the process's stdout sent to a temporary file; returns what it
// printed (stdout is restored when `f` throws too).
inline std::string captured_stdout(const std::function<void()>& f) {
  std::fflush(stdout);
  char path[] = "/tmp/areno_stdout_XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  const int saved = ::dup(STDOUT_FILENO);
  ::dup2(fd, STDOUT_FILENO);
  auto restore = [&] {
    std::fflush(stdout);
    ::dup2(saved, STDOUT_FILENO);
    ::close(saved);
    ::close(fd);
  };
  try {
    f();
  } catch (...) {
    restore();
    ::unlink(path);
    throw;
  }
  restore();
  std::ifstream in(path, std::ios::binary);
  std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ::unlink(path);
  return out;
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
