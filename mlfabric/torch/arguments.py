"""What mlfabric.torch's collectives accept, checked before a call's control round: the reduction
ops (Average, Sum, Min, Max, Product, Adasum) and how an op with its scaling factors maps to one
of mlfabric's core ops (ReducePlan), with Horovod's arithmetic of the scaling (``scale_``); the
dtypes that travel and their wire dtypes (uint8, int8, int16 and bool widened to int64); the
checks of a tensor, a list of tensors (scan_tensors), a name, a factor, and a tensor that takes
a result in place. Every check raises the error the caller sees, naming the call.
"""
import math
from operator import attrgetter

import numpy as np
import torch

from .._core import buffers as _buffers
from ..comm import nccl as _nccl
from ..errors import MlfabricError
from . import tensor_meta as _meta

# --- reduction ops --------------------------------------------------------------------------------

Average = "average"
Sum = "sum"
Min = "min"
Max = "max"
Product = "product"
Adasum = "adasum"  # see adasum.py

OP_NAMES = {"average": Average, "avg": Average, "sum": Sum, "min": Min, "max": Max,
            "product": Product, "prod": Product, "adasum": Adasum}
# mlfabric's core ops, by code in the descriptor.
CORE_OPS = ("sum", "avg", "min", "max", "prod")
CORE_OF = {Sum: "sum", Min: "min", Max: "max", Product: "prod"}


def resolve_op(op, average):
    """Horovod's rule: op wins, average (deprecated) maps True/False to Average/Sum, and the
    default is Average."""
    if op is not None and average is not None:
        raise ValueError("pass op or average (deprecated), not both")
    if op is None:
        return Average if average is None or average else Sum
    name = OP_NAMES.get(op.lower()) if isinstance(op, str) else None
    if name is None:
        raise ValueError(f"unknown reduction op {op!r}; expected one of Average, Sum, Min, Max, "
                         "Product, Adasum (mlfabric.torch.Average, ...)")
    return name


# --- dtypes ---------------------------------------------------------------------------------------

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.uint8, torch.int8, torch.int16, torch.bool)
DTYPE_CODE = {dt: i for i, dt in enumerate(DTYPES)}
NATIVE = 6  # the first six travel as they are; the others widened to int64
_meta.available(str(dt).replace("torch.", "") for dt in DTYPES)  # the native reader, if any


def wire_dtype(dtype):
    return dtype if DTYPE_CODE[dtype] < NATIVE else torch.int64


def dtype_name(code):
    return str(DTYPES[code]).replace("torch.", "")


def check_tensor(t, what, arg="tensor"):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "cuda":
        _nccl.library()  # MlfabricError saying why GPU tensors cannot move here
    elif t.device.type != "cpu":
        raise MlfabricError(f"{what}: {arg} is on {t.device}; mlfabric.torch moves CPU and CUDA "
                            "tensors only")
    if t.layout != torch.strided:
        hint = "; a sparse COO tensor goes through sparse_allreduce_async" \
            if t.layout == torch.sparse_coo else ""
        raise TypeError(f"{what}: {arg} has layout {t.layout}; only dense tensors are "
                        f"supported{hint}")
    if t.dtype not in DTYPE_CODE:
        raise TypeError(f"{what}: unsupported dtype {t.dtype}; mlfabric.torch supports "
                        f"{', '.join(dtype_name(c) for c in range(len(DTYPES)))}")
    return DTYPE_CODE[t.dtype]


def check_writable(t, what, arg="tensor"):
    """t can take a result in place: no two of its elements share memory (an expanded tensor's
    do, or an as_strided one's: torch refuses to write there, or keeps one result of several).
    Checked before the call, as a rank that failed only when writing, after its peers moved on,
    would leave them waiting (or a later call paired wrongly)."""
    if not t.is_contiguous() and _buffers.elements_overlap(t.shape, t.stride(), 1):
        raise ValueError(f"{what}: {arg} cannot receive the result in place: elements of it share "
                         "memory (an expanded tensor?); pass a tensor of its own (.clone())")


