// Row ops on x contig [m, n]: softmax / log_softmax and their backward,
// layer_norm and rms_norm with their backward. One block per row with
// block-wide reductions in acc_t<T> (f32, f64 for f64); parameter gradients
// reduce over rows in fixed-size chunks (deterministic, no atomics).
#include "kernels/cuda/allocator.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

namespace areno::cuda {
namespace {

// [m, n] geometry of a row op from x's last dim.
struct Rows {
  int64_t m, n;
};

Rows rows_of(const Tensor& x, const char* op) {
  require_contiguous(x, op, "x");
  if (x.dim() == 0) return {1, 1};
  int64_t n = x.size(-1);
  return {n == 0 ? 0 : x.numel() / n, n};
}

void check_like(const Tensor& t, const Tensor& x, const char* op, const char* name) {
  require_contiguous(t, op, name);
  if (t.shape() != x.shape() || t.dtype() != x.dtype())
    throw std::invalid_argument(std::string("cuda ") + op + ": " + name + " " + t.str() +
                                " must match x " + x.str());
}

// Per-row statistics are f32, or f64 for f64 input.
template <typename T>
void check_stats(const Tensor& t, int64_t m, const char* op, const char* name) {
  if (!t.defined()) return;
  DType want = std::is_same_v<T, double> ? DType::f64 : DType::f32;
  require_contiguous(t, op, name);
  if (t.dtype() != want || t.numel() != m)
    throw std::invalid_argument(std::string("cuda ") + op + ": " + name + " " + t.str() +
                                " must hold " + std::to_string(m) + " " +
                                std::string(dtype_name(want)) + " values");
}

void check_param(const Tensor& t, const Tensor& x, int64_t n, const char* op, const char* name) {
  if (!t.defined()) return;
  require_contiguous(t, op, name);
  if (t.numel() != n || t.dtype() != x.dtype())
    throw std::invalid_argument(std::string("cuda ") + op + ": " + name + " " + t.str() +
                                " must hold " + std::to_string(n) + " values of x's dtype");
}

unsigned row_grid(int64_t m) { return unsigned(std::min<int64_t>(m, 1 << 20)); }

// ---- softmax ----

template <typename T>
__global__ void softmax_kernel(const T* x, T* y, int64_t m, int64_t n, bool log) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    A mx = A(-INFINITY);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) mx = fmax(mx, load_acc(xr, k));
    mx = block_max(mx, shared);
    A s = A(0);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) s += exp(load_acc(xr, k) - mx);
    s = block_sum(s, shared);
    if (log) {
      A lse = ::log(s);
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x)
        yr[k] = cast_value<T>(load_acc(xr, k) - mx - lse);
    } else {
      A inv = A(1) / s;
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x)
        yr[k] = cast_value<T>(exp(load_acc(xr, k) - mx) * inv);
    }
  }
}

// dx = softmax'(y) dy, times scale (scaled_softmax's backward; 1 for softmax).
template <typename T>
__global__ void softmax_backward_kernel(const T* y, const T* dy, T* dx, int64_t m, int64_t n,
                                        bool log, acc_t<T> scale) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const T* yr = y + r * n;
    const T* dyr = dy + r * n;
    T* dxr = dx + r * n;
    A s = A(0);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x)
      s += log ? load_acc(dyr, k) : load_acc(dyr, k) * load_acc(yr, k);
    s = block_sum(s, shared);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      A yv = load_acc(yr, k), g = load_acc(dyr, k);
      dxr[k] = cast_value<T>(log ? g - exp(yv) * s : scale * yv * (g - s));
    }
  }
}

// ---- scaled (causal) softmax: attention's probabilities ----

