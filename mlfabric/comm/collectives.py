"""The public collectives: allreduce, reduce, broadcast, allgather, reduce_scatter, barrier, send,
recv, and their non-blocking forms. Owns the host path's argument checks and the choice of data
path (the call guard and header exchange that turn a mismatch on any rank into an error on every
rank are call.py's, shared with the GPU path):

- every rank on one host (the usual case): the shared-memory engine (comm/shm.py), zero-copy when
  the buffers come from shared_empty();
- otherwise, or when asked by name: MPI point-to-point algorithms (comm/algorithms.py).

GPU arrays (CUDA torch tensors, CuPy arrays) take gpu_collectives.py's path, over NCCL.

Semantics: allreduce(x, out=None) returns a new array; out=x reduces in place. broadcast works in
place and returns x. Inputs may be numpy arrays or CPU torch tensors; non-contiguous ones are copied
(and outputs copied back). Every call blocks until this rank's part is done; *_async forms return a
Handle whose wait() gives the result (buffers must be left alone until then).
"""
import contextlib
import logging
import threading
import time
from typing import Callable, NamedTuple

import numpy as np
from mpi4py import MPI

from .. import _C
from .._core import buffers as _buffers, config as _config, device as _device, dtypes as _dtypes
from .._core import log as _mflog
from . import algorithms, context, gpu_collectives, header, p2p
from .call import (alltoall_splits as _alltoall_splits, check_root as _check_root,
                   exchange_headers as _exchange_headers, exchange_splits as _exchange_splits,
                   run as _run, split_rows)
from .executor import Handle
from ..errors import MismatchError, MlfabricError, PeerTimeoutError

def _output(xb, out, what, count=None, shape=None):
    """(out object, its Buf): a new array shaped like `shape`, or the user's out, checked."""
    if out is None:
        return _buffers.empty_like(xb, shape)
    ob = _buffers.wrap(out, "out", writable=True)
    want = xb.count if count is None else count
    if ob.code != xb.code:
        raise TypeError(f"{what}: out has dtype {_dtypes.DTYPE_NAMES[ob.code]}, "
                        f"x has {_dtypes.DTYPE_NAMES[xb.code]}")
    if ob.count != want:
        raise ValueError(f"{what}: out has {ob.count} elements, expected {want}")
    if _partly_overlap(ob, xb):
        raise ValueError(f"{what}: out shares memory with x without being x (the result would "
                         "overwrite input not yet read); pass out=x to work in place, or an "
                         "array of its own")
    return out, ob


def _partly_overlap(ob, xb):
    """Whether the output's memory overlaps the input's other than as the same buffer (in
    place). A temporary copy (a non-contiguous array's) overlaps nothing the call reads."""
    if ob.copied or xb.copied or not ob.nbytes or not xb.nbytes:
        return False
    o, x = ob.ptr, xb.ptr
    if o == x and ob.nbytes == xb.nbytes:
        return False
    return o < x + xb.nbytes and x < o + ob.nbytes


def _copy(dst, src):
    if src.nbytes and dst.ptr != src.ptr:
        _C.copy(dst.ptr, src.ptr, src.nbytes)


def _finish(obj, buf):
    buf.writeback()
    return obj


# --- allreduce / reduce -------------------------------------------------------------------------

class UnknownBackendError(MlfabricError, ValueError):
    """algorithm= names no backend (a ValueError too: it is a bad argument)."""


class Backend(NamedTuple):
    """One way to run an allreduce (Horovod's operation manager, Enabled()): algorithm='auto'
    runs the first entry of BACKENDS whose enabled(ctx, xb, gpu) is true. A backend named with
    algorithm= runs unless refusal(ctx, gpu) gives the error that says why it cannot take this
    call (the MPI algorithms take any host call, whatever its size). run(ctx, xb, gpu, opc, avg,
    out, name) -> (header, body), as call.run's prepare returns them.

    The arguments: ctx the context (ctx.shm: the shared-memory engine, or None), xb x wrapped
    (_core.buffers, or _core.device for a GPU array), gpu a GPU array's (xb, result, out view,
    ready event) made on the caller's thread by gpu_collectives.allreduce_now (None for a host
    array), opc and avg the kernel op code and whether the result is scaled by 1 / size, out the
    caller's out=, name the backend's (the MPI algorithms share one run)."""
    name: str
    enabled: Callable[..., bool]
    run: Callable
    refusal: Callable[..., Exception]


# --- the path log (MLFABRIC_LOG_LEVEL=info): each kind of call's backend and path, once per size
# class. Each call pays one read of _mflog.paths (set at init) when logging is off; the direct
# path pays nothing (it logs when it prepares a plan, once per shape).

