"""Cut-through relays in the scheduler's model (Network.t_en_relay; distribute and Alg. 3 with
cut_through=True): a relay starts with its inbound transfer, never ends before it, books no link
past its capacity, and never makes a batch end later than store-and-forward does; the C++
engines plan what the reference loops plan (tests/unit/test_sched_fast.py compares them in depth)."""
from math import inf, isclose

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.sched import Network, Update, schedule
from mlfabric.sched.distribution import OBJECTIVES, distribute
from tests.sched_util import check_bytes, check_capacity, instances
from tests.unit.test_sched_distribution import instances as pull_instances

PROPS = settings(max_examples=60, deadline=None)


def test_relay_follows_its_inbound_on_a_free_path():
    nw = Network.uniform(3, 10.0)
    end, segs = nw.send(0, 1, 20.0, 1.0)       # inbound 1 -> 3
    assert end == 3.0
    r_end, r_segs = nw.t_en_relay(1, 2, 20.0, 1.0, end)
    assert r_end == 3.0 and len(r_segs) == 1 and r_segs[0].t0 == 1.0 and r_segs[0].rate == 10.0
    # a slower inbound caps the relay at its pace: it ends with it, not before
    r_end, r_segs = nw.t_en_relay(1, 2, 20.0, 1.0, 5.0)
    assert r_end == 5.0 and isclose(r_segs[0].rate, 5.0)
    # a slower outbound path ends later, at its own pace
    slow = Network([10.0, 4.0, 10.0], [10.0] * 3)
    assert slow.t_en_relay(1, 2, 20.0, 1.0, 3.0)[0] == 6.0
    # a busy relay host waits for its link, as any transfer does
    nw.reserve(1, 0, nw.t_en(1, 0, 30.0, 0.0)[1])   # 1's egress busy over [0, 3)
    assert nw.t_en_relay(1, 2, 20.0, 1.0, 3.0)[0] == 5.0
    with pytest.raises(ValueError, match="before time 0"):
        nw.t_en_relay(1, 2, 1.0, -1.0, 1.0)


def test_cut_through_distribution_beats_store_and_forward():
    """The runtime's setting: one server, six requesters on equal NICs, the requesters as
    distributors. Each relay costs a whole transfer time store-and-forward, none cut-through: the
    two-level tree takes 3 transfer times instead of 4, and the pipeline through all six 1."""
    nw = Network.uniform(7, 10.0)
    args = (list(range(1, 7)), nw, 0, 10.0)
    saf, _ = distribute(*args, distributors=range(1, 7), seed=3)
    ct, after = distribute(*args, distributors=range(1, 7), seed=3, cut_through=True)
    assert saf.makespan == 4.0 and min(ct.cases) == 3.0
    assert ct.makespan == ct.pipeline == 1.0 and ct.server_bytes == 10.0
    assert sorted(ct.deliveries) == list(range(1, 7))
    hops = [(r.inbound.src, r.host) for r in ct.distributors]
    assert hops == list(zip([0] + ct.order[:-2], ct.order[:-1]))
    assert ct.deliveries[ct.order[-1]].source == ct.order[-2]
    check_capacity(nw, ct.transfers())
    assert len(ct.transfers()) == 6 and "d%-4d -> d" % ct.order[0] in str(ct)
    # a requester that may not relay rules the pipeline out; the greedy tree makes it a leaf
    two, _ = distribute(*args, distributors=range(1, 6), seed=3, cut_through=True)
    assert two.pipeline == inf and min(two.cases) == 3.0 and two.makespan == two.tree == 1.0
    assert all(r.host != 6 for r in two.distributors)
    check_capacity(nw, two.transfers())


