"""The scheduler's core (network model, Alg. 2 ordering, Alg. 3 aggregation, the batch plan): the
paper's worked examples, and the invariants over random instances (hypothesis)."""
from math import inf

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.sched import (DROP_LOOKAHEAD, DROP_NO_PATH, DROP_REASONS, DROP_SLOW, DROP_STALE,
                            Network, Profile, Update, schedule, t_en)
from mlfabric.sched.aggregation import det_agg
from mlfabric.sched.ordering import order_updates
from tests.sched_util import check_bytes, check_capacity, check_work_conserving, instances

PROPS = settings(max_examples=60, deadline=None)


# --- network model -------------------------------------------------------------------------------
def test_t_en_follows_the_residual_bottleneck():
    # Fig. 4b in numbers: 30 units starting at 0 over a residual of 2 on [0,3), 6 on [3,5),
    # 0 on [5,6), 4 after: 6 + 12 by t=5, nothing until 6, then 12 more at 4/s -> t_en = 9.
    p = Profile([(0, 2), (3, 6), (5, 0), (6, 4)])
    end, segs = t_en([p], 30.0, 0.0)
    assert end == 9.0
    assert [(s.t0, s.t1, s.rate) for s in segs] == [(0, 3, 2), (3, 5, 6), (6, 9, 4)]
    # the bottleneck is the minimum over the path, at every instant
    q = Profile([(0, 10), (4, 1)])
    end2, segs2 = t_en([p, q], 30.0, 0.0)
    # 6 by t=3, 12 by t=4, 13 by t=5, nothing on [5,6), the other 17 at 1/s
    assert [(s.t0, s.t1, s.rate) for s in segs2] == [(0, 3, 2), (3, 4, 6), (4, 5, 1), (6, 23, 1)]
    assert end2 == 23.0


def test_netup_leaves_the_bottleneck_empty_and_merges_segments():
    nw = Network([10.0, 4.0], [10.0, 10.0])
    end, segs = nw.send(1, 0, 8.0, 1.0)  # host 1 egress (4/s) is the bottleneck
    assert end == 3.0
    assert nw.links[nw.egress(1)].steps() == [(0, 4.0), (1.0, 0.0), (3.0, 4.0)]
    assert nw.links[nw.ingress(0)].steps() == [(0, 10.0), (1.0, 6.0), (3.0, 10.0)]
    nw.send(1, 0, 8.0, 3.0)  # back to back: the two saturated stretches become one segment
    assert nw.links[nw.egress(1)].steps() == [(0, 4.0), (1.0, 0.0), (5.0, 4.0)]


def test_a_path_without_capacity_never_ends():
    nw = Network([[(0, 5.0), (2, 0.0)], 5.0], [5.0, 5.0])
    assert nw.t_en(0, 1, 10.0, 0.0)[0] == 2.0
    assert nw.t_en(0, 1, 11.0, 0.0) == (inf, None)
    assert nw.t_en(1, 1, 11.0, 3.0) == (3.0, ())  # same host: no network time


@pytest.mark.parametrize("bad, match", [
    (dict(egress=[[(1.0, 5.0)]], ingress=[5.0]), "start at time 0"),
    (dict(egress=[[(0.0, 5.0), (0.0, 1.0)]], ingress=[5.0]), "must increase"),
    (dict(egress=[-1.0], ingress=[5.0]), ">= 0"),
    (dict(egress=[5.0, 5.0], ingress=[5.0]), "same hosts"),
    (dict(egress=[5.0], ingress=[5.0], core=[1.0], paths={(0, 0): [3]}), "core link 3"),
])
def test_bad_networks_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        Network(**bad)


def test_bad_batches_are_rejected():
    nw = Network.uniform(3, 10.0)
    us = [Update(0, 1, 1.0, 0)]
    with pytest.raises(ValueError, match="mode"):
        schedule(us, nw, 0, mode="bogus")
    with pytest.raises(ValueError, match="tau_max"):
        schedule(us, nw, 0, tau_max=-1)
    with pytest.raises(ValueError, match="unique"):
        schedule(us + us, nw, 0)
    with pytest.raises(ValueError, match="host 7"):
        schedule([Update(0, 7, 1.0, 0)], nw, 0)