def _shm_path(ctx, what, nbytes, zero_copy):
    """The shared-memory engine's path for a call, as the engine picks it: zero-copy when the
    buffers are shared ones (shared_empty; every rank's must be), single-copy (CMA,
    process_vm_readv) for allreduce calls of more than one step within MLFABRIC_CMA_MIN/MAX
    where the kernel allows it, else staged through the engine's segment."""
    if zero_copy:
        return "zero-copy shared buffer"
    if what == "allreduce" and nbytes > ctx.shm.block and ctx.shm.engine.cma_enabled:
        lo, hi = _config.cma_range(ctx.shm.size)
        if lo < nbytes <= hi:
            return "single-copy CMA"
    return "staged"


def _log_path(ctx, what, backend, xb, zero_copy=False):
    """Log the backend (and, for shm, the path) of a call when it is the first of its kind,
    backend, size class and dtype in this process; callers check _mflog.paths first."""
    nbytes = xb.count * _dtypes.ITEMSIZE[xb.code]
    path = _shm_path(ctx, what, nbytes, zero_copy) if backend == "shm" else None
    _mflog.path_chosen(what, backend, nbytes, _dtypes.DTYPE_NAMES[xb.code], ctx.size, path)


def _nccl_run(ctx, xb, gpu, opc, avg, out, name):
    if _mflog.paths:
        _log_path(ctx, "allreduce", name, xb)
    return gpu_collectives.allreduce_plan(ctx, gpu, opc, avg)


def _shm_run(ctx, xb, gpu, opc, avg, out, name):
    what = "allreduce"
    res, ob = _output(xb, out, what)
    scale = 1.0 / ctx.size if avg else 1.0
    zc_in, peer_in = ctx.shm.zero_copy_info(xb)
    zc_out, peer_out = ctx.shm.zero_copy_info(ob)
    hdr = header.make(what, xb.code, opc, avg, 0, xb.shape, name, zc_in, zc_out)
    if _mflog.paths:
        _log_path(ctx, what, name, xb, zc_in[0] >= 0 and zc_out[0] >= 0)

    def body(hdr):
        ctx.shm.run(what, what, hdr, xb.code, opc, scale, 0, xb, ob, xb.count,
                    peer_in=peer_in, peer_out=peer_out)
        return _finish(res, ob)
    return hdr, body


def _mpi_run(ctx, xb, gpu, opc, avg, out, name):
    """An MPI point-to-point algorithm (comm/algorithms.py): ring, rhd or tree."""
    what = "allreduce"
    res, ob = _output(xb, out, what)
    scale = 1.0 / ctx.size if avg else 1.0
    hdr = header.make(what, xb.code, opc, avg, 0, xb.shape, name)
    if _mflog.paths:
        _log_path(ctx, what, name, xb)

    def body(hdr):
        _exchange_headers(ctx, what, hdr)
        _copy(ob, xb)
        algorithms.allreduce(ctx.comm, ob.arr, xb.code, opc, name)
        if avg and ob.count:
            _C.scale(ob.ptr, ob.count, ob.code, scale)
        return _finish(res, ob)
    return hdr, body


def _host_only(gpu, name):
    if gpu is not None:
        return ValueError(f"GPU arrays move over NCCL, which picks its own algorithm: pass "
                          f"algorithm='auto', not {name!r}")
    return None


def _shm_refusal(ctx, gpu):
    if gpu is None and ctx.shm is None:
        return MlfabricError("algorithm='shm' needs every rank on one host and MLFABRIC_SHM=1")
    return _host_only(gpu, "shm")


def _nccl_refusal(ctx, gpu):
    if gpu is None:
        return ValueError("algorithm='nccl' moves GPU arrays (CUDA torch tensors, CuPy arrays); "
                          "x is a host array")
    return None


# In order: the first enabled one runs. GPU arrays only go over NCCL; host arrays take the
# shared-memory engine when every rank is on one host, else an MPI algorithm by size (see
# algorithms.choose_allreduce: the tree for small calls, rhd up to its limit on a power-of-two
# number of ranks, the ring otherwise).
BACKENDS = (
    Backend("nccl", lambda ctx, xb, gpu: gpu is not None, _nccl_run, _nccl_refusal),
    Backend("shm", lambda ctx, xb, gpu: gpu is None and ctx.shm is not None, _shm_run,
            _shm_refusal),
    Backend("tree", lambda ctx, xb, gpu: gpu is None and algorithms.tree_fits(xb.nbytes, ctx.size),
            _mpi_run, lambda ctx, gpu: _host_only(gpu, "tree")),
    Backend("rhd", lambda ctx, xb, gpu: gpu is None and algorithms.rhd_fits(xb.nbytes, ctx.size),
            _mpi_run, lambda ctx, gpu: _host_only(gpu, "rhd")),
    Backend("ring", lambda ctx, xb, gpu: gpu is None, _mpi_run,
            lambda ctx, gpu: _host_only(gpu, "ring")),
)
_BACKEND = {b.name: b for b in BACKENDS}
ALGORITHMS = ("auto",) + tuple(_BACKEND)
_log = logging.getLogger("mlfabric")
_DEBUG = logging.DEBUG

