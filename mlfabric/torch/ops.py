"""mlfabric.torch's tensor collectives, with horovod.torch's names and semantics: allreduce,
grouped_allreduce, allgather, broadcast, alltoall, reducescatter (and their in-place `_` and
`_async` forms), synchronize / poll on integer handles, join and barrier, on top of mlfabric's
collectives.

Owns:
- issue order. Every call goes through one queue per process (and one more per process set it
  belongs to: process_sets.py), in the order it was issued (as on every rank: mlfabric matches
  collectives by order, not by name). A blocking call runs on the
  caller's thread when nothing is queued; *_async calls run on the queue's thread, so
  communication overlaps the caller's work (the engine releases the GIL). Async allreduces of
  CPU tensors queued behind a running one are fused with it (see _fused_job).
- the control round. In front of every call each rank contributes a small descriptor of it (kind,
  dtype, op, root, shape, name; see _desc) to an allgather. From the table every rank decides the
  same thing: go ahead, or raise MismatchError naming the ranks and what each passed (so every
  rank fails together, before any data moves). A rank inside join() contributes 'joined' and
  learns from the others' descriptors which call to take part in, and how.
- join semantics (Horovod's): a joined rank takes part in the others' calls until every rank has
  joined. In an allreduce or reducescatter it contributes the op's identity (zeros for Sum and
  Average, as in Horovod; +inf / -inf / 1 for Min / Max / Product; its own rows of a
  reducescatter are dropped), and Average still divides by size(), the joined ranks included:
  Horovod averages over all ranks too. In an allgather or alltoall it contributes no rows; in a
  broadcast it receives (a joined root is an error on every rank).
  While joined, a rank waits for the others' next call at most MLFABRIC_TIMEOUT seconds.
- devices: CPU tensors move through mlfabric's host paths, CUDA tensors over NCCL (every rank's
  tensor of a call on the same kind of device: the descriptor carries it). A call on CUDA
  tensors follows the work queued on the caller's current stream when it is made, and only that
  (an event), runs its copies and NCCL on mlfabric's streams, and its result is ready for the
  caller's current stream when it returns (blocking) or at synchronize() (as in Horovod).
- dtypes: float32, float64, float16, bfloat16, int32 and int64 travel as they are; uint8, int8,
  int16 and bool travel widened to int64 and come back narrowed (exact: integer sums wrap the way
  the dtype does). Average needs a floating tensor.
- autograd: allreduce, grouped_allreduce, allgather, broadcast, alltoall and reducescatter are
  differentiable as in Horovod (>= 0.22): the gradient of an allreduce is the allreduce (same op
  and factors) of the gradient; of an allgather, this rank's rows of the averaged gradient; of a
  broadcast, the averaged gradient on the root and zeros elsewhere; of an alltoall, the alltoall
  back; of a reducescatter, the allgather of the gradient, scaled as the forward was.
"""
import atexit
import bisect
import contextlib
import copy
import itertools
import math
import sys
import threading
import zlib
from operator import attrgetter

import numpy as np
import torch
from torch.autograd.graph import increment_version as _increment_version

from .. import _C
from .._core import config as _config
from .._core import buffers as _buffers
from ..comm import collectives as _coll
from ..comm import context as _context
from ..comm import shared as _shared
from ..comm import nccl as _nccl
from ..comm.executor import Executor
from ..errors import MismatchError, MlfabricError, PeerTimeoutError
from . import adasum as _adasum
from . import tensor_meta as _meta
from . import timeline as _timeline
from .compression import Compression, check as _check_compression

# --- reduction ops --------------------------------------------------------------------------------

Average = "average"
Sum = "sum"
Min = "min"
Max = "max"
Product = "product"
Adasum = _adasum.Adasum  # see adasum.py

_OP_NAMES = {"average": Average, "avg": Average, "sum": Sum, "min": Min, "max": Max,
             "product": Product, "prod": Product, "adasum": Adasum}
# mlfabric's core ops, by code in the descriptor.
_CORE_OPS = ("sum", "avg", "min", "max", "prod")
_CORE_OF = {Sum: "sum", Min: "min", Max: "max", Product: "prod"}


def _resolve_op(op, average):
    """Horovod's rule: op wins, average (deprecated) maps True/False to Average/Sum, and the
    default is Average."""
    if op is not None and average is not None:
        raise ValueError("pass op or average (deprecated), not both")
    if op is None:
        return Average if average is None or average else Sum
    name = _OP_NAMES.get(op.lower()) if isinstance(op, str) else None
    if name is None:
        raise ValueError(f"unknown reduction op {op!r}; expected one of Average, Sum, Min, Max, "
                         "Product, Adasum (mlfabric.torch.Average, ...)")
    return name


# --- dtypes ---------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
           torch.uint8, torch.int8, torch.int16, torch.bool)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_NATIVE = 6  # the first six travel as they are; the others widened to int64
_meta.available(str(dt).replace("torch.", "") for dt in _DTYPES)  # the native reader, if any


def _wire(dtype):
    return dtype if _DTYPE_CODE[dtype] < _NATIVE else torch.int64


def _dtype_name(code):
    return str(_DTYPES[code]).replace("torch.", "")


def _check_tensor(t, what, arg="tensor"):
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
    if t.dtype not in _DTYPE_CODE:
        raise TypeError(f"{what}: unsupported dtype {t.dtype}; mlfabric.torch supports "
                        f"{', '.join(_dtype_name(c) for c in range(len(_DTYPES)))}")
    return _DTYPE_CODE[t.dtype]


def _check_writable(t, what, arg="tensor"):
    """t can take a result in place: no two of its elements share memory (an expanded tensor's
    do, or an as_strided one's: torch refuses to write there, or keeps one result of several).
    Checked before the call, as a rank that failed only when writing, after its peers moved on,
    would leave them waiting (or a later call paired wrongly)."""
    if not t.is_contiguous() and _buffers.elements_overlap(t.shape, t.stride(), 1):
        raise ValueError(f"{what}: {arg} cannot receive the result in place: elements of it share "
                         "memory (an expanded tensor?); pass a tensor of its own (.clone())")


def _factor(value, what, arg):
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


def _check_rows(tensor, name, what):
    """The checks of a call that splits tensor's dimension 0 (name, tensor, at least one
    dimension): its dtype code."""
    _check_name(name)
    code = _check_tensor(tensor, what)
    if tensor.dim() == 0:
        raise ValueError(f"{what}: needs a tensor with at least one dimension")
    return code


def _identity(core, wire, n, device):
    """n elements that leave a reduction unchanged: what a joined rank contributes."""
    if core in ("sum", "avg"):
        return torch.zeros(n, dtype=wire, device=device)
    if core == "prod":
        return torch.ones(n, dtype=wire, device=device)
    if wire.is_floating_point:
        value = float("inf") if core == "min" else float("-inf")
    else:
        info = torch.iinfo(wire)
        value = info.max if core == "min" else info.min
    return torch.full((n,), value, dtype=wire, device=device)


# --- the control round ----------------------------------------------------------------------------

(_STATE, _JOINED_AT, _KIND, _DTYPE, _OP, _ROOT, _ROWS, _ROW_LEN, _NDIM, _SHAPE_HASH, _ROW_HASH,
 _NAME_HASH) = range(12)
_DIMS, _MAX_DIMS = 12, 8  # words 12..19: the first dimensions, for messages
_DEVICE = 20  # 0: the tensors are on the CPU, 1: on a GPU (they move over NCCL)
# An async allreduce's offer to fuse the like calls queued behind it (see _fused_job): how many
# (_FUSE_N), and a hash of their descriptors after the first 1, 2, 4, ... 128 of them.
_FUSE_N, _FUSE_LEVELS = 21, 8
_FUSE_H = 22  # words 22..29
_W = 30  # int64 words per descriptor
# equal when all agree
_SAME = [_KIND, _DTYPE, _OP, _ROOT, _ROW_LEN, _ROW_HASH, _NAME_HASH, _DEVICE]
_ACTIVE, _JOINED, _REJECTED = 1, 0, -1
_KINDS = ("barrier", "allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
          "process set")
_BARRIER, _ALLREDUCE, _ALLGATHER, _BROADCAST, _ALLTOALL, _REDUCESCATTER, _PROCESS_SET = range(7)
_SET_CALLS = ("add_process_set", "remove_process_set")  # op of a _PROCESS_SET descriptor


def _hash(value):
    return zlib.crc32(repr(value).encode())


_DESCS = {}  # _desc's arguments -> the descriptor: a training loop repeats the same calls


def _desc(kind, dtype=0, op=0, root=0, shape=(), name=None, layout=None, tensor=None):
    """This rank's descriptor of a call (a new array: callers may amend it). shape: the
    tensor's (0-d counts as (1,)); layout: what else must agree (the member shapes of a grouped
    allreduce); tensor: one of the call's tensors, for its device."""
    device = 1 if tensor is not None and tensor.is_cuda else 0
    key = (kind, dtype, op, root, tuple(shape), name, layout, device)
    try:
        d = _DESCS.get(key)
    except TypeError:  # an unhashable name or layout: described afresh (and checked by plan)
        key, d = None, None
    if d is None:
        d = _new_desc(kind, dtype, op, root, shape, name, layout, device)
        if key is not None and len(_DESCS) < 4096:
            _DESCS[key] = d
    return d.copy()


