"""The network as it really is, for the scheduled policies: every link's true capacity over time
(worker NICs follow an N preset, the server's and replica's machines run at the base rate) minus
every transfer executed so far. Plans are made on the monitor's lagged view (mlfabric.sched.view) and then
executed here with mlfabric.sched.Network.send (t_en + NetUp, paper §5.1, Fig. 4): each transfer
takes the whole residual bottleneck rate from its start, so a stale view costs real time.

Hosts: 0..W-1 are worker machines, then the server (W), then the replica (W+1) if any. Link ids are
mlfabric.sched.Network's: egress(h) = h, ingress(h) = hosts + h.

The capacity trace is generated ahead in chunks of periods. A transfer's t_en is only computed
against trace that exists: if it would end past the generated horizon, the trace is extended and
t_en recomputed before anything is reserved, so no reservation ever rests on an assumed rate.
Breakpoints in the past are pruned (nothing is sent before "now"), which keeps t_en walks short.

Fast paths (each gives bit-identical results; tests/unit/test_sim.py holds them to the plain versions):
send calls mlfabric.sched.network.send_path (t_en + NetUp, native when built) directly on the
two links of the path; capacities(t) reads every link's capacity once per NIC-rate period for the monitor; trace
extension finds the new breakpoints with numpy.
"""
from bisect import bisect_right
from math import inf

import numpy as np

from mlfabric.sched import Network
from mlfabric.sched.network import send_path

_CHUNK_PERIODS = 64


class TrueNetwork:
    def __init__(self, trace, worker_hosts, fixed_hosts, base_rate):
        self.trace = trace
        self.worker_hosts = int(worker_hosts)
        self.hosts = self.worker_hosts + int(fixed_hosts)
        self.base_rate = float(base_rate)
        self.period = trace.period
        self._periods = _CHUNK_PERIODS
        self.horizon = self._periods * self.period
        fixed = [[(0.0, self.base_rate)] for _ in range(int(fixed_hosts))]
        until = self.horizon - self.period / 2
        egress = [trace.steps(h, until) for h in range(self.worker_hosts)] + fixed
        ingress = ([trace.steps(self.worker_hosts + h, until) for h in range(self.worker_hosts)]
                   + [list(f) for f in fixed])
        self.net = Network(egress, ingress)
        self.touched = set()  # hosts whose links got reservations since the last prune
        self._trace_of = [self.trace_link(link) for link in range(2 * self.hosts)]
        self._cap_period, self._cap_list = None, None  # capacities(): the period cached
        self._varying = [(link, k) for link, k in enumerate(self._trace_of) if k is not None]

    # --- capacity (what the monitor measures) -----------------------------------------------------
    def trace_link(self, link):
        """Index of a Network link in the NIC trace, or None for the fixed machines' links."""
        h, direction = link % self.hosts, link // self.hosts
        if h >= self.worker_hosts:
            return None
        return h + direction * self.worker_hosts

    def capacity(self, link, t):
        """The true capacity of `link` at time t (before any reservation; t < 0 reads period 0)."""
        k = self._trace_of[link]
        return self.base_rate if k is None else self.trace.rate(k, t)

    # --- transfers --------------------------------------------------------------------------------
    def send(self, src, dst, size, start, segments=True):
        """Execute a transfer: (end, segments), its capacity reserved on the true network;
        segments=False: (end, None), the Segment objects not built (the simulator needs the end).

        Network.send's arithmetic, called one level down: mlfabric.sched.network.send_path (t_en
        over the path's two links, then NetUp on each, as Network.reserve; in C++ on the
        Profiles' lists when built). The core is full-bisection here (no core links), so a path
        is exactly (egress(src), ingress(dst)); this skips Network.path's per-call host checks on
        hosts this module numbered itself. Same arithmetic, same order, same floats. send_path
        reserves nothing when the transfer would end past the generated horizon: the trace is
        then extended and the walk redone."""
        if src == dst:  # Network.send: an empty path takes no network time
            return start, ()
        if not start >= 0:
            raise ValueError("a transfer cannot start before time 0, got %r" % (start,))
        links = self.net.links
        path = (links[src], links[self.hosts + dst])
        while True:
            end, segs = send_path(path, size, start, self.horizon, segments)
            if end == inf:
                raise RuntimeError("no capacity from host %d to %d after t=%r: capacities must "
                                   "stay > 0" % (src, dst, start))
            if end <= self.horizon:
                break
            self._extend(end)
        if size > 0:  # something was reserved (a positive size always has a segment)
            self.touched.add(src)
            self.touched.add(dst)
        return end, segs

    def send_end(self, src, dst, size, start):
        """send(src, dst, size, start)[0]: the end of an executed transfer (what the simulator
        needs), without building its Segments."""
        return self.send(src, dst, size, start, False)[0]

    def capacities(self, t):
        """Every link's true capacity at time t, as a list by link id (shared: do not modify).
        The same numbers as capacity(link, t), read once per NIC-rate period."""
        k = int(t // self.period) if t > 0 else 0
        if k != self._cap_period:
            # link ids: worker egress, fixed egress, worker ingress, fixed ingress (trace_link)
            rates = self.trace.period_rates(k).tolist()
            w, fixed = self.worker_hosts, [self.base_rate] * (self.hosts - self.worker_hosts)
            self._cap_list = rates[:w] + fixed + rates[w:2 * w] + fixed
            self._cap_period = k
        return self._cap_list

    def _extend(self, until):
        """Generate trace periods until the horizon passes `until` (plus a chunk).

        Per link, the first new period is added one link at a time (the link's last breakpoint
        may sit exactly at the old horizon, where a reservation ended). Past it nothing is
        reserved, so each later period adds a breakpoint exactly where its rate differs from the
        period before: those are found for all links at once with numpy, and appended."""
        old = self._periods
        new = max(old + _CHUNK_PERIODS, int(until // self.period) + 1 + _CHUNK_PERIODS)
        links = self.net.links
        rates = np.array([self.trace.period_rates(j) for j in range(old, new)])
        first = rates[0].tolist()
        t0 = old * self.period
        for link, k in self._varying:
            p, r = links[link], first[k]
            if p.t[-1] == t0:
                p.v[-1] = r
                if len(p.v) > 1 and p.v[-2] == r:
                    p.t.pop()
                    p.v.pop()
            elif p.v[-1] != r:
                p.t.append(t0)
                p.v.append(r)
        if new - old > 1:
            times = np.arange(old + 1, new, dtype=np.float64) * self.period
            changed = rates[1:] != rates[:-1]
            for link, k in self._varying:
                at = changed[:, k]
                if at.any():
                    links[link].t.extend(times[at].tolist())
                    links[link].v.extend(rates[1:, k][at].tolist())
        self._periods = new
        self.horizon = new * self.period

    def prune(self, now):
        """Forget the breakpoints before `now` of every link reserved since the last prune (the
        others gain breakpoints only from trace extensions, one per period at most)."""
        links = self.net.links
        for h in self.touched:
            prune(links[h], now)
            prune(links[self.hosts + h], now)
        self.touched = set()


def prune(profile, now):
    """Drop a Profile's breakpoints before `now` (its value before `now` becomes that at `now`)."""
    k = bisect_right(profile.t, now) - 1
    if k > 0:
        profile.t = [0.0] + profile.t[k + 1:]
        profile.v = profile.v[k:]
