"""The runtime of one rank between start() and the end of the job: its role, its communicators
(control and data, each a Dup of the world's), the job's settings, the clock shared with the
scheduler, and the queue through which the training thread hands work to the daemon thread.
Owns the start-up handshake and nothing else; the roles (worker.py, server.py, replica.py,
scheduler.py) own their behaviour and daemon.py the loop that drives them.
"""
import math
import queue
import threading
import time
from dataclasses import dataclass, field


from .._core import config as _config
from ..comm.wait import Backoff
from ..emulate import Emulation
from ..errors import MlfabricError, PeerTimeoutError
from ..sched.distribution import OBJECTIVES
from .control import Channel, clock_offsets
from .ledger import Ledger
from .roles import Roles

# Training modes that run on the parameter-server runtime, and what the scheduler does for each
# (mlfabric.sched modes). 'async' is the vanilla parameter server: no scheduler, no aggregation.
PS_MODES = {"mlfabric-A": "async", "mlfabric-S": "sync", "ssp": "ssp", "async": None}
# The MPI baselines: every worker keeps the model and allreduces gradients among workers.
ALLREDUCE_MODES = ("rr-sync", "tr-sync")
MODES = tuple(PS_MODES) + ALLREDUCE_MODES


@dataclass(frozen=True)
class Config:
    """A job's settings; every rank must pass the same (start() checks)."""
    mode: str = "mlfabric-A"
    servers: int = 1
    replicas: int = 0
    aggregators: int = None     # per server: how many workers aggregate (default: all workers)
    batch_interval: float = 0.1  # the scheduler batches ready updates this often (paper: 100 ms)
    t_lag: float = 0.2           # monitor report period (paper: 0.2 s)
    slack: int = 2               # SSP's K
    gamma: float = 0.0           # server momentum (eq. 2); the replica bound uses it
    distribution: bool = True    # answer simultaneous gets through distributors (§10.3)
    cut_through: bool = True     # relays and aggregates forward bytes as they come (worker.py)
    # a pull batch's tree (sched.distribute's objective): None = "fast-first" for the
    # asynchronous modes (a worker waits for its own copy; slow links pace theirs in any tree),
    # "makespan" (the paper's) for mlfabric-S (its workers wait for the batch's last)
    pull_objective: str = None
    # mlfabric-A: drop an update whose own link is slower than the next batch's (sched.scheduler)
    slow_drop: bool = True
    # mlfabric-A: a pull batch hands out a model only while the update computed from it can
    # still meet tau_max; the other requesters wait for a later batch; and (with slow_drop) a
    # worker whose uplink is slow is parked while one with a fast uplink pushes, since its
    # update would be dropped for it (runtime/pulls.py _admit)
    pull_admission: bool = True
    checkpoint_every: int = 0    # servers write model + version every this many updates (0: off)
    # the last commits a server / replica keeps for applied_log() (None: all, for benchmarks
    # that audit every one)
    applied_log_max: int = 100_000
    checkpoint_dir: str = None
    resume: bool = False         # servers start from their checkpoint in checkpoint_dir
    emulation: Emulation = field(default_factory=Emulation)
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise MlfabricError("unknown mode %r; known: %s" % (self.mode, ", ".join(MODES)))
        for name in ("batch_interval", "t_lag"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < math.inf):
                raise MlfabricError("%s must be a positive number of seconds, got %r" % (name, v))
        if self.pull_objective is None:
            object.__setattr__(self, "pull_objective",
                               "makespan" if self.mode == "mlfabric-S" else "fast-first")
        if self.pull_objective not in OBJECTIVES:
            raise MlfabricError("pull_objective must be one of %s, got %r"
                                % (", ".join(OBJECTIVES), self.pull_objective))
        if not (isinstance(self.slack, int) and self.slack >= 0):
            raise MlfabricError("slack must be an int >= 0, got %r" % (self.slack,))
        if not 0 <= self.gamma < 1:
            raise MlfabricError("gamma must be in [0, 1), got %r" % (self.gamma,))
        if self.gamma and self.mode != "mlfabric-S":
            raise MlfabricError("server momentum (gamma > 0) with per-update application needs "
                                "aggregates of two weighted sums, not built yet: use gamma=0 or "
                                "mode='mlfabric-S'")
        if self.replicas and self.mode not in ("mlfabric-A", "ssp"):
            raise MlfabricError("replicas follow the scheduler's plans (paper §5.3): they need "
                                "mode 'mlfabric-A' or 'ssp', not %r" % (self.mode,))
        if self.applied_log_max is not None and not (
                isinstance(self.applied_log_max, int) and self.applied_log_max >= 0):
            raise MlfabricError("applied_log_max must be an int >= 0 or None, got %r"
                                % (self.applied_log_max,))
        if not (isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0):
            raise MlfabricError("checkpoint_every must be an int >= 0, got %r"
                                % (self.checkpoint_every,))
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise MlfabricError("checkpoint_every / resume need checkpoint_dir")
        if not isinstance(self.emulation, Emulation):
            raise MlfabricError("emulation must be an mlfabric.emulate.Emulation, got %r"
                                % (self.emulation,))

    @property
    def sched_mode(self):
        return PS_MODES.get(self.mode)


