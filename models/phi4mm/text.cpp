#include "models/phi4mm/text.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <set>
#include <stdexcept>
#include <tuple>

#include <fmt/format.h>

#include "models/phi4mm/audio/encoder.h"
#include "models/phi4mm/kv_cache.h"
#include "models/phi4mm/vision/vision.h"
#include "autograd/checkpoint.h"
#include "tensor/autograd.h"

namespace areno::phi4mm {

Adapter adapter_from_name(const std::string& name) {
  if (name == "none") return Adapter::none;
  if (name == "vision") return Adapter::vision;
  if (name == "speech") return Adapter::speech;
  throw std::invalid_argument(
      fmt::format("unknown adapter '{}' (expected none, vision or speech)", name));
}

const char* adapter_name(Adapter a) {
  switch (a) {
    case Adapter::none: return "none";
    case Adapter::vision: return "vision";
    case Adapter::speech: return "speech";
  }
  return "?";
}

Weight::Weight(const std::string& type, Shape shape, TensorOptions opts) : Module(type) {
  weight = register_parameter("weight", empty(std::move(shape), opts));
}

Tensor Weight::linear(const Tensor& x) const { return int8 ? areno::linear(x, *int8) : areno::linear(x, weight); }

Tensor Weight::rows(const Tensor& ids) const { return int8 ? embedding(*int8, ids) : embedding(weight, ids); }

void Weight::set_int8(Int8Weight q) {
  if (weight.dim() != 2 || q.rows != weight.size(0) || q.cols != weight.size(1))
    throw std::invalid_argument(fmt::format("Weight::set_int8: int8 weight [{}, {}] for {}", q.rows, q.cols, weight.str()));
  int8 = std::make_shared<const Int8Weight>(std::move(q));
  // Same handle (dtype, device, requires_grad), no data: the memory goes back.
  replace_tensor_data(weight, empty({0, int8->cols}, TensorOptions(weight.dtype(), weight.device())));
}

Quantize quantize_from_name(const std::string& name) {
  if (name == "none") return Quantize::none;
  if (name == "int8") return Quantize::int8;
  throw std::invalid_argument(fmt::format("unknown quantization '{}' (expected none or int8)", name));
}

const char* quantize_name(Quantize q) { return q == Quantize::int8 ? "int8" : "none"; }

// ---- LoraLinear ----

namespace {

// A generator seed per (forward, layer, adapter).
uint64_t dropout_stream(uint64_t seed, uint64_t salt) { return splitmix64(seed ^ splitmix64(salt)); }

}  // namespace

LoraLinear::LoraLinear(int64_t in, int64_t out, const std::optional<LoraConfig>& vision,
                       const std::optional<LoraConfig>& speech, TensorOptions opts)
    : Module("LoraLinear"), in_features(in), out_features(out) {
  base_layer = register_module("base_layer", std::make_shared<Weight>("Linear", Shape{out, in}, opts));
  if (vision) register_adapter(int(Adapter::vision), adapter_name(Adapter::vision), *vision, opts);
  if (speech) register_adapter(int(Adapter::speech), adapter_name(Adapter::speech), *speech, opts);
}

void LoraLinear::register_adapter(int k, const char* name, const LoraConfig& cfg, TensorOptions opts) {
  auto dict = [&](const char* key) {
    for (auto& [n, m] : named_children())
      if (n == key) return m;
    return std::static_pointer_cast<Module>(register_module(key, std::make_shared<Module>("ModuleDict")));
  };
  auto a = dict("lora_A")->register_module(name, std::make_shared<Weight>("Linear", Shape{cfg.r, in_features}, opts));
  auto b = dict("lora_B")->register_module(name, std::make_shared<Weight>("Linear", Shape{out_features, cfg.r}, opts));
  lora_a_[k] = a->weight;
  lora_b_[k] = b->weight;
  scaling_[k] = cfg.scaling();
  dropout_[k] = cfg.dropout;
}

bool is_user_lora_param(const std::string& name) {
  return name.find(".lora_A.user.") != std::string::npos || name.find(".lora_B.user.") != std::string::npos;
}

void LoraLinear::add_user(const LoraConfig& cfg, TensorOptions opts) {
  if (has_user()) throw std::invalid_argument("this linear has a user adapter already");
  register_adapter(kUser, "user", cfg, opts);
}

void LoraLinear::init_user(Generator& g) {
  NoGradGuard ng;
  const double bound = 1.0 / std::sqrt(double(in_features));
  Tensor& a = lora_a_[kUser];
  a.copy_(rand_uniform(a.shape(), g, -bound, bound, TensorOptions(DType::f32)).to(a.dtype()).to(a.device()));
  lora_b_[kUser].zero_();
}

bool LoraLinear::pow2(double scaling) {
  int exponent = 0;
  return std::frexp(scaling, &exponent) == 0.5;
}

void LoraLinear::set_served(int32_t j, Tensor a, Tensor b, double scaling) {
  if (j < 1 || a.defined() != b.defined() ||
      (a.defined() && (a.dim() != 2 || b.dim() != 2 || a.size(1) != in_features || b.size(0) != out_features ||
                       b.size(1) != a.size(0))))
    throw std::invalid_argument(fmt::format("served LoRA {}: expected A [r, {}] and B [{}, r]", j, in_features,
                                            out_features));
  if (served_.size() < size_t(j)) served_.resize(size_t(j));
  // A power-of-two scaling goes into A once (exact, as scaling x·Aᵀ is:
  // the same bits), which saves a pass and an op per run of rows.
  if (a.defined() && pow2(scaling) && scaling != 1.0) {
    NoGradGuard ng;
    a = mul(a, scaling);
    scaling = 1.0;
  }
  served_[size_t(j - 1)] = {std::move(a), std::move(b), scaling};
}

// The rows x as adapter k sees them: with its dropout in training mode.
Tensor LoraLinear::adapter_input(int k, const Tensor& x, const AdapterRows& rows) const {
  if (!is_training() || dropout_[k] <= 0) return x;
  Generator g(dropout_stream(rows.dropout_seed, salt * 3 + uint64_t(k)));
  return dropout(x, dropout_[k], true, g);
}

// Adapter k's term for the rows x (every row for the user adapter).
Tensor LoraLinear::adapter_delta(int k, const Tensor& x, const AdapterRows& rows) const {
  // A power-of-two scaling (the checkpoint's: alpha / r = 2 for both
  // adapters) commutes with every rounding, so it scales the r-wide x·Aᵀ
  // instead of the out-wide product: the same bits, forward and backward, for
  // a pass over [rows, r] instead of [rows, out].
  return product(adapter_input(k, x, rows), lora_a_[k], lora_b_[k], scaling_[k]);
}

// y + s·xa·Bᵀ for adapter k (xa = x·Aᵀ of every row) in y's GEMM: a
// power-of-two scaling on the r-wide xa (exact), another as the GEMM's alpha.
Tensor LoraLinear::accumulate(int k, const Tensor& y, const Tensor& xa) const {
  const double s = scaling_[k];
  if (s == 1.0 || !pow2(k)) return linear_accumulate(y, xa, lora_b_[k], s);
  return linear_accumulate(y, mul(xa, s), lora_b_[k]);
}

Tensor LoraLinear::product(const Tensor& x, const Tensor& a, const Tensor& b, double s) {
  // PEFT rounding order: (x·Aᵀ)·Bᵀ, times the scaling (then added).
  if (s == 1.0) return linear(linear(x, a), b);
  return pow2(s) ? linear(mul(linear(x, a), s), b) : mul(linear(linear(x, a), b), s);
}

Tensor LoraLinear::forward(const Tensor& x, const AdapterRows& rows) const {
  // Inference where adapter k covers every row: its x·Aᵀ comes from the base
  // product's pass over x (linear_pair).
  auto pairs = [&](int k) {
    return rows.all[k] && !is_training() && x.dim() == 2 &&
           !needs_grad({x, base_layer->weight, lora_a_[k], lora_b_[k]});
  };
  Tensor y, xa;  // xa: x·Aᵀ of adapter `paired`, from the base product's pass over x
  int paired = -1;
  for (Adapter a : {Adapter::vision, Adapter::speech})
    if (has(a) && !base_layer->int8 && pairs(int(a))) paired = int(a);
  // Training where the first adapter to add covers every row with no dropout
  // active: base and adapter as one op (lora_linear: the forward's bits of the
  // path below), whose backward sums x's gradient inside its second GEMM
  // instead of adding two [rows, in] products.
  int fused = -1;
  if (x.dim() == 2 && !base_layer->int8) {
    for (int k : {int(Adapter::vision), int(Adapter::speech), kUser}) {
      const bool user = k == kUser;
      if (user ? !has_user() : !rows.any(Adapter(k)) || !lora_a_[k].defined()) continue;
      if ((user || rows.all[k]) && (!is_training() || dropout_[k] <= 0) &&
          needs_grad({x, base_layer->weight, lora_a_[k], lora_b_[k]}))
        fused = k;
      break;
    }
  }
  if (fused >= 0) y = lora_linear(x, base_layer->weight, lora_a_[fused], lora_b_[fused], scaling_[fused]);
  else if (paired >= 0) std::tie(y, xa) = linear_pair(x, base_layer->weight, lora_a_[paired]);  // the bits of two linears
  else y = base_layer->linear(x);  // int8 or the model's dtype; the adapters below are always the latter
  // An adapter on every row (training too): its B product joins y in the
  // GEMM (linear_accumulate: one rounding where linear then add rounds twice,
  // and no pass over [rows, out]). y is this call's own fresh output.
  auto joins_gemm = [&](bool all) { return all && x.dim() == 2 && y.is_contiguous(); };
  for (Adapter a : {Adapter::vision, Adapter::speech}) {
    const int k = int(a);
    if (!rows.any(a) || k == fused) continue;
    if (!has(a))
      throw std::runtime_error(fmt::format(
          "the batch asks for the {} adapter but the model has no {} LoRA weights", adapter_name(a),
          adapter_name(a)));
    if (joins_gemm(rows.all[k])) {
      y = accumulate(k, y, k == paired ? xa : linear(adapter_input(k, x, rows), lora_a_[k]));
      continue;
    }
    // Only the rows of sequences that use this adapter pay for it.
    Tensor xs = rows.all[k] ? x : index_select(x, 0, rows.rows[k]);
    Tensor d = adapter_delta(k, xs, rows);
    y = rows.all[k] ? add(y, d) : index_add(y, 0, rows.rows[k], d);
  }
  if (has_user() && fused != kUser) {  // every row
    if (joins_gemm(true)) y = accumulate(kUser, y, linear(adapter_input(kUser, x, rows), lora_a_[kUser]));
    else y = add(y, adapter_delta(kUser, x, rows));
  }
  // Served adapters, each on its sequences' rows, in the user adapter's
  // rounding order (so one served on every row gives the bits of the same
  // folder loaded as the user adapter).
  for (size_t j = 0; j < served_.size() && j < rows.served.size(); ++j) {
    const Served& sv = served_[j];
    const AdapterRows::Served& at = rows.served[j];
    if (!sv.a.defined() || (!at.all && !at.rows.defined())) continue;
    if (x.dim() == 2 && y.is_contiguous() && !needs_grad({x, base_layer->weight})) {
      // Inference: the product joins y in its GEMM, on every row or on each
      // run of the adapter's consecutive rows in place (no gather or scatter).
      // (A holds a power-of-two scaling, set_served; another is the GEMM's alpha.)
      if (at.all) linear_add_(y, linear(x, sv.a), sv.b, sv.scaling);
      else
        for (const auto& [r0, n] : at.runs)
          linear_add_(y.narrow(0, r0, n), linear(x.narrow(0, r0, n), sv.a), sv.b, sv.scaling);
      continue;
    }
    Tensor d = product(at.all ? x : index_select(x, 0, at.rows), sv.a, sv.b, sv.scaling);
    y = at.all ? add(y, d) : index_add(y, 0, at.rows, d);
  }
  return y;
}

// ---- rotary and attention cores ----

Tensor apply_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  // Same op order as the reference: (x·cos) + (rotate_half(x)·sin), each
  // rounded, in one pass (rotary_embedding).
  return rotary_embedding(x, cos, sin);
}

Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t lq = q.size(0), nq = q.size(1), d = q.size(2);
  auto heads = [](const Tensor& t) { return t.transpose(0, 1).unsqueeze(0); };  // [L, NH, D] -> [1, NH, L, D]
  AttentionOptions ao;
  ao.causal = true;  // aligns the last query with the last key
  Tensor o = scaled_dot_product_attention(heads(q), heads(k), heads(v), ao);  // [1, nq, lq, D]
  return o.squeeze(0).transpose(0, 1).reshape({lq, nq * d});
}

