"""The package's layering, as docs/design.md draws it: each layer imports only the layers below it
(read from the source, one process, no MPI), no module uses an old import path, and the old paths
still alias the moved modules for one release."""
import ast
import importlib
import os
import subprocess
import sys

import pytest

from tests.mpi_util import run_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "mlfabric")

# Bottom to top. A package may import its own layer's other members only where listed together in
# one tuple (they are independent of each other otherwise); `mlfabric` is the facade package
# (mlfabric/__init__.py), which re-exports comm: the layers above comm may use it.
LAYERS = [
    ("errors", "_C", "_version"),
    ("_core",),
    ("kernels",),
    ("comm", "mlfabric"),
    ("sched", "emulate", "workloads"),
    ("sim",),
    ("runtime",),
    ("ps",),
    ("pipeline",),
    ("torch",),
    ("bench",),
    ("info", "run"),
]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _imports(path, module):
    """(line, imported module) for every mlfabric import in the file, relative ones resolved."""
    is_pkg = path.endswith("__init__.py")
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[:len(base) - (node.level - 1)]
                                  + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "mlfabric":  # from mlfabric import x: x may be a sub-package
                for alias in node.names:
                    yield node.lineno, "mlfabric." + alias.name
            else:
                yield node.lineno, target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def _modules():
    for root, _, files in os.walk(PKG):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield path, module[:-len(".__init__")] if name == "__init__.py" else module


def _layer(module):
    parts = module.split(".")
    return "mlfabric" if len(parts) == 1 else parts[1]


def test_each_layer_imports_only_layers_below():
    upward = []
    for path, module in _modules():
        own = _layer(module)
        for line, target in _imports(path, module):
            if not target.startswith("mlfabric"):
                continue
            other = _layer(target)
            assert other in LEVEL, f"{module}:{line} imports {target}: a layer LAYERS does not know"
            if other != own and LEVEL[other] > LEVEL[own]:
                upward.append(f"{os.path.relpath(path, ROOT)}:{line} ({own}) imports {target} ({other})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_module_uses_an_old_path():
    from mlfabric._core.moved import MOVED
    old = []
    for path, module in _modules():
        if module == "mlfabric._core.moved":
            continue
        for line, target in _imports(path, module):
            if any(target == o or target.startswith(o + ".") for o in MOVED):
                old.append(f"{os.path.relpath(path, ROOT)}:{line} imports {target}")
    assert not old, "\n".join(old)


@pytest.mark.parametrize("old", sorted(importlib.import_module("mlfabric._core.moved").MOVED))
def test_old_path_is_the_moved_module(old):
    """In a fresh interpreter (the old name must not be cached yet): the same module object, and a
    DeprecationWarning naming the new path."""
    from mlfabric._core.moved import MOVED
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"import mlfabric, importlib, {MOVED[old]} as new\n"
            f"try:\n    importlib.import_module({old!r})\n"
            f"except DeprecationWarning as w:\n    assert {MOVED[old]!r} in str(w), w\n"
            f"else:\n    raise SystemExit('no warning')\n"
            f"warnings.simplefilter('ignore')\n"
            f"assert importlib.import_module({old!r}) is new\n")
    # from run_dir(): the tree's mlfabric, or (against an installed package) a directory without it
    out = subprocess.run([sys.executable, "-c", code], cwd=run_dir(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
