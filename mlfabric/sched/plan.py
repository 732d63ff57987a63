"""The scheduler's input and output as plain data: an Update (what a worker's push() tells the
scheduler: size, model version, norm), a Transfer (bytes from one host to another over intervals at
given rates), an Aggregate, and the Plan for a batch with its readable text form.

Versions and delay (paper §3.1, Fig. 1): the server's model is at version v_init when the batch
starts; the update applied at position p (1-based) of the batch's order takes it to v_init + p, and its
delay is tau = v_init + p - v(g). It respects the bound when tau <= tau_max, i.e. p <= dl(g) with
dl(g) = v(g) + tau_max - v_init (eq. 9). An aggregate of m updates is applied as m consecutive
positions (its members keep the positions the ordering gave them), so aggregation never changes a
delay.
"""
from dataclasses import dataclass, field
from math import inf

# Why an update was dropped. Every update of a batch is applied exactly once or dropped with one.
DROP_STALE = "stale"          # its deadline passed: applying it would exceed tau_max
DROP_LOOKAHEAD = "lookahead"  # Alg. 2: forced by its deadline, but the next update would finish first
DROP_NO_PATH = "no-capacity"  # its path has no capacity left, ever: it could never arrive
DROP_SLOW = "slow-link"       # its path is so slow that the next batch's would arrive first
DROP_NOT_CHOSEN = "not-chosen"  # only in the oracle's plans: asked to apply fewer updates
DROP_REASONS = {
    DROP_STALE: "deadline passed: applied now its delay would exceed tau_max",
    DROP_LOOKAHEAD: "kept for its deadline, the next update would finish first and leave the "
                    "server idle (Alg. 2 look-ahead), so it is dropped at the worker",
    DROP_NO_PATH: "no capacity on its path for the rest of time",
    DROP_SLOW: "its path is so slow that the batch's fastest update, sent at the next batch, "
               "would reach the server first, and the server, applying in order, would idle "
               "behind it (Alg. 2's look-ahead against the next batch), so it is dropped at the "
               "worker",
    DROP_NOT_CHOSEN: "the exact oracle's optimal plan applies the requested number of updates "
                     "without it (mlfabric.sched.oracle)",
}


@dataclass(frozen=True)
class Update:
    """A ready gradient update: `worker` host, `size` bytes, computed from model `version`, ready to
    send at time `ready`, with L2 norm `norm` (for the divergence bound: inf when unknown, which
    makes replication assume the worst and catch the replica up fully)."""
    id: int
    worker: int
    size: float
    version: int
    ready: float = 0.0
    norm: float = inf


@dataclass(frozen=True)
class Transfer:
    """Bytes from src to dst: `segments` are (t0, t1, rate) intervals, back to back. `what` says what
    moves: 'update', 'aggregate', 'replica-update', 'replica-aggregate', 'model'; `ids` the updates
    it carries."""
    src: int
    dst: int
    size: float
    start: float
    end: float
    segments: tuple
    what: str
    ids: tuple

    @property
    def duration(self):
        return self.end - self.start


@dataclass
class Aggregate:
    """Updates summed at `aggregator` (members in order) and forwarded as one to `dst`.

    In a cut-through pipeline (aggregation.pipeline) the sum passes through several aggregators:
    `upstream` is then the Aggregate before this one, whose transfer (to this aggregator, carrying
    its members) is one of this one's `inbound` and whose members are among this one's."""
    aggregator: int
    dst: int
    members: list
    inbound: list          # the members' transfers to the aggregator (and the upstream sum's)
    transfer: Transfer     # the aggregate's transfer to dst
    upstream: "Aggregate" = None

    @property
    def ready(self):
        """When the last member has arrived at the aggregator."""
        return max(t.end for t in self.inbound)

    def levels(self):
        """This aggregate and those upstream of it, the first of the pipeline first."""
        out = [] if self.upstream is None else self.upstream.levels()
        out.append(self)
        return out

    def transfers(self):
        """Every transfer of it, upstream ones included, each once."""
        out = []
        for a in self.levels():
            out.extend(t for t in a.inbound if a.upstream is None or t is not a.upstream.transfer)
            out.append(a.transfer)
        return out

    def hop_of(self, uid):
        """The aggregator member `uid` is first sent to."""
        for a in self.levels():
            if any(t.what == "update" and uid in t.ids for t in a.inbound):
                return a.aggregator
        return None


@dataclass(frozen=True)
class Commit:
    """At `time` the server applies `ids` (one update, or an aggregate's members in order)."""
    time: float
    ids: tuple
    via: int  # the host it arrived from (worker or aggregator)


