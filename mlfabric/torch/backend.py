"""torch.distributed backend "mlfabric": importing this module registers it, so that

    torch.distributed.init_process_group("mlfabric")     # under mpirun, no env vars needed
    DistributedDataParallel(model)                        # runs unchanged, on mlfabric

work on CPU tensors (and torch's functional collectives, DeviceMesh and DTensor, which find the
group by the name torch gives it). Owns the ProcessGroup subclass (MlfabricProcessGroup), its
Work objects, the "mlfabric://" rendezvous and the registrations with torch; the data moves
through mlfabric's public collectives (mlfabric/comm/collectives.py), which also turn a shape, dtype
or op that differs between ranks into an error on every rank.

Ranks and world size come from MPI (mlfabric.init() on MPI.COMM_WORLD if not yet initialised).
Rendezvous: init_method="mlfabric://" asks MPI, and so does the default init_method ("env://")
of init_process_group("mlfabric") (or of a backend string naming it, "cpu:mlfabric,...") when
none of MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE is set (torch would raise there) or they hold
only what mlfabric.init() exported under mpirun; every other backend's env:// is torch's own. Either
way every rank gets a real TCPStore (rank 0 serves it on a free port, MPI tells the others where),
so torch code that needs a store (gloo groups beside this one, TORCH_DIST_INIT_BARRIER=1) works.
The store authenticates nothing; it listens on 127.0.0.1 when the job runs on one host, else on
the one address rank 0 reaches its peers from, or MLFABRIC_STORE_ADDR (docs/security.md).
A rank or world size passed to init_process_group must agree with MPI's, else an error.

Groups: new_group(ranks, backend="mlfabric") of any ranks (every rank calls new_group, as torch
requires; only the members reach the backend). A group of fewer than every rank gets a context
of its own (mlfabric.comm.context.Context on a communicator made among its members alone,
MPI_Comm_create_group: its own shared memory, queue, NCCL communicator), and each of its calls
runs in that context (context.using), so groups run independently; it is freed at mlfabric's
finalize (destroy_process_group does not free it sooner). CUDA tensors move over NCCL
(mlfabric's GPU path); results that need a copy back (lists of several tensors, widened dtypes)
are copied on the stream that was current when the call was made. init_process_group's timeout
is not used: mlfabric's own bound (MLFABRIC_TIMEOUT) applies to every call. Work.wait(timeout)
bounds that one wait further: a collective's raises MlfabricError and leaves the call to finish; a
send's or receive's, if shorter than MLFABRIC_TIMEOUT, gives the request up (PeerTimeoutError,
naming the bound; a receive is cancelled, so a message coming later is never written into its
tensor).

Calls: every torch call is one mlfabric call (gather, all_to_all and sparse all_reduce: more,
below), in the order issued. Collectives are non-blocking: Work.wait() returns, and the Work's
future completes, when mlfabric is done; reduce and barrier complete before they return (mlfabric
has no non-blocking forms of them). send and recv are mlfabric.isend / irecv, posted when made
(ranks may post receives first, as batch_isend_irecv does) and completed by Work.wait() on the
caller's thread (or, once get_future() is asked for, by one polling thread); their tags are ints
from 0 to what MPI's tag bound allows (2^31 - 32768 with Open MPI, 8192 at least; mlfabric offsets
them past its own). Future callbacks run on a small thread pool,
so one may wait for another collective; but a collective issued from a callback races the training
thread for its place in the issue order, which must be the same on every rank, so hooks that do
that (PowerSGD) are not supported. all_to_all_single takes any split sizes (rows of dimension 0;
zero too), all_to_all tensors of any sizes: first one small allgather of every rank's split sizes,
on the caller's thread (so after the calls issued before it), so sizes that disagree anywhere (a
rank expecting rows that are not sent it) are a MismatchError on every rank before any data moves;
then one mlfabric alltoall, in the background (equal splits everywhere and at most _ALLGATHER_BYTES
gathered: an allgather, faster there). gather is an allgather too, after one small allgather of the
ranks' roots (an allgather's header has none to compare). Outputs are checked before the call: one
whose elements share memory (an expanded tensor) is refused.
Reductions: SUM, AVG, PRODUCT, MIN, MAX on float32/64, float16, bfloat16, int32, int64; calls
that only move data carry those, the narrow integers and bool (widened to int32), complex ones
(as float pairs), uint64 (its bits as int64) and the float8 kinds (their bits as uint8, widened);
others are a TypeError. The dtype each rank had is
compared with the rest of the call (element=, comm/header.py: int8 against uint8 is a
MismatchError on every rank, though both travel as int32).
all_reduce of a sparse COO tensor (SUM or AVG) is gloo's sparse allreduce, which DDP uses for
nn.Embedding(sparse=True): allgathers of every rank's entries (sparse.combine sums them).
"""
import concurrent.futures
import contextlib
import functools
import importlib
import math
import operator
import os
import socket
import sys
import threading
import time
import warnings
import zlib
from datetime import timedelta
from urllib.parse import parse_qsl, urlparse

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllreduceCoalescedOptions, AllreduceOptions,
                                        BroadcastOptions, GatherOptions, ReduceOp, ReduceOptions,
                                        ReduceScatterOptions, ScatterOptions)

import mlfabric as mf
from mlfabric._core import buffers as _buffers, config as _config
from mlfabric.comm import context as _context
from mlfabric.comm import header as _header
from mlfabric.comm import launch as _launching
from mlfabric.comm import nccl as _nccl
from mlfabric.comm import wait as _wait
from mlfabric.errors import MismatchError, MlfabricError

from . import sparse as _sparse

BACKEND = "mlfabric"
INIT_METHOD = "mlfabric://"

_OPS = ((ReduceOp.SUM, "sum"), (ReduceOp.AVG, "avg"), (ReduceOp.PRODUCT, "prod"),
        (ReduceOp.MIN, "min"), (ReduceOp.MAX, "max"))
# What mlfabric carries as is; other dtypes are widened for the calls that do not reduce.
_WIRE_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16,
                          torch.int32, torch.int64))
_ELEMENTS = {getattr(torch, name): i for i, name in enumerate(_header.ELEMENTS)
             if isinstance(getattr(torch, name, None), torch.dtype)}
_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
# The module (torch.distributed.rendezvous is also the name of a function in torch.distributed).
_rdzv = importlib.import_module("torch.distributed.rendezvous")


# --- Work -----------------------------------------------------------------------------------------