def _new_desc(kind, dtype, op, root, shape, name, layout, device):
    shape = tuple(int(s) for s in shape) or (1,)
    d = np.zeros(_W, np.int64)
    d[_STATE], d[_KIND], d[_DTYPE], d[_OP], d[_ROOT] = _ACTIVE, kind, dtype, op, root
    d[_ROWS] = shape[0]
    d[_ROW_LEN] = math.prod(shape[1:])
    d[_NDIM] = len(shape)
    d[_SHAPE_HASH] = _hash(shape if layout is None else (shape, layout))
    d[_ROW_HASH] = _hash(shape[1:])
    d[_NAME_HASH] = -1 if name is None else _hash(name)
    k = min(len(shape), _MAX_DIMS)
    d[_DIMS:_DIMS + k] = shape[:k]
    d[_DEVICE] = device
    return d


def _shape_of(d, rows=True):
    nd = int(d[_NDIM])
    dims = tuple(int(v) for v in d[_DIMS:_DIMS + min(nd, _MAX_DIMS)])
    dims += ("...",) if nd > _MAX_DIMS else ()
    return dims if rows else dims[1:]


def _groups(table, ranks, key):
    """Lists of ranks that agree on key(descriptor), in order of first appearance."""
    groups = {}
    for r in ranks:
        groups.setdefault(key(table[r]), []).append(int(r))
    return list(groups.values())