# Who hears each allreduce's backend as it runs: None, or a function (set by mlfabric.torch's
# timeline while it records) that returns the list the call running on this thread collects
# the names in (None: no such call). Read once per allreduce: the one cost when nothing listens.
backend_sink = None


def _choose(ctx, xb, gpu, algorithm):
    """The Backend that runs an allreduce of xb for algorithm= (see Backend), or the error that
    refuses it."""
    if algorithm == "auto":
        for backend in BACKENDS:   # (ring takes every host call, nccl every GPU call)
            if backend.enabled(ctx, xb, gpu):
                break
    else:
        backend = _BACKEND.get(algorithm) if isinstance(algorithm, str) else None
        if backend is None:
            raise UnknownBackendError(f"unknown algorithm {algorithm!r}; expected one of "
                                      f"{', '.join(ALGORITHMS)}")
        error = backend.refusal(ctx, gpu)
        if error is not None:
            raise error
    if _log.isEnabledFor(_DEBUG):
        _log.debug("allreduce of %d x %s on %d ranks, algorithm=%s: %s", xb.count,
                   _dtypes.DTYPE_NAMES[xb.code], ctx.size, algorithm, backend.name)
    return backend


def chosen_backend(x, algorithm="auto"):
    """The backend (a name in ALGORITHMS) that allreduce(x, algorithm=algorithm) takes on this
    rank, or the error it raises for an algorithm that cannot take x. The choice is also logged
    at each call (logger 'mlfabric', level DEBUG), but for allreduce's direct path, which is
    the 'shm' backend's."""
    device = _device.is_device(x)
    xb = _device.wrap(x) if device else _buffers.wrap(x)
    return _choose(context.get(), xb, () if device else None, algorithm).name


def _allreduce(x, op, out, algorithm, async_):
    what = "allreduce"
    # a GPU array is wrapped, and its stream marked, on the caller's thread (see gpu_collectives)
    early = gpu_collectives.allreduce_now(x, out) if _device.is_device(x) else None
    # asked on the caller's thread: prepare may run on the executor's
    sink = backend_sink() if backend_sink is not None else None

    def prepare(ctx):
        gpu = None if early is None else early()
        xb = _buffers.wrap(x) if gpu is None else gpu[0]
        opc, avg = _dtypes.op_code(op, xb.code)
        backend = _choose(ctx, xb, gpu, algorithm)
        if sink is not None:
            sink.append(backend.name)
        return backend.run(ctx, xb, gpu, opc, avg, out, backend.name)

    return _run(what, prepare, async_)


def _maybe_shared(x):
    """False when x cannot be an mlfabric shared buffer: its memory is owned by an ndarray chain
    that does not end in an MPI window (cheaper than looking its address up)."""
    base = x.base
    while type(base) is np.ndarray:
        base = base.base
    return type(base) is MPI.buffer


def _same_layout(out, x):
    return type(out) is np.ndarray and out.dtype == x.dtype and out.shape == x.shape


def _plain_plan(ctx, kind, x, op=None):
    """The prepared engine call of a numpy allreduce or allgather on the direct path, or None
    when the arguments need the general path's checks (it raises the right errors). Its header
    is the general path's for the same call, so ranks on either path still agree."""
    key = (kind, x.dtype, x.shape, op)
    try:
        plan = ctx.plain_plans.get(key)
    except Exception:  # an unhashable op: the general path rejects it on every rank
        return None
    if plan is None:
        if len(ctx.plain_plans) >= 1024:
            # the engine keeps every plan it prepares: calls of ever new shapes (allgathers of
            # varying rows) take the general path once this many are kept
            return None
        try:
            code = _dtypes.numpy_dtype_code(x.dtype)
            opc, avg = _dtypes.op_code(op, code) if kind == "allreduce" else (0, False)
        except Exception:  # the general path raises it, on every rank
            return None
        hdr = header.make(kind, code, opc, avg, 0, x.shape, "shm")
        if _mflog.paths:  # once per shape: the direct path's calls pay nothing
            _mflog.path_chosen(kind, "shm", x.nbytes, _dtypes.DTYPE_NAMES[code], ctx.size,
                               _shm_path(ctx, kind, x.nbytes, False))
        plan = ctx.plain_plans[key] = ctx.shm.plan(kind, code, opc,
                                                   1.0 / ctx.size if avg else 1.0, hdr)
    return plan