class MlfabricWork(dist.Work):
    """One call in flight. wait() blocks until mlfabric has finished it (raising its error) and
    its future is complete; get_future() gives that torch Future, whose value is the output
    tensors (what DDP and its communication hooks chain on)."""

    def __init__(self, handle, future):
        super().__init__()
        self._handle = handle      # mlfabric Handle; None for a call already complete
        self._future = future

    def wait(self, timeout=None):
        if self._handle is not None:
            self._handle.wait(_seconds(timeout))
            self._future.wait()  # set just after the handle completes (see _launch)
        return True

    def is_completed(self):
        return self._future.done()

    def get_future(self):
        return self._future

    def result(self):
        self.wait()
        return self._future.value()


def _seconds(timeout):
    """Work.wait's timeout (C++ passes a timedelta; zero means none) in seconds, or None."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return timeout if timeout > 0 else None


# Futures are completed here, not on mlfabric's communication thread: completing one runs its
# callbacks, and a callback that issues a collective and waits for it (a DDP communication hook
# may) would otherwise block the very thread that has to run that collective. The pool adds a
# thread when all of its threads are busy, so such a callback cannot starve the next completion.
_completer = concurrent.futures.ThreadPoolExecutor(max_workers=32,
                                                   thread_name_prefix="mlfabric-futures")


def _launch(what, handle, finish):
    """Work of an mlfabric call in flight. finish(result of the call) runs after it on mlfabric's
    communication thread (queued now, so in issue order; it issues nothing itself), puts the
    results in place, and returns the tensors the future gives. With CUDA in use, finish's copies
    run on the stream current when the call was made (the communication thread's own is
    another), so the caller's later work there follows them."""
    future = torch.futures.Future()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    on_stream = torch.cuda.stream(torch.cuda.current_stream()) if cuda else \
        contextlib.nullcontext()

    def complete():
        try:
            with on_stream:
                out = finish(handle.wait())
        except BaseException as exc:
            _completer.submit(future.set_exception, exc)
            raise
        _completer.submit(future.set_result, out)
        return out

    return MlfabricWork(_context.get().executor.submit(what, complete), future)


class _P2PWork(dist.Work):
    """A send or receive in flight (mlfabric.isend / irecv, posted when made: ranks may post
    receives before sends, as batch_isend_irecv does). wait() completes it on the calling thread
    (within MLFABRIC_TIMEOUT), then finish(the request's result) puts a received tensor in
    place; the future completes then. is_completed() says True only once that is done. A
    future asked for completes by itself: _P2P_POLLER finishes the Work when its request is
    done (one thread for them all, so that pending receives cannot take the threads that
    complete the collectives' futures)."""

    def __init__(self, request, finish):
        super().__init__()
        self._request, self._finish = request, finish
        self._future = torch.futures.Future()
        self._lock = threading.Lock()
        self._out = self._error = None
        self._done = False
        self._polled = False

    def wait(self, timeout=None):
        limit = _seconds(timeout)   # a bound longer than MLFABRIC_TIMEOUT leaves that one
        limit = limit if limit is not None and limit < _config.timeout_s() else None
        with self._lock:
            if not self._done:
                try:
                    self._out = self._finish(self._request.wait(limit))
                except BaseException as exc:  # noqa: BLE001 - raised to every waiter
                    self._error = exc
                self._done = True
                if self._error is not None:
                    _completer.submit(self._future.set_exception, self._error)
                else:
                    _completer.submit(self._future.set_result, self._out)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        if self._done:
            return True
        if not self._request.test():
            return False
        self._wait_quietly()  # at once: puts a received tensor in place
        return True

    def get_future(self):
        with self._lock:
            if not self._done and not self._polled:
                self._polled = True
                _P2P_POLLER.add(self)
        return self._future

    def _wait_quietly(self):
        try:
            self.wait()
        except BaseException:  # noqa: BLE001 - the future carries it
            pass

    def result(self):
        self.wait()
        return self._out


class _P2PPoller:
    """One thread that finishes the p2p Works whose futures were asked for, as their requests
    complete (polling, paced by _paced() while nothing completes). One still pending
    MLFABRIC_TIMEOUT after it came is given up (its future gets the PeerTimeoutError), at once,
    blocking nothing; unless a thread of the user's waits on it, whose own bound ends it (the
    poller sees it done then)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._works = []  # (work, deadline)
        self._thread = None

    def add(self, work):
        with self._cv:
            self._works.append((work, time.monotonic() + _config.timeout_s()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mlfabric-p2p",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _loop(self):
        from mpi4py import MPI  # (imported by then: a request exists)
        back = _paced()
        while True:
            with self._cv:
                while not self._works:
                    self._cv.wait()
                    back = _paced()
                works = list(self._works)
            if MPI.Is_finalized():  # a receive left pending at exit: nothing can finish it
                return
            now, finished = time.monotonic(), set()
            for work, deadline in works:
                if work.is_completed():
                    finished.add(id(work))
                elif now > deadline and work._request.give_up(_config.timeout_s()):
                    work._wait_quietly()  # at once: the future gets the error
                    finished.add(id(work))
                # (else it stays: a thread of the user's waits on it, or it just completed)
            if finished:
                with self._cv:
                    self._works = [(w, d) for w, d in self._works if id(w) not in finished]
                back = _paced()
            else:
                back.pause()


def _paced():
    """The poller's schedule between polls: comm.wait's back-off in its sleeping phase from the
    start (FIRST_NAP_S doubling to MAX_SLEEP_S: a thread of its own need not spin or yield the
    core), with no deadline of its own (each Work has its own, above)."""
    return _wait.Backoff(math.inf, start=time.perf_counter() - _wait.YIELD_S)


_P2P_POLLER = _P2PPoller()


def _completed(out):
    future = torch.futures.Future()
    future.set_result(out)
    return MlfabricWork(None, future)


# --- argument checks ------------------------------------------------------------------------------

class _Refused(Exception):
    """A local argument error, raised through _refuse so the peers do not wait for this rank."""

    def __init__(self, exc):
        super().__init__(str(exc))
        self.exc = exc


def _refuse(exc):
    """Raise exc on this rank after making the peers' matching call fail too.

    An mlfabric call whose own arguments are invalid still joins the header exchange, marked
    'rejected', so every peer's call fails at once with a MismatchError naming this rank instead
    of waiting for it (collectives._run). An allreduce with an unknown op is such a call; its own
    error on this rank is dropped in favour of exc."""
    mf.allreduce_async(np.zeros(1), op="refused: see the error on that rank")
    raise exc


def _checked(fn):
    """For a collective: turn the _Refused raised by fn's argument checks into _refuse(error).
    The call (and the refusal) runs in the group's context."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        with self._in_group():
            try:
                return fn(self, *args, **kwargs)
            except _Refused as r:
                _refuse(r.exc)
    return call


