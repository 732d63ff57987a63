"""The native core's platform guards: compiled as for a CPU other than x86 (aarch64) and an OS other
than Linux, from this x86-64 Linux machine. The standard headers are included first, as the host
builds them; then the CPU and OS macros are taken away, so only mlfabric's own code sees "another
platform": the scalar kernels must build and link without the AVX tables or <immintrin.h> and give
the right sums (their streaming stores become plain copies), and the shared-memory engine must
compile without process_vm_readv's Linux guard. What this cannot show: a real aarch64 or macOS
compiler's headers (no cross-compiler here)."""
import os
import shutil
import subprocess

import pytest

from tests.mpi_util import ROOT

CSRC = os.path.join(ROOT, "csrc")

PRELUDE = """
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>
#include <sched.h>
#include <sys/uio.h>
#include <unistd.h>
#undef __x86_64__
#undef __x86_64
#undef __amd64__
#undef __amd64
#undef __i386__
#ifdef MLF_TEST_NOT_LINUX
#undef __linux__
#undef __linux
#undef linux
#endif
"""

# Sums over three sources of 3 M elements (past the 4 MiB streaming-store threshold) and of a
# short tail; small integers, exact in every dtype.
MAIN = r"""
#include <cstdio>
#include <cstring>
#include <vector>
#include "kernels.h"

template <class T>
static int check(mlf::DType t, T one, T two, T three, T six, size_t n) {
  std::vector<T> a(n, one), b(n, two), c(n, three), out(n + 1, T{});
  const void* srcs[3] = {a.data(), b.data(), c.data()};
  mlf::reduce(out.data(), srcs, 3, n, t, mlf::RedOp::sum, 1.0);
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(&out[i], &six, sizeof(T)) != 0) {
      std::printf("dtype %d: element %zu of %zu wrong\n", int(t), i, n);
      return 1;
    }
  std::vector<T> copied(n);
  mlf::copy(copied.data(), out.data(), n * sizeof(T));
  return std::memcmp(copied.data(), out.data(), n * sizeof(T)) != 0;
}

int main() {
  int bad = 0;
  for (size_t n : {size_t(3) << 20, size_t(1000)}) {
    bad += check<float>(mlf::DType::f32, 1.f, 2.f, 3.f, 6.f, n);
    bad += check<double>(mlf::DType::f64, 1., 2., 3., 6., n);
    bad += check<int>(mlf::DType::i32, 1, 2, 3, 6, n);
    bad += check<unsigned short>(mlf::DType::f16, 0x3C00, 0x4000, 0x4200, 0x4600, n);
    bad += check<unsigned short>(mlf::DType::bf16, 0x3F80, 0x4000, 0x4040, 0x40C0, n);
  }
  std::printf("isa %s avx2 %d avx512 %d bad %d\n", mlf::isa(), int(mlf::set_isa("avx2")),
              int(mlf::set_isa("avx512")), bad);
  return bad != 0;
}
"""


@pytest.fixture(scope="module")
def gxx():
    found = shutil.which(os.environ.get("CXX", "g++"))
    if found is None:
        pytest.skip("needs a C++ compiler")
    return found


def _compile(gxx, tmp_path, args, timeout=300):
    prelude = tmp_path / "prelude.h"
    prelude.write_text(PRELUDE)
    return subprocess.run([gxx, "-std=c++17", "-Wall", "-include", str(prelude), "-I", CSRC,
                           *args], cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def test_scalar_kernels_build_and_add_up_on_another_cpu(gxx, tmp_path):
    (tmp_path / "main.cc").write_text(MAIN)
    # No kernels_avx2.cc / kernels_avx512.cc: setup.py leaves them out on other CPUs.
    proc = _compile(gxx, tmp_path, ["-O1", os.path.join(CSRC, "kernels_scalar.cc"),
                                    os.path.join(CSRC, "kernels_dispatch.cc"), "main.cc",
                                    "-o", "kernels_other_cpu"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    run = subprocess.run([str(tmp_path / "kernels_other_cpu")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120)
    assert run.returncode == 0, run.stdout
    assert run.stdout.strip() == "isa scalar avx2 0 avx512 0 bad 0", run.stdout


def test_avx_kernels_refuse_another_cpu(gxx, tmp_path):
    proc = _compile(gxx, tmp_path, ["-fsyntax-only", os.path.join(CSRC, "kernels_avx2.cc")])
    assert proc.returncode != 0 and "built for x86 only" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("not_linux", [False, True], ids=["aarch64-linux", "not-linux"])
def test_shm_engine_compiles_on_another_platform(gxx, tmp_path, not_linux):
    proc = _compile(gxx, tmp_path, ["-fsyntax-only", "-Werror",
                                    *(["-DMLF_TEST_NOT_LINUX"] if not_linux else []),
                                    os.path.join(CSRC, "shm_engine.cc")])
    assert proc.returncode == 0, proc.stdout[-4000:]