def _direct(x, algorithm="auto"):
    """(context, x as a numpy array) when the call may take the direct path: every rank on one
    host, nothing queued before it, x a numpy array or a contiguous CPU torch tensor of a dtype
    numpy has (then a numpy view of its memory), and not a shared buffer longer than one step,
    which the general path reads in place; else (None, None). A tensor numpy cannot view (one
    with its negative bit set, a sparse one, vmap's batched one) takes the general path, which
    copies it or refuses it inside the call: raised here, this rank's peers would wait for it."""
    ctx = (context._subs and context._local.ctx) or context._ctx  # context.get(), unchecked
    if ctx is None or ctx.shm is None or algorithm != "auto" or ctx.executor.pending:
        return None, None
    if type(x) is np.ndarray:
        arr, maybe_shared = x, _maybe_shared(x)
    else:
        try:
            arr = _buffers.numpy_view(x)
        except Exception:
            arr = None
        if arr is None:
            return None, None
        maybe_shared = True  # a tensor does not tell who owns its memory: looked up below
    if maybe_shared and ctx.shm.allocs and arr.nbytes > ctx.shm.block and \
            ctx.shm.lookup(arr.ctypes.data, arr.nbytes) is not None:
        return None, None
    return ctx, arr


def _run_direct(ctx, kind, plan, arr, out):
    """Run a prepared engine call (_plain_plan) on the calling thread; False (nothing done)
    where the general path must take the call instead, which raises the right error on every
    rank: the context is unusable, or another thread is inside a call on it (see
    context.Context.enter), or an array is not contiguous. A timeout here marks the engine
    failed, as on the general path."""
    busy = ctx.busy
    if ctx.failure is not None or not busy.acquire(False):
        return False
    ctx.running = kind
    try:
        done = ctx.shm.run_plan(kind, plan, arr, out)
    finally:
        ctx.running = None  # (ctx.leave(), inline: this path counts every 0.1 us)
        busy.release()
    return done and ctx.failure is None


def _as_input(res, x, arr):
    """A direct path's new numpy result, of the kind x is (a tensor for a tensor)."""
    return res if arr is x else _buffers.from_numpy(res)


def allreduce(x, op="sum", out=None, algorithm="auto"):
    """Reduce x elementwise over all ranks; every rank gets the result.

    op: sum, prod, min, max, avg (avg: floating dtypes). out=None returns a new array; pass
    out=x to reduce in place. algorithm: auto (shared memory on one host, else by size), shm,
    ring, rhd (recursive halving-doubling), tree. Every rank gets bitwise the same result."""
    # Direct path: arrays on one host skip the general machinery (microseconds of Python that
    # would dominate calls up to ~1 MiB) through a prepared engine call. Same protocol, same
    # header checks. Shared buffers longer than one step take the general path, for zero-copy.
    ctx, arr = _direct(x, algorithm)
    if ctx is not None and (out is None or out is x or (arr is x and _same_layout(out, x) and
                                                        not np.may_share_memory(out, x))):
        plan = _plain_plan(ctx, "allreduce", arr, op)
        if plan is not None:
            try:
                res = np.empty_like(arr) if out is None else arr if out is x else out
            except Exception:  # a MemoryError: the general path allocates it again, before its
                res = None     # header exchange, so that the peers hear of it
            if res is not None and _run_direct(ctx, "allreduce", plan, arr, res):
                if backend_sink is not None and (sink := backend_sink()) is not None:
                    sink.append("shm")  # the direct path is the shm backend's
                return _as_input(res, x, arr) if out is None else out
    return _allreduce(x, op, out, algorithm, False)


def allreduce_async(x, op="sum", out=None, algorithm="auto"):
    """Non-blocking allreduce: returns a Handle; handle.wait() returns the result."""
    return _allreduce(x, op, out, algorithm, True)


def reduce(x, root=0, op="sum", out=None):
    """Reduce x over all ranks onto root; returns the result on root, None elsewhere."""
    what = "reduce"
    if _device.is_device(x):
        return gpu_collectives.reduce(x, root, op, out)

    def prepare(ctx):
        xb = _buffers.wrap(x)
        opc, avg = _dtypes.op_code(op, xb.code)
        r = _check_root(root, ctx.size)
        res, ob = _output(xb, out, what) if ctx.rank == r else (None, None)
        scale = 1.0 / ctx.size if avg else 1.0
        hdr = header.make(what, xb.code, opc, avg, r, xb.shape,
                          "shm" if ctx.shm is not None else "tree")
        if _mflog.paths:
            _log_path(ctx, what, "shm" if ctx.shm is not None else "tree", xb)
        if ctx.shm is not None:
            def body(hdr):
                ctx.shm.run(what, what, hdr, xb.code, opc, scale, r, xb, ob, xb.count)
                return _finish(res, ob) if ob is not None else None
        else:
            work = np.array(xb.arr)  # the tree reduce uses its buffer as scratch (allocated
            # before the header exchange: a MemoryError here is a rejection the peers hear of)

            def body(hdr):
                _exchange_headers(ctx, what, hdr)
                algorithms.tree_reduce(ctx.comm, work, xb.code, opc, r)
                if ob is None:
                    return None
                ob.arr[...] = work
                if avg and ob.count:
                    _C.scale(ob.ptr, ob.count, ob.code, scale)
                return _finish(res, ob)
        return hdr, body

    return _run(what, prepare)


