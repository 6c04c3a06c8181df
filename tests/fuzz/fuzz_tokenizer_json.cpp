// A tokenizer.json: the Hugging Face tokenizer loader, then encoding and
// decoding a fixed text with whatever loaded.
#include <exception>
#include <string>
#include <string_view>

#include "models/phi4mm/tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_common.h"

using namespace areno;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1 << 20)) return 0;
  try {
    const tok::Tokenizer t = tok::Tokenizer::from_hf_text(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    const auto ids = t.encode("Hello, world! <|user|> 12345 \xc3\xa9\xe4\xb8\xad");
    (void)t.decode(ids);
  } catch (const std::exception&) {
  }
  return 0;
}