// One block per row: the visible prefix's max of scale * x, the sum of
// exp(scale * x - max), then the probabilities (0 past the prefix); the whole
// row NaN when the prefix is empty, its sum NaN or its max -inf (CPU: the same
// rule in kernels/cpu/rows.cpp).
template <typename T>
__global__ void scaled_softmax_kernel(const T* x, T* y, int64_t m, int64_t n, acc_t<T> scale, int64_t tq) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    int64_t vis = n;
    if (tq > 0) vis = min(n, max(int64_t(0), r % tq + n - tq + 1));
    A mx = A(-INFINITY);
    for (int64_t k = threadIdx.x; k < vis; k += blockDim.x) mx = fmax(mx, load_acc(xr, k) * scale);
    mx = block_max(mx, shared);
    A s = A(0);
    for (int64_t k = threadIdx.x; k < vis; k += blockDim.x) s += exp(load_acc(xr, k) * scale - mx);
    s = block_sum(s, shared);
    const bool nan_row = vis == 0 || isnan(s) || isinf(s) || mx == A(-INFINITY);
    const A inv = A(1) / s;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      A p = k < vis ? exp(load_acc(xr, k) * scale - mx) * inv : A(0);
      yr[k] = cast_value<T>(nan_row ? A(NAN) : p);
    }
  }
}

// ---- cross-entropy rows (Backend::cross_entropy_rows) ----

// One block per row of logits (f32, or bf16 read and written in f32 math,
// each element rounded once on its way back): the largest logit, the sum of
// exp(x - max) (f64 per thread and across the block, as the CPU kernel sums
// in f64 lanes), then x = exp(x - max) / sum in place, minus 1 at the target;
// loss = log(sum) + max - x[target]. A NaN or +inf logit (NaN sum), or a row
// with nothing finite, gives an all-NaN row and a NaN loss, as the CPU
// kernel; so does a target outside [0, n).
template <typename T>
__global__ void cross_entropy_rows_kernel(T* x, const int64_t* targets, float* loss, int64_t m, int64_t n) {
  __shared__ float shared_f[32];
  __shared__ double shared_d[32];
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    T* xr = x + r * n;
    const int64_t t = targets[r];
    const bool valid = t >= 0 && t < n;
    const float xt = valid ? load_acc(xr, t) : 0.0f;  // read before any thread overwrites the row
    float mx = -INFINITY;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) mx = fmaxf(mx, load_acc(xr, k));
    mx = block_max(mx, shared_f);
    double s = 0.0;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) s += double(expf(load_acc(xr, k) - mx));
    s = block_sum(s, shared_d);
    if (!valid || isnan(s) || mx == -INFINITY) {
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x) xr[k] = cast_value<T>(NAN);
      if (threadIdx.x == 0) loss[r] = NAN;
      continue;
    }
    const float inv = float(1.0 / s);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      const float p = expf(load_acc(xr, k) - mx) * inv;
      xr[k] = cast_value<T>(k == t ? p - 1.0f : p);
    }
    if (threadIdx.x == 0) loss[r] = float(log(s)) + mx - xt;
  }
}

// ---- layer norm / rms norm ----

template <typename T>
__global__ void layer_norm_kernel(const T* x, const T* w, const T* b, double eps, T* y,
                                  acc_t<T>* mean_out, acc_t<T>* rstd_out, int64_t m, int64_t n) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    A s = A(0);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) s += load_acc(xr, k);
    A mean = block_sum(s, shared) / A(n);
    A q = A(0);  // second pass: the variance of centred values stays accurate
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      A d = load_acc(xr, k) - mean;
      q += d * d;
    }
    A var = block_sum(q, shared) / A(n);
    A rstd = A(1) / sqrt(var + A(eps));
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      A v = (load_acc(xr, k) - mean) * rstd;
      if (w) v *= load_acc(w, k);
      if (b) v += load_acc(b, k);
      yr[k] = cast_value<T>(v);
    }
    if (threadIdx.x == 0) {
      if (mean_out) mean_out[r] = mean;
      if (rstd_out) rstd_out[r] = rstd;
    }
  }
}

