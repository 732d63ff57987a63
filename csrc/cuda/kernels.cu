// kernels.cu — the CUDA versions of the elementwise kernels (reduce, scale, axpy, norm2) on
// device pointers, declared in csrc/cuda_api.h. Same semantics as the CPU kernels: float16/bfloat16
// accumulate in float32 and round once, integer sum/prod wrap, min/max propagate NaN, norm2 sums
// squares in float64 (per-block partials, then one block adds them in a fixed order, so the result
// is deterministic). Loads are 16-byte vectors when every pointer is 16-byte aligned; all loops
// are grid-stride. Work is queued on the caller's stream on the device that owns dst.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_api.h"

namespace mlf {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;
constexpr int kInlineSrcs = 32;  // source pointers passed by value; more go through device memory

struct SrcPtrs {
  const void* p[kInlineSrcs];
};

// ------------------------------------------------------------------- element kinds and ops

// Element kind: the type a reduction accumulates in (A) and the conversions in and out. Most
// types accumulate in themselves; half precision accumulates in float and rounds once.
template <class S> struct Kind {
  using A = S;
  static __device__ A in(S v) { return v; }
  static __device__ S out(A a) { return a; }
};
template <> struct Kind<__half> {
  using A = float;
  static __device__ A in(__half v) { return __half2float(v); }
  static __device__ __half out(A a) { return __float2half_rn(a); }
};
template <> struct Kind<__nv_bfloat16> {
  using A = float;
  static __device__ A in(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __nv_bfloat16 out(A a) { return __float2bfloat16_rn(a); }
};

template <class A> struct WrapAs { using U = A; };
template <> struct WrapAs<int32_t> { using U = uint32_t; };
template <> struct WrapAs<int64_t> { using U = uint64_t; };

struct Sum {
  template <class A>
  static __device__ A f(A a, A b) {
    using U = typename WrapAs<A>::U;
    return A(U(a) + U(b));
  }
};
struct Prod {
  template <class A>
  static __device__ A f(A a, A b) {
    using U = typename WrapAs<A>::U;
    return A(U(a) * U(b));
  }
};
struct Min {
  template <class A>
  static __device__ A f(A a, A b) { return (a < b || a != a) ? a : b; }
};
struct Max {
  template <class A>
  static __device__ A f(A a, A b) { return (a > b || a != a) ? a : b; }
};

// V elements moved as one 16-byte load/store when V > 1.
template <class S, int V>
struct alignas(V == 1 ? alignof(S) : 16) Pack {
  S e[V];
};

// Explicitly rounded add and multiply: no FMA contraction, so axpy/scale round like the CPU
// kernels.
__device__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// ------------------------------------------------------------------- kernels

// Packs [0, npacks) of V elements starting at element `first` of every buffer.
template <class Op, class S, int V>
__global__ void reduce_kernel(S* dst, SrcPtrs inl, const void* const* dev_srcs, int k,
                              size_t first, size_t npacks, typename Kind<S>::A scale, bool scaled) {
  using A = typename Kind<S>::A;
  using P = Pack<S, V>;
  auto src = [&](int j) {
    const void* p = k <= kInlineSrcs ? inl.p[j] : dev_srcs[j];
    return reinterpret_cast<const P*>(static_cast<const S*>(p) + first);
  };
  P* out = reinterpret_cast<P*>(dst + first);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < npacks;
       i += size_t(gridDim.x) * blockDim.x) {
    P x = src(0)[i];
    A acc[V];
#pragma unroll
    for (int l = 0; l < V; ++l) acc[l] = Kind<S>::in(x.e[l]);
    for (int j = 1; j < k; ++j) {
      P y = src(j)[i];
#pragma unroll
      for (int l = 0; l < V; ++l) acc[l] = Op::f(acc[l], Kind<S>::in(y.e[l]));
    }
    P r;
#pragma unroll
    for (int l = 0; l < V; ++l) r.e[l] = Kind<S>::out(scaled ? acc[l] * scale : acc[l]);
    out[i] = r;
  }
}

// y = y * a (x null) or y = y + b * x, over packs.
template <class S, int V>
__global__ void axpby_kernel(S* y, const S* x, size_t first, size_t npacks, typename Kind<S>::A a,
                             typename Kind<S>::A b) {
  using A = typename Kind<S>::A;
  using P = Pack<S, V>;
  P* yp = reinterpret_cast<P*>(y + first);
  const P* xp = x ? reinterpret_cast<const P*>(x + first) : nullptr;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < npacks;
       i += size_t(gridDim.x) * blockDim.x) {
    P yv = yp[i];
    if (xp) {
      P xv = xp[i];
#pragma unroll
      for (int l = 0; l < V; ++l)
        yv.e[l] = Kind<S>::out(add_rn(Kind<S>::in(yv.e[l]), mul_rn(b, Kind<S>::in(xv.e[l]))));
    } else {
#pragma unroll
      for (int l = 0; l < V; ++l) yv.e[l] = Kind<S>::out(mul_rn(Kind<S>::in(yv.e[l]), a));
    }
    yp[i] = yv;
  }
}

