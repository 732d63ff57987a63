"""mlfabric-allocated shared buffers: arrays that live in host shared memory, so collectives on
them skip the copy into the engine's staging area and read peers' data in place (zero-copy). The
fusion buffers of the training layers live here. Owns shared_empty/shared_zeros/is_shared."""
import numpy as np

from . import context
from .comm.shm import dtype_of


def shared_empty(shape, dtype=np.float32):
    """Collective: a new uninitialised array of `shape` in shared memory on every rank.

    dtype may be a numpy dtype (returns an ndarray) or a torch dtype (returns a CPU tensor). When
    the ranks do not share one host (or MLFABRIC_SHM=0) this is a plain private array. The memory
    is freed by finalize(): do not use the array after it."""
    ctx = context.get()
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    np_dtype, torch_dtype, code = dtype_of(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    itemsize = np_dtype.itemsize if np_dtype is not None else (2 if code in (2, 3) else
                                                                 (4 if code in (0, 4) else 8))
    if ctx.shm is None:
        if torch_dtype is not None:
            import torch
            return torch.empty(shape, dtype=torch_dtype)
        return np.empty(shape, np_dtype)
    alloc = ctx.shm.allocate(count * itemsize)
    mem = alloc.win.tomemory()
    if torch_dtype is not None:
        import torch
        if count == 0:
            return torch.empty(shape, dtype=torch_dtype)
        return torch.frombuffer(mem, dtype=torch_dtype, count=count).view(shape)
    return np.frombuffer(mem, np_dtype, count=count).reshape(shape)


def shared_zeros(shape, dtype=np.float32):
    """Collective: shared_empty() filled with zeros."""
    x = shared_empty(shape, dtype)
    x[...] = 0
    return x


def is_shared(x):
    """True when x lives in an mlfabric shared buffer (collectives on it run zero-copy)."""
    from ._buffers import wrap
    ctx = context.get()
    if ctx.shm is None:
        return False
    b = wrap(x)
    return not b.copied and ctx.shm.lookup(b.ptr, b.nbytes) is not None
