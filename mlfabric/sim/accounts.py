"""Per-update bookkeeping shared by every policy: what happened to each pushed update (applied
straight, applied as part of an aggregate, or dropped with a reason), its delay and when it was
resolved; the server's model version over time; and the stale-synchronous gate (§6).

Update ids are worker * updates_per_worker + iteration, so they are unique across the run (the
replication step needs that: punted updates travel with later batches) and say whose they are.
Storage is plain lists indexed by id (fast to write one at a time; numpy for the report).

Delay convention (mlfabric.sched.plan, Fig. 1): an update applied to make server version v has delay
tau = v - v(g), where v(g) is the version it was computed from.
"""
from bisect import bisect_right

PENDING, DIRECT, AGGREGATED, DROPPED = 0, 1, 2, 3


class UpdateLog:
    def __init__(self, workers, per_worker):
        n = workers * per_worker
        self.per_worker = per_worker
        self.status = bytearray(n)
        self.pushed = bytearray(n)
        self.version = [0] * n
        self.ready = [0.0] * n
        self.delay = [0] * n
        self.done = [0.0] * n
        self.reason = {}            # id -> drop reason
        self.n_pushed = 0
        self.n_resolved = 0

    def uid(self, w, i):
        return w * self.per_worker + i

    def worker(self, uid):
        return uid // self.per_worker

    def push(self, uid, version, ready):
        if self.pushed[uid]:
            raise RuntimeError("update %d pushed twice" % uid)
        self.pushed[uid] = 1
        self.version[uid] = version
        self.ready[uid] = ready
        self.n_pushed += 1

    def _resolve(self, uid, status, t):
        if not self.pushed[uid]:
            raise RuntimeError("update %d resolved but never pushed" % uid)
        if self.status[uid] != PENDING:
            raise RuntimeError("update %d resolved twice" % uid)
        self.status[uid] = status
        self.done[uid] = t
        self.n_resolved += 1

    def apply(self, uid, delay, t, aggregated=False):
        self._resolve(uid, AGGREGATED if aggregated else DIRECT, t)
        self.delay[uid] = delay

    def drop(self, uid, reason, t):
        self._resolve(uid, DROPPED, t)
        self.reason[uid] = reason


class VersionLog:
    """The server's model version as a step function of time (commits are logged in time order)."""

    def __init__(self):
        self.t = [0.0]
        self.v = [0]

    @property
    def current(self):
        return self.v[-1]

    def add(self, t, steps):
        if t < self.t[-1]:
            raise RuntimeError("commit at %r logged after one at %r" % (t, self.t[-1]))
        if t == self.t[-1]:
            self.v[-1] += steps
        else:
            self.t.append(t)
            self.v.append(self.v[-1] + steps)

    def at(self, t):
        """The version a pull served at time t reads (commits at t included)."""
        return self.v[bisect_right(self.t, t) - 1]


class Gate:
    """Stale synchronous parallel (§6): a worker may compute its update i (0-based) only once every
    worker has had at least i - slack updates processed (applied or dropped). slack = 0 is the
    per-iteration barrier of synchronous SGD. release(w, t) is called for workers let through."""

    def __init__(self, workers, slack, release):
        self.slack = slack
        self.processed = [0] * workers
        self.low = 0
        self.count = {0: workers}
        self.waiting = {}
        self.release = release

    def allows(self, i):
        return self.low >= i - self.slack

    def wait(self, w, i):
        self.waiting.setdefault(i - self.slack, []).append(w)

    def done(self, w, t):
        c = self.processed[w]
        self.processed[w] = c + 1
        self.count[c] -= 1
        self.count[c + 1] = self.count.get(c + 1, 0) + 1
        while self.count.get(self.low, 0) == 0:
            self.count.pop(self.low, None)
            self.low += 1
            for v in self.waiting.pop(self.low, ()):
                self.release(v, t)
