// Every differentiable op passes the central-difference gradient checker
// (autograd/gradcheck, f64 on the CPU) on small random inputs. One line per
// op; floating inputs require grad, index and mask inputs do not.
// ARENO_OP=<substring> runs only the matching entries.
#include <doctest/doctest.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "autograd/gradcheck.h"
#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tests/core/op_harness.h"

using namespace areno;
using namespace areno::testing;

namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

struct GradCase {
  std::string name;
  std::vector<In> inputs;
  Fn fn;
  // Looser settings for functions that round through a 16/32-bit dtype: the
  // step must dwarf the rounding, and the bound must allow it.
  double eps = 1e-6, atol = 1e-6, rtol = 1e-4;
};

#define F(expr) [](const std::vector<Tensor>& x) -> Tensor { return expr; }

Tensor attention(const std::vector<Tensor>& x, bool causal, int bias_at, int mask_at) {
  AttentionOptions o;
  o.causal = causal;
  if (bias_at >= 0) o.bias = x[size_t(bias_at)];
  if (mask_at >= 0)  // key 0 stays visible so that no row is fully masked
    o.key_padding_mask =
        cat({zeros({x[size_t(mask_at)].size(0), 1}, DType::boolean),
             x[size_t(mask_at)].narrow(1, 1, x[size_t(mask_at)].size(1) - 1)}, 1);
  return scaled_dot_product_attention(x[0], x[1], x[2], o);
}

