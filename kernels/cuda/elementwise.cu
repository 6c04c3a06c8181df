// Copies (device, host<->device, device<->device), fill, arange and the
// unary / binary / where ops. Arithmetic runs in acc_t<T> (f32 for 16-bit
// floats, i64 for integers); the op is a runtime switch inside one kernel per
// dtype, which keeps instantiations at one per dtype rather than op x dtype.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>

#include "kernels/cuda/allocator.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/elementwise.cuh"

namespace areno::cuda {

Tensor device_empty(const Shape& shape, DType dtype, int device) {
  size_t nbytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  return make_tensor(allocate_storage(nbytes, device), 0, shape, contiguous_strides(shape), dtype);
}

Tensor host_empty(const Shape& shape, DType dtype) {
  size_t nbytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  return make_tensor(cpu_backend().allocate(nbytes, Device::cpu()), 0, shape, contiguous_strides(shape),
                     dtype);
}

namespace {

// ---- copy and cast ----

template <typename B>
struct CopyBitsFn {
  B* out;
  const B* in;
  __device__ void operator()(const int64_t (&off)[2]) const { out[off[0]] = in[off[1]]; }
};

template <typename S>
struct CastFn {
  void* out;
  DType out_dtype;
  const S* in;
  __device__ void operator()(const int64_t (&off)[2]) const {
    store_as(out_dtype, out, off[0], in[off[1]]);
  }
};

template <typename B>
struct FillFn {
  B* out;
  B value;
  __device__ void operator()(const int64_t (&off)[1]) const { out[off[0]] = value; }
};

template <typename T>
__global__ void arange_kernel(T* out, int64_t n, double start, double step) {
  ARENO_GRID_STRIDE_LOOP(i, n) out[i] = cast_value<T>(start + double(i) * step);
}

// ---- unary ----

template <typename A>
__device__ __forceinline__ A sigmoid_of(A x) {
  return A(1) / (A(1) + exp(-x));
}

template <typename A>  // A: float or double
__device__ __forceinline__ A unary_float(UnaryOp op, A x, A p0, A p1) {
  constexpr A kSqrt1_2 = A(0.70710678118654752440);
  constexpr A kSqrt2OverPi = A(0.79788456080286535588);
  switch (op) {
    case UnaryOp::neg: return -x;
    case UnaryOp::exp: return exp(x);
    case UnaryOp::log: return log(x);
    case UnaryOp::sqrt: return sqrt(x);
    case UnaryOp::rsqrt: return A(1) / sqrt(x);
    case UnaryOp::abs: return fabs(x);
    case UnaryOp::sin: return sin(x);
    case UnaryOp::cos: return cos(x);
    case UnaryOp::square: return x * x;
    case UnaryOp::reciprocal: return A(1) / x;
    case UnaryOp::relu: return x != x ? x : x > A(0) ? x : A(0);  // NaN propagates, as torch
    case UnaryOp::silu: return x * sigmoid_of(x);
    case UnaryOp::sigmoid: return sigmoid_of(x);
    case UnaryOp::tanh: return tanh(x);
    case UnaryOp::gelu: return A(0.5) * x * (A(1) + erf(x * kSqrt1_2));
    case UnaryOp::gelu_tanh:
      return A(0.5) * x * (A(1) + tanh(kSqrt2OverPi * (x + A(0.044715) * x * x * x)));
    case UnaryOp::logical_not: return x == A(0) ? A(1) : A(0);
    case UnaryOp::affine: return x * p0 + p1;
    case UnaryOp::pow_scalar: return pow(x, p0);
    case UnaryOp::clamp: {
      A r = x < p0 ? p0 : x;  // comparisons with NaN are false: NaN passes through
      return r > p1 ? p1 : r;
    }
  }
  return x;
}

__device__ __forceinline__ int64_t unary_int(UnaryOp op, int64_t x, double p0, double p1) {
  switch (op) {
    case UnaryOp::neg: return -x;
    case UnaryOp::abs: return x < 0 ? -x : x;
    case UnaryOp::square: return x * x;
    case UnaryOp::relu: return x < 0 ? 0 : x;
    case UnaryOp::logical_not: return x == 0;
    case UnaryOp::affine: return x * int64_t(p0) + int64_t(p1);  // integer factors, as the CPU
    case UnaryOp::clamp: {
      double d = double(x);
      if (d < p0) return int64_t(p0);
      if (d > p1) return int64_t(p1);
      return x;
    }
    default: return int64_t(unary_float<double>(op, double(x), p0, p1));
  }
}

template <typename T>
struct UnaryFn {
  T* out;
  const T* x;
  UnaryOp op;
  double p0, p1;
  __device__ void operator()(const int64_t (&off)[2]) const {
    using A = acc_t<T>;
    A v = cast_value<A>(x[off[1]]);
    if constexpr (std::is_floating_point_v<A>) {
      out[off[0]] = cast_value<T>(unary_float<A>(op, v, A(p0), A(p1)));
    } else {
      out[off[0]] = cast_value<T>(unary_int(op, int64_t(v), p0, p1));
    }
  }
};

template <typename T>
struct LogicalNotFn {
  bool* out;
  const T* x;
  __device__ void operator()(const int64_t (&off)[2]) const {
    out[off[0]] = !cast_value<bool>(x[off[1]]);
  }
};

// ---- binary ----

template <typename A>  // float or double
__device__ __forceinline__ A binary_float(BinaryOp op, A a, A b, A alpha) {
  constexpr A kSqrt1_2 = A(0.70710678118654752440);
  constexpr A kInvSqrt2Pi = A(0.39894228040143267794);
  constexpr A kSqrt2OverPi = A(0.79788456080286535588);
  switch (op) {
    case BinaryOp::add: return a + alpha * b;
    case BinaryOp::sub: return a - alpha * b;
    case BinaryOp::mul: return a * b;
    case BinaryOp::div: return a / b;
    case BinaryOp::pow: return pow(a, b);
    case BinaryOp::maximum: return (a != a || b != b) ? a + b : (a > b ? a : b);  // NaN wins
    case BinaryOp::minimum: return (a != a || b != b) ? a + b : (a < b ? a : b);
    case BinaryOp::logical_and: return A((a != A(0)) && (b != A(0)));
    case BinaryOp::logical_or: return A((a != A(0)) || (b != A(0)));
    case BinaryOp::relu_backward: return a > A(0) ? b : A(0);
    case BinaryOp::silu_backward: {
      A s = sigmoid_of(a);
      return b * s * (A(1) + a * (A(1) - s));
    }
    case BinaryOp::sigmoid_backward: return b * a * (A(1) - a);
    case BinaryOp::tanh_backward: return b * (A(1) - a * a);
    case BinaryOp::gelu_backward: {
      A cdf = A(0.5) * (A(1) + erf(a * kSqrt1_2));
      A pdf = kInvSqrt2Pi * exp(A(-0.5) * a * a);
      return b * (cdf + a * pdf);
    }
    case BinaryOp::gelu_tanh_backward: {
      A inner = kSqrt2OverPi * (a + A(0.044715) * a * a * a);
      A t = tanh(inner);
      A dinner = kSqrt2OverPi * (A(1) + A(3) * A(0.044715) * a * a);
      return b * (A(0.5) * (A(1) + t) + A(0.5) * a * (A(1) - t * t) * dinner);
    }
    default: return A(0);  // comparisons go through CompareFn
  }
}

__device__ __forceinline__ int64_t binary_int(BinaryOp op, int64_t a, int64_t b, int64_t alpha) {
  switch (op) {
    case BinaryOp::add: return a + alpha * b;
    case BinaryOp::sub: return a - alpha * b;
    case BinaryOp::mul: return a * b;
    case BinaryOp::div: return b == 0 ? 0 : a / b;  // truncating; ops promote true division
    case BinaryOp::maximum: return a > b ? a : b;
    case BinaryOp::minimum: return a < b ? a : b;
    case BinaryOp::logical_and: return (a != 0) && (b != 0);
    case BinaryOp::logical_or: return (a != 0) || (b != 0);
    case BinaryOp::relu_backward: return a > 0 ? b : 0;
    default: return int64_t(binary_float<double>(op, double(a), double(b), double(alpha)));
  }
}

template <typename T>
struct BinaryFn {
  T* out;
  const T* a;
  const T* b;
  BinaryOp op;
  double alpha;
  __device__ void operator()(const int64_t (&off)[3]) const {
    using A = acc_t<T>;
    A x = cast_value<A>(a[off[1]]), y = cast_value<A>(b[off[2]]);
    if constexpr (std::is_floating_point_v<A>) {
      out[off[0]] = cast_value<T>(binary_float<A>(op, x, y, A(alpha)));
    } else {
      out[off[0]] = cast_value<T>(binary_int(op, x, y, int64_t(alpha)));
    }
  }
};

template <typename T>
struct CompareFn {
  bool* out;
  const T* a;
  const T* b;
  BinaryOp op;
  __device__ void operator()(const int64_t (&off)[3]) const {
    using A = acc_t<T>;
    A x = cast_value<A>(a[off[1]]), y = cast_value<A>(b[off[2]]);
    bool r = false;
    switch (op) {
      case BinaryOp::eq: r = x == y; break;
      case BinaryOp::ne: r = x != y; break;
      case BinaryOp::lt: r = x < y; break;
      case BinaryOp::le: r = x <= y; break;
      case BinaryOp::gt: r = x > y; break;
      case BinaryOp::ge: r = x >= y; break;
      default: break;
    }
    out[off[0]] = r;
  }
};

template <typename B>
struct WhereFn {
  B* out;
  const bool* cond;
  const B* a;
  const B* b;
  __device__ void operator()(const int64_t (&off)[4]) const {
    out[off[0]] = cond[off[1]] ? a[off[2]] : b[off[3]];
  }
};

void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  if (a.device() != b.device())
    throw std::invalid_argument(std::string("cuda ") + op + ": tensors on different devices (" +
                                a.device().str() + " and " + b.device().str() + ")");
}

}  // namespace