// RMSNorm of rows; with b (add_rms_norm), each row is x + b rounded to T,
// written to sum first and read back from it (each thread reads only what it
// wrote).
template <typename T>
__global__ void rms_norm_kernel(const T* x, const T* b, T* sum, const T* w, double eps, T* y, acc_t<T>* rstd_out,
                                int64_t m, int64_t n) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    A q = A(0);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      A v = load_acc(xr, k);
      if (b) {
        const T s = cast_value<T>(v + load_acc(b + r * n, k));
        sum[r * n + k] = s;
        v = cast_value<A>(s);
      }
      q += v * v;
    }
    if (b) xr = sum + r * n;
    A rstd = A(1) / sqrt(block_sum(q, shared) / A(n) + A(eps));
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      A v = load_acc(xr, k) * rstd;
      if (w) v *= load_acc(w, k);
      yr[k] = cast_value<T>(v);
    }
    if (threadIdx.x == 0 && rstd_out) rstd_out[r] = rstd;
  }
}

// dx of both norms: xhat = (x - mean) * rstd (mean = 0 for rms), g = dy * w,
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (no mean(g) term for rms).
template <typename T>
__global__ void norm_backward_dx_kernel(const T* x, const T* w, const acc_t<T>* mean,
                                        const acc_t<T>* rstd, const T* dy, T* dx, int64_t m,
                                        int64_t n) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const T* xr = x + r * n;
    const T* dyr = dy + r * n;
    T* dxr = dx + r * n;
    A mu = mean ? mean[r] : A(0), rs = rstd[r];
    A sg = A(0), sgx = A(0);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      A g = load_acc(dyr, k) * (w ? load_acc(w, k) : A(1));
      A xh = (load_acc(xr, k) - mu) * rs;
      sg += g;
      sgx += g * xh;
    }
    A mean_g = mean ? block_sum(sg, shared) / A(n) : A(0);
    A mean_gx = block_sum(sgx, shared) / A(n);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
      A g = load_acc(dyr, k) * (w ? load_acc(w, k) : A(1));
      A xh = (load_acc(xr, k) - mu) * rs;
      dxr[k] = cast_value<T>(rs * (g - mean_g - xh * mean_gx));
    }
  }
}

constexpr int kParamRowsPerThread = 8;  // y-threads per block in the column pass

// Partial column sums over a chunk of rows: pw[c, j] = sum dy * xhat, pb[c, j] = sum dy.
template <typename T>
__global__ void norm_param_partial_kernel(const T* x, const acc_t<T>* mean, const acc_t<T>* rstd,
                                          const T* dy, int64_t m, int64_t n, int64_t chunk_rows,
                                          acc_t<T>* pw, acc_t<T>* pb) {
  using A = acc_t<T>;
  __shared__ A sw[kParamRowsPerThread][32];
  __shared__ A sb[kParamRowsPerThread][32];
  int64_t j = int64_t(blockIdx.x) * 32 + threadIdx.x;
  int64_t chunk = blockIdx.y;
  int64_t r0 = chunk * chunk_rows, r1 = min(m, r0 + chunk_rows);
  A aw = A(0), ab = A(0);
  if (j < n) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kParamRowsPerThread) {
      A g = load_acc(dy, r * n + j);
      A xh = (load_acc(x, r * n + j) - (mean ? mean[r] : A(0))) * rstd[r];
      aw += g * xh;
      ab += g;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && j < n) {
    for (int y = 1; y < kParamRowsPerThread; ++y) {
      aw += sw[y][threadIdx.x];
      ab += sb[y][threadIdx.x];
    }
    pw[chunk * n + j] = aw;
    if (pb) pb[chunk * n + j] = ab;
  }
}

