"""Network model of the scheduler (paper §5.1, Fig. 4): links whose residual capacity is a piecewise
constant function of time, paths made of links, t_en (when a transfer that always takes the whole
residual bottleneck rate finishes) and NetUp (reserving that rate over time).

Units: bytes, seconds, bytes per second. Hosts are numbered 0..H-1. Every host has an egress and an
ingress link (its NIC, each direction on its own, as in the paper's emulation); the core is
full-bisection unless explicit core links and paths are given, for shared bottlenecks. A path from a
host to itself is empty: such a transfer (a worker handing its update to the aggregator on its own
host) takes no network time.

This module is the plain reference: Python lists, no cleverness. `mlfabric.sched.fast` runs the
same arithmetic in C++; tests hold the two to identical results.

One-transfer accelerator: when mlfabric._C is built, t_en, Profile.subtract and send_path run in
C++ (csrc/sched_send.cc) directly on the Profiles' lists: the same operations in the same order,
so the same floats and the same lists (tests/unit/test_sched_send.py holds them bit for bit to the
Python below, which is what runs without the native part, or with MLFABRIC_SCHED_PYTHON=1).
"""
import os
from bisect import bisect_right
from dataclasses import dataclass
from math import inf
from numbers import Integral

from ._records import fast_constructor

try:
    from .._C import send_path as _send_path, send_subtract as _subtract, send_t_en as _t_en
except ImportError:  # a build without the native part: the Python below does it all
    _send_path = _subtract = _t_en = None
if os.environ.get("MLFABRIC_SCHED_PYTHON"):
    _send_path = _subtract = _t_en = None

GBPS = 1e9 / 8  # bytes per second in one Gbit/s


def gbps(x):
    """Bytes per second for x Gbit/s."""
    return x * GBPS


class Profile:
    """A piecewise-constant function of time t >= 0: value v[k] on [t[k], t[k+1]), the last value
    forever. t[0] is 0. Equal neighbours are merged, so a link saturated over a long stretch is one
    segment (this is what keeps t_en walks short)."""

    __slots__ = ("t", "v")

    def __init__(self, steps):
        if isinstance(steps, (int, float)):
            steps = [(0.0, float(steps))]
        steps = [(float(t), float(r)) for t, r in steps]
        if not steps or steps[0][0] != 0.0:
            raise ValueError("a capacity trace must start at time 0, got %r" % (steps[:1],))
        for (t0, _), (t1, _) in zip(steps, steps[1:]):
            if not t1 > t0:
                raise ValueError("capacity trace times must increase, got %r then %r" % (t0, t1))
        for _, r in steps:
            if not r >= 0 or r == inf:
                raise ValueError("capacities must be finite and >= 0, got %r" % (r,))
        self.t = [t for t, _ in steps]
        self.v = [r for _, r in steps]
        self._merge()

    def copy(self):
        p = Profile.__new__(Profile)
        p.t = list(self.t)
        p.v = list(self.v)
        return p

    def at(self, t):
        """Value at time t."""
        return self.v[bisect_right(self.t, t) - 1]

    def _split(self, t):
        """Make t a breakpoint; return its index."""
        k = bisect_right(self.t, t) - 1
        if self.t[k] == t:
            return k
        self.t.insert(k + 1, t)
        self.v.insert(k + 1, self.v[k])
        return k + 1

    def subtract(self, t0, t1, rate):
        """Take `rate` off the value over [t0, t1)."""
        if not t1 > t0 or rate == 0:
            return
        if _subtract is not None and t0 >= 0:
            _subtract(self.t, self.v, t0, t1, rate)
            return
        self._subtract(t0, t1, rate)

    def _subtract(self, t0, t1, rate):
        """subtract() in Python (the reference of csrc/sched_send.cc)."""
        a = self._split(t0)
        b = self._split(t1) if t1 < inf else len(self.t)
        for k in range(a, b):
            # the bottleneck link of a reservation hits exactly 0 (x - x); others stay >= rate
            self.v[k] = self.v[k] - rate
        self._merge(a, b)

    def _merge(self, lo=1, hi=None):
        """Merge equal neighbours among indices lo-1..hi. The profile was merged before values in
        [lo, hi) changed, so only those pairs can have become equal: merging just them gives the
        same profile as merging everything, in time proportional to the change."""
        t, v = self.t, self.v
        lo = max(lo, 1)
        hi = len(t) - 1 if hi is None else min(hi, len(t) - 1)
        if lo > hi:
            return
        keep_t, keep_v, last = [], [], v[lo - 1]
        for k in range(lo, hi + 1):
            if v[k] != last:
                keep_t.append(t[k])
                keep_v.append(v[k])
                last = v[k]
        t[lo:hi + 1] = keep_t
        v[lo:hi + 1] = keep_v

    def steps(self):
        return list(zip(self.t, self.v))