class Future:
    """A result the daemon hands to the training thread (bounded wait)."""

    def __init__(self, what):
        self.what = what
        self._done = threading.Event()
        self._value = self._error = None

    def set(self, value):
        self._value = value
        self._done.set()

    def fail(self, error):
        if not self._done.is_set():
            self._error = error
            self._done.set()

    def done(self):
        return self._done.is_set()

    def wait(self, timeout=None):
        timeout = _config.timeout_s() if timeout is None else timeout
        if not self._done.wait(timeout):
            raise PeerTimeoutError("%s did not complete within %gs (MLFABRIC_TIMEOUT)"
                                   % (self.what, timeout))
        if self._error is not None:
            raise self._error
        return self._value


class Runtime:
    def __init__(self, comm, config, info):
        """Collective over comm: every rank passes the job's config and its role's registration
        info (a dict). Checks agreement, syncs clocks, sets up the channel and the data plane."""
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.config = config
        self.roles = Roles(self.size, config.servers, config.replicas)
        self.role = self.roles.role(self.rank)
        _bounded_barrier(comm)  # everyone is here: the collective calls below cannot hang
        self.ctrl = comm.Dup()
        self.data = comm.Dup()
        everyone = self.ctrl.allgather((config, info))
        _check_agreement(everyone, self.roles)
        self.infos = [i for _, i in everyone]
        self.offset = clock_offsets(self.ctrl)
        # the job's time 0: the scheduler's clock at the end of the handshake, told to everyone
        t0 = self.ctrl.bcast(time.monotonic() if self.rank == 0 else None, root=0)
        self.t0 = t0 - self.offset  # the same instant on this rank's clock
        self.channel = Channel(self.ctrl)
        workers = len(self.roles.worker_ranks)
        self.nic = config.emulation.nic(self.roles.worker_index(self.rank), workers, self.t0)
        from .dataplane import DataPlane
        self.dp = DataPlane(self.data, self.nic)
        self.ledger = Ledger()
        self.requests = queue.SimpleQueue()   # training thread -> daemon
        self.wakeup = threading.Event()
        self.error = None
        self.failed = set()                   # ranks known dead (ULFM)
        self.summary = Future("the end of the job (finish)")
        self.daemon = None

    # --- time: the scheduler plans in seconds since t0 on its clock ------------------------------
    def now(self):
        """Job time of this instant (seconds since the job's t0)."""
        return time.monotonic() - self.t0

    def local(self, t):
        """time.monotonic() on this rank of job time t."""
        return self.t0 + t

    def submit(self, *request):
        if self.error is not None:
            raise self.error
        self.requests.put(request)
        self.wakeup.set()

    def spec(self, server):
        """(shape, dtype) of server rank `server`'s model."""
        return self.infos[server]["shape"], self.infos[server]["dtype"]


def _bounded_barrier(comm):
    """A barrier that waits at most MLFABRIC_TIMEOUT: a rank that never registers becomes an error
    on the others instead of a hang. `comm` is the job's own duplicate (mlfabric.ps.init makes
    it), so a barrier left pending by the error never meets the user's collectives."""
    req = comm.Ibarrier()
    limit = _config.timeout_s()
    back = Backoff(limit)
    while not req.Test():
        if back.pause():
            continue
        raise PeerTimeoutError(
            "mlfabric.ps start-up: not every rank registered within MLFABRIC_TIMEOUT=%gs; "
            "every rank must call its role's register_as_*() (or serve()) once" % limit)


def _check_agreement(everyone, roles):
    """The same config on every rank, and each rank registered as the role its rank has."""
    configs = [c for c, _ in everyone]
    if any(c != configs[0] for c in configs):
        bad = [r for r, c in enumerate(configs) if c != configs[0]]
        raise MlfabricError("mlfabric.ps.init: ranks %s passed a different config from rank 0's "
                            "(%r); every rank must pass the same" % (bad, configs[0]))
    problems = []
    for r, (_, info) in enumerate(everyone):
        want = roles.role(r)
        if info.get("role") != want:
            problems.append("rank %d registered as %s but is a %s (%s)"
                            % (r, info.get("role"), want, roles.describe()))
    workers = [everyone[r][1] for r in roles.worker_ranks if everyone[r][1].get("role") == "worker"]
    # the workers' bounds, checked here so that a bad one fails every rank at once (a worker
    # refusing it alone would leave the others waiting for its registration)
    bad = []
    for r in roles.worker_ranks:
        info = everyone[r][1]
        if info.get("role") != "worker":
            continue  # (reported above)
        for key in ("tau_max", "div_max"):
            if not (isinstance(info[key], float) and info[key] >= 0):
                bad.append("worker rank %d: %s must be a number >= 0, got %r" % (r, key, info[key]))
    problems += bad
    taus = {w["tau_max"] for w in workers}
    divs = {w["div_max"] for w in workers}
    if not bad and len(taus) > 1:
        problems.append("workers disagree on tau_max: %s" % sorted(taus))
    if not bad and len(divs) > 1:
        problems.append("workers disagree on div_max: %s" % sorted(divs))
    mode = configs[0].mode
    if not bad and mode != "mlfabric-A" and any(t < math.inf for t in taus):
        problems.append("tau_max=%g: only mode 'mlfabric-A' bounds staleness by it; mode %r "
                        "does not" % (min(taus), mode))
    if not bad and not configs[0].replicas and any(d < math.inf for d in divs):
        problems.append("div_max=%g bounds the replicas' divergence; this job has none "
                        "(replicas=0)" % min(divs))
    for r in roles.replica_ranks:
        info = everyone[r][1]
        if info.get("role") == "replica" and info.get("server") != roles.server_of(r):
            problems.append("rank %d replicates server %r but is the replica of server %d"
                            % (r, info.get("server"), roles.server_of(r)))
    if problems:
        raise MlfabricError("mlfabric.ps start-up: " + "; ".join(problems))