template <typename T>
__global__ void norm_param_final_kernel(const acc_t<T>* pw, const acc_t<T>* pb, int64_t chunks,
                                        int64_t n, T* dw, T* db) {
  using A = acc_t<T>;
  ARENO_GRID_STRIDE_LOOP(j, n) {
    A aw = A(0), ab = A(0);
    for (int64_t c = 0; c < chunks; ++c) {
      aw += pw[c * n + j];
      if (pb) ab += pb[c * n + j];
    }
    if (dw) dw[j] = cast_value<T>(aw);
    if (db) db[j] = cast_value<T>(ab);
  }
}

// dweight (and dbias) = column sums over rows; nothing to do when both are undefined.
template <typename T>
void norm_param_grads(const Launch& l, const Tensor& x, const acc_t<T>* mean, const acc_t<T>* rstd,
                      const Tensor& dy, int64_t m, int64_t n, const Tensor& dweight,
                      const Tensor& dbias) {
  using A = acc_t<T>;
  if (!dweight.defined() && !dbias.defined()) return;
  if (m == 0) {  // no rows: the sums are zero
    if (dweight.defined()) ARENO_CUDA_CHECK(cudaMemsetAsync(dweight.data_ptr(), 0, dweight.nbytes(), l.stream));
    if (dbias.defined()) ARENO_CUDA_CHECK(cudaMemsetAsync(dbias.data_ptr(), 0, dbias.nbytes(), l.stream));
    return;
  }
  int64_t chunks = std::min<int64_t>(ceil_div(m, 64), 512);
  int64_t chunk_rows = ceil_div(m, chunks);
  chunks = ceil_div(m, chunk_rows);
  int device = x.device().index;
  auto pw = allocate_scratch(size_t(chunks * n) * sizeof(A), device);
  std::shared_ptr<void> pb;
  if (dbias.defined()) pb = allocate_scratch(size_t(chunks * n) * sizeof(A), device);
  dim3 grid(unsigned(ceil_div(n, 32)), unsigned(chunks));
  norm_param_partial_kernel<T><<<grid, dim3(32, kParamRowsPerThread), 0, l.stream>>>(
      ptr<const T>(x), mean, rstd, ptr<const T>(dy), m, n, chunk_rows, static_cast<A*>(pw.get()),
      static_cast<A*>(pb.get()));
  ARENO_LAUNCH_CHECK("norm_param_partial_kernel");
  norm_param_final_kernel<T><<<grid_for(n), kBlock, 0, l.stream>>>(
      static_cast<const A*>(pw.get()), static_cast<const A*>(pb.get()), chunks, n,
      dweight.defined() ? ptr<T>(dweight) : nullptr, dbias.defined() ? ptr<T>(dbias) : nullptr);
  ARENO_LAUNCH_CHECK("norm_param_final_kernel");
}

void softmax_backward_rows(const Tensor& y, const Tensor& dy, const Tensor& dx, bool log, double scale,
                           const char* op) {
  Rows r = rows_of(y, op);
  check_like(dy, y, op, "dy");
  check_like(dx, y, op, "dx");
  if (r.m == 0 || r.n == 0) return;
  Launch l(dx);
  visit_floating(y.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_backward_kernel<T><<<row_grid(r.m), row_block(r.n), 0, l.stream>>>(
        ptr<const T>(y), ptr<const T>(dy), ptr<T>(dx), r.m, r.n, log, acc_t<T>(scale));
    ARENO_LAUNCH_CHECK("softmax_backward_kernel");
  });
}

template <typename T>
const T* opt_ptr(const Tensor& t) {
  return t.defined() ? ptr<const T>(t) : nullptr;
}

template <typename T>
T* opt_mut_ptr(const Tensor& t) {
  return t.defined() ? ptr<T>(t) : nullptr;
}

}  // namespace
// ---- SwiGLU and rotary (elementwise, one thread per output value) ----

