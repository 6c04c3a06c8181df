// Independent references: the f64 CPU ops against naive loops written here
// from the definitions (llm.c style), so the reference of test_ops.cpp is not
// only checked against itself.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "tensor/autograd.h"
#include "tensor/ops.h"
#include "tests/core/op_harness.h"
#include "tests/test_util.h"

using namespace areno;
using namespace areno::testing;

namespace {

Tensor rnd(Shape s, uint64_t seed, Kind k = Kind::normal, int64_t hi = 0) {
  return make_input(In(std::move(s), k, View::contig, hi), DType::f64, Device::cpu(), seed);
}
Tensor as_tensor(const std::vector<double>& v, Shape s) { return from_vector<double>(v, std::move(s), DType::f64); }

void check_close(const Tensor& got, const std::vector<double>& want, const Shape& shape,
                 double tol = 1e-10) {
  Mismatch m = compare(got, as_tensor(want, shape), tol);
  CHECK_MESSAGE(m.ok, m.message);
}

// y[b, m, n] = sum_k a[b, m, k] b[b, k, n]
std::vector<double> naive_matmul(const std::vector<double>& a, const std::vector<double>& b,
                                 int64_t B, int64_t M, int64_t K, int64_t N) {
  std::vector<double> y(size_t(B * M * N), 0.0);
  for (int64_t bb = 0; bb < B; ++bb)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += a[size_t((bb * M + m) * K + k)] * b[size_t((bb * K + k) * N + n)];
        y[size_t((bb * M + m) * N + n)] = s;
      }
  return y;
}

}  // namespace

TEST_CASE("ops/naive: matmul, batched and transposed") {
  Tensor a = rnd({3, 5, 7}, 1), b = rnd({3, 7, 4}, 2);
  check_close(matmul(a, b), naive_matmul(a.to_vector<double>(), b.to_vector<double>(), 3, 5, 7, 4), {3, 5, 4});
  // a^T with a stored [7, 5]: the column-major operand path.
  Tensor at = rnd({7, 5}, 3), bt = rnd({4, 7}, 4);
  check_close(matmul(at.t(), bt.t()),
              naive_matmul(at.t().contiguous().to_vector<double>(), bt.t().contiguous().to_vector<double>(), 1, 5, 7, 4),
              {5, 4});
  // linear: x W^T + b
  Tensor x = rnd({6, 7}, 5), w = rnd({3, 7}, 6), bias = rnd({3}, 7);
  auto y = naive_matmul(x.to_vector<double>(), w.t().contiguous().to_vector<double>(), 1, 6, 7, 3);
  auto bv = bias.to_vector<double>();
  for (size_t i = 0; i < y.size(); ++i) y[i] += bv[i % 3];
  check_close(linear(x, w, bias), y, {6, 3});
}

TEST_CASE("ops/naive: f32 head shapes (1-17 rows times a wide transposed weight) on every dispatch path") {
  // The vocabulary head at decode: [M, K] x W^T with N large enough for the
  // column split (N >= 1024 x threads, M N K >= 2^21), M around the small-M
  // limit (4) and K not a multiple of the vector width.
  const int64_t K = 259, N = 8200;
  Tensor w = rnd({N, K}, 40);
  const std::vector<double> wt = w.t().contiguous().to_vector<double>();
  for (int64_t M : {1, 2, 3, 4, 5, 8, 17}) {
    CAPTURE(M);
    Tensor x = rnd({M, K}, 41 + uint64_t(M));
    const std::vector<double> want = naive_matmul(x.to_vector<double>(), wt, 1, M, K, N);
    Tensor got = linear(x.to(DType::f32), w.to(DType::f32), Tensor()).to(DType::f64);
    Mismatch m = compare(got, as_tensor(want, {M, N}), 2e-5);
    CHECK_MESSAGE(m.ok, m.message);
  }
}

