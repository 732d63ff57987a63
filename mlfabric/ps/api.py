"""The parameter-server API of the paper's Table 1, with Python names (the paper's names are kept
as aliases in mlfabric.ps):

  every rank      init(mode=..., servers=..., replicas=..., emulation=...)  -> this rank's role
  worker          register_as_worker(tau_max=, div_max=); push(server, update, update_norm=None);
                  get(server) -> (model, version); dropped() -> [(id, reason)]; finish() -> Summary
  server          register_as_server(model); on_update(fn); on_request(fn); serve() -> Summary
  replica         register_as_replica(server); on_update(fn); serve() -> Summary
  scheduler       serve() -> Summary

register_as_* is collective: every rank calls its role's one (the scheduler rank calls serve()),
and it checks that all ranks agree on the config and on their roles. Everything is bounded by
MLFABRIC_TIMEOUT seconds.
"""
import math
import time

import numpy as np
from mpi4py import MPI

from .._core import config as _config, exit_guard
from .. import kernels
from ..errors import MismatchError, MlfabricError, NotInitializedError, PeerTimeoutError
from ..runtime.core import Config, Runtime
from ..runtime.roles import REPLICA, SCHEDULER, SERVER, WORKER, Roles

# Control and data communicators of jobs that ended with a failed or hung peer: never freed, so
# that Open MPI never reuses their context ids for a later job's (messages may be left on them).
_KEPT = []
_state = {"config": None, "comm": None, "rt": None, "role": None, "pushes": {}, "versions": {},
          "next_id": 0, "handler": None}  # handler: the role object serve() drives


def init(mode="mlfabric-A", *, servers=1, replicas=0, aggregators=None, batch_interval=0.1,
         t_lag=0.2, slack=2, gamma=0.0, emulation=None, seed=0, distribution=True,
         cut_through=True, pull_objective=None, slow_drop=True, pull_admission=True,
         checkpoint_every=0,
         checkpoint_dir=None, resume=False, applied_log_max=100_000, comm=None):
    """Set the job's configuration and return this rank's role: 'scheduler', 'server',
    'replica' or 'worker' (mlfabric.runtime.roles says which). mlfabric.runtime.Config documents
    every setting. Collective over comm (default: the world): a rank whose arguments are refused
    raises its error and every other rank a MismatchError naming it (see agree_to_start)."""
    from ..emulate import Emulation
    try:
        old = _state["rt"]
        if old is not None:
            if old.error is None:
                raise MlfabricError("mlfabric.ps is already running; init() once per job")
            # the last job failed (its error reached this rank): it is over, a new one may start
            if old.daemon is not None:
                old.daemon.join(timeout=5.0)
            _state.update(rt=None, handler=None)
        cfg = Config(mode=mode, servers=servers, replicas=replicas, aggregators=aggregators,
                     batch_interval=batch_interval, t_lag=t_lag, slack=slack, gamma=gamma,
                     emulation=emulation if emulation is not None else Emulation(), seed=seed,
                     distribution=distribution, cut_through=cut_through,
                     pull_objective=pull_objective, slow_drop=slow_drop,
                     pull_admission=pull_admission,
                     applied_log_max=applied_log_max,
                     checkpoint_every=checkpoint_every,
                     checkpoint_dir=checkpoint_dir, resume=resume)
        if comm is not None and not isinstance(comm, MPI.Intracomm):
            raise TypeError("comm must be an MPI intracommunicator, got %r" % (comm,))
        comm = MPI.COMM_WORLD if comm is None else comm
        roles = Roles(comm.size, cfg.servers, cfg.replicas)
    except Exception as exc:  # noqa: BLE001 - the others hear of any, then it is raised
        agree_to_start(comm, exc)
    agree_to_start(comm)
    # (a duplicate left by a job that never started or failed is dropped, not freed: a barrier of
    # its failed start-up may still be pending on it)
    # The job's own duplicate (collective, like MPI's own start-up): its start-up handshake then
    # never meets the user's collectives, even when it fails half way
    _state.update(config=cfg, comm=comm.Dup(), role=roles.role(comm.rank), dropped=None)
    return _state["role"]


