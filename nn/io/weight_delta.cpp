#include "nn/io/weight_delta.h"

#include <cstring>
#include <map>
#include <stdexcept>

#include <fmt/format.h>

namespace areno {

namespace {

constexpr const char* kRows = ":rows";
constexpr const char* kValues = ":values";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

Tensor cpu_contiguous(const Tensor& t) {
  Tensor c = t.device().is_cpu() ? t : t.to(Device::cpu());
  return c.contiguous();
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> weight_delta(const Module& base, const Module& trained,
                                                         WeightDeltaStats* stats) {
  const NamedTensors b = base.named_parameters(), t = trained.named_parameters();
  if (b.size() != t.size())
    throw std::invalid_argument(
        fmt::format("weight delta: the base has {} parameters, the trained model {}", b.size(), t.size()));
  WeightDeltaStats s;
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < b.size(); ++i) {
    const std::string& name = t[i].first;
    if (b[i].first != name)
      throw std::invalid_argument(
          fmt::format("weight delta: parameter {} is '{}' in the base, '{}' in the trained model", i, b[i].first, name));
    const Tensor x = cpu_contiguous(b[i].second), y = cpu_contiguous(t[i].second);
    if (x.shape() != y.shape() || x.dtype() != y.dtype())
      throw std::invalid_argument(fmt::format("weight delta: '{}' differs in shape or dtype from the base", name));
    const auto* px = static_cast<const uint8_t*>(x.data_ptr());
    const auto* py = static_cast<const uint8_t*>(y.data_ptr());
    if (y.nbytes() == 0 || std::memcmp(px, py, y.nbytes()) == 0) {
      ++s.unchanged;
      continue;
    }
    const int64_t rows = y.dim() >= 2 ? y.size(0) : 0;
    std::vector<int64_t> changed;
    if (rows > 0) {
      const size_t rb = y.nbytes() / size_t(rows);
      for (int64_t r = 0; r < rows; ++r)
        if (std::memcmp(px + size_t(r) * rb, py + size_t(r) * rb, rb) != 0) changed.push_back(r);
    }
    if (rows == 0 || 2 * int64_t(changed.size()) > rows) {
      ++s.whole;
      out.emplace_back(name, y.clone());
      continue;
    }
    Shape vs = y.shape();
    vs[0] = int64_t(changed.size());
    Tensor values = empty(vs, TensorOptions(y.dtype()));
    const size_t rb = y.nbytes() / size_t(rows);
    for (size_t k = 0; k < changed.size(); ++k)
      std::memcpy(static_cast<uint8_t*>(values.data_ptr()) + k * rb, py + size_t(changed[k]) * rb, rb);
    ++s.sparse;
    s.sparse_rows += int64_t(changed.size());
    out.emplace_back(name + kRows, from_vector(changed, {int64_t(changed.size())}));
    out.emplace_back(name + kValues, values);
  }
  if (stats) *stats = s;
  return out;
}

void apply_weight_delta(Module& model, const SafetensorsFile& delta) {
  auto fail = [&](const std::string& name, const std::string& what) -> void {
    throw std::runtime_error(fmt::format("weight delta '{}': tensor '{}': {}", delta.path(), name, what));
  };
  std::map<std::string, Tensor> params;
  for (auto& [name, p] : model.named_parameters()) params.emplace(name, p);
  // Check everything first, then write.
  struct Write {
    Tensor param, values;
    std::vector<int64_t> rows;  // the rows `values` holds (row-sparse entries)
    bool whole = false;         // `values` is the whole tensor
  };
  std::vector<Write> writes;
  for (const std::string& key : delta.names()) {
    if (ends_with(key, kValues)) {
      if (!delta.contains(key.substr(0, key.size() - std::strlen(kValues)) + kRows))
        fail(key, "no matching :rows tensor");
      continue;
    }
    const bool sparse = ends_with(key, kRows);
    const std::string name = sparse ? key.substr(0, key.size() - std::strlen(kRows)) : key;
    auto it = params.find(name);
    if (it == params.end()) fail(key, "the model has no such parameter");
    const Tensor& p = it->second;
    if (!p.device().is_cpu() || !p.is_contiguous()) fail(key, "the parameter is not a contiguous CPU tensor");
    Write w{p, {}, {}, !sparse};
    if (w.whole) {
      w.values = delta.load_copy(name);
      if (w.values.shape() != p.shape() || w.values.dtype() != p.dtype())
        fail(key, "shape or dtype differs from the parameter's");
    } else {
      const std::string vname = name + kValues;
      if (!delta.contains(vname)) fail(key, "no matching :values tensor");
      const Tensor rows = delta.load_copy(key);
      w.values = delta.load_copy(vname);
      if (rows.dtype() != DType::i64 || rows.dim() != 1) fail(key, "must be a 1-D I64 tensor");
      if (p.dim() < 2) fail(key, "row-sparse delta for a parameter with fewer than 2 dimensions");
      Shape expect = p.shape();
      expect[0] = rows.size(0);
      if (w.values.shape() != expect || w.values.dtype() != p.dtype())
        fail(vname, "shape or dtype does not match the parameter's rows");
      w.rows = rows.to_vector<int64_t>();
      for (size_t k = 0; k < w.rows.size(); ++k)
        if (w.rows[k] < 0 || w.rows[k] >= p.size(0) || (k > 0 && w.rows[k] <= w.rows[k - 1]))
          fail(key, fmt::format("row {} is out of range [0, {}) or not ascending", w.rows[k], p.size(0)));
    }
    writes.push_back(std::move(w));
  }
  for (const Write& w : writes) {
    auto* dst = static_cast<uint8_t*>(w.param.data_ptr());
    const auto* src = static_cast<const uint8_t*>(w.values.data_ptr());
    if (w.whole) {
      std::memcpy(dst, src, w.param.nbytes());
      continue;
    }
    const size_t rb = w.param.nbytes() / size_t(w.param.size(0));
    for (size_t k = 0; k < w.rows.size(); ++k) std::memcpy(dst + size_t(w.rows[k]) * rb, src + k * rb, rb);
  }
}

}  // namespace areno