# --- broadcast ----------------------------------------------------------------------------------

def _broadcast(x, root, async_, element=0):
    what = "broadcast"
    if _device.is_device(x):
        return gpu_collectives.broadcast(x, root, async_, element)

    def prepare(ctx):
        xb = _buffers.wrap(x, writable=True)
        r = _check_root(root, ctx.size)
        if ctx.shm is not None:
            zc, peers = ctx.shm.zero_copy_info(xb)
            hdr = header.make(what, xb.code, 0, False, r, xb.shape, "shm", zc, element=element)
            if _mflog.paths:
                _log_path(ctx, what, "shm", xb, zc[0] >= 0)

            def body(hdr):
                ctx.shm.run(what, what, hdr, xb.code, root=r, out=xb, count=xb.count,
                            peer_in=peers)
                return _finish(x, xb)
        else:
            hdr = header.make(what, xb.code, 0, False, r, xb.shape, "tree", element=element)
            if _mflog.paths:
                _log_path(ctx, what, "tree", xb)

            def body(hdr):
                _exchange_headers(ctx, what, hdr)
                algorithms.tree_broadcast(ctx.comm, xb.arr, r)
                return _finish(x, xb)
        return hdr, body

    return _run(what, prepare, async_)


def broadcast(x, root=0, element=0):
    """Copy root's x into x on every rank, in place; returns x. element (for adapters that
    widen their callers' data, as the torch.distributed backend does): the index in
    comm.header.ELEMENTS of the type x had before, compared between ranks like the dtype."""
    return _broadcast(x, root, False, element)


def broadcast_async(x, root=0, element=0):
    return _broadcast(x, root, True, element)


# --- allgather ----------------------------------------------------------------------------------

def _allgather(x, out, async_, element=0):
    what = "allgather"
    if _device.is_device(x):
        return gpu_collectives.allgather(x, out, async_, element)

    def prepare(ctx):
        xb = _buffers.wrap(x)
        shape = (ctx.size * xb.shape[0], *xb.shape[1:]) if xb.shape else (ctx.size,)
        res, ob = _output(xb, out, what, ctx.size * xb.count, shape)
        if ctx.shm is not None:
            zc, peers = ctx.shm.zero_copy_info(xb)
            hdr = header.make(what, xb.code, 0, False, 0, xb.shape, "shm", zc, element=element)
            if _mflog.paths:
                _log_path(ctx, what, "shm", xb, zc[0] >= 0)

            def body(hdr):
                ctx.shm.run(what, what, hdr, xb.code, inp=xb, out=ob, count=xb.count,
                            peer_in=peers)
                return _finish(res, ob)
        else:
            hdr = header.make(what, xb.code, 0, False, 0, xb.shape, "ring", element=element)
            if _mflog.paths:
                _log_path(ctx, what, "ring", xb)

            def body(hdr):
                _exchange_headers(ctx, what, hdr)
                algorithms.ring_allgather(ctx.comm, xb.arr, ob.arr)
                return _finish(res, ob)
        return hdr, body

    return _run(what, prepare, async_)


def allgather(x, out=None, element=0):
    """Concatenate every rank's x along axis 0 (rank order); 0-d inputs give shape (size,).
    All ranks must pass the same shape. element: as broadcast's."""
    ctx, arr = _direct(x)
    if ctx is not None and out is None and not element and arr.ndim and arr.size:
        # (as allreduce's direct path)
        plan = _plain_plan(ctx, "allgather", arr)
        if plan is not None:
            try:
                res = np.empty((ctx.size * arr.shape[0], *arr.shape[1:]), arr.dtype)
            except Exception:  # (as allreduce's)
                res = None
            if res is not None and _run_direct(ctx, "allgather", plan, arr, res):
                return _as_input(res, x, arr)
    return _allgather(x, out, False, element)


def allgather_async(x, out=None, element=0):
    return _allgather(x, out, True, element)


# --- reduce_scatter -----------------------------------------------------------------------------

