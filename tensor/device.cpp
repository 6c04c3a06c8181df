#include "tensor/device.h"

#include <charconv>
#include <stdexcept>
#include <string>

namespace areno {

Device Device::parse(std::string_view s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.substr(0, 5) == "cuda:") {
    auto num = s.substr(5);
    int idx = -1;
    auto [p, ec] = std::from_chars(num.data(), num.data() + num.size(), idx);
    if (ec == std::errc() && p == num.data() + num.size() && idx >= 0) return cuda(idx);
  }
  throw std::invalid_argument("unknown device '" + std::string(s) +
                              "' (expected cpu, cuda or cuda:N)");
}

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

}  // namespace areno