// ---- Attention ----

Attention::Attention(const Config& c, TensorOptions opts) : Module("Attention"), cfg_(c.text) {
  const TextConfig& t = c.text;
  qkv_proj = register_module("qkv_proj", std::make_shared<LoraLinear>(t.hidden_size, t.qkv_size(),
                                                                       c.vision_lora, c.speech_lora, opts));
  o_proj = register_module("o_proj", std::make_shared<LoraLinear>(t.q_size(), t.hidden_size,
                                                                   c.vision_lora, c.speech_lora, opts));
}

Tensor Attention::forward(const Tensor& x, const Tensor& cos, const Tensor& sin,
                          const std::vector<int64_t>& cu_seqlens, const AdapterRows& rows, const KvStep* kv,
                          int64_t layer) const {
  const int64_t T = x.size(0), hd = cfg_.head_dim();
  const int64_t nq = cfg_.num_attention_heads, nkv = cfg_.num_key_value_heads;
  Tensor qkv = qkv_proj->forward(x, rows);  // [T, q + 2 kv]: Q rows, then K, then V
  // Q and K heads sit side by side in qkv and share the token's angles: one
  // rotary pass over both.
  Tensor qk = rotary_embedding(qkv.narrow(1, 0, (nq + nkv) * hd).reshape({T, nq + nkv, hd}), cos, sin);
  Tensor q = qk.narrow(1, 0, nq), k = qk.narrow(1, nq, nkv);
  Tensor v = qkv.narrow(1, (nq + nkv) * hd, nkv * hd).reshape({T, nkv, hd});
  // One causal attention per sequence: rows of different sequences never see
  // each other. With a KV step, a sequence's keys are its cached history
  // followed by its chunk, read back from the cache after the chunk is written.
  std::vector<Tensor> outs;
  const size_t S = cu_seqlens.size() - 1;
  for (size_t s = 0; s < S; ++s) {
    const int64_t b = cu_seqlens[s], len = cu_seqlens[s + 1] - b;
    if (kv) {
      kv->cache->write(layer, *kv->blocks[s], kv->start[s], k.narrow(0, b, len), v.narrow(0, b, len));
      auto [kc, vc] = kv->cache->gather(layer, kv->history[s]);  // [start + len, NKV, D]
      outs.push_back(causal_attention(q.narrow(0, b, len), kc, vc));
    } else if (S == 1) {
      outs.push_back(causal_attention(q, k, v));
    } else {
      outs.push_back(causal_attention(q.narrow(0, b, len), k.narrow(0, b, len), v.narrow(0, b, len)));
    }
  }
  Tensor o = outs.size() == 1 ? outs[0] : cat(outs, 0);
  return o_proj->forward(o, rows);
}