void device_copy(const Tensor& src, const Tensor& dst, cudaStream_t stream) {
  if (dst.numel() == 0) return;
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    ARENO_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(),
                                     cudaMemcpyDeviceToDevice, stream));
    return;
  }
  if (src.dtype() == dst.dtype()) {
    visit_bits(dst.element_size(), [&](auto tag) {
      using B = typename decltype(tag)::type;
      launch_elementwise<2>(stream, dst.shape(), {&dst, &src}, CopyBitsFn<B>{ptr<B>(dst), ptr<const B>(src)});
    });
    return;
  }
  visit_cuda_dtype(src.dtype(), [&](auto tag) {
    using S = typename decltype(tag)::type;
    launch_elementwise<2>(stream, dst.shape(), {&dst, &src},
                          CastFn<S>{dst.data_ptr(), dst.dtype(), ptr<const S>(src)});
  });
}

}  // namespace areno::cuda

namespace areno {

using namespace cuda;

void CudaBackend::copy(const Tensor& src, const Tensor& dst) {
  if (src.shape() != dst.shape())
    throw std::invalid_argument("cuda copy: source " + src.str() + " and destination " + dst.str() +
                                " differ in shape");
  if (dst.numel() == 0) return;
  bool src_cuda = src.device().is_cuda(), dst_cuda = dst.device().is_cuda();
  if (!src_cuda && !dst_cuda)
    throw std::invalid_argument("cuda copy: neither " + src.str() + " nor " + dst.str() +
                                " is on a CUDA device");

  if (src_cuda && dst_cuda && src.device() == dst.device()) {
    Launch l(dst);
    device_copy(src, dst, l.stream);
    return;
  }

  if (!src_cuda) {  // host -> device
    Launch l(dst);
    Tensor host = src;
    if (!src.is_contiguous()) {
      host = host_empty(src.shape(), src.dtype());
      cpu_backend().copy(src, host);
    }
    Tensor staged = dst;
    if (!(dst.is_contiguous() && dst.dtype() == src.dtype()))
      staged = device_empty(src.shape(), src.dtype(), dst.device().index);
    ARENO_CUDA_CHECK(cudaMemcpyAsync(staged.data_ptr(), host.data_ptr(), host.nbytes(),
                                     cudaMemcpyHostToDevice, l.stream));
    if (!staged.same(dst)) device_copy(staged, dst, l.stream);
    // The host buffer may be freed or changed once we return (torch's blocking copy).
    ARENO_CUDA_CHECK(cudaStreamSynchronize(l.stream));
    return;
  }

  if (!dst_cuda) {  // device -> host
    Launch l(src);
    Tensor dev = src;
    if (!(src.is_contiguous() && src.dtype() == dst.dtype())) {
      dev = device_empty(src.shape(), dst.dtype(), src.device().index);
      device_copy(src, dev, l.stream);
    }
    Tensor host = dst.is_contiguous() ? dst : host_empty(dst.shape(), dst.dtype());
    ARENO_CUDA_CHECK(cudaMemcpyAsync(host.data_ptr(), dev.data_ptr(), dev.nbytes(),
                                     cudaMemcpyDeviceToHost, l.stream));
    ARENO_CUDA_CHECK(cudaStreamSynchronize(l.stream));
    if (!host.same(dst)) cpu_backend().copy(host, dst);
    return;
  }

  // cuda:i -> cuda:j: contiguous, dst-typed staging on each side as needed.
  int si = src.device().index, di = dst.device().index;
  Tensor packed = src;
  {
    Launch ls(src);
    if (!(src.is_contiguous() && src.dtype() == dst.dtype())) {
      packed = device_empty(src.shape(), dst.dtype(), si);
      device_copy(src, packed, ls.stream);
    }
    ARENO_CUDA_CHECK(cudaStreamSynchronize(ls.stream));
  }
  Launch ld(dst);
  Tensor landing = dst.is_contiguous() ? dst : device_empty(dst.shape(), dst.dtype(), di);
  ARENO_CUDA_CHECK(cudaMemcpyPeerAsync(landing.data_ptr(), di, packed.data_ptr(), si,
                                       packed.nbytes(), ld.stream));
  if (!landing.same(dst)) device_copy(landing, dst, ld.stream);
  // `packed` lives on the source device's stream; the copy must finish before it is reused.
  ARENO_CUDA_CHECK(cudaStreamSynchronize(ld.stream));
}

void CudaBackend::fill(const Tensor& dst, double value) {
  if (dst.numel() == 0) return;
  Launch l(dst);
  uint64_t bits = visit_cuda_dtype(dst.dtype(), [&](auto tag) -> uint64_t {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bf16>) {
      return BFloat16(float(value)).bits;
    } else if constexpr (std::is_same_v<T, f16>) {
      return Half(float(value)).bits;
    } else {
      T v;
      if constexpr (std::is_same_v<T, bool>) v = value != 0.0;
      else v = static_cast<T>(value);
      uint64_t b = 0;
      std::memcpy(&b, &v, sizeof(T));
      return b;
    }
  });
  if (dst.is_contiguous() && (bits == 0 || dst.element_size() == 1)) {
    ARENO_CUDA_CHECK(cudaMemsetAsync(dst.data_ptr(), int(bits & 0xff), dst.nbytes(), l.stream));
    return;
  }
  visit_bits(dst.element_size(), [&](auto tag) {
    using B = typename decltype(tag)::type;
    launch_elementwise<1>(l.stream, dst.shape(), {&dst}, FillFn<B>{ptr<B>(dst), B(bits)});
  });
}

