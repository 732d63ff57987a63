"""Accounting (issue: "nothing is lost"): every pushed update id ends in exactly one outcome,
applied or dropped with a reason, and the job's summary says so. Each rank records what it saw in
its Ledger; the scheduler merges them at the end (summarize) and checks pushed = applied + dropped
on the ids themselves, not only on counts. The id sets are IdSets (one byte per id), so a long
job's accounting stays small.
"""
from collections import Counter, deque
from dataclasses import dataclass, field

from .idset import IdSet

DROP_SERVER_FAILED = "server-failed"   # applied only at a server that died, never at its replica
DROP_WORKER_FAILED = "worker-failed"   # its worker died before the update could be sent
DROP_AGGREGATOR_FAILED = "aggregator-failed"  # its aggregator died holding it
DROP_STREAM_VOIDED = "aggregate-voided"  # summed (cut-through) with a member whose sender died

# Timing profiles (summary.control) keep each rank's latest samples only: a job's profile, not a
# log that grows with every get of a long job
PROFILE_KEPT = 20_000


def profile():
    """An empty timing profile: the latest PROFILE_KEPT samples (seconds)."""
    return deque(maxlen=PROFILE_KEPT)


class Drops:
    """Dropped update ids with their reasons, read and written as a dict id -> reason, kept as
    one IdSet per reason (a handful of reasons; a byte an id instead of a dict entry's ~100, the
    largest per-update state of an asynchronous job, where a third or more of the pushes may be
    dropped). An id has one reason: recording another moves it."""
    __slots__ = ("by_reason",)

    def __init__(self, items=()):
        self.by_reason = {}    # reason -> IdSet
        for uid, reason in dict(items).items():
            self[uid] = reason

    def __setitem__(self, uid, reason):
        for r, ids in self.by_reason.items():
            if r != reason:
                ids.discard(uid)
        self.by_reason.setdefault(reason, IdSet()).add(uid)

    def __getitem__(self, uid):
        for r, ids in self.by_reason.items():
            if uid in ids:
                return r
        raise KeyError(uid)

    def __contains__(self, uid):
        return any(uid in ids for ids in self.by_reason.values())

    def __len__(self):
        return sum(len(ids) for ids in self.by_reason.values())

    def __iter__(self):
        for ids in self.by_reason.values():
            yield from ids

    def items(self):
        for r, ids in self.by_reason.items():
            for uid in ids:
                yield uid, r

    def ids(self):
        """Every dropped id, as one IdSet."""
        out = IdSet()
        for ids in self.by_reason.values():
            out |= ids
        return out

    def update(self, other):
        """Take `other`'s drops (a Drops or a dict); its reason wins for an id in both."""
        if not isinstance(other, Drops):
            other = Drops(other)
        for r, ids in other.by_reason.items():
            for r2 in self.by_reason:
                if r2 != r:
                    self.by_reason[r2] = self.by_reason[r2] - ids
            mine = self.by_reason.setdefault(r, IdSet())
            mine |= ids

    def counts(self, among=None):
        """reason -> how many ids (of those in the IdSet `among`, if given); no zeros."""
        out = {r: len(ids if among is None else ids & among) for r, ids in self.by_reason.items()}
        return {r: n for r, n in out.items() if n}