def _reduce_scatter(x, op, out, async_):
    what = "reduce_scatter"
    if _device.is_device(x):
        return gpu_collectives.reduce_scatter(x, op, out, async_)

    def prepare(ctx):
        xb = _buffers.wrap(x)
        opc, avg = _dtypes.op_code(op, xb.code)
        if not xb.shape:
            raise ValueError("reduce_scatter needs an array with at least one dimension")
        rows = split_rows(xb.shape[0], ctx.size)
        row_len = xb.count // xb.shape[0] if xb.shape[0] else 0
        counts = [r * row_len for r in rows]
        res, ob = _output(xb, out, what, counts[ctx.rank], (rows[ctx.rank], *xb.shape[1:]))
        scale = 1.0 / ctx.size if avg else 1.0
        if ctx.shm is not None:
            zc, peers = ctx.shm.zero_copy_info(xb)
            hdr = header.make(what, xb.code, opc, avg, 0, xb.shape, "shm", zc)
            if _mflog.paths:
                _log_path(ctx, what, "shm", xb, zc[0] >= 0)

            def body(hdr):
                ctx.shm.run(what, what, hdr, xb.code, opc, scale, 0, xb, ob, xb.count,
                            chunks=counts, peer_in=peers)
                return _finish(res, ob)
        else:
            hdr = header.make(what, xb.code, opc, avg, 0, xb.shape, "ring")
            if _mflog.paths:
                _log_path(ctx, what, "ring", xb)

            work = np.array(xb.arr)  # the ring uses its buffer as scratch (allocated before
            # the header exchange, as reduce's)

            def body(hdr):
                _exchange_headers(ctx, what, hdr)
                chunk = algorithms.ring_reduce_scatter(ctx.comm, work, xb.code, opc, counts)
                ob.arr[...] = chunk
                if avg and ob.count:
                    _C.scale(ob.ptr, ob.count, ob.code, scale)
                return _finish(res, ob)
        return hdr, body

    return _run(what, prepare, async_)


def reduce_scatter(x, op="sum", out=None):
    """Reduce x over all ranks and give rank r the r-th block of rows (axis 0 split like
    numpy.array_split: the first shape[0] % size ranks get one row more)."""
    return _reduce_scatter(x, op, out, False)


def reduce_scatter_async(x, op="sum", out=None):
    return _reduce_scatter(x, op, out, True)


# --- barrier, send, recv ------------------------------------------------------------------------

def barrier():
    """Return once every rank has called barrier()."""
    what = "barrier"

    def prepare(ctx):
        hdr = header.make(what)

        def body(hdr):
            _exchange_headers(ctx, what, hdr)
        return hdr, body

    return _run(what, prepare)


# User tags are offset so they never meet mlfabric's own traffic on the communicator (p2p.TAG
# 0x6D66, the torch backend's group tag 0x6D67): [0, 0x2000) -> 0x4000 + tag (as always), larger
# ones -> 0x8000 + tag, up to what MPI allows (MPI_TAG_UB: 2^31 - 1 with Open MPI; at least 32767).
_SEND_TAG_BASE = 0x4000
_SMALL_TAGS = 0x2000
_LARGE_TAG_BASE = 0x8000


_user_tags = []   # [how many user tags MPI can carry], asked once (MPI_TAG_UB is per process)


def _user_tag(tag):
    """The MPI tag that carries user `tag` (ValueError, naming the range, if it cannot be)."""
    if not _user_tags:
        ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)   # None: only the standard's 32767 is sure
        ub = 32767 if ub is None else int(ub)
        _user_tags.append(max(_SMALL_TAGS, ub - _LARGE_TAG_BASE + 1))
    top = _user_tags[0]
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag < top:
        raise ValueError(f"tag must be an int in [0, {top}), got {tag!r}")
    tag = int(tag)
    return _SEND_TAG_BASE + tag if tag < _SMALL_TAGS else _LARGE_TAG_BASE + tag


def _meta_of(xb, element):
    """What a send tells its receiver first: dtype code, element count, element type (see
    broadcast's element), checked by the receiver against its own array."""
    return np.array([xb.code, xb.count, element], np.int64)


def _recv_mismatch(what, source, meta, xb, element):
    """The MismatchError of a receive whose sender's array differs, or None."""
    code, count, sent_element = (int(v) for v in meta)
    if code == xb.code and count == xb.count and sent_element == element:
        return None
    elements = header.ELEMENTS

    def shown(n, c, e):
        return f"{n} x {_dtypes.DTYPE_NAMES[c]}" + (f" (from {elements[e]})" if e else "")
    return MismatchError(f"{what}: rank {source} sent {shown(count, code, sent_element)}, this "
                         f"rank expects {shown(xb.count, xb.code, element)}")


def send(x, dest, tag=0, element=0):
    """Send x to rank dest; blocks until x may be reused. The receiver's array must have the
    same dtype and number of elements: a mismatch raises MismatchError at the receiver.
    element: as broadcast's."""
    request = isend(x, dest, tag, element)
    context.get().executor.run("send", request.wait)  # (after the calls queued before it)