# --- the paper's examples --------------------------------------------------------------------------
def test_shortest_transfer_first():
    # Alg. 1: three updates to a 10/s server from hosts of different egress: smallest t_en first
    nw = Network([10.0, 1.0, 5.0, 10.0], [10.0] * 4)
    us = [Update(0, 1, 2.0, 0), Update(1, 2, 2.0, 0), Update(2, 3, 2.0, 0)]
    o = order_updates(us, nw, 0)
    assert o.order == [2, 1, 0] and not o.dropped
    ends = [o.transfers[g].end for g in o.order]
    assert ends == sorted(ends)


def test_deadline_forces_an_update_forward():
    # the slow update is due at position 1, so it goes first although it is not the shortest
    nw = Network([10.0, 5.0, 10.0], [10.0] * 3)
    us = [Update(0, 1, 10.0, version=0), Update(1, 2, 10.0, version=5)]
    o = order_updates(us, nw, 0, v_init=5, tau_max=1)  # dl(u0) = 0 + 1 - 5 < 1: already stale
    assert o.dropped == {0: DROP_STALE} and o.order == [1]
    o = order_updates(us, nw, 0, v_init=5, tau_max=6)  # dl(u0) = 1, dl(u1) = 6
    assert o.order == [0, 1]


def test_fig5_lookahead_drops_the_slow_due_update():
    # Fig. 5: g1 (dl 1) behind a 10 Mbps link would take 10 s; g2 (dl 5) then finishes in 1.1 s
    # on the 90 Mbps left, before g1: g1 is dropped at the worker and g2 is sent at once.
    mbps = 1e6 / 8
    nw = Network([100 * mbps, 10 * mbps, 100 * mbps], [100 * mbps] * 3)
    size = 100 * mbps  # 100 Mbit: 10 s at 10 Mbps, 1.11 s at 90 Mbps
    us = [Update(1, 1, size, version=0), Update(2, 2, size, version=4)]
    o = order_updates(us, nw, 0, v_init=0, tau_max=1)
    assert o.dropped == {1: DROP_LOOKAHEAD}
    assert o.order == [2] and o.transfers[2].start == 0.0 and o.transfers[2].end == 1.0
    assert {DROP_STALE, DROP_LOOKAHEAD, DROP_NO_PATH} <= set(DROP_REASONS)


def test_fig2_aggregation_shortens_the_batch_and_unloads_the_server():
    # Fig. 2: four equal updates, full bisection, one aggregator. Direct: 4 transfer times at the
    # server. With aggregation g1, g2 go direct while g3, g4 stream to the aggregator; its sum
    # reaches the server at 3 transfer times, with 3 updates' bytes instead of 4.
    nw = Network.uniform(6, 10.0)
    us = [Update(i, i + 1, 10.0, version=0) for i in range(4)]
    direct, _ = schedule(us, nw, 0)
    agg, _ = schedule(us, nw, 0, aggregators=[5])
    assert direct.makespan == 4.0 and direct.server_bytes == 40.0
    assert agg.makespan == 3.0 and agg.server_bytes == 30.0
    assert [c.ids for c in agg.commits] == [(0,), (1,), (2, 3)]
    assert agg.next_hop(2) == 5 and agg.next_hop(0) == 0
    # the chosen case is the best of all |U|+1 cases
    cases = [det_agg(n, [0, 1, 2, 3], {u.id: u for u in us}, nw, 0, [5], 0.0)[0]
             for n in range(5)]
    assert agg.makespan == min(cases)


