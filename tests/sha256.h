#pragma once
// Minimal SHA-256 (FIPS 180-4) for hashing golden tensors in tests; libcrypto
// is not a project dependency.
#include <cstddef>
#include <cstdint>
#include <string>

namespace areno::testing {

// Lower-case hex digest of `n` bytes.
std::string sha256_hex(const void* data, size_t n);

}  // namespace areno::testing
