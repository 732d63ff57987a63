"""What the scheduler believes about the network (paper §4, §7 "monitor lag"): the network monitor
reports each link's capacity as it was t_lag ago (0.2 s in the paper), and the scheduler subtracts
the reservations of every transfer it has already planned. From that belief it builds the
mlfabric.sched.Network that schedule() plans a batch on.

Choices where the paper is silent:
- A report is one number per link, held constant into the future: the scheduler cannot know when the
  background load will change next, so it plans as if the last report stays true.
- The scheduler's book of reservations holds each planned transfer as planned. It is not told when
  a transfer actually ends early or late (that would need a report from the daemons the paper does
  not describe); a transfer that overruns its plan simply finds less capacity on the true network.
- Per batch the scheduler is handed only the hosts the batch involves (its workers, the server, the
  aggregators, the replica and its aggregators), renumbered 0..m-1. With a full-bisection core a
  transfer's path is its two endpoints' NICs, so this is the same problem schedule() would see on
  the whole network, at a cost that does not grow with the number of idle hosts.
"""
from bisect import bisect_right
from math import inf

from mlfabric.sched import Network, Profile


class Book:
    """Reserved bytes/s on one link over time, as the scheduler booked it: piecewise constant,
    [t[k], t[k+1]) -> v[k], from t = 0. `version` changes whenever the content does."""
    __slots__ = ("t", "v", "version")

    def __init__(self):
        self.t = [0.0]
        self.v = [0.0]
        self.version = 0

    def _split(self, x):
        k = bisect_right(self.t, x) - 1
        if self.t[k] == x:
            return k
        self.t.insert(k + 1, x)
        self.v.insert(k + 1, self.v[k])
        return k + 1

    def add(self, t0, t1, rate):
        """Book `rate` more over [t0, t1)."""
        if not t1 > t0 or rate == 0:
            return
        a = self._split(t0)
        b = self._split(t1) if t1 < inf else len(self.t)
        v = self.v
        for k in range(a, b):
            v[k] += rate
        # only the two ends can have become equal to their outer neighbour
        if b < len(v) and v[b] == v[b - 1]:
            del self.t[b], v[b]
        if a > 0 and v[a] == v[a - 1]:
            del self.t[a], v[a]
        self.version += 1

    def prune(self, now):
        """Forget entries before `now` (the value before `now` becomes that at `now`)."""
        k = bisect_right(self.t, now) - 1
        if k > 0:
            self.t = [0.0] + self.t[k + 1:]
            self.v = self.v[k:]
            self.version += 1


class _Residual:
    __slots__ = ("t", "v")


_ZERO = Profile(0.0)  # copied, then given its t and v lists: a Profile without re-validation


class SchedulerView:
    def __init__(self, truth, t_lag):
        if not t_lag >= 0:
            raise ValueError("monitor lag t_lag must be >= 0 seconds, got %r" % (t_lag,))
        self.truth = truth
        self.t_lag = float(t_lag)
        self.hosts = truth.hosts
        self.booked = [Book() for _ in range(2 * truth.hosts)]
        self.touched = set()  # links booked since the last prune
        self._cache = {}      # link -> (book version, book index at now, report, Profile)
        self._templates = {}  # m -> an m-host Network whose links are replaced per batch

    def reported(self, link, now):
        """The capacity the monitor reports for `link` at time `now`: the true one t_lag ago."""
        return self.truth.capacity(link, now - self.t_lag)

    def steps(self, link, now):
        """The scheduler's residual capacity of `link` from `now` on, as [(t, rate), ...] from 0
        (the value before `now` is that at `now`; nothing is planned in the past)."""
        r = self.truth.capacity(link, now - self.t_lag)
        b = self.booked[link]
        bt, bv = b.t, b.v
        k = bisect_right(bt, now) - 1
        out = [(0.0, max(0.0, r - bv[k]))]
        for j in range(k + 1, len(bt)):
            x = r - bv[j]
            out.append((bt[j], x if x > 0.0 else 0.0))
        return out

    def profile(self, link, now):
        """steps() as a Profile, reused while neither the book nor the report has changed."""
        r = self.truth.capacity(link, now - self.t_lag)
        b = self.booked[link]
        bt, bv = b.t, b.v
        k = bisect_right(bt, now) - 1
        got = self._cache.get(link)
        if got is not None and got[0] == b.version and got[1] == k and got[2] == r:
            return got[3].copy()
        x = r - bv[k]
        t, v = [0.0], [x if x > 0.0 else 0.0]
        for j in range(k + 1, len(bt)):
            x = r - bv[j]
            if x < 0.0:
                x = 0.0
            if x != v[-1]:  # keep Profile's form: equal neighbours merged
                t.append(bt[j])
                v.append(x)
        p = _ZERO.copy()
        p.t, p.v = t, v
        self._cache[link] = (b.version, k, r, p)
        return p.copy()

    def residual(self, link, now):
        """steps() as an object t_en can walk (lists t and v; equal neighbours not merged)."""
        r = self.reported(link, now)
        b = self.booked[link]
        k = bisect_right(b.t, now) - 1
        out = _Residual()
        out.t = [0.0] + b.t[k + 1:]
        out.v = [max(0.0, r - v) for v in b.v[k:]]
        return out

    def network(self, hosts, now):
        """The scheduler's view of `hosts` (global ids), renumbered in the order given."""
        n, m = self.hosts, len(hosts)
        template = self._templates.get(m)
        if template is None:
            template = self._templates[m] = Network([0.0] * m, [0.0] * m)
        net = template.copy()
        net.links = ([self.profile(h, now) for h in hosts]
                     + [self.profile(n + h, now) for h in hosts])
        return net

    def book(self, src, dst, segments):
        """Record a planned transfer's reservation (global host ids)."""
        if src == dst or not segments:
            return
        for link in (src, self.hosts + dst):
            b = self.booked[link]
            for s in segments:
                b.add(s.t0, s.t1, s.rate)
            self.touched.add(link)

    def prune(self, now):
        """Forget the book's entries before `now` (on links booked since the last prune)."""
        for link in self.touched:
            self.booked[link].prune(now)
        self.touched = set()
