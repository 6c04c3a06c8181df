// Compiles o200k_base.tiktoken into the library, so the tokenizer needs no
// file at run time.
#include "models/phi4mm/embedded_file.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"

#ifndef ARENO_O200K_PATH
#error "ARENO_O200K_PATH must name o200k_base.tiktoken (set by meson)"
#endif

namespace areno::phi4mm {

ARENO_EMBED_FILE(embedded_o200k_ranks, ARENO_EMBED_STR(ARENO_O200K_PATH))

}  // namespace areno::phi4mm
