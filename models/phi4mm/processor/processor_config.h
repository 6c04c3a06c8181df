#pragma once
// preprocessor_config.json of the released layout (spec vision.md 1, end; audio.md 4):
// what Python's AutoProcessor reads to build the image processor and the audio
// feature extractor. Written beside every checkpoint areno writes (init, train).
#include <filesystem>

#include <nlohmann/json.hpp>

#include "models/phi4mm/processor/image_processor.h"

namespace areno::phi4mm {

// image_processor_type, processor_class, feature_extractor_type, dynamic_hd
// (max crops), audio_compression_rate 8, audio_downsample_rate 1,
// audio_feat_stride 1, auto_map (AutoProcessor -> processing_phi4mm.Phi4MMProcessor).
nlohmann::json preprocessor_config(const ImageProcessorOptions& image = {});
// Writes `dir`/preprocessor_config.json through AtomicFile.
void write_preprocessor_config(const std::filesystem::path& dir, const ImageProcessorOptions& image = {});

}  // namespace areno::phi4mm