@dataclass(frozen=True)
class Segment:
    """A transfer sends at `rate` bytes/s over [t0, t1)."""
    t0: float
    t1: float
    rate: float


_segment = fast_constructor(Segment)


def segments_from_flat(flat):
    """Segments from a flat [t0, t1, rate, ...] (the native part's form)."""
    return tuple([_segment(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)])


def t_en(profiles, size, start):
    """Completion time of `size` bytes starting at `start` over links with these residual profiles,
    taking the whole residual bottleneck rate min_l r_l(t) at every instant (Fig. 4b). Returns
    (end, segments); end is inf (segments None) when the path never has capacity again."""
    if size <= 0 or not profiles:
        return start, ()
    if _t_en is not None and start >= 0 and len(profiles) <= 16:
        try:
            end, flat = _t_en(profiles, size, start)
        except (TypeError, ValueError):  # not Profile-like lists: the Python walk says what
            return _t_en_python(profiles, size, start)
        return end, (None if flat is None else segments_from_flat(flat))
    return _t_en_python(profiles, size, start)


def _t_en_python(profiles, size, start):
    """t_en in Python (the reference of csrc/sched_send.cc)."""
    idx = [bisect_right(p.t, start) - 1 for p in profiles]
    t = start
    left = size
    segs = []
    while True:
        rate = inf
        nxt = inf
        for p, i in zip(profiles, idx):
            if p.v[i] < rate:
                rate = p.v[i]
            if i + 1 < len(p.t) and p.t[i + 1] < nxt:
                nxt = p.t[i + 1]
        if rate > 0:
            if nxt == inf or rate * (nxt - t) >= left:
                end = t + left / rate
                segs.append(Segment(t, end, rate))
                return end, tuple(segs)
            segs.append(Segment(t, nxt, rate))
            left -= rate * (nxt - t)
        elif nxt == inf:
            return inf, None
        t = nxt
        for j, p in enumerate(profiles):
            if idx[j] + 1 < len(p.t) and p.t[idx[j] + 1] == nxt:
                idx[j] += 1


def send_path(profiles, size, start, limit=inf, segments=True):
    """t_en over these links, then NetUp on each of them (per link, per segment, as
    Network.reserve), unless the transfer would end after `limit`: then nothing is reserved.
    Returns (end, segments); segments is None when nothing was reserved (end > limit, or end is
    inf: the path never has capacity again). segments=False: (end, None) always, the Segment
    objects not built (a caller that only needs the end). start must be >= 0."""
    if not start >= 0:
        raise ValueError("a transfer cannot start before time 0, got %r" % (start,))
    if size <= 0 or not profiles:
        return start, (() if segments else None)
    if _send_path is not None and len(profiles) <= 16:
        end, flat = _send_path(profiles, size, start, limit)
        if flat is None or not segments:
            return end, None
        return end, segments_from_flat(flat)
    end, segs = _t_en_python(profiles, size, start)
    if end == inf or end > limit:
        return end, None
    for p in profiles:
        for s in segs:
            p.subtract(s.t0, s.t1, s.rate)
    return end, (segs if segments else None)


