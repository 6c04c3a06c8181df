#pragma once
// The trainer tests' model and rows: the tiny preset with every component and
// the four rows of tests/reference/train/make_train_golden.py (text, image,
// audio, image+audio), built with the same hand-written ids and media.
#include <memory>
#include <vector>

#include "models/phi4mm/init.h"
#include "models/phi4mm/model.h"
#include "models/phi4mm/tokenizer/phi4_tokenizer.h"
#include "tests/media_fixtures.h"
#include "train/dataset.h"

namespace areno::testing {

inline constexpr int64_t kImg = 200010, kAud = 200011;
inline constexpr int64_t kUser = 200021, kEnd = 200020, kAssistant = 200019;

// init_phi4mm("tiny", 5, f32), optionally with the speech LoRA's dropout changed
// (the preset has 0.01).
inline std::shared_ptr<phi4mm::Phi4MMForCausalLM> tiny_phi4mm(std::optional<double> speech_dropout = {}) {
  phi4mm::Config c = phi4mm::preset_config("tiny");
  if (speech_dropout) c.speech_lora->dropout = *speech_dropout;
  return phi4mm::init_phi4mm(c, 5, DType::f32);
}

// A row: prompt ids (media placeholders expanded), then the answer and <|end|>
// as targets.
struct RowBuilder {
  train::SftRow row;
  RowBuilder& text(std::initializer_list<int64_t> ids) {
    row.ids.insert(row.ids.end(), ids);
    return *this;
  }
  RowBuilder& image(int64_t w, int64_t h) {
    row.media.push_back(phi4mm::Media::of_image(formula_image(w, h)));
    row.ids.insert(row.ids.end(), size_t(phi4mm::num_image_tokens(w, h)), kImg);
    return *this;
  }
  RowBuilder& audio(std::vector<double> samples, int64_t rate) {
    row.ids.insert(row.ids.end(), size_t(phi4mm::audio_token_count(int64_t(samples.size()), rate)), kAud);
    row.media.push_back(phi4mm::Media::of_audio(std::move(samples), rate));
    return *this;
  }
  train::SftRow answer(std::initializer_list<int64_t> ids, phi4mm::Adapter a, int64_t line = 0) {
    row.ids.push_back(kEnd);
    row.ids.push_back(kAssistant);
    const size_t first = row.ids.size();
    row.ids.insert(row.ids.end(), ids);
    row.ids.push_back(kEnd);
    row.targets.assign(row.ids.size(), -1);
    for (size_t t = first - 1; t + 1 < row.ids.size(); ++t) row.targets[t] = row.ids[t + 1];
    row.adapter = a;
    row.line = line;
    row.prompt_tokens = int64_t(first);
    row.target_tokens = int64_t(row.ids.size() - first);
    return row;
  }
};

// r0 text, r1 image (vision LoRA), r2 audio (speech LoRA, speech projector),
// r3 audio then image (vision LoRA, vision projector for the audio).
inline std::vector<train::SftRow> golden_rows() {
  using phi4mm::Adapter;
  std::vector<train::SftRow> rows;
  rows.push_back(RowBuilder().text({kUser, 1008, 2501, 318, 4440, 30}).answer({4821, 13, 777}, Adapter::none, 1));
  rows.push_back(RowBuilder().text({kUser}).image(448, 448).text({3923, 374, 420, 30}).answer({2579, 13}, Adapter::vision, 2));
  rows.push_back(RowBuilder().text({kUser}).audio(clip_b(), 16000).text({8144, 420}).answer({1114, 2204, 1303}, Adapter::speech, 3));
  rows.push_back(RowBuilder().text({kUser}).audio(clip_c(), 8000).image(448, 448).text({3923, 30}).answer({9712, 13}, Adapter::vision, 4));
  return rows;
}

// The Phi-4 tokenizer, built once per test program.
inline std::shared_ptr<const tok::Tokenizer> phi4_tokenizer() {
  static auto t = std::make_shared<const tok::Tokenizer>(phi4mm::make_tokenizer());
  return t;
}

}  // namespace areno::testing
