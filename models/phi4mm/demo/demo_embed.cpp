// Compiles demo_weights.safetensors into the library, so the demo model needs
// no file at run time.
#include "models/phi4mm/demo/demo.h"
#include "models/phi4mm/demo/demo_weights_stamp.h"  // generated: rebuilds this object when the file changes
#include "models/phi4mm/embedded_file.h"

#ifndef ARENO_DEMO_WEIGHTS_PATH
#error "ARENO_DEMO_WEIGHTS_PATH must name demo_weights.safetensors (set by meson)"
#endif

namespace areno::phi4mm {

ARENO_EMBED_FILE(embedded_demo_weights, ARENO_EMBED_STR(ARENO_DEMO_WEIGHTS_PATH))

}  // namespace areno::phi4mm
