#include "models/phi4mm/processor/processor_config.h"

#include "nn/io/atomic_file.h"

namespace areno::phi4mm {

nlohmann::json preprocessor_config(const ImageProcessorOptions& image) {
  // The spec lists the keys and values; the auto_map's content is not in it:
  // this is the entry AutoProcessor needs to find the remote-code processor.
  return {{"auto_map", {{"AutoProcessor", "processing_phi4mm.Phi4MMProcessor"}}},
          {"image_processor_type", "Phi4MMImageProcessor"},
          {"processor_class", "Phi4MMProcessor"},
          {"feature_extractor_type", "Phi4MMAudioFeatureExtractor"},
          {"dynamic_hd", image.max_crops},
          {"audio_compression_rate", 8},
          {"audio_downsample_rate", 1},
          {"audio_feat_stride", 1}};
}

void write_preprocessor_config(const std::filesystem::path& dir, const ImageProcessorOptions& image) {
  write_file_atomic((dir / "preprocessor_config.json").string(), preprocessor_config(image).dump(2) + "\n");
}

}  // namespace areno::phi4mm