// ---- MLP ----

Mlp::Mlp(const Config& c, TensorOptions opts) : Module("Mlp"), intermediate_(c.text.intermediate_size) {
  const TextConfig& t = c.text;
  gate_up_proj = register_module("gate_up_proj",
                                 std::make_shared<LoraLinear>(t.hidden_size, 2 * t.intermediate_size,
                                                              c.vision_lora, c.speech_lora, opts));
  down_proj = register_module("down_proj", std::make_shared<LoraLinear>(t.intermediate_size, t.hidden_size,
                                                                         c.vision_lora, c.speech_lora, opts));
}

Tensor Mlp::forward(const Tensor& x, const AdapterRows& rows) const {
  Tensor gu = gate_up_proj->forward(x, rows);  // [T, 2I]
  return down_proj->forward(silu_and_mul(gu), rows);  // up * silu(gate), gu = [gate | up]
}

// ---- DecoderLayer ----

DecoderLayer::DecoderLayer(const Config& c, int64_t index, TensorOptions opts)
    : Module("DecoderLayer"), eps_(c.text.rms_norm_eps), index_(index) {
  const int64_t H = c.text.hidden_size;
  self_attn = register_module("self_attn", std::make_shared<Attention>(c, opts));
  mlp = register_module("mlp", std::make_shared<Mlp>(c, opts));
  const uint64_t base = uint64_t(index) * 4;
  self_attn->qkv_proj->salt = base, self_attn->o_proj->salt = base + 1;
  mlp->gate_up_proj->salt = base + 2, mlp->down_proj->salt = base + 3;
  input_layernorm = register_module("input_layernorm", std::make_shared<Weight>("RMSNorm", Shape{H}, opts));
  post_attention_layernorm =
      register_module("post_attention_layernorm", std::make_shared<Weight>("RMSNorm", Shape{H}, opts));
}

Tensor DecoderLayer::forward(const Tensor& h, const Tensor& cos, const Tensor& sin,
                             const std::vector<int64_t>& cu_seqlens, const AdapterRows& rows, const KvStep* kv) const {
  Tensor attn = self_attn->forward(rms_norm(h, input_layernorm->weight, eps_), cos, sin, cu_seqlens, rows, kv, index_);
  // The residual add and the MLP's norm in one pass (the bits of add, then rms_norm).
  auto [x, xn] = add_rms_norm(h, attn, post_attention_layernorm->weight, eps_);
  return add(x, mlp->forward(xn, rows));
}

// ---- TextModel ----

MediaEmbed::MediaEmbed(const Config& c, const ModelParts& parts, TensorOptions opts)
    : Module("Phi4MMImageAudioEmbedding") {
  if (parts.vision) image_embed = register_module("image_embed", std::make_shared<ImageEmbed>(c.vision, opts));
  if (parts.audio) audio_embed = register_module("audio_embed", std::make_shared<AudioEmbed>(c.audio, opts));
}

