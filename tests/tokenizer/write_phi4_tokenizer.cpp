// Writes the Phi-4 tokenizer files (built from the repository's o200k rank
// file) into a directory. Used by tests/reference/tokenizer/make_goldens.py.
//
//   write_phi4_tokenizer OUT_DIR [RANK_FILE]
#include <cstdio>
#include <exception>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR [RANK_FILE]\n", argv[0]);
    return 2;
  }
  try {
    const auto tok = argc > 2 ? areno::phi4mm::make_tokenizer(argv[2]) : areno::phi4mm::make_tokenizer();
    areno::phi4mm::write_tokenizer_files(tok, argv[1]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
