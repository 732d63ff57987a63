"""The package as a user gets it: the source distribution carries the native sources (csrc/*.h,
csrc/cuda/*.cu), a wheel builds from the unpacked sdist alone (CPU-only, MLFABRIC_CUDA=0), and that
wheel installed into a fresh virtual environment works from outside the source tree: mlfabric is
the venv's copy, an allreduce on 2 ranks is right, and this suite's unit tests and an MPI test
module pass against it (tests/mpi_util.py keeps the tree off the ranks' path): the unit tests and
one MPI module, not the whole suite run twice; a few minutes in all (the C++ build dominates).
Dependencies come from the configured package index (pip's own settings)."""
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile

import pytest

from tests.mpi_util import ROOT, shared_memory_btl

pytestmark = pytest.mark.mpi

ALLREDUCE = """
import sys
import numpy as np
import mlfabric as mf
assert mf.__file__.startswith(sys.prefix), (mf.__file__, sys.prefix)
mf.init()
for n in (1000, 1 << 20):
    y = mf.allreduce(np.full(n, mf.rank() + 1.0, dtype=np.float32))
    assert np.all(y == sum(range(1, mf.size() + 1))), y[:4]
print("rank", mf.rank(), "of", mf.size(), "ok", mf.__version__, mf.__file__)
mf.finalize()
"""


def _run(cmd, cwd, env=None, timeout=600):
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} (rc={proc.returncode}):\n" \
                                 f"{proc.stdout[-6000:]}"
    return proc.stdout


def _checkout_copy(dst):
    """The files a clone would have (tracked, plus new ones not ignored): no build outputs."""
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("needs a git checkout")
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           cwd=ROOT, stdout=subprocess.PIPE, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, f)):
            os.makedirs(os.path.join(dst, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f))


def _clean_env(**extra):
    """No PYTHONPATH or active venv of the calling shell: the fresh venv's interpreter finds only its
    own packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV",
                                                             "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def test_sdist_builds_a_wheel_that_works_installed(tmp_path):
    src, dist, outside = tmp_path / "src", tmp_path / "dist", tmp_path / "elsewhere"
    for d in (src, dist, outside):
        d.mkdir()
    _checkout_copy(src)

    # 1. the source distribution (the build tools of this environment: no download)
    try:
        import build  # noqa: F401
        _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(dist)],
             cwd=src)
    except ImportError:
        _run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(dist)], cwd=src)
    (sdist,) = dist.glob("mlfabric-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0]
        members = {n.split("/", 1)[1] for n in names if "/" in n}
        for must in ("LICENSE", "README.md", "CHANGES.md", "MANIFEST.in", "setup.py",
                     "pyproject.toml", "csrc/sched_fast.h", "csrc/kernels_impl.h",
                     "csrc/shm_engine.h", "csrc/cuda/kernels.cu", "mlfabric/py.typed",
                     "mlfabric/_version.py"):
            assert must in members, f"{must} missing from {sdist.name}"
        headers = {f"csrc/{os.path.basename(h)}" for h in os.listdir(os.path.join(ROOT, "csrc"))
                   if h.endswith(".h")}
        assert headers <= members, headers - members
        assert not [m for m in members if m.endswith((".so", ".o", ".pyc"))
                    or m.startswith(("benchmarks/results", "build/"))], members
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path / "unpacked", **safe)
    unpacked = tmp_path / "unpacked" / top

    # 2. a wheel from the unpacked sdist alone, CPU-only
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--wheel-dir", str(dist), str(unpacked)], cwd=outside,
         env=_clean_env(MLFABRIC_CUDA="0", PATH=os.environ["PATH"]), timeout=900)
    (wheel,) = dist.glob("mlfabric-*.whl")

    # 3. a fresh venv with the wheel and what it depends on; pytest for step 5
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=outside)
    py = str(venv / "bin" / "python")
    env = _clean_env(PATH=str(venv / "bin") + os.pathsep + os.environ["PATH"])
    _run([py, "-m", "pip", "install", "-q", str(wheel), "pytest"], cwd=outside, env=env,
         timeout=600)
    for script in ("mlfabric-bench", "mlfabricrun"):
        assert (venv / "bin" / script).exists(), script

    # 4. from outside the tree: the installed copy, and a 2-rank allreduce with it
    info = _run([py, "-c", "import mlfabric, os; print(mlfabric.__file__, mlfabric.__version__, "
                 "os.path.exists(os.path.join(os.path.dirname(mlfabric.__file__), 'py.typed')))"],
                cwd=outside, env=env).split()
    assert info[0].startswith(str(venv)) and info[2] == "True", info
    mpirun = shutil.which("mpirun", path=env["PATH"])
    assert mpirun, "mpirun not found in the venv or on PATH"
    mpi_env = dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_btl="self," + shared_memory_btl(), OMPI_MCA_osc="^ucx",
                   MLFABRIC_TIMEOUT="60")
    out = _run([mpirun, "--oversubscribe", "-n", "2", py, "-c", ALLREDUCE], cwd=outside,
               env=mpi_env, timeout=240)
    assert out.count(" ok ") == 2 and str(venv) in out, out

    # 5. this suite's unit tests and an MPI test module, run by pytest against the installed
    # package, from the copy of the checkout (its mlfabric/ has no built _C, as in a fresh clone):
    # the tree is only appended to the path (for tests/), and the harness keeps it off the ranks'
    # path. The test dependencies (torch, hypothesis, ...) come from this environment, appended
    # after the venv's own packages, so mlfabric is still the wheel's. The build tests are left
    # out: they compile the tree, not the package.
    with open(_site_packages(py) / "test-deps.pth", "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    probe = ("import os, sys; sys.path.append(sys.argv[1]); from tests import mpi_util as m; "
             "import mlfabric, torch; e = m.mpi_env(); print(m.mlfabric_from_tree(), "
             "os.path.exists(os.path.join(m.run_dir(), 'mlfabric')), "
             "sys.argv[1] in e['PYTHONPATH'].split(os.pathsep), "
             "mlfabric.__file__.startswith(sys.prefix))")
    assert _run([py, "-c", probe, str(src)], cwd=outside, env=env).split() == \
        ["False", "False", "False", "True"]
    out = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=append",
                "--rootdir", str(src), str(src / "tests" / "unit"),
                "--ignore", str(src / "tests" / "unit" / "test_build.py"),
                "--ignore", str(src / "tests" / "unit" / "test_platform_guards.py"),
                str(src / "tests" / "mpi" / "test_init.py")], cwd=outside, env=mpi_env,
               timeout=900)
    assert " passed" in out and " failed" not in out and " error" not in out, out[-3000:]


def _site_packages(py):
    import pathlib
    return pathlib.Path(subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        stdout=subprocess.PIPE, text=True, check=True).stdout.strip())