def _disagreement(table, what):
    """The error every rank raises for this control round, or None (the same on every rank:
    it depends on the table alone)."""
    # The usual case: every rank active and describing the same call, word for word.
    raw = table.tobytes()
    if table[0, _STATE] == _ACTIVE and raw == raw[:len(raw) // len(table)] * len(table):
        return None
    states = table[:, _STATE]
    # Then at numpy speed: the same call, its rows differing where they may (allgather).
    if (states == _ACTIVE).all() and (table[:, _SAME] == table[0, _SAME]).all() and (
            table[0, _KIND] in (_ALLGATHER, _ALLTOALL)
            or (table[:, _SHAPE_HASH] == table[0, _SHAPE_HASH]).all()):
        return None
    bad = np.flatnonzero(states == _REJECTED)
    if bad.size:
        return (f"{what}: rank(s) {bad.tolist()} rejected their arguments (see the error on those "
                "ranks); nothing was exchanged")
    active = np.flatnonzero(states == _ACTIVE)
    if not active.size:
        return None
    kinds = _groups(table, active, lambda d: int(d[_KIND]))
    if len(kinds) == 1 and (table[active, _NAME_HASH] != -1).all():
        names = _groups(table, active, lambda d: int(d[_NAME_HASH]))
        if len(names) > 1:
            return (f"{what}: the ranks' tensor names differ (ranks grouped by name: "
                    f"{' | '.join(map(str, names))}): they issued different calls at this point. "
                    "mlfabric matches collectives by the order ranks issue them, so every rank "
                    "must issue the same calls in the same order")
    checks = [("call", lambda d: int(d[_KIND]), lambda d: _KINDS[int(d[_KIND])]),
              ("device", lambda d: int(d[_DEVICE]), lambda d: ("cpu", "cuda")[int(d[_DEVICE])]),
              ("dtype", lambda d: int(d[_DTYPE]), lambda d: _dtype_name(int(d[_DTYPE])))]
    kind = int(table[active[0], _KIND])
    if kind == _PROCESS_SET:
        joined = np.flatnonzero(states == _JOINED)
        if joined.size:
            return (f"{what}: rank(s) {joined.tolist()} are inside join(); every rank adds or "
                    "removes a process set, outside join()")
        checks.append(("call", lambda d: int(d[_OP]), lambda d: _SET_CALLS[int(d[_OP])]))
        checks.append(("the process set's ranks", lambda d: int(d[_SHAPE_HASH]),
                       lambda d: str(list(_shape_of(d)))))
    if kind in (_ALLREDUCE, _REDUCESCATTER):
        checks.append(("op", lambda d: int(d[_OP]), lambda d: _CORE_OPS[int(d[_OP])]))
    if kind == _BROADCAST:
        checks.append(("root", lambda d: int(d[_ROOT]), lambda d: str(int(d[_ROOT]))))
    if kind in (_ALLREDUCE, _BROADCAST, _REDUCESCATTER):
        checks.append(("shape", lambda d: int(d[_SHAPE_HASH]), lambda d: str(_shape_of(d))))
    elif kind in (_ALLGATHER, _ALLTOALL):
        checks.append(("shape of a row (the dimensions after the first)",
                       lambda d: int(d[_ROW_HASH]), lambda d: str(_shape_of(d, rows=False))))
    for field, key, show in checks:
        groups = _groups(table, active, key)
        if len(groups) > 1:
            shown = [show(table[g[0]]) for g in groups]
            if field == "shape" and len(set(shown)) == 1:  # the hash covers the layout too
                return (f"{what}: the ranks issued different calls of the same shape {shown[0]} "
                        f"(ranks grouped by call: {' | '.join(map(str, groups))}): a grouped "
                        "call's list, a DistributedOptimizer's bucket (or one built otherwise: "
                        "another model, groups or backward_passes_per_step) or a SyncBatchNorm "
                        "layer on some, another call on the others")
            parts = "; ".join(f"{v} on rank(s) {g}" for v, g in zip(shown, groups))
            return f"{what}: ranks disagree on {field}: {parts}"
    if kind == _BROADCAST:
        root = int(table[active[0], _ROOT])
        if states[root] != _ACTIVE:
            return f"{what}: the root rank {root} has joined; a joined rank cannot broadcast"
    return None


class _State:
    """Per-initialisation state of one set of ranks: the queue, the count of control rounds,
    the staging buffers. The global state (every rank of mlfabric's communicator) also holds
    the process sets registered since init() (process_sets.py); a process set's own state
    (ranks: their global ranks) runs its calls in its own context (context.using), so its
    collectives and control rounds stay among its ranks, on their own queue. Handles are one
    namespace: synchronize() finds a process set's calls too."""

    def __init__(self, ctx, parent=None, ranks=None):
        self.ctx = ctx
        self.ranks = ranks  # None: the global set
        self.queue = Executor()
        self.handles = parent.handles if parent is not None else {}
        self.ids = parent.ids if parent is not None else itertools.count()
        self.rounds = 0  # control rounds so far: the same on every rank (all take part in each)
        self.staging = {}  # wire dtype (and GPU) -> the grouped allreduces' staging buffer
        self.shared_staging = {}  # the same in shared memory (see _staged)
        self.layouts = {}  # signature of a grouped allreduce's list -> (its _Groups, hash)
        self.grouped_layouts = {}  # the same for grouped_reducescatter (grouped_ops.py)
        self.streams = {}  # GPU -> mlfabric's stream there for calls on CUDA tensors
        self.fusion_pause = 0  # async allreduces left to run without offering fusion
        self.mismatch = None  # (call, message) of the last control round, if it mismatched
        self.sets = {}  # global state only: process set id -> (ranks, its _State or None)
        self.set_ids = itertools.count(1)  # the next process set's id (0: the global set)

    def _within(self, fn):
        """fn, run in this state's context (a process set's) wherever the queue runs it."""
        if self.ranks is None:
            return fn
        ctx = self.ctx

        def within():
            with _context.using(ctx):
                return fn()
        return within

    def run(self, what, fn):
        """fn() in issue order on this state's queue (on the calling thread when it is idle)."""
        return self.queue.run(what, self._within(fn))

    def submit(self, what, fn, tag=None):
        """fn() in issue order on the queue's thread: its Handle (tag: see Executor.submit)."""
        return self.queue.submit(what, self._within(fn), tag)

    def root(self, root_rank, what):
        """root_rank (a global rank, as in Horovod, also in a process set) as a rank of this
        state's communicator, or ValueError."""
        if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
            raise ValueError(f"{what}: root_rank must be an integer rank, got {root_rank!r}")
        if self.ranks is None:
            n = self.ctx.size
            if not 0 <= root_rank < n:
                raise ValueError(f"{what}: root_rank must be a rank in [0, {n}), got "
                                 f"{root_rank!r}")
            return int(root_rank)
        if int(root_rank) not in self.ranks:
            raise ValueError(f"{what}: root_rank {root_rank} is not in the process set "
                             f"{list(self.ranks)} (root_rank is a global rank, as in Horovod)")
        return self.ranks.index(int(root_rank))

    def close(self):
        """A process set's: finish its queued calls, free its context (collective over it)."""
        self.queue.shutdown()
        _context.close_sub_context(self.ctx)


_S = None
_S_LOCK = threading.Lock()


def _state(process_set=None):
    """The state of the current mlfabric initialisation (NotInitializedError before init()), or
    of process_set's ranks (ValueError when this rank is not one of them)."""
    global _S
    ctx = _context._ctx
    if ctx is None:
        _context.get()  # raises NotInitializedError
    s = _S
    if s is None or s.ctx is not ctx:
        with _S_LOCK:
            if _S is None or _S.ctx is not ctx:
                _S = _State(ctx)
            s = _S
    return s if process_set is None else _set_state(s, process_set)


def _set_state(s, ps):
    """The state of process set ps (see process_sets.py) in the global state s."""
    ps_id = getattr(ps, "process_set_id", False)
    if ps_id is False:
        raise TypeError(f"process_set must be a ProcessSet, got {type(ps).__name__}")
    if ps_id == 0:
        return s
    entry = s.sets.get(ps_id)
    if ps_id is None or entry is None or entry[0] != tuple(ps.ranks or ()):
        raise ValueError(f"process set {ps.ranks} is not registered in this initialisation: "
                         "pass it to init(process_sets=[...]) or add_process_set() first")
    if entry[1] is None:
        raise ValueError(f"this rank ({s.ctx.rank}) is not in the process set {list(entry[0])}; "
                         "only its ranks call collectives on it")
    return entry[1]


def _drain():
    """Let queued calls finish, free the process sets' contexts, forget the state (before
    finalize)."""
    global _S
    with _S_LOCK:
        s, _S = _S, None
    if s is not None:
        for _, sub in s.sets.values():
            if sub is not None:
                sub.close()
        s.sets.clear()
        s.queue.shutdown()


# Registered after mlfabric.comm.context's finalize (imported above), so it runs before it at exit.
atexit.register(_drain)


def _control(st, desc, what=None):
    """The control round: every rank's descriptor, as a table. what: the call, named in the
    PeerTimeoutError of a round that times out."""
    timing = _timeline.negotiating()
    try:
        table = _coll.allgather(desc).reshape(st.ctx.size, _W)
    except PeerTimeoutError as exc:
        if what is None:
            raise
        # its own words name the engine's allgather, not the call. After a mismatch the
        # ranks' calls may no longer line up (a call some rank issued once more, e.g. an async
        # one queued behind the call that failed): a round no peer joins times out, and its
        # cause is that earlier error, which may have gone unseen (an async call's, until
        # synchronize())
        after = "" if st.mismatch is None else (
            f" (this rank's earlier call {st.mismatch[0]} failed with MismatchError: "
            f"{st.mismatch[1][:300]}; after a mismatch the ranks' calls may no longer line up, "
            "so the peers may never issue this one)")
        raise PeerTimeoutError(f"{what}: in the control round (the ranks agreeing on the call): "
                               f"{exc}{after}") from exc
    finally:
        if timing is not None:  # a round that failed (a dead peer) is the one to see
            timing[1].append((timing[0], _timeline._now_us()))
    st.rounds += 1
    st.mismatch = None  # the ranks' calls line up again (the caller records a new mismatch)
    return table


def _mismatched(st, what, msg):
    """The MismatchError every rank of st raises for call `what`, recorded for _control."""
    st.mismatch = (what, msg)
    err = MismatchError(msg)
    err._mlf_peers_told = st  # every rank of st raises it (elastic.run reads the mark)
    return err


def _agree(st, desc, what):
    """Control round of an active rank: the table, or the MismatchError every rank raises."""
    table = _control(st, desc, what)
    msg = _disagreement(table, what)
    if msg is not None:
        raise _mismatched(st, what, msg)
    return table


def _everyone(table):
    """Whether every rank takes part in the call this table agreed on (none has joined)."""
    return _JOINED not in table[:, _STATE].tolist()


def _what(kind, name):
    return f"{kind} '{name}'" if name is not None else kind


def _check_name(name):
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string or None, got {type(name).__name__}")


def _issue(what, plan, job, async_, tensor=None, group=None, process_set=None, tag=None):
    """Validate (plan() -> its result, or raise) and run job(st, planned) in order. tensor: one
    of the call's tensors; for a CUDA one, job runs on mlfabric's stream (see _on_side_stream);
    group: all of them, where there are several; process_set: the ranks taking part (None: all);
    tag: tag(planned), what an async call queued behind a running one shows it (_fused_job).

    A rank whose arguments are bad still takes part in the control round, as 'rejected', so its
    peers fail at once with a MismatchError naming it; then it raises its own error. Any error
    of plan() counts: one that escaped here would leave the peers waiting for this rank."""
    try:
        st = _state(process_set)
    except (TypeError, ValueError) as exc:
        _reject_call(process_set, what, async_)
        raise exc
    if _UNSTARTED and not _flushing:
        _start_unstarted(st, _graph_task())
    try:
        planned = plan(st)
    except Exception as exc:
        _reject(st, what, async_)
        raise exc
    job = _guarded(what, job)
    recording = _timeline._ACTIVE  # once: stop_timeline() may run on another thread
    if recording is not None:
        job = recording.wrap(what, job)
    gpu = tensor is not None and tensor.is_cuda
    if gpu:
        job = _on_side_stream(st, job, tensor.device, group or (tensor,))
    if async_:
        shown = tag(planned) if tag is not None and recording is None and not gpu else None
        handle = st.submit(what, lambda: job(st, planned), shown)
        hid = next(st.ids)
        st.handles[hid] = _GpuCall(handle, tensor.device, job) if gpu else handle
        return hid
    result = st.run(what, lambda: job(st, planned))
    return _on_caller_stream(*result, tensor.device) if gpu else result


def _guarded(what, job):
    """job, making this rank give up on its state's communicator when the job fails other than
    in step with the peers (a MismatchError, which every rank raises alike): after its control
    round the peers may be inside the call's collective, waiting for this rank (a MemoryError
    in a wire copy), and are told at once (context.Context.fail) instead of pairing this rank's
    next call with it."""
    def guarded(st, planned):
        try:
            return job(st, planned)
        except MismatchError:
            raise
        except BaseException as exc:
            st.ctx.fail(what, exc)
            raise
    return guarded


# DistributedOptimizers (weak references) with buckets before their last whose step's backward
# passes have all brought this rank gradients, so may have buckets its hooks did not start
# (optimizer.py; see _start_unstarted).
_UNSTARTED = []
_flushing = False  # inside _own_calls(): no call starts them
_graph_task = torch._C._current_graph_task_id  # -1 outside backward (~30 ns)


def _start_unstarted(st, task):
    """Before a call on st made in autograd graph task `task` (-1: outside backward), and
    before another optimizer's gradient (its hook calls this): each DistributedOptimizer on st
    whose backward passes are over (none still runs, and the call's pass does not enclose them:
    _mlf_after) starts the buckets its hooks did not (all but its last, which synchronize()
    runs). Why: a bucket starts in backward once all its parameters have had their gradients on
    this rank, so a parameter that gets one on some ranks only (a branch taken on some, an
    expert given no tokens) leaves its bucket unstarted until synchronize() on those ranks but
    not on the others, and a later call (a metric's allreduce, another optimizer's buckets, in
    the next backward pass too) would meet that bucket's allreduce on the others: a
    MismatchError on some ranks, a PeerTimeoutError on the rest, or, between two optimizers of
    one model, gradients summed with another bucket's. Started here, every rank has issued the
    same buckets before the call. (Every rank must still bring the optimizer some gradient in
    each pass: a rank that brings none cannot tell a backward pass happened.)"""
    due = [ref for ref in _UNSTARTED
           if (opt := ref()) is None or (opt._mlf_state is st and opt._mlf_after(task))]
    if not due:  # the usual case within a pass: its own buckets' calls
        return
    with _own_calls():
        for ref in due:
            if ref not in _UNSTARTED:  # (reduced meanwhile: nothing left to start)
                continue
            _UNSTARTED.remove(ref)
            opt = ref()
            if opt is not None:
                opt._mlf_start_unstarted()


@contextlib.contextmanager
def _own_calls():
    """Calls issued inside start no optimizer's unstarted buckets: those of _start_unstarted
    itself, and a DistributedOptimizer's synchronize() starting its own buckets before its
    last (which buckets its hooks started before may differ between ranks; they must all be
    issued before another optimizer's are)."""
    global _flushing
    outer, _flushing = _flushing, True
    try:
        yield
    finally:
        _flushing = outer


def _on_side_stream(st, job, device, tensors):
    """job, to run on mlfabric's stream on `device` after the work queued so far on the caller's
    current stream (an event recorded now, on the caller's thread), returning (its result, an
    event after its work, the NCCL work it launched, its error or None). Recorded at the call,
    not when the queue reaches it: by then a gradient hook's caller has queued the rest of
    backward, which the allreduce need not wait for, and would. Its NCCL work is launched, not
    waited for (the caller waits, bounded, in _on_caller_stream): the next call's queues behind
    it on the GPU while the host exchanges that call's descriptors. (DDP and Horovod do the
    same.) The call's CUDA tensors are marked in use by mlfabric's stream: freed after the call,
    whichever stream they came from, their memory waits for its work there."""
    produced = torch.cuda.Event()
    produced.record(torch.cuda.current_stream(device))
    side = st.streams.get(device)
    if side is None:
        with _S_LOCK:  # calls come from the training thread and from autograd's
            side = st.streams.get(device)
            if side is None:
                side = st.streams[device] = torch.cuda.Stream(device)

    def on_side(st, planned):
        for t in tensors:
            if t.is_cuda:
                t.record_stream(side)
        side.wait_event(produced)
        result = error = None
        with torch.cuda.stream(side), _nccl.deferred() as launched:
            try:
                result = job(st, planned)
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                error = exc
        done = torch.cuda.Event()
        done.record(side)
        return result, done, launched, error
    return on_side


def _wait_launched(launched):
    """Wait (bounded by MLFABRIC_TIMEOUT; PeerTimeoutError) for NCCL work a call launched."""
    for comm, devices, event, what in launched:
        comm.wait(devices, event, what)


def _on_caller_stream(result, done, launched, error, device):
    """A GPU call's result (or its error), once its NCCL work is done, made safe for the
    caller's current stream: its later work there follows mlfabric's (copies out included,
    and on an error whatever the call did before it), and tensors allocated on mlfabric's
    stream are marked in use by it, so the allocator does not hand their memory to mlfabric's
    next call while that work reads them. Where the wait fails (the communicator was aborted)
    the stream is left alone: it would wait for NCCL work that may never finish."""
    try:
        _wait_launched(launched)
    except MlfabricError:
        if error is None:
            raise
        raise error from None  # the call's own error says more
    stream = torch.cuda.current_stream(device)
    stream.wait_event(done)
    if error is not None:
        raise error
    for t in result if isinstance(result, (list, tuple)) else (result,):
        for u in t if isinstance(t, (list, tuple)) else (t,):  # (outputs, rows): grouped
            if isinstance(u, torch.Tensor) and u.is_cuda:
                u.record_stream(stream)
    return result


class _GpuCall:
    """An *_async call on CUDA tensors in flight: its queue Handle, and its job, which holds its
    tensors alive until synchronize(): freed earlier, their memory could go to the caller's next
    tensor while mlfabric's stream still reads them."""
    __slots__ = ("handle", "device", "keep")

    def __init__(self, handle, device, keep):
        self.handle, self.device, self.keep = handle, device, keep

    def done(self):
        """True once synchronize() would return at once: the job has run and its GPU work is
        done (or failed)."""
        if not self.handle.done():
            return False
        _, done, launched, error = self.handle.wait()
        if error is not None or any(comm.failed is not None for comm, *_ in launched):
            return True
        return all(devices.done(ev) for _, devices, ev, _ in launched) and done.query()

    def wait(self):
        return _on_caller_stream(*self.handle.wait(), self.device)


def _reject_call(process_set, what, async_):
    """_reject() on process_set's ranks, where this rank can tell which they are: when
    process_set is not a ProcessSet at all, the global set's (the call can only have been meant
    for a set this rank knows nothing of, and a peer calling on the global set hears of it); an
    unregistered set, or one without this rank, has no round to take part in."""
    try:
        st = _state(process_set)
    except TypeError:
        st = _state()
    except ValueError:
        return
    _reject(st, what, async_)


def _reject(st, what, async_):
    """Take part in the control round of the call `what` as 'rejected' (the peers raise a
    MismatchError naming this rank). Called while handling the error this rank raises next,
    which is marked with the state whose ranks have heard of it (elastic.run reads the mark)."""
    told = sys.exc_info()[1]
    if told is not None:
        try:
            told._mlf_peers_told = st
        except AttributeError:  # an exception type without a __dict__
            pass
    desc = np.zeros(_W, np.int64)
    desc[_STATE] = _REJECTED

    def job():
        try:
            _control(st, desc)
        except MlfabricError:
            pass  # the peers' view of this call; this rank's own error is the one to raise

    if async_:
        st.submit(what, job)
    else:
        st.run(what, job)


# --- handles --------------------------------------------------------------------------------------

def synchronize(handle):
    """Wait for an *_async call and return its result (what the blocking form returns; for
    alltoall_async, (output, received_splits)). Raises the call's error, if any."""
    st = _state()
    h = st.handles.pop(handle, None)
    if h is None:
        raise ValueError(f"unknown handle {handle!r}: not from an *_async call since init(), or "
                         "already synchronized")
    return h.wait()


def poll(handle):
    """True once the call behind handle has finished (synchronize() then returns at once)."""
    st = _state()
    h = st.handles.get(handle)
    if h is None:
        raise ValueError(f"unknown handle {handle!r}: not from an *_async call since init(), or "
                         "already synchronized")
    return h.done()


# --- allreduce ------------------------------------------------------------------------------------

class _ReducePlan:
    """How one allreduce runs: the core op, the prescale, and the scaling after the sum."""
    __slots__ = ("op", "core", "pre", "after")

    def __init__(self, op, dtype, pre, post, size, what):
        if op == Adasum:
            raise ValueError(f"{what}: op Adasum is for allreduce (and its forms) only")
        floating = dtype.is_floating_point
        if op == Average and not floating:
            raise TypeError(f"{what}: op Average needs a floating tensor, got {dtype}; use op=Sum")
        pre, post = _factor(pre, what, "prescale_factor"), _factor(post, what, "postscale_factor")
        if (pre != 1.0 or post != 1.0) and not floating:
            raise TypeError(f"{what}: prescale_factor / postscale_factor need a floating tensor, "
                            f"got {dtype}")
        self.op, self.pre = op, pre
        if op == Average:
            # One pass when nothing else scales the sum; otherwise sum, then one scaling.
            self.core, self.after = ("avg", 1.0) if post == 1.0 else ("sum", post / size)
        else:
            self.core, self.after = _CORE_OF[op], post


def _allreduce_flat(flat, plan):
    if flat.numel():
        _coll.allreduce(flat, op=plan.core, out=flat)
        if plan.after != 1.0:
            flat.mul_(plan.after)


def _wire_copy(t, plan):
    """A new contiguous wire-dtype copy of t (same shape), prescaled."""
    buf = torch.empty(t.shape, dtype=_wire(t.dtype), device=t.device)
    buf.copy_(t)
    if plan.pre != 1.0:
        buf.mul_(plan.pre)
    return buf


# --- tensor fusion of queued async allreduces --------------------------------------------------
# Horovod fuses the allreduces that are ready at the same time into one buffer. Here an async
# allreduce of a CPU tensor that starts while like calls (the same dtype, op and scaling) are
# queued behind it does their work too: one control round and one allreduce for them all, where
# each call would cost both (100 async calls of 1 KiB: ~120 us each on the 2-core VM). Ranks may
# have queued different numbers of them by then, so each offers in its descriptor how many it has
# (_FUSE_N) and a running hash of their descriptors after 1, 2, 4, ... of them (_FUSE_H). From
# the table every rank picks the same number: the largest power of 2 that every rank has queued
# and whose hashes all agree (64-bit: crc32 and adler32). The calls fused are then those every
# rank would have described next, word for word, so fusion changes how the data moves, never what
# is checked: calls that would not agree are left queued, to fail in their own round. A rank whose
# offers the others keep refusing (ranks naming their calls differently) offers less often.
_REFUSED_PAUSE = 16  # calls run unfused (no offer to hash) after an offer every rank could take

class _Member:
    """One allreduce call's tensor and descriptor: what _reduce_members moves, and for an async
    call of a CPU tensor what it shows the call running ahead of it (its Executor tag). key and
    nbytes are read only where fusion asks (a blocking call never does)."""
    __slots__ = ("what", "plan", "desc", "tensor", "inplace")

    def __init__(self, what, plan, desc, tensor, inplace):
        self.what, self.plan, self.desc, self.tensor = what, plan, desc, tensor
        self.inplace = inplace

    @property
    def key(self):
        """What calls fused into one allreduce share: dtype, core op and scaling."""
        p = self.plan
        return (self.tensor.dtype, p.core, p.pre, p.after)

    @property
    def nbytes(self):
        """Bytes as it travels."""
        return self.tensor.numel() * _wire(self.tensor.dtype).itemsize


def _followers(st, head):
    """The fusible calls queued right behind head, within the fusion threshold, up to the first
    that reads or writes memory an earlier one of the run writes in place (fused, it would see
    that call's input, not its result)."""
    budget = _fusion_budget() - head.nbytes
    key = head.key
    written = ([], [])
    _writes(written, head)
    out = []
    for tag in st.queue.queued(1 << (_FUSE_LEVELS - 1)):
        budget -= tag.nbytes
        if budget < 0 or tag.key != key or _writes(written, tag):
            break
        out.append(tag)
    return out


def _writes(written, tag):
    """Whether tag's tensor overlaps memory in `written` (the byte spans [first, end) written in
    place by earlier members: disjoint, so kept sorted as (firsts, ends) and searched by
    bisection); then records its own span if it is written in place. Addresses alone decide:
    the tensors of queued calls are alive, so spans of distinct storages never overlap."""
    t = tag.tensor
    if not t.numel():
        return False
    lo = t.data_ptr()
    if t.is_contiguous():
        hi = lo + t.numel() * t.element_size()
    else:
        hi = lo + (1 + sum((k - 1) * s for k, s in zip(t.shape, t.stride()))) * t.element_size()
    firsts, ends = written
    i = bisect.bisect_right(firsts, lo)
    if (i and ends[i - 1] > lo) or (i < len(firsts) and firsts[i] < hi):
        return True
    if tag.inplace:
        firsts.insert(i, lo)
        ends.insert(i, hi)
    return False


def _fusion_budget():
    try:
        return fusion_threshold()
    except MlfabricError:
        return 0  # a bad setting: no fusion here (DistributedOptimizer reports it)


def _offer(desc, followers):
    """Write the fusion words of desc: len(followers) and their prefix hashes."""
    desc[_FUSE_N] = len(followers)
    a, b = 0, 1
    for i, tag in enumerate(followers, 1):
        data = tag.desc.tobytes()
        a, b = zlib.crc32(data, a), zlib.adler32(data, b)
        if i & (i - 1) == 0:  # a power of 2
            desc[_FUSE_H + i.bit_length() - 1] = (a << 31) ^ b


def _fused_count(table):
    """How many queued calls every rank fuses behind this one (from the table alone)."""
    rows = table.tolist()  # (a few ranks' 30 words: cheaper as lists than as numpy ops)
    n = min(row[_FUSE_N] for row in rows)
    if n <= 0 or any(row[_STATE] != _ACTIVE for row in rows):
        return 0  # a joined rank takes part in one call at a time
    first = rows[0]
    for level in range(n.bit_length() - 1, -1, -1):
        h = _FUSE_H + level
        if all(row[h] == first[h] for row in rows):
            return 1 << level
    return 0


def _fused_job(st, head, plan, what):
    """An async allreduce's job: its control round, offering the like calls queued behind it;
    then one allreduce for it and those that every rank fuses. Their handles finish here."""
    desc = head.desc
    followers = []
    if st.fusion_pause:
        st.fusion_pause -= 1
    else:
        try:
            followers = _followers(st, head)
            if followers:
                _offer(desc, followers)
        except Exception:  # noqa: BLE001 - a queued tensor that cannot be read: offer nothing
            # (this call's round must still happen: the peers are in it)
            followers = []
            desc[_FUSE_N:_W] = 0
    table = _agree(st, desc, what)
    taken = st.queue.take(_fused_count(table)) if followers else []
    if not taken:
        if followers and table[:, _FUSE_N].min() > 0:
            st.fusion_pause = _REFUSED_PAUSE  # every rank offered; their calls differ
        return _reduce_one(head, plan)
    members = [head] + followers[:len(taken)]
    try:
        results = _reduce_members(st, members, plan)
    except BaseException as exc:
        st.queue.finish(taken, errors=[_own_copy(exc, f"{m.what}, fused with {what}")
                                       for m in members[1:]])
        raise
    st.queue.finish(taken, results[1:])
    return results[0]


def _own_copy(exc, what):
    """exc for another handle, whose call is `what`: a copy caused by it, its message led by
    that call's name (one exception object raised by many synchronize() calls would grow its
    traceback at each)."""
    try:
        err = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception that cannot be copied: itself
        return exc
    if len(err.args) == 1 and isinstance(err.args[0], str):
        err.args = (f"{what}: {err.args[0]}",)
    err.__cause__ = exc
    return err


def _addresses(tensors):
    """The data addresses of these CPU tensors (a uint64 array, read in one native call where it
    can be: tensor_meta.py), or None if one is not contiguous."""
    got = _meta.scan(tensors)
    if got is not None:
        return got[1]
    if all(map(torch.Tensor.is_contiguous, tensors)):
        return np.array(list(map(torch.Tensor.data_ptr, tensors)), dtype=np.uint64)
    return None


def _reduce_members(st, members, plan):
    """Allreduce the tensors of these fused calls (after the control round, which every rank
    passed as active): each call's result. They travel as one wire buffer: dense tensors of a
    dtype that travels as it is are copied into the staging buffer (shared memory where the
    ranks share a host: the allreduce then reads it in place) and, when every call is in
    place, back, by address, in one native call each way (~0.1 us a tensor, where torch's
    copies cost ~1 us)."""
    tensors = [m.tensor for m in members]
    dtype = tensors[0].dtype  # (one per run: the members' key)
    sizes = list(map(torch.Tensor.numel, tensors))
    ptrs = _addresses(tensors) if _wire(dtype) == dtype else None
    if ptrs is not None:
        total = sum(sizes)
        flat = _staging(st, dtype, total, True, tensors[0].device)[:total]
        nbytes = np.array(sizes, dtype=np.uint64) * np.uint64(dtype.itemsize)
        _C.gather(flat.data_ptr(), ptrs, nbytes)
    else:
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]).to(_wire(dtype))
    if plan.pre != 1.0:
        flat.mul_(plan.pre)
    _allreduce_flat(flat, plan)
    if ptrs is not None and all(m.inplace for m in members):
        _C.scatter(flat.data_ptr(), ptrs, nbytes)
        _increment_version(tensors)  # as an in-place torch op would
        return tensors
    results = []
    for m, piece in zip(members, flat.split(sizes)):
        piece = piece.view(m.tensor.shape)
        if m.inplace:
            m.tensor.detach().copy_(piece)
            results.append(m.tensor)
        elif piece.dtype != dtype:
            results.append(piece.to(dtype))
        else:  # a result of its own, not a view of the (reused) fused buffer
            results.append(piece.clone())
    return results