@dataclass
class Ledger:
    pushed: IdSet = field(default_factory=IdSet)
    applied: IdSet = field(default_factory=IdSet)
    aggregated: IdSet = field(default_factory=IdSet)     # went through an aggregator
    replicated: IdSet = field(default_factory=IdSet)
    dropped: Drops = field(default_factory=Drops)    # id -> reason
    delays: Counter = field(default_factory=Counter)  # tau -> applied updates, async modes
    bytes_out: int = 0
    bytes_in: int = 0
    plan_latency: deque = field(default_factory=profile)  # worker: scheduler's send -> receipt
    get_latency: deque = field(default_factory=profile)   # worker: get() asked -> model in
    pull_wait: deque = field(default_factory=profile)     # server: get in -> its batch leaves
    pull_plan: deque = field(default_factory=profile)     # server: batch to scheduler -> its plan
    # cut-through relays (worker.py): 'forward' a payload passed on from its header, 'sum' an
    # aggregate streamed out while its members came in
    relayed: Counter = field(default_factory=Counter)

    def merge(self, other):
        self.pushed |= other.pushed
        self.applied |= other.applied
        self.aggregated |= other.aggregated
        self.replicated |= other.replicated
        self.dropped.update(other.dropped)
        self.delays.update(other.delays)
        self.bytes_out += other.bytes_out
        self.bytes_in += other.bytes_in
        self.plan_latency.extend(other.plan_latency)
        self.get_latency.extend(other.get_latency)
        self.pull_wait.extend(other.pull_wait)
        self.pull_plan.extend(other.pull_plan)
        self.relayed.update(other.relayed)


@dataclass
class Summary:
    pushed: int
    applied: int
    aggregated: int
    replicated: int
    dropped: dict            # reason -> count
    max_delay: object        # largest tau (server.py) among applied updates, None if none
    balanced: bool           # every pushed id applied or dropped, exactly once
    missing: list            # pushed ids with no outcome (empty when balanced)
    twice: list              # ids both applied and dropped
    server_bytes_in: int = 0
    replica_bytes_in: int = 0
    failed: list = field(default_factory=list)     # ranks that died during the job (ULFM)
    control: dict = field(default_factory=dict)    # control-plane timings (the scheduler's)
    failovers: list = field(default_factory=list)  # (server, new rank, its version, job time)
    relayed: dict = field(default_factory=dict)    # cut-through relays by kind (Ledger.relayed)
    nic_bytes: dict = field(default_factory=dict)  # rank -> (bytes out, bytes in), live ranks

    def __str__(self):
        drops = ", ".join("%s %d" % kv for kv in sorted(self.dropped.items())) or "none"
        return ("pushed %d = applied %d + dropped %d (%s)%s; aggregated %d, replicated %d, "
                "max delay %s" % (self.pushed, self.applied, sum(self.dropped.values()), drops,
                                  "" if self.balanced else "  UNBALANCED: missing %d, twice %d"
                                  % (len(self.missing), len(self.twice)),
                                  self.aggregated, self.replicated, self.max_delay))


def summarize(ledgers, server_ranks=(), replica_ranks=(), dead=(), known=()):
    """One Summary from every rank's Ledger (a list indexed by rank; None for a rank that died).
    A dead worker's ledger is gone: what it pushed is known from the `known` ids the scheduler
    was told of, and from its ids that were applied or dropped."""
    total = Ledger()
    for lg in ledgers:
        if lg is not None:
            total.merge(lg)
    dropped = total.dropped.ids()
    if dead:
        dead = set(dead)
        seen = IdSet(known) | total.applied | dropped
        total.pushed |= [uid for uid in seen if uid >> 32 in dead]
    # an update applied at a server that later died is dropped, not applied, when the
    # replica never got it (the recovery step records that drop); applied wins otherwise
    twice = list(total.applied & dropped)
    missing = list(total.pushed - total.applied - dropped)
    return Summary(
        pushed=len(total.pushed), applied=len(total.applied & total.pushed),
        aggregated=len(total.aggregated), replicated=len(total.replicated),
        dropped=total.dropped.counts(total.pushed),
        max_delay=max(total.delays) if total.delays else None,
        balanced=not missing and not twice and total.applied <= total.pushed,
        missing=missing, twice=twice,
        server_bytes_in=sum(ledgers[r].bytes_in for r in server_ranks if ledgers[r]),
        replica_bytes_in=sum(ledgers[r].bytes_in for r in replica_ranks if ledgers[r]),
        failed=sorted(dead), relayed=dict(total.relayed),
        nic_bytes={r: (lg.bytes_out, lg.bytes_in) for r, lg in enumerate(ledgers) if lg})
