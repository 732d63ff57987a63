"""How a call is issued: the per-initialisation State (the queue of one set of ranks, the handles,
the count of control rounds, the staging buffers, streams and process sets), state() to find it,
and issue(): check a call's arguments (a rank whose arguments are bad still takes part in the
round, as 'rejected'), then run it in issue order. Every call goes through one queue per process
(and one more per process set it belongs to: process_sets.py), in the order it was issued
(mlfabric matches collectives by order; async calls that ranks issue in different orders are
set aside until every rank has issued them: reorder.py, which also refuses a named call issued
twice while in flight). A blocking call runs on the
caller's thread when nothing is queued; *_async calls run on the queue's thread, so
communication overlaps the caller's work (the engine releases the GIL), and get an integer
handle (ops.synchronize / ops.poll). Also owns the rule that starts a DistributedOptimizer's
unstarted buckets before any other call (start_unstarted).
"""
import atexit
import contextlib
import itertools
import threading

import numpy as np
import torch

from ..comm import context as _context
from ..comm.executor import Executor
from ..errors import MismatchError
from . import reorder as _reorder
from . import timeline as _timeline
from .control import reject
from .streams import GpuCall, on_caller_stream, on_side_stream


class State:
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
        self.shared_staging = {}  # the same in shared memory (see fusion.staged)
        self.layouts = {}  # signature of a grouped allreduce's list -> (fusion.group_layout, hash)
        self.grouped_layouts = {}  # the same for grouped_reducescatter (grouped_ops.py)
        self.streams = {}  # GPU -> mlfabric's stream there for calls on CUDA tensors
        self.fusion_pause = 0  # async allreduces left to run without offering fusion
        self.mismatch = None  # (call, message) of the last control round, if it mismatched
        self.verdict = None  # (table, its disagreement) of the last round that computed it
        # async calls issued in different orders on different ranks (reorder.py): the call
        # whose job runs (a reorder.Call; None: a blocking call, which cannot be set aside),
        # the calls set aside, the table a call set aside runs with (its round took place)
        self.current = None
        self.aside = []
        self.preagreed = None
        self.in_flight = {}  # named async calls (CallName) -> weak reference to their Call
        self.sets = {}  # global state only: process set id -> (ranks, its State or None)
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
        _reorder.abandon(self)
        _context.close_sub_context(self.ctx)


_S = None
_S_LOCK = threading.Lock()


def state(process_set=None):
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
                _S = State(ctx)
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


def drain():
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
        _reorder.abandon(s)


# Registered after mlfabric.comm.context's finalize (imported above), so it runs before it at exit.
atexit.register(drain)


def issue(what, plan, job, async_, tensor=None, group=None, process_set=None, tag=None):
    """Validate (plan() -> its result, or raise) and run job(st, planned) in order. tensor: one
    of the call's tensors; for a CUDA one, job runs on mlfabric's stream (see on_side_stream);
    group: all of them, where there are several; process_set: the ranks taking part (None: all);
    tag: tag(planned), what an async call queued behind a running one shows it (fusion.fused_job).

    A rank whose arguments are bad still takes part in the control round, as 'rejected', so its
    peers fail at once with a MismatchError naming it; then it raises its own error. Any error
    of plan() counts: one that escaped here would leave the peers waiting for this rank."""
    try:
        st = state(process_set)
    except (TypeError, ValueError) as exc:
        reject_call(process_set, what, async_)
        raise exc
    _reorder.check_name_free(st, what)  # this rank's own error: nothing issued, no round
    if UNSTARTED and not _flushing:
        start_unstarted(st, _graph_task())
    try:
        planned = plan(st)
    except Exception as exc:
        reject(st, what, async_)
        raise exc
    job = _guarded(what, job)
    recording = _timeline.ACTIVE  # once: stop_timeline() may run on another thread
    if recording is not None:
        job = recording.wrap(what, job)
    gpu = tensor is not None and tensor.is_cuda
    if gpu:
        job = on_side_stream(st, job, tensor.device, group or (tensor,))
    if async_:
        shown = tag(planned) if tag is not None and recording is None and not gpu else None
        # a GPU call is not set aside: its job runs on mlfabric's stream (see reorder.py)
        call = _reorder.Call(st, what, lambda: job(st, planned), not gpu)
        handle = st.submit(what, call.run, shown)
        call.inner = GpuCall(handle, tensor.device, job) if gpu else handle
        _reorder.in_flight(st, what, call)
        hid = next(st.ids)
        st.handles[hid] = call
        return hid
    result = st.run(what, lambda: job(st, planned))
    return on_caller_stream(*result, tensor.device) if gpu else result


def _guarded(what, job):
    """job, making this rank give up on its state's communicator when the job fails other than
    in step with the peers (a MismatchError, which every rank raises alike): after its control
    round the peers may be inside the call's collective, waiting for this rank (a MemoryError
    in a wire copy), and are told at once (context.Context.fail) instead of pairing this rank's
    next call with it."""
    def guarded(st, planned):
        try:
            return job(st, planned)
        except (MismatchError, _reorder.SetAside):
            raise
        except BaseException as exc:
            st.ctx.fail(what, exc)
            raise
    return guarded


# DistributedOptimizers (weak references) with buckets before their last whose step's backward
# passes have all brought this rank gradients, so may have buckets its hooks did not start
# (optimizer.py; see start_unstarted).
UNSTARTED = []
_flushing = False  # inside own_calls(): no call starts them
_graph_task = torch._C._current_graph_task_id  # -1 outside backward (~30 ns)


def start_unstarted(st, task):
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
    due = [ref for ref in UNSTARTED
           if (opt := ref()) is None or (opt._mlf_state is st and opt._mlf_after(task))]
    if not due:  # the usual case within a pass: its own buckets' calls
        return
    with own_calls():
        for ref in due:
            if ref not in UNSTARTED:  # (reduced meanwhile: nothing left to start)
                continue
            UNSTARTED.remove(ref)
            opt = ref()
            if opt is not None:
                opt._mlf_start_unstarted()


@contextlib.contextmanager
def own_calls():
    """Calls issued inside start no optimizer's unstarted buckets: those of start_unstarted
    itself, and a DistributedOptimizer's synchronize() starting its own buckets before its
    last (which buckets its hooks started before may differ between ranks; they must all be
    issued before another optimizer's are)."""
    global _flushing
    outer, _flushing = _flushing, True
    try:
        yield
    finally:
        _flushing = outer


def reject_call(process_set, what, async_):
    """reject() on process_set's ranks, where this rank can tell which they are: when
    process_set is not a ProcessSet at all, the global set's (the call can only have been meant
    for a set this rank knows nothing of, and a peer calling on the global set hears of it); an
    unregistered set, or one without this rank, has no round to take part in."""
    try:
        st = state(process_set)
    except TypeError:
        st = state()
    except ValueError:
        return
    reject(st, what, async_)
