"""User-facing elementwise kernels: reduce a list of arrays, L2 norm, in-place ``scale_`` and
``axpy_``, and the CPU instruction-set switch. Owns argument checking for them; the arithmetic is
native (csrc/kernels*.cc on the CPU, csrc/cuda/kernels.cu for CUDA torch tensors when built with
CUDA).

Accepts numpy arrays and CPU torch tensors (non-contiguous ones go through a contiguous copy), and
CUDA torch tensors in builds with CUDA kernels (work is queued on the tensor's current stream).
"""
from . import _C
from ._core import buffers as _buffers, dtypes as _dtypes
from .errors import MlfabricError

ISAS = ("scalar", "avx2", "avx512")

__all__ = ["reduce", "norm2", "scale_", "axpy_", "isa", "set_isa", "supported_isas", "ISAS"]


# ------------------------------------------------------------------------------------------ CPU

def _check_same(bufs, names):
    first = bufs[0]
    for b, name in zip(bufs[1:], names[1:]):
        if b.code != first.code:
            raise TypeError(f"{name} has dtype {_dtypes.DTYPE_NAMES[b.code]}, "
                            f"{names[0]} has {_dtypes.DTYPE_NAMES[first.code]}")
        if b.count != first.count:
            raise MlfabricError(f"{name} has {b.count} elements, {names[0]} has {first.count}")


def _check_floating(code, what):
    if code not in _dtypes.FLOATING:
        raise TypeError(f"{what} needs a floating dtype, got {_dtypes.DTYPE_NAMES[code]}")


def _overlaps(a, b):
    """True if two buffers share bytes without starting at the same address (the kernels allow
    exact aliasing only)."""
    if a.nbytes == 0 or b.nbytes == 0 or a.ptr == b.ptr:
        return False
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def reduce(inputs, op="sum", out=None, scale=1.0):
    """out = scale * op(inputs[0], ..., inputs[k-1]) elementwise; returns out.

    op is "sum", "prod", "min", "max" or "avg" (sum scaled by 1/k). float16/bfloat16 accumulate in
    float32 and round once; integer sum/prod wrap around. min/max propagate NaN like numpy. out
    may be one of the inputs (in-place); when None, a new array shaped like inputs[0] is returned.
    """
    if not isinstance(inputs, (list, tuple)) or len(inputs) == 0:
        raise ValueError("reduce needs a non-empty list of arrays")
    if _is_cuda(inputs[0]):
        return _cuda_reduce(inputs, op, out, scale)
    names = [f"inputs[{i}]" for i in range(len(inputs))]
    bufs = [_buffers.wrap(x, n) for x, n in zip(inputs, names)]
    _check_same(bufs, names)
    code = bufs[0].code
    opc, is_avg = _dtypes.op_code(op, code)
    scale = float(scale) / len(inputs) if is_avg else float(scale)
    if scale != 1.0:
        _check_floating(code, "scale != 1")
    if out is None:
        out, ob = _buffers.empty_like(bufs[0])
    else:
        ob = _buffers.wrap(out, "out", writable=True)
        _check_same([bufs[0], ob], [names[0], "out"])
        for b, n in zip(bufs, names):
            if _overlaps(ob, b):
                raise MlfabricError(f"out partially overlaps {n}; it may only be {n} itself")
    _C.reduce(ob.ptr, [b.ptr for b in bufs], ob.count, code, opc, scale)
    ob.writeback()
    return out


def norm2(x):
    """sqrt(sum(x**2)) as a Python float, accumulated in float64."""
    if _is_cuda(x):
        return _cuda_norm2(x)
    b = _buffers.wrap(x, "x")
    return _C.norm2(b.ptr, b.count, b.code)


def scale_(x, alpha):
    """``x *= alpha`` in place (floating dtypes); returns x."""
    if _is_cuda(x):
        return _cuda_scale(x, alpha)
    b = _buffers.wrap(x, "x", writable=True)
    _check_floating(b.code, "scale_")
    _C.scale(b.ptr, b.count, b.code, float(alpha))
    b.writeback()
    return x


