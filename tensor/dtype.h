#pragma once
// Element types, their sizes and names, PyTorch-style type promotion, and the
// 16-bit float formats stored as raw bits.
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace areno {

enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, boolean };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);   // "f32", "bf16", "bool", ...
DType dtype_from_name(std::string_view name);  // accepts our names and torch/safetensors names
bool is_floating(DType t);
bool is_integral(DType t);  // i32, i64 (not bool)
// PyTorch's promotion: bool < integers < floating; f16 with bf16 gives f32.
DType promote_types(DType a, DType b);

// Round-to-nearest-even conversions between f32 and the 16-bit formats.
inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float f16_bits_to_float(uint16_t h);
uint16_t float_to_f16_bits(float f);

// Storage types for the 16-bit formats (same bits as CUDA's __nv_bfloat16 / __half).
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  BFloat16(float f) : bits(float_to_bf16_bits(f)) {}
  operator float() const { return bf16_bits_to_float(bits); }
};
struct Half {
  uint16_t bits = 0;
  Half() = default;
  Half(float f) : bits(float_to_f16_bits(f)) {}
  operator float() const { return f16_bits_to_float(bits); }
};

template <typename T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<BFloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<Half> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::boolean; };

// Calls f(T{}) with the C++ type of a dtype: DISPATCH over every dtype.
template <typename F>
decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(BFloat16{});
    case DType::f16: return f(Half{});
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    case DType::boolean: return f(bool{});
  }
  return f(float{});
}

}  // namespace areno
