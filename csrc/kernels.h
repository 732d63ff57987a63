// kernels.h — the elementwise kernels of mlfabric's native core: reduce (sum/prod/min/max over k
// buffers, with an optional scale), scale, axpy, L2 norm and copy, for the six wire dtypes.
// Owns: the contract of every kernel and the run-time choice of instruction set (scalar, AVX2,
// AVX-512). Never touches MPI, Python or the GIL: callers convert arguments first and release the
// GIL around these calls.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mlf {

// Codes shared with mlfabric/_core/dtypes.py; keep in step.
enum class DType : int { f32 = 0, f64 = 1, f16 = 2, bf16 = 3, i32 = 4, i64 = 5 };
enum class RedOp : int { sum = 0, prod = 1, min = 2, max = 3 };
constexpr int kNumDTypes = 6;
constexpr int kNumOps = 4;

size_t dtype_size(DType t);
bool is_floating(DType t);

// dst[i] = scale * op(srcs[0][i], ..., srcs[k-1][i]) for i < count, k >= 1.
// dst may alias any srcs[j] exactly (never a partial overlap). float16/bfloat16 accumulate in
// float32 and round once per element. scale != 1 is only allowed for floating dtypes (the caller
// checks); integer ops wrap around on overflow, as MPI's do.
void reduce(void* dst, const void* const* srcs, int k, size_t count, DType t, RedOp op, double scale);

// x[i] *= alpha (floating dtypes only).
void scale(void* x, size_t count, DType t, double alpha);

// y[i] += alpha * x[i] (floating dtypes only); y and x do not overlap.
void axpy(void* y, const void* x, size_t count, DType t, double alpha);

// sqrt(sum x[i]^2), accumulated in float64.
double norm2(const void* x, size_t count, DType t);

// memcpy with the best available instruction set (the ceiling the reduce kernels are measured
// against, and the copy-in/copy-out of the shared-memory engine).
void copy(void* dst, const void* src, size_t bytes);

// Instruction set in use: "scalar", "avx2" or "avx512". set_isa() forces one (for tests and
// benchmarks); it returns false when the CPU lacks it or the name is unknown, leaving the choice
// unchanged. The first choice is the best the CPU has, unless MLFABRIC_ISA names another.
const char* isa();
bool set_isa(const char* name);

}  // namespace mlf