void CudaBackend::arange(const Tensor& dst, double start, double step) {
  require_contiguous(dst, "arange", "dst");
  int64_t n = dst.numel();
  if (n == 0) return;
  Launch l(dst);
  visit_cuda_dtype(dst.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    arange_kernel<T><<<grid_for(n), kBlock, 0, l.stream>>>(ptr<T>(dst), n, start, step);
    ARENO_LAUNCH_CHECK("arange_kernel");
  });
}

void CudaBackend::unary(UnaryOp op, const Tensor& x, const Tensor& out, double p0, double p1) {
  check_same_device(x, out, "unary");
  if (out.numel() == 0) return;
  Launch l(out);
  if (op == UnaryOp::logical_not) {
    if (out.dtype() != DType::boolean)
      throw std::invalid_argument("cuda logical_not: out must be bool, got " + out.str());
    visit_cuda_dtype(x.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch_elementwise<2>(l.stream, out.shape(), {&out, &x}, LogicalNotFn<T>{ptr<bool>(out), ptr<const T>(x)});
    });
    return;
  }
  if (x.dtype() != out.dtype())
    throw std::invalid_argument("cuda unary: x " + x.str() + " and out " + out.str() +
                                " must share a dtype");
  if (x.dtype() == DType::boolean)
    throw std::invalid_argument("cuda unary: op not defined for bool tensor " + x.str());
  visit_cuda_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T, bool>) {
      launch_elementwise<2>(l.stream, out.shape(), {&out, &x},
                            UnaryFn<T>{ptr<T>(out), ptr<const T>(x), op, p0, p1});
    }
  });
}

void CudaBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out,
                         double alpha) {
  check_same_device(a, out, "binary");
  check_same_device(b, out, "binary");
  if (a.dtype() != b.dtype())
    throw std::invalid_argument("cuda binary: a " + a.str() + " and b " + b.str() +
                                " must share a dtype");
  if (out.numel() == 0) return;
  Launch l(out);
  bool compare = op == BinaryOp::eq || op == BinaryOp::ne || op == BinaryOp::lt ||
                 op == BinaryOp::le || op == BinaryOp::gt || op == BinaryOp::ge;
  if (compare) {
    if (out.dtype() != DType::boolean)
      throw std::invalid_argument("cuda comparison: out must be bool, got " + out.str());
    visit_cuda_dtype(a.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch_elementwise<3>(l.stream, out.shape(), {&out, &a, &b},
                            CompareFn<T>{ptr<bool>(out), ptr<const T>(a), ptr<const T>(b), op});
    });
    return;
  }
  if (out.dtype() != a.dtype())
    throw std::invalid_argument("cuda binary: out " + out.str() + " must have the inputs' dtype " +
                                std::string(dtype_name(a.dtype())));
  visit_cuda_dtype(a.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_elementwise<3>(l.stream, out.shape(), {&out, &a, &b},
                          BinaryFn<T>{ptr<T>(out), ptr<const T>(a), ptr<const T>(b), op, alpha});
  });
}

void CudaBackend::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  check_same_device(cond, out, "where");
  check_same_device(a, out, "where");
  check_same_device(b, out, "where");
  if (cond.dtype() != DType::boolean)
    throw std::invalid_argument("cuda where: cond must be bool, got " + cond.str());
  if (a.dtype() != out.dtype() || b.dtype() != out.dtype())
    throw std::invalid_argument("cuda where: a, b and out must share a dtype");
  if (out.numel() == 0) return;
  Launch l(out);
  visit_bits(out.element_size(), [&](auto tag) {
    using B = typename decltype(tag)::type;
    launch_elementwise<4>(l.stream, out.shape(), {&out, &cond, &a, &b},
                          WhereFn<B>{ptr<B>(out), ptr<const bool>(cond), ptr<const B>(a), ptr<const B>(b)});
  });
}

}  // namespace areno
