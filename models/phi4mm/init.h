#pragma once
// Random-weight Phi-4-multimodal models for tests and benchmarks
// (`areno init --preset tiny|small`).
//
// Presets keep the released structure (packed qkv, GQA, partial rotary 0.75,
// LongRoPE with short/long tables, tied head, vision + speech LoRA on the four
// projections) at smaller sizes. The vocabulary stays 200064 so that the
// Phi-4 tokenizer's ids are valid. The towers (SigLIP, Conformer, projectors)
// are not written yet: config.json says so under "areno_towers".
#include <cstdint>
#include <memory>
#include <string>

#include "models/phi4mm/text.h"

namespace areno::phi4mm {

// "tiny" (about 13 M parameters, mostly the embedding), "small" (about 55 M)
// or "full" (the released sizes: 3.84 B text + 0.83 B LoRA; towers not yet).
Config preset_config(const std::string& preset);

// Fills every parameter of the language model from `gen` (the towers, when
// present, have their own init: vision.h, encoder.h): N(0, std) for matrices
// and the embedding, ones for norms. LoRA B is random too (PEFT starts it at zero, which would
// make the adapters invisible in tests).
void init_weights(Phi4MMForCausalLM& model, Generator& gen, double std = 0.02);

// A preset model initialised from `seed`, in `dtype` (values drawn in f32 and
// rounded, so the bf16 and f32 models of one seed agree up to rounding).
std::shared_ptr<Phi4MMForCausalLM> init_model(const std::string& preset, uint64_t seed,
                                              DType dtype = DType::f32);

}  // namespace areno::phi4mm
