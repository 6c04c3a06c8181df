#pragma once
// ARENO_EMBED_FILE(name, path): assembles the file at `path` (a string
// literal) into .rodata (the assembler's .incbin) and defines
// `std::string_view name()` returning its bytes, so the program needs no file
// at run time. The compiler's dependency list does not see the file: meson
// makes the object depend on it (see models/phi4mm/demo/meson.build).
#include <cstddef>
#include <string_view>

#define ARENO_EMBED_STR2(x) #x
#define ARENO_EMBED_STR(x) ARENO_EMBED_STR2(x)

#define ARENO_EMBED_FILE(name, path)                                                 \
  asm(".section .rodata\n"                                                           \
      ".balign 16\n"                                                                 \
      "areno_embed_" #name "_begin:\n"                                               \
      ".incbin \"" path "\"\n"                                                       \
      "areno_embed_" #name "_end:\n"                                                 \
      ".previous\n");                                                                \
  extern "C" const char areno_embed_##name##_begin[];                                \
  extern "C" const char areno_embed_##name##_end[];                                  \
  std::string_view name() {                                                          \
    return std::string_view(areno_embed_##name##_begin,                              \
                            size_t(areno_embed_##name##_end - areno_embed_##name##_begin)); \
  }