def test_norm_cap_closes_a_group_before_it_outweighs_the_cap():
    # Fig. 2's batch with norms 1, 1, 1, 1: the paper's grouping sends (2, 3) as one aggregate of
    # norm 2. A cap of 2 keeps it; a cap of 1.5 splits it, and then the batch takes as long as
    # sending everything direct; lighter updates still share an aggregate under the same cap.
    nw = Network.uniform(7, 10.0)
    us = [Update(i, i + 1, 10.0, version=0, norm=1.0) for i in range(4)]
    capped2, _ = schedule(us, nw, 0, aggregators=[5], norm_cap=2.0, engine="reference")
    assert [c.ids for c in capped2.commits] == [(0,), (1,), (2, 3)]
    one, _ = schedule(us, nw, 0, aggregators=[5], norm_cap=1.5)
    assert one.makespan == 4.0 and all(len(a.members) == 1 for a in one.aggregates)
    light = us[:2] + [Update(i, i + 1, 10.0, version=0, norm=0.5) for i in (2, 3)]
    two, _ = schedule(light, nw, 0, aggregators=[5], norm_cap=1.5)
    assert two.makespan == 3.0 and [c.ids for c in two.commits] == [(0,), (1,), (2, 3)]
    # an update heavier than the cap still goes, alone
    heavy = [Update(i, i + 1, 10.0, version=0, norm=5.0) for i in range(4)]
    h, _ = schedule(heavy, nw, 0, aggregators=[5, 6], norm_cap=1.0)
    assert sorted(h.order) == [0, 1, 2, 3] and all(len(a.members) == 1 for a in h.aggregates)


@PROPS
@given(instances(), st.floats(0.0, 6.0))
def test_norm_cap_bounds_every_aggregate_and_keeps_plans_valid(inst, cap):
    nw, us, server, aggs, tau, v_init = inst
    plan, after = schedule(us, nw, server, aggregators=aggs, tau_max=tau, v_init=v_init,
                           norm_cap=cap)
    by_id = {u.id: u for u in us}
    for a in plan.aggregates:
        assert len(a.members) == 1 or sum(by_id[m].norm for m in a.members) <= cap
    check_capacity(nw, plan.transfers())
    # the cap changes grouping only: ordering and drops are the uncapped plan's
    free, _ = schedule(us, nw, server, aggregators=aggs, tau_max=tau, v_init=v_init)
    assert plan.order == free.order and plan.dropped == free.dropped
    # (no makespan relation: Alg. 3's greedy fill is not optimal, and a cap can happen to help)
    same, _ = schedule(us, nw, server, aggregators=aggs, tau_max=tau, v_init=v_init,
                       norm_cap=inf, engine="reference")
    assert same.commits == free.commits


def test_norm_cap_needs_the_reference_loops():
    nw = Network.uniform(3, 10.0)
    us = [Update(0, 1, 10.0, 0, norm=1.0)]
    with pytest.raises(ValueError, match="norm_cap"):
        schedule(us, nw, 0, norm_cap=1.0, engine="fast")
    with pytest.raises(ValueError, match="norm_cap must be >= 0"):
        schedule(us, nw, 0, norm_cap=-1.0)


def test_local_member_costs_no_network():
    nw = Network.uniform(3, 10.0)
    us = [Update(0, 1, 10.0, 0), Update(1, 2, 10.0, 0), Update(2, 2, 10.0, 0)]
    plan, _ = schedule(us, nw, 0, aggregators=[2])
    for a in plan.aggregates:
        for t in a.inbound:
            if t.src == a.aggregator:
                assert t.segments == () and t.start == t.end


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_no_capacity_drops_with_a_reason(engine):
    nw = Network([5.0, [(0, 5.0), (1, 0.0)], 5.0], [5.0, 5.0, 5.0])
    us = [Update(0, 1, 50.0, 0), Update(1, 1, 1.0, 0)]
    plan, _ = schedule(us, nw, 0, engine=engine)
    assert plan.order == [1] and plan.dropped == {0: DROP_NO_PATH}
    # an update due first that can never arrive is dropped alone: the others still go
    us = [Update(0, 1, 50.0, version=0), Update(1, 2, 1.0, version=5)]
    plan, _ = schedule(us, nw, 0, tau_max=1, engine=engine)
    assert plan.dropped == {0: DROP_NO_PATH} and plan.order == [1]


