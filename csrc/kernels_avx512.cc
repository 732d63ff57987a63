// kernels_avx512.cc — the AVX-512 (F + BW) build of the CPU kernels in kernels_impl.h, exported
// as mlf::isa_avx512::table(); kernels_dispatch.cc uses it only on CPUs that have those.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "kernels_table.h"

// After the standard includes, so only this file's own code is built for the target. 512-bit
// vectors are asked for explicitly: gcc's generic tuning may otherwise stay at 256.
#pragma GCC target("avx512f,avx512bw,avx2,fma,f16c,prefer-vector-width=512")
// gcc 12 warns inside its own headers: _mm256_undefined_si256() initialises a value from itself.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define MLF_ISA_NS isa_avx512
#define MLF_ISA_NAME "avx512"
#define MLF_ISA_LEVEL 2
#include "kernels_impl.h"
