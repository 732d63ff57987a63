"""Shared helpers of the scheduler tests: random instances (hypothesis strategies) and independent
checks of a plan against the network's original capacities."""
from math import inf

from hypothesis import strategies as st

from mlfabric.sched import Network, Update

RATES = (0.0, 1.0, 2.5, 3.3, 5.0, 10.0)  # the paper's NIC rates, in units per second, and 0


@st.composite
def traces(draw, allow_dead=False):
    """A piecewise-constant capacity trace: 1-3 steps; the last step is positive unless allowed."""
    n = draw(st.integers(1, 3))
    times = [0.0] + sorted(draw(st.sets(st.sampled_from([0.5, 1.0, 2.0, 3.5, 6.0]),
                                        min_size=n - 1, max_size=n - 1)))
    rates = [draw(st.sampled_from(RATES)) for _ in times]
    if not allow_dead and rates[-1] == 0.0:
        rates[-1] = 10.0
    return list(zip(times, rates))


@st.composite
def instances(draw, max_updates=8, max_hosts=6, allow_dead=False):
    """(network, updates, server=0, aggregators, tau_max, v_init) for random small batches."""
    hosts = draw(st.integers(2, max_hosts))
    egress = [draw(traces(allow_dead)) for _ in range(hosts)]
    ingress = [draw(traces(allow_dead)) for _ in range(hosts)]
    nw = Network(egress, ingress)
    n = draw(st.integers(0, max_updates))
    v_init = draw(st.integers(0, 20))
    sizes = st.sampled_from([1.0, 2.0, 5.0, 7.5, 10.0])
    updates = [Update(i, draw(st.integers(1, hosts - 1)), draw(sizes),
                      version=draw(st.integers(max(0, v_init - 12), v_init)),
                      ready=draw(st.sampled_from([0.0, 0.0, 0.5, 1.5])),
                      norm=draw(st.floats(0.0, 3.0)))
               for i in range(n)]
    aggs = draw(st.lists(st.integers(1, hosts - 1), unique=True, max_size=3))
    tau = draw(st.one_of(st.just(inf), st.integers(0, 12)))
    return nw, updates, 0, aggs, tau, v_init


def breakpoints(network, transfers):
    """Every time at which some capacity or some transfer's rate may change."""
    ts = set()
    for p in network.links:
        ts.update(p.t)
    for t in transfers:
        for s in t.segments:
            ts.update((s.t0, s.t1))
    return sorted(ts)


def link_load(network, transfers, t):
    """Each link's load at time t, recomputed from the transfers' segments alone."""
    load = [0.0] * len(network.links)
    for x in transfers:
        for s in x.segments:
            if s.t0 <= t < s.t1:
                for k in network.path(x.src, x.dst):
                    load[k] += s.rate
    return load


def check_capacity(original, transfers, rel=1e-9):
    """Recompute each link's load from the transfers alone; it never exceeds the original
    capacity."""
    ts = breakpoints(original, transfers)
    for a, b in zip(ts, ts[1:] + [ts[-1] + 1.0]):
        mid = (a + b) / 2
        load = link_load(original, transfers, mid)
        for k, used in enumerate(load):
            cap = original.links[k].at(mid)
            assert used <= cap * (1 + rel) + 1e-12, (
                "link %d carries %r > capacity %r at t=%r" % (k, used, cap, mid))


def check_bytes(transfers, rel=1e-9):
    """Each transfer's segments carry exactly its size, in time order (gaps where its path has no
    capacity), from start to end."""
    for t in transfers:
        if not t.segments:
            assert t.start == t.end
            continue
        sent = sum(s.rate * (s.t1 - s.t0) for s in t.segments)
        assert abs(sent - t.size) <= rel * t.size + 1e-12, (t, sent)
        assert t.segments[0].t0 == t.start and t.segments[-1].t1 == t.end
        for s, s2 in zip(t.segments, t.segments[1:]):
            assert s.t1 <= s2.t0 and s.rate > 0


def check_work_conserving(original, after, transfers, ready):
    """Fig. 4b: from the moment a transfer may start until it ends, its path's residual bottleneck
    is zero once everything is reserved — it took all there was, so its path never idled while it
    waited. `ready(t)` gives the earliest time the transfer could start."""
    ts = breakpoints(original, transfers)
    for t in transfers:
        path = original.path(t.src, t.dst)
        if not path:
            continue
        r = ready(t)
        for a, b in zip(ts, ts[1:]):
            if b <= r or a >= t.end:
                continue
            mid = (max(a, r) + min(b, t.end)) / 2
            bottleneck = min(after.links[k].at(mid) for k in path)
            assert bottleneck == 0.0, (
                "transfer %s->%s of %r could use %r more at t=%r" % (t.src, t.dst, t.ids,
                                                                    bottleneck, mid))
