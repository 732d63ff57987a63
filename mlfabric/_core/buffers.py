"""Turns what users pass (numpy arrays, CPU torch tensors) into a contiguous numpy view of the same
memory plus a wire dtype code, without copying when the input is contiguous. Owns the rules for
non-contiguous input: such an array is copied into a contiguous temporary, and for outputs the
result is copied back (documented in the README). Never communicates."""
import sys

import numpy as np

from . import dtypes as _dtypes
from ..errors import MlfabricError

_TORCH_CODES = {}   # torch dtype -> wire code, filled at the first tensor


def _torch():
    """torch if this process has imported it, else None. A tensor or a torch dtype can only
    exist once it has, so the checks below never import it themselves: a process that never
    uses torch (a parameter-server job) is spared its import (about a second) and the garbage
    collector's passes over its objects (tens of ms per full collection)."""
    torch = sys.modules.get("torch")
    if torch is not None and not _TORCH_CODES and hasattr(torch, "bfloat16"):
        _TORCH_CODES.update({torch.float32: 0, torch.float64: 1, torch.float16: 2,
                             torch.bfloat16: 3, torch.int32: 4, torch.int64: 5})
    return torch


def torch_codes():
    """torch dtype -> wire code ({} while torch is not imported)."""
    _torch()
    return _TORCH_CODES


class Buf:
    """A contiguous view (`arr`, 1-D, storage dtype) of a user array.

    `obj` is what the user passed; `shape` its shape; `code` the wire dtype; `copied` says `arr` is
    a temporary (write back with `writeback()` when `obj` is an output)."""

    __slots__ = ("obj", "arr", "shape", "code", "copied")

    def __init__(self, obj, arr, shape, code, copied):
        self.obj, self.arr, self.shape, self.code, self.copied = obj, arr, shape, code, copied

    @property
    def count(self):
        return self.arr.size

    @property
    def nbytes(self):
        return self.arr.nbytes

    @property
    def ptr(self):
        return self.arr.__array_interface__["data"][0]

    def writeback(self):
        """Copy a temporary back into the user's (non-contiguous) array."""
        if not self.copied:
            return
        src = self.arr.reshape(self.shape)
        if is_torch(self.obj):
            torch = _torch()
            t = torch.from_numpy(src)
            if self.code == 3:
                t = t.view(torch.bfloat16)
            self.obj.copy_(t)
        else:
            np.copyto(self.obj, src.view(self.obj.dtype))


_OVERLAP_EXACT_MAX = 1 << 22  # elements whose offsets elements_overlap compares one by one


def elements_overlap(shape, strides, itemsize):
    """Whether two elements of an array overlap in memory: a stride of 0 (an expanded tensor, a
    broadcast array) or strides that interleave (as_strided). Strides and itemsize in one unit."""
    if 0 in shape:
        return False
    dims = sorted((abs(s), k) for s, k in zip(strides, shape) if k > 1)
    if dims and dims[0][0] == 0:
        return True  # stride 0: every element of that dimension is one
    count = 1
    for _, k in dims:
        count *= k
    if count * itemsize > sum(s * (k - 1) for s, k in dims) + itemsize:
        return True  # more elements than the memory they span can hold apart
    span = itemsize  # the memory one step of the next (larger) stride must clear
    for stride, k in dims:
        if stride < span:  # the blocks may interleave: compare every element's start
            if count > _OVERLAP_EXACT_MAX:
                return True  # too many to compare; refused as if they overlapped
            starts = np.zeros(1, np.int64)
            for s, n in dims:
                starts = np.add.outer(starts, np.arange(n, dtype=np.int64) * s).ravel()
            return bool((np.diff(np.sort(starts)) < itemsize).any())
        span += stride * (k - 1)
    return False


def _check_apart(x, strides, itemsize, name):
    """ValueError when elements of output x share memory (an expanded tensor, a broadcast
    array, rows of an as_strided one that interleave)."""
    contiguous = x.is_contiguous() if is_torch(x) else x.flags.c_contiguous
    if not contiguous and elements_overlap(x.shape, strides, itemsize):
        raise ValueError(f"{name} cannot take the result in place: elements of it share memory "
                         "(an expanded tensor, a broadcast array?); pass an array of its own "
                         "(.clone(), .copy())")