TextModel::TextModel(const Config& c, const ModelParts& parts, TensorOptions opts) : Module("Phi4MMModel") {
  const TextConfig& t = c.text;
  embed_tokens = register_module("embed_tokens",
                                 std::make_shared<Weight>("Embedding", Shape{t.vocab_size, t.hidden_size}, opts));
  layers = register_module("layers", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < t.num_hidden_layers; ++i) layers->push_back(std::make_shared<DecoderLayer>(c, i, opts));
  norm = register_module("norm", std::make_shared<Weight>("RMSNorm", Shape{t.hidden_size}, opts));
  // Registered last: the towers' tensors follow the language model's in saved shards.
  if (parts.vision || parts.audio)
    embed_tokens_extend = register_module("embed_tokens_extend", std::make_shared<MediaEmbed>(c, parts, opts));
}

// ---- PackedBatch ----

PackedBatch PackedBatch::single(const std::vector<int64_t>& ids, Adapter a, RopeTable r) {
  PackedBatch b;
  b.token_ids = from_vector(ids, {int64_t(ids.size())});
  b.cu_seqlens = {0, int64_t(ids.size())};
  b.adapters = {a};
  b.rope = {r};
  return b;
}

PackedBatch PackedBatch::pack(const std::vector<std::vector<int64_t>>& seqs,
                              const std::vector<Adapter>& adapters) {
  PackedBatch b;
  std::vector<int64_t> all;
  b.cu_seqlens = {0};
  for (auto& s : seqs) {
    all.insert(all.end(), s.begin(), s.end());
    b.cu_seqlens.push_back(int64_t(all.size()));
  }
  b.token_ids = from_vector(all, {int64_t(all.size())});
  b.adapters = adapters;
  return b;
}

// ---- Phi4MMForCausalLM ----

Phi4MMForCausalLM::Phi4MMForCausalLM(const Config& c, TensorOptions opts, const ModelParts& parts)
    : Module("Phi4MMForCausalLM"), cfg_(c) {
  if (!parts.lora) {
    cfg_.vision_lora.reset();
    cfg_.speech_lora.reset();
  }
  model = register_module("model", std::make_shared<TextModel>(cfg_, parts, opts));
  if (cfg_.user_lora)
    for (const auto& nl : user_lora_linears(*cfg_.user_lora)) nl.second->add_user(*cfg_.user_lora, opts);
  eval();  // no dropout unless a trainer switches a part to training mode
}

std::vector<std::pair<std::string, LoraLinear*>> Phi4MMForCausalLM::user_lora_linears(const LoraConfig& cfg) const {
  auto wants = [&](const char* name) { return std::find(cfg.targets.begin(), cfg.targets.end(), name) != cfg.targets.end(); };
  std::vector<std::pair<std::string, LoraLinear*>> out;
  for (size_t i = 0; i < model->layers->size(); ++i) {
    auto layer = model->layers->at<DecoderLayer>(i);
    const std::string p = fmt::format("model.layers.{}.", i);
    if (wants("qkv_proj")) out.emplace_back(p + "self_attn.qkv_proj", layer->self_attn->qkv_proj.get());
    if (wants("o_proj")) out.emplace_back(p + "self_attn.o_proj", layer->self_attn->o_proj.get());
    if (wants("gate_up_proj")) out.emplace_back(p + "mlp.gate_up_proj", layer->mlp->gate_up_proj.get());
    if (wants("down_proj")) out.emplace_back(p + "mlp.down_proj", layer->mlp->down_proj.get());
  }
  return out;
}

int32_t Phi4MMForCausalLM::add_served_lora(
    const std::string& name, const std::string& source, const LoraConfig& cfg,
    const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& fill) {
  if (name.empty()) throw std::invalid_argument("a served LoRA needs a name");
  for (const ServedLora& s : served_)
    if (s.name == name && !s.removed)
      throw std::invalid_argument(fmt::format("a served LoRA is named '{}' already", name));
  check_user_lora(cfg, fmt::format("served LoRA '{}'", name));
  const TensorOptions opts(dtype(), device());
  const auto linears = user_lora_linears(cfg);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [path, l] : linears) {
    tensors.emplace_back(path + ".lora_A.weight", zeros({cfg.r, l->in_features}, opts));
    tensors.emplace_back(path + ".lora_B.weight", zeros({l->out_features, cfg.r}, opts));
  }
  std::vector<Shape> shapes;
  for (const auto& nt : tensors) shapes.push_back(nt.second.shape());
  fill(tensors);  // may throw: nothing is attached yet
  for (size_t i = 0; i < tensors.size(); ++i)
    if (!tensors[i].second.defined() || tensors[i].second.shape() != shapes[i])
      throw std::invalid_argument(fmt::format("served LoRA '{}': {} is not {}", name, tensors[i].first, shape_str(shapes[i])));
  static std::atomic<uint64_t> next_uid{1};
  size_t slot = 0;  // the first number an unloaded adapter left, else a new one
  while (slot < served_.size() && !served_[slot].removed) ++slot;
  const int32_t number = int32_t(slot + 1);
  clear_served(number);  // every linear gets an entry, so the numbers stay aligned
  for (size_t t = 0; t < linears.size(); ++t)
    linears[t].second->set_served(number, tensors[2 * t].second, tensors[2 * t + 1].second, cfg.scaling());
  ServedLora l{name, source, cfg, next_uid++, number};
  if (slot < served_.size()) served_[slot] = std::move(l);
  else served_.push_back(std::move(l));
  return number;
}

void Phi4MMForCausalLM::remove_served_lora(int32_t number) {
  if (number < 1 || size_t(number) > served_.size() || served_[size_t(number - 1)].removed)
    throw std::out_of_range(fmt::format("no served LoRA number {}", number));
  clear_served(number);
  served_[size_t(number - 1)].removed = true;
}

