// kernels_table.h — the table of kernel entry points each instruction-set build exports
// (kernels_scalar.cc, kernels_avx2.cc, kernels_avx512.cc) and kernels_dispatch.cc chooses from.
#pragma once
#include <cstddef>

#include "kernels.h"

namespace mlf {

struct KernelTable {
  const char* name;  // "scalar", "avx2" or "avx512", as isa() reports it
  void (*reduce)(void* dst, const void* const* srcs, int k, size_t count, DType t, RedOp op,
                 double scale);
  void (*scale)(void* x, size_t count, DType t, double alpha);
  void (*axpy)(void* y, const void* x, size_t count, DType t, double alpha);
  double (*norm2)(const void* x, size_t count, DType t);
  void (*copy)(void* dst, const void* src, size_t bytes);
};

namespace isa_scalar { const KernelTable& table(); }
namespace isa_avx2 { const KernelTable& table(); }
namespace isa_avx512 { const KernelTable& table(); }

}  // namespace mlf
