"""mlfabric.sched.sharded (paper §10.2): every server sees the same order, tau_max holds, eq. 18
holds for every applied update, no link is ever booked past its capacity (recomputed from the
transfers), and with one server the result is exactly schedule()'s."""
from collections import defaultdict
from math import inf, isclose

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlfabric.sched import Network, Update, gbps, schedule
from mlfabric.sched.plan import DROP_REASONS
from mlfabric.sched.sharded import (ShardedUpdate, components_t_en, order_sharded,
                                    schedule_sharded)

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RATES = [gbps(r) for r in (1, 2.5, 3.3, 5, 10)]


# --- independent checks, shared with the other sched test files ------------------------------

def check_transfer(t, size=None):
    """A transfer's segments are ordered, disjoint, inside [start, end], and carry its bytes."""
    segs = list(t.segments)
    if size is None:
        size = t.size
    if not segs:
        assert t.start == t.end
        assert size == 0 or t.src == t.dst
        return
    assert segs[0].t0 == t.start and segs[-1].t1 == t.end
    for a, b in zip(segs, segs[1:]):
        assert a.t1 <= b.t0
    for s in segs:
        # >=: network.t_en may close a transfer with a zero-length segment for the last few
        # bytes' float residue; it carries nothing and books nothing
        assert s.t1 >= s.t0 and s.rate > 0
    sent = sum(s.rate * (s.t1 - s.t0) for s in segs)
    assert isclose(sent, size, rel_tol=1e-9, abs_tol=1e-3)


def check_capacity(network, transfers):
    """Recompute every link's use from the transfers' segments and compare with its capacity in
    `network` (the one the schedule started from) at every breakpoint."""
    per = defaultdict(list)
    for t in transfers:
        for k in network.path(t.src, t.dst):
            per[k].extend(t.segments)
    for k, segs in per.items():
        prof = network.links[k]
        points = sorted({s.t0 for s in segs} | {s.t1 for s in segs} | set(prof.t))
        for x in points:
            used = sum(s.rate for s in segs if s.t0 <= x < s.t1)
            cap = prof.at(x)
            assert used <= cap * (1 + 1e-9) + 1e-6, (k, x, used, cap)


def residuals_equal(a, b):
    return all(p.steps() == q.steps() for p, q in zip(a.links, b.links))


# --- random instances ------------------------------------------------------------------------

def link(draw):
    """A constant NIC rate, or a trace that may drop to 0 for a while (never forever)."""
    if draw(st.booleans()):
        return draw(st.sampled_from(RATES))
    times = sorted(draw(st.sets(st.floats(0.01, 0.5), min_size=1, max_size=2)))
    rates = [draw(st.sampled_from(RATES + [0.0])) for _ in times[:-1]]
    rates.append(draw(st.sampled_from(RATES)))
    return [(0.0, draw(st.sampled_from(RATES + [0.0])))] + list(zip(times, rates))


@st.composite
def instances(draw, servers=None):
    hosts = draw(st.integers(4, 8))
    m = servers or draw(st.integers(1, min(3, hosts - 2)))
    net = Network([link(draw) for _ in range(hosts)], [link(draw) for _ in range(hosts)])
    srv = list(range(m))
    others = list(range(m, hosts))
    n = draw(st.integers(0, 8))
    ups = [ShardedUpdate(i, draw(st.sampled_from(others)),
                         tuple(draw(st.sampled_from([0.0, 1e6, 5e6, 2e7, 4e7])) for _ in srv),
                         draw(st.integers(0, 4)), draw(st.sampled_from([0.0, 0.0, 0.01, 0.05])),
                         tuple(draw(st.floats(0, 10)) for _ in srv))
           for i in range(n)]
    aggs = draw(st.lists(st.sampled_from(others), unique=True, max_size=3))
    tau_max = draw(st.sampled_from([inf, 0, 1, 2, 4, 8]))
    v_init = draw(st.integers(0, 4))
    return net, srv, ups, aggs, tau_max, v_init


def _arrival(plan, uid):
    """Independent of sharded.arrival: the end of the transfer that brings uid to the server."""
    ends = [t.end for t in plan.direct if t.ids == (uid,)]
    ends += [a.transfer.end for a in plan.aggregates if uid in a.members]
    assert len(ends) == 1
    return ends[0]


