"""Parameter-server training for PyTorch models on the mlfabric runtime (mlfabric.ps): the job's
roles, the server side (`serve_model`) and the worker side (`PSOptimizer`).

    role = ps_init("async")                   # every rank; rank 0 schedules, rank 1 serves
    model = build_model(seed=0)               # every rank builds the same initial model
    if role != "worker":
        summary = serve_model(model)          # server / replica / scheduler: until the job ends
    else:
        opt = PSOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(),
                          tau_max=4)
        for x, y in data:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        summary = opt.finish()

A worker's step() lets the wrapped optimizer step on its own copy of the model, pushes the change
(new - old parameters: an update already scaled by the learning rate, as push() expects) to the
server(s), and replaces its parameters with the server's model (get()). Any torch optimizer works,
and the PSOptimizer is one of its class (learning-rate schedulers, state_dict()); its state
(momentum, Adam moments) stays local to the worker. The flat model is sharded over the
servers as in mlfabric.ps.driver (§10.2).

Modes: "async" = mlfabric-A (scheduled, aggregated, updates staler than tau_max dropped), "sync" =
mlfabric-S (every worker's update of an iteration applied before anyone goes on), "ssp" (stale
synchronous, slack K), "vanilla" = a plain asynchronous parameter server (no scheduling). In sync
mode each worker's change is divided by the number of workers, so an iteration applies their
average, as data-parallel SGD would; in the asynchronous modes every update is applied as pushed.
"""
import inspect
import math

import numpy as np

from .. import ps
from ..errors import MlfabricError
from ..ps.driver import shards
from ..runtime.roles import Roles

MODES = {"async": "mlfabric-A", "sync": "mlfabric-S", "ssp": "ssp", "vanilla": "async"}

_job = {"mode": None, "roles": None, "servers": 1}


def ps_init(mode="async", *, servers=1, replicas=0, comm=None, **settings):
    """Start configuring a parameter-server job on every rank; returns this rank's role
    ('scheduler', 'server', 'replica' or 'worker'). `settings` go to mlfabric.ps.init
    (emulation, batch_interval, slack, gamma, seed, checkpoint_every, ...).

    Collective over `comm` (default: the world), as mlfabric.ps.init: a rank whose arguments
    are refused raises its error, and every other rank a MismatchError naming it."""
    from mpi4py import MPI
    try:  # what fails before mlfabric.ps.init's own checks: in its round all the same
        if not (isinstance(mode, str) and mode in MODES):
            raise ValueError("mode must be one of %s, got %r" % (", ".join(MODES), mode))
        inspect.signature(ps.init).bind(MODES[mode], servers=servers, replicas=replicas,
                                        comm=comm, **settings)  # a setting it has not
    except (TypeError, ValueError) as exc:
        ps.agree_to_start(comm, exc)
    role = ps.init(MODES[mode], servers=servers, replicas=replicas, comm=comm, **settings)
    comm = MPI.COMM_WORLD if comm is None else comm
    _job.update(mode=mode, roles=Roles(comm.size, servers, replicas), servers=servers,
                rank=comm.rank)
    return role


def _flat(params):
    params = list(params)
    if not params:
        raise ValueError("no parameters given")
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise TypeError("all parameters must share one dtype to travel as one model, got %s"
                        % sorted(str(d) for d in dtypes))
    if any(p.device.type != "cpu" for p in params):
        raise TypeError("the parameter-server runtime moves CPU tensors only")
    return params, _vector(params)


def _vector(params):
    """The parameters as one new flat numpy vector (their dtype)."""
    import torch
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1) for p in params]).numpy()


def _load(params, vec):
    import torch
    at = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(torch.from_numpy(vec[at:at + n]).view_as(p))
            at += n


def _started():
    if _job["roles"] is None:
        raise MlfabricError("call mlfabric.torch.ps_init(...) on every rank first")
    return _job["roles"]


