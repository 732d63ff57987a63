// kernels_scalar.cc — the baseline build of the CPU kernels in kernels_impl.h, exported as
// mlf::isa_scalar::table(): the fallback. On x86 it uses SSE2 at most (what every x86-64 CPU
// has); on other CPUs (e.g. aarch64) it is plain C++, the only kernel table built there.
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "kernels_table.h"

// No target pragma: this build must run everywhere.
#define MLF_ISA_NS isa_scalar
#define MLF_ISA_NAME "scalar"
#define MLF_ISA_LEVEL 0
#include "kernels_impl.h"
