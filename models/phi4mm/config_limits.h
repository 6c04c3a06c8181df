#pragma once
// Upper bounds on the sizes config.json may give, checked while it is parsed,
// before anything is allocated: a config with vocab_size 2^40 fails naming the
// file and the key instead of ending in std::bad_alloc. Far above every
// released Phi-4 size (vocabulary 200,064, width 3,072, 32 layers, 131,072
// positions, towers of width 1,152 / 1,024 on 448-pixel crops), and small
// enough that the product of any two fits in int64.
#include <cstdint>

namespace areno::phi4mm {

inline constexpr int64_t kMaxVocabSize = int64_t(1) << 22;  // 4,194,304 token ids
inline constexpr int64_t kMaxWidth = int64_t(1) << 18;      // hidden / intermediate / tower sizes, heads, LoRA rank
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxPositions = int64_t(1) << 24;  // max_position_embeddings
inline constexpr int64_t kMaxImageSide = 4096;              // the vision tower's crop side in pixels

}  // namespace areno::phi4mm