def recv(x, source, tag=0, element=0):
    """Receive into x from rank source (in place); returns x. See send()."""
    ctx = context.get()
    xb = _buffers.wrap(x, writable=True)
    source = _check_root(source, ctx.size)
    t = _user_tag(tag)
    meta = np.empty(3, np.int64)
    what = f"recv from rank {source}"

    def body():
        ctx.check(what)
        with _watched(ctx, what):
            p2p.wait([ctx.comm.Irecv(meta, source, t)], [source], what, [True])
            error = _recv_mismatch(what, source, meta, xb, element)
            if error is not None:
                # Drain the payload so the channel stays usable, then report.
                scratch = np.empty(int(meta[1]) * _dtypes.ITEMSIZE[int(meta[0])], np.uint8)
                p2p.wait([ctx.comm.Irecv([scratch, MPI.BYTE], source, t)], [source], what,
                         [True])
                raise error
            p2p.wait([ctx.comm.Irecv([p2p.as_bytes(xb.arr), MPI.BYTE], source, t)], [source],
                     what, [True])
        return _finish(x, xb)

    return ctx.executor.run("recv", body)


@contextlib.contextmanager
def _watched(ctx, what):
    """A point-to-point wait on ctx: watched for a peer giving up (p2p.watch); a timeout or an
    MPI error in it makes this rank give up on ctx (a late message would otherwise be matched
    by a later receive), a MismatchError (the sender's array differs, the payload drained)
    does not."""
    previous = p2p.watch(ctx.peer_failure)
    try:
        yield
    except MismatchError:
        raise
    except MlfabricError as exc:
        ctx.fail(what, exc)
        raise
    finally:
        p2p.watch(previous)