def _reduce_one(member, plan):
    """One call's allreduce (after its control round): straight into the tensor where it can
    be, else through a wire copy. Its result: the tensor (in place) or a tensor of its own."""
    src = member.tensor.detach()
    if member.inplace and src.is_contiguous() and _wire(src.dtype) == src.dtype \
            and plan.pre == 1.0:
        _allreduce_flat(src.view(-1), plan)
        _increment_version([src])  # as an in-place torch op would
        return member.tensor
    buf = _wire_copy(src, plan)
    _allreduce_flat(buf.view(-1), plan)
    if member.inplace:
        src.copy_(buf)
        return member.tensor
    return buf if buf.dtype == src.dtype else buf.to(src.dtype)


def _allreduce_call(tensor, op, average, name, pre, post, inplace, async_, layout=None,
                    process_set=None):
    """layout: what else every rank's call must agree on (DistributedOptimizer: the model)."""
    what = _what("allreduce", name)
    try:
        resolved = _resolve_op(op, average)
    except ValueError:
        resolved = None  # the plan below reports it, on every rank
    if resolved == Adasum:
        return _adasum.call(tensor, name, pre, post, inplace, async_, process_set)

    def plan(st):
        _check_name(name)
        code = _check_tensor(tensor, what)
        if inplace:
            _check_writable(tensor, what)
        p = _ReducePlan(resolved or _resolve_op(op, average), tensor.dtype, pre, post,
                        st.ctx.size, what)
        desc = _desc(_ALLREDUCE, code, _CORE_OPS.index(p.core), shape=tensor.shape, name=name,
                     layout=layout, tensor=tensor)
        return p, _Member(what, p, desc, tensor, inplace)

    def job(st, planned):
        p, me = planned
        if async_ and not tensor.is_cuda:
            return _fused_job(st, me, p, what)
        _agree(st, me.desc, what)
        return _reduce_one(me, p)

    # (_issue shows no GPU call to the calls ahead of it: they are never fused)
    return _issue(what, plan, job, async_, tensor, process_set=process_set,
                  tag=lambda planned: planned[1])


