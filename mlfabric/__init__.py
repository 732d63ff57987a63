"""mlfabric: a communication library for distributed ML training on MPI.

Public API (this ``__all__`` is the contract; everything else is private)::

    init(comm=None), finalize(), initialized(), rank(), size(), local_rank(), local_size(),
    cross_rank(), cross_size(), is_homogeneous()
    allreduce(x, op="sum", out=None, algorithm="auto"), reduce, broadcast(x, root=0),
    allgather(x), reduce_scatter(x, op="sum"), barrier(), send, recv, *_async -> Handle,
    isend, irecv -> Request
    shared_empty / shared_zeros / is_shared (zero-copy shared buffers)
    cuda_built(), MlfabricError and its subclasses
"""
import os as _os

# Open MPI's UCX one-sided component prints an error when it declines to run on a host without
# UCX devices; mlfabric's shared windows use the shared-memory component anyway. Only a default,
# and only where no UCX device exists (there, the user's own one-sided MPI keeps UCX): it has no
# effect if MPI is already initialised or the user chose osc components.
from .comm.launch import ucx_device_present as _ucx_device_present  # noqa: E402

if not _ucx_device_present():
    _os.environ.setdefault("OMPI_MCA_osc", "^ucx")

import importlib as _importlib  # noqa: E402

try:
    from . import _C  # noqa: E402
except ImportError as _exc:
    # Importing the source tree before its native module is built: say so, as numpy does, rather
    # than fail later with a confusing partial import.
    from importlib.machinery import EXTENSION_SUFFIXES as _suffixes
    _here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _built = any(_os.path.exists(_os.path.join(_here, "mlfabric", "_C" + s)) for s in _suffixes)
    _what = "does not load (%s)" % _exc if _built else "is not built"
    raise ImportError(
        f"mlfabric's native module mlfabric._C {_what}: run `pip install -e .` (or `python "
        f"setup.py build_ext --inplace`) in {_here}, or import mlfabric from outside its source "
        "tree") from _exc
from ._core import exit_guard as _exit_guard  # noqa: E402,F401 (its exit handler runs last)
from ._core import moved as _moved  # noqa: E402
from .errors import (ConcurrentCallError, MismatchError, MlfabricError,  # noqa: E402
                     NotInitializedError, PeerTimeoutError)

# The communication API is imported on first use (PEP 562), not with the package: importing MPI
# (and torch, for tensor support) takes seconds, and mlfabric.sched / mlfabric.sim are pure
# computation that must not pay for it or start MPI.
_LAZY = {name: ".comm.collectives" for name in (
    "Handle", "allgather", "allgather_async", "allreduce", "allreduce_async", "alltoall",
    "alltoall_async", "barrier",
    "broadcast", "broadcast_async", "irecv", "isend", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_async", "Request", "send")}
_LAZY.update({name: ".comm.context" for name in ("finalize", "init", "initialized")})
_LAZY.update({name: ".comm.shared" for name in ("is_shared", "shared_empty", "shared_zeros")})


_moved.install()


def __dir__():
    # The lazily imported API is listed before its first use, as tab completion expects.
    return sorted(set(globals()) | set(_LAZY))


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError("module 'mlfabric' has no attribute %r" % name)
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def _get():
    from .comm.context import get
    return get()


from ._version import __version__  # noqa: E402


def rank():
    """This process's rank in mlfabric's communicator."""
    return _get().rank


def size():
    """Number of ranks in mlfabric's communicator."""
    return _get().size


def local_rank():
    """This process's rank among the ranks on its host."""
    return _get().local_rank


def local_size():
    """Number of ranks on this host."""
    return _get().local_size


def cross_rank():
    """This host's index among the hosts that run a rank with this rank's local rank (Horovod's
    cross_rank: the rank in the communicator of the ranks with the same local rank)."""
    return _get().cross_rank


def cross_size():
    """Number of hosts that run a rank with this rank's local rank (every host, when each runs
    as many ranks)."""
    return _get().cross_size


def is_homogeneous():
    """True when every host runs the same number of ranks."""
    return _get().homogeneous


def cuda_built():
    """True when the native core was compiled with CUDA kernels (nvcc found at build time)."""
    return bool(_C.cuda_built())


def nccl_built():
    """True when GPU arrays can move over NCCL: libnccl can be loaded (it is found at run time,
    not built in; see comm/nccl.py)."""
    from .comm import nccl
    return nccl.available()


__all__ = ["init", "finalize", "initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "is_homogeneous",
           "allreduce", "allreduce_async", "reduce", "broadcast", "broadcast_async", "allgather",
           "allgather_async", "reduce_scatter", "reduce_scatter_async", "barrier", "send", "recv",
           "isend", "irecv", "Request", "Handle", "shared_empty", "shared_zeros", "is_shared", "cuda_built", "nccl_built",
           "MlfabricError", "MismatchError", "NotInitializedError", "PeerTimeoutError",
           "ConcurrentCallError",
           "__version__", "alltoall", "alltoall_async"]
