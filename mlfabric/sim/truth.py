"""The network as it really is, for the scheduled policies: every link's true capacity over time
(worker NICs follow an N preset, the server's and replica's machines run at the base rate) minus
every transfer executed so far. Plans are made on the monitor's lagged view (monitor.py) and then
executed here with mlfabric.sched.Network.send (t_en + NetUp, paper §5.1, Fig. 4): each transfer
takes the whole residual bottleneck rate from its start, so a stale view costs real time.

Hosts: 0..W-1 are worker machines, then the server (W), then the replica (W+1) if any. Link ids are
mlfabric.sched.Network's: egress(h) = h, ingress(h) = hosts + h.

The capacity trace is generated ahead in chunks of periods. A transfer's t_en is only computed
against trace that exists: if it would end past the generated horizon, the trace is extended and
t_en recomputed before anything is reserved, so no reservation ever rests on an assumed rate.
Breakpoints in the past are pruned (nothing is sent before "now"), which keeps t_en walks short.
"""
from bisect import bisect_right
from math import inf

from mlfabric.sched import Network

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
    def send(self, src, dst, size, start):
        """Execute a transfer: (end, segments), its capacity reserved on the true network."""
        net = self.net
        while True:
            end, segs = net.t_en(src, dst, size, start)
            if end == inf:
                raise RuntimeError("no capacity from host %d to %d after t=%r: capacities must "
                                   "stay > 0" % (src, dst, start))
            if end <= self.horizon:
                break
            self._extend(end)
        if segs:
            net.reserve(src, dst, segs)
            self.touched.add(src)
            self.touched.add(dst)
        return end, segs

    def _extend(self, until):
        """Generate trace periods until the horizon passes `until` (plus a chunk)."""
        old = self._periods
        new = max(old + _CHUNK_PERIODS, int(until // self.period) + 1 + _CHUNK_PERIODS)
        varying = [(link, self.trace_link(link)) for link in range(2 * self.hosts)
                   if self.trace_link(link) is not None]
        for j in range(old, new):
            t0, rates = j * self.period, self.trace.period_rates(j).tolist()
            for link, k in varying:
                p, r = self.net.links[link], rates[k]
                # past the horizon nothing is reserved: the residual there is the trace's last rate
                if p.t[-1] == t0:
                    p.v[-1] = r
                    if len(p.v) > 1 and p.v[-2] == r:
                        p.t.pop()
                        p.v.pop()
                elif p.v[-1] != r:
                    p.t.append(t0)
                    p.v.append(r)
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