TEST_CASE("ops/naive: softmax, log_softmax, cumsum, var along a middle dim") {
  Tensor x = rnd({3, 6, 4}, 10);
  auto v = x.to_vector<double>();
  std::vector<double> sm(v.size()), lsm(v.size()), cs(v.size()), vr(12);
  for (int a = 0; a < 3; ++a)
    for (int c = 0; c < 4; ++c) {
      auto at = [&](int b) { return size_t((a * 6 + b) * 4 + c); };
      double mx = -INFINITY, s = 0, run = 0, mean = 0;
      for (int b = 0; b < 6; ++b) mx = std::max(mx, v[at(b)]), mean += v[at(b)] / 6;
      for (int b = 0; b < 6; ++b) s += std::exp(v[at(b)] - mx);
      double ss = 0;
      for (int b = 0; b < 6; ++b) {
        sm[at(b)] = std::exp(v[at(b)] - mx) / s;
        lsm[at(b)] = v[at(b)] - mx - std::log(s);
        run += v[at(b)];
        cs[at(b)] = run;
        ss += (v[at(b)] - mean) * (v[at(b)] - mean);
      }
      vr[size_t(a * 4 + c)] = ss / 5;  // correction 1
    }
  check_close(softmax(x, 1), sm, {3, 6, 4});
  check_close(log_softmax(x, 1), lsm, {3, 6, 4});
  check_close(cumsum(x, 1), cs, {3, 6, 4});
  check_close(var(x, {1}), vr, {3, 4});
  // Softmax of large logits must not overflow.
  Tensor big = as_tensor({1000.0, 1001.0, 1002.0}, {3});
  double e = std::exp(-1.0), e2 = std::exp(-2.0), z = 1 + e + e2;
  check_close(softmax(big), {e2 / z, e / z, 1 / z}, {3});
}

TEST_CASE("ops/naive: log_softmax and softmax of a confident 200064-wide row keep the tail's mass (f32)") {
  // One logit far above the rest, as a trained model's head gives: the sum of
  // exponentials must not drop the 200063 small terms (f32 vector lanes did,
  // log-probabilities ended up ~6e-5 too high).
  const int64_t n = 200064;
  std::vector<float> v(static_cast<size_t>(n));
  uint64_t s = 7;
  for (auto& x : v) x = float(double(splitmix64(s++) >> 11) * 0x1p-53 * 8.0 - 4.0);
  v[18] = 17.0f;
  double mx = 17.0, sum = 0;
  for (float x : v) sum += std::exp(double(x) - mx);
  const double lse = mx + std::log(sum);
  const double tail = 1.0 - std::exp(17.0 - lse);
  CHECK(tail > 1e-3);  // the case is one where the tail matters
  for (const Device& d : testing::available_devices()) {
    CAPTURE(d.str());
    Tensor x = from_vector(v, {1, n}).to(d);
    const std::vector<float> lp = log_softmax(x, -1).to(Device::cpu()).to_vector<float>();
    const std::vector<float> p = softmax(x, -1).to(Device::cpu()).to_vector<float>();
    CHECK(std::abs(double(lp[18]) - (17.0 - lse)) < 2e-6);
    CHECK(std::abs(double(p[18]) - std::exp(17.0 - lse)) < 1e-6);
    double worst = 0;
    for (int64_t j = 0; j < n; j += 997) worst = std::max(worst, std::abs(double(lp[size_t(j)]) - (double(v[size_t(j)]) - lse)));
    CHECK(worst < 4e-6);
  }
}

TEST_CASE("ops/naive: layer_norm and rms_norm") {
  Tensor x = rnd({4, 9}, 20), w = rnd({9}, 21), b = rnd({9}, 22);
  auto xv = x.to_vector<double>(), wv = w.to_vector<double>(), bv = b.to_vector<double>();
  std::vector<double> ln(xv.size()), rms(xv.size());
  for (int r = 0; r < 4; ++r) {
    double mean = 0, var = 0, ms = 0;
    for (int c = 0; c < 9; ++c) mean += xv[size_t(r * 9 + c)] / 9;
    for (int c = 0; c < 9; ++c) {
      double d = xv[size_t(r * 9 + c)] - mean;
      var += d * d / 9;  // biased, as layer_norm
      ms += xv[size_t(r * 9 + c)] * xv[size_t(r * 9 + c)] / 9;
    }
    for (int c = 0; c < 9; ++c) {
      size_t i = size_t(r * 9 + c);
      ln[i] = (xv[i] - mean) / std::sqrt(var + 1e-5) * wv[size_t(c)] + bv[size_t(c)];
      rms[i] = xv[i] / std::sqrt(ms + 1e-6) * wv[size_t(c)];
    }
  }
  check_close(layer_norm(x, w, b, 1e-5), ln, {4, 9});
  check_close(rms_norm(x, w, 1e-6), rms, {4, 9});
}