@SETTINGS
@given(instances(), st.sampled_from(["async", "ssp", "sync"]), st.integers(0, 3))
def test_invariants(inst, mode, seed):
    net, srv, ups, aggs, tau_max, v_init = inst
    before = [p.steps() for p in net.links]
    sp, after = schedule_sharded(ups, net, srv, aggregators=aggs, tau_max=tau_max, v_init=v_init,
                                 seed=seed, mode=mode)
    assert [p.steps() for p in net.links] == before          # the input is not modified
    ids = {u.id for u in ups}
    # every update applied once or dropped once, with a known reason
    assert sorted(sp.order + list(sp.dropped)) == sorted(ids)
    assert set(sp.dropped.values()) <= set(DROP_REASONS)
    bound = tau_max if mode == "async" else inf
    for plan in sp.plans:
        # the same order on every server, and the server applies it in that order
        assert plan.order == sp.order and plan.dropped == sp.dropped
        assert [u for c in plan.commits for u in c.ids] == sp.order
        times = [c.time for c in plan.commits]
        assert times == sorted(times)
        for uid in sp.order:
            assert plan.delay(uid) <= bound
    for uid in sp.order:
        # eq. 18: the update is in when its last component is in, and applied when the last
        # server has applied it
        assert sp.arrival(uid) == max(_arrival(p, uid) for p in sp.plans)
        assert sp.commit_time(uid) == max(p.commit_time(uid) for p in sp.plans)
        assert sp.commit_time(uid) >= sp.arrival(uid)
    by_id = {u.id: u for u in ups}
    for j, plan in enumerate(sp.plans):
        for t in plan.transfers():
            check_transfer(t)
        for t in plan.direct + [i for a in plan.aggregates for i in a.inbound]:
            u = by_id[t.ids[0]]
            assert t.src == u.worker and t.size == u.sizes[j] and t.start >= u.ready
    check_capacity(net, sp.transfers())
    # the returned network is the input minus exactly these transfers
    replay = net.copy()
    for t in sp.transfers():
        if t.segments:
            replay.reserve(t.src, t.dst, t.segments)
    for p, q in zip(replay.links, after.links):
        assert len(p.t) == len(q.t)
        for (ta, va), (tb, vb) in zip(p.steps(), q.steps()):
            assert isclose(ta, tb, abs_tol=1e-12) and isclose(va, vb, rel_tol=1e-9, abs_tol=1e-3)


def _eq18(network, u, servers, start=0.0):
    """eq. 18 recomputed with Network.send on a copy: components in the servers' order."""
    nw = network.copy()
    ends = [nw.send(u.worker, s, u.sizes[j], max(u.ready, start))[0]
            for j, s in enumerate(servers)]
    return max(ends)


@SETTINGS
@given(instances())
def test_ordering_is_shortest_first_by_eq18(inst):
    """Without deadlines, Alg. 1 with eq. 18: each pick has the least max-over-components t_en
    given the picks before it, and its recorded t_en is its components' latest end."""
    net, srv, ups, _, _, v_init = inst
    o = order_sharded(ups, net, srv, v_init=v_init)
    by_id = {u.id: u for u in ups}
    nw = net.copy()
    left = set(by_id)
    for uid in o.order:
        best = min(_eq18(nw, by_id[g], srv) for g in left)
        assert isclose(_eq18(nw, by_id[uid], srv), best, rel_tol=1e-12)
        assert o.t_en[uid] == max(t.end for t in o.transfers[uid])
        assert o.t_en[uid] == components_t_en(nw, by_id[uid], srv)[0]
        for j, t in enumerate(o.transfers[uid]):
            check_transfer(t, by_id[uid].sizes[j])
            if t.segments:
                nw.reserve(t.src, t.dst, t.segments)
        left.discard(uid)
    assert not (left - set(o.dropped))
    check_capacity(net, [t for ts in o.transfers.values() for t in ts])


@SETTINGS
@given(instances(servers=1), st.sampled_from(["async", "sync"]), st.integers(0, 3))
def test_one_server_is_schedule(inst, mode, seed):
    net, srv, ups, aggs, tau_max, v_init = inst
    sp, nw = schedule_sharded(ups, net, srv, aggregators=aggs, tau_max=tau_max, v_init=v_init,
                              seed=seed, mode=mode)
    plain = [Update(u.id, u.worker, u.sizes[0], u.version, u.ready, u.norms[0]) for u in ups]
    plan, nw1 = schedule(plain, net, srv[0], aggregators=aggs, tau_max=tau_max, v_init=v_init,
                         seed=seed, mode=mode)
    assert sp.plans[0] == plan
    assert residuals_equal(nw, nw1)
    assert sp.makespan == plan.makespan


def test_eq18_picks_the_smallest_largest_component():
    """u0 is tiny on S0 but huge on S1; u1 is medium on both. Shortest-first per component would
    start with u0; eq. 18 starts with u1, whose last component lands first."""
    net = Network.uniform(4, gbps(10))
    ups = [ShardedUpdate(0, 2, (1e5, 8e7), 0), ShardedUpdate(1, 3, (2e7, 2e7), 0)]
    sp, _ = schedule_sharded(ups, net, [0, 1])
    assert sp.order == [1, 0]
    assert sp.plans[0].order == sp.plans[1].order == [1, 0]


