#include "nn/io/finite.h"

#include <stdexcept>

#include <fmt/format.h>

namespace areno {

namespace {

// Index of the first element whose exponent bits are all ones (NaN or inf):
// a bit test, so a large tensor costs one pass over its memory.
template <typename Bits>
std::optional<int64_t> first_all_ones_exponent(const void* data, int64_t n, Bits mask) {
  const auto* p = static_cast<const Bits*>(data);
  for (int64_t i = 0; i < n; ++i)
    if ((p[i] & mask) == mask) return i;
  return std::nullopt;
}

}  // namespace

std::optional<NonFinite> first_nonfinite(const Tensor& t) {
  if (!t.defined() || !is_floating(t.dtype()) || t.numel() == 0) return std::nullopt;
  const Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(Device::cpu()).contiguous();
  const int64_t n = c.numel();
  std::optional<int64_t> i;
  switch (c.dtype()) {
    case DType::f32: i = first_all_ones_exponent<uint32_t>(c.data_ptr(), n, 0x7f800000u); break;
    case DType::f64: i = first_all_ones_exponent<uint64_t>(c.data_ptr(), n, 0x7ff0000000000000ull); break;
    case DType::bf16: i = first_all_ones_exponent<uint16_t>(c.data_ptr(), n, uint16_t(0x7f80)); break;
    case DType::f16: i = first_all_ones_exponent<uint16_t>(c.data_ptr(), n, uint16_t(0x7c00)); break;
    default: return std::nullopt;
  }
  if (!i) return std::nullopt;
  return NonFinite{*i, c.reshape({n}).narrow(0, *i, 1).item()};
}

void check_finite(const Tensor& t, const std::string& source, const std::string& name) {
  if (auto bad = first_nonfinite(t))
    throw std::runtime_error(fmt::format("{}: tensor {} holds {} at element {} (of shape {}); refusing non-finite "
                                         "weights",
                                         source, name, bad->value, bad->index, shape_str(t.shape())));
}

void check_finite(const SafetensorsCheckpoint& ckpt) {
  for (const auto& name : ckpt.names()) {
    const SafetensorsFile& f = ckpt.file_of(name);
    check_finite(f.load(name), f.path(), name);
    f.release_pages(name);
  }
}

}  // namespace areno