std::vector<GradCase> grad_table() {
  return {
      // ---- elementwise (with broadcasting) ----
      {"add", {In({3, 4}), In({4})}, F(add(x[0], x[1]))},
      {"sub", {In({3, 1}), In({2, 1, 4})}, F(sub(x[0], x[1]))},
      {"mul", {In({3, 4}), In({3, 1})}, F(mul(x[0], x[1]))},
      {"div", {In({3, 4}), pos({4})}, F(div(x[0], x[1]))},
      {"pow", {pos({3, 4}), In({3, 4})}, F(pow(x[0], x[1]))},
      {"pow_scalar", {pos({3, 4})}, F(pow(x[0], 2.5))},
      {"maximum", {In({3, 4}), In({4})}, F(maximum(x[0], x[1]))},
      {"minimum", {In({3, 4}), In({3, 4})}, F(minimum(x[0], x[1]))},
      {"add_scaled", {In({3, 4}), In({3, 4})}, F(add_scaled(x[0], x[1], -0.7))},
      {"add_mul_scalar", {In({5})}, F(mul(add(x[0], 1.5), -2.0))},
      {"where", {mask({3, 4}), In({3, 4}), In({4})}, F(where(x[0], x[1], x[2]))},
      {"cast_f32_roundtrip", {In({6})}, F(mul(cast(cast(x[0], DType::f32), DType::f64), 2.0)), 1e-2, 1e-4, 1e-3},
      {"add_promoted_f32", {In({2, 3}), In({3})}, F(cast(add(cast(x[0], DType::f32), x[1]), DType::f64)), 1e-2, 1e-4, 1e-3},
      {"masked_fill", {In({3, 4}), mask({3, 4})}, F(masked_fill(x[0], x[1], 2.0))},
      {"neg", {In({6})}, F(neg(x[0]))},
      {"exp", {In({6})}, F(exp(x[0]))},
      {"log", {pos({6})}, F(log(x[0]))},
      {"sqrt", {pos({6})}, F(sqrt(x[0]))},
      {"rsqrt", {pos({6})}, F(rsqrt(x[0]))},
      {"abs", {In({6})}, F(abs(x[0]))},
      {"sin", {In({6})}, F(sin(x[0]))},
      {"cos", {In({6})}, F(cos(x[0]))},
      {"square", {In({6})}, F(square(x[0]))},
      {"reciprocal", {pos({6})}, F(reciprocal(x[0]))},
      {"clamp", {In({12})}, F(clamp(x[0], -0.5, 0.5))},
      {"relu", {In({12})}, F(relu(x[0]))},
      {"silu", {In({12})}, F(silu(x[0]))},
      {"sigmoid", {In({12})}, F(sigmoid(x[0]))},
      {"tanh", {In({12})}, F(tanh(x[0]))},
      {"gelu", {In({12})}, F(gelu(x[0]))},
      {"gelu_tanh", {In({12})}, F(gelu_tanh(x[0]))},
      {"silu_and_mul", {In({3, 10})}, F(silu_and_mul(x[0]))},
      {"silu_and_mul_slice", {In({2, 9})}, F(silu_and_mul(x[0].narrow(1, 1, 8)))},

      // ---- reductions and rows ----
      {"sum_dims", {In({2, 3, 4})}, F(sum(x[0], {0, 2}))},
      {"sum_all", {In({2, 3})}, F(sum(x[0]))},
      {"sum_squares", {In({2, 3})}, F(sum_squares(x[0]))},
      {"mean_keepdim", {In({2, 3, 4})}, F(mean(x[0], {1}, true))},
      {"var", {In({3, 5})}, F(var(x[0], {-1}))},
      {"var_all_population", {In({3, 5})}, F(var(x[0], {}, 0))},
      {"max_dim", {In({3, 5})}, F(max(x[0], 1))},
      {"min_dim_keepdim", {In({3, 5})}, F(min(x[0], 0, true))},
      {"max_all", {In({3, 5})}, F(max(x[0]))},
      {"softmax", {In({3, 5})}, F(softmax(x[0], -1))},
      {"softmax_dim0", {In({3, 5})}, F(softmax(x[0], 0))},
      {"log_softmax", {In({3, 5})}, F(log_softmax(x[0], -1))},
      {"cumsum", {In({3, 5})}, F(cumsum(x[0], 1))},
      {"topk_values", {In({3, 6})}, F(topk(x[0], 2, -1).first)},
      {"sort_values", {In({3, 6})}, F(sort(x[0], -1, true).first)},
      {"sum_to", {In({2, 3, 4})}, F(sum_to(x[0], Shape{3, 1}))},

      // ---- views ----
      {"narrow", {In({4, 5})}, F(x[0].narrow(1, 1, 3))},
      {"slice_step", {In({4, 7})}, F(x[0].slice(1, 0, 7, 3))},
      {"select", {In({3, 4})}, F(x[0].select(0, 1))},
      {"permute", {In({2, 3, 4})}, F(x[0].permute({2, 0, 1}))},
      {"transpose", {In({3, 4})}, F(x[0].t())},
      {"expand", {In({3, 1})}, F(x[0].expand({2, 3, 4}))},
      {"reshape_of_transpose", {In({3, 4})}, F(x[0].t().reshape({2, 6}))},
      {"view", {In({3, 4})}, F(x[0].view({4, -1}))},
      {"squeeze_unsqueeze", {In({3, 1, 2})}, F(x[0].squeeze(1).unsqueeze(0))},
      {"flatten_unflatten", {In({2, 3, 4})}, F(x[0].flatten(1).unflatten(0, {1, 2}))},
      {"contiguous_of_view", {In({3, 4})}, F(x[0].t().contiguous())},
      {"view_chain_mul", {In({3, 4})}, F(mul(x[0].t().narrow(0, 1, 2), x[0].t().narrow(0, 0, 2)))},

      // ---- shape ops ----
      {"cat", {In({2, 3}), In({1, 3}), In({4, 3})}, F(cat({x[0], x[1], x[2]}, 0))},
      {"cat_last", {In({2, 3}), In({2, 1})}, F(cat({x[0], x[1]}, -1))},
      {"stack", {In({2, 3}), In({2, 3})}, F(stack({x[0], x[1]}, 1))},
      {"split", {In({7, 2})}, F(split(x[0], 3, 0).at(2))},
      {"split_sizes", {In({2, 6})}, F(mul(split_sizes(x[0], {1, 2, 3}, 1).at(1), 3.0))},
      {"chunk", {In({6, 2})}, F(chunk(x[0], 3, 0).at(1))},
      {"pad", {In({2, 3})}, F(pad(x[0], {1, 2, 0, 1}, 0.5))},

      // ---- indexing ----
      {"gather", {In({4, 3}), idx({5, 3}, 4)}, F(gather(x[0], 0, x[1]))},
      {"index_select", {In({5, 3}), idx({7}, 5)}, F(index_select(x[0], 0, x[1]))},
      {"index_select_dim1", {In({3, 5}), idx({4}, 5)}, F(index_select(x[0], 1, x[1]))},
      {"embedding", {In({6, 3}), idx({2, 4}, 6)}, F(embedding(x[0], x[1]))},
      {"scatter_add", {In({4, 3}), idx({5, 3}, 4), In({5, 3})}, F(scatter_add(x[0], 0, x[1], x[2]))},
      {"scatter", {In({5, 3}), perm({3, 3}, 5), In({3, 3})}, F(scatter(x[0], 0, x[1], x[2]))},
      {"index_add", {In({4, 3}), idx({6}, 4), In({6, 3})}, F(index_add(x[0], 0, x[1], x[2]))},
      {"masked_scatter", {In({3, 4}), mask({3, 4}), In({12})}, F(masked_scatter(x[0], x[1], x[2]))},

      // ---- linear algebra ----
      {"matmul", {In({3, 4}), In({4, 2})}, F(matmul(x[0], x[1]))},
      {"matmul_broadcast_batch", {In({2, 1, 3, 4}), In({3, 4, 2})}, F(matmul(x[0], x[1]))},
      {"matmul_transposed", {In({4, 3}), In({2, 4})}, F(matmul(x[0].t(), x[1].t()))},
      {"matmul_vec", {In({4}), In({2, 4, 3})}, F(matmul(x[0], x[1]))},
      {"linear", {In({2, 3, 4}), In({5, 4}), In({5})}, F(linear(x[0], x[1], x[2]))},
      {"linear_accumulate", {In({3, 2}), In({5, 2}), In({3, 4}), In({5, 4})},
       F(linear_accumulate(linear(x[0], x[1]), x[2], x[3], 0.75))},
      {"lora_linear", {In({3, 4}), In({5, 4}), In({2, 4}), In({5, 2})}, F(lora_linear(x[0], x[1], x[2], x[3], 0.75))},

      // ---- neural network ----
      {"conv1d", {In({2, 3, 7}), In({4, 3, 3}), In({4})}, F(conv1d(x[0], x[1], x[2]))},
      {"conv1d_stride_pad_dil", {In({1, 2, 9}), In({3, 2, 3}), In({3})}, F(conv1d(x[0], x[1], x[2], 2, 2, 2))},
      {"conv1d_groups", {In({1, 4, 6}), In({4, 2, 2})}, F(conv1d(x[0], x[1], Tensor(), 1, 1, 1, 2))},
      {"conv1d_depthwise", {In({2, 3, 6}), In({3, 1, 3}), In({3})}, F(conv1d(x[0], x[1], x[2], 1, 1, 1, 3))},
      {"conv2d", {In({1, 2, 5, 4}), In({3, 2, 3, 2}), In({3})}, F(conv2d(x[0], x[1], x[2]))},
      {"conv2d_stride_pad", {In({2, 2, 5, 5}), In({2, 2, 3, 3}), In({2})},
       F(conv2d(x[0], x[1], x[2], {2, 1}, {1, 1}))},
      {"conv2d_groups", {In({1, 4, 4, 4}), In({4, 2, 2, 2})}, F(conv2d(x[0], x[1], Tensor(), {1, 1}, {0, 1}, {1, 1}, 2))},
      {"conv2d_depthwise_dilated", {In({1, 3, 6, 6}), In({3, 1, 3, 3}), In({3})},
       F(conv2d(x[0], x[1], x[2], {1, 1}, {2, 2}, {2, 2}, 3))},
      {"depthwise_conv2d_nhwc", {In({1, 5, 6, 3}), In({3, 3, 2}), In({3})},
       F(depthwise_conv2d_nhwc(x[0], x[1], x[2], {2, 1}))},
      {"depthwise_conv2d_nhwc_no_bias", {In({2, 4, 1, 2}), In({2, 3, 1})},
       F(depthwise_conv2d_nhwc(x[0], x[1], Tensor()))},
      {"avg_pool2d", {In({1, 2, 4, 6})}, F(avg_pool2d(x[0], {2, 2}))},
      {"avg_pool2d_pad", {In({1, 2, 5, 5})}, F(avg_pool2d(x[0], {3, 3}, {2, 2}, {1, 1}))},
      {"layer_norm", {In({3, 5}), In({5}), In({5})}, F(layer_norm(x[0], x[1], x[2], 1e-5))},
      {"layer_norm_no_bias", {In({2, 2, 4}), In({4})}, F(layer_norm(x[0], x[1], Tensor(), 1e-5))},
      {"rms_norm", {In({3, 5}), In({5})}, F(rms_norm(x[0], x[1], 1e-6))},
      {"add_rms_norm", {In({3, 5}), In({3, 5}), In({5})},
       [](const std::vector<Tensor>& x) {
         auto [s, y] = add_rms_norm(x[0], x[1], x[2], 1e-6);
         return add(y, mul(s, 0.5));
       }},
      {"rotary_embedding_tables", {In({3, 2, 6}), In({3, 4}), In({3, 4})},
       F(rotary_embedding(x[0], x[1], x[2]))},  // tables with gradients: the composed form
      {"rotary_embedding", {In({3, 2, 6})},
       [](const std::vector<Tensor>& x) {
         Generator g(3);
         return rotary_embedding(x[0], rand_normal({3, 1, 4}, g, 0.0, 1.0, TensorOptions(DType::f64)),
                                 rand_normal({3, 1, 4}, g, 0.0, 1.0, TensorOptions(DType::f64)));
       }},
      {"cross_entropy", {In({5, 4}), idx({5}, 4)}, F(cross_entropy(x[0], x[1]))},
      {"cross_entropy_ignore_index", {In({6, 3}), idx({6}, 3)}, F(cross_entropy(x[0], x[1], 1))},
      {"cross_entropy_sum", {In({6, 3}), idx({6}, 3)}, F(cross_entropy(x[0], x[1], 1, "sum"))},
      {"cross_entropy_none", {In({6, 3}), idx({6}, 3)}, F(cross_entropy(x[0], x[1], -100, "none"))},
      {"dropout", {In({4, 5})}, [](const std::vector<Tensor>& x) {
         Generator g(3);  // the same mask on every call
         return dropout(x[0], 0.4, true, g);
       }},
      {"sdpa", {In({1, 2, 3, 4}), In({1, 2, 5, 4}), In({1, 2, 5, 4})},
       [](const std::vector<Tensor>& x) { return attention(x, false, -1, -1); }},
      {"sdpa_causal", {In({1, 2, 4, 3}), In({1, 2, 4, 3}), In({1, 2, 4, 3})},
       [](const std::vector<Tensor>& x) { return attention(x, true, -1, -1); }},
      {"sdpa_gqa_causal", {In({1, 4, 3, 2}), In({1, 2, 5, 2}), In({1, 2, 5, 2})},
       [](const std::vector<Tensor>& x) { return attention(x, true, -1, -1); }},
      {"sdpa_bias", {In({2, 2, 3, 2}), In({2, 1, 4, 2}), In({2, 1, 4, 2}), In({1, 2, 3, 4})},
       [](const std::vector<Tensor>& x) { return attention(x, false, 3, -1); }},
      {"sdpa_key_padding_mask", {In({2, 2, 3, 2}), In({2, 2, 4, 2}), In({2, 2, 4, 2}), mask({2, 4})},
       [](const std::vector<Tensor>& x) { return attention(x, false, -1, 3); }},
  };
}

}  // namespace

TEST_CASE("autograd/every differentiable op passes gradcheck") {
  const char* filter = std::getenv("ARENO_OP");
  int64_t run = 0;
  for (const GradCase& c : grad_table()) {
    if (filter && c.name.find(filter) == std::string::npos) continue;
    std::vector<Tensor> xs;
    try {
      for (size_t i = 0; i < c.inputs.size(); ++i) {
        Tensor x = make_input(c.inputs[i], DType::f64, Device::cpu(),
                              hash_str(c.name) + 7919 * uint64_t(i + 1));
        if (is_floating(x.dtype())) x.set_requires_grad(true);
        xs.push_back(x);
      }
      GradcheckResult r = gradcheck(c.fn, xs, c.eps, c.atol, c.rtol);
      ++run;
      CHECK_MESSAGE(r.ok, c.name << " (" << describe(c.inputs) << "): " << r.message
                                 << " (max abs err " << r.max_abs_err << ", max rel err "
                                 << r.max_rel_err << ")");
    } catch (const std::exception& e) {
      FAIL_CHECK(c.name << " (" << describe(c.inputs) << ") threw: " << std::string(e.what()));
    }
  }
  MESSAGE("gradchecks run: " << run);
  CHECK(run > 0);
}