def _checked_p2p(fn):
    """For send / recv: argument errors are this rank's alone (no collective to fail with it:
    the peer's matching call ends by mlfabric's timeout, as with mlfabric.send / recv)."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        with self._in_group():
            try:
                return fn(self, *args, **kwargs)
            except _Refused as r:
                raise r.exc from None
    return call


def _fail(exc):
    raise _Refused(exc)


def _round(what, row):
    """Every rank's row (one small blocking allgather) ahead of a call's data: where a peer
    refused the call (_refuse), the error this rank gets names the call, not the allgather."""
    try:
        return mf.allgather(row)
    except MismatchError as exc:
        raise MismatchError(f"{what}: {exc}") from None


def _tensor(t, what):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}"))
    if t.device.type == "cuda":
        try:
            _nccl.library()
        except MlfabricError as exc:
            _fail(MlfabricError(f"{what}: tensor is on {t.device}: {exc}"))
    elif t.device.type != "cpu":
        _fail(MlfabricError(f"{what}: tensor is on {t.device}; the mlfabric backend handles CPU "
                            "and CUDA tensors only"))
    if t.layout != torch.strided:
        _fail(TypeError(f"{what}: {t.layout} tensors are not supported, only dense ones"))
    return t


def _tensors(ts, what, n=None):
    """ts as a list of checked CPU tensors (a single tensor counts as a list of one)."""
    ts = [ts] if isinstance(ts, torch.Tensor) else list(ts)
    if n is not None and len(ts) != n:
        _fail(ValueError(f"{what}: expected {n} tensor(s), got {len(ts)}"))
    return [_tensor(t, what) for t in ts]


def _writable(ts, what, role="output"):
    """ts (a tensor or a list), checked that each can take a result. Checked with the arguments,
    before the call: a rank that failed only when writing, after the data moved, would leave
    its peers with their results and no error (or, for a call that runs in place, hanging)."""
    for t in [ts] if isinstance(ts, torch.Tensor) else ts:
        if not t.is_contiguous() and _buffers.elements_overlap(t.shape, t.stride(), 1):
            _fail(ValueError(f"{what}: {role} cannot take the result: elements of it share "
                             "memory (an expanded tensor?); pass a tensor of its own (.clone())"))
    return ts


def _one(ts, what):
    """The single tensor of a per-device list (the mlfabric backend is one CPU device)."""
    ts = _tensors(ts, what)
    if len(ts) != 1:
        _fail(ValueError(f"{what}: expected a list of one tensor, got {len(ts)}"))
    return ts[0]


def _same(ts, like, what, numel=None, role="tensor"):
    """Every tensor of ts has like's dtype and numel (or the given numel)."""
    want = like.numel() if numel is None else numel
    for t in ts:
        if t.dtype != like.dtype:
            _fail(TypeError(f"{what}: tensors must share one dtype, got {t.dtype} and "
                            f"{like.dtype}"))
        if t.numel() != want:
            _fail(ValueError(f"{what}: {role} has {t.numel()} elements, {want} expected"))


def _op(opts, what):
    """mlfabric's op name for an options object's reduceOp (or a ReduceOp given directly)."""
    rop = getattr(opts, "reduceOp", opts)
    for red, name in _OPS:
        if rop == red:
            return name
    label = getattr(getattr(rop, "op", rop), "name", rop)
    _fail(ValueError(f"{what}: the mlfabric backend supports ReduceOp SUM, AVG, PRODUCT, MIN, "
                     f"MAX; got {label}"))


def _wire(t):
    """t, or a copy mlfabric can carry (calls that do not reduce): small integer and bool types
    are widened to int32, complex ones viewed as their float pairs, uint64 viewed as int64 and
    the float8 kinds' bits as uint8 widened (bit patterns, not values: _put restores a float8's)."""
    if t.dtype in _WIRE_DTYPES:
        return t
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj() if t.is_conj() else t)
    if t.dtype == torch.uint64:
        return t.view(torch.int64)
    if t.is_floating_point() and t.element_size() == 1:
        return t.view(torch.uint8).to(torch.int32)
    if t.is_floating_point() or t.element_size() > 4:
        _fail(TypeError(f"dtype {t.dtype} is not supported by the mlfabric backend"))
    return t.to(torch.int32)


def _element(t):
    """What _wire(t) hides, for mlfabric to compare between ranks with the dtype (element=):
    the index of t's dtype in comm.header.ELEMENTS, 0 where t travels as it is. Without it,
    ranks passing int8 and uint8 (both sent as int32) would reinterpret each other's data."""
    return _ELEMENTS.get(t.dtype, 0)  # (no dtype mlfabric carries is in ELEMENTS)


def _into(t):
    """What mlfabric writes t's result into: t's own memory when t is contiguous, else a
    contiguous copy that _back puts into t. So every copy into a caller's tensor is _put's
    (detached; in inference mode for an inference tensor), none mlfabric's own."""
    return t.detach().contiguous()


def _copied(w, t):
    """True when w (from _wire or _into) is a copy of t (results must be put back), not t's
    memory."""
    return w.data_ptr() != t.data_ptr()


def _back(t, w):
    """After mlfabric wrote w = _into(t) (or _into(_wire(t))): t holds the result. [t]."""
    if _copied(w, t):
        _put(t, w)
    return [t]


def _flat(t):
    return t.reshape(-1)


