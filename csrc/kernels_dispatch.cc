// kernels_dispatch.cc — the public entry points of kernels.h: picks the kernel table (scalar,
// AVX2, AVX-512) once, from the CPU's features and MLFABRIC_ISA, and forwards every call to it.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels.h"
#include "kernels_table.h"

namespace mlf {
namespace {

constexpr int kNumIsas = 3;
const char* const kIsaNames[kNumIsas] = {"scalar", "avx2", "avx512"};

// The AVX2 and AVX-512 tables are built on x86 only (setup.py leaves their files out elsewhere);
// other CPUs have the scalar table alone, and MLFABRIC_ISA=avx2/avx512 is "not supported" there.
#if defined(__x86_64__) || defined(__i386__)
const KernelTable& table_of(int i) {
  switch (i) {
    case 2: return isa_avx512::table();
    case 1: return isa_avx2::table();
    default: return isa_scalar::table();
  }
}

// __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
bool cpu_supports(int i) {
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
              __builtin_cpu_supports("f16c");
  switch (i) {
    case 0: return true;
    case 1: return avx2;
    case 2: return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    default: return false;
  }
}
#else
const KernelTable& table_of(int) { return isa_scalar::table(); }

bool cpu_supports(int i) { return i == 0; }
#endif

int isa_index(const char* name) {
  for (int i = 0; name && i < kNumIsas; ++i)
    if (std::strcmp(name, kIsaNames[i]) == 0) return i;
  return -1;
}

int best_isa() {
  for (int i = kNumIsas - 1; i > 0; --i)
    if (cpu_supports(i)) return i;
  return 0;
}

// The first choice: MLFABRIC_ISA if it names one this CPU has, else the best. A bad value is
// reported once on stderr rather than failing: the kernels are correct on every ISA.
const KernelTable* initial_table() {
  const char* env = std::getenv("MLFABRIC_ISA");
  if (env && *env && std::strcmp(env, "auto") != 0) {
    int i = isa_index(env);
    if (i >= 0 && cpu_supports(i)) return &table_of(i);
    std::fprintf(stderr, "mlfabric: MLFABRIC_ISA=%s is %s; using %s\n", env,
                 i < 0 ? "not one of scalar, avx2, avx512, auto" : "not supported by this CPU",
                 kIsaNames[best_isa()]);
  }
  return &table_of(best_isa());
}

std::atomic<const KernelTable*> g_table{nullptr};

const KernelTable& current() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (t) return *t;
  const KernelTable* expected = nullptr;
  g_table.compare_exchange_strong(expected, initial_table(), std::memory_order_acq_rel);
  return *g_table.load(std::memory_order_acquire);
}

}  // namespace

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::f16: case DType::bf16: return 2;
  }
  return 0;
}

bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16;
}

void reduce(void* dst, const void* const* srcs, int k, size_t count, DType t, RedOp op,
            double scale) {
  current().reduce(dst, srcs, k, count, t, op, scale);
}

void scale(void* x, size_t count, DType t, double alpha) { current().scale(x, count, t, alpha); }

void axpy(void* y, const void* x, size_t count, DType t, double alpha) {
  current().axpy(y, x, count, t, alpha);
}

double norm2(const void* x, size_t count, DType t) { return current().norm2(x, count, t); }

void copy(void* dst, const void* src, size_t bytes) {
  if (bytes) current().copy(dst, src, bytes);
}

const char* isa() { return current().name; }

bool set_isa(const char* name) {
  int i = isa_index(name);
  if (i < 0 || !cpu_supports(i)) return false;
  g_table.store(&table_of(i), std::memory_order_release);
  return true;
}

}  // namespace mlf
