"""Process-wide state between init() and finalize(): the communicator mlfabric works on, the
host-local communicator, the shared-memory transport (when all ranks share one host) and the
executor that orders blocking and non-blocking calls. Owns init/finalize; whether a context is
still usable (a rank gives up on it after a timeout or a failure inside a call, and tells its
peers: comm/abort.py); the guard against calls entering from two threads at once; and which
context a thread works in: the process-wide one, or for the duration of using(ctx) another one
made on a sub-communicator (mlfabric.torch's process sets, the torch backend's subgroups), so
that every collective called inside runs on that communicator without each taking a context
argument."""
import atexit
import contextlib
import functools
import threading
import time

import numpy as np
from mpi4py import MPI

from .._core import config as _config, exit_guard
from .._core import log as _log
from . import launch, respawn
from .abort import AbortChannel
from .executor import Executor
from ..errors import ConcurrentCallError, MlfabricError, NotInitializedError, PeerTimeoutError

_ctx = None
_lock = threading.Lock()


class _ThreadContext(threading.local):
    # A class attribute, so reading it where no context was put in force finds None without
    # raising inside (getattr(local, "ctx", None) cost ~0.6 us here, on every collective).
    ctx = None  # the context using() put in force on this thread


_local = _ThreadContext()
# True once a context on a sub-communicator exists (sub_context()): only then can a thread have
# another context in force, so until then get() and allreduce's direct path skip the
# thread-local read (~0.1 us, a twentieth of a small allreduce's latency here).
_subs = False
# (request, buffers) of exit agreements given up on (close()): MPI may still write into them
_parked = []


