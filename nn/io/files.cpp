#include "nn/io/files.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

namespace areno {

namespace {
OpenHook& hook() {
  static OpenHook h;
  return h;
}
}  // namespace

void set_open_hook(OpenHook h) { hook() = std::move(h); }

void report_open(const std::string& path) {
  if (hook()) hook()(path);
}

std::string read_file(const std::string& path) {
  report_open(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("cannot open {}: {}", path, std::strerror(errno)));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw std::runtime_error(fmt::format("cannot read {}", path));
  return ss.str();
}

}  // namespace areno