def test_the_pipeline_puts_slow_links_last():
    """Every hop runs at the pace of the one before: requester 1 receives at full rate but sends
    at a tenth, requester 4 receives at a tenth. Down the request order the chain would pass
    1's slow uplink to 2 and 3 (a transfer time 10x); ordered, the full-rate ones come first,
    then 1, then 4 (chain_order): 2 and 3 have the model after one transfer time, the makespan
    is the slow receiver's alone."""
    nw = Network([10.0, 1.0, 10.0, 10.0, 10.0], [10.0, 10.0, 10.0, 10.0, 1.0])
    d, _ = distribute([1, 2, 3, 4], nw, 0, 10.0, distributors=range(1, 5), seed=0,
                      cut_through=True)
    assert [(r.inbound.src, r.host) for r in d.distributors] == [(0, 2), (2, 3), (3, 1)]
    ends = {w: d.deliveries[w].transfer.end for w in (1, 2, 3, 4)}
    assert ends[2] == ends[3] == ends[1] == 1.0 and ends[4] == 10.0 == d.makespan
    check_capacity(nw, d.transfers())
    for objective in ("makespan", "mean"):   # either objective keeps that chain
        again, _ = distribute([1, 2, 3, 4], nw, 0, 10.0, distributors=range(1, 5), seed=0,
                              cut_through=True, objective=objective)
        assert {w: again.deliveries[w].transfer.end for w in ends} == ends, objective


def test_fast_first_serves_the_fast_requesters_before_the_makespan():
    """Requester 4 has full-rate links both ways; 1-3 send at a tenth (slow senders), 1 and 2
    also receive at a tenth, and 3's uplink is booked from t=0.5 (its pushes). The chain
    4 -> 3 -> 1 -> 2 then waits on 3's booked hop (makespan 13), so the least makespan is the
    server sending to everyone, one after the other (12): requester 4 has the model after two
    transfer times and the server's link is held for four. fast-first keeps the chain: 4 after
    one, one copy out of the server; only the slow receivers' deliveries move."""
    nw = Network([10.0, 1.0, 1.0, 1.0, 10.0], [10.0, 1.0, 1.0, 10.0, 10.0])
    nw.links[nw.egress(3)].subtract(0.5, 3.5, 1.0)
    got = {}
    for objective in ("makespan", "fast-first"):
        d, _ = distribute([1, 2, 3, 4], nw, 0, 10.0, distributors=range(1, 5), seed=0,
                          cut_through=True, objective=objective)
        check_capacity(nw, d.transfers())
        got[objective] = (d.deliveries[4].transfer.end, d.server_bytes, d.makespan)
    assert got["makespan"] == (2.0, 40.0, 12.0)
    assert got["fast-first"] == (1.0, 10.0, 13.0)


def test_the_greedy_tree_feeds_slow_senders_from_slow_senders():
    """2 and 3 send at a tenth: their updates reach the server late, so a full-rate relay's
    egress is not spent on them once one of them has the model. 2, the first, takes it from 1
    (no slow sender has it yet); 3 then from 2, though 1 or the server would be sooner."""
    from mlfabric.sched.distribution import _tree, slow_senders
    nw = Network([10.0, 10.0, 1.0, 1.0], [10.0] * 4)
    slow = slow_senders([1, 2, 3], nw, 10.0, 0.0)
    assert slow == {2, 3}
    # over a transfer, not at an instant: 1's egress booked for a moment is not slow
    busy = nw.copy()
    busy.links[busy.egress(1)].subtract(0.0, 0.05, 10.0)
    assert slow_senders([1, 2, 3], busy, 10.0, 0.0) == {2, 3}
    makespan, direct, relays, _ = _tree([1, 2, 3], nw, 0, [1, 2, 3], 10.0, 0.0, slow)
    parent = {t.dst: t.src for t in direct}
    parent.update({r.host: r.inbound.src for r in relays})
    parent.update({t.dst: r.host for r in relays for t in r.outbound})
    assert parent == {1: 0, 2: 1, 3: 2} and makespan == 10.0
    # without slow senders it is the earliest source: 3 from 1's egress or the server, at 2.0
    makespan, direct, relays, _ = _tree([1, 2, 3], nw, 0, [1, 2, 3], 10.0, 0.0, set())
    assert makespan == 2.0
    # a slow sender that may not relay feeds no one: 3 from the earliest of the others
    makespan, direct, relays, _ = _tree([1, 2, 3], nw, 0, [1, 3], 10.0, 0.0, slow)
    assert makespan == 2.0 and all(r.host != 2 for r in relays)



