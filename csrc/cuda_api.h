// cuda_api.h — host-side declarations of the CUDA kernels in csrc/cuda/kernels.cu (reduce, scale,
// axpy, norm2 on device pointers), callable from code compiled without CUDA headers. Present in
// the build only when MLFABRIC_WITH_CUDA is defined.
#pragma once
#include <cstddef>

#include "kernels.h"

namespace mlf {
namespace cuda {

// Same semantics as the CPU kernels in kernels.h, on device memory. Each returns nullptr on
// success or CUDA's error string. `stream` is a cudaStream_t (nullptr = the legacy default
// stream); reduce, scale and axpy are queued on it and return without waiting.
const char* reduce(void* dst, const void* const* srcs, int k, size_t count, DType t, RedOp op,
                   double scale, void* stream);
const char* scale(void* x, size_t count, DType t, double alpha, void* stream);
const char* axpy(void* y, const void* x, size_t count, DType t, double alpha, void* stream);
// Waits for `stream`, then stores sqrt(sum x^2) (accumulated in float64) in *out.
const char* norm2(const void* x, size_t count, DType t, void* stream, double* out);

// Number of visible CUDA devices; 0 when there is no driver or no GPU.
int device_count();

}  // namespace cuda
}  // namespace mlf
