"""The wire dtypes and reduction ops mlfabric supports, and their codes shared with csrc/kernels.h
(DType, RedOp). Owns the mapping from numpy / torch dtypes to those codes; nothing else."""
import numpy as np

# code -> name; the order is csrc/kernels.h's DType enum.
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
DTYPE_CODES = {name: code for code, name in enumerate(DTYPE_NAMES)}
ITEMSIZE = (4, 8, 2, 2, 4, 8)
FLOATING = frozenset((0, 1, 2, 3))

# Reduction ops: csrc/kernels.h's RedOp, plus "avg" = sum then scale by 1/n (floating only).
OPS = ("sum", "prod", "min", "max")
OP_CODES = {name: code for code, name in enumerate(OPS)}
AVG = "avg"
ALL_OPS = OPS + (AVG,)


# Native-byte-order numpy dtypes -> code (a dict lookup: dtype.name is slow in numpy 2).
_NUMPY_CODES = {np.dtype(name): code for code, name in enumerate(DTYPE_NAMES) if name != "bfloat16"}


def numpy_dtype_code(dt):
    """Code of a numpy dtype, or raise TypeError naming the supported ones."""
    code = _NUMPY_CODES.get(dt)
    if code is not None:
        return code
    dt = np.dtype(dt)
    name = dt.name
    if name in DTYPE_CODES and dt.isnative:
        return DTYPE_CODES[name]
    raise TypeError(f"unsupported dtype {dt}; mlfabric supports {', '.join(DTYPE_NAMES)}")


def op_code(op, dtype_code):
    """(kernel op code, is_avg) for an op name; MlfabricError-free: bad names raise ValueError,
    avg on an integer dtype raises TypeError."""
    if not isinstance(op, str) or op.lower() not in ALL_OPS:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {', '.join(ALL_OPS)}")
    op = op.lower()
    if op == AVG:
        if dtype_code not in FLOATING:
            raise TypeError(f"op 'avg' needs a floating dtype, got {DTYPE_NAMES[dtype_code]}")
        return OP_CODES["sum"], True
    return OP_CODES[op], False


def storage_dtype(code):
    """The numpy dtype that holds values of a wire dtype (bfloat16 is carried as uint16)."""
    return np.dtype(np.uint16) if code == DTYPE_CODES["bfloat16"] else np.dtype(DTYPE_NAMES[code])