def _recorded(*tensors):
    """Whether autograd must record this call (grad mode on, a tensor requiring grad): only
    then does it go through its autograd Function, whose apply() costs ~50 us a call on the
    2-core VM; else the call runs as the Function's forward would, with the same result."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _check_differentiable(op, what):
    if op not in (Average, Sum):
        raise MlfabricError(f"the gradient of {what} with op {op} is not defined; only Average "
                            "and Sum are differentiable")


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, average, name, pre, post, process_set):
        out = _allreduce_call(tensor, op, average, name, pre, post, False, False,
                              process_set=process_set)
        ctx.op, ctx.pre, ctx.post = _resolve_op(op, average), pre, post
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx, grad):
        _check_differentiable(ctx.op, "allreduce")
        grad = _allreduce_call(grad, ctx.op, None, None, ctx.pre, ctx.post, False, False,
                               process_set=ctx.process_set)
        return grad, None, None, None, None, None, None


def _compression(what, compression, process_set=None):
    """compression, or its TypeError raised on every rank (through a rejected call)."""
    try:
        return _check_compression(compression)
    except TypeError as exc:
        _reject_call(process_set, what, False)
        raise exc


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Reduce tensor over all ranks (default: Average) and return the result; tensor is left
    as it is. Differentiable. op: Average, Sum, Min, Max, Product (average=True/False is the
    deprecated spelling of Average/Sum). prescale_factor multiplies the input and
    postscale_factor the result (floating tensors). compression: Compression.none or
    Compression.fp16 (see mlfabric.torch.compression for its tolerance). name: an optional
    label; when every rank gives one they must match (a check that ranks issue calls in the
    same order). process_set: the ranks taking part (default every rank; process_sets.py);
    every collective of mlfabric.torch takes it."""
    compression = _compression(_what("allreduce", name), compression, process_set)
    if not isinstance(tensor, torch.Tensor):  # reported on every rank
        return _allreduce_call(tensor, op, average, name, 1.0, 1.0, False, False,
                               process_set=process_set)
    compressed, cctx = compression.compress(tensor)
    if _recorded(compressed):
        out = _AllreduceFn.apply(compressed, op, average, name, prescale_factor,
                                 postscale_factor, process_set)
    else:
        out = _allreduce_call(compressed, op, average, name, prescale_factor, postscale_factor,
                              False, False, process_set=process_set)
    return compression.decompress(out, cctx)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None):
    """Non-blocking allreduce: returns a handle; synchronize(handle) returns the result."""
    return _allreduce_call(tensor, op, average, name, prescale_factor, postscale_factor, False,
                           True, process_set=process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """In-place allreduce: tensor receives the result; returns tensor. Not differentiable."""
    return _allreduce_call(tensor, op, average, name, prescale_factor, postscale_factor, True,
                           False, process_set=process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None):
    """Non-blocking in-place allreduce: returns a handle; leave tensor alone until
    synchronize(handle), which returns it."""
    return _allreduce_call(tensor, op, average, name, prescale_factor, postscale_factor, True,
                           True, process_set=process_set)


# --- grouped allreduce ----------------------------------------------------------------------------

# Grouped allreduces stage through one reusable flat buffer per wire dtype (a fresh buffer would
# cost page faults on every call) of up to this many bytes; larger calls get a buffer of their own.
# When every rank is on one host and takes part, the buffer is in shared memory (collectively
# allocated, at the same offset everywhere), so the allreduce reads the peers' staging buffers in
# place instead of copying through the engine's segment: the tensors are copied once in and once
# out, as one tensor of the same size would be. Shared staging grows by doubling and is freed at
# finalize (at most about twice _STAGING_MAX per dtype).
_STAGING_MAX = 64 << 20
_LAYOUTS_KEPT = 64  # lists of dtypes and shapes whose grouping (and staging views) are kept


class _Group:
    """The tensors of one dtype in a grouped allreduce's list, and their place in the staging
    buffer: kept per list of dtypes and shapes, since a training loop reduces the same list
    every step."""
    __slots__ = ("code", "members", "shapes", "total", "nbytes", "staged")

    def __init__(self, code, members, shapes):
        self.code, self.members, self.shapes = code, members, shapes
        self.total = sum(math.prod(s) for s in shapes)
        size = _DTYPES[code].itemsize
        # of each tensor, for _C.gather / scatter (a uint64 array: nothing to convert per call)
        self.nbytes = np.array([math.prod(s) * size for s in shapes], dtype=np.uint64)
        self.staged = None  # (staging buffer, its first `total` elements, views shaped as shapes)


def _layout(codes, shapes):
    """The groups of a list of these dtype codes and shapes: one per dtype, in order of first
    appearance."""
    if codes.count(codes[0]) == len(codes):
        return [_Group(codes[0], None, shapes)]
    members = {}
    for i, c in enumerate(codes):
        members.setdefault(c, []).append(i)
    return [_Group(c, m, tuple(shapes[i] for i in m)) for c, m in members.items()]


def _staging(st, wire, total, everyone, device):
    """A buffer of at least `total` elements of dtype `wire` on `device` to stage a fused call's
    data in (the one kept for the next call, unless it is over _STAGING_MAX). Staging runs
    inside calls, one at a time, after the control round: `everyone` (every rank takes part,
    none joined) means every rank makes this same call now, so a shared buffer may be
    allocated (a collective). A GPU buffer is only touched on mlfabric's stream there, one call
    after another: reuse is ordered."""
    nbytes = total * wire.itemsize
    shared = everyone and device.type == "cpu" and st.ctx.shm is not None and \
        nbytes <= _STAGING_MAX
    pool = st.shared_staging if shared else st.staging
    key = wire if device.type == "cpu" else (wire, device)
    buf = pool.get(key)
    if buf is None or buf.numel() < total:
        if shared:
            grown = max(total, 2 * buf.numel() if buf is not None else 0)
            buf = _shared.shared_empty(min(grown, _STAGING_MAX // wire.itemsize), wire)
        else:
            buf = torch.empty(total, dtype=wire, device=device)
        if nbytes <= _STAGING_MAX:  # else used for this call only
            pool[key] = buf
    return buf


def _staged(st, group, everyone, device):
    """(flat, views) for group in the staging buffer of its wire dtype (_staging): views shaped
    like the group's tensors, back to back at the start of flat; kept in the group while that
    buffer is the one staging uses."""
    buf = _staging(st, _wire(_DTYPES[group.code]), group.total, everyone, device)
    if group.staged is not None and group.staged[0] is buf:
        return group.staged[1], group.staged[2]
    flat = buf[:group.total]
    views = [v.view(s) for v, s in zip(flat.split([math.prod(s) for s in group.shapes]),
                                       group.shapes)]
    if group.total * buf.element_size() <= _STAGING_MAX:
        group.staged = (buf, flat, views)
    return flat, views


def _clone_all(tensors):
    """Independent copies of tensors, in one call where this torch has one."""
    clone = getattr(torch, "_foreach_clone", None)
    return list(clone(tensors)) if clone is not None else [t.clone() for t in tensors]


_IS_CPU, _DTYPE_OF, _SHAPE_OF = (attrgetter(a) for a in ("is_cpu", "dtype", "shape"))


def _scan(tensors, what):
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
            codes = (_DTYPE_CODE[first],) * len(dtypes) if dtypes.count(first) == len(dtypes) \
                else tuple(map(_DTYPE_CODE.__getitem__, dtypes))
            shapes = tuple(map(_SHAPE_OF, tensors))
            ptrs = list(map(torch.Tensor.data_ptr, tensors))  # raises where not strided
            contiguous = all(map(torch.Tensor.is_contiguous, tensors))
            return _meta.signature(codes, shapes), _meta.addresses(ptrs) if contiguous else None
    except (AttributeError, KeyError, TypeError, RuntimeError):
        pass
    for i, t in enumerate(tensors):
        _check_tensor(t, what, f"tensors[{i}]")
        if t.device != tensors[0].device:
            raise ValueError(f"{what}: tensors[{i}] is on {t.device}, tensors[0] on "
                             f"{tensors[0].device}; a group's tensors share one device")
    # GPU lists get here, and CPU tensors whose storage has no address to read (wrapper
    # subclasses, whose data_ptr raises): torch copies them, no addresses needed
    return _meta.signature([_DTYPE_CODE[t.dtype] for t in tensors],
                           [t.shape for t in tensors]), None


def _grouped_call(tensors, op, average, name, pre, post, inplace, async_, process_set=None):
    """One fused allreduce per dtype (in order of first appearance), each its own call. The
    tensors are copied into a staging buffer with one torch._foreach_copy_ (widened there if
    need be), reduced in place, and copied back with one more (in place forms) or cloned out."""
    what = _what("grouped_allreduce", name)

    def plan(st):
        _check_name(name)
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{what}: tensors must be a list of tensors, got "
                            f"{type(tensors).__name__}")
        if not tensors:
            raise ValueError(f"{what}: needs at least one tensor")
        resolved = _resolve_op(op, average)
        sig, ptrs = _scan(tensors, what)
        if inplace and ptrs is None:  # (addresses: every tensor is contiguous, so writable)
            for i, t in enumerate(tensors):
                _check_writable(t, what, f"tensors[{i}]")
        # Every group's descriptor carries the whole list's dtypes and shapes, hashed once
        # (Python's hash of a tuple of ints is the same in every process), so ranks whose lists
        # differ fail at the first group instead of issuing different numbers of calls. The
        # hash is kept with the groups: a tuple does not cache its own.
        # (a group on a GPU is kept apart: its staging buffer is on that GPU)
        key = sig if tensors[0].is_cpu else (tensors[0].device, sig)
        known = st.layouts.get(key)
        if known is None:
            if len(st.layouts) >= _LAYOUTS_KEPT:
                st.layouts.clear()
            known = st.layouts[key] = (_layout(*_meta.decode(sig)), zlib.crc32(sig))
        groups, layout = known
        planned = []
        for g, group in enumerate(groups):
            p = _ReducePlan(resolved, _DTYPES[group.code], pre, post, st.ctx.size, what)
            planned.append((group, p, _desc(
                _ALLREDUCE, group.code, _CORE_OPS.index(p.core), shape=(group.total,),
                name=None if name is None else f"{name}.{g}", layout=(g, layout),
                tensor=tensors[0])))
        return planned, ptrs

    def job(st, planned_ptrs):
        planned, all_ptrs = planned_ptrs
        outs = list(tensors) if inplace else [None] * len(tensors)
        for group, p, desc in planned:
            members = group.members
            srcs = tensors if members is None else [tensors[i] for i in members]
            ptrs = all_ptrs if members is None or all_ptrs is None else all_ptrs[members]
            table = _agree(st, desc, what)
            flat, views = _staged(st, group, _everyone(table), tensors[0].device)
            dtype = _DTYPES[group.code]
            # torch copies instead when the wire dtype is wider, a tensor is not contiguous,
            # or they are on a GPU (ptrs is None then)
            if flat.dtype != dtype:
                ptrs = None
            if ptrs is not None:
                _C.gather(flat.data_ptr(), ptrs, group.nbytes)
            else:
                with torch.no_grad():  # the staging buffer must not join srcs' graph
                    torch._foreach_copy_(views, srcs)
            if p.pre != 1.0:
                flat.mul_(p.pre)
            _allreduce_flat(flat, p)
            if inplace:
                if ptrs is not None:
                    _C.scatter(flat.data_ptr(), ptrs, group.nbytes)
                    # as an in-place torch op would: autograd must see these were written
                    _increment_version(srcs)
                else:
                    with torch.no_grad():  # srcs may require grad
                        torch._foreach_copy_(srcs, views)
                continue
            results = _clone_all(views) if flat.dtype == dtype else [v.to(dtype)
                                                                     for v in views]
            if members is None:
                return results
            for i, out in zip(members, results):
                outs[i] = out
        return outs

    return _issue(what, plan, job, async_, tensors[0] if isinstance(tensors, (list, tuple))
                  and tensors else None, tensors, process_set)


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, average, name, pre, post, process_set, *tensors):
        outs = _grouped_call(list(tensors), op, average, name, pre, post, False, False,
                             process_set)
        ctx.op, ctx.pre, ctx.post = _resolve_op(op, average), pre, post
        ctx.process_set = process_set
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        _check_differentiable(ctx.op, "grouped_allreduce")
        reduced = _grouped_call(list(grads), ctx.op, None, None, ctx.pre, ctx.post, False, False,
                                ctx.process_set)
        return (None, None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """allreduce of a list of tensors, fused into one buffer per dtype; returns a list.
    Differentiable."""
    compression = _compression(_what("grouped_allreduce", name), compression, process_set)
    if not (isinstance(tensors, (list, tuple)) and tensors
            and all(isinstance(t, torch.Tensor) for t in tensors)):  # reported on every rank
        return _grouped_call(tensors, op, average, name, 1.0, 1.0, False, False, process_set)
    pairs = [(t, None) for t in tensors] if compression is Compression.none else \
        [compression.compress(t) for t in tensors]
    sent = [c for c, _ in pairs]
    if _recorded(*sent):
        outs = _GroupedAllreduceFn.apply(op, average, name, prescale_factor, postscale_factor,
                                         process_set, *sent)
    else:
        outs = _grouped_call(sent, op, average, name, prescale_factor, postscale_factor, False,
                             False, process_set)
    if compression is Compression.none:
        return list(outs)
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None):
    return _grouped_call(tensors, op, average, name, prescale_factor, postscale_factor, False,
                         True, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None):
    return _grouped_call(tensors, op, average, name, prescale_factor, postscale_factor, True,
                         False, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None):
    return _grouped_call(tensors, op, average, name, prescale_factor, postscale_factor, True,
                         True, process_set)


# --- allgather ------------------------------------------------------------------------------------

def _gather_plan(table):
    """(rows of each rank, the rows every rank sends, row length): the same on every rank.
    Every rank sends max_rows rows (padded): mlfabric's allgather moves equal blocks."""
    rows = table[:, _ROWS].copy()
    rows[table[:, _STATE] != _ACTIVE] = 0
    active = np.flatnonzero(table[:, _STATE] == _ACTIVE)
    return rows, int(rows.max()), int(table[active[0], _ROW_LEN])


def _allgather_call(tensor, name, async_, with_rows=False, process_set=None):
    what = _what("allgather", name)

    def plan(st):
        _check_name(name)
        code = _check_tensor(tensor, what)
        return _desc(_ALLGATHER, code, shape=tensor.shape, name=name, tensor=tensor)

    def job(st, desc):
        table = _agree(st, desc, what)
        src = tensor.detach()
        shape = tuple(src.shape) or (1,)
        wire = _wire(src.dtype)
        out, rows = _gather(table, src.reshape(shape[0], math.prod(shape[1:])).to(wire))
        out = _own(out, (out.shape[0], *shape[1:])) if wire == src.dtype else \
            out.view(out.shape[0], *shape[1:]).to(src.dtype)
        return (out, rows) if with_rows else out

    return _issue(what, plan, job, async_, tensor, process_set=process_set)


def _own(t, shape):
    """t's elements (a contiguous tensor no one else uses) as a tensor of shape that is not a
    view: a caller may then modify it in place even as the output of a custom autograd
    Function, which torch refuses for views (Horovod's outputs are fresh tensors too)."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), shape)


def _gather(table, mine):
    """(every active rank's rows of mine, a (rows, row length) tensor of the wire dtype, in rank
    order; the rows of each rank), after the control round that gave table. Joined ranks give
    no rows (_take_part pads for them as for anyone: every rank sends max_rows rows)."""
    rows, max_rows, row_len = _gather_plan(table)
    total = int(rows.sum())
    if not (max_rows and row_len):
        return torch.empty((total, row_len), dtype=mine.dtype, device=mine.device), rows
    mine = mine.contiguous()
    if (rows == max_rows).all():
        out = torch.empty((total, row_len), dtype=mine.dtype, device=mine.device) \
            if mine.is_cuda else None  # on the CPU the core allocates it (its direct path)
        return _coll.allgather(mine, out=out), rows
    block = torch.zeros((max_rows, row_len), dtype=mine.dtype, device=mine.device)
    block[:mine.shape[0]] = mine
    got = _coll.allgather(block)
    out = torch.empty((total, row_len), dtype=mine.dtype, device=mine.device)
    torch.cat([got[r * max_rows:r * max_rows + int(k)] for r, k in enumerate(rows)], out=out)
    return out, rows


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        out, rows = _allgather_call(tensor, name, False, True, process_set)
        me = _state(process_set).ctx.rank
        ctx.offset, ctx.rows, ctx.shape = int(rows[:me].sum()), int(rows[me]), tensor.shape
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduce_call(grad, Average, None, None, 1.0, 1.0, False, False,
                                  process_set=ctx.process_set)
        return reduced.narrow(0, ctx.offset, ctx.rows).reshape(ctx.shape), None, None


def allgather(tensor, name=None, process_set=None):
    """Concatenate every rank's tensor along dimension 0, in rank order; the first dimension may
    differ between ranks, the others must agree (a 0-d tensor counts as shape (1,)).
    Differentiable."""
    if not isinstance(tensor, torch.Tensor) or not _recorded(tensor):  # (a bad one: reported
        return _allgather_call(tensor, name, False, process_set=process_set)  # on every rank)
    return _AllgatherFn.apply(tensor, name, process_set)


def allgather_async(tensor, name=None, process_set=None):
    return _allgather_call(tensor, name, True, process_set=process_set)


# --- reducescatter --------------------------------------------------------------------------------

def _reducescatter_call(tensor, op, average, name, pre, post, async_, process_set=None):
    what = _what("reducescatter", name)

    def plan(st):
        code = _check_rows(tensor, name, what)
        p = _ReducePlan(_resolve_op(op, average), tensor.dtype, pre, post, st.ctx.size, what)
        return p, _desc(_REDUCESCATTER, code, _CORE_OPS.index(p.core), shape=tensor.shape,
                        name=name, tensor=tensor)

    def job(st, planned):
        p, desc = planned
        _agree(st, desc, what)
        src = tensor.detach()
        n, rows = st.ctx.size, src.shape[0]
        mine = _coll.split_rows(rows, n)[st.ctx.rank]
        if not src.numel():
            return src.new_empty((mine, *src.shape[1:]))
        # the core's reduce_scatter leaves its input alone: a copy only to widen or prescale
        sent = src.contiguous() if _wire(src.dtype) == src.dtype and p.pre == 1.0 else \
            _wire_copy(src, p)
        out = _own(_coll.reduce_scatter(sent.view(rows, -1), op=p.core), (mine, *src.shape[1:]))
        if p.after != 1.0:
            out.mul_(p.after)
        return out if out.dtype == src.dtype else out.to(src.dtype)

    return _issue(what, plan, job, async_, tensor, process_set=process_set)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, average, name, pre, post, process_set):
        out = _reducescatter_call(tensor, op, average, name, pre, post, False,
                                  process_set)  # checks first
        ctx.op, ctx.process_set = _resolve_op(op, average), process_set
        ctx.scale = float(pre) * float(post) / (_state(process_set).ctx.size
                                                if ctx.op == Average else 1)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Every rank's input rows r went, scaled, into rank r's output: the gradient of an input
        # is the allgather of the outputs' gradients, scaled the same way.
        _check_differentiable(ctx.op, "reducescatter")
        back = _allgather_call(grad.contiguous(), None, False, process_set=ctx.process_set)
        return ((back.mul_(ctx.scale) if ctx.scale != 1.0 else back), None, None, None, None,
                None, None)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Reduce tensor over all ranks (default: Average) and return this rank's block of rows of
    the result: dimension 0 split in rank order, the first shape[0] % size() ranks one row more
    (as Horovod, whose argument order this keeps). Every rank passes the same shape.
    Differentiable (Average, Sum); the factors and compression as in allreduce."""
    compression = _compression(_what("reducescatter", name), compression, process_set)
    if not isinstance(tensor, torch.Tensor):  # reported on every rank
        return _reducescatter_call(tensor, op, None, name, 1.0, 1.0, False, process_set)
    compressed, cctx = compression.compress(tensor)
    if _recorded(compressed):
        out = _ReducescatterFn.apply(compressed, op, None, name, prescale_factor,
                                     postscale_factor, process_set)
    else:
        out = _reducescatter_call(compressed, op, None, name, prescale_factor, postscale_factor,
                                  False, process_set)
    return compression.decompress(out, cctx)


def reducescatter_async(tensor, name=None, op=Average, prescale_factor=1.0,
                        postscale_factor=1.0, process_set=None):
    """Non-blocking reducescatter: synchronize(handle) returns this rank's rows."""
    return _reducescatter_call(tensor, op, None, name, prescale_factor, postscale_factor, True,
                               process_set)


# --- broadcast ------------------------------------------------------------------------------------

def _broadcast_call(tensor, root_rank, name, inplace, async_, process_set=None):
    what = _what("broadcast", name)

    def plan(st):
        _check_name(name)
        code = _check_tensor(tensor, what)
        if inplace:
            _check_writable(tensor, what)
        return _desc(_BROADCAST, code, root=st.root(root_rank, what), shape=tensor.shape,
                     name=name, tensor=tensor)

    def job(st, desc):
        _agree(st, desc, what)
        src, root = tensor.detach(), int(desc[_ROOT])
        if inplace and src.is_contiguous() and _wire(src.dtype) == src.dtype:
            if src.numel():
                _coll.broadcast(src.view(-1), root=root)
                _increment_version([src])  # as an in-place torch op would (as allreduce_)
            return tensor
        buf = torch.empty(src.shape, dtype=_wire(src.dtype), device=src.device)
        buf.copy_(src)
        if buf.numel():
            _coll.broadcast(buf.view(-1), root=root)
        if inplace:
            src.copy_(buf)
            return tensor
        return buf if buf.dtype == src.dtype else buf.to(src.dtype)

    return _issue(what, plan, job, async_, tensor, process_set=process_set)


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _broadcast_call(tensor, root_rank, name, False, False, process_set)

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduce_call(grad, Average, None, None, 1.0, 1.0, False, False,
                                  process_set=ctx.process_set)
        if _state().ctx.rank != ctx.root_rank:  # both global ranks
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=None):
    """root_rank's tensor, on every rank (tensor itself is left as it is). Differentiable.
    root_rank is a global rank, also with a process_set (as in Horovod)."""
    if not isinstance(tensor, torch.Tensor) or not _recorded(tensor):  # (a bad one: reported
        return _broadcast_call(tensor, root_rank, name, False, False, process_set)  # everywhere)
    return _BroadcastFn.apply(tensor, root_rank, name, process_set)


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    return _broadcast_call(tensor, root_rank, name, False, True, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """In-place broadcast: tensor receives root_rank's values; returns tensor."""
    return _broadcast_call(tensor, root_rank, name, True, False, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    return _broadcast_call(tensor, root_rank, name, True, True, process_set)


def fusion_threshold():
    """MLFABRIC_FUSION_THRESHOLD: the most bytes fused into one buffer (DistributedOptimizer's
    gradient buckets after the first, broadcast_parameters, queued async allreduces); default
    4 MiB; 0 turns fusion off.
    Every rank must use the same value. A bucket waits for all its gradients, so smaller buckets
    overlap more of backward; each costs a control round and an allreduce call, which with
    buckets in shared memory (zero-copy) is cheap enough that 4 MiB beat DDP's 25 MiB (the
    previous default) on every step measured (BENCHMARKS.md, DistributedOptimizer)."""
    return _config.fusion_threshold()  # (init() checks that every rank reads the same)


def fuse(tensors, threshold, first=None):
    """Indices of tensors grouped into buffers: one device and dtype per buffer, at most
    threshold bytes (a larger tensor gets a buffer of its own), in the order given; first
    (default threshold) caps the first buffer of each instead (DDP's small first bucket).
    Deterministic: the same tensors give the same buffers on every rank."""
    first = threshold if first is None else first
    buckets, current, filled, cap = [], {}, {}, {}
    for i, t in enumerate(tensors):
        # one device and dtype per buffer (an optimizer's state can mix CUDA tensors with CPU
        # scalars: Adam's step counts)
        kind, nbytes = (t.device, t.dtype), t.numel() * t.element_size()
        members = current.get(kind)
        if members is None or (members and filled[kind] + nbytes > cap[kind]):
            cap[kind] = first if members is None else threshold
            members = current[kind] = []
            filled[kind] = 0
            buckets.append(members)
        members.append(i)
        filled[kind] += nbytes
    return buckets


def _grouped_broadcast_call(tensors, root_rank, name, process_set=None):
    """In-place broadcast of a list of tensors, fused into buffers of MLFABRIC_FUSION_THRESHOLD
    bytes (one call each)."""
    what = _what("broadcast", name)

    def plan(st):
        root = st.root(root_rank, what)
        for i, t in enumerate(tensors):
            _check_tensor(t, what, f"tensors[{i}]")
            _check_writable(t, what, f"tensors[{i}]")
        # the whole list's, as grouped (hashed once: each fused buffer's descriptor carries it)
        signature = _hash(tuple((str(t.dtype), tuple(t.shape)) for t in tensors))
        planned = []
        for b, members in enumerate(fuse(tensors, fusion_threshold())):
            dtype = tensors[members[0]].dtype
            total = sum(tensors[i].numel() for i in members)
            planned.append((members, _desc(_BROADCAST, _DTYPE_CODE[dtype], root=root,
                                           shape=(total,), name=f"{name}.{b}",
                                           layout=(b, signature), tensor=tensors[members[0]])))
        return planned

    def job(st, planned):
        for members, desc in planned:
            _agree(st, desc, what)
            srcs = [tensors[i].detach() for i in members]
            flat = torch.cat([s.reshape(-1).to(_wire(s.dtype)) for s in srcs])
            root = int(desc[_ROOT])
            if flat.numel():
                _coll.broadcast(flat, root=root)
            if st.ctx.rank != root:
                off = 0
                for s in srcs:
                    s.copy_(flat[off:off + s.numel()].view(s.shape))
                    off += s.numel()
        return tensors

    cuda = next((t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda), None)
    return _issue(what, plan, job, False, cuda, tensors, process_set)


# --- alltoall -------------------------------------------------------------------------------------

def _row_shape(d):
    """The row shape alltoall moves: the tensor's own when the descriptor holds every dimension
    (so the result needs no reshaping), else flattened. The same on every rank."""
    nd = int(d[_NDIM])
    if nd <= _MAX_DIMS:
        return tuple(int(v) for v in d[_DIMS + 1:_DIMS + nd])
    return (int(d[_ROW_LEN]),)


def _alltoall_call(tensor, splits, name, async_, process_set=None):
    what = _what("alltoall", name)

    def plan(st):
        code = _check_rows(tensor, name, what)
        sends = _coll._alltoall_splits(splits, tensor.shape[0], st.ctx.size)
        return sends, _desc(_ALLTOALL, code, shape=tensor.shape, name=name, tensor=tensor)

    def job(st, planned):
        sends, desc = planned
        _agree(st, desc, what)
        src = tensor.detach()
        x = src.reshape(src.shape[0], *_row_shape(desc)).to(_wire(src.dtype))
        out, received = _coll.alltoall(x, sends)
        if out.dim() != src.dim():
            out = out.reshape(out.shape[0], *src.shape[1:]).clone()
        out = out if out.dtype == src.dtype else out.to(src.dtype)
        return out, torch.from_numpy(received.astype(np.int32))

    return _issue(what, plan, job, async_, tensor, process_set=process_set)


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _alltoall_call(tensor, splits, name, False, process_set)
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = _alltoall_call(grad, ctx.received, None, False, ctx.process_set)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send splits[j] rows of tensor (dimension 0, in order) to rank j and receive every rank's
    rows for this one, concatenated in rank order. splits: None (shape[0] / size rows to each
    rank) or size integers (a list or tensor). Returns the received tensor and, when splits was
    given, also the rows received from each rank (int32 tensor), like Horovod. Differentiable."""
    if not isinstance(tensor, torch.Tensor):  # reported on every rank
        return _alltoall_call(tensor, splits, name, False, process_set)
    if _recorded(tensor):
        out, received = _AlltoallFn.apply(tensor, splits, name, process_set)
    else:
        out, received = _alltoall_call(tensor, splits, name, False, process_set)
    return out if splits is None else (out, received)


def alltoall_async(tensor, splits=None, name=None, process_set=None):
    """Non-blocking alltoall: synchronize(handle) returns (output, received_splits)."""
    return _alltoall_call(tensor, splits, name, True, process_set)


# --- barrier and join -----------------------------------------------------------------------------

def barrier(process_set=None):
    """Return once every rank (of process_set) has called barrier() (joined ranks take part on
    their own)."""
    def job(st, desc):
        _agree(st, desc, "barrier")
        _coll.barrier()

    return _issue("barrier", lambda st: _desc(_BARRIER), job, False, process_set=process_set)


def join(device=-1):
    """Declare that this rank has no more data: until every rank has joined, it takes part in the
    others' collectives (see the module docstring for what it contributes), then returns the rank
    that joined last (of several joining in the same round, the highest). In the others' GPU
    calls a joined rank takes part on GPU `device` if >= 0, else on its NCCL communicator's GPU,
    else on the current one (as of this call)."""
    def plan(st):
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise TypeError(f"join: device must be a GPU index (or -1), got {device!r}")
        gpu = int(device) if device >= 0 else None
        if gpu is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            gpu = torch.cuda.current_device()   # taken here: the job runs on another thread
        return gpu

    return _issue("join", plan, _joined_loop, False)


def _joined_loop(st, gpu):
    desc = np.zeros(_W, np.int64)
    desc[_STATE] = _JOINED
    desc[_JOINED_AT] = st.rounds + 1
    while True:
        table = _control(st, desc)
        states = table[:, _STATE]
        if (states == _JOINED).all():
            at = table[:, _JOINED_AT]
            return int(np.flatnonzero(at == at.max()).max())
        if _disagreement(table, "join") is not None:
            continue  # the active ranks raise; nothing moves
        _take_part(table, gpu)


def _take_part(table, gpu):
    """A joined rank's part in the call the active ranks described."""
    d = table[np.flatnonzero(table[:, _STATE] == _ACTIVE)[0]]
    kind, wire = int(d[_KIND]), _wire(_DTYPES[int(d[_DTYPE])])
    device = _joined_device(gpu) if d[_DEVICE] else torch.device("cpu")
    numel = int(d[_ROWS]) * int(d[_ROW_LEN])
    if kind == _ALLREDUCE:
        core = _CORE_OPS[int(d[_OP])]
        if numel:
            buf = _identity(core, wire, numel, device)
            _coll.allreduce(buf, op=core, out=buf)
    elif kind == _ALLGATHER:
        rows, max_rows, row_len = _gather_plan(table)
        if max_rows and row_len:
            _coll.allgather(torch.zeros((max_rows, row_len), dtype=wire, device=device))
    elif kind == _BROADCAST:
        if numel:
            _coll.broadcast(torch.empty(numel, dtype=wire, device=device), root=int(d[_ROOT]))
    elif kind == _REDUCESCATTER:
        core = _CORE_OPS[int(d[_OP])]
        if numel:  # its rows of the result are dropped
            _coll.reduce_scatter(_identity(core, wire, numel, device).view(int(d[_ROWS]), -1),
                                 op=core)
    elif kind == _ALLTOALL:
        _coll.alltoall(torch.empty((0, *_row_shape(d)), dtype=wire, device=device),
                       np.zeros(table.shape[0], np.int64))
    else:
        _coll.barrier()


def _joined_device(gpu):
    """The GPU a joined rank takes part on (see join())."""
    comm = _state().ctx.nccl
    if gpu is None:
        gpu = comm.device if comm is not None else torch.cuda.current_device()
    return torch.device("cuda", gpu)