def agree_to_start(comm, error=None):
    """The ranks of comm (the world's when comm is not a communicator: it can only have been
    meant for ranks this one cannot name) agree to start a job: one allgather of refusals.
    Raises error on a rank that passes one, a MismatchError naming those ranks on the others.
    Before init() duplicates comm (MPI's own collective, with no timeout): a rank that raised
    before it would leave the others waiting there forever. Bounded by MLFABRIC_TIMEOUT, as
    every wait of mlfabric.ps: a rank calling init() alone (a second time, or where the others
    never do) gets a PeerTimeoutError, not a hang."""
    comm = comm if isinstance(comm, MPI.Intracomm) else MPI.COMM_WORLD
    mine = np.array([error is not None], np.uint8)
    every = np.zeros(comm.size, np.uint8)
    req = comm.Iallgather(mine, every)
    limit = _config.timeout_s()
    end = time.monotonic() + limit
    while not req.Test():
        if time.monotonic() > end:
            # the allgather stays pending on comm (MPI cannot cancel a collective): no later
            # collective on comm can match its peers', and MPI_Finalize may wait for them
            exit_guard.out_of_step()
            raise PeerTimeoutError(
                "mlfabric.ps.init: not every rank of its communicator (%d ranks) called init() "
                "within MLFABRIC_TIMEOUT=%gs (init() is collective: every rank calls it, once "
                "per job); the communicator is left with a pending collective"
                % (comm.size, limit)) from error
        time.sleep(0.001)
    if error is not None:
        raise error
    refused = np.flatnonzero(every).tolist()
    if refused:
        raise MismatchError("ps.init: rank(s) %s refused their arguments (see the error on those "
                            "ranks); no job was started" % refused)


def role():
    if _state["role"] is None:
        raise NotInitializedError("call mlfabric.ps.init() first")
    return _state["role"]


def _start(as_role, info):
    if _state["config"] is None:
        init()
    if _state["rt"] is not None:
        raise MlfabricError("this rank has already registered (as %s)" % _state["rt"].role)
    if _state["role"] != as_role:
        raise MlfabricError("rank %d is the %s (%s), not a %s: call the %s's register function"
                            % (_state["comm"].rank, _state["role"],
                               Roles(_state["comm"].size, _state["config"].servers,
                                     _state["config"].replicas).describe(), as_role,
                               _state["role"]))
    info = dict(info, role=as_role)
    rt = Runtime(_state["comm"], _state["config"], info)
    _state["rt"] = rt
    return rt


def _running(as_role, call):
    rt = _state["rt"]
    if rt is None:
        raise NotInitializedError("%s: register first (this rank is %s; call register_as_%s)"
                                  % (call, _state["role"] or "not initialised", as_role))
    if rt.role != as_role:
        raise MlfabricError("%s is a %s call; rank %d is the %s"
                            % (call, as_role, rt.rank, rt.role))
    if rt.error is not None:
        raise rt.error
    return rt


def _launch(rt, role):
    from ..runtime.daemon import Daemon
    rt.daemon = Daemon(rt, role)
    rt.daemon.start()


# --- worker ---------------------------------------------------------------------------------------
def register_as_worker(tau_max=math.inf, div_max=math.inf):
    """Join as a worker. tau_max: the largest delay an applied update may have (mlfabric-A;
    delays count from 1, a lone worker's update taking the model one version past the one it
    was computed from, so a tau_max below 1 drops every update: the tests use that);
    div_max: the largest server-replica divergence the job tolerates (with replicas)."""
    from ..runtime.worker import WorkerRole
    # (checked in the start-up's agreement, so that a bad value fails every rank at once)
    rt = _start(WORKER, {"tau_max": _number(tau_max), "div_max": _number(div_max)})
    _state["pushes"] = {s: 0 for s in rt.roles.server_ranks}
    _state["versions"] = {s: 0 for s in rt.roles.server_ranks}
    _state["next_id"] = 0  # ids are (rank << 32) | n: unique within the job
    _state["allreduce_calls"] = 0
    role_obj = WorkerRole(rt)
    _state["dropped"] = role_obj.dropped   # readable after finish() too (late notices)
    _launch(rt, role_obj)


