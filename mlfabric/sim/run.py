"""What every policy's run has in common: the workers' compute/push/pull cycle, the seeded traces,
the update log, the server's version over time, the traffic counters, the replica's divergence
records, and turning all of it into a Report. Policies (scheduled.py, baselines.py) supply how an
update travels and when the server applies it.

A worker's cycle (§3.1, §4): compute an update from the model version it last pulled (the first
from version 0, present at start), push it, and once the push has left it (reached the server or an
aggregator, or been dropped) pull the model and compute the next. Pulls read the server's version
at the moment the request is served. A worker stops after `updates` pushes.
"""
import time

from .accounts import UpdateLog, VersionLog
from .engine import Engine, Progress
from .models import ModelPair, UpdateVectors
from mlfabric.emulate.presets import ComputeTrace, NicTrace
from .report import build_report


class Run:
    policy = None

    def __init__(self, cfg, progress=False):
        self.cfg = cfg
        self.W, self.N = cfg.workers, cfg.updates
        self.size = float(cfg.size)
        self.compute = ComputeTrace(cfg.compute, cfg.workers, cfg.compute_time, cfg.seed)
        self.nic = NicTrace(cfg.net, 2 * cfg.hosts, cfg.base_rate, cfg.period, cfg.seed)
        self.host = [cfg.host_of(w) for w in range(cfg.workers)]
        self.log = UpdateLog(cfg.workers, cfg.updates)
        self.versions = VersionLog()
        self.wver = [0] * cfg.workers     # model version each worker computes from
        self.next_it = [0] * cfg.workers  # its next update's iteration
        self.total = cfg.workers * cfg.updates
        self.prog = (Progress(self.policy, self.total, lambda: self.log.n_resolved)
                     if progress else None)
        self.engine = Engine(self.prog)
        # traffic and replica records
        self.server_bytes = 0.0
        self.server_out_bytes = 0.0
        self.replica_bytes = None
        self.div_bound = None
        self.div_exact = None
        self.div_checks = 0
        self.div_violations = 0
        self.bound_unmet = 0
        self.sched_times = []
        self.models = None
        if cfg.replica:
            self.replica_bytes = 0.0
            self.div_bound = 0.0
            if cfg.vectors:
                vec = UpdateVectors(cfg.vectors, cfg.seed, cfg.updates, self.compute.norm)
                self.models = ModelPair(vec, cfg.gamma)
                self.div_exact = 0.0

    # --- the worker cycle -----------------------------------------------------------------------
    def start_compute(self, t, w):
        """Worker w starts computing its next update at t (after its pull)."""
        i = self.next_it[w]
        self.engine.at(t + self.compute.time(w, i), self.ready, w, i)

    def ready(self, t, w, i):
        raise NotImplementedError

    def note_divergence(self, bound=None):
        """Record one divergence check (bound from norms and, with vectors, the exact value)."""
        self.div_checks += 1
        if bound is not None and bound > self.div_bound:
            self.div_bound = bound
        if self.models is not None:
            exact = self.models.divergence()
            self.div_exact = max(self.div_exact, exact)
            if bound is not None and exact > bound * (1 + 1e-9) + 1e-12:
                self.div_violations += 1

    def simulate(self):
        t0 = time.perf_counter()
        self.begin()
        self.engine.run()
        self.finish()
        if self.log.n_resolved != self.total:
            raise RuntimeError("%s: %d of %d updates were never resolved"
                               % (self.policy, self.total - self.log.n_resolved, self.total))
        return build_report(self, time.perf_counter() - t0)

    def begin(self):
        for w in range(self.W):
            self.start_compute(0.0, w)

    def finish(self):
        pass
