"""Old import paths of modules that moved (into mlfabric.comm, mlfabric._core, mlfabric.runtime), kept
one release: `import mlfabric.collectives` gives the module object of mlfabric.comm.collectives
(the same object, so monkeypatching either name patches both) and a DeprecationWarning naming the
new path. CHANGES.md lists the moves; this table is removed in the release after."""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "mlfabric.collectives": "mlfabric.comm.collectives",
    "mlfabric.gpu_collectives": "mlfabric.comm.gpu_collectives",
    "mlfabric.context": "mlfabric.comm.context",
    "mlfabric.shared": "mlfabric.comm.shared",
    "mlfabric.respawn": "mlfabric.comm.respawn",
    "mlfabric.progress": "mlfabric._core.progress",
    "mlfabric.exit_guard": "mlfabric._core.exit_guard",
    "mlfabric._config": "mlfabric._core.config",
    "mlfabric._dtypes": "mlfabric._core.dtypes",
    "mlfabric._buffers": "mlfabric._core.buffers",
    "mlfabric._device": "mlfabric._core.device",
    "mlfabric.ps.checkpoint": "mlfabric.runtime.checkpoint",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn("%s moved to %s; the old path goes away in the next release"
                      % (spec.name, new), DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module):
        # The module is the new one, already executed; the import system then binds it under the old
        # name in sys.modules, which is what makes both names one object.
        pass


def install():
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