def _number(value):
    """value as a float, or as it is when it is not a real number (the agreement refuses it)."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return float(value)
    return value


def _check_server(rt, server, call):
    if server not in rt.roles.server_ranks:
        raise MlfabricError("%s: %r is not a server; the servers are ranks %s"
                            % (call, server, rt.roles.server_ranks))


def push(server, update, update_norm=None):
    """Hand `update` (a numpy array shaped and typed like the server's model, already scaled by
    -learning rate) to the daemon for `server`; returns its update id at once. The update is copied;
    its L2 norm is computed by the C++ kernel unless given (the replica bound needs it)."""
    from ..runtime.worker import check_update
    rt = _running(WORKER, "push")
    _check_server(rt, server, "push")
    shape, dtype = rt.spec(server)
    check_update(update, shape, dtype, server)
    payload = np.array(update, copy=True, order="C")
    norm = kernels.norm2(payload.reshape(-1)) if update_norm is None else float(update_norm)
    if not norm >= 0:
        raise MlfabricError("push: update_norm must be a number >= 0, got %r" % (update_norm,))
    uid = (rt.rank << 32) | _state["next_id"]
    _state["next_id"] += 1
    _state["pushes"][server] += 1
    rt.submit("push", uid, server, payload, _state["versions"][server], norm)
    return uid


def get(server):
    """The server's model and its version: (array, version). In mlfabric-S it waits for the
    iteration this worker last pushed to; in SSP for the slowest worker to be within the slack."""
    from ..runtime.core import Future
    rt = _running(WORKER, "get")
    _check_server(rt, server, "get")
    fut = Future("get(%d)" % server)
    rt.submit("get", fut, server, _state["pushes"][server])
    model, version = fut.wait()
    _state["versions"][server] = version
    shape, _ = rt.spec(server)
    return model.reshape(shape), version


def dropped():
    """Worker: [(update id, reason), ...] of this worker's pushed updates that the scheduler
    dropped since the last call (stale beyond tau_max, no path, a failure...), as it learns of
    them. Training whose updates are state rather than gradients (LDA's topic counts) re-pushes
    them, folded into a later update; gradient training may ignore them. After finish(), the
    notices that came last."""
    q = _state.get("dropped")
    if q is None:
        raise NotInitializedError("dropped(): register_as_worker() first")
    out = []
    while q:
        out.append(q.popleft())
    return out


def allreduce(update):
    """The sum of `update` over all workers, on every worker (the paper's AllReduce, §6): pushed
    to a root worker drawn for this call (the same on every worker), summed there with aggregation
    planned by the scheduler, and sent back through a distribution tree. Collective over the
    workers, which call it in the same order with the same shape and dtype. Returns a new array."""
    from ..runtime.core import Future
    rt = _running(WORKER, "allreduce")
    if not isinstance(update, np.ndarray) or update.dtype.kind != "f":
        raise TypeError("allreduce: update must be a floating numpy array, got %r"
                        % (type(update).__name__ if not isinstance(update, np.ndarray)
                           else update.dtype))
    workers = [w for w in rt.roles.worker_ranks if w not in rt.failed]
    k = _state["allreduce_calls"]
    _state["allreduce_calls"] += 1
    rng = np.random.default_rng([rt.config.seed, 0xA11, k])
    root = workers[int(rng.integers(len(workers)))]
    fut = Future("allreduce call %d (root rank %d)" % (k, root))
    rt.submit("allreduce", fut, k, root, np.array(update, copy=True, order="C"), workers)
    return fut.wait().reshape(update.shape)


def finish():
    """This worker is done: wait (bounded) for the job to end; returns the job's Summary."""
    rt = _running(WORKER, "finish")
    rt.submit("finish")
    return _end(rt)


def _end(rt):
    try:
        summary = _wait_for_summary(rt)
    except PeerTimeoutError as e:
        role_obj = rt.daemon.role if rt.daemon is not None else None
        why = getattr(role_obj, "waiting_for", None)
        if why is None:
            raise
        raise PeerTimeoutError("%s; the scheduler was waiting for: %s" % (e, why())) from None
    finally:
        rt.daemon.join(timeout=5.0)
        _state["rt"] = None
        _state["config"] = None
    # everyone has the summary: the job's communicators can go (collective, so only now)
    rt.dp.close(timeout=5.0)
    if not rt.failed and not rt.daemon.is_alive() and rt.channel.close(_config.timeout_s()):
        rt.ctrl.Free()
        rt.data.Free()
    else:  # a peer failed or hangs: messages may be left on them (see control.py), keep them
        _KEPT.extend((rt.ctrl, rt.data))
    rt.comm.Free()
    _state["comm"] = None
    return summary


def _wait_for_summary(rt):
    """The job's summary, however long the job lasts, as long as it is alive: this rank's daemon
    turns, and (not at the scheduler) the scheduler's liveness messages keep coming (the
    scheduler checks every other rank the same way). Silence for MLFABRIC_TIMEOUT is an error."""
    limit = _config.timeout_s()
    while True:
        try:
            return rt.summary.wait(timeout=min(limit, 1.0))
        except PeerTimeoutError:
            if rt.summary.done():   # it ended in the meantime (or failed: its own error)
                return rt.summary.wait(timeout=0)
        now = time.monotonic()
        stalled = now - rt.daemon.last_turn
        silent = rt.rank != 0 and now - rt.channel.heard[0] > limit
        # the scheduler's messages come through this rank's daemon: silence while the daemon
        # has not turned for a while says this rank is stuck, not the scheduler
        if not rt.daemon.is_alive() or stalled > limit or (silent and stalled > limit / 2):
            raise PeerTimeoutError("rank %d: the end of the job did not come and this rank's "
                                   "daemon has stopped turning (MLFABRIC_TIMEOUT=%g s)"
                                   % (rt.rank, limit))
        if silent:
            raise PeerTimeoutError("rank %d: the end of the job did not come and the scheduler "
                                   "(rank 0) has sent nothing for %.0f s (MLFABRIC_TIMEOUT=%g s)"
                                   % (rt.rank, now - rt.channel.heard[0], limit))


# --- server, replica, scheduler -------------------------------------------------------------------
def register_as_server(model, on_update=None, on_request=None):
    """Join as a server holding `model` (a numpy float array; the server updates it in place)."""
    if not isinstance(model, np.ndarray) or model.dtype.kind != "f":
        raise TypeError("register_as_server: model must be a floating numpy array, got %r"
                        % (type(model).__name__ if not isinstance(model, np.ndarray)
                           else model.dtype))
    from ..runtime.server import ServerRole
    from ..runtime import checkpoint
    model = np.ascontiguousarray(model)
    cfg = _state["config"]
    version = 0
    if cfg is not None and cfg.resume:
        got = checkpoint.load(cfg.checkpoint_dir, _state["comm"].rank)
        if got is not None:
            saved, version = got
            if saved.shape != model.shape or saved.dtype != model.dtype:
                raise MlfabricError("resume: the checkpoint in %s holds a %s %s model, this server "
                                    "registered %s %s" % (cfg.checkpoint_dir, saved.dtype,
                                                          saved.shape, model.dtype, model.shape))
            model[...] = saved
    rt = _start(SERVER, {"shape": model.shape, "dtype": model.dtype.str, "version": version})
    _state["handler"] = ServerRole(rt, model, on_update, on_request, version=version)


def on_update(fn):
    """Server or replica: fn(model, update, ids) applies an update (or an aggregate: ids lists its
    members in order) to the model in place. Default: model += update. Call before serve()."""
    role_obj = _state["handler"]
    if role_obj is None or _state["rt"].daemon is not None:
        raise MlfabricError("on_update: register as a server or replica first, and call it "
                            "before serve()")
    role_obj.apply_fn = fn
    return fn


def on_request(fn):
    """Server: fn(model, version) returns what get() delivers (default: the model). Call it
    before serve()."""
    role_obj = _state["handler"]
    if role_obj is None or _state["rt"].daemon is not None or _state["rt"].role != SERVER:
        raise MlfabricError("on_request: register as a server first, and call it before serve()")
    role_obj.request_fn = fn
    return fn


def register_as_replica(server, on_update=None):
    """Join as the replica of server rank `server`: it applies the server's updates in the
    server's order, at most div_max (the workers' setting) behind."""
    from ..runtime.replica import ReplicaRole
    rt = _start(REPLICA, {"server": server})
    _state["handler"] = ReplicaRole(rt, server, on_update)


def serve():
    """Server, replica or scheduler: run this rank's part until the job ends; returns the
    Summary."""
    if _state["rt"] is None and (_state["role"] in (None, SCHEDULER)):
        from ..runtime.scheduler import SchedulerRole
        rt = _start(SCHEDULER, {})
        _state["handler"] = SchedulerRole(rt)
    rt = _state["rt"]
    if rt is None:
        raise NotInitializedError("serve(): register first (this rank is the %s)" % _state["role"])
    if rt.role == WORKER:
        raise MlfabricError("serve() is for servers, replicas and the scheduler; a worker calls "
                            "finish()")
    role_obj = _state["handler"]
    _launch(rt, role_obj)
    try:
        return _end(rt)
    finally:
        _state["final_model"] = getattr(role_obj, "model", None)
        _state["applied_log"] = list(getattr(role_obj, "applied_log", []))
        _state["handler"] = None


def applied_log():
    """Server or replica, after serve(): [(ids, version or count after, job time), ...] in the
    order this rank applied them: the last applied_log_max commits (init's setting)."""
    return _state.get("applied_log", [])


def local_model():
    """Server or replica, after serve(): this rank's final model (the server's is also the array
    it registered, updated in place)."""
    return _state.get("final_model")