# --- invariants over random instances --------------------------------------------------------------
@PROPS
@given(instances(allow_dead=True), st.sampled_from(["reference", "fast"]))
def test_plan_invariants(inst, engine):
    nw, updates, server, aggs, tau, v_init = inst
    plan, after = schedule(updates, nw, server, aggregators=aggs, tau_max=tau, v_init=v_init,
                           engine=engine)
    ids = {u.id for u in updates}
    # every update applied exactly once or dropped with a known reason
    assert len(plan.order) == len(set(plan.order))
    assert set(plan.order) | set(plan.dropped) == ids
    assert not set(plan.order) & set(plan.dropped)
    assert set(plan.dropped.values()) <= set(DROP_REASONS)
    # no applied update violates tau_max
    for uid in plan.order:
        assert plan.delay(uid) <= tau
    # commits: the order's sequence, non-decreasing in time, each update once
    assert [g for c in plan.commits for g in c.ids] == plan.order
    times = [c.time for c in plan.commits]
    assert times == sorted(times)
    # aggregation preserves the commit order of the no-aggregation plan
    plain, _ = schedule(updates, nw, server, tau_max=tau, v_init=v_init)
    assert plain.order == plan.order and plain.dropped == plan.dropped
    assert not plain.aggregates
    # ... and never ends later than it (case n = |U| is the plain plan)
    assert plan.makespan <= plain.makespan
    # an aggregate's members are consecutive positions
    for a in plan.aggregates:
        pos = [plan.position(g) for g in a.members]
        assert pos == list(range(pos[0], pos[0] + len(pos)))
        assert a.transfer.start >= a.ready
    # bytes, capacity, work conservation
    transfers = plan.transfers()
    check_bytes(transfers)
    check_capacity(nw, transfers)
    ready = {}
    for t in plan.direct:
        ready[id(t)] = max(plan.updates[t.ids[0]].ready, plan.start)
    for a in plan.aggregates:
        for t in a.inbound:
            ready[id(t)] = max(plan.updates[t.ids[0]].ready, plan.start)
        ready[id(a.transfer)] = a.ready
    check_work_conserving(nw, after, transfers, lambda t: ready[id(t)])
    # the input network is untouched
    fresh = schedule(updates, nw, server, aggregators=aggs, tau_max=tau, v_init=v_init)[0]
    assert fresh.commits == plan.commits
    str(plan)


@PROPS
@given(instances())
def test_aggregation_keeps_the_server_busy(inst):
    """§5.2's constraint: once some group has reached the server, every later group has finished
    arriving at its aggregator by the time the server has received the groups before it."""
    nw, updates, server, aggs, tau, v_init = inst
    plan, _ = schedule(updates, nw, server, aggregators=aggs, tau_max=tau, v_init=v_init)
    t_max = max([t.end for t in plan.direct], default=None)
    for a in plan.aggregates:
        if t_max is not None:
            assert a.ready <= t_max
        t_max = a.transfer.end if t_max is None else max(t_max, a.transfer.end)


@PROPS
@given(instances())
def test_shortest_first_arrivals_never_decrease(inst):
    """Without deadlines (Alg. 1) t_en only grows as capacity is reserved, so arrivals come in
    order and the server never waits for an earlier position; sync and SSP drop nothing."""
    nw, updates, server, aggs, _, v_init = inst
    for mode in ("sync", "ssp"):
        plan, _ = schedule(updates, nw, server, mode=mode, v_init=v_init)
        assert not plan.dropped and len(plan.order) == len(updates)
        arrivals = [t.end for t in plan.direct]
        assert arrivals == sorted(arrivals)
        assert [c.time for c in plan.commits] == arrivals


def test_the_scheduler_and_simulator_start_no_mpi():
    """mlfabric.sched is pure computation: importing it (and the simulator) must neither start
    MPI nor pay for importing it."""
    import subprocess
    import sys
    code = ("import sys, mlfabric.sched, mlfabric.sim; "
            "sys.exit(1 if 'mpi4py.MPI' in sys.modules or 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@pytest.mark.parametrize("change, match", [
    (dict(v_init=float("nan")), "v_init"),
    (dict(tau_max=float("nan")), "tau_max"),
    (dict(start=-1.0), "start"),
    (dict(start=float("inf")), "start"),
    (dict(after=float("nan")), "after"),
    (dict(aggregators=[2, 2]), "distinct"),
    (dict(aggregators=[True]), "host True"),
    (dict(updates=[Update(0, 1, -1.0, 0)]), "size"),
    (dict(updates=[Update(0, 1, float("nan"), 0)]), "size"),
    (dict(updates=[Update(0, 1, 1.0, float("nan"))]), "version"),
    (dict(updates=[Update(0, 1, 1.0, 0, ready=float("inf"))]), "ready"),
])
@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_bad_values_are_refused_by_every_engine(change, match, engine):
    kw = dict(updates=[Update(0, 1, 1.0, 0)], network=Network.uniform(3, 1.0), server=0)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        schedule(kw.pop("updates"), kw.pop("network"), kw.pop("server"), engine=engine, **kw)


