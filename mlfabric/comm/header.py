"""Call headers: the few int64 words every rank contributes before a collective so that a call
whose kind, dtype, op, root, shape or algorithm differs between ranks becomes a MismatchError on
every rank (Horovod negotiates the same way). Owns the header layout (shared with
csrc/shm_engine.h: 16 words, the first 12 must agree) and the error messages; sends nothing."""
import math
import zlib

import numpy as np

from .._core import dtypes as _dtypes
from ..errors import MismatchError

WORDS, CHECKED = 16, 12
# The first six are csrc/shm_engine.h's Kind; the others are header-only exchanges.
KINDS = ("barrier", "allreduce", "reduce", "reduce_scatter", "allgather", "broadcast",
         "shared_empty", "alltoall")
KIND_CODES = {k: i for i, k in enumerate(KINDS)}
ALGORITHMS = ("none", "shm", "ring", "rhd", "tree", "nccl")
ALGO_CODES = {a: i for i, a in enumerate(ALGORITHMS)}
REJECTED = -1       # kind word of a rank that refused its own arguments
_MAX_DIMS = 6
# The caller's element types that an adapter (the torch.distributed backend) widens to a dtype
# mlfabric carries, for calls that only move data: passed as element=, compared with the rest,
# so that ranks passing int8 and uint8 (both sent as int32) fail instead of reinterpreting.
ELEMENTS = ("as sent", "int8", "uint8", "int16", "uint16", "uint32", "bool", "complex32",
            "complex64", "complex128", "uint64", "float8_e4m3fn", "float8_e5m2",
            "float8_e4m3fnuz", "float8_e5m2fnuz")
_ELEMENT_SHIFT = 12  # of the op word: op (3 bits), avg (1), algorithm (8), then the element


def make(kind, code=0, op=0, avg=False, root=0, shape=(), algorithm="none",
         zc_in=(-1, -1), zc_out=(-1, -1), element=0):
    """The header of one call, as a list of 16 ints. element: an index in ELEMENTS."""
    dims = list(shape)
    if len(dims) > _MAX_DIMS:  # long shapes: the tail is folded into one hash word
        tail = zlib.crc32(np.asarray(dims[_MAX_DIMS - 1:], np.int64).tobytes())
        dims = dims[:_MAX_DIMS - 1] + [tail]
    dims += [-1] * (_MAX_DIMS - len(dims))
    count = math.prod(shape)
    word = op | (8 if avg else 0) | (ALGO_CODES[algorithm] << 4) | (element << _ELEMENT_SHIFT)
    return [KIND_CODES[kind], code, word, root, count, len(shape), *dims, zc_in[0], zc_in[1],
            zc_out[0], zc_out[1]]


def rejected(kind):
    """The header of a rank whose own arguments were invalid: it still takes part in the header
    exchange so that its peers fail at once instead of waiting for it."""
    return [REJECTED, KIND_CODES[kind]] + [0] * (WORDS - 2)


def _shape(h):
    nd = h[5]
    return tuple(h[6:6 + min(nd, _MAX_DIMS)]) + (("...",) if nd > _MAX_DIMS else ())


def _describe(field, h):
    if field == "kind":
        return KINDS[h[0]] if 0 <= h[0] < len(KINDS) else "?"
    if field == "dtype":
        return _dtypes.DTYPE_NAMES[h[1]]
    if field == "op":
        return "avg" if h[2] & 8 else _dtypes.OPS[h[2] & 7]
    if field == "algorithm":
        return ALGORITHMS[(h[2] >> 4) & 255]
    if field == "element type":
        e = h[2] >> _ELEMENT_SHIFT
        return ELEMENTS[e] if 0 <= e < len(ELEMENTS) else "?"
    if field == "root":
        return str(h[3])
    return str(_shape(h))


_FIELDS = (("kind", lambda h: h[0]), ("element type", lambda h: h[2] >> _ELEMENT_SHIFT),
           ("dtype", lambda h: h[1]), ("op", lambda h: h[2] & 15),
           ("algorithm", lambda h: (h[2] >> 4) & 255), ("root", lambda h: h[3]),
           ("shape", lambda h: tuple(h[4:CHECKED])))


def check(headers, what):
    """Raise MismatchError if the ranks' headers (a list, index = rank) disagree."""
    headers = [list(map(int, h)) for h in headers]
    if all(h[:CHECKED] == headers[0][:CHECKED] for h in headers):
        return
    bad = [r for r, h in enumerate(headers) if h[0] == REJECTED]
    if bad:
        raise MismatchError(f"{what}: rank(s) {bad} rejected their arguments (see the error on "
                            "those ranks); no data was exchanged")
    for name, key in _FIELDS:
        values = {}
        for r, h in enumerate(headers):
            values.setdefault(key(h), []).append(r)
        if len(values) > 1:
            parts = "; ".join(f"{_describe(name, headers[ranks[0]])} on rank(s) {ranks}"
                              for ranks in values.values())
            raise MismatchError(f"{what}: ranks disagree on {name}: {parts}")
    raise MismatchError(f"{what}: ranks disagree on the call")  # pragma: no cover


def from_flat(flat, nranks):
    return [list(flat[r * WORDS:(r + 1) * WORDS]) for r in range(nranks)]
