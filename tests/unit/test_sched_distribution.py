"""mlfabric.sched.distribution (paper §10.3): every requester gets the model exactly once, nobody
forwards it before having it, no link is booked past its capacity, the case kept is no worse than
the server serving everyone itself, and distribution strictly wins when the server's egress is the
bottleneck."""
from math import inf, isclose

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlfabric.sched import Network, gbps
from mlfabric.sched.distribution import distribute
from tests.unit.test_sched_sharded import RATES, check_capacity, check_transfer, link

SETTINGS = settings(max_examples=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def instances(draw):
    hosts = draw(st.integers(3, 10))
    server = draw(st.integers(0, hosts - 1))
    egress = [link(draw) for _ in range(hosts)]
    if draw(st.booleans()):   # a slow server egress, where distribution pays
        egress[server] = draw(st.sampled_from(RATES[:2]))
    net = Network(egress, [link(draw) for _ in range(hosts)])
    others = [h for h in range(hosts) if h != server]
    requests = draw(st.lists(st.sampled_from(others), unique=True, max_size=len(others)))
    # distributors: requesters (they relay their own copy) and other hosts, the server included
    pool = st.sampled_from(requests) if requests and draw(st.booleans()) else \
        st.sampled_from(list(range(hosts)))
    dists = draw(st.lists(pool, unique=True, max_size=4))
    size = draw(st.sampled_from([1e6, 1e7, 5e7]))
    start = draw(st.sampled_from([0.0, 0.02, 0.3]))
    return net, server, requests, dists, size, start


def all_direct(network, server, requests, size, start):
    """The reference: the server sends the model to every requester itself, shortest transfer
    first (Alg. 1 with NetUp, recomputed here with Network.send)."""
    nw = network.copy()
    left = list(requests)
    last = start
    while left:
        ends = [(nw.copy().send(server, w, size, start)[0], i) for i, w in enumerate(left)]
        end, i = min(ends)
        if end == inf:
            return inf
        nw.send(server, left.pop(i), size, start)
        last = max(last, end)
    return last


@SETTINGS
@given(instances(), st.integers(0, 3))
def test_invariants(inst, seed):
    net, server, requests, dists, size, start = inst
    before = [p.steps() for p in net.links]
    d, after = distribute(requests, net, server, size, distributors=dists, start=start, seed=seed)
    assert [p.steps() for p in net.links] == before
    transfers = d.transfers()
    # every requester gets exactly one model transfer (or is reported unserved)
    assert sorted(list(d.deliveries) + d.unserved) == sorted(requests)
    into = {}
    for t in transfers:
        check_transfer(t)
        assert t.size == size and t.what == "model"
        into.setdefault(t.dst, []).append(t)
    relays = {r.host: r for r in d.distributors}
    for w in requests:
        if w in d.unserved:
            assert w not in into
        else:
            assert len(into[w]) == 1 and d.deliveries[w].transfer is into[w][0]
            assert d.deliveries[w].source == into[w][0].src
    for h in into:  # the only others that receive it are distributors
        assert h in requests or h in relays
    # nobody forwards the model before it has it, and only the server and distributors send it
    for t in transfers:
        assert t.src == server or t.src in relays
        if t.src == server:
            assert t.start >= start
        else:
            assert t.start >= relays[t.src].inbound.end
            assert relays[t.src].inbound.dst == t.src and relays[t.src].inbound.src == server
    for r in d.distributors:
        assert r.host != server and r.host not in [t.dst for t in d.direct]
        assert [t.dst for t in r.outbound] == [w for w in r.workers if w != r.host]
    check_capacity(net, transfers)
    replay = net.copy()
    for t in transfers:
        if t.segments:
            replay.reserve(t.src, t.dst, t.segments)
    assert all(p.steps() == q.steps() for p, q in zip(replay.links, after.links))
    # the case kept is the best of those enumerated, and no worse than all direct
    assert d.makespan == min(d.cases)
    assert len(d.cases) == len(d.order) + 1
    if not d.unserved:
        assert d.makespan <= all_direct(net, server, requests, size, start) * (1 + 1e-12)
    assert str(d).count("\n") >= len(d.deliveries) - 1


def test_slow_server_fast_distributors_win():
    """A 1 Gbit/s server egress, 10 Gbit/s everywhere else: relaying through two hosts beats the
    server sending 8 copies itself, and sends fewer bytes out of the server."""
    hosts = 11
    net = Network([gbps(1)] + [gbps(10)] * (hosts - 1), [gbps(10)] * hosts)
    requests = list(range(1, 9))
    size = 1.25e8  # 1 s at 1 Gbit/s
    d, _ = distribute(requests, net, 0, size, distributors=[9, 10])
    direct = all_direct(net, 0, requests, size, 0.0)
    assert isclose(direct, 8.0)
    assert d.makespan < direct / 2
    assert d.distributors and d.server_bytes < size * len(requests)
    assert d.makespan == min(d.cases) < d.cases[-1]   # cases[-1]: everyone served directly


def test_requesting_distributor_is_served_once():
    hosts = 8
    net = Network([gbps(1)] + [gbps(10)] * (hosts - 1), [gbps(10)] * hosts)
    requests = list(range(1, hosts))
    d, _ = distribute(requests, net, 0, 1.25e8, distributors=[3])
    assert [r.host for r in d.distributors] == [3]
    r = d.distributors[0]
    assert r.workers[0] == 3 and d.deliveries[3].transfer is r.inbound
    assert d.deliveries[3].source == 0
    assert all(d.deliveries[w].source == 3 for w in r.workers[1:])


def test_nobody_served_twice_when_a_served_requester_comes_up_as_distributor():
    """Host 3 is a distributor in the list but gets its copy from distributor 11 first: it must
    not be sent a second copy by the server to relay."""
    net = Network([gbps(2.5)] + [gbps(5)] * 12, [gbps(10)] * 13)
    for seed in range(6):
        d, _ = distribute(range(1, 11), net, 0, 1.25e8, distributors=[11, 12, 3], seed=seed)
        into = [t.dst for t in d.transfers()]
        assert sorted(w for w in into if w in range(1, 11)) == list(range(1, 11))
        assert len(d.distributors) >= 2 or seed


def test_no_distributors_is_all_direct():
    net = Network([gbps(2.5), gbps(10), gbps(5), gbps(1), gbps(10)],
                  [gbps(10), gbps(1), gbps(5), gbps(10), gbps(2.5)])
    d, _ = distribute([1, 2, 3, 4], net, 0, 1e7)
    assert not d.distributors and d.n_direct == 4
    assert isclose(d.makespan, all_direct(net, 0, [1, 2, 3, 4], 1e7, 0.0))


def test_unreachable_requester_is_reported():
    # host 2's ingress is down for good from t=0.1: a 1 GB model cannot make it
    net = Network([gbps(10)] * 4, [gbps(10), gbps(10), [(0.0, gbps(1)), (0.1, 0.0)], gbps(10)])
    d, _ = distribute([1, 2, 3], net, 0, 1e9, distributors=[1])
    assert d.unserved == [2]
    assert sorted(d.deliveries) == [1, 3]
    assert "unserved" in str(d)


def test_empty_batch():
    d, nw = distribute([], Network.uniform(3, gbps(10)), 0, 1e6, distributors=[1])
    assert d.deliveries == {} and d.makespan == 0.0 and d.transfers() == []


@pytest.mark.parametrize("args, kwargs, match", [
    (([1, 2], 0, 0), {}, "model_size"),
    (([1, 2], 0, float("inf")), {}, "model_size"),
    (([1, 1], 0, 1e6), {}, "once per batch"),
    (([0, 1], 0, 1e6), {}, "its own model"),
    (([1, 9], 0, 1e6), {}, "requester 9"),
    (([1, 2], 7, 1e6), {}, "server 7"),
    (([1, 2], 0, 1e6), dict(distributors=[3, 3]), "distinct"),
    (([1, 2], 0, 1e6), dict(distributors=[-1]), "distributor -1"),
])
def test_bad_arguments(args, kwargs, match):
    requests, server, size = args
    with pytest.raises(ValueError, match=match):
        distribute(requests, Network.uniform(4, gbps(10)), server, size, **kwargs)


def test_a_server_link_that_dies_mid_batch_serves_whom_it_can():
    # 1 B/s for one second, then dead: one of the two 1-byte models gets through
    nw = Network([[(0.0, 1.0), (1.0, 0.0)], 1.0, 1.0], [1.0, 1.0, 1.0])
    dist, after = distribute([1, 2], nw, 0, 1.0)
    assert len(dist.deliveries) == 1 and len(dist.unserved) == 1
    assert set(dist.deliveries) | set(dist.unserved) == {1, 2}
    assert dist.makespan == 1.0


def mean_delivery(d):
    ends = [x.transfer.end for x in d.deliveries.values()]
    return sum(ends) / len(ends) if ends else 0.0


@SETTINGS
@given(instances(), st.integers(0, 3), st.booleans())
def test_mean_objective_minimises_the_mean_delivery(inst, seed, cut_through):
    """objective="mean" picks among the same cases (and pipeline) as the makespan objective, so
    its requesters have the model no later on average; its last one may have it later. Both
    serve every requester once."""
    net, server, requests, dists, size, start = inst
    kw = dict(distributors=dists, start=start, seed=seed, cut_through=cut_through)
    by_makespan, _ = distribute(requests, net, server, size, **kw)
    by_mean, after = distribute(requests, net, server, size, objective="mean", **kw)
    assert sorted(list(by_mean.deliveries) + by_mean.unserved) == sorted(requests)
    assert by_mean.unserved == by_makespan.unserved
    assert mean_delivery(by_mean) <= mean_delivery(by_makespan) * (1 + 1e-12) + 1e-12
    assert by_mean.makespan >= by_makespan.makespan * (1 - 1e-12)
    check_capacity(net, by_mean.transfers())


def test_mean_objective_can_trade_the_last_delivery_for_the_average():
    """On random 8-host networks of 1 and 10 Gbit/s links, the mean objective does find plans
    with an earlier mean delivery than the makespan objective's (then never an earlier end)."""
    import random
    differ = 0
    for trial in range(300):
        rng = random.Random(trial)
        hosts = 8
        egress = [gbps(rng.choice([1, 10, 10])) for _ in range(hosts)]
        ingress = [gbps(rng.choice([1, 10, 10])) for _ in range(hosts)]
        net = Network(egress, ingress)
        requests = list(range(1, hosts))
        kw = dict(distributors=rng.sample(requests, 3), seed=trial)
        a, _ = distribute(requests, net, 0, 1.25e8, **kw)
        b, _ = distribute(requests, net, 0, 1.25e8, objective="mean", **kw)
        if mean_delivery(b) < mean_delivery(a) * (1 - 1e-9):
            differ += 1
            assert b.makespan >= a.makespan
    assert differ > 0


def test_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="objective must be one of makespan, mean"):
        distribute([1], Network.uniform(3, gbps(10)), 0, 1e6, objective="p99")