def _same_storage(a, b):
    """Whether a and b are views of one storage: torch lets a call's input be the caller's
    part of its output (all_gather_into_tensor, reduce_scatter_tensor in place), which
    mlfabric refuses (an output partly overlapping its input); one shard is copied instead."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _put(dst, src):
    """Copy src's elements into dst (any layout; src may be wider or a real view: cast back).
    Detached: the backend writes results as gloo does, where autograd does not look (a leaf that
    requires grad takes them). An inference tensor is written in inference mode: this runs on
    mlfabric's thread, outside the caller's inference_mode() if any."""
    dst = dst.detach()
    if dst.is_complex() and not src.is_complex():
        src = torch.view_as_complex(src.reshape(*dst.shape, 2).contiguous())
    elif dst.dtype != src.dtype and dst.is_floating_point() and dst.element_size() == 1:
        src = src.to(torch.uint8).view(dst.dtype)          # a float8's bits, widened by _wire
    # (uint64 sent as int64 needs nothing: copying int64 into uint64 is modulo 2**64, the bits)
    with torch.inference_mode(dst.is_inference()):
        dst.copy_(src.reshape(dst.shape))


def _splits(splits, t, n, what, name):
    """Rows of t's dimension 0 going to (or coming from) each of n ranks, a list of n ints.
    torch's split sizes (empty: none given) must be n non-negative integers adding up to
    dimension 0; none given, dimension 0 must divide by n (equal parts)."""
    if t.dim() == 0:
        _fail(ValueError(f"{what}: the {name} needs a dimension 0 to split"))
    rows = t.shape[0]
    if splits is None or len(splits) == 0:
        if rows % n:
            _fail(ValueError(f"{what}: {name} dimension 0 ({rows}) does not split into {n} "
                             "equal parts"))
        return [rows // n] * n
    try:
        got = [operator.index(s) for s in splits]
    except TypeError:
        _fail(TypeError(f"{what}: {name} split sizes must be integers, got {list(splits)}"))
    if len(got) != n or sum(got) != rows or min(got) < 0:
        _fail(ValueError(f"{what}: {name} split sizes {got}: expected {n} (one per rank), "
                         f"non-negative, adding up to the {name}'s dimension 0 ({rows})"))
    return got


def _row(t):
    """Elements of one row (along dimension 0) of t."""
    return math.prod(t.shape[1:])


def _counted(count, what, name):
    """A count of rows mlfabric's alltoall passes to MPI as a 32-bit int: refused beyond."""
    if count >= 2 ** 31:
        _fail(ValueError(f"{what}: the {name} has {count} rows (elements, for a list) in all; "
                         "the mlfabric backend moves fewer than 2**31 per call"))


# Equal all_to_all splits everywhere: moved by an allgather up to this many bytes gathered on
# each rank (size x one input), by mlfabric's alltoall beyond. Measured at 2 ranks on one host:
# the allgather faster up to 64 KiB inputs, as fast at 128 KiB, the alltoall faster from 256 KiB
# (1.6x at 4 MiB, where the allgather moves twice the bytes).
_ALLGATHER_BYTES = 256 << 10