@pytest.mark.parametrize("base", [12.5e6, 12.5e6 / 3, 50e6 / 3, 100e6 / 7])
def test_a_link_at_exactly_half_the_rate_is_not_slow_however_rates_are_scaled(base):
    """The paper's NIC levels (mlfabric.emulate: 1, 2.5, 3.3, 5, 10 Gbps) scaled to a base rate;
    5 Gbps is exactly half, and stays on the fast side of every "under half" test whatever the
    scale: at 12.5e6 / 3 (Table 2's --dilate 3) float rounding used to put it under half, so
    N1's half-rate links were taken for slow senders (and mlfabric-A's pull admission parked
    them). 3.3 Gbps is slow at every scale; a downlink at half is not paced (fast-first)."""
    import numpy as np
    from mlfabric.emulate.presets import PAPER_BASE_GBPS, RATES_GBPS
    from mlfabric.sched.distribution import SLOW_EGRESS, _fast_links, slow_senders, under_share
    # as the emulation has them: a worker's levels scaled from the base rate (NicTrace), the
    # server (a dedicated machine) at the base rate itself
    levels = [float(x) for x in np.array(RATES_GBPS) * (base / PAPER_BASE_GBPS)]
    full, half, third = levels[-1], levels[-2], levels[-3]
    for reference in (base, full):
        assert not under_share(half, reference, SLOW_EGRESS)
        assert under_share(third, reference, SLOW_EGRESS)
        assert under_share(half * (1 - 1e-6), reference, SLOW_EGRESS)   # a real shortfall
    size = base / 10    # a transfer of 0.1 s at the base rate
    nw = Network([base, full, half, third], [base, full, half, third])
    assert slow_senders([1, 2, 3], nw, size, 0.0) == {3}
    assert _fast_links([1, 2, 3], nw, 0, size, 0.0, set()) == {1, 2}

@PROPS
@given(pull_instances(), st.integers(0, 3), st.sampled_from(OBJECTIVES))
def test_cut_through_distribution_invariants(inst, seed, objective):
    net, server, requests, dists, size, start = inst
    d, after = distribute(requests, net, server, size, distributors=dists, start=start,
                          seed=seed, cut_through=True, objective=objective)
    assert sorted(list(d.deliveries) + d.unserved) == sorted(requests)
    for r in d.distributors:
        assert r.inbound.dst == r.host
        for t in r.outbound:   # a relay starts with its inbound at the soonest, never ends before
            assert t.src == r.host
            assert t.start >= r.inbound.start and t.end >= r.inbound.end
    into = [t.dst for t in d.transfers()]   # nobody gets the model twice
    assert len(into) == len(set(into))
    check_capacity(net, d.transfers())
    replay = net.copy()
    for t in d.transfers():
        if t.segments:
            replay.reserve(t.src, t.dst, t.segments)
    assert all(p.steps() == q.steps() for p, q in zip(replay.links, after.links))
    if objective == "makespan":   # the least of every shape tried (the tree only if strictly)
        assert d.makespan == min(min(d.cases), d.pipeline, d.tree)
    saf, _ = distribute(requests, net, server, size, distributors=dists, start=start, seed=seed)
    # case n = all (everyone direct) is the same in both models, so neither can be worse than it
    assert d.cases[-1] == saf.cases[-1]


@PROPS
@given(instances(allow_dead=True))
def test_cut_through_aggregation_invariants(inst):
    nw, updates, server, aggs, tau, v_init = inst
    plan, after = schedule(updates, nw, server, aggregators=aggs, tau_max=tau, v_init=v_init,
                           cut_through=True)
    saf, _ = schedule(updates, nw, server, aggregators=aggs, tau_max=tau, v_init=v_init)
    plain, _ = schedule(updates, nw, server, tau_max=tau, v_init=v_init)
    # grouping changes, ordering and drops do not; everything is applied once or dropped
    assert plan.order == saf.order and plan.dropped == saf.dropped
    assert [g for c in plan.commits for g in c.ids] == plan.order
    assert plan.makespan <= plain.makespan
    for a in plan.aggregates:
        assert a.transfer.start >= max(t.start for t in a.inbound)
        assert a.transfer.end >= a.ready   # the sum cannot be through before its last member
    check_bytes(plan.transfers())
    check_capacity(nw, plan.transfers())