void Phi4MMForCausalLM::clear_served(int32_t number) {
  LoraConfig every;
  every.targets = kLoraTargets;
  for (const auto& nl : user_lora_linears(every)) nl.second->set_served(number, {}, {}, 0.0);
}

void Phi4MMForCausalLM::add_user_lora(const LoraConfig& cfg, uint64_t seed) {
  if (cfg_.user_lora)
    throw std::invalid_argument(fmt::format("the model has a user LoRA already (rank {}); train it as it is, or "
                                            "start from a checkpoint without one", cfg_.user_lora->r));
  check_user_lora(cfg, "user LoRA");
  if (is_quantized())
    throw std::invalid_argument("a user LoRA needs an unquantized model (--quantize int8 is for inference)");
  const TensorOptions opts(dtype(), device());
  Generator g(seed);
  for (const auto& [path, l] : user_lora_linears(cfg)) {
    l->add_user(cfg, opts);
    l->init_user(g);
    l->train(l->is_training());  // the new children follow their linear's mode
  }
  cfg_.user_lora = cfg;
}

void Phi4MMForCausalLM::set_dynamic_hd(int64_t n) {
  if (n < 1 || n > kMaxDynamicHd)
    throw std::invalid_argument(fmt::format("dynamic_hd: must be an integer from 1 to {} (got {})", kMaxDynamicHd, n));
  cfg_.vision.dynamic_hd = n;
}

std::shared_ptr<ImageEmbed> Phi4MMForCausalLM::image_embed() const {
  return model->embed_tokens_extend ? model->embed_tokens_extend->image_embed : nullptr;
}

std::shared_ptr<AudioEmbed> Phi4MMForCausalLM::audio_embed() const {
  return model->embed_tokens_extend ? model->embed_tokens_extend->audio_embed : nullptr;
}

DType Phi4MMForCausalLM::dtype() const { return model->embed_tokens->weight.dtype(); }
Device Phi4MMForCausalLM::device() const { return model->embed_tokens->weight.device(); }

bool Phi4MMForCausalLM::is_quantized() const { return model->embed_tokens->int8 != nullptr; }

std::vector<std::pair<std::string, Weight*>> Phi4MMForCausalLM::quantizable_weights() {
  std::vector<std::pair<std::string, Weight*>> out{{"model.embed_tokens", model->embed_tokens.get()}};
  for (size_t i = 0; i < model->layers->size(); ++i) {
    auto layer = model->layers->at<DecoderLayer>(i);
    const std::string p = fmt::format("model.layers.{}.", i);
    out.emplace_back(p + "self_attn.qkv_proj.base_layer", layer->self_attn->qkv_proj->base_layer.get());
    out.emplace_back(p + "self_attn.o_proj.base_layer", layer->self_attn->o_proj->base_layer.get());
    out.emplace_back(p + "mlp.gate_up_proj.base_layer", layer->mlp->gate_up_proj->base_layer.get());
    out.emplace_back(p + "mlp.down_proj.base_layer", layer->mlp->down_proj->base_layer.get());
  }
  return out;
}

void quantize_model(Phi4MMForCausalLM& m, Quantize q) {
  if (q == Quantize::none) return;
  if (!m.device().is_cpu())
    throw std::invalid_argument(fmt::format("--quantize int8 runs on the CPU only for now; the model is on {}",
                                            m.device().str()));
  if (m.dtype() != DType::f32 && m.dtype() != DType::bf16)
    throw std::invalid_argument(fmt::format("--quantize int8 needs an f32 or bf16 model, not {}", dtype_name(m.dtype())));
  NoGradGuard ng;
  for (auto& [name, w] : m.quantizable_weights())
    if (!w->int8) w->set_int8(quantize_int8(w->weight, m.dtype()));
}

bool Phi4MMForCausalLM::has_adapter(Adapter a) const {
  if (a == Adapter::none) return true;
  return a == Adapter::vision ? cfg_.vision_lora.has_value() : cfg_.speech_lora.has_value();
}

namespace {

// [T] position of every row: b.positions, or 0..len-1 in each sequence.
std::vector<int64_t> batch_positions(const PackedBatch& b) {
  const int64_t T = b.token_ids.size(0);
  if (b.positions.defined()) return b.positions.to(Device::cpu(), DType::i64).to_vector<int64_t>();
  std::vector<int64_t> pos(static_cast<size_t>(T));
  for (size_t s = 0; s + 1 < b.cu_seqlens.size(); ++s)
    for (int64_t i = b.cu_seqlens[s]; i < b.cu_seqlens[s + 1]; ++i) pos[size_t(i)] = i - b.cu_seqlens[s];
  return pos;
}

}  // namespace

