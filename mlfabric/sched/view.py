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

Cost (the view is built for every batch, ~13 links; booking and rebuilding a link's view run in
C++ on the same lists when mlfabric._C has them, csrc/sched_send.cc, else in the Python below): each link's view Profile is cached and rebuilt
only when its book, its book entry at "now" or its report changed; the network handed to
schedule() holds the cached Profiles themselves, not copies (schedule, replicate and distribute
never modify the network they are given; tests/unit/test_sim.py checks it), and reports are read once
per NIC-rate period (TrueNetwork.capacities).
"""
from bisect import bisect_right
from math import inf

from .network import Network, Profile
from .network import segments_from_flat, t_en as path_t_en

try:  # the book's and the view's hot loops on the same lists, in C++ (csrc/sched_send.cc)
    from mlfabric._C import (book_add as _book_add, book_t_en as _book_t_en,
                             view_links as _view_links, view_residual as _view_residual)
except ImportError:  # a build without them: the Python below
    _book_add = _book_t_en = _view_links = _view_residual = None


class Book:
    """Reserved bytes/s on one link over time, as the scheduler booked it: piecewise constant,
    [t[k], t[k+1]) -> v[k], from t = 0. `version` changes whenever the content does."""
    __slots__ = ("t", "v", "version")

    def __init__(self):
        self.t = [0.0]
        self.v = [0.0]
        self.version = 0

    def add(self, t0, t1, rate):
        """Book `rate` more over [t0, t1)."""
        if not t1 > t0 or rate == 0:
            return
        t, v = self.t, self.v
        # make t0 and t1 breakpoints (t1 searched from t0 on: it lies after)
        a = bisect_right(t, t0) - 1
        if t[a] != t0:
            a += 1
            t.insert(a, t0)
            v.insert(a, v[a - 1])
        if t1 < inf:
            b = bisect_right(t, t1, a) - 1
            if t[b] != t1:
                b += 1
                t.insert(b, t1)
                v.insert(b, v[b - 1])
        else:
            b = len(t)
        for k in range(a, b):
            v[k] += rate
        # only the two ends can have become equal to their outer neighbour
        if b < len(v) and v[b] == v[b - 1]:
            del t[b], v[b]
        if a > 0 and v[a] == v[a - 1]:
            del t[a], v[a]
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


# Profiles and Networks the view builds from lists it knows are valid (times increasing from 0,
# values finite and >= 0, equal neighbours merged), without the constructors' re-validation
_Profile, _new_profile = Profile, Profile.__new__
_new_network = Network.__new__


class SchedulerView:
    def __init__(self, truth, t_lag):
        if not t_lag >= 0:
            raise ValueError("monitor lag t_lag must be >= 0 seconds, got %r" % (t_lag,))
        self.truth = truth
        self.t_lag = float(t_lag)
        self.hosts = truth.hosts
        self.booked = [Book() for _ in range(2 * truth.hosts)]
        self.touched = set()  # links booked since the last prune
        # link -> (book version, book index at now, report, Profile) of its last view
        self._cache = [None] * (2 * truth.hosts)
        self._templates = {}  # m -> an m-host Network, shallow-copied per batch

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
        """steps() as a Profile (shared with later calls: read it, do not modify it)."""
        return self._profile(link, now, self.truth.capacities(now - self.t_lag)[link])

    def _profile(self, link, now, r):
        """profile() given the report r; rebuilt only when the book, the book's entry at `now` or
        the report has changed since the last call for this link."""
        b = self.booked[link]
        k = bisect_right(b.t, now) - 1
        got = self._cache[link]
        if got is not None and got[0] == b.version and got[1] == k and got[2] == r:
            return got[3]
        return self._build(link, b, k, r)

    def _build(self, link, b, k, r):
        """The view of `link` from book entry k on, given the report r, cached: r - booked,
        clipped at 0 (a link booked past what the monitor now reports has nothing left), with
        equal neighbours merged as a Profile keeps them."""
        bt, bv = b.t, b.v
        if _view_residual is not None:
            t, v = _view_residual(bt, bv, k, r)
        else:
            x = bv[k]
            last = r - x if r > x else 0.0
            t, v = [0.0], [last]
            for j in range(k + 1, len(bt)):
                x = bv[j]
                x = r - x if r > x else 0.0
                if x != last:
                    t.append(bt[j])
                    v.append(x)
                    last = x
        p = _new_profile(_Profile)
        p.t = t
        p.v = v
        self._cache[link] = (b.version, k, r, p)
        return p

    def residual(self, link, now):
        """steps() as an object t_en can walk (lists t and v; equal neighbours not merged)."""
        return self.residuals((link,), now)[0]

    def residuals(self, links, now):
        """residual() of each of `links`, as a list (the report read once)."""
        caps = self.truth.capacities(now - self.t_lag)
        out = []
        for link in links:
            r = caps[link]
            b = self.booked[link]
            bt = b.t
            k = bisect_right(bt, now) - 1
            x = _Residual()
            x.t = [0.0] + bt[k + 1:]
            x.v = [r - v if r > v else 0.0 for v in b.v[k:]]
            out.append(x)
        return out

    def t_en(self, links, now, size, start):
        """mlfabric.sched.network.t_en(residuals(links, now), size, start): (end, segments), in
        C++ on the books' lists when built (the residual lists are never made)."""
        if _book_t_en is None or not start >= 0:
            return path_t_en(self.residuals(links, now), size, start)
        caps, booked = self.truth.capacities(now - self.t_lag), self.booked
        end, flat = _book_t_en([(booked[k].t, booked[k].v, caps[k]) for k in links], now, size,
                               start)
        return end, (None if flat is None else segments_from_flat(flat))

    def network(self, hosts, now):
        """The scheduler's view of `hosts` (global ids), renumbered in the order given.

        Its links are the cached Profiles of profile(), not copies: schedule(), replicate() and
        distribute() take a network they do not modify (they plan on copies), and the view never
        changes a Profile it has handed out (it builds a new one when the link changes)."""
        n, m = self.hosts, len(hosts)
        template = self._templates.get(m)
        if template is None:
            template = self._templates[m] = Network([0.0] * m, [0.0] * m)
        caps = self.truth.capacities(now - self.t_lag)
        booked, cache = self.booked, self._cache
        ids = [*hosts, *[n + h for h in hosts]]
        if _view_links is not None:  # the loop below, in C++
            links = _view_links(ids, caps, booked, cache, now, _Profile)
        else:
            links = []
            for link in ids:
                # _profile's cache check inlined (this loop runs for every link of every batch)
                r = caps[link]
                b = booked[link]
                k = bisect_right(b.t, now) - 1
                got = cache[link]
                if got is not None and got[0] == b.version and got[1] == k and got[2] == r:
                    links.append(got[3])
                else:
                    links.append(self._build(link, b, k, r))
        net = _new_network(Network)
        net.__dict__.update(template.__dict__)  # hosts and (no) core paths: a shallow copy
        net.links = links
        return net

    def book(self, src, dst, segments):
        """Record a planned transfer's reservation (global host ids)."""
        if src == dst or not segments:
            return
        booked, touched = self.booked, self.touched
        for link in (src, self.hosts + dst):
            b = booked[link]
            # natively: Book.add per segment on the same lists; the version moves once (it only
            # has to differ from every cached one when the content may have changed)
            if _book_add is not None and _book_add(b.t, b.v, segments) >= 0:
                b.version += 1
            else:
                for s in segments:
                    b.add(s.t0, s.t1, s.rate)
            touched.add(link)

    def prune(self, now):
        """Forget the book's entries before `now` (on links booked since the last prune)."""
        for link in self.touched:
            self.booked[link].prune(now)
        self.touched = set()
