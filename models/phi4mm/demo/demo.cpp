#include "models/phi4mm/demo/demo.h"

#include "nn/io/safetensors.h"
#include "nn/io/weight_delta.h"

namespace areno::phi4mm {

std::shared_ptr<Phi4MMForCausalLM> demo_model(DType dtype) {
  auto model = init_phi4mm(kDemoPreset, kDemoSeed, DType::f32);
  apply_weight_delta(*model, SafetensorsFile::from_memory("<embedded demo_weights.safetensors>",
                                                          embedded_demo_weights()));
  if (dtype != DType::f32) model->to(dtype);
  return model;
}

}  // namespace areno::phi4mm