void Phi4MMForCausalLM::check_batch(const PackedBatch& b) const {
  if (!b.token_ids.defined() || b.token_ids.dim() != 1 || !is_integral(b.token_ids.dtype()))
    throw std::invalid_argument("PackedBatch: token_ids must be a 1-D integer tensor");
  const int64_t T = b.token_ids.size(0);
  const auto& cu = b.cu_seqlens;
  if (cu.size() < 2 || cu.front() != 0 || cu.back() != T)
    throw std::invalid_argument(fmt::format(
        "PackedBatch: cu_seqlens must start at 0 and end at the token count {}", T));
  for (size_t i = 1; i < cu.size(); ++i)
    if (cu[i] <= cu[i - 1])
      throw std::invalid_argument("PackedBatch: cu_seqlens must be strictly increasing (no empty sequence)");
  const size_t S = cu.size() - 1;
  if (!b.adapters.empty() && b.adapters.size() != S)
    throw std::invalid_argument(fmt::format("PackedBatch: {} adapters for {} sequences", b.adapters.size(), S));
  if (!b.rope.empty() && b.rope.size() != S)
    throw std::invalid_argument(fmt::format("PackedBatch: {} rope tables for {} sequences", b.rope.size(), S));
  for (Adapter a : b.adapters)
    if (!has_adapter(a))
      throw std::invalid_argument(
          fmt::format("PackedBatch: the model was loaded without the {} adapter", adapter_name(a)));
  if (!b.served_lora.empty() && b.served_lora.size() != S)
    throw std::invalid_argument(fmt::format("PackedBatch: {} served LoRAs for {} sequences", b.served_lora.size(), S));
  for (int32_t j : b.served_lora)
    if (j < 0 || size_t(j) > served_.size() || (j > 0 && served_[size_t(j - 1)].removed))
      throw std::invalid_argument(fmt::format("PackedBatch: served LoRA {} of {}{}", j, served_.size(),
                                              j > 0 && size_t(j) <= served_.size() ? " was unloaded" : ""));
  if (b.positions.defined() && (b.positions.dim() != 1 || b.positions.size(0) != T))
    throw std::invalid_argument("PackedBatch: positions must be [T]");
  const std::vector<int64_t> pos = batch_positions(b);
  for (size_t s = 0; s < S; ++s) {
    int64_t last = 0;
    for (int64_t i = cu[s]; i < cu[s + 1]; ++i) last = std::max(last, pos[size_t(i)]);
    if (last >= cfg_.text.max_position_embeddings)
      throw std::invalid_argument(fmt::format("sequence {} reaches position {} but max_position_embeddings is {}",
                                              s, last, cfg_.text.max_position_embeddings));
  }
  if (b.media_rows.defined()) {
    if (b.media_rows.dim() != 2 || b.media_rows.size(1) != cfg_.text.hidden_size)
      throw std::invalid_argument(
          fmt::format("PackedBatch: media_rows must be [M, {}]", cfg_.text.hidden_size));
    int64_t marked = 0;
    for (int64_t id : b.token_ids.to(Device::cpu(), DType::i64).to_vector<int64_t>()) marked += is_media_token(id);
    if (marked != b.media_rows.size(0))
      throw std::invalid_argument(fmt::format(
          "PackedBatch: the tokens hold {} media placeholders but media_rows has {} rows; with a KV cache, slice "
          "each request's media rows to the placeholders inside this step's chunks",
          marked, b.media_rows.size(0)));
  }
  if (b.kv) {
    const KvStep& kv = *b.kv;
    if (!kv.cache || kv.blocks.size() != S || kv.start.size() != S || kv.history.size() != S)
      throw std::invalid_argument(fmt::format("PackedBatch: the KV step must describe all {} sequences", S));
  }
}

bool Phi4MMForCausalLM::uses_long_table(int64_t last_position, RopeTable r) const {
  if (r == RopeTable::long_table) return true;
  if (r == RopeTable::short_table) return false;
  return last_position + 1 > cfg_.text.original_max_position_embeddings;
}

std::pair<Tensor, Tensor> Phi4MMForCausalLM::rope_tables(const PackedBatch& b) const {
  const TextConfig& t = cfg_.text;
  const int64_t T = b.token_ids.size(0), R = t.rotary_dim(), F = R / 2;
  const std::vector<int64_t> pos = batch_positions(b);
  // inv_freq in float32 exactly as the reference: 1 / (factor * theta^(2j/R)).
  auto inv_freq = [&](const std::vector<double>& factor) {
    std::vector<float> f(static_cast<size_t>(F));
    for (int64_t j = 0; j < F; ++j) {
      float e = float(2 * j) / float(R);
      f[size_t(j)] = 1.0f / (float(factor[size_t(j)]) * std::pow(float(t.rope_theta), e));
    }
    return f;
  };
  const std::vector<float> short_f = inv_freq(t.short_factor), long_f = inv_freq(t.long_factor);
  const float m = float(t.rope_mscale());
  std::vector<float> c(static_cast<size_t>(T * R)), s(static_cast<size_t>(T * R));
  for (size_t q = 0; q + 1 < b.cu_seqlens.size(); ++q) {
    const int64_t b0 = b.cu_seqlens[q], b1 = b.cu_seqlens[q + 1];
    int64_t last = 0;
    for (int64_t i = b0; i < b1; ++i) last = std::max(last, pos[size_t(i)]);
    const RopeTable r = b.rope.empty() ? RopeTable::automatic : b.rope[q];
    const std::vector<float>& f = uses_long_table(last, r) ? long_f : short_f;  // check_batch bounds `last`
    for (int64_t i = b0; i < b1; ++i) {
      const float p = float(pos[size_t(i)]);
      for (int64_t j = 0; j < F; ++j) {
        const float th = p * f[size_t(j)];
        const float cv = std::cos(th) * m, sv = std::sin(th) * m;
        c[size_t(i * R + j)] = c[size_t(i * R + j + F)] = cv;
        s[size_t(i * R + j)] = s[size_t(i * R + j + F)] = sv;
      }
    }
  }
  TensorOptions o(dtype(), device());
  return {from_vector(c, {T, 1, R}, o), from_vector(s, {T, 1, R}, o)};
}

AdapterRows Phi4MMForCausalLM::adapter_rows(const PackedBatch& b) const {
  const size_t S = b.cu_seqlens.size() - 1;
  // The rows of the sequences `uses` picks: all, or their indices and runs.
  auto rows_of = [&](const std::function<bool(size_t)>& uses) {
    AdapterRows::Served set;
    std::vector<int64_t> rows;
    for (size_t s = 0; s < S; ++s) {
      if (!uses(s)) continue;
      const int64_t first = b.cu_seqlens[s], n = b.cu_seqlens[s + 1] - first;
      for (int64_t i = first; i < first + n; ++i) rows.push_back(i);
      if (!set.runs.empty() && set.runs.back().first + set.runs.back().second == first) set.runs.back().second += n;
      else set.runs.emplace_back(first, n);
    }
    if (int64_t(rows.size()) == b.cu_seqlens.back()) set.all = true;
    else if (!rows.empty()) set.rows = from_vector(rows, {int64_t(rows.size())}, TensorOptions(DType::i64, device()));
    return set;
  };
  AdapterRows ar;
  if (!b.adapters.empty())
    for (Adapter a : {Adapter::vision, Adapter::speech}) {
      AdapterRows::Served set = rows_of([&](size_t s) { return b.adapters[s] == a; });
      ar.all[int(a)] = set.all;
      ar.rows[int(a)] = set.rows;
    }
  if (!b.served_lora.empty())
    for (size_t j = 1; j <= served_.size(); ++j)
      ar.served.push_back(rows_of([&](size_t s) { return b.served_lora[s] == int32_t(j); }));
  return ar;
}