def axpy_(y, alpha, x):
    """``y += alpha * x`` in place (floating dtypes, equal dtypes and sizes); returns y."""
    if _is_cuda(y):
        return _cuda_axpy(y, alpha, x)
    by, bx = _buffers.wrap(y, "y", writable=True), _buffers.wrap(x, "x")
    _check_same([by, bx], ["y", "x"])
    _check_floating(by.code, "axpy_")
    if by.nbytes and by.ptr < bx.ptr + bx.nbytes and bx.ptr < by.ptr + by.nbytes:
        raise MlfabricError("axpy_: y and x must not overlap")
    _C.axpy(by.ptr, bx.ptr, by.count, by.code, float(alpha))
    by.writeback()
    return y


def isa():
    """Instruction set the CPU kernels use: "scalar", "avx2" or "avx512"."""
    return _C.isa()


def set_isa(name):
    """Force the CPU kernels' instruction set (for tests and benchmarks); ValueError if the name is
    unknown or this CPU lacks it. MLFABRIC_ISA sets the initial choice: an unknown name there is
    an error at init() (_config.check_isa), one this CPU lacks warns and takes the best."""
    if name not in ISAS:
        raise ValueError(f"unknown instruction set {name!r}; expected one of {', '.join(ISAS)}")
    if not _C.set_isa(name):
        raise ValueError(f"this CPU does not support {name}")


def supported_isas():
    """The instruction sets this CPU can run, from simplest to widest."""
    current = _C.isa()
    ok = [name for name in ISAS if _C.set_isa(name)]
    _C.set_isa(current)
    return ok


# ----------------------------------------------------------------------------------------- CUDA

def _is_cuda(x):
    return _buffers.is_torch(x) and x.device.type == "cuda"


def _cuda_info(tensors, names):
    """(device, dtype code, stream handle) after checking the tensors agree and are CUDA."""
    if not _C.cuda_built():
        raise MlfabricError("this mlfabric build has no CUDA kernels (built without nvcc)")
    import torch

    first = tensors[0]
    for t, n in zip(tensors, names):
        if not _is_cuda(t) or t.device != first.device:
            raise MlfabricError(f"{n} is on {t.device if _buffers.is_torch(t) else 'the host'}, "
                                f"{names[0]} on {first.device}")
        if t.dtype != first.dtype:
            raise TypeError(f"{n} has dtype {t.dtype}, {names[0]} has {first.dtype}")
        if t.numel() != first.numel():
            raise MlfabricError(f"{n} has {t.numel()} elements, {names[0]} has {first.numel()}")
    if first.dtype not in _buffers.torch_codes():
        raise TypeError(f"unsupported dtype {first.dtype}; mlfabric supports "
                        f"{', '.join(_dtypes.DTYPE_NAMES)}")
    return _buffers.torch_codes()[first.dtype], torch.cuda.current_stream(first.device).cuda_stream


def _cuda_reduce(inputs, op, out, scale):
    names = [f"inputs[{i}]" for i in range(len(inputs))]
    code, stream = _cuda_info(list(inputs) + ([out] if out is not None else []),
                              names + (["out"] if out is not None else []))
    opc, is_avg = _dtypes.op_code(op, code)
    scale = float(scale) / len(inputs) if is_avg else float(scale)
    if scale != 1.0:
        _check_floating(code, "scale != 1")
    srcs = [t.contiguous() for t in inputs]  # kept alive until the kernel is queued
    dst = out if out is not None and out.is_contiguous() else srcs[0].new_empty(srcs[0].shape)
    _C.cuda_reduce(dst.data_ptr(), [s.data_ptr() for s in srcs], dst.numel(), code, opc, scale,
                   stream)
    if out is None:
        return dst.view(inputs[0].shape)
    if dst is not out:
        out.copy_(dst.view(out.shape))
    return out


def _cuda_norm2(x):
    code, stream = _cuda_info([x], ["x"])
    x = x.contiguous()
    return _C.cuda_norm2(x.data_ptr(), x.numel(), code, stream)


def _cuda_scale(x, alpha):
    code, stream = _cuda_info([x], ["x"])
    _check_floating(code, "scale_")
    t = x if x.is_contiguous() else x.contiguous()
    _C.cuda_scale(t.data_ptr(), t.numel(), code, float(alpha), stream)
    if t is not x:
        x.copy_(t)
    return x


def _cuda_axpy(y, alpha, x):
    code, stream = _cuda_info([y, x], ["y", "x"])
    _check_floating(code, "axpy_")
    t, xs = (y if y.is_contiguous() else y.contiguous()), x.contiguous()
    _C.cuda_axpy(t.data_ptr(), xs.data_ptr(), t.numel(), code, float(alpha), stream)
    if t is not y:
        y.copy_(t)
    return y