namespace {

template <typename T>
__global__ void silu_and_mul_kernel(const T* x, T* out, int64_t m, int64_t n, int64_t ld) {
  using A = acc_t<T>;
  ARENO_GRID_STRIDE_LOOP(i, m * n) {
    const int64_t r = i / n, j = i % n;
    const A g = load_acc(x, r * ld + j), u = load_acc(x, r * ld + n + j);
    // silu rounded to T before the product, as mul(up, silu(gate)).
    const A s = cast_value<A>(cast_value<T>(g * (A(1) / (A(1) + exp(-g)))));
    out[i] = cast_value<T>(u * s);
  }
}

template <typename T>
__global__ void rotary_kernel(const T* x, const T* c, const T* s, T* out, int64_t t, int64_t h, int64_t d,
                              int64_t r, int64_t ld, bool transpose) {
  using A = acc_t<T>;
  // Each product rounded to T before the sum, with no fused multiply-add
  // (the composed ops' rounding points).
  auto rd = [](A v) { return cast_value<A>(cast_value<T>(v)); };
  auto mul = [](A a, A b) {
    if constexpr (std::is_same_v<A, double>) return __dmul_rn(a, b);
    else return __fmul_rn(a, b);
  };
  const int64_t f = r / 2;
  ARENO_GRID_STRIDE_LOOP(i, t * h * d) {
    const int64_t tok = i / (h * d), k = (i / d) % h, j = i % d;
    const T* v = x + tok * ld + k * d;
    if (j >= r) {
      out[i] = v[j];
      continue;
    }
    const T* cr = c + tok * r;
    const T* sr = s + tok * r;
    const int64_t jj = j < f ? j + f : j - f;  // the partner in rotate_half
    const A a = load_acc(v, j), b = load_acc(v, jj);
    A y;
    const A ac = rd(mul(a, load_acc(cr, j)));
    if (!transpose)
      y = j < f ? ac + rd(mul(-b, load_acc(sr, j))) : ac + rd(mul(b, load_acc(sr, j)));
    else
      y = j < f ? ac + rd(mul(b, load_acc(sr, jj))) : ac - rd(mul(b, load_acc(sr, jj)));
    out[i] = cast_value<T>(y);
  }
}

}  // namespace

}  // namespace areno::cuda

namespace areno {

using namespace cuda;

void CudaBackend::softmax(const Tensor& x, const Tensor& out, bool log) {
  Rows r = rows_of(x, "softmax");
  check_like(out, x, "softmax", "out");
  if (r.m == 0 || r.n == 0) return;
  Launch l(out);
  visit_floating(x.dtype(), "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_kernel<T><<<row_grid(r.m), row_block(r.n), 0, l.stream>>>(ptr<const T>(x), ptr<T>(out),
                                                                      r.m, r.n, log);
    ARENO_LAUNCH_CHECK("softmax_kernel");
  });
}

void CudaBackend::scaled_softmax(const Tensor& x, const Tensor& out, double scale, int64_t tq) {
  Rows r = rows_of(x, "scaled_softmax");
  check_like(out, x, "scaled_softmax", "out");
  if (r.m == 0 || r.n == 0) return;
  Launch l(out);
  visit_floating(x.dtype(), "scaled_softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    scaled_softmax_kernel<T><<<row_grid(r.m), row_block(r.n), 0, l.stream>>>(ptr<const T>(x), ptr<T>(out), r.m, r.n,
                                                                             acc_t<T>(scale), tq);
    ARENO_LAUNCH_CHECK("scaled_softmax_kernel");
  });
}

void CudaBackend::scaled_softmax_backward(const Tensor& y, const Tensor& dy, const Tensor& dx, double scale) {
  softmax_backward_rows(y, dy, dx, false, scale, "scaled_softmax_backward");
}