class Context:
    def __init__(self, comm):
        # Private duplicates: mlfabric's traffic never matches the user's own messages.
        self.user_comm = comm
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.rank, self.comm.size
        try:
            _check_same_settings(self.comm)
        except MlfabricError:
            self.comm.Free()
            raise
        # close()'s agreement only: a collective a timeout left unfinished on self.comm would
        # be matched against it
        self.exit_comm = self.comm.Dup()
        # and the abort notices, point-to-point there (a tag of their own)
        self.abort = AbortChannel(self.exit_comm)
        self.failure = None  # why this rank gave up on the context (see fail()); None: usable
        # held by the call in progress (see enter()); `running` names it for the error
        self.busy = threading.Lock()
        self.running = None
        self.node_comm = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = self.node_comm.rank, self.node_comm.size
        # Every rank's place on its host, once: one host for everyone (then every collective
        # can go through shared memory); the cross-host ranks (Horovod's cross_rank / cross_size:
        # the ranks with the same local rank, one per host, in rank order); whether every host
        # runs as many ranks.
        places = self.comm.allgather((self.local_rank, self.local_size))
        self.single_host = all(ls == self.size for _, ls in places)
        peers = [q for q, (lr, _) in enumerate(places) if lr == self.local_rank]
        self.cross_rank, self.cross_size = peers.index(self.rank), len(peers)
        self.homogeneous = len({ls for _, ls in places}) == 1
        self.shm = None
        if self.single_host and _config.shm_enabled():
            from .shm import open_transport
            self.shm = open_transport(self.node_comm)  # None where /dev/shm has no room
        # its thread works in this context (not the process-wide one: see using())
        self.executor = Executor(thread_init=functools.partial(setattr, _local, "ctx", self))
        self.plain_plans = {}  # (kind, dtype, shape, op) -> plan of a direct-path call
        self.nccl = None  # comm/nccl.py's Communicator, made at the first GPU collective
        # called before the shared memory goes: owners of long-lived shared buffers that users
        # can still reach (DistributedOptimizer's gradient buckets) move them to private memory
        self.on_close = []
        self.abandoned = False  # set when peers are known dead (elastic reset): see broken()

    def close(self):
        """Free what the context holds when every rank closes it in step; True if it did."""
        self.executor.shutdown()
        if self.nccl is not None:
            self.nccl.close()  # not collective: an aborted one is not destroyed again
        if self._out_of_step():
            # Freeing windows and communicators is collective: it would wait forever on a peer
            # that never frees them (it timed out, or raised before a collective and is waiting
            # in its own free). MPI_Finalize may likewise wait on a peer that never gets there.
            exit_guard.out_of_step()
            return False
        for fn in self.on_close:
            fn()
        if self.shm is not None:
            self.shm.close()
        self.node_comm.Free()
        self.exit_comm.Free()
        self.comm.Free()
        return True

    def _out_of_step(self):
        """Whether some rank closes this context out of step with the others: it timed out
        (broken()), or an exception went uncaught there (its peers may be waiting for it in a
        collective, and time out: a rank that raised before a collective must not wait for them
        in a free, nor they for it). Every rank gets the same answer when all of them get here:
        one MAX reduction, on which an out-of-step rank waits at most MLFABRIC_TIMEOUT (its peers
        are told it gave up, see fail(), and come as soon as they are done); a rank in step waits
        as long as it takes (a peer may legitimately still be working), as in the collective
        frees it used to go straight to, unless a peer's notice comes meanwhile (then the wait is
        bounded as an out-of-step rank's: the peer may exit before the reduction completes).

        Not MPI_Abort on an uncaught exception (as `python -m mpi4py` does): it would kill the
        peers before they report anything, and it would end elastic jobs whose survivors are
        meant to go on without the failed rank (torch.elastic, ULFM)."""
        if self.size == 1:
            return self.broken()
        if self.abandoned or _has_failed(self.comm):
            return True  # a member is dead (abandoned: the elastic reset's): nothing can finish
        mine = int(self.broken() or self.peer_failure() is not None or exit_guard.uncaught())
        send, recv = np.array([mine], np.int32), np.zeros(1, np.int32)
        try:
            req = self.exit_comm.Iallreduce(send, recv, op=MPI.MAX)
            deadline = time.monotonic() + _config.timeout_s() if mine else None
            pause = 1e-4
            while not req.Test():
                now = time.monotonic()
                if deadline is None and self.peer_failure() is not None:
                    deadline = now + _config.timeout_s()
                if deadline is not None and now > deadline:
                    _parked.append((req, send, recv))
                    return True
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
        except MPI.Exception:  # e.g. ULFM's MPI_ERR_PROC_FAILED: a peer is dead
            return True
        return bool(recv[0])

    def enter(self, what):
        """Start call `what` on this context: raise if it is unusable (this rank gave up on it, or
        a peer's notice says the peer did) or if another thread is inside a call on it; else
        hold it (leave() lets go). Every call must enter, on whichever thread runs it."""
        self.check(what)
        if not self.busy.acquire(blocking=False):
            other = self.running
            exc = ConcurrentCallError(
                f"{what}: called while another thread is inside {other} on the same communicator."
                " Calls on one communicator must come from one thread at a time (the ranks would "
                "pair different calls); use the non-blocking forms from one thread, or one "
                "communicator per thread. The communicator is unusable now.")
            self.fail(what, exc)
            raise exc
        self.running = what

    def check(self, what):
        """Raise PeerTimeoutError if the context is unusable: this rank gave up on it, or a peer
        did (see peer_failure())."""
        if self.failure is not None:
            raise PeerTimeoutError(f"{what}: this communicator is unusable since an earlier call "
                                   f"failed ({self.failure})")
        why = self.peer_failure()
        if why is not None:
            self.fail(what, why)
            raise PeerTimeoutError(f"{what}: {why}. The communicator is unusable now.")

    def leave(self):
        """Let go of the context after a call enter() started (however it ended)."""
        self.running = None
        self.busy.release()

    def confirm(self, what):
        """Raise instead of returning the result of call `what` (ended, left) when the context
        became unusable during it: on the MPI path a peer's notice that came meanwhile (the
        result may pair with a call the peer abandoned), or a failure another thread recorded
        meanwhile (a concurrent call: see enter())."""
        if self.failure is None and self.shm is None:
            why = self.abort.heard()
            if why is not None:
                self.fail(what, why)
        if self.failure is not None:
            raise PeerTimeoutError(f"{what}: not a result: the communicator became unusable "
                                   f"during the call ({self.failure})")

    def fail(self, what, why):
        """Give up on this context after call `what` ended out of step with the peers (`why`: an
        exception or a reason): every later call on this rank fails at once, and the peers are
        told (an abort notice over MPI; on one host the engine's failed mark), so that none
        pairs its messages with a call abandoned here. Idempotent: the first reason stays."""
        if self.failure is not None:
            return
        # peers see a timeout where this rank timed out or heard of a peer that gave up,
        # another failure where this rank failed otherwise (it names this rank's error)
        timeout = not isinstance(why, BaseException) or isinstance(why, PeerTimeoutError)
        if isinstance(why, BaseException):
            why = f"{what}: {type(why).__name__}: {why}"
        self.failure = str(why).replace(" The communicator is unusable now.", "")[:500]
        if self.shm is not None:
            self.shm.engine.abandon(2 if timeout else 3)
        self.abort.tell(self.failure)

    def peer_failure(self):
        """Why the context became unusable (a peer gave up on it: on one host the engine's
        failed mark, else its notice), or None: asked as a call starts, and polled by
        comm/p2p.py's waits under watch()."""
        if self.shm is not None:
            engine = self.shm.engine
            if not engine.any_failed:  # (this rank's own mark included)
                return None
            if engine.broken:
                return "this rank's shared-memory engine gave up in an earlier call"
            return "a peer gave up on the communicator (see the error on that rank)"
        return self.abort.heard()

    def broken(self):
        """True after a timeout or engine failure: peers may be gone, so nothing collective."""
        from . import p2p
        return bool(self.abandoned or self.failure is not None
                    or (self.shm is not None and self.shm.engine.any_failed)
                    or p2p.abandoned()
                    or (self.nccl is not None and self.nccl.failed not in (None, "closed")))