def test_cut_through_aggregate_overlaps_its_members():
    # three updates into one aggregator whose sum goes on to a server with a slow ingress: the
    # sum streams out while the last member comes in
    nw = Network([10.0] * 5, [4.0] + [10.0] * 4)
    us = [Update(i, i + 1, 10.0, version=0) for i in range(3)]
    saf, _ = schedule(us, nw, 0, aggregators=[4])
    ct, _ = schedule(us, nw, 0, aggregators=[4], cut_through=True)
    assert ct.makespan < saf.makespan
    a = ct.aggregates[-1]
    assert a.transfer.start < a.ready


@PROPS
@given(instances(allow_dead=True), st.sampled_from(["sync", "async"]), st.booleans(),
       st.booleans())
def test_cut_through_fast_engines_equal_the_reference(inst, mode, momentum, every_aggregates):
    """The C++ engines implement cut_through (relayed aggregates, the pipeline case): 'auto'
    takes the fast path, and every engine gives the reference's plan and network."""
    nw, updates, server, aggs, tau, v_init = inst
    if every_aggregates:   # the pipeline case is possible when no worker is on the server's host
        aggs = [h for h in range(nw.hosts) if h != server]
    kw = dict(aggregators=aggs, tau_max=tau, v_init=v_init, mode=mode, momentum=momentum,
              cut_through=True)
    ref, ref_nw = schedule(updates, nw, server, engine="reference", **kw)
    for engine in ("auto", "fast", "plain"):
        plan, after = schedule(updates, nw, server, engine=engine, **kw)
        assert plan == ref and str(plan) == str(ref)
        assert [p.steps() for p in after.links] == [p.steps() for p in ref_nw.links]


def test_cut_through_uses_the_fast_engine_and_norm_cap_the_reference():
    us = [Update(i, i + 1, 10.0, version=0) for i in range(4)]
    kw = dict(aggregators=[1, 2, 3, 4], mode="sync", cut_through=True)
    timings = {}
    plan, _ = schedule(us, Network.uniform(5, 10.0), 0, timings=timings, **kw)
    assert timings and plan.makespan == 1.0   # 'auto' took the fast path: the pipeline
    with pytest.raises(ValueError, match="norm_cap"):
        schedule(us, Network.uniform(5, 10.0), 0, engine="fast", norm_cap=1.0, **kw)


def test_pipeline_reduces_a_batch_in_one_transfer_time():
    """Six equal updates ready together, every worker an aggregator: Alg. 3's best two-level
    grouping takes 4 transfer times at the server; the cut-through pipeline passes one running
    sum w1 -> w2 -> ... -> w6 -> S in 1, as one commit of the whole batch in its order."""
    nw = Network.uniform(7, 10.0)
    us = [Update(i, i + 1, 10.0, version=0) for i in range(6)]
    saf, _ = schedule(us, nw, 0, aggregators=list(range(1, 7)), mode="sync")
    ct, after = schedule(us, nw, 0, aggregators=list(range(1, 7)), mode="sync", cut_through=True)
    assert saf.makespan == 4.0 and ct.makespan == 1.0 and ct.server_bytes == 10.0
    assert [c.ids for c in ct.commits] == [tuple(range(6))] and not ct.direct
    (last,) = ct.aggregates
    levels = last.levels()
    assert [a.aggregator for a in levels] == [2, 3, 4, 5, 6]
    assert [a.dst for a in levels] == [3, 4, 5, 6, 0]
    assert [len(a.members) for a in levels] == [2, 3, 4, 5, 6]
    assert ct.next_hop(0) == 2 and ct.next_hop(3) == 4    # w1 sends to w2; w4 sums its own
    assert len(ct.transfers()) == 11                      # 6 updates (5 local) + 5 sums
    check_capacity(nw, ct.transfers())
    assert "sum of 5  h5" in str(ct)
    # the pipeline is tried only when each host after the first may aggregate
    part, _ = schedule(us, nw, 0, aggregators=[2, 3], mode="sync", cut_through=True)
    assert all(a.upstream is None for a in part.aggregates)
