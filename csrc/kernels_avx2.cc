// kernels_avx2.cc — the AVX2 + FMA + F16C build of the CPU kernels in kernels_impl.h, exported
// as mlf::isa_avx2::table(); kernels_dispatch.cc uses it only on CPUs that have those.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "kernels_table.h"

// After the standard includes, so only this file's own code is built for the target.
#pragma GCC target("avx2,fma,f16c")
#define MLF_ISA_NS isa_avx2
#define MLF_ISA_NAME "avx2"
#define MLF_ISA_LEVEL 1
#include "kernels_impl.h"