def test_numpy_hosts_are_hosts():
    import numpy as np
    nw = Network.uniform(3, 1.0)
    plan, _ = schedule([Update(0, np.int64(1), 1.0, 0)], nw, np.int64(0), aggregators=[np.int64(2)])
    assert plan.order == [0]
    with pytest.raises(ValueError, match="twice"):
        Network([1.0, 1.0], [1.0, 1.0], core=[1.0], paths={(1, 0): [0, 0]})


# --- slow-link drop against the next batch (scheduler.py header; not in the paper) -------------
@pytest.mark.parametrize("engine", ["reference", "auto"])
def test_an_update_slower_than_the_next_batch_is_dropped_at_its_worker(engine):
    # server 0's ingress takes 10 B/s; worker 1's egress 1 B/s (10 s for 10 B), worker 2's 10 B/s
    # (1 s), worker 3's 4 B/s (2.5 s). Worker 2's update sent at the next batch (0.5) would be in
    # at 1.5: waiting for workers 1 and 3 would hold every later commit, so they are dropped.
    nw = Network([10.0, 1.0, 10.0, 4.0], [10.0] * 4)
    us = [Update(1, 1, 10.0, version=0), Update(2, 2, 10.0, version=0),
          Update(3, 3, 10.0, version=0)]
    plan, _ = schedule(us, nw, 0, tau_max=10, next_batch=0.5, engine=engine)
    assert plan.dropped == {1: DROP_SLOW, 3: DROP_SLOW} and plan.order == [2]
    assert set(plan.updates) == {1, 2, 3}     # every update is applied or dropped with a reason
    assert "next batch" in DROP_REASONS[DROP_SLOW]
    # the paper's batch alone (the default) keeps them all, the slow ones last
    plan, _ = schedule(us, nw, 0, tau_max=10, engine=engine)
    assert plan.dropped == {} and plan.order == [2, 3, 1]
    # a next batch late enough that even worker 1 is first: nothing is dropped
    plan, _ = schedule(us, nw, 0, tau_max=10, next_batch=9.5, engine=engine)
    assert plan.dropped == {} and sorted(plan.order) == [1, 2, 3]


def test_the_servers_queue_trips_no_one_and_the_fastest_always_stays():
    # The server's ingress is booked until t=3, which delays every sender alike: 1 B takes 0.1 s
    # at full rate, 0.2 s at half (within the 0.15 s to the next batch: kept), 1 s at a tenth
    # (dropped).
    nw = Network([10.0, 10.0, 5.0, 1.0], [10.0] * 4)
    nw.links[nw.ingress(0)].subtract(0.0, 3.0, 10.0)
    us = [Update(1, 1, 1.0, version=0), Update(2, 2, 1.0, version=0),
          Update(3, 3, 1.0, version=0)]
    plan, _ = schedule(us, nw, 0, tau_max=10, next_batch=0.15)
    assert plan.dropped == {3: DROP_SLOW} and plan.order == [1, 2]
    # every sender slower than the server's NIC (a 10x server): none is dropped, nor is the
    # fastest of a batch of slow senders alone
    fast_server = Network([100.0, 10.0, 10.0], [100.0] * 3)
    us = [Update(1, 1, 10.0, version=0), Update(2, 2, 10.0, version=0)]
    plan, _ = schedule(us, fast_server, 0, tau_max=10, next_batch=0.1)
    assert plan.dropped == {} and sorted(plan.order) == [1, 2]
    plan, _ = schedule(us[:1], Network([10.0, 1.0], [10.0] * 2), 0, tau_max=10,
                       next_batch=0.1)
    assert plan.dropped == {} and plan.order == [1]