class Network:
    """Residual capacity of every link over time, and the path between any two hosts.

    egress[h], ingress[h]: a number (constant bytes/s) or a trace [(t, rate), ...] starting at t=0.
    core: optional list of core links (same forms); paths: optional {(src, dst): [core link index,
    ...]} for host pairs whose traffic crosses those core links (others cross a full-bisection core).
    """

    def __init__(self, egress, ingress, core=(), paths=None):
        if len(egress) != len(ingress):
            raise ValueError("egress and ingress must list the same hosts (%d vs %d)"
                             % (len(egress), len(ingress)))
        self.hosts = len(egress)
        self.links = ([Profile(e) for e in egress] + [Profile(i) for i in ingress]
                      + [Profile(c) for c in core])
        self._core_paths = {}
        for (a, b), via in (paths or {}).items():
            self._check_host(a)
            self._check_host(b)
            for c in via:
                if not 0 <= c < len(core):
                    raise ValueError("path %r uses core link %r; there are %d" % ((a, b), c, len(core)))
            if len(set(via)) != len(via):  # it would be reserved twice for one transfer
                raise ValueError("path %r lists a core link twice: %r" % ((a, b), list(via)))
            self._core_paths[(a, b)] = tuple(2 * self.hosts + c for c in via)

    @classmethod
    def uniform(cls, hosts, rate):
        """`hosts` hosts whose NICs all run at `rate` bytes/s each way, full-bisection core."""
        return cls([rate] * hosts, [rate] * hosts)

    def _check_host(self, h):
        if isinstance(h, bool) or not (isinstance(h, Integral) and 0 <= h < self.hosts):
            raise ValueError("host %r is not in this network (0..%d)" % (h, self.hosts - 1))

    def copy(self):
        n = Network.__new__(Network)
        n.hosts = self.hosts
        n.links = [p.copy() for p in self.links]
        n._core_paths = self._core_paths
        return n

    def egress(self, h):
        return h

    def ingress(self, h):
        return self.hosts + h

    def path(self, src, dst):
        """Link indices from src to dst: egress, core links if any, ingress; () on one host."""
        n = self.hosts
        if not (type(src) is int and type(dst) is int and 0 <= src < n and 0 <= dst < n):
            self._check_host(src)   # (the plain case above is the hot one: the details here)
            self._check_host(dst)
        if src == dst:
            return ()
        return (src,) + self._core_paths.get((src, dst), ()) + (self.hosts + dst,)

    def t_en(self, src, dst, size, start):
        """(end, segments) of `size` bytes from src to dst starting at `start` (Fig. 4b)."""
        if not start >= 0:  # capacity traces start at 0; before that there is nothing to read
            raise ValueError("a transfer cannot start before time 0, got %r" % (start,))
        return t_en([self.links[k] for k in self.path(src, dst)], size, start)

    def t_en_relay(self, src, dst, size, start, inbound_end):
        """(end, segments) of `size` bytes relayed cut-through from src to dst: src forwards them
        as they come in on an inbound transfer that starts at `start` and ends at `inbound_end`
        (a distributor passing the model on, an aggregator streaming a sum). It takes the residual
        bottleneck rate from `start`, as t_en, but cannot get ahead of what has come in, so it
        never ends before `inbound_end`: if t_en would, its rate is capped at
        size / (inbound_end - start) (a constant virtual link on the path), which ends it at
        `inbound_end` when the path has that rate free throughout, later otherwise. The data
        plane adds about one chunk (a few ms) that this model leaves out."""
        if not start >= 0:
            raise ValueError("a transfer cannot start before time 0, got %r" % (start,))
        links = [self.links[k] for k in self.path(src, dst)]
        end, segs = t_en(links, size, start)
        if end >= inbound_end or not inbound_end > start:
            return end, segs
        end, segs = t_en(links + [Profile(size / (inbound_end - start))], size, start)
        if end < inbound_end:  # float rounding over several segments: an ulp early
            last = segs[-1]
            segs = segs[:-1] + (Segment(last.t0, inbound_end, last.rate),)
            end = inbound_end
        return end, segs

    def reserve(self, src, dst, segments):
        """NetUp (Fig. 4c): take each segment's rate off every link of the path over its interval."""
        for k in self.path(src, dst):
            for s in segments:
                self.links[k].subtract(s.t0, s.t1, s.rate)

    def send(self, src, dst, size, start):
        """t_en then NetUp: the transfer's (end, segments), capacity reserved."""
        end, segs = self.t_en(src, dst, size, start)
        if segs:
            self.reserve(src, dst, segs)
        return end, segs

    def send_relay(self, src, dst, size, start, inbound_end):
        """t_en_relay then NetUp: the relayed transfer's (end, segments), capacity reserved."""
        end, segs = self.t_en_relay(src, dst, size, start, inbound_end)
        if segs:
            self.reserve(src, dst, segs)
        return end, segs

    def residual(self, link, t):
        return self.links[link].at(t)