TEST_CASE("ops/naive: conv2d with stride, padding, dilation and groups; conv1d") {
  const int64_t N = 2, C = 4, H = 7, W = 6, O = 6, G = 2, KH = 3, KW = 2;
  const int64_t sh = 2, sw = 1, ph = 1, pw = 1, dh = 1, dw = 2;
  Tensor x = rnd({N, C, H, W}, 30), w = rnd({O, C / G, KH, KW}, 31), b = rnd({O}, 32);
  auto xv = x.to_vector<double>(), wv = w.to_vector<double>(), bv = b.to_vector<double>();
  int64_t Ho = (H + 2 * ph - dh * (KH - 1) - 1) / sh + 1, Wo = (W + 2 * pw - dw * (KW - 1) - 1) / sw + 1;
  std::vector<double> y(size_t(N * O * Ho * Wo));
  int64_t cg = C / G, og = O / G;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t i = 0; i < Ho; ++i)
        for (int64_t j = 0; j < Wo; ++j) {
          double s = bv[size_t(o)];
          int64_t g = o / og;
          for (int64_t c = 0; c < cg; ++c)
            for (int64_t ki = 0; ki < KH; ++ki)
              for (int64_t kj = 0; kj < KW; ++kj) {
                int64_t hi = i * sh - ph + ki * dh, wj = j * sw - pw + kj * dw;
                if (hi < 0 || hi >= H || wj < 0 || wj >= W) continue;
                s += xv[size_t(((n * C + g * cg + c) * H + hi) * W + wj)] *
                     wv[size_t(((o * cg + c) * KH + ki) * KW + kj)];
              }
          y[size_t(((n * O + o) * Ho + i) * Wo + j)] = s;
        }
  check_close(conv2d(x, w, b, {sh, sw}, {ph, pw}, {dh, dw}, G), y, {N, O, Ho, Wo});

  // conv1d equals conv2d with a height of one.
  Tensor x1 = rnd({2, 4, 11}, 33), w1 = rnd({4, 1, 3}, 34);
  Tensor via2d = conv2d(x1.unsqueeze(2), w1.unsqueeze(2), Tensor(), {1, 2}, {0, 1}, {1, 1}, 4);
  auto want = via2d.squeeze(2).contiguous().to_vector<double>();
  check_close(conv1d(x1, w1, Tensor(), 2, 1, 1, 4), want, via2d.squeeze(2).shape());
}

TEST_CASE("ops/naive: avg_pool2d counts padding like torch") {
  Tensor x = rnd({1, 2, 5, 4}, 40);
  auto xv = x.to_vector<double>();
  const int64_t K = 3, S = 2, P = 1, H = 5, W = 4;
  int64_t Ho = (H + 2 * P - K) / S + 1, Wo = (W + 2 * P - K) / S + 1;
  std::vector<double> y(size_t(2 * Ho * Wo));
  for (int64_t c = 0; c < 2; ++c)
    for (int64_t i = 0; i < Ho; ++i)
      for (int64_t j = 0; j < Wo; ++j) {
        double s = 0;
        for (int64_t a = 0; a < K; ++a)
          for (int64_t b = 0; b < K; ++b) {
            int64_t h = i * S - P + a, w = j * S - P + b;
            if (h >= 0 && h < H && w >= 0 && w < W) s += xv[size_t((c * H + h) * W + w)];
          }
        y[size_t((c * Ho + i) * Wo + j)] = s / double(K * K);
      }
  check_close(avg_pool2d(x, {K, K}, {S, S}, {P, P}), y, {1, 2, Ho, Wo});
}

TEST_CASE("ops/naive: cross_entropy with ignore_index, mean and sum") {
  Tensor logits = rnd({6, 4}, 50);
  Tensor target = as_tensor({0, 3, -100, 1, 2, -100}, {6}).to(DType::i64);
  auto lv = logits.to_vector<double>();
  std::vector<double> tv = {0, 3, -100, 1, 2, -100}, none(6, 0.0);
  double total = 0;
  int counted = 0;
  for (int r = 0; r < 6; ++r) {
    if (tv[size_t(r)] == -100) continue;
    double mx = -INFINITY, s = 0;
    for (int c = 0; c < 4; ++c) mx = std::max(mx, lv[size_t(r * 4 + c)]);
    for (int c = 0; c < 4; ++c) s += std::exp(lv[size_t(r * 4 + c)] - mx);
    none[size_t(r)] = -(lv[size_t(r * 4 + int(tv[size_t(r)]))] - mx - std::log(s));
    total += none[size_t(r)];
    ++counted;
  }
  check_close(cross_entropy(logits, target), {total / counted}, {});
  check_close(cross_entropy(logits, target, -100, "sum"), {total}, {});
  check_close(cross_entropy(logits, target, -100, "none"), none, {6});
}