def test_components_share_the_worker_egress():
    """Both components leave through one 1 Gbit/s egress: reserved together, not side by side."""
    net = Network([gbps(10), gbps(10), gbps(1)], [gbps(10)] * 3)
    u = ShardedUpdate(0, 2, (1.25e8, 1.25e8), 0)
    end, parts = components_t_en(net, u, [0, 1])
    assert isclose(end, 2.0)        # 2 x 1 Gbit in sequence through the 1 Gbit/s egress
    sp, _ = schedule_sharded([u], net, [0, 1])
    check_capacity(net, sp.transfers())
    assert isclose(sp.arrival(0), 2.0)


def test_slowest_shard_is_aggregated_first():
    net = Network([gbps(10)] * 6, [gbps(10), gbps(1)] + [gbps(10)] * 4)
    ups = [ShardedUpdate(i, 2 + i % 4, (1e7, 1e7), 0) for i in range(6)]
    sp, _ = schedule_sharded(ups, net, [0, 1], aggregators=[2, 3, 4, 5])
    assert sp.aggregation_order == (1, 0)
    assert "S0" in str(sp) and "S1" in str(sp)


def test_zero_sized_component_arrives_when_ready():
    net = Network.uniform(4, gbps(10))
    ups = [ShardedUpdate(0, 2, (0.0, 1e7), 0, ready=0.05)]
    sp, _ = schedule_sharded(ups, net, [0, 1])
    assert sp.plans[0].commit_time(0) == 0.05
    assert sp.arrival(0) == sp.plans[1].commit_time(0) > 0.05


def test_dropped_everywhere_alike():
    """A stale update is dropped on every server, never half-applied."""
    net = Network.uniform(5, gbps(10))
    ups = [ShardedUpdate(0, 2, (1e7, 1e7), 0), ShardedUpdate(1, 3, (1e7, 1e7), 5)]
    sp, _ = schedule_sharded(ups, net, [0, 1], tau_max=2, v_init=5)
    assert 0 in sp.dropped and sp.order == [1]
    for p in sp.plans:
        assert p.dropped == sp.dropped and p.commit_time(0) is None


@pytest.mark.parametrize("make, match", [
    (lambda n: ShardedUpdate(0, 2, (1e6,), 0), "1 components for 2 servers"),
    (lambda n: ShardedUpdate(0, 2, (1e6, -1.0), 0), "finite and >= 0"),
    (lambda n: ShardedUpdate(0, 2, 5, 0), "sequence of bytes per server"),
    (lambda n: ShardedUpdate(0, 2, (), 0), "empty"),
    (lambda n: ShardedUpdate(0, 2, (1.0, 1.0), 0, norms=(1.0,)), "1 norms for 2 components"),
    (lambda n: ShardedUpdate(0, 9, (1.0, 1.0), 0), "worker 9"),
])
def test_bad_updates(make, match):
    net = Network.uniform(4, gbps(10))
    with pytest.raises(ValueError, match=match):
        schedule_sharded([make(net)], net, [0, 1])


@pytest.mark.parametrize("kwargs, match", [
    (dict(servers=[]), "at least one server"),
    (dict(servers=[0, 0]), "distinct"),
    (dict(servers=[0, 7]), "server 7"),
    (dict(mode="lazy"), "mode must be one of"),
    (dict(tau_max=-1), "tau_max must be >= 0"),
    (dict(aggregators={3: [2]}), "not one of the servers"),
    (dict(aggregators=[2, 11]), "aggregator 11"),
])
def test_bad_arguments(kwargs, match):
    net = Network.uniform(4, gbps(10))
    args = dict(servers=[0, 1])
    args.update(kwargs)
    servers = args.pop("servers")
    with pytest.raises(ValueError, match=match):
        schedule_sharded([ShardedUpdate(0, 2, (1e6, 1e6), 0)], net, servers, **args)


def test_duplicate_ids():
    net = Network.uniform(4, gbps(10))
    ups = [ShardedUpdate(0, 2, (1e6, 1e6), 0), ShardedUpdate(0, 3, (1e6, 1e6), 0)]
    with pytest.raises(ValueError, match="unique"):
        schedule_sharded(ups, net, [0, 1])


def test_a_server_link_that_dies_mid_batch_falls_back_to_the_orderings_transfers():
    """Aggregating S2 first takes the worker's egress until S1's ingress has died; the batch then
    keeps the ordering's transfers (feasible together) instead of failing."""
    nw = Network([1.0, 1.0, 1.0], [1.0, [(0.0, 1.0), (1.0, 0.0)], 1.0])
    sp, after = schedule_sharded([ShardedUpdate(0, 0, (1.0, 2.0), version=0)], nw, [1, 2])
    assert sp.order == [0] and not sp.dropped
    assert [p.direct[0].end for p in sp.plans] == [1.0, 3.0]
    check_capacity(nw, sp.transfers())
    assert ShardedUpdate(1, 0, (1.0,), version=0).norms == (inf,)