Tensor Phi4MMForCausalLM::decoder(const PackedBatch& b) const {
  check_batch(b);
  auto [cos, sin] = rope_tables(b);
  AdapterRows rows = adapter_rows(b);
  Tensor h;
  if (b.media_rows.defined()) {
    // Placeholder rows look up id 0 (the vocabulary may be smaller than the
    // placeholder ids) and are then replaced by the media rows, in order.
    std::vector<int64_t> ids = b.token_ids.to(Device::cpu(), DType::i64).to_vector<int64_t>();
    std::vector<int64_t> mask(ids.size());
    for (size_t i = 0; i < ids.size(); ++i)
      if ((mask[i] = is_media_token(ids[i]))) ids[i] = 0;
    const int64_t T = int64_t(ids.size());
    h = model->embed_tokens->rows(from_vector(ids, {T}, TensorOptions(DType::i64, device())));
    Tensor m = from_vector(mask, {T}).to(device(), DType::boolean).unsqueeze(1).expand({-1, h.size(1)});
    h = masked_scatter(h, m.contiguous(), b.media_rows.to(device(), dtype()));
  } else {
    h = model->embed_tokens->rows(b.token_ids.to(device()));  // [T, H]
  }
  rows.dropout_seed = b.dropout_seed;
  const bool recompute = b.recompute_layers && !b.kv && grad_enabled();
  for (size_t i = 0; i < model->layers->size(); ++i) {
    std::shared_ptr<DecoderLayer> layer = model->layers->at<DecoderLayer>(i);
    if (!recompute) {
      h = layer->forward(h, cos, sin, b.cu_seqlens, rows, b.kv);
      continue;
    }
    // Only the layer's input is kept; backward runs the layer again.
    // (copies of the bindings: clang 14 cannot capture structured bindings)
    h = checkpoint([layer, c = cos, s = sin, cu = b.cu_seqlens, rows](const std::vector<Tensor>& in) {
      return layer->forward(in[0], c, s, cu, rows, nullptr);
    }, {h});
  }
  return h;
}

Tensor Phi4MMForCausalLM::hidden_states(const PackedBatch& b) const {
  return rms_norm(decoder(b), model->norm->weight, cfg_.text.rms_norm_eps);
}

Tensor Phi4MMForCausalLM::logits(const PackedBatch& b) const {
  return model->embed_tokens->linear(hidden_states(b));  // tied head
}

Tensor Phi4MMForCausalLM::logits_at(const PackedBatch& b, const std::vector<int64_t>& rows) const {
  // The final norm and the head only for the rows asked for (the vocabulary is 200k wide).
  Tensor idx = from_vector(rows, {int64_t(rows.size())}, TensorOptions(DType::i64, device()));
  Tensor h = index_select(decoder(b), 0, idx);
  return model->embed_tokens->linear(rms_norm(h, model->norm->weight, cfg_.text.rms_norm_eps));
}

Tensor Phi4MMForCausalLM::token_logprobs(const PackedBatch& b, const Tensor& targets) const {
  const int64_t T = b.token_ids.size(0);
  if (!targets.defined() || targets.dim() != 1 || targets.size(0) != T)
    throw std::invalid_argument(fmt::format("token_logprobs: targets must be [{}]", T));
  Tensor tg = targets.to(device(), DType::i64);
  Tensor lp = log_softmax(logits(b).to(DType::f32), -1);  // [T, V]
  Tensor invalid = lt(tg, scalar_tensor(0, TensorOptions(DType::i64, device())));
  Tensor picked = gather(lp, 1, masked_fill(tg, invalid, 0.0).unsqueeze(1)).squeeze(1);
  return masked_fill(picked, invalid, 0.0);
}

// ---- the forward with a KV cache ----

void IncrementalBatch::add(KvSequence& s, const std::vector<int64_t>& ids, Adapter a, RopeTable r, int32_t served) {
  token_ids.insert(token_ids.end(), ids.begin(), ids.end());
  cu_seqlens.push_back(int64_t(token_ids.size()));
  seqs.push_back(&s);
  adapters.push_back(a);
  rope.push_back(r);
  served_lora.push_back(served);
}

namespace {

const char* table_name(RopeTable r) {
  switch (r) {
    case RopeTable::automatic: return "automatic";
    case RopeTable::short_table: return "short";
    case RopeTable::long_table: return "long";
  }
  return "?";
}

// What the packed batch cannot check: the sequences, the cache and the rows asked for.
void check_incremental(const Phi4MMForCausalLM& m, const PagedKvCache& cache, const IncrementalBatch& b) {
  const size_t S = b.seqs.size();
  if (S == 0) throw std::invalid_argument("IncrementalBatch: no sequence");
  if (b.cu_seqlens.size() != S + 1)
    throw std::invalid_argument(fmt::format("IncrementalBatch: cu_seqlens must have {} entries", S + 1));
  std::set<const KvSequence*> distinct;
  for (const KvSequence* s : b.seqs) {
    if (!s) throw std::invalid_argument("IncrementalBatch: null sequence");
    if (!distinct.insert(s).second)
      throw std::invalid_argument("IncrementalBatch: a sequence appears twice in one step");
    if (s->length < 0 || cache.blocks_for(s->length) > int64_t(s->blocks.size()))
      throw std::invalid_argument(fmt::format("IncrementalBatch: a sequence of length {} has only {} blocks",
                                              s->length, s->blocks.size()));
  }
  const int64_t T = int64_t(b.token_ids.size());
  for (int64_t r : b.logit_rows)
    if (r < 0 || r >= T)
      throw std::invalid_argument(fmt::format("IncrementalBatch: logit row {} outside the {} new tokens", r, T));
  const TextConfig& t = m.config().text;
  if (cache.num_layers() != t.num_hidden_layers || cache.keys(0).dtype() != m.dtype() ||
      cache.keys(0).device() != m.device() || cache.keys(0).size(2) != t.num_key_value_heads ||
      cache.keys(0).size(3) != t.head_dim())
    throw std::invalid_argument("forward_incremental: the KV cache was built for another model, dtype or device");
}

// The table each sequence's new keys are rotated with (see IncrementalBatch::rope).
RopeTable resolve_table(const Phi4MMForCausalLM& m, const KvSequence& s, RopeTable want, int64_t last, size_t i) {
  if (s.length == 0) return want == RopeTable::automatic ? rope_table_for_length(m, last + 1) : want;
  const RopeTable cached = s.rope;
  if (cached == RopeTable::automatic)
    throw std::invalid_argument(fmt::format("IncrementalBatch: sequence {} holds {} cached tokens but no table; "
                                            "was it filled outside forward_incremental?", i, s.length));
  if (want != RopeTable::automatic && want != cached)
    throw std::invalid_argument(fmt::format(
        "IncrementalBatch: sequence {} asks for the {} LongRoPE table but its cached keys use the {} table; "
        "release it and re-prefill", i, table_name(want), table_name(cached)));
  if (want == RopeTable::automatic && needs_reprefill(m, s, last + 1))
    throw std::invalid_argument(fmt::format(
        "IncrementalBatch: sequence {} grows to {} tokens, past original_max_position_embeddings = {}, but its "
        "cached keys use the short LongRoPE table; release it and re-prefill all its tokens with the long table",
        i, last + 1, m.config().text.original_max_position_embeddings));
  return cached;
}

}  // namespace