namespace {

// Attention summed in double: q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D],
// `masked` [B, Tk] (1 = key left out), `bias` [Hq, Tq, Tk] or empty; with
// `causal` the last query sees the last key.
std::vector<double> naive_attention(const std::vector<double>& qv, const std::vector<double>& kv,
                                    const std::vector<double>& vv, const std::vector<double>& masked,
                                    const std::vector<double>& bias, bool causal, int64_t B, int64_t Hq,
                                    int64_t Hkv, int64_t Tq, int64_t Tk, int64_t D) {
  std::vector<double> y(size_t(B * Hq * Tq * D), 0.0);
  const double scale = 1 / std::sqrt(double(D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / (Hq / Hkv);
      for (int64_t i = 0; i < Tq; ++i) {
        std::vector<double> s(size_t(Tk), -INFINITY);
        for (int64_t j = 0; j < Tk; ++j) {
          if (masked[size_t(b * Tk + j)] != 0) continue;
          if (causal && j > i + (Tk - Tq)) continue;
          double d = 0;
          for (int64_t c = 0; c < D; ++c)
            d += qv[size_t(((b * Hq + h) * Tq + i) * D + c)] * kv[size_t(((b * Hkv + hk) * Tk + j) * D + c)];
          s[size_t(j)] = d * scale + (bias.empty() ? 0.0 : bias[size_t((h * Tq + i) * Tk + j)]);
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (auto& e : s) z += (e = std::exp(e - mx));
        for (int64_t c = 0; c < D; ++c) {
          double acc = 0;
          for (int64_t j = 0; j < Tk; ++j) acc += s[size_t(j)] / z * vv[size_t(((b * Hkv + hk) * Tk + j) * D + c)];
          y[size_t(((b * Hq + h) * Tq + i) * D + c)] = acc;
        }
      }
    }
  return y;
}

}  // namespace

TEST_CASE("ops/naive: scaled_dot_product_attention with GQA, causal, bias and key padding") {
  const int64_t B = 2, Hq = 4, Hkv = 2, Tq = 3, Tk = 5, D = 4;
  Tensor q = rnd({B, Hq, Tq, D}, 60), k = rnd({B, Hkv, Tk, D}, 61), v = rnd({B, Hkv, Tk, D}, 62);
  Tensor bias = rnd({1, Hq, Tq, Tk}, 63);
  std::vector<double> maskv = {0, 0, 1, 0, 0, 0, 1, 0, 0, 1};  // [B, Tk], 1 = masked
  Tensor kpm = as_tensor(maskv, {B, Tk}).to(DType::boolean);
  for (bool causal : {false, true}) {
    const std::vector<double> y = naive_attention(q.to_vector<double>(), k.to_vector<double>(), v.to_vector<double>(),
                                                  maskv, bias.to_vector<double>(), causal, B, Hq, Hkv, Tq, Tk, D);
    AttentionOptions o;
    o.causal = causal;
    o.bias = bias;
    o.key_padding_mask = kpm;
    CAPTURE(causal);
    check_close(scaled_dot_product_attention(q, k, v, o), y, {B, Hq, Tq, D});
  }
}

TEST_CASE("ops/naive: scaled_dot_product_attention with a key padding mask and no bias, inference and recorded paths") {
  // Without a bias or a tape the fused kernel runs per batch element over the
  // keys it keeps; with a tape the composition runs. Both equal the naive sum.
  const int64_t B = 3, Hq = 4, Hkv = 2, Tq = 6, Tk = 9, D = 8;
  // f32: the dtype the fused kernels take.
  Tensor q = rnd({B, Hq, Tq, D}, 80).to(DType::f32), k = rnd({B, Hkv, Tk, D}, 81).to(DType::f32),
         v = rnd({B, Hkv, Tk, D}, 82).to(DType::f32);
  // Batch 0 keeps every key, 1 masks the last three, 2 masks keys 0, 4 and 8.
  std::vector<double> maskv(size_t(B * Tk), 0.0);
  for (int64_t j : {6, 7, 8}) maskv[size_t(Tk + j)] = 1;
  for (int64_t j : {0, 4, 8}) maskv[size_t(2 * Tk + j)] = 1;
  const Tensor kpm = as_tensor(maskv, {B, Tk}).to(DType::boolean);
  const std::vector<double> y = naive_attention(q.to_vector<double>(), k.to_vector<double>(), v.to_vector<double>(),
                                                maskv, {}, false, B, Hq, Hkv, Tq, Tk, D);
  AttentionOptions o;
  o.key_padding_mask = kpm;
  {
    NoGradGuard ng;  // the fused kernel per batch element
    check_close(scaled_dot_product_attention(q, k, v, o), y, {B, Hq, Tq, D}, 1e-5);  // f32
    // A transposed (strided) q, as the vision tower passes it.
    const Tensor qt = q.transpose(1, 2).contiguous().transpose(1, 2);
    check_close(scaled_dot_product_attention(qt, k, v, o), y, {B, Hq, Tq, D}, 1e-5);  // f32
  }
  {
    Tensor qg = q.detach().set_requires_grad(true);  // recorded: the composition
    check_close(scaled_dot_product_attention(qg, k, v, o), y, {B, Hq, Tq, D}, 1e-5);  // f32
  }
}

TEST_CASE("ops/naive: gather, scatter_add, index_add, index_select, embedding, masked_scatter") {
  Tensor x = rnd({4, 3}, 70);
  auto xv = x.to_vector<double>();
  std::vector<double> iv = {3, 0, 1, 1, 1, 2, 0, 3, 3, 2, 2, 0};  // [4, 3] into dim 0 of size 4
  Tensor index = as_tensor(iv, {4, 3}).to(DType::i64);
  std::vector<double> g(12), sa = xv;
  Tensor src = rnd({4, 3}, 71);
  auto sv = src.to_vector<double>();
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j) {
      g[size_t(i * 3 + j)] = xv[size_t(int(iv[size_t(i * 3 + j)]) * 3 + j)];
      sa[size_t(int(iv[size_t(i * 3 + j)]) * 3 + j)] += sv[size_t(i * 3 + j)];
    }
  check_close(gather(x, 0, index), g, {4, 3});
  check_close(scatter_add(x, 0, index, src), sa, {4, 3});

  std::vector<double> rows = {2, 0, 2};
  Tensor ri = as_tensor(rows, {3}).to(DType::i64);
  Tensor s3 = rnd({3, 3}, 72);
  auto s3v = s3.to_vector<double>();
  std::vector<double> ia = xv, sel(9);
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 3; ++c) {
      ia[size_t(int(rows[size_t(r)]) * 3 + c)] += s3v[size_t(r * 3 + c)];
      sel[size_t(r * 3 + c)] = xv[size_t(int(rows[size_t(r)]) * 3 + c)];
    }
  check_close(index_add(x, 0, ri, s3), ia, {4, 3});
  check_close(index_select(x, 0, ri), sel, {3, 3});
  check_close(embedding(x, ri.unsqueeze(0)), sel, {1, 3, 3});