bool CudaBackend::cross_entropy_rows(const Tensor& logits, const Tensor& targets, const Tensor& loss) {
  if (!cross_entropy_rows_layout_ok(logits, targets, loss)) return false;
  const int64_t m = logits.size(0), n = logits.size(1);
  if (m == 0) return true;
  Launch l(logits);
  if (logits.dtype() == DType::bf16)
    cross_entropy_rows_kernel<<<row_grid(m), row_block(n), 0, l.stream>>>(
        ptr<bf16>(logits), ptr<const int64_t>(targets), ptr<float>(loss), m, n);
  else
    cross_entropy_rows_kernel<<<row_grid(m), row_block(n), 0, l.stream>>>(
        ptr<float>(logits), ptr<const int64_t>(targets), ptr<float>(loss), m, n);
  ARENO_LAUNCH_CHECK("cross_entropy_rows_kernel");
  return true;
}

void CudaBackend::softmax_backward(const Tensor& y, const Tensor& dy, const Tensor& dx, bool log) {
  softmax_backward_rows(y, dy, dx, log, 1.0, "softmax_backward");
}

void CudaBackend::layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                             const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  Rows r = rows_of(x, "layer_norm");
  check_like(y, x, "layer_norm", "y");
  check_param(weight, x, r.n, "layer_norm", "weight");
  check_param(bias, x, r.n, "layer_norm", "bias");
  if (r.m == 0) return;
  Launch l(y);
  visit_floating(x.dtype(), "layer_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    check_stats<T>(mean, r.m, "layer_norm", "mean");
    check_stats<T>(rstd, r.m, "layer_norm", "rstd");
    layer_norm_kernel<T><<<row_grid(r.m), row_block(r.n), 0, l.stream>>>(
        ptr<const T>(x), opt_ptr<T>(weight), opt_ptr<T>(bias), eps, ptr<T>(y), opt_mut_ptr<A>(mean),
        opt_mut_ptr<A>(rstd), r.m, r.n);
    ARENO_LAUNCH_CHECK("layer_norm_kernel");
  });
}

void CudaBackend::layer_norm_backward(const Tensor& x, const Tensor& weight, const Tensor& mean,
                                      const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                                      const Tensor& dweight, const Tensor& dbias) {
  Rows r = rows_of(x, "layer_norm_backward");
  check_like(dy, x, "layer_norm_backward", "dy");
  if (dx.defined()) check_like(dx, x, "layer_norm_backward", "dx");
  check_param(weight, x, r.n, "layer_norm_backward", "weight");
  check_param(dweight, x, r.n, "layer_norm_backward", "dweight");
  check_param(dbias, x, r.n, "layer_norm_backward", "dbias");
  Launch l(x);
  visit_floating(x.dtype(), "layer_norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    check_stats<T>(mean, r.m, "layer_norm_backward", "mean");
    check_stats<T>(rstd, r.m, "layer_norm_backward", "rstd");
    if (!mean.defined() || !rstd.defined())
      throw std::invalid_argument("cuda layer_norm_backward: mean and rstd are required");
    if (dx.defined() && r.m > 0) {
      norm_backward_dx_kernel<T><<<row_grid(r.m), row_block(r.n), 0, l.stream>>>(
          ptr<const T>(x), opt_ptr<T>(weight), ptr<const A>(mean), ptr<const A>(rstd),
          ptr<const T>(dy), ptr<T>(dx), r.m, r.n);
      ARENO_LAUNCH_CHECK("norm_backward_dx_kernel");
    }
    norm_param_grads<T>(l, x, ptr<const A>(mean), ptr<const A>(rstd), dy, r.m, r.n, dweight, dbias);
  });
}

namespace {

// rms_norm, and add_rms_norm when b is given (sum then receives x + b).
void launch_rms_norm(const Tensor& x, const Tensor* b, const Tensor* sum, const Tensor& weight, double eps,
                     const Tensor& y, const Tensor& rstd, const char* op) {
  Rows r = rows_of(x, op);
  if (b) {
    check_like(*b, x, op, "b");
    check_like(*sum, x, op, "sum");
  }
  check_like(y, x, op, "y");
  check_param(weight, x, r.n, op, "weight");
  if (r.m == 0) return;
  Launch l(y);
  visit_floating(x.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    check_stats<T>(rstd, r.m, op, "rstd");
    rms_norm_kernel<T><<<row_grid(r.m), row_block(r.n), 0, l.stream>>>(
        ptr<const T>(x), b ? ptr<const T>(*b) : nullptr, sum ? ptr<T>(*sum) : nullptr, opt_ptr<T>(weight), eps,
        ptr<T>(y), opt_mut_ptr<A>(rstd), r.m, r.n);
    ARENO_LAUNCH_CHECK("rms_norm_kernel");
  });
}

}  // namespace