@dataclass
class Plan:
    """The schedule of one batch. `order` lists applied updates by position; `dropped` maps update
    id to a DROP_* reason; `direct` are the transfers straight to the server; `aggregates` the
    aggregated groups; `commits` the server's applications in order; `replica` is filled by the
    replication step (mlfabric.sched.replication) when a replica exists."""
    server: int
    v_init: int
    tau_max: float
    updates: dict                      # id -> Update
    order: list = field(default_factory=list)
    dropped: dict = field(default_factory=dict)
    direct: list = field(default_factory=list)
    aggregates: list = field(default_factory=list)
    commits: list = field(default_factory=list)
    replica: object = None
    start: float = 0.0
    momentum: bool = False             # aggregates carry two weighted sums (server momentum)

    # --- derived facts -------------------------------------------------------------------------
    def position(self, uid):
        """1-based position of an applied update in the batch's order (None if dropped)."""
        try:
            return self.order.index(uid) + 1
        except ValueError:
            return None

    def delay(self, uid):
        """tau = v_init + position - v(g) of an applied update."""
        p = self.position(uid)
        return None if p is None else self.v_init + p - self.updates[uid].version

    def commit_time(self, uid):
        for c in self.commits:
            if uid in c.ids:
                return c.time
        return None

    def next_hop(self, uid):
        """Where the update goes first: the server, or the aggregator of its group."""
        for a in self.aggregates:
            if uid in a.members:
                return a.hop_of(uid)
        return self.server if uid in self.order else None

    def transfers(self):
        """Every transfer of the plan (server side, then the replica's if any)."""
        out = list(self.direct)
        for a in self.aggregates:
            out.extend(a.transfers())
        if self.replica is not None:
            out.extend(self.replica.transfers())
        return out

    @property
    def makespan(self):
        """obj_sync (eq. 16): when the last update or aggregate reaches the server."""
        return max((c.time for c in self.commits), default=self.start)

    @property
    def mean_commit(self):
        """obj_async (eq. 17): mean commit time over applied updates."""
        n = sum(len(c.ids) for c in self.commits)
        return sum(c.time * len(c.ids) for c in self.commits) / n if n else 0.0

    @property
    def server_wait(self):
        """Total time arrived updates waited at the server for an earlier position to commit."""
        arrival = {t.ids: t.end for t in self.direct}
        arrival.update({tuple(a.members): a.transfer.end for a in self.aggregates})
        return sum((c.time - arrival[c.ids]) * len(c.ids) for c in self.commits
                   if c.ids in arrival)

    @property
    def server_bytes(self):
        """Bytes that reach the server's NIC (aggregation lowers this)."""
        return sum(t.size for t in self.direct) + sum(a.transfer.size for a in self.aggregates)

    # --- readable form -----------------------------------------------------------------------
    def __str__(self):
        lines = ["plan: server %d, v_init %d, tau_max %s, %d applied, %d dropped, makespan %.6g s, "
                 "server bytes %.6g" % (self.server, self.v_init, _fmt(self.tau_max),
                                        len(self.order), len(self.dropped), self.makespan,
                                        self.server_bytes)]
        for t in self.direct:
            uid = t.ids[0]
            lines.append("  #%-3d u%-5d w%-4d -> S%-4d [%.6g, %.6g]  tau=%d"
                         % (self.position(uid), uid, t.src, t.dst, t.start, t.end, self.delay(uid)))
        for a in self.aggregates:
            pos = [self.position(u) for u in a.members]
            lines.append("  #%d-%d aggregate at h%d of %d updates -> S%d [%.6g, %.6g]"
                         % (pos[0], pos[-1], a.aggregator, len(a.members), a.dst, a.transfer.start,
                            a.transfer.end))
            for t in a.transfers()[:-1]:
                if t.what != "update":   # a pipeline's partial sum, one aggregator to the next
                    lines.append("      sum of %d  h%-4d -> h%-4d [%.6g, %.6g]"
                                 % (len(t.ids), t.src, t.dst, t.start, t.end))
                    continue
                uid = t.ids[0]
                lines.append("      u%-5d w%-4d -> h%-4d [%.6g, %.6g]  tau=%d"
                             % (uid, t.src, t.dst, t.start, t.end, self.delay(uid)))
        for uid, why in sorted(self.dropped.items()):
            lines.append("  dropped u%d (w%d, v%d): %s" % (uid, self.updates[uid].worker,
                                                           self.updates[uid].version, why))
        if self.replica is not None:
            lines.append(str(self.replica))
        return "\n".join(lines)


def _fmt(x):
    return "inf" if x == inf else "%g" % x
