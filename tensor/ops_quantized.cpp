// Weight-only int8 (tensor/quantized.h): quantization at load and the ops
// that read the int8 weights.
#include "tensor/quantized.h"

#include <cmath>

#include "tensor/ops_util.h"

namespace areno {
using namespace detail;

namespace {

template <typename T>
void quantize_rows(const Tensor& w, Int8Weight& q) {
  const T* p = static_cast<const T*>(w.data_ptr());
  const int64_t rs = w.stride(0), cs = w.stride(1), K = q.cols;
  int64_t bad = -1;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < q.rows; ++n) {
    const T* row = p + n * rs;
    float amax = 0;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      const float v = float(row[k * cs]);
      finite = finite && std::isfinite(v);
      amax = std::max(amax, std::fabs(v));
    }
    if (!finite) {
#pragma omp critical
      bad = bad < 0 ? n : std::min(bad, n);
      continue;
    }
    const float scale = amax / 127.0f;
    q.scales[size_t(n)] = scale;
    int8_t* out = q.values.data() + n * K;
    if (amax == 0) {
      std::fill(out, out + K, int8_t(0));
      continue;
    }
    const float inv = 127.0f / amax;
    for (int64_t k = 0; k < K; ++k)
      out[k] = int8_t(std::clamp(std::nearbyint(float(row[k * cs]) * inv), -127.0f, 127.0f));
  }
  if (bad >= 0)
    throw std::invalid_argument(fmt::format("quantize_int8: row {} of {} holds a NaN or infinite weight", bad, w.str()));
}

}  // namespace

Int8Weight quantize_int8(const Tensor& w, DType dtype) {
  check_defined(w, "quantize_int8", "w");
  if (w.dim() != 2) throw std::invalid_argument("quantize_int8: the weight must be [N, K], got " + w.str());
  if (!w.device().is_cpu()) throw std::invalid_argument("quantize_int8: the weight must be on the CPU, got " + w.str());
  if (dtype != DType::f32 && dtype != DType::bf16)
    throw std::invalid_argument(fmt::format("quantize_int8: int8 weights stand in for f32 or bf16 ones, not {}",
                                            dtype_name(dtype)));
  Int8Weight q;
  q.rows = w.size(0), q.cols = w.size(1), q.dtype = dtype;
  q.values.resize(size_t(q.rows * q.cols));
  q.scales.resize(size_t(q.rows));
  switch (w.dtype()) {
    case DType::f32: quantize_rows<float>(w, q); break;
    case DType::bf16: quantize_rows<BFloat16>(w, q); break;
    case DType::f16: quantize_rows<Half>(w, q); break;
    case DType::f64: quantize_rows<double>(w, q); break;
    default: throw std::invalid_argument("quantize_int8: the weight must be floating-point, got " + w.str());
  }
  return q;
}

Tensor dequantize(const Int8Weight& w) {
  std::vector<float> v(w.values.size());
  for (int64_t n = 0; n < w.rows; ++n)
    for (int64_t k = 0; k < w.cols; ++k)
      v[size_t(n * w.cols + k)] = w.scales[size_t(n)] * float(w.values[size_t(n * w.cols + k)]);
  return from_vector(v, {w.rows, w.cols});
}

Tensor linear(const Tensor& x, const Int8Weight& w) {
  check_defined(x, "linear (int8)", "x");
  if (x.dim() < 1 || x.size(-1) != w.cols)
    throw std::invalid_argument(fmt::format("linear (int8): input {} has {} features, the int8 weight [{}, {}] expects {}",
                                            x.str(), x.dim() ? x.size(-1) : 0, w.rows, w.cols, w.cols));
  if (x.dtype() != DType::f32 && x.dtype() != DType::bf16)
    throw std::invalid_argument("linear (int8): the input must be f32 or bf16, got " + x.str());
  if (needs_grad({x}))
    throw std::invalid_argument("linear (int8): int8 weights are for inference; the input records autograd history "
                                "(train an unquantized model)");
  Shape out_shape = x.shape();
  out_shape.back() = w.rows;
  Tensor x2 = x.detach().reshape({-1, w.cols}).contiguous();
  Tensor out = empty({x2.size(0), w.rows}, TensorOptions(x.dtype(), x.device()));
  if (out.numel()) {
    if (w.cols == 0) {
      out.fill_(0);
    } else if (!backend(x.device()).linear_int8(x2, w.values.data(), w.scales.data(), out)) {
      throw std::invalid_argument(fmt::format("linear (int8): no int8 kernel on {} (int8 weights run on the CPU)",
                                              x.device().str()));
    }
  }
  return out.reshape(out_shape);
}

Tensor embedding(const Int8Weight& w, const Tensor& ids) {
  check_defined(ids, "embedding (int8)", "ids");
  if (!is_integral(ids.dtype())) throw std::invalid_argument("embedding (int8): ids must be integers, got " + ids.str());
  const std::vector<int64_t> idx = ids.to(Device::cpu(), DType::i64).contiguous().to_vector<int64_t>();
  std::vector<float> v(idx.size() * size_t(w.cols));
  for (size_t i = 0; i < idx.size(); ++i) {
    const int64_t r = idx[i];
    if (r < 0 || r >= w.rows)
      throw std::invalid_argument(fmt::format("embedding (int8): id {} outside [0, {})", r, w.rows));
    const int8_t* q = w.values.data() + r * w.cols;
    const float s = w.scales[size_t(r)];
    for (int64_t k = 0; k < w.cols; ++k) v[i * size_t(w.cols) + size_t(k)] = s * float(q[k]);
  }
  Shape out_shape = ids.shape();
  out_shape.push_back(w.cols);
  return from_vector(v, out_shape).to(w.dtype);
}

}  // namespace areno