void CudaBackend::rms_norm(const Tensor& x, const Tensor& weight, double eps, const Tensor& y,
                           const Tensor& rstd) {
  launch_rms_norm(x, nullptr, nullptr, weight, eps, y, rstd, "rms_norm");
}

void CudaBackend::add_rms_norm(const Tensor& a, const Tensor& b, const Tensor& weight, double eps, const Tensor& sum,
                               const Tensor& y, const Tensor& rstd) {
  launch_rms_norm(a, &b, &sum, weight, eps, y, rstd, "add_rms_norm");
}

void CudaBackend::rms_norm_backward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                    const Tensor& dy, const Tensor& dx, const Tensor& dweight) {
  Rows r = rows_of(x, "rms_norm_backward");
  check_like(dy, x, "rms_norm_backward", "dy");
  if (dx.defined()) check_like(dx, x, "rms_norm_backward", "dx");
  check_param(weight, x, r.n, "rms_norm_backward", "weight");
  check_param(dweight, x, r.n, "rms_norm_backward", "dweight");
  Launch l(x);
  visit_floating(x.dtype(), "rms_norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    check_stats<T>(rstd, r.m, "rms_norm_backward", "rstd");
    if (!rstd.defined()) throw std::invalid_argument("cuda rms_norm_backward: rstd is required");
    if (dx.defined() && r.m > 0) {
      norm_backward_dx_kernel<T><<<row_grid(r.m), row_block(r.n), 0, l.stream>>>(
          ptr<const T>(x), opt_ptr<T>(weight), nullptr, ptr<const A>(rstd), ptr<const T>(dy),
          ptr<T>(dx), r.m, r.n);
      ARENO_LAUNCH_CHECK("norm_backward_dx_kernel");
    }
    norm_param_grads<T>(l, x, nullptr, ptr<const A>(rstd), dy, r.m, r.n, dweight, Tensor());
  });
}


void CudaBackend::silu_and_mul(const Tensor& x, const Tensor& out) {
  require_contiguous(out, "silu_and_mul", "out");
  const int64_t m = out.size(0), n = out.size(1);
  if (m * n == 0) return;
  Launch l(out);
  visit_floating(x.dtype(), "silu_and_mul", [&](auto tag) {
    using T = typename decltype(tag)::type;
    silu_and_mul_kernel<T><<<grid_for(m * n), kBlock, 0, l.stream>>>(ptr<const T>(x), ptr<T>(out), m, n,
                                                                      x.stride(0));
    ARENO_LAUNCH_CHECK("silu_and_mul_kernel");
  });
}

void CudaBackend::rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& out, bool transpose) {
  require_contiguous(out, "rotary", "out");
  require_contiguous(cos, "rotary", "cos");
  require_contiguous(sin, "rotary", "sin");
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2), r = cos.size(1);
  if (t * h * d == 0) return;
  Launch l(out);
  visit_floating(x.dtype(), "rotary", [&](auto tag) {
    using T = typename decltype(tag)::type;
    rotary_kernel<T><<<grid_for(t * h * d), kBlock, 0, l.stream>>>(
        ptr<const T>(x), ptr<const T>(cos), ptr<const T>(sin), ptr<T>(out), t, h, d, r, x.stride(0), transpose);
    ARENO_LAUNCH_CHECK("rotary_kernel");
  });
}

}  // namespace areno
