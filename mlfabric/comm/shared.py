"""mlfabric-allocated shared buffers: arrays that live in host shared memory, so collectives on
them skip the copy into the engine's staging area and read peers' data in place (zero-copy). The
fusion buffers of the training layers live here. Owns shared_empty/shared_zeros/is_shared."""
import math

import numpy as np

from .._core import dtypes as _dtypes
from .._core.buffers import dtype_of
from . import context, header
from .call import exchange_headers, run
from .shm import ShmAllocError, ShmSpaceError


def shared_empty(shape, dtype=np.float32):
    """Collective: a new uninitialised array of `shape` in shared memory on every rank.

    dtype may be a numpy dtype (returns an ndarray) or a torch dtype (returns a CPU tensor). All
    ranks must pass the same shape and dtype (checked: a MismatchError on every rank). When the
    ranks do not share one host (or MLFABRIC_SHM=0) this is a plain private array. The memory is
    freed by finalize(): do not use the array after it.

    When the filesystem behind shared memory (/dev/shm) has too little free space, every rank
    raises ShmSpaceError (an MlfabricError naming it and how to enlarge it) and the job can go
    on; the memory is taken at once (not at first touch), so running short shows here."""
    what = "shared_empty"

    def prepare(ctx):
        dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"shared_empty: negative dimension in {dims}")
        np_dtype, torch_dtype, code = dtype_of(dtype)
        count = math.prod(dims)

        def body(hdr):
            exchange_headers(ctx, what, hdr)
            if ctx.shm is None:
                if torch_dtype is not None:
                    import torch
                    return torch.empty(dims, dtype=torch_dtype)
                return np.empty(dims, np_dtype)
            try:
                alloc = ctx.shm.allocate(count * _dtypes.ITEMSIZE[code], what)
            except ShmSpaceError as exc:
                # every rank has it, in step: returned, so that the call ends as a finished
                # one (the communicator stays usable), and raised below
                return exc
            except ShmAllocError:
                # MPI failed here after the ranks agreed there was room: peers may wait inside
                # its allocation for good, so nothing collective can finish (finalize frees
                # nothing, and the exit is bounded)
                ctx.abandoned = True
                raise
            mem = alloc.win.tomemory()
            if torch_dtype is not None:
                import torch
                if count == 0:
                    return torch.empty(dims, dtype=torch_dtype)
                return torch.frombuffer(mem, dtype=torch_dtype, count=count).view(dims)
            return np.frombuffer(mem, np_dtype, count=count).reshape(dims)
        return header.make(what, code, shape=dims), body

    result = run(what, prepare)
    if isinstance(result, ShmSpaceError):
        raise result
    return result


def shared_zeros(shape, dtype=np.float32):
    """Collective: shared_empty() filled with zeros."""
    x = shared_empty(shape, dtype)
    x[...] = 0
    return x


def is_shared(x):
    """True when x lives in an mlfabric shared buffer (collectives on it run zero-copy)."""
    from .._core.buffers import wrap
    from .._core.device import is_device
    ctx = context.get()
    if ctx.shm is None or is_device(x):
        return False
    b = wrap(x)
    return not b.copied and ctx.shm.lookup(b.ptr, b.nbytes) is not None