  std::vector<double> mv = {1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1};
  Tensor m = as_tensor(mv, {4, 3}).to(DType::boolean);
  Tensor many = rnd({12}, 73);
  auto mnv = many.to_vector<double>();
  std::vector<double> ms = xv;
  size_t k = 0;
  for (size_t i = 0; i < 12; ++i)
    if (mv[i] != 0) ms[i] = mnv[k++];
  check_close(masked_scatter(x, m, many), ms, {4, 3});
}

TEST_CASE("ops/naive: pad, cat, topk and sort") {
  Tensor x = rnd({2, 3}, 80);
  auto xv = x.to_vector<double>();
  // pad last dim by (1, 2) and dim 0 by (0, 1) with 9
  std::vector<double> p(size_t(3 * 6), 9.0);
  for (int r = 0; r < 2; ++r)
    for (int c = 0; c < 3; ++c) p[size_t(r * 6 + c + 1)] = xv[size_t(r * 3 + c)];
  check_close(pad(x, {1, 2, 0, 1}, 9.0), p, {3, 6});

  Tensor y = rnd({2, 2}, 81);
  auto yv = y.to_vector<double>();
  std::vector<double> c = {xv[0], xv[1], xv[2], yv[0], yv[1], xv[3], xv[4], xv[5], yv[2], yv[3]};
  check_close(cat({x, y}, 1), c, {2, 5});

  Tensor z = as_tensor({0.5, -1.0, 3.0, 0.5, 2.0, -4.0}, {6});
  auto [vals, idxs] = topk(z, 3);
  check_close(vals, {3.0, 2.0, 0.5}, {3});
  check_close(idxs, {2, 4, 0}, {3}, 0.0);  // ties: the lower index first
  auto [svals, sidx] = sort(z);
  check_close(svals, {-4.0, -1.0, 0.5, 0.5, 2.0, 3.0}, {6});
  check_close(sidx, {5, 1, 0, 3, 4, 2}, {6}, 0.0);
}