# Codes of torch's dtypes in the split tables (crc32 of the name: the same on every rank).
_DTYPE_NAMES = {zlib.crc32(str(d).encode()): str(d)
                for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _split_table(dtype, in_row, out_row, send, recv):
    """This rank's row of an all_to_all's split table: its dtype, the elements of one input and
    of one output row, the rows it sends to each rank and those it expects from each."""
    return np.array([zlib.crc32(str(dtype).encode()), in_row, out_row, *send, *recv], np.int64)


def _check_split_table(table, what, form):
    """Every rank's _split_table (allgathered, so each rank sees the same): a MismatchError
    naming the ranks, the same on every rank, where dtypes differ or what a rank sends another
    is not what that one expects (in elements: rows of another size may carry them). form:
    "single" (split sizes) or "list" (one tensor per rank, counted in elements)."""
    n = table.shape[0]
    codes = table[:, 0].tolist()
    if len(set(codes)) > 1:
        parts = "; ".join(
            f"{_DTYPE_NAMES.get(c, c)} on rank(s) {[r for r, x in enumerate(codes) if x == c]}"
            for c in dict.fromkeys(codes))
        raise MismatchError(f"{what}: ranks disagree on dtype: {parts}")
    in_row, out_row = table[:, 1], table[:, 2]
    rows = in_row.tolist()
    if len(set(rows)) > 1:  # the alltoall moves rows of one size
        parts = "; ".join(f"{q} on rank(s) {[r for r, x in enumerate(rows) if x == q]}"
                          for q in dict.fromkeys(rows))
        raise MismatchError(f"{what}: ranks disagree on the elements of one input row "
                            f"(dimensions after the first): {parts}")
    send, recv = table[:, 3:3 + n], table[:, 3 + n:3 + 2 * n]
    sent = send * in_row[:, None]          # [i, j]: elements rank i sends rank j
    expected = recv * out_row[:, None]     # [j, i]: elements rank j expects from rank i
    bad = [(i, j) for i in range(n) for j in range(n) if sent[i, j] != expected[j, i]]
    if not bad:
        return
    lines = []
    for i, j in bad[:6]:
        s, e = int(send[i, j]), int(recv[j, i])
        if form == "list":
            lines.append(f"rank {i}'s input_tensors[{j}] has {s} element(s), rank {j}'s "
                         f"output_tensors[{i}] {e}")
        elif in_row[i] == out_row[j]:
            lines.append(f"rank {i} sends {s} row(s) to rank {j}, which expects {e} "
                         f"(output_split_sizes[{i}] there)")
        else:
            lines.append(f"rank {i} sends {s} row(s) of {in_row[i]} element(s) to rank {j}, "
                         f"which expects {e} row(s) of {out_row[j]} (output_split_sizes[{i}] "
                         "there)")
    more = f"; and {len(bad) - 6} more" if len(bad) > 6 else ""
    receivers = sorted({j for _, j in bad})
    sizes = "output_split_sizes" if form == "single" else "output_tensors"
    raise MismatchError(f"{what}: the {sizes} of rank(s) {receivers} disagree with what the "
                        f"ranks send: {'; '.join(lines)}{more}; no data was exchanged")


# --- the process group ----------------------------------------------------------------------------

class MlfabricProcessGroup(dist.ProcessGroup):
    """A torch.distributed ProcessGroup whose collectives are mlfabric's (CPU tensors).

    Created by init_process_group("mlfabric") / new_group(backend="mlfabric"); its rank and size
    are mlfabric's, or those of its own context (ctx) for a group of fewer ranks. Each method
    takes torch's usual (tensors, options; roots and peers as group ranks) and returns a Work."""

    def __init__(self, rank, size, ctx=None):
        super().__init__(rank, size)
        self._rank, self._size, self._ctx = rank, size, ctx

    def _in_group(self):
        """The context this group's calls run in (mlfabric's own for a group of every rank)."""
        return _context.using(self._ctx) if self._ctx is not None else contextlib.nullcontext()

    def getBackendName(self):
        return BACKEND

    # torch names every group (_set_group_name) and finds it again by that name: functional
    # collectives, DeviceMesh, DTensor. The C++ ProcessGroup keeps the name in its C++
    # backends, of which this Python group has none, so it keeps its own.
    def _set_group_name(self, name):
        self._group_name = name

    @property
    def group_name(self):
        return getattr(self, "_group_name", "")

    def _set_group_desc(self, desc):
        self._group_desc = desc

    @property
    def group_desc(self):
        return getattr(self, "_group_desc", "")

    def __repr__(self):
        return f"MlfabricProcessGroup(rank={self._rank}, size={self._size})"

    # --- reductions ---

    @_checked
    def allreduce(self, tensors, opts=None):
        """Reduce over ranks in place. Several tensors (gloo's per-device form) must share shape
        and dtype; each gets the reduction over every rank and every tensor of the list."""
        what = "allreduce"
        op = _op(opts if opts is not None else AllreduceOptions(), what)
        if isinstance(tensors, (list, tuple)) and len(tensors) == 1 and \
                getattr(tensors[0], "layout", None) == torch.sparse_coo:
            return self._sparse_allreduce(tensors[0], op, what)
        ts = _writable(_tensors(tensors, what), what)
        if not ts:
            _fail(ValueError(f"{what}: empty tensor list"))
        if len(ts) == 1:
            t, w = ts[0], _into(ts[0])
            return _launch(what, mf.allreduce_async(w, op=op, out=w), lambda _: _back(t, w))
        _same(ts, ts[0], what)
        if any(t.shape != ts[0].shape for t in ts):
            _fail(ValueError(f"{what}: the tensors of one call must share one shape"))
        if op == "avg":
            _fail(ValueError(f"{what}: AVG over a list of several tensors is ambiguous; "
                             "pass one tensor"))
        stack = torch.stack([t.detach() for t in ts])
        local = {"sum": lambda s: s.sum(0), "prod": lambda s: s.prod(0),
                 "min": lambda s: s.amin(0), "max": lambda s: s.amax(0)}[op](stack)
        local = local.to(ts[0].dtype).contiguous()

        def finish(res):
            for t in ts:
                _put(t, res)
            return ts
        return _launch(what, mf.allreduce_async(local, op=op, out=local), finish)

    def _sparse_allreduce(self, t, op, what):
        """gloo's sparse allreduce, which DDP calls for the gradient of an
        nn.Embedding(sparse=True) (pre-divided by the world size, op SUM): the sum (or average)
        of every rank's sparse COO tensor t, coalesced, copied into t. First a blocking
        allgather of each rank's entry count and a hash of its size, sparse dimensions and dtype
        (ranks that differ fail together); then the indices' and the values' allgathers, every
        rank's padded to the largest count, in the background."""
        if op not in ("sum", "avg"):
            _fail(ValueError(f"{what}: a sparse tensor reduces with SUM or AVG, got {op}"))
        _tensor(t._values(), what)
        if t.dtype not in _WIRE_DTYPES or (op == "avg" and not t.is_floating_point()):
            _fail(TypeError(f"{what}: a sparse tensor of dtype {t.dtype} cannot reduce with "
                            f"{op}"))
        sd, n = t.sparse_dim(), self._size
        sig = zlib.crc32(repr((tuple(t.shape), sd, str(t.dtype))).encode())
        table = _round(what, np.array([t._nnz(), sig], np.int64)).reshape(n, 2)
        if (table[:, 1] != sig).any():
            raise MismatchError(f"{what}: the ranks' sparse tensors differ in size, sparse "
                                f"dimensions or dtype (this rank's: {tuple(t.shape)}, {sd}, "
                                f"{t.dtype}; signature per rank: {table[:, 1].tolist()})")
        counts, m = table[:, 0].tolist(), int(table[:, 0].max())
        if m == 0:  # nothing anywhere
            return _completed([t])
        idx = t._indices().new_zeros((m, sd))
        idx[:t._nnz()] = t._indices().t()
        vals = t._values().new_zeros((m, *t.shape[sd:]))
        vals[:t._nnz()] = t._values()
        rows = [slice(r * m, r * m + c) for r, c in enumerate(counts)]
        got = {}
        _launch(what, mf.allgather_async(_flat(idx)), lambda res: got.setdefault("idx", res))

        def finish(res):
            if "idx" not in got:  # its error went to a Work no one holds; say so here
                raise MlfabricError(f"{what}: the allgather of the indices failed")
            every = got.pop("idx").reshape(n * m, sd)
            res = res.reshape(n * m, *t.shape[sd:])
            t.copy_(_sparse.combine(torch.cat([every[s] for s in rows]),
                                    torch.cat([res[s] for s in rows]), t.shape,
                                    n if op == "avg" else 1))
            return [t]
        return _launch(what, mf.allgather_async(_flat(vals)), finish)

    @_checked
    def allreduce_coalesced(self, tensors, opts=None):
        """Reduce several tensors of one dtype in one call (packed into one buffer)."""
        what = "allreduce_coalesced"
        op = _op(opts if opts is not None else AllreduceCoalescedOptions(), what)
        ts = _writable(_tensors(tensors, what), what)
        if not ts:
            return _completed([])
        for t in ts:
            if t.dtype != ts[0].dtype:
                _fail(TypeError(f"{what}: tensors must share one dtype, got {t.dtype} and "
                                f"{ts[0].dtype}"))
        flat = torch.cat([_flat(t.detach()) for t in ts])

        def finish(res):
            off = 0
            for t in ts:
                _put(t, res[off:off + t.numel()])
                off += t.numel()
            return ts
        return _launch(what, mf.allreduce_async(flat, op=op, out=flat), finish)

    @_checked
    def reduce(self, tensors, opts=None):
        """Reduce onto opts.rootRank, in place there (other ranks' tensors are left alone);
        complete on return (mlfabric's reduce blocks)."""
        what = "reduce"
        opts = opts if opts is not None else ReduceOptions()
        op = _op(opts, what)
        t = _one(tensors, what)
        root = self._root(opts.rootRank, what)
        if self._rank == root:
            _writable(t, what, "the root's tensor")
        w = _into(t)
        out = w if self._rank == root else None
        mf.reduce(w, root=root, op=op, out=out)
        return _completed(_back(t, w) if out is not None else [t])

    @_checked
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """Rank r's output gets the reduction of every rank's input_tensors[0][r]."""
        what = "reduce_scatter"
        op = _op(opts if opts is not None else ReduceScatterOptions(), what)
        out = _writable(_one(output_tensors, what), what)
        ins = [_tensors(x, what, self._size) for x in input_tensors]
        if len(ins) != 1:
            _fail(ValueError(f"{what}: expected one list of {self._size} input tensors"))
        _same(ins[0], out, what, role="input")
        stack = torch.stack([_flat(x.detach()) for x in ins[0]])  # (size, numel): row r to rank r
        w = _into(out)
        return _launch(what, mf.reduce_scatter_async(stack, op=op, out=w),
                       lambda _: _back(out, w))

    @_checked
    def reduce_scatter_single(self, output, input, opts=None):
        """Rank r's output gets the reduction of every rank's r-th 1/size of input."""
        what = "reduce_scatter_single"
        op = _op(opts if opts is not None else ReduceScatterOptions(), what)
        out, inp = _writable(_tensor(output, what), what), _tensor(input, what)
        _same([inp], out, what, out.numel() * self._size, "input")
        rows = inp.detach().reshape(self._size, out.numel())
        w = _into(out)
        if _same_storage(w, rows):  # out is this rank's part of input (torch allows it)
            w = torch.empty_like(w)
        return _launch(what, mf.reduce_scatter_async(rows, op=op, out=w),
                       lambda _: _back(out, w))

    _reduce_scatter_base = reduce_scatter_single

    @_checked
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """reduce_scatter_single of several (output, input) pairs of one dtype, in one call."""
        what = "reduce_scatter_single_coalesced"
        op = _op(opts if opts is not None else ReduceScatterOptions(), what)
        outs = _writable(_tensors(outputs, what), what)
        ins = _tensors(inputs, what, len(outputs))
        if not outs:
            return _completed([])
        for o, i in zip(outs, ins):
            _same([o], outs[0], what, o.numel())
            _same([i], o, what, o.numel() * self._size, "input")
        # Every input as (size, numel), side by side: row r is everything rank r gets.
        rows = torch.cat([i.detach().reshape(self._size, o.numel()) for o, i in zip(outs, ins)],
                         dim=1)

        def finish(res):
            off = 0
            for o in outs:
                _put(o, res[0, off:off + o.numel()])
                off += o.numel()
            return outs
        return _launch(what, mf.reduce_scatter_async(rows, op=op), finish)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # --- data movement ---

    @_checked
    def broadcast(self, tensors, opts=None):
        """Copy opts.rootRank's tensor into every rank's, in place."""
        what = "broadcast"
        opts = opts if opts is not None else BroadcastOptions()
        t = _one(tensors, what)
        if opts.rootTensor != 0:
            _fail(ValueError(f"{what}: rootTensor must be 0 (one tensor per call)"))
        root = self._root(opts.rootRank, what)
        if self._rank != root:  # the root's tensor is only read
            _writable(t, what, "tensor")
        w = _into(_wire(t))
        return _launch(what, mf.broadcast_async(w, root=root, element=_element(t)),
                       lambda _: _back(t, w) if self._rank != root else [t])

    @_checked
    def allgather(self, output_tensors, input_tensors, opts=None):
        """output_tensors[0][r] gets rank r's input_tensors[0]; every rank's input has one shape."""
        what = "allgather"
        inp = _one(input_tensors, what)
        outs = [_tensors(o, what, self._size) for o in output_tensors]
        if len(outs) != 1:
            _fail(ValueError(f"{what}: expected one list of {self._size} output tensors"))
        _same(_writable(outs[0], what), inp, what, role="output")
        flat = _flat(_wire(inp.detach()))
        n = flat.numel()

        def finish(res):
            for r, o in enumerate(outs[0]):
                _put(o, res[r * n:(r + 1) * n])
            return outs[0]
        return _launch(what, mf.allgather_async(flat, element=_element(inp)), finish)

    @_checked
    def all_gather_single(self, output, input, opts=None):
        """output (size x input's elements) gets every rank's input, in rank order."""
        what = "all_gather_single"
        out, inp = _writable(_tensor(output, what), what), _tensor(input, what)
        _same([out], inp, what, inp.numel() * self._size, "output")
        w = _wire(inp.detach())
        if w.dtype == inp.dtype:  # straight into output, no staging copy
            o = _into(out)
            if _same_storage(w, o):  # input is this rank's part of output (FSDP's in place)
                w = w.clone()
            return _launch(what, mf.allgather_async(_flat(w), out=o), lambda _: _back(out, o))

        def finish(res):
            _put(out, res)
            return [out]
        return _launch(what, mf.allgather_async(_flat(w), element=_element(inp)), finish)

    _allgather_base = all_gather_single

    @_checked
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """all_gather_single of several (output, input) pairs of one dtype, in one call."""
        what = "all_gather_single_coalesced"
        outs = _writable(_tensors(outputs, what), what)
        ins = _tensors(inputs, what, len(outputs))
        if not outs:
            return _completed([])
        for o, i in zip(outs, ins):
            _same([i], ins[0], what, i.numel())
            _same([o], i, what, i.numel() * self._size, "output")
        wires = [_flat(_wire(i.detach())) for i in ins]
        flat = torch.cat(wires)

        def finish(res):
            rows = res.reshape(self._size, flat.numel())  # row r: rank r's inputs, packed
            off = 0
            for o, w in zip(outs, wires):
                _put(o, rows[:, off:off + w.numel()])
                off += w.numel()
            return outs
        return _launch(what, mf.allgather_async(flat, element=_element(ins[0])), finish)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_checked
    def gather(self, output_tensors, input_tensors, opts=None):
        """opts.rootRank's output_tensors[0][r] gets rank r's input (one allgather, after the
        ranks compare roots)."""
        what = "gather"
        opts = opts if opts is not None else GatherOptions()
        inp = _one(input_tensors, what)
        root = self._root(opts.rootRank, what)
        outs = [_tensors(o, what, self._size) for o in output_tensors]
        if self._rank == root:
            if len(outs) != 1:
                _fail(ValueError(f"{what}: root needs one list of {self._size} output tensors"))
            _same(_writable(outs[0], what), inp, what, role="output")
        self._same_root(root, what)
        flat = _flat(_wire(inp.detach()))
        n = flat.numel()

        def finish(res):
            if self._rank != root:
                return []
            for r, o in enumerate(outs[0]):
                _put(o, res[r * n:(r + 1) * n])
            return outs[0]
        return _launch(what, mf.allgather_async(flat, element=_element(inp)), finish)

    @_checked
    def scatter(self, output_tensors, input_tensors, opts=None):
        """Rank r's output gets opts.rootRank's input_tensors[0][r] (one broadcast)."""
        what = "scatter"
        opts = opts if opts is not None else ScatterOptions()
        out = _writable(_one(output_tensors, what), what)
        root = self._root(opts.rootRank, what)
        w = _wire(out.detach())
        rows = torch.empty((self._size, w.numel()), dtype=w.dtype)  # row r goes to rank r
        if self._rank == root:
            ins = [_tensors(x, what, self._size) for x in input_tensors]
            if len(ins) != 1:
                _fail(ValueError(f"{what}: root needs one list of {self._size} input tensors"))
            _same(ins[0], out, what, role="input")
            for r, x in enumerate(ins[0]):
                rows[r].copy_(_flat(_wire(x.detach())))

        def finish(_):
            _put(out, rows[self._rank])
            return [out]
        return _launch(what, mf.broadcast_async(rows, root=root, element=_element(out)), finish)

    @_checked
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        """input_split_sizes[j] rows of input (dimension 0, in order) go to rank j; output gets
        output_split_sizes[j] rows from each rank j, in rank order (no split sizes: equal
        parts). See _alltoall."""
        what = "all_to_all_single"
        n = self._size
        out, inp = _writable(_tensor(output, what), what), _tensor(input, what)
        if out.dtype != inp.dtype:
            _fail(TypeError(f"{what}: output and input must share one dtype, got {out.dtype} "
                            f"and {inp.dtype}"))
        recv = _splits(output_split_sizes, out, n, what, "output")
        send = _splits(input_split_sizes, inp, n, what, "input")
        _counted(inp.shape[0], what, "input")
        _counted(out.numel() // max(_row(inp), 1), what, "output")  # rows of input's size
        w = _wire(inp.detach())

        def finish(res):
            _put(out, res)
            return [out]
        return self._alltoall(what, "single", _split_table(inp.dtype, _row(inp), _row(out),
                                                           send, recv), w, send, finish)

    alltoall_base = all_to_all_single

    @_checked
    def alltoall(self, output_tensors, input_tensors, opts=None):
        """Rank r's output_tensors[j] gets rank j's input_tensors[r]: one dtype, any numbers of
        elements (rank j's input_tensors[r] and rank r's output_tensors[j] have as many), any
        shapes. The inputs go flattened and concatenated; see _alltoall."""
        what = "alltoall"
        n = self._size
        outs = _writable(_tensors(output_tensors, what, n), what)
        ins = _tensors(input_tensors, what, n)
        for t in outs + ins:
            if t.dtype != ins[0].dtype:
                _fail(TypeError(f"{what}: tensors must share one dtype, got {t.dtype} and "
                                f"{ins[0].dtype}"))
            if t.device != ins[0].device:
                _fail(ValueError(f"{what}: tensors must be on one device, got {t.device} and "
                                 f"{ins[0].device}"))
        send, recv = [x.numel() for x in ins], [o.numel() for o in outs]
        per = 2 if ins[0].is_complex() else 1  # elements on the wire of one element
        _counted(per * sum(send), what, "input")
        _counted(per * sum(recv), what, "output")
        flat = torch.cat([_flat(_wire(x.detach())) for x in ins])

        def finish(res):
            off = 0
            for o in outs:
                _put(o, res[off:off + per * o.numel()])
                off += per * o.numel()
            return outs
        return self._alltoall(what, "list", _split_table(ins[0].dtype, 1, 1, send, recv), flat,
                              [per * k for k in send], finish)

    def _alltoall(self, what, form, table, x, send, finish):
        """First every rank's split table (_split_table) goes round in one small blocking
        allgather and is compared (_check_split_table): sizes that disagree anywhere are the
        same MismatchError on every rank, before any data moves. Then x's rows (send[j] to rank
        j) move in the background: by mlfabric's alltoall, finish(the rows received, in rank
        order) putting them in place; or, where every rank sends every rank as many and the
        allgather of every input is at most _ALLGATHER_BYTES (faster there: one shared-memory
        step), by that allgather, finish getting block `rank` of each rank's input."""
        size, rank = self._size, self._rank
        every = _round(what, table).reshape(size, -1)
        _check_split_table(every, what, form)
        sends = every[:, 3:3 + size]
        # Every rank's x has as many elements where every rank sends every rank as many rows
        # (rows of one size and one dtype everywhere: checked): the same choice everywhere.
        if (sends == sends[0, 0]).all() and x.numel() * x.element_size() * size <= \
                _ALLGATHER_BYTES:
            block = x.numel() // size

            def from_allgather(res):
                return finish(res.reshape(size, size, block)[:, rank].reshape(-1))
            return _launch(what, mf.allgather_async(_flat(x)), from_allgather)
        if x.dim() != 2:  # rows as they were, whatever the dimensions after the first
            x = x.reshape(x.shape[0], _row(x))
        return _launch(what, mf.alltoall_async(x, np.asarray(send, np.int64)),
                       lambda res: finish(res[0]))

    # --- synchronisation and point to point ---

    def barrier(self, opts=None):
        """Return once every rank has called barrier (complete on return)."""
        with self._in_group():
            mf.barrier()
        return _completed([])

    @_checked_p2p
    def send(self, tensors, dst, tag=0):
        """Start sending one tensor to rank dst (isend / send: torch waits on the Work)."""
        t = _one(tensors, "send")
        return _P2PWork(mf.isend(_wire(t.detach()).contiguous(), int(dst), tag=int(tag),
                                 element=_element(t)), lambda _: [t])

    @_checked_p2p
    def recv(self, tensors, src, tag=0):
        """Start receiving into one tensor from rank src (irecv / recv)."""
        t = _writable(_one(tensors, "recv"), "recv")
        w = _into(_wire(t))
        return _P2PWork(mf.irecv(w, int(src), tag=int(tag), element=_element(t)),
                        lambda _: _back(t, w))

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError("recv from any source (dist.recv(src=None)) is not supported "
                                  "by the mlfabric backend; name the source rank")

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        raise NotImplementedError("allgather_coalesced is not supported by the mlfabric backend "
                                  "(it is deprecated in torch); use all_gather_into_tensor")

    def _root(self, root, what):
        if not 0 <= root < self._size:
            _fail(ValueError(f"{what}: root rank {root} is not in [0, {self._size})"))
        return int(root)

    def _same_root(self, root, what):
        """For a rooted call carried by an allgather (gather), whose header has no root: the
        ranks compare roots first (one small allgather); else ranks naming different ones
        would each take a wrong result, silently."""
        roots = _round(what, np.array([root], np.int64)).tolist()
        if len(set(roots)) > 1:
            by_root = "; ".join(f"{q} on rank(s) {[r for r, x in enumerate(roots) if x == q]}"
                                for q in sorted(set(roots)))
            raise MismatchError(f"{what}: ranks disagree on root: {by_root}")


# --- creation, rendezvous, registration -----------------------------------------------------------

def _ensure_mlfabric():
    if not mf.initialized():  # torch.distributed's ranks are the user's; no RANK etc. exported
        _context.init(_torch_env=False)
    return mf.rank(), mf.size()


def _check_agrees(rank, size, where):
    """rank / world size asked for by torch (-1: not given) against MPI's."""
    my_rank, my_size = _ensure_mlfabric()
    if (size not in (-1, None) and size != my_size) or (rank not in (-1, None)
                                                         and rank != my_rank):
        raise MlfabricError(
            f"{where}: rank={rank}, world_size={size} disagree with MPI, which runs this process "
            f"as rank {my_rank} of {my_size}; with the mlfabric backend leave them out (MPI "
            "decides) or pass MPI's values")
    return my_rank, my_size


# Tag of MPI_Comm_create_group's own messages on mlfabric's communicator: unlike MPI_Comm_split
# it involves the members alone (torch calls the backend on them only), and its messages must
# not match mlfabric's traffic there (p2p.TAG; user sends at collectives._SEND_TAG_BASE + tag).
_GROUP_TAG = 0x6D67


def _create(opts, backend_options=None):
    """Backend creator torch calls for init_process_group / new_group (its extended form, which
    names the group's global ranks: [] for the default group). The store is not needed (MPI
    connects the ranks); the timeout is mlfabric's own (MLFABRIC_TIMEOUT)."""
    my_rank, my_size = _ensure_mlfabric()
    ranks = [int(q) for q in opts.global_ranks_in_group]
    if not ranks or ranks == list(range(my_size)):
        _check_agrees(opts.group_rank, opts.group_size, "mlfabric process group")
        return MlfabricProcessGroup(my_rank, my_size)
    ctx = _group_context(ranks)
    if (ctx.rank, ctx.size) != (opts.group_rank, opts.group_size):  # torch's numbering is ours
        raise MlfabricError(f"mlfabric process group of ranks {ranks}: torch numbers this rank "
                            f"{opts.group_rank} of {opts.group_size}, MPI {ctx.rank} of "
                            f"{ctx.size}")
    return MlfabricProcessGroup(ctx.rank, ctx.size, ctx)


def _group_context(ranks):
    """A context among the global ranks `ranks` (in that order), made by its members alone and
    freed at mlfabric's finalize, before the global context."""
    world = _context.get()
    comm = world.comm.Create_group(world.comm.group.Incl(ranks), _GROUP_TAG)
    try:
        ctx = _context.sub_context(comm)
    except BaseException:
        comm.Free()
        raise
    world.on_close.append(functools.partial(_context.close_sub_context, ctx))
    return ctx


_STORE_ADDR_VAR = _launching.STORE_ADDR_VAR
_store_address = _launching.store_address
_route_from = _launching.route_from


def _listening_socket(address):
    """A TCP socket bound to `address` on a free port and listening; (its fd, the port). The fd
    is handed to torch's TCPStore, which owns it from then on."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return sock.detach(), port


def _shared_store(rank, size, timeout):
    """A TCPStore served by rank 0 on a free port; MPI tells the other ranks where. torch's
    TCPStore listens on every interface whatever host it is given, so rank 0 binds the listening
    socket itself and hands it over: to the loopback when the job runs on one host, else to the
    address it reaches its peers from (or MLFABRIC_STORE_ADDR). The store authenticates
    nothing (docs/security.md)."""
    ctx = _context.get()
    comm = ctx.user_comm
    listen, host = _store_address(comm, rank, ctx.single_host)
    store, port = None, None
    if rank == 0:
        try:
            if listen is None:
                warnings.warn(
                    "mlfabric rendezvous: no one address of this host reaches every peer, so the "
                    "rendezvous TCPStore listens on all interfaces; set MLFABRIC_STORE_ADDR to "
                    "the address to use (docs/security.md)", RuntimeWarning, stacklevel=2)
                store = dist.TCPStore(host, 0, size, True, timeout=timeout,
                                      wait_for_workers=False)
                port = store.port
            else:
                fd, port = _listening_socket(listen)
                store = dist.TCPStore(listen, port, size, True, timeout=timeout,
                                      wait_for_workers=False, master_listen_fd=fd)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            port = f"{type(exc).__name__}: {exc}"
    port = comm.bcast(port, root=0)
    if not isinstance(port, int):
        raise MlfabricError(f"mlfabric rendezvous: rank 0 could not start a TCPStore: {port}")
    if rank != 0:
        store = dist.TCPStore(host, port, size, False, timeout=timeout)
    return store


def _mpi_rendezvous(url, timeout=dist.default_pg_timeout, **kwargs):
    """Rendezvous handler of mlfabric:// (torch's interface: a generator of (store, rank,
    world_size)). Ranks come from MPI; rank / world_size in the URL must agree with them."""
    query = dict(parse_qsl(urlparse(url).query))
    rank, size = _check_agrees(int(query.get("rank", -1)), int(query.get("world_size", -1)),
                               "init_process_group")
    yield _shared_store(rank, size, timeout), rank, size
    raise RuntimeError("mlfabric:// rendezvous cannot run twice: MPI fixes the ranks of a job")


def _backend_asked():
    """The backend of the init_process_group call under way on this thread (torch passes the
    rendezvous handler no backend), or None outside one."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "init_process_group" and "distributed_c10d" in code.co_filename:
            return frame.f_locals.get("backend")
        frame = frame.f_back
    return None


def _env_or_mpi(env_handler):
    def handler(url, **kwargs):
        # For the mlfabric backend only (gloo and NCCL keep torch's env:// as it is), and only
        # where env:// would fail for want of every one of its variables (or holds just those
        # mlfabric.init() exported under mpirun): init_process_group("mlfabric") then works
        # under mpirun with nothing set, its store served as _shared_store says.
        if (BACKEND in str(_backend_asked() or "").lower()
                and _launching.torch_env_is_ours(_ENV_VARS)):
            return _mpi_rendezvous(url, **kwargs)
        return env_handler(url, **kwargs)
    handler._mlfabric_fallback = True
    return handler


def _register():
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    handlers = _rdzv._rendezvous_handlers
    if "mlfabric" not in handlers:
        _rdzv.register_rendezvous_handler("mlfabric", _mpi_rendezvous)
    env = handlers.get("env")
    if env is not None and not getattr(env, "_mlfabric_fallback", False):
        handlers["env"] = _env_or_mpi(env)


_register()

__all__ = ["BACKEND", "INIT_METHOD", "MlfabricProcessGroup", "MlfabricWork"]
