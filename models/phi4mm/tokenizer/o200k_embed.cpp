// Compiles o200k_base.tiktoken into the library (the assembler's .incbin),
// so the tokenizer needs no file at run time.
#include <string_view>

#include "models/phi4mm/tokenizer/phi4_tokenizer.h"

#ifndef ARENO_O200K_PATH
#error "ARENO_O200K_PATH must name o200k_base.tiktoken (set by meson)"
#endif

#define ARENO_STR2(x) #x
#define ARENO_STR(x) ARENO_STR2(x)

asm(".section .rodata\n"
    ".balign 16\n"
    "areno_o200k_begin:\n"
    ".incbin \"" ARENO_STR(ARENO_O200K_PATH) "\"\n"
    "areno_o200k_end:\n"
    ".previous\n");

extern "C" const char areno_o200k_begin[];
extern "C" const char areno_o200k_end[];

namespace areno::phi4mm {

std::string_view embedded_o200k_ranks() {
  return std::string_view(areno_o200k_begin, size_t(areno_o200k_end - areno_o200k_begin));
}

}  // namespace areno::phi4mm
