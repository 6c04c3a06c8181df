// A safetensors file: header parsing and validation, then loading every
// tensor it declares.
#include <sys/mman.h>
#include <unistd.h>

#include <exception>
#include <string>

#include "nn/io/safetensors.h"
#include "tests/fuzz/fuzz_common.h"

using namespace areno;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = ::memfd_create("fuzz.safetensors", 0);
  if (fd < 0) return 0;
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) break;
    done += size_t(n);
  }
  try {
    SafetensorsFile f("/proc/self/fd/" + std::to_string(fd));
    for (const std::string& name : f.names()) (void)f.load_copy(name);
    (void)f.metadata();
  } catch (const std::exception&) {
  }
  ::close(fd);
  return 0;
}
