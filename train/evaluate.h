#pragma once
// Held-out exact match (`areno eval`, the demo's accuracy in docs/demo.md):
// the serving engine answers each row's prompt greedily, and the answer is
// compared token for token with the row's first assistant turn. The rows come
// from the trainer's dataset code (load_sft_dataset), so prompts and media
// slots are exactly what training and serving build for the same messages.
#include <cstdint>
#include <memory>
#include <vector>

#include "models/phi4mm/text.h"
#include "models/phi4mm/tokenizer/tokenizer.h"
#include "train/dataset.h"

namespace areno::train {

struct AnswerCheck {
  int64_t line = 0;                 // the row's source line
  std::vector<int64_t> expected;    // the first assistant turn, without its end token
  std::vector<int64_t> generated;   // the greedy answer, without the end token
  bool finished = false;            // the answer ended with an end-of-turn token
  bool correct = false;             // generated == expected and finished
};

// Greedy answers of `model` to every row, in row order, through one
// serve::Engine (rows batched as the engine schedules them), with at most the
// expected answer's length + 1 new tokens.
std::vector<AnswerCheck> greedy_exact_match(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model,
                                            std::shared_ptr<const tok::Tokenizer> tokenizer,
                                            const std::vector<SftRow>& rows);

}  // namespace areno::train