Tensor forward_incremental(const Phi4MMForCausalLM& m, PagedKvCache& cache, IncrementalBatch& b) {
  check_incremental(m, cache, b);
  NoGradGuard ng;
  const auto& cu = b.cu_seqlens;
  const size_t S = b.seqs.size();
  const int64_t T = int64_t(b.token_ids.size());

  // The packed batch of the chunks: positions continue each sequence's cache.
  PackedBatch pb;
  pb.token_ids = from_vector(b.token_ids, {T});
  pb.cu_seqlens = cu;
  pb.adapters = b.adapters;
  pb.served_lora = b.served_lora;
  pb.media_rows = b.media_rows;
  KvStep kv;
  kv.cache = &cache;
  std::vector<int64_t> positions(static_cast<size_t>(T));
  for (size_t s = 0; s < S; ++s) {
    const int64_t start = b.seqs[s]->length, len = cu[s + 1] - cu[s];
    for (int64_t i = 0; i < len; ++i) positions[size_t(cu[s] + i)] = start + i;
    kv.start.push_back(start);
    kv.blocks.push_back(&b.seqs[s]->blocks);
  }
  pb.positions = from_vector(positions, {T});
  m.check_batch(pb);  // everything is checked before a block is taken
  for (size_t s = 0; s < S; ++s) {
    const RopeTable want = b.rope.empty() ? RopeTable::automatic : b.rope[s];
    pb.rope.push_back(resolve_table(m, *b.seqs[s], want, kv.start[s] + cu[s + 1] - cu[s] - 1, s));
  }

  // Blocks for the new tokens, all or nothing across the step.
  int64_t needed = 0;
  for (size_t s = 0; s < S; ++s)
    needed += std::max<int64_t>(0, cache.blocks_for(kv.start[s] + cu[s + 1] - cu[s]) -
                                       int64_t(b.seqs[s]->blocks.size()));
  if (!cache.manager().can_allocate(needed))
    throw std::runtime_error(fmt::format("KV cache out of blocks: this step needs {} more, {} free of {}", needed,
                                         cache.manager().num_free(), cache.num_blocks()));
  // Slots of each sequence's whole history + chunk, shared by all layers.
  for (size_t s = 0; s < S; ++s) {
    const int64_t total = kv.start[s] + cu[s + 1] - cu[s];
    cache.reserve(*b.seqs[s], total);
    kv.history.push_back(from_vector(cache.slots(b.seqs[s]->blocks, 0, total), {total},
                                     TensorOptions(DType::i64, m.device())));
  }
  pb.kv = &kv;

  std::vector<int64_t> want = b.logit_rows;
  if (want.empty())
    for (size_t s = 0; s < S; ++s) want.push_back(cu[s + 1] - 1);
  Tensor logits = m.logits_at(pb, want);
  for (size_t s = 0; s < S; ++s) {
    b.seqs[s]->length = kv.start[s] + cu[s + 1] - cu[s];
    b.seqs[s]->rope = pb.rope[s];
  }
  return logits;
}

int64_t text_parameter_count(const TextConfig& t) {
  const int64_t H = t.hidden_size, I = t.intermediate_size;
  const int64_t layer = t.qkv_size() * H + H * t.q_size() + 2 * I * H + H * I + 2 * H;
  return t.vocab_size * H + t.num_hidden_layers * layer + H;
}

std::vector<float> score(const Phi4MMForCausalLM& model, const std::vector<int64_t>& prompt,
                         const std::vector<int64_t>& completion, Adapter adapter, const Tensor& media_rows) {
  if (prompt.empty()) throw std::invalid_argument("score: the prompt is empty");
  if (completion.empty()) return {};
  std::vector<int64_t> ids = prompt;
  ids.insert(ids.end(), completion.begin(), completion.end());
  PackedBatch b = PackedBatch::single(ids, adapter);
  int64_t n_media = 0;
  for (int64_t id : prompt) n_media += is_media_token(id);
  if (n_media > 0) {
    if (!media_rows.defined() || media_rows.size(0) != n_media)
      throw std::invalid_argument(fmt::format("score: {} media placeholders need as many media rows", n_media));
    b.media_rows = media_rows;
  }
  std::vector<int64_t> targets(ids.size(), -1);
  for (size_t t = prompt.size() - 1; t + 1 < ids.size(); ++t) targets[t] = ids[t + 1];
  NoGradGuard ng;
  std::vector<float> lp = model.token_logprobs(b, from_vector<int64_t>(targets, {int64_t(targets.size())}))
                              .to(Device::cpu())
                              .to_vector<float>();
  return std::vector<float>(lp.begin() + int64_t(prompt.size()) - 1, lp.end() - 1);
}

}  // namespace areno::phi4mm
