// Weight-only int8 in the model (issue 16, `--quantize int8`): load_model
// quantizes each linear base and the tied head as it reads them, the same
// values quantize_model gives an already built model; the full-precision
// weights are gone; the forward (packed sequences, per-sequence LoRA) stays
// close to the unquantized one; what is refused is refused by name.
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <string>
#include <vector>

#include "models/phi4mm/checkpoint.h"
#include "models/phi4mm/demo/demo.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tests/test_util.h"
#include "train/param_groups.h"

using namespace areno;
using namespace areno::phi4mm;

namespace {

// Largest |a - b| over the largest |b|.
double rel_diff(const Tensor& a, const Tensor& b) {
  return max_abs_diff(a.to(DType::f64), b.to(DType::f64)) / max_abs_diff(b.to(DType::f64), zeros_like(b).to(DType::f64));
}

}  // namespace

TEST_CASE("int8 model: load_model --quantize int8 equals quantize_model, drops the weights, keeps LoRA per sequence") {
  NoGradGuard ng;
  auto ref = demo_model(DType::f32);
  testing::TempDir dir;
  save_model(*ref, dir.str());
  LoadOptions lo;
  lo.quantize = Quantize::int8;
  LoadReport report;
  auto q = load_model(dir.str(), lo, &report);
  const int64_t layers = ref->config().text.num_hidden_layers;
  CHECK(report.quantized == 1 + 4 * layers);
  CHECK(report.summary().find(fmt::format("{} quantized to int8", 1 + 4 * layers)) != std::string::npos);
  REQUIRE(q->is_quantized());
  CHECK(!ref->is_quantized());
  CHECK(q->dtype() == DType::f32);

  auto built = demo_model(DType::f32);
  quantize_model(*built, Quantize::int8);
  const auto a = q->quantizable_weights(), b = built->quantizable_weights();
  REQUIRE(a.size() == size_t(1 + 4 * layers));
  REQUIRE(a.size() == b.size());
  size_t int8_bytes = 0, f32_bytes = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(a[i].first);
    REQUIRE(a[i].second->int8);
    CHECK(a[i].second->int8->values == b[i].second->int8->values);
    CHECK(a[i].second->int8->scales == b[i].second->int8->scales);
    CHECK(a[i].second->weight.numel() == 0);  // no full-precision copy left
    CHECK(a[i].second->weight.size(1) == a[i].second->int8->cols);
    int8_bytes += a[i].second->int8->nbytes();
    f32_bytes += size_t(a[i].second->int8->rows * a[i].second->int8->cols) * 4;
  }
  CHECK(double(int8_bytes) < 0.27 * double(f32_bytes));  // 1 byte per weight + a scale per row
  // LoRA, norms and towers stay as they were.
  for (auto& [name, t] : q->named_parameters())
    if (name.find("lora_") != std::string::npos || name.find("layernorm") != std::string::npos) {
      const std::string& param = name;  // clang 14 cannot capture a structured binding
      CAPTURE(param);
      CHECK(max_abs_diff(t, ref->get(name)) == 0);
    }

  // Three sequences packed, each with its adapter: every one as alone, and near the unquantized model.
  const std::vector<int64_t> s1{1, 2, 3, 4, 5, 6, 7}, s2{9, 8, 7, 6}, s3{100, 200, 300, 400, 500};
  const std::vector<Adapter> ads{Adapter::none, Adapter::vision, Adapter::speech};
  const PackedBatch packed = PackedBatch::pack({s1, s2, s3}, ads);
  const Tensor lq = q->logits(packed), lr = ref->logits(packed);
  CHECK(rel_diff(lq, lr) < 0.05);
  int64_t row = 0;
  for (size_t s = 0; s < 3; ++s) {
    const auto& ids = s == 0 ? s1 : s == 1 ? s2 : s3;
    const Tensor alone = q->logits(PackedBatch::single(ids, ads[s]));
    CHECK(max_abs_diff(alone, lq.narrow(0, row, int64_t(ids.size()))) < 1e-4);
    row += int64_t(ids.size());
  }
  // The adapters still act: vision LoRA changes the int8 model's logits as it changes the reference's.
  const Tensor qn = q->logits(PackedBatch::single(s2, Adapter::none)), qv = q->logits(PackedBatch::single(s2, Adapter::vision));
  const Tensor rn = ref->logits(PackedBatch::single(s2, Adapter::none)), rv = ref->logits(PackedBatch::single(s2, Adapter::vision));
  CHECK(max_abs_diff(qv, qn) > 1e-3);
  CHECK(rel_diff(sub(qv, qn), sub(rv, rn)) < 0.1);
}

TEST_CASE("int8 model: refusals name what is not supported") {
  auto ref = demo_model(DType::f32);
  testing::TempDir dir;
  save_model(*ref, dir.str());
  LoadOptions lo;
  lo.quantize = Quantize::int8;
  lo.device = Device::parse("cuda:0");
  CHECK_THROWS_WITH_AS(load_model(dir.str(), lo), doctest::Contains("CPU only"), std::invalid_argument);
  lo.device = Device::cpu();
  lo.dtype = DType::f16;
  CHECK_THROWS_WITH_AS(load_model(dir.str(), lo), doctest::Contains("f32 or bf16"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(quantize_from_name("int4"), doctest::Contains("none or int8"), std::invalid_argument);

  auto q = demo_model(DType::f32);
  quantize_model(*q, Quantize::int8);
  CHECK_THROWS_WITH_AS(save_model(*q, (dir.path / "again").string()), doctest::Contains("int8"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(train::apply_trainable(*q, train::GroupOptions{}), doctest::Contains("unquantized"),
                       std::invalid_argument);
  // An input that records autograd history cannot go through int8 weights.
  CHECK_THROWS_WITH_AS(q->model->layers->at<DecoderLayer>(0)->mlp->down_proj->base_layer->linear(
                           ones({1, ref->config().text.intermediate_size}).set_requires_grad(true)),
                       doctest::Contains("inference"), std::invalid_argument);
}
