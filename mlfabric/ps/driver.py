"""One training job of any mode on this MPI job, the same loop for every mode so comparisons are
fair (paper §7): the same workers, the same emulated NICs and stragglers, the same updates. Used by
scripts/train.py, the benchmarks and the tests.

Parameter-server modes: each worker, each iteration, gets the model from every server (its shard,
§10.2), computes (the emulated compute time, then update_fn), and pushes its update's shards.
Allreduce modes (rr-sync, tr-sync): the workers keep the model themselves and sum their updates
with a ring or a binary-tree allreduce over the same paced data plane; the scheduler, server and
replica ranks sit the job out, so the worker count is the same as in the PS modes.

update_fn(worker_rank, iteration, model) -> update (already scaled by -learning rate). The default
is a seeded pseudo-gradient that does not depend on the model, so any mode's result can be checked
against a float64 sum of the same updates.
"""
import math
import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from . import api
from ..emulate import Emulation
from ..runtime.core import ALLREDUCE_MODES, Config
from ..runtime.ledger import Summary
from ..runtime.roles import WORKER, Roles


ASYNC_MODES = ("mlfabric-A", "async")   # the modes whose workers wait for nobody


def default_update(size, dtype, seed=0, lr=0.01):
    """The deterministic update of (worker rank, iteration): lr * N(0, 1) draws."""
    def update(rank, i, model):
        rng = np.random.default_rng([seed, rank, i])
        return (lr * rng.standard_normal(size)).astype(dtype)
    return update


def shards(size, servers):
    """(start, stop) of each server's part of a model of `size` elements (§10.2)."""
    cut = np.linspace(0, size, servers + 1).round().astype(int)
    return [(int(cut[k]), int(cut[k + 1])) for k in range(servers)]


@dataclass
class JobResult:
    role: str
    summary: Summary = None
    model: np.ndarray = None          # server/replica: its shard; worker: the last model it got
    wall: float = 0.0                 # seconds of this rank's training loop
    iter_times: list = field(default_factory=list)   # worker: seconds per iteration
    applied_log: list = field(default_factory=list)  # server/replica: (ids, version, job time)


def run_job(mode="mlfabric-A", *, size=1000, iterations=10, compute_s=0.0, dtype=np.float64,
            emulation=None, tau_max=math.inf, div_max=math.inf, servers=1, replicas=0,
            aggregators=None, batch_interval=0.1, t_lag=0.2, slack=2, seed=0, update_fn=None,
            model0=None, comm=None, duration_s=None, **settings):
    """Run one job on every rank of `comm` (default COMM_WORLD); returns this rank's JobResult.
    `settings` go to mlfabric.ps.init (distribution, checkpoint_every, checkpoint_dir, resume).

    duration_s (asynchronous modes, mlfabric-A and async, only): a worker also stops after the
    first iteration that ends duration_s or more after the job's start, so workers run for a
    time rather than a quota: in asynchronous training a fast worker does not idle while a
    slow one finishes its share (iterations still caps every worker)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    if duration_s is not None:
        if mode not in ASYNC_MODES:
            raise ValueError("duration_s is for the asynchronous modes (mlfabric-A, async): a "
                             "%r job's workers must run the same iterations" % (mode,))
        if not duration_s > 0:
            raise ValueError("duration_s must be > 0 seconds, got %r" % (duration_s,))
    emulation = emulation or Emulation()
    update_fn = update_fn or default_update(size, dtype, seed)
    model0 = np.zeros(size, dtype) if model0 is None else np.asarray(model0, dtype)
    if mode in ALLREDUCE_MODES:
        Config(mode=mode, emulation=emulation)  # the same checks as the PS modes
        return _allreduce_job(mode, comm, size, iterations, compute_s, emulation, servers,
                              replicas, update_fn, model0)
    role = api.init(mode, servers=servers, replicas=replicas, aggregators=aggregators,
                    batch_interval=batch_interval, t_lag=t_lag, slack=slack,
                    emulation=emulation, seed=seed, comm=comm, **settings)
    roles = Roles(comm.size, servers, replicas)
    cuts = shards(size, servers)
    res = JobResult(role)
    t0 = time.monotonic()
    if role == WORKER:
        api.register_as_worker(tau_max=tau_max, div_max=div_max)
        w = roles.worker_index(comm.rank)
        ctrace = emulation.compute_trace(len(roles.worker_ranks), compute_s) if compute_s else None
        model = model0.copy()
        stop = math.inf if duration_s is None else t0 + duration_s
        for i in range(iterations):
            ti = time.monotonic()
            if ti >= stop:
                break
            for s, (a, b) in zip(roles.server_ranks, cuts):
                model[a:b] = api.get(s)[0]
            if ctrace is not None:
                time.sleep(ctrace.time(w, i))
            u = np.asarray(update_fn(comm.rank, i, model), dtype)
            for s, (a, b) in zip(roles.server_ranks, cuts):
                api.push(s, u[a:b])
            res.iter_times.append(time.monotonic() - ti)
        res.wall = time.monotonic() - t0
        res.summary = api.finish()
        res.model = model
    elif role == "server":
        k = roles.server_ranks.index(comm.rank)
        a, b = cuts[k]
        api.register_as_server(model0[a:b].copy())
        res.summary = api.serve()
        res.model, res.applied_log = api.local_model(), api.applied_log()
        res.wall = time.monotonic() - t0
    elif role == "replica":
        api.register_as_replica(roles.server_of(comm.rank))
        res.summary = api.serve()
        res.model, res.applied_log = api.local_model(), api.applied_log()
        res.wall = time.monotonic() - t0
    else:
        res.summary = api.serve()
        res.wall = time.monotonic() - t0
    return res


def _allreduce_job(mode, comm, size, iterations, compute_s, emulation, servers, replicas,
                   update_fn, model0):
    from ..runtime.dataplane import DataPlane
    from .allreduce_baselines import ring_allreduce, tree_allreduce
    roles = Roles(comm.size, servers, replicas)
    workers = roles.worker_ranks
    data = comm.Dup()
    t0_job = comm.bcast(time.monotonic() if comm.rank == 0 else None, root=0)
    res = JobResult(roles.role(comm.rank))
    w = roles.worker_index(comm.rank)
    if w is not None:
        nic = emulation.nic(w, len(workers), t0_job)
        dp = DataPlane(data, nic)
        reduce = ring_allreduce if mode == "rr-sync" else tree_allreduce
        ctrace = emulation.compute_trace(len(workers), compute_s) if compute_s else None
        model = model0.copy()
        t0 = time.monotonic()
        for i in range(iterations):
            ti = time.monotonic()
            if ctrace is not None:
                time.sleep(ctrace.time(w, i))
            u = np.array(update_fn(comm.rank, i, model), model.dtype)
            reduce(dp, workers, u)
            model += u
            res.iter_times.append(time.monotonic() - ti)
        res.wall = time.monotonic() - t0
        res.model = model
        dp.close()
    n = len(workers) * iterations
    res.summary = Summary(pushed=n, applied=n, aggregated=0, replicated=0, dropped={},
                          max_delay=0, balanced=True, missing=[], twice=[])
    comm.Barrier()
    data.Free()
    return res
