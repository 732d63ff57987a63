// kernels_scalar.cc — the baseline x86-64 build (SSE2 at most, what every x86-64 CPU has) of
// the CPU kernels in kernels_impl.h, exported as mlf::isa_scalar::table(): the fallback.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "kernels_table.h"

// No target pragma: this build must run everywhere.
#define MLF_ISA_NS isa_scalar
#define MLF_ISA_NAME "scalar"
#define MLF_ISA_LEVEL 0
#include "kernels_impl.h"
