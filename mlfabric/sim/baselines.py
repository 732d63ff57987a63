"""The uncontrolled baselines (paper §3.1.1, Fig. 1a/1b; §7 "Async"): no scheduler. Every push, pull
and replica copy is a flow that starts at once and shares links max-min fairly with the others
(fairshare.StarShare: pushes share the server's ingress, pulls and replica copies its egress, each
also limited by its own host's NIC). Capacities follow the same NIC traces as mlfabric's policies.

- 'async' (vanilla parameter server): the server applies updates in arrival order; nothing bounds
  the delay, nothing is dropped.
- 'buffered' (server-side buffering, §3.1.1): the same flows, but the server holds back arrivals so
  that delays stay <= tau_max (buffering.py); an update is dropped only when its bound is already
  broken.

A worker pulls when its push has arrived at the server (the pull rides behind the push on the same
connection, as in a parameter server), reading the version the server has then — for 'buffered'
that excludes updates still held. With a replica, the server forwards every update it applies (chain
replication, what parameter servers do today, §3.3), in its own order, so the replica lags but never
reorders; its divergence is measured after every server update.
"""
from .buffering import BufferingServer
from .fairshare import FlowSource, StarShare
from .models import ChainBound
from .run import Run

PUSH, PULL, COPY = 0, 1, 2   # a flow id is 3 * update id + kind


class FairShareRun(Run):
    def __init__(self, cfg, policy, progress=False):
        if policy not in ("async", "buffered"):
            raise ValueError("not a fair-share baseline: %r (known: async, buffered)" % (policy,))
        self.policy = policy
        super().__init__(cfg, progress)
        hw, base = cfg.hosts, cfg.base_rate
        r0 = self.nic.period_rates(0)
        self.push = FlowSource(StarShare(base, r0[:hw]), self._arrived)
        leaves = list(r0[hw:]) + ([base] if cfg.replica else [])  # + the replica's ingress
        self.pull = FlowSource(StarShare(base, leaves), self._delivered)
        self.engine.sources = [self.push, self.pull]
        self.buffer = None
        if policy == "buffered":
            self.buffer = BufferingServer(cfg.tau_max, self._apply, self._drop)
        self.sv = 0                 # server version (async)
        self.chain = ChainBound(cfg.gamma) if cfg.replica else None
        self.rep_applied = 0
        self.replica_lag = 0 if cfg.replica else None

    def begin(self):
        super().begin()
        self.engine.at(self.cfg.period, self._capacity, 1)

    def _capacity(self, t, k):
        """Period k's NIC rates (the server's and replica's machines stay at the base rate)."""
        hw, base = self.cfg.hosts, self.cfg.base_rate
        r = self.nic.period_rates(k)
        self.push.share.set_capacity(t, base, r[:hw])
        self.pull.share.set_capacity(t, base, list(r[hw:]) + ([base] if self.cfg.replica else []))
        if self.log.n_resolved < self.total or len(self.push.share) or len(self.pull.share):
            self.engine.at((k + 1) * self.cfg.period, self._capacity, k + 1)

    # --- workers and server -----------------------------------------------------------------------
    def ready(self, t, w, i):
        uid = self.log.uid(w, i)
        v = self.wver[w]
        self.log.push(uid, v, t)
        if self.buffer is not None:
            self.buffer.pushed(uid, v)
        self.push.share.add(t, self.host[w], self.size, 3 * uid + PUSH)

    def _arrived(self, t, fid):
        uid = fid // 3
        self.server_bytes += self.size
        if self.buffer is None:
            self.sv += 1
            self._apply(t, uid, self.sv)
        else:
            self.buffer.arrived(t, uid, self.log.version[uid])
        w, i = divmod(uid, self.N)
        self.next_it[w] = i + 1
        if i + 1 < self.N:
            self.wver[w] = self.versions.current
            self.pull.share.add(t, self.host[w], self.size, 3 * uid + PULL)
            self.server_out_bytes += self.size

    def _apply(self, t, uid, v):
        self.log.apply(uid, v - self.log.version[uid], t)
        self.versions.add(t, 1)
        if self.chain is not None:
            w, i = divmod(uid, self.N)
            self.chain.server_applied(self.compute.norm(w, i))
            if self.models is not None:
                self.models.apply_server(uid)
            self.pull.share.add(t, self.cfg.hosts, self.size, 3 * uid + COPY)
            self.replica_bytes += self.size
            self.server_out_bytes += self.size
            self.replica_lag = len(self.chain.prefix) - 1 - self.rep_applied
            self.note_divergence(self.chain.bound(self.rep_applied))

    def _drop(self, t, uid, reason):
        self.log.drop(uid, reason, t)

    def _delivered(self, t, fid):
        uid, kind = divmod(fid, 3)
        if kind == PULL:
            self.start_compute(t, uid // self.N)
        else:
            self.rep_applied += 1
            if self.models is not None:
                self.models.apply_replica(uid)
            self.replica_lag = len(self.chain.prefix) - 1 - self.rep_applied

    def finish(self):
        if self.buffer is not None and (self.buffer.buffer or self.buffer.inflight):
            raise RuntimeError("buffered: %d updates still held at the end of the run"
                               % len(self.buffer.buffer))