def serve_model(model_or_params):
    """On a server, replica or the scheduler rank: take part until the job ends; returns the job's
    Summary. A server registers its shard of the model's initial parameters (every rank builds the
    same initial model); after the job, the server's shard holds the trained values, and
    `model_or_params` is updated with it on a single-server job."""
    roles = _started()
    role = ps.role()
    if role == "worker":
        raise MlfabricError("serve_model() is for servers, replicas and the scheduler; a worker "
                            "trains through PSOptimizer")
    params = model_or_params.parameters() if hasattr(model_or_params, "parameters") else \
        model_or_params
    if role == "server":
        params, vec = _flat(params)
        k = roles.server_ranks.index(_job["rank"])
        a, b = shards(vec.size, _job["servers"])[k]
        ps.register_as_server(vec[a:b].copy())
        summary = ps.serve()
        if _job["servers"] == 1:
            _load(params, ps.local_model())
        return summary
    if role == "replica":
        ps.register_as_replica(roles.server_of(_job["rank"]))
    return ps.serve()


class PSOptimizer:
    """Wraps a torch optimizer on a worker: step() = local step, push the change, pull the model.
    `params`: the parameters the wrapped optimizer updates (model.parameters()), in the same order
    on every rank. tau_max (mode async only) and div_max (with replicas) are the worker's
    registration.

    The object returned is a torch.optim.Optimizer of the wrapped optimizer's class, sharing its
    parameter groups and state (as DistributedOptimizer): learning-rate schedulers, state_dict()
    / load_state_dict() and zero_grad() work on it as on the wrapped optimizer."""

    def __new__(cls, optimizer, params, **kwargs):
        import torch
        if cls is not PSOptimizer or not isinstance(optimizer, torch.optim.Optimizer):
            return super().__new__(cls)  # (not an Optimizer: __init__ says so)
        mixed = type(type(optimizer).__name__, (PSOptimizer, type(optimizer)), {})
        return object.__new__(mixed)

    def __init__(self, optimizer, params, *, tau_max=math.inf, div_max=math.inf):
        import torch
        roles = _started()
        if ps.role() != "worker":
            raise MlfabricError("PSOptimizer is for worker ranks; this rank is the %s (it calls "
                                "serve_model)" % ps.role())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("PSOptimizer wraps a torch.optim.Optimizer, got %s"
                            % type(optimizer).__name__)
        self.__dict__.update(optimizer.__dict__)  # shares param_groups, state and hooks
        self.optimizer = optimizer
        self.params, vec = _flat(params)   # checked once: one dtype, CPU
        self.size, self.dtype = vec.size, vec.dtype
        self.cuts = shards(vec.size, _job["servers"])
        self.servers = roles.server_ranks
        self.scale = 1.0 / len(roles.worker_ranks) if _job["mode"] == "sync" else 1.0
        self.steps = 0
        ps.register_as_worker(tau_max=tau_max, div_max=div_max)
        self._pull()   # start from the server's model, whatever this rank built

    def _pull(self):
        vec = np.empty(self.size, self.dtype)
        for s, (a, b) in zip(self.servers, self.cuts):
            model, self.version = ps.get(s)
            if model.size != b - a:
                raise MlfabricError("server %d holds %d values, this worker's model shard has %d: "
                                    "the ranks built different models" % (s, model.size, b - a))
            vec[a:b] = model
        _load(self.params, vec)
        self.last = vec

    def step(self, closure=None):
        """One worker iteration: returns the closure's loss, if any."""
        loss = super().step(closure) if closure is not None else super().step()
        change = _vector(self.params) - self.last
        if self.scale != 1.0:
            change *= self.scale
        for s, (a, b) in zip(self.servers, self.cuts):
            ps.push(s, change[a:b])
        self.steps += 1
        self._pull()
        return loss

    # torch's Optimizer wraps a class's step() to run step hooks; the wrapped optimizer's own
    # step() (called above) already does, so this one is marked as done (as DistributedOptimizer)
    step.hooked = True

    def finish(self):
        """This worker is done: waits for the job's end and returns its Summary."""
        return ps.finish()