def check_factor(value, what, arg):
    """A finite scaling factor as a float, or the error saying why not."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: {arg} must be a number, got {value!r:.40}") from None
    except OverflowError:  # an int beyond float's range
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"{what}: {arg} must be a finite number, got {value!r:.40}")
    return f


def check_rows(tensor, name, what):
    """The checks of a call that splits tensor's dimension 0 (name, tensor, at least one
    dimension): its dtype code."""
    check_name(name)
    code = check_tensor(tensor, what)
    if tensor.dim() == 0:
        raise ValueError(f"{what}: needs a tensor with at least one dimension")
    return code


def check_name(name):
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string or None, got {type(name).__name__}")


def scale_(t, factor):
    """t times factor, in place, with Horovod's arithmetic (its ScaleBuffer): a floating tensor in
    its own precision (float16 and bfloat16 on the CPU through float32, as torch computes them;
    on a GPU, float16 by a factor rounded to float16, as Horovod's kernel does), an integer
    tensor in float64, truncated toward zero back to its dtype. The same on every rank for the
    same t and factor: no accumulation order is involved."""
    if not t.is_floating_point():
        return t.copy_(t.to(torch.float64).mul_(factor))  # (a float to integer copy truncates)
    if t.is_cuda and t.dtype == torch.float16:
        factor = float(np.float16(factor))
    return t.mul_(factor)


class ReducePlan:
    """How one reduction runs, as Horovod's: the core op, prescale_factor (multiplying each
    input), and the scaling after the reduction (after). Average is a Sum whose result is
    multiplied by postscale_factor / size (an integer tensor's in float64, truncated: see
    ``scale_``), except on a floating tensor with nothing else to scale, which takes the core's
    one-pass average. dtype: the caller's tensors' (their wire dtype may be wider)."""
    __slots__ = ("op", "core", "pre", "after", "dtype")

    def __init__(self, op, dtype, pre, post, size, what):
        if op == Adasum:
            # an error of the call, as Horovod's (a RuntimeError), on every rank
            raise MlfabricError(f"{what}: op Adasum is for allreduce (and its forms) only")
        pre = check_factor(pre, what, "prescale_factor")
        post = check_factor(post, what, "postscale_factor")
        if dtype == torch.bool and (op == Average or pre != 1.0 or post != 1.0):
            raise TypeError(f"{what}: op Average and prescale_factor / postscale_factor need a "
                            "numeric tensor, got torch.bool")
        self.op, self.pre, self.dtype = op, pre, dtype
        if op == Average:
            one_pass = post == 1.0 and dtype.is_floating_point
            self.core, self.after = ("avg", 1.0) if one_pass else ("sum", post / size)
        else:
            self.core, self.after = CORE_OF[op], post

    def prescale_(self, t):
        """t, a copy of the input as it travels, times prescale_factor (in place)."""
        if self.pre != 1.0:
            scale_(t, self.pre)
        return t

    def postscale_(self, t):
        """t, a reduced result as it travels, times the scaling after the reduction (in place).
        An integer tensor that travels widened (int8, ...) is first wrapped to its dtype's
        range, as its sum would have wrapped in that dtype, and the result scaled from there."""
        if self.after != 1.0:
            if t.dtype != self.dtype and not self.dtype.is_floating_point:
                t.copy_(t.to(self.dtype))
            scale_(t, self.after)
        return t


_IS_CPU, _DTYPE_OF, _SHAPE_OF = (attrgetter(a) for a in ("is_cpu", "dtype", "shape"))


def scan_tensors(tensors, what):
    """(signature, addresses) of a grouped call's tensors, after checking them all. signature:
    their dtypes and shapes as tensor_meta.py's bytes; addresses: their data addresses (a uint64
    array; None for GPU tensors or when one is not contiguous), for the C++ gather / scatter,
    which costs ~0.1 us a tensor where torch._foreach_copy_ costs ~0.4 us.

    At 100 x 1 KiB these reads are most of what the grouped call adds to one fused allreduce:
    a list of dense CPU tensors is read in one native call (tensor_meta.py: ~0.2 us a tensor).
    Where that is unavailable, the usual case reads five attributes a tensor in C-level loops
    (map over attrgetter or Tensor's own methods: ~0.5-0.8 us a tensor on the 2-core VM).
    data_ptr raises for a tensor without strided storage (sparse, mkldnn), which the layout
    check would refuse: such a list, like one holding a non-tensor or a CUDA tensor, takes the
    per-tensor check, which names the first bad one."""
    got = _meta.scan(tensors)
    if got is not None:
        return got
    try:
        if all(map(_IS_CPU, tensors)):
            dtypes = tuple(map(_DTYPE_OF, tensors))
            first = dtypes[0]
            codes = (DTYPE_CODE[first],) * len(dtypes) if dtypes.count(first) == len(dtypes) \
                else tuple(map(DTYPE_CODE.__getitem__, dtypes))
            shapes = tuple(map(_SHAPE_OF, tensors))
            ptrs = list(map(torch.Tensor.data_ptr, tensors))  # raises where not strided
            contiguous = all(map(torch.Tensor.is_contiguous, tensors))
            return _meta.signature(codes, shapes), _meta.addresses(ptrs) if contiguous else None
    except (AttributeError, KeyError, TypeError, RuntimeError):
        pass
    for i, t in enumerate(tensors):
        check_tensor(t, what, f"tensors[{i}]")
        if t.device != tensors[0].device:
            raise ValueError(f"{what}: tensors[{i}] is on {t.device}, tensors[0] on "
                             f"{tensors[0].device}; a group's tensors share one device")
    # GPU lists get here, and CPU tensors whose storage has no address to read (wrapper
    # subclasses, whose data_ptr raises): torch copies them, no addresses needed
    return _meta.signature([DTYPE_CODE[t.dtype] for t in tensors],
                           [t.shape for t in tensors]), None
