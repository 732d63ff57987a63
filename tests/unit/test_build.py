"""The build's CUDA switch: MLFABRIC_CUDA=0 gives a CPU-only module that needs no nvcc, a bad
value is an error, and so is an NVCC that is not an executable. Builds run in a copy of the
tracked sources, so the checkout's own build is untouched."""
import os
import shutil
import subprocess
import sys

import pytest

from tests.mpi_util import ROOT


def _copy_sources(dst):
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                           check=True).stdout.split()
    for f in files:
        if f.startswith(("setup.py", "pyproject.toml", "csrc/", "mlfabric/")):
            os.makedirs(os.path.join(dst, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f))


def _build(src, **env):
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=src, env=e,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("needs a git checkout")
    d = str(tmp_path_factory.mktemp("build"))
    _copy_sources(d)
    return d


def test_bad_cuda_flag_is_an_error(src):
    proc = _build(src, MLFABRIC_CUDA="yes")
    assert proc.returncode != 0 and "MLFABRIC_CUDA must be 0, 1 or unset" in proc.stdout


def test_missing_nvcc_is_an_error(src):
    proc = _build(src, MLFABRIC_CUDA="1", NVCC="/nonexistent/nvcc")
    assert proc.returncode != 0 and "is not an executable" in proc.stdout


def test_cpu_only_build_needs_no_nvcc(src):
    proc = _build(src, MLFABRIC_CUDA="0", PATH=os.pathsep.join(
        [os.path.dirname(sys.executable), "/usr/bin", "/bin"]))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "CUDA kernels OFF" in proc.stdout and "nvcc" not in proc.stdout.replace(
        "CUDA kernels OFF", "")
    check = subprocess.run([sys.executable, "-c", "import mlfabric._C as C; print(C.cuda_built())"],
                           cwd=src, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=60)
    assert check.stdout.strip() == "False", check.stdout
