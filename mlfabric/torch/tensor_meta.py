"""Reads a list of tensors' dtypes, shapes and data addresses in one native call (torch_meta.cc),
for the grouped calls: through torch's Python API each tensor costs ~0.8 us of attribute reads,
which at 100 small tensors was more than the fused allreduce itself.

The native reader uses PyTorch's stable C shim (aoti_torch_*), found at run time in the
libtorch_cpu that torch loaded, and torch._C._aoti's handles to the tensors. Where either is
missing (another torch), or MLFABRIC_TORCH_META=0, scan() returns None and ops._scan reads the
tensors through Python as before: the results are the same (tested)."""
import os

import torch

from .. import _C

_SCAN = None  # torch._C._aoti's handle maker once the shim is open; False: not available


def available(dtype_names):
    """Whether the native reader works here (opened on first use). dtype_names: mlfabric's
    dtype codes' names, in code order."""
    global _SCAN
    if _SCAN is None:
        _SCAN = False
        if os.environ.get("MLFABRIC_TORCH_META", "1") != "0":
            handles = getattr(getattr(torch._C, "_aoti", None),
                              "unsafe_alloc_void_ptrs_from_tensors", None)
            lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
            if handles is not None and _C.torch_shim_open(lib, list(dtype_names)):
                _SCAN = handles
    return bool(_SCAN)


def scan(tensors):
    """((dtype codes, shapes), addresses) of a list of dense CPU tensors, as ops._scan gives
    them (addresses: None for a tensor that is not contiguous); None where the native reader is
    off or cannot read them all (a non-tensor, a GPU or sparse tensor, a dtype mlfabric does not
    move): the caller's checks then say which."""
    if not _SCAN:
        return None
    try:
        handles = _SCAN(tensors)
    except (TypeError, RuntimeError):  # not a list of tensors
        return None
    return _C.torch_scan(handles)