def is_torch(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def numpy_view(x):
    """A numpy array on x's memory when x is a contiguous CPU torch tensor of a dtype numpy has
    (not bfloat16), else None: what the collectives' direct path runs on."""
    torch = _torch()
    if torch is None or not isinstance(x, torch.Tensor) or x.device.type != "cpu" or \
            x.dtype not in _TORCH_CODES or x.dtype == torch.bfloat16 or not x.is_contiguous():
        return None
    return x.detach().numpy()


def from_numpy(arr):
    """A CPU torch tensor on arr's memory (torch is imported: a tensor came in)."""
    return _torch().from_numpy(arr)


def wrap(x, name="x", writable=False):
    """Buf for x (numpy ndarray or CPU torch tensor). TypeError for other types, dtypes and
    layouts (sparse); ValueError when writable is asked for and x is a read-only numpy array, or
    an array whose elements share memory (written back element by element, it would keep one
    of their results). Refused here, before a call, as what would fail only after the data
    moved would leave this rank raising while its peers have their results."""
    if is_torch(x):
        if x.layout != _torch().strided:
            raise TypeError(f"{name} is a {x.layout} tensor; mlfabric moves dense (strided) "
                            f"tensors only: pass {name}.to_dense()")
        if x.device.type != "cpu":
            raise MlfabricError(f"{name} is on {x.device}: this call moves host arrays only (GPU "
                                "arrays go over NCCL in allreduce, reduce, broadcast, allgather, "
                                "reduce_scatter and alltoall, with every array of the call on "
                                "the GPU); move the tensor to the CPU")
        if x.dtype not in _TORCH_CODES:
            raise TypeError(f"unsupported dtype {x.dtype} for {name}; mlfabric supports "
                            f"{', '.join(_dtypes.DTYPE_NAMES)}")
        code = _TORCH_CODES[x.dtype]
        if writable:
            _check_apart(x, x.stride(), 1, name)
        # Detached: results are written outside autograd, into a leaf that requires grad too,
        # in any layout (the copy back into a non-contiguous one as well).
        obj = t = x.detach()
        copied = not t.is_contiguous() or t.is_neg()
        if t.is_neg():  # lazily negated (a conjugate's .imag): numpy cannot view it
            t = t.resolve_neg()
        if copied:
            t = t.contiguous()
        if code == 3:
            t = t.view(_torch().int16)
        arr = t.numpy().reshape(-1)
        if code == 3:
            arr = arr.view(np.uint16)
        return Buf(obj, arr, tuple(x.shape), code, copied)
    if isinstance(x, np.ndarray):
        if writable and not x.flags.writeable:
            raise ValueError(f"{name} is a read-only array; mlfabric writes the result into it")
        if writable:
            _check_apart(x, x.strides, x.itemsize, name)
        code = _dtypes._NUMPY_CODES.get(x.dtype)
        if code is None:
            code = 3 if x.dtype.name == "bfloat16" else _dtypes.numpy_dtype_code(x.dtype)
        copied = not x.flags.c_contiguous
        arr = np.ascontiguousarray(x) if copied else x
        arr = arr.reshape(-1)
        if code == 3:
            arr = arr.view(np.uint16)
        return Buf(x, arr, x.shape, code, copied)
    raise TypeError(f"{name} must be a numpy array or a CPU torch tensor, got {type(x).__name__}")


def empty_like(buf, shape=None):
    """A new user-facing array of buf's kind (numpy or torch) and dtype, and its Buf."""
    shape = buf.shape if shape is None else tuple(shape)
    if is_torch(buf.obj):
        out = _torch().empty(shape, dtype=buf.obj.dtype)
    elif buf.code == 3:
        out = np.empty(shape, dtype=buf.obj.dtype)
    else:
        out = np.empty(shape, dtype=_dtypes.storage_dtype(buf.code))
    return out, wrap(out, "out")


def dtype_of(dtype):
    """(numpy dtype or None, torch dtype or None, wire code) for a dtype argument (shared_empty);
    TypeError for an unsupported one."""
    torch = _torch()
    if torch is not None and isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_CODES:
            raise TypeError(f"unsupported dtype {dtype}; mlfabric supports "
                            f"{', '.join(_dtypes.DTYPE_NAMES)}")
        return None, dtype, _TORCH_CODES[dtype]
    return np.dtype(dtype), None, _dtypes.numpy_dtype_code(dtype)