__device__ double block_sum(double v) {
  __shared__ double warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0;
  if (warp == 0)
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

template <class S>
__global__ void sumsq_kernel(const S* x, size_t n, double* partials) {
  double acc = 0.0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    double v = double(Kind<S>::in(x[i]));
    acc = __fma_rn(v, v, acc);
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void finish_sumsq_kernel(const double* partials, int nblocks, double* out) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < nblocks; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *out = sqrt(acc);
}

// ------------------------------------------------------------------- host side

int grid_for(size_t items) {
  size_t blocks = (items + kThreads - 1) / kThreads;
  return int(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Makes the device that owns `p` current (our static cudart keeps its own current device, so the
// caller's framework setting it does not reach us).
const char* use_device_of(const void* p) {
  cudaPointerAttributes attr;
  cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    return "buffer is not CUDA device memory";
  e = cudaSetDevice(attr.device);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

const char* last_error() {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

template <class Op, class S>
const char* reduce_typed(void* dst, const void* const* srcs, int k, size_t n, double scale,
                         cudaStream_t st) {
  using A = typename Kind<S>::A;
  SrcPtrs inl{};
  const void** dev = nullptr;
  if (k <= kInlineSrcs) {
    for (int j = 0; j < k; ++j) inl.p[j] = srcs[j];
  } else {
    cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&dev), k * sizeof(void*), st);
    if (e != cudaSuccess) return cudaGetErrorString(e);
    // From pageable memory: returns once `srcs` has been staged, so it may go out of scope.
    e = cudaMemcpyAsync(dev, srcs, k * sizeof(void*), cudaMemcpyHostToDevice, st);
    if (e != cudaSuccess) return cudaGetErrorString(e);
  }
  bool vec = aligned16(dst);
  for (int j = 0; j < k; ++j) vec = vec && aligned16(srcs[j]);
  constexpr int V = 16 / sizeof(S);
  size_t npacks = vec ? n / V : 0, tail_first = npacks * V;
  A s = A(scale);
  bool scaled = scale != 1.0;
  S* d = static_cast<S*>(dst);
  if (npacks)
    reduce_kernel<Op, S, V><<<grid_for(npacks), kThreads, 0, st>>>(d, inl, dev, k, 0, npacks, s,
                                                                   scaled);
  if (n > tail_first)
    reduce_kernel<Op, S, 1><<<grid_for(n - tail_first), kThreads, 0, st>>>(
        d, inl, dev, k, tail_first, n - tail_first, s, scaled);
  const char* err = last_error();
  if (dev) cudaFreeAsync(dev, st);
  return err;
}

template <class S>
const char* reduce_op(void* dst, const void* const* srcs, int k, size_t n, RedOp op, double scale,
                      cudaStream_t st) {
  switch (op) {
    case RedOp::sum: return reduce_typed<Sum, S>(dst, srcs, k, n, scale, st);
    case RedOp::prod: return reduce_typed<Prod, S>(dst, srcs, k, n, scale, st);
    case RedOp::min: return reduce_typed<Min, S>(dst, srcs, k, n, scale, st);
    case RedOp::max: return reduce_typed<Max, S>(dst, srcs, k, n, scale, st);
  }
  return "bad reduction op";
}

template <class S>
const char* axpby_typed(void* y, const void* x, size_t n, double a, double b, cudaStream_t st) {
  using A = typename Kind<S>::A;
  constexpr int V = 16 / sizeof(S);
  bool vec = aligned16(y) && (!x || aligned16(x));
  size_t npacks = vec ? n / V : 0, tail_first = npacks * V;
  S* yp = static_cast<S*>(y);
  const S* xp = static_cast<const S*>(x);
  if (npacks)
    axpby_kernel<S, V><<<grid_for(npacks), kThreads, 0, st>>>(yp, xp, 0, npacks, A(a), A(b));
  if (n > tail_first)
    axpby_kernel<S, 1><<<grid_for(n - tail_first), kThreads, 0, st>>>(yp, xp, tail_first,
                                                                      n - tail_first, A(a), A(b));
  return last_error();
}

const char* axpby(void* y, const void* x, size_t n, DType t, double a, double b, void* stream) {
  if (n == 0) return nullptr;
  if (const char* e = use_device_of(y)) return e;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (t) {
    case DType::f32: return axpby_typed<float>(y, x, n, a, b, st);
    case DType::f64: return axpby_typed<double>(y, x, n, a, b, st);
    case DType::f16: return axpby_typed<__half>(y, x, n, a, b, st);
    case DType::bf16: return axpby_typed<__nv_bfloat16>(y, x, n, a, b, st);
    default: return "scale/axpy need a floating dtype";
  }
}

template <class S>
const char* norm2_typed(const void* x, size_t n, cudaStream_t st, double* out) {
  int blocks = grid_for(n);
  double* buf = nullptr;  // blocks partial sums, then the result
  size_t bytes = (blocks + 1) * sizeof(double);
  cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&buf), bytes, st);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  sumsq_kernel<S><<<blocks, kThreads, 0, st>>>(static_cast<const S*>(x), n, buf);
  finish_sumsq_kernel<<<1, kThreads, 0, st>>>(buf, blocks, buf + blocks);
  const char* err = last_error();
  if (!err) {
    e = cudaMemcpyAsync(out, buf + blocks, sizeof(double), cudaMemcpyDeviceToHost, st);
    if (e != cudaSuccess) err = cudaGetErrorString(e);
  }
  cudaFreeAsync(buf, st);
  e = cudaStreamSynchronize(st);
  if (!err && e != cudaSuccess) err = cudaGetErrorString(e);
  return err;
}

}  // namespace

const char* reduce(void* dst, const void* const* srcs, int k, size_t count, DType t, RedOp op,
                   double scale, void* stream) {
  if (count == 0 || k < 1) return nullptr;
  if (const char* e = use_device_of(dst)) return e;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (t) {
    case DType::f32: return reduce_op<float>(dst, srcs, k, count, op, scale, st);
    case DType::f64: return reduce_op<double>(dst, srcs, k, count, op, scale, st);
    case DType::f16: return reduce_op<__half>(dst, srcs, k, count, op, scale, st);
    case DType::bf16: return reduce_op<__nv_bfloat16>(dst, srcs, k, count, op, scale, st);
    case DType::i32: return reduce_op<int32_t>(dst, srcs, k, count, op, 1.0, st);
    case DType::i64: return reduce_op<int64_t>(dst, srcs, k, count, op, 1.0, st);
  }
  return "bad dtype";
}

const char* scale(void* x, size_t count, DType t, double alpha, void* stream) {
  return axpby(x, nullptr, count, t, alpha, 0.0, stream);
}

const char* axpy(void* y, const void* x, size_t count, DType t, double alpha, void* stream) {
  return axpby(y, x, count, t, 1.0, alpha, stream);
}

const char* norm2(const void* x, size_t count, DType t, void* stream, double* out) {
  *out = 0.0;
  if (count == 0) return nullptr;
  if (const char* e = use_device_of(x)) return e;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (t) {
    case DType::f32: return norm2_typed<float>(x, count, st, out);
    case DType::f64: return norm2_typed<double>(x, count, st, out);
    case DType::f16: return norm2_typed<__half>(x, count, st, out);
    case DType::bf16: return norm2_typed<__nv_bfloat16>(x, count, st, out);
    case DType::i32: return norm2_typed<int32_t>(x, count, st, out);
    case DType::i64: return norm2_typed<int64_t>(x, count, st, out);
  }
  return "bad dtype";
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free "no driver/device" error
    return 0;
  }
  return n;
}

}  // namespace cuda
}  // namespace mlf