def _has_failed(comm):
    """Whether ULFM knows a member of comm has died (False without ULFM)."""
    try:
        return comm.Get_failed().Get_size() > 0
    except (AttributeError, NotImplementedError, MPI.Exception):
        return False


def _check_same_settings(comm):
    """MismatchError-like failure on every rank when ranks run with different settings (the
    values as read: unset and the default agree). A rank whose value is bad raises its own
    error, after the exchange, so its peers do not wait for it."""
    mine = _config.shaping_settings(comm.size)
    every = comm.allgather(mine)
    for name, value in mine:
        if _config.is_error(value):
            raise MlfabricError(f"init: {value[len('error: '):]}")
    bad = {r: [v for _, v in s if _config.is_error(v)] for r, s in enumerate(every)}
    bad = {r: errors for r, errors in bad.items() if errors}
    if bad:  # the peers of a rank with a bad value fail with it, instead of waiting for it
        r, errors = next(iter(bad.items()))
        raise MlfabricError(f"init: rank(s) {sorted(bad)} have a bad setting (rank {r}: "
                            f"{errors[0][len('error: '):]})")
    for i, name in enumerate(_config.SHAPING):
        values = {}
        for r, s in enumerate(every):
            values.setdefault(s[i][1], []).append(r)
        if len(values) > 1:
            parts = "; ".join(f"{v!r} on rank(s) {ranks}" for v, ranks in values.items())
            raise MlfabricError(f"init: ranks disagree on {name}: {parts}; every rank must use "
                                "the same value")


def init(comm=None, *, _torch_env=True):
    """Initialise mlfabric on `comm` (default MPI.COMM_WORLD; in a process spawned to replace a
    dead rank, the survivors' communicator: see respawn.py). Collective over comm.

    A process started by a launcher MPI does not see (torchrun, srun without PMI wiring) is
    refused with an error saying how to launch (launch.py). On MPI.COMM_WORLD under mpirun,
    torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) are set where unset (_torch_env=False: not; the torch backend's own init).

    Calling init() again with the same communicator is a no-op; with another one it is an error
    (finalize() first)."""
    global _ctx
    with _lock:
        launch.check_launch(MPI.COMM_WORLD.size, spawned=MPI.Comm.Get_parent() != MPI.COMM_NULL)
        if comm is None:  # a replacement for a dead rank joins the survivors (respawn.py)
            comm = respawn.join() or MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise MlfabricError(f"init(comm=...) needs an mpi4py intracommunicator, got {comm!r}")
        if _ctx is not None:
            if MPI.Comm.Compare(_ctx.user_comm, comm) in (MPI.IDENT, MPI.CONGRUENT):
                return
            raise MlfabricError("mlfabric is already initialised on another communicator; "
                                "call finalize() first")
        _ctx = Context(comm)
        _log.init(_ctx.rank)  # the mlfabric logger, and a warning for misspelled MLFABRIC_*
        if _torch_env and MPI.Comm.Compare(comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):
            launch.export_torch_env(_ctx)


def finalize():
    """Finish pending non-blocking calls and free mlfabric's communicators and shared memory.
    Collective. Arrays from shared_empty() must not be used afterwards."""
    global _ctx, _subs
    with _lock:
        if _ctx is None or MPI.Is_finalized():
            _ctx = None
            return
        ctx, _ctx = _ctx, None
        ctx.close()
        _subs = False  # closed with it (their owners free them first)


def initialized():
    return _ctx is not None


def get():
    """The context in force on this thread (see using()), or NotInitializedError."""
    if _subs:
        ctx = _local.ctx
        if ctx is not None:
            return ctx
    if _ctx is None:
        raise NotInitializedError("mlfabric is not initialised: call mlfabric.init() first")
    return _ctx


def sub_context(comm):
    """A Context on comm, a communicator of some of the process-wide context's ranks, for
    using(): mlfabric.torch's process sets and the torch backend's subgroups."""
    global _subs
    _subs = True
    return Context(comm)


def close_sub_context(ctx):
    """Close a sub_context() and free the communicator it was made on (collective over its
    ranks; skipped when they close it out of step: a dead member would hold the free up)."""
    if ctx.close():
        ctx.user_comm.Free()


@contextlib.contextmanager
def using(ctx):
    """Run the body with get() returning ctx on this thread (nested uses restore the outer)."""
    outer = _local.ctx
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = outer


atexit.register(finalize)
