"""The signature of a list of tensors (their dtypes and shapes, as bytes) and their data
addresses, for the grouped calls; read in one native call (torch_meta.cc) where it can be: through
torch's Python API each tensor costs ~0.8 us of attribute reads, which at 100 small tensors was
more than the fused allreduce itself.

The native reader uses PyTorch's stable C shim (aoti_torch_*), found at run time in the
libtorch_cpu that torch loaded, and torch._C._aoti's handles to the tensors. Where either is
missing (another torch), or MLFABRIC_TORCH_META=0, scan() returns None and
arguments.scan_tensors reads the tensors through Python, building the same signature with
signature(): the results are the same (tested), so ranks taking either path agree.

A signature is int64 words, [dtype code, ndim, dims...] per tensor: compared and hashed as bytes
(cheaper than tuples of shapes), decoded back into (codes, shapes) only where needed."""
import functools
import os
from array import array

import numpy as np
import torch

from .. import _C
from .._core import config as _config

_SCAN = None  # torch._C._aoti's handle maker once the shim is open; False: not available


def available(dtype_names):
    """Whether the native reader works here (opened on first use, and checked once against
    torch's own reads: a torch whose shim or handles behave otherwise keeps the Python path).
    dtype_names: mlfabric's dtype codes' names, in code order."""
    global _SCAN
    if _SCAN is None:
        _SCAN = False
        names = list(dtype_names)
        if _config.torch_meta_enabled():
            handles = getattr(getattr(torch._C, "_aoti", None),
                              "unsafe_alloc_void_ptrs_from_tensors", None)
            lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
            if handles is not None and _C.torch_shim_open(lib, names) and \
                    _agrees_with_torch(handles, names):
                _SCAN = handles
    return bool(_SCAN)


def _agrees_with_torch(handles, names):
    """Whether the native reader reads a probe list as torch's Python API does."""
    probe = [torch.zeros((2, c + 1), dtype=getattr(torch, n)) for c, n in enumerate(names)]
    want = signature(range(len(names)), [t.shape for t in probe])
    try:
        got = _C.torch_scan(handles(probe))
        strided = _C.torch_scan(handles([probe[0], probe[2].t()]))  # (3, 2), not contiguous
    except (TypeError, RuntimeError, ValueError):
        return False
    return got is not None and got[0] == want and got[1] is not None and \
        got[1].tolist() == [t.data_ptr() for t in probe] and strided is not None and \
        strided[1] is None and decode(strided[0]) == ((0, 2), ((2, 1), (3, 2)))


def scan(tensors):
    """(signature, addresses) of a list of dense CPU tensors (addresses: a uint64 array of their
    data pointers, None when one is not contiguous); None where the native reader is off or
    cannot read them all (a non-tensor, a GPU or sparse tensor, a dtype mlfabric does not move):
    the caller's checks then say which."""
    if not _SCAN:
        return None
    try:
        handles = _SCAN(tensors)
    except (TypeError, RuntimeError):  # not a list of tensors
        return None
    return _C.torch_scan(handles)


def signature(codes, shapes):
    """The signature scan() would give for these dtype codes and shapes."""
    words = array("q")
    for code, shape in zip(codes, shapes):
        words.append(code)
        words.append(len(shape))
        words.extend(shape)
    return words.tobytes()


def addresses(ptrs):
    """Data addresses as scan() gives them: a uint64 array, None if one is None."""
    return None if None in ptrs else np.array(ptrs, dtype=np.uint64)


@functools.lru_cache(maxsize=256)
def decode(sig):
    """(dtype codes, shapes) of a signature, each a tuple (shapes: tuples of ints)."""
    words = array("q", sig).tolist()
    codes, shapes, at = [], [], 0
    while at < len(words):
        ndim = words[at + 1]
        codes.append(words[at])
        shapes.append(tuple(words[at + 2:at + 2 + ndim]))
        at += 2 + ndim
    return tuple(codes), tuple(shapes)