@pytest.mark.parametrize("engine", ["reference", "auto"])
def test_a_batch_of_slow_senders_alone_is_dropped_for_a_faster_peer(engine):
    # Workers 1 and 2 send at a tenth of the server's rate (10 B: 10 s); worker 3, a peer that
    # pushes but has nothing in this batch, would be in at 0.5 + 1 = 1.5 s from the next batch:
    # waiting 10 s for the batch's fastest would hold every later commit, so both are dropped.
    nw = Network([10.0, 1.0, 1.0, 10.0, 1.0], [10.0] * 5)
    us = [Update(1, 1, 10.0, version=0), Update(2, 2, 10.0, version=0)]
    plan, _ = schedule(us, nw, 0, tau_max=10, next_batch=0.5, peers=[3], engine=engine)
    assert plan.dropped == {1: DROP_SLOW, 2: DROP_SLOW} and plan.order == []
    # liveness: without a peer, or with peers no faster than the batch (worker 4 at a tenth
    # too, one of the batch's own), the batch's fastest stays
    for peers in ([], [4], [1, 4]):
        plan, _ = schedule(us, nw, 0, tau_max=10, next_batch=0.5, peers=peers, engine=engine)
        assert plan.dropped == {} and sorted(plan.order) == [1, 2], (peers, plan.dropped)
    # a peer only counts from the next batch: a batch fast enough to beat it keeps its own
    plan, _ = schedule([Update(5, 3, 10.0, version=0)], nw, 0, tau_max=10, next_batch=0.5,
                       peers=[3], engine=engine)
    assert plan.dropped == {} and plan.order == [5]
    # the peer's path is the one booked: its egress busy until t=20, it is no reference
    busy = nw.copy()
    busy.links[busy.egress(3)].subtract(0.0, 20.0, 10.0)
    plan, _ = schedule(us, busy, 0, tau_max=10, next_batch=0.5, peers=[3], engine=engine)
    assert plan.dropped == {} and sorted(plan.order) == [1, 2]
    for bad, match in (([0], "server"), ([9], "not in this network"), ([True], "not in this")):
        with pytest.raises(ValueError, match=match):
            schedule(us, nw, 0, tau_max=10, next_batch=0.5, peers=bad, engine=engine)
    # without next_batch (the paper's batch alone) peers change nothing
    plan, _ = schedule(us, nw, 0, tau_max=10, peers=[3], engine=engine)
    assert plan.dropped == {} and sorted(plan.order) == [1, 2]


def test_the_slow_link_drop_is_async_only_and_leaves_no_path_to_alg2():
    nw = Network([10.0, 1.0, 0.0, 10.0], [10.0] * 4)   # worker 2 has no capacity, ever
    us = [Update(1, 1, 10.0, version=0), Update(2, 2, 10.0, version=0),
          Update(3, 3, 10.0, version=0)]
    plan, _ = schedule(us, nw, 0, tau_max=10, next_batch=0.1)
    assert plan.dropped == {1: DROP_SLOW, 2: DROP_NO_PATH}
    for mode in ("sync", "ssp"):   # their staleness is the clock's: nothing that can arrive drops
        plan, _ = schedule([us[0], us[2]], nw, 0, mode=mode, next_batch=0.1)
        assert plan.dropped == {} and sorted(plan.order) == [1, 3]
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="next_batch"):
            schedule(us, nw, 0, tau_max=10, next_batch=bad)
    # duplicate ids are refused before any is filtered out
    with pytest.raises(ValueError, match="unique"):
        schedule([us[0], Update(1, 3, 10.0, version=0)], nw, 0, tau_max=10, next_batch=0.1)


def test_a_stale_update_is_dropped_stale_even_on_a_slow_link():
    nw = Network([10.0, 1.0, 10.0], [10.0] * 3)
    us = [Update(1, 1, 10.0, version=0), Update(2, 2, 10.0, version=5)]
    plan, _ = schedule(us, nw, 0, tau_max=2, v_init=5, next_batch=0.1)   # dl(1) = -3
    assert plan.dropped == {1: DROP_STALE} and plan.order == [2]