class Request:
    """A send or receive in flight (isend / irecv), posted when made, so that a program whose
    ranks post receives before sends (batch_isend_irecv, a pipeline's exchange) progresses.
    wait() completes it, on the calling thread, within MLFABRIC_TIMEOUT like every wait in
    mlfabric, and returns the received array (irecv) or None (isend); test() says whether it
    is complete, without waiting. A receive checks what the sender said it sent (dtype, count,
    element type) when it completes: a mismatch is a MismatchError there (the payload, received
    into the array or cut short by MPI, is then not a result)."""

    def __init__(self, ctx, what, peer, reqs, recv=None):
        self._ctx, self._what, self._peer, self._reqs, self._recv = ctx, what, peer, reqs, recv
        self._lock = threading.Lock()
        self._done = False
        self._result = self._error = None

    def test(self):
        """Whether wait() would return (or raise) at once. While another thread is inside
        wait(), False (MPI forbids testing a request another thread is waiting on)."""
        if self._done:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._done or bool(MPI.Request.Testall(self._reqs))
        except MPI.Exception:  # an MPI error (a truncated receive): wait() reports it
            return True
        finally:
            self._lock.release()

    def give_up(self, timeout):
        """Past a bound of `timeout` seconds without completing (a poller's, which must not
        block): park the requests and make wait() raise the PeerTimeoutError wait() would have.
        False, doing nothing, where wait() should run instead: another thread is inside it (its
        own bound ends it), or the requests completed meanwhile."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._done:
                return True
            try:
                if MPI.Request.Testall(self._reqs):
                    return False
            except MPI.Exception:  # an MPI error (a truncated receive): wait() reports it
                return False
            is_recv = [self._recv is not None] * len(self._reqs)
            try:
                p2p.give_up(self._reqs, [self._peer] * len(self._reqs), is_recv, self._what,
                            timeout)
            except PeerTimeoutError as exc:
                self._ctx.fail(self._what, exc)
                self._error = exc
            self._done = True
            return True
        finally:
            self._lock.release()

    def wait(self, timeout=None):
        """The result (see the class); `timeout` (seconds, None: MLFABRIC_TIMEOUT) bounds this
        wait instead, torch's Work.wait(timeout): past it the request is given up as at
        MLFABRIC_TIMEOUT, the PeerTimeoutError naming that bound."""
        with self._lock:
            if not self._done:
                try:
                    with _watched(self._ctx, self._what):
                        self._result = self._complete(timeout)
                except BaseException as exc:
                    self._error = exc
                self._done = True
        if self._error is not None:
            raise self._error
        return self._result

    def _complete(self, timeout):
        peers, what = [self._peer] * len(self._reqs), self._what
        # one bound for the whole receive, header and payload (not one per phase)
        bound = {"since": time.perf_counter()}
        if timeout is not None:
            bound.update(timeout=timeout, bound="Work.wait's timeout")
        if self._recv is None:
            p2p.wait(self._reqs, peers, what, [False] * len(self._reqs), **bound)
            return None
        x, xb, meta, element = self._recv
        try:
            p2p.wait(self._reqs[:1], peers[:1], what, [True], **bound)
        except PeerTimeoutError:  # the payload's receive must not write into x later either
            p2p.park(self._reqs[1:], [True])
            raise
        error = _recv_mismatch(what, self._peer, meta, xb, element)
        try:
            p2p.wait(self._reqs[1:], peers[1:], what, [True], **bound)
        except MlfabricError:  # a payload longer than the array: MPI cut it short
            if error is None:
                raise
        if error is not None:
            raise error
        return _finish(x, xb)


def isend(x, dest, tag=0, element=0):
    """Start sending x to rank dest: a Request (leave x alone until its wait() returns). See
    send()."""
    ctx = context.get()
    xb = _buffers.wrap(x)
    dest = _check_root(dest, ctx.size)
    t = _user_tag(tag)
    meta = _meta_of(xb, element)
    what = f"send to rank {dest}"
    ctx.check(what)
    return Request(ctx, what, dest, [
        ctx.comm.Isend(meta, dest, t), ctx.comm.Isend([p2p.as_bytes(xb.arr), MPI.BYTE], dest, t)])


def irecv(x, source, tag=0, element=0):
    """Start receiving into x (in place) from rank source: a Request whose wait() returns x.
    See recv()."""
    ctx = context.get()
    xb = _buffers.wrap(x, writable=True)
    source = _check_root(source, ctx.size)
    t = _user_tag(tag)
    meta = np.empty(3, np.int64)
    what = f"recv from rank {source}"
    ctx.check(what)
    return Request(ctx, what, source, [
        ctx.comm.Irecv(meta, source, t), ctx.comm.Irecv([p2p.as_bytes(xb.arr), MPI.BYTE],
                                                       source, t)], (x, xb, meta, element))


__all__ = ["allreduce", "allreduce_async", "reduce", "broadcast", "broadcast_async", "allgather",
           "allgather_async", "reduce_scatter", "reduce_scatter_async", "barrier", "send", "recv",
           "isend", "irecv", "Request", "Handle", "chosen_backend"]


# --- alltoall -----------------------------------------------------------------------------------
# Rows of x (axis 0) are split into one block per rank (splits[j] rows go to rank j, in rank order)
# and every rank gets the blocks addressed to it, concatenated in rank order. Ranks may send
# different numbers of rows; the dtype and the shape of one row must agree. It runs over MPI
# (Ialltoall of the split counts, then Ialltoallv of the rows) on every kind of host.

def _alltoall_header(code, row_shape):
    # The shape carried is one row's (the first dimension may differ between ranks).
    return header.make("alltoall", code, 0, False, 0, row_shape)


def _alltoall(x, splits, async_):
    what = "alltoall"
    if _device.is_device(x):
        return gpu_collectives.alltoall(x, splits, async_)

    def prepare(ctx):
        xb = _buffers.wrap(x)
        if not xb.shape:
            raise ValueError("alltoall needs an array with at least one dimension")
        send_rows = _alltoall_splits(splits, xb.shape[0], ctx.size)
        if _mflog.paths:
            _log_path(ctx, what, "mpi", xb)

        def body(hdr):
            try:
                _exchange_headers(ctx, what, hdr)
            except MismatchError as exc:
                # header.py describes kinds it does not list as "?": on this side that is
                # alltoall.
                msg = str(exc).replace("kind: ? on", "kind: alltoall on")
                if "disagree on shape" in msg:
                    msg += (" (alltoall compares the shape of one row: the dimensions after the "
                            "first)")
                raise MismatchError(msg) from None
            rest = tuple(xb.shape[1:])
            recv_rows, row_bytes = _exchange_splits(ctx, what, send_rows, rest, xb.code)
            res, ob = _buffers.empty_like(xb, (int(recv_rows.sum()), *rest))
            if row_bytes:  # the same on every rank: MPI_Ialltoallv is collective, so a rank
                # with no rows to move takes part too. Counts in rows of a contiguous row type:
                # no 2**31 limit on the bytes moved.
                row = MPI.BYTE.Create_contiguous(row_bytes).Commit()
                try:
                    sdispl = np.concatenate(([0], np.cumsum(send_rows)[:-1]))
                    rdispl = np.concatenate(([0], np.cumsum(recv_rows)[:-1]))
                    req = ctx.comm.Ialltoallv(
                        [p2p.as_bytes(xb.arr),
                         (send_rows.astype(np.int32), sdispl.astype(np.int32)), row],
                        [p2p.as_bytes(ob.arr),
                         (recv_rows.astype(np.int32), rdispl.astype(np.int32)), row])
                    p2p.wait([req], p2p.others(ctx.comm), what)
                finally:
                    row.Free()
            return _finish(res, ob), recv_rows
        return _alltoall_header(xb.code, tuple(xb.shape[1:])), body

    return _run(what, prepare, async_)


def alltoall(x, splits=None):
    """Send splits[j] rows of x (axis 0, in order) to rank j and receive every rank's rows for
    this one; returns (out, recv_splits): the received rows concatenated in rank order, and how
    many came from each rank (int64 array). splits=None sends shape[0] / size rows to each rank.
    Ranks must agree on the dtype and on the shape of one row (a MismatchError otherwise)."""
    return _alltoall(x, splits, False)


def alltoall_async(x, splits=None):
    """Non-blocking alltoall: returns a Handle; handle.wait() returns (out, recv_splits)."""
    return _alltoall(x, splits, True)


__all__ += ["alltoall", "alltoall_async"]
