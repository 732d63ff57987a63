"""Importing the package: a source tree without its built native module fails with a clear "build
it first" error (as numpy's does), a native module that does not load says so, and dir(mlfabric)
lists the lazily imported API. The unbuilt tree is a copy of mlfabric/'s .py files in a temporary
directory, imported by a Python started with -S: no site-packages, so no editable-install finder
maps mlfabric._C back to this checkout's build (the package fails before it needs anything else)."""
import os
import shutil
import subprocess
import sys

import pytest

from tests.mpi_util import ROOT


@pytest.fixture
def unbuilt(tmp_path):
    src = os.path.join(ROOT, "mlfabric")
    shutil.copytree(src, tmp_path / "mlfabric",
                    ignore=lambda d, names: [n for n in names if not n.endswith(".py")
                                             and not os.path.isdir(os.path.join(d, n))])
    assert not list((tmp_path / "mlfabric").glob("_C*"))
    return tmp_path


def _import(path):
    code = f"import sys; sys.path.insert(0, {str(path)!r}); import mlfabric"
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=str(path),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)


def test_unbuilt_tree_says_build_it_first(unbuilt):
    proc = _import(unbuilt)
    assert proc.returncode != 0
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ImportError: mlfabric's native module mlfabric._C is not built: run "
                           "`pip install -e .`"), proc.stdout
    assert "build_ext --inplace" in last and str(unbuilt) in last, last
    # The original error is chained, not hidden.
    assert "direct cause of the following exception" in proc.stdout, proc.stdout


def test_native_module_that_does_not_load_says_so(unbuilt):
    (unbuilt / "mlfabric" / "_C.so").write_bytes(b"not a shared object")
    proc = _import(unbuilt)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode != 0 and "mlfabric._C does not load" in last, proc.stdout


def test_dir_lists_the_lazy_api():
    import mlfabric
    names = dir(mlfabric)
    assert names == sorted(names)
    for name in mlfabric.__all__:
        assert name in names, name
    assert {"init", "allreduce", "shared_empty", "Handle"} <= set(names)


def test_version_has_one_source():
    import mlfabric
    from mlfabric import _version
    assert mlfabric.__version__ == _version.__version__
    with open(os.path.join(ROOT, "setup.py")) as f:
        setup_py = f.read()
    assert "version=read_version()" in setup_py and _version.__version__ not in setup_py
