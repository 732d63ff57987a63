"""Tests of the exact oracle (mlfabric.sched.oracle, paper §10.1) and of the comparison it makes:
- hand-checkable batches whose optimum follows from reasoning about the bottleneck link;
- on random tiny batches (hypothesis, both objectives): the heuristic (mlfabric.sched.schedule) is
  never better than the optimum, the heuristic's own plan is a point of the model with the same
  objective (the model's feasible set contains it), and the oracle's plan is a valid schedule,
  verified from the plan and the network alone (delays, capacity replayed with NetUp);
- the plan checker catches broken plans, bad input is a ValueError naming the value;
- the report command runs end to end.
"""
import itertools
import json
import random
import sys
from dataclasses import replace
from math import inf

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlfabric.sched import DROP_STALE, Network, Segment, Update, schedule
from mlfabric.sched import oracle
from mlfabric.sched.network import GBPS

REL = 1e-6        # the solver's tolerances are near 1e-7; a modelling error is far larger
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def close(a, b, rel=REL):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def at_least(h, opt, unit):
    """h >= opt up to the solver's tolerance, relative, or absolute in `unit` (a transfer's
    duration) when opt is near 0 (e.g. an update already on the server's host)."""
    return h >= opt - REL * max(abs(opt), unit)


def delays_ok(plan):
    """Delay of every applied update, from its position alone (plan.py's convention)."""
    return all(plan.v_init + p - plan.updates[g].version <= plan.tau_max
               for p, g in enumerate(plan.order, 1))


def overbooked(plan, network):
    """Reserve every transfer of the plan on a copy of the network (NetUp) and return the bytes
    sent beyond capacity, summed over links and time (0 for a valid plan; the solver's
    feasibility tolerance leaves a trace near 1e-7 of an update)."""
    nw = network.copy()
    for t in plan.transfers():
        nw.reserve(t.src, t.dst, t.segments)
    end = max([s.t1 for t in plan.transfers() for s in t.segments] + [0.0])
    over = 0.0
    for link in nw.links:
        steps = link.steps() + [(max(end, link.t[-1]), 0.0)]
        for (t0, v), (t1, _) in zip(steps, steps[1:]):
            over += max(0.0, -v) * max(0.0, t1 - t0)
    return over


def delivered(t):
    return sum(s.rate * (s.t1 - s.t0) for s in t.segments)


# --- hand-checkable batches ----------------------------------------------------------------------

RATE = 1e9          # bytes/s on every NIC
SIZE = 1e9          # so one update alone takes T = 1 s
T = SIZE / RATE


def test_two_equal_updates_one_link():
    # both cross the server's ingress: the first can commit at T at best, the second at 2T
    net = Network.uniform(3, RATE)
    ups = [Update(0, 1, SIZE, 0), Update(1, 2, SIZE, 0)]
    a = oracle.solve(ups, net, 0, objective="async")
    s = oracle.solve(ups, net, 0, objective="sync")
    assert a.optimal and s.optimal
    assert close(a.value, 1.5 * T)
    assert close(s.value, 2 * T)
    for r in (a, s):
        assert oracle.check_plan(r.plan, net) == []
        assert r.lower_bound <= r.value * (1 + REL)


def test_aggregation_strictly_beats_direct():
    # Workers 1, 2, 3 and an aggregator on host 3. Direct only, the server's ingress takes 3T.
    # With it: u0 straight to the server over [0, T] while u1 goes to host 3 (u2 is already
    # there), then one aggregate over [T, 2T]. Nothing does better: any plan puts at least two
    # updates' worth of bytes through the server's ingress, or, aggregating all three, 2S through
    # host 3's ingress before the aggregate can leave.
    net = Network.uniform(4, RATE)
    ups = [Update(0, 1, SIZE, 0), Update(1, 2, SIZE, 0), Update(2, 3, SIZE, 0)]
    with_agg = oracle.solve(ups, net, 0, aggregators=(3,), objective="sync")
    direct = oracle.solve(ups, net, 0, objective="sync")
    assert close(with_agg.value, 2 * T)
    assert close(direct.value, 3 * T)
    assert len(with_agg.plan.aggregates) == 1
    assert oracle.check_plan(with_agg.plan, net) == []
    # async: direct only, commits at best T, 2T, 3T (mean 2T); aggregation strictly helps
    a_direct = oracle.solve(ups, net, 0, objective="async")
    a_agg = oracle.solve(ups, net, 0, aggregators=(3,), objective="async")
    assert close(a_direct.value, 2 * T)
    assert a_agg.value < a_direct.value * (1 - 1e-3)
    assert oracle.check_plan(a_agg.plan, net) == []


def test_deadline_forces_the_large_update_first():
    # tau_max = 2, v_init = 10: u0 (2S, version 9) has deadline 1 and must take position 1, so
    # the commits are at best 2T and 3T (the server's ingress carries 3S). Without the bound the
    # small one goes first: T and 3T.
    net = Network.uniform(3, RATE)
    ups = [Update(0, 1, 2 * SIZE, version=9), Update(1, 2, SIZE, version=10)]
    bound = oracle.solve(ups, net, 0, tau_max=2, v_init=10, objective="async")
    free = oracle.solve(ups, net, 0, tau_max=inf, v_init=10, objective="async")
    assert bound.plan.order == [0, 1]
    assert close(bound.value, 2.5 * T)
    assert close(free.value, 2 * T)
    assert delays_ok(bound.plan)


def test_stale_update_is_dropped_and_the_rest_applied():
    # u0's deadline is 0: no position satisfies tau_max; the others fit positions 1 and 2
    net = Network.uniform(4, RATE)
    ups = [Update(0, 1, SIZE, version=7), Update(1, 2, SIZE, version=10),
           Update(2, 3, SIZE, version=10)]
    assert oracle.max_applied(ups, tau_max=2, v_init=10)[0] == 2
    r = oracle.solve(ups, net, 0, tau_max=2, v_init=10, objective="async")
    assert r.plan.dropped == {0: DROP_STALE}
    assert sorted(r.plan.order) == [1, 2]
    assert close(r.value, 1.5 * T)


def test_fixed_count_leaves_the_slowest_out():
    # applying one of two: the best is the update with the fast path, committed at T
    net = Network([RATE, RATE, RATE / 4], [RATE, RATE, RATE])   # host 2 sends at RATE / 4
    ups = [Update(0, 1, SIZE, 0), Update(1, 2, SIZE, 0)]
    r = oracle.solve(ups, net, 0, objective="async", applied=1)
    assert r.plan.order == [0]
    assert r.plan.dropped == {1: oracle.DROP_NOT_CHOSEN}
    assert close(r.value, T)


def test_piecewise_capacity_and_ready_time():
    # the server's ingress runs at RATE on [0, 1 s), then 3 RATE: 2S bytes are done at 4/3 s
    net = Network([RATE, 3 * RATE], [[(0.0, RATE), (1.0, 3 * RATE)], RATE])
    r = oracle.solve([Update(0, 1, 2 * SIZE, 0)], net, 0, objective="sync")
    assert close(r.value, 1 + 1 / 3)
    # an update ready at 0.5 s cannot start earlier
    net = Network.uniform(2, RATE)
    r = oracle.solve([Update(0, 1, SIZE, 0, ready=0.5)], net, 0, objective="async")
    assert close(r.value, 0.5 + T)
    assert r.plan.direct[0].segments[0].t0 >= 0.5 - 1e-9


def test_aggregate_is_as_large_as_its_largest_member():
    # The server's ingress is slow (RATE / 10): 3S straight there take 30T. Aggregated at host
    # 3, u0 (2S) arrives there at 2T, u1 (S) at T, and the aggregate is as large as u0, 2S:
    # 20T more, 22T in all; any plan without one aggregate of both sends 3S to the server.
    net = Network([RATE, RATE, RATE, 4 * RATE], [RATE / 10, RATE, RATE, 4 * RATE])
    ups = [Update(0, 1, 2 * SIZE, 0), Update(1, 2, SIZE, 0)]
    r = oracle.solve(ups, net, 0, aggregators=(3,), objective="sync")
    assert close(r.value, 22 * T)
    assert len(r.plan.aggregates) == 1
    for a in r.plan.aggregates:
        assert a.transfer.size == max(r.plan.updates[g].size for g in a.members)
        assert delivered(a.transfer) >= a.transfer.size * (1 - 1e-5)
    assert oracle.check_plan(r.plan, net) == []


# --- random tiny batches -------------------------------------------------------------------------

@st.composite
def instances(draw, max_updates=4):
    """A tiny batch like oracle.random_instance's, drawn by hypothesis. Choices are listed
    largest first: hypothesis favours the first, and a batch of one stale update tests nothing."""
    hosts = draw(st.sampled_from(range(3, 6)))

    def trace():
        r = draw(st.sampled_from(oracle.RATES_GBPS)) * GBPS
        if draw(st.sampled_from((False, False, False, True))):
            return [(0.0, r), (draw(st.sampled_from(oracle.CHANGE_TIMES)),
                               draw(st.sampled_from(oracle.RATES_GBPS)) * GBPS)]
        return r

    net = Network([trace() for _ in range(hosts)], [trace() for _ in range(hosts)])
    aggs = tuple(draw(st.lists(st.sampled_from(range(1, hosts)), max_size=2, unique=True)))
    tau_max = draw(st.sampled_from((4, 3, 2, 1)))
    v_init = 10
    n = draw(st.sampled_from(range(max_updates, 1, -1)))

    def version():
        # position p gives delay v_init + p - v: offsets 0..tau_max-1 fit some position, tau_max
        # fits none (stale), drawn now and then
        stale = draw(st.sampled_from((False, False, False, False, True)))
        return v_init - (tau_max if stale else draw(st.sampled_from(range(tau_max))))

    workers = list(range(1, hosts)) + [0]      # the server's host too, last
    ups = tuple(Update(i, draw(st.sampled_from(workers)),
                       draw(st.sampled_from(oracle.SIZES_MB)) * 1e6, version(),
                       draw(st.sampled_from((0.0, 0.0, 0.015))))
                for i in range(n))
    return oracle.Instance(ups, net, 0, aggs, tau_max, v_init, 0.0, draw(st.integers(0, 99)))


def heuristic_and_oracle(inst, objective):
    plan, _ = schedule(list(inst.updates), inst.network, inst.server, seed=inst.seed,
                       mode=objective, **inst.kwargs())
    count = len(plan.order) if objective == "async" else None
    model = oracle.build_model(inst.updates, inst.network, inst.server, objective=objective,
                               applied=count, reference=plan, prune=False, **inst.kwargs())
    return plan, model, model.solve(time_limit=30)


@pytest.mark.parametrize("objective", oracle.OBJECTIVES)
@SETTINGS
@given(inst=instances())
def test_heuristic_never_beats_the_optimum(objective, inst):
    plan, model, res = heuristic_and_oracle(inst, objective)
    assert res.status == "optimal"
    h = oracle.objective_value(plan, objective)
    assert at_least(h, res.value, model.TU)
    assert at_least(h, res.lower_bound, model.TU)
    # the oracle applies as many updates as the heuristic, within tau_max, on real capacity
    assert len(res.plan.order) == len(plan.order)
    assert delays_ok(res.plan)
    assert overbooked(res.plan, inst.network) <= 1e-5 * max(u.size for u in inst.updates)
    assert oracle.check_plan(res.plan, inst.network) == []
    for t in res.plan.transfers():
        if inst.network.path(t.src, t.dst):
            assert delivered(t) >= t.size * (1 - 1e-5)


@pytest.mark.parametrize("objective", oracle.OBJECTIVES)
@SETTINGS
@given(inst=instances(max_updates=5))
def test_the_heuristics_plan_is_inside_the_model(objective, inst):
    plan, _ = schedule(list(inst.updates), inst.network, inst.server, seed=inst.seed,
                       mode=objective, **inst.kwargs())
    assert oracle.check_plan(plan, inst.network) == []
    if not plan.order:
        return
    model = oracle.build_model(inst.updates, inst.network, inst.server, objective=objective,
                               applied=len(plan.order) if objective == "async" else None,
                               reference=plan, prune=False, **inst.kwargs())
    x = model.encode(plan)
    assert model.check_point(x) == []
    assert close(model.value_of(x), oracle.objective_value(plan, objective))


@SETTINGS
@given(inst=instances())
def test_lexicographic_async_applies_the_most(inst):
    most, chosen = oracle.max_applied(inst.updates, inst.tau_max, inst.v_init)
    plan, _ = schedule(list(inst.updates), inst.network, inst.server, seed=inst.seed,
                       **inst.kwargs())
    assert len(plan.order) <= most
    res = oracle.solve(inst.updates, inst.network, inst.server, objective="async",
                       time_limit=30, **inst.kwargs())
    assert res.status == "optimal"
    assert len(res.plan.order) == most == res.applied_max
    assert delays_ok(res.plan)
    assert oracle.check_plan(res.plan, inst.network) == []
    if len(plan.order) == most:
        unit = max(u.size for u in inst.updates) / max(max(l.v) for l in inst.network.links)
        assert at_least(oracle.objective_value(plan, "async"), res.value, unit)


@settings(max_examples=60, deadline=None)
@given(versions=st.lists(st.integers(0, 6), min_size=1, max_size=5), tau_max=st.integers(0, 4))
def test_max_applied_matches_brute_force(versions, tau_max):
    ups = [Update(i, 1, 1.0, v) for i, v in enumerate(versions)]
    v_init = 5

    def fits(seq):
        return all(v_init + p - ups[g].version <= tau_max for p, g in enumerate(seq, 1))

    best = max(k for k in range(len(ups) + 1)
               if any(fits(seq) for seq in itertools.permutations(range(len(ups)), k)))
    most, chosen = oracle.max_applied(ups, tau_max, v_init)
    assert most == best
    assert fits(chosen)


def test_compare_reports_ratios_at_least_one():
    rng = random.Random(3)
    insts = [oracle.random_instance(rng, updates=(2, 4)) for _ in range(4)]
    out = oracle.compare(insts, time_limit=30)
    assert len(out) == 4
    for inst, per in zip(insts, out):
        assert set(per) == set(oracle.OBJECTIVES)
        for c in per.values():
            assert c.status == "optimal"
            assert c.ratio >= 1 - REL
            assert c.applied <= c.applied_max
            assert oracle.check_plan(c.oracle_plan, inst.network) == []
        # the same updates as the heuristic: never better than any updates, never worse than it
        c = per["async"]
        assert c.status_same_updates == "optimal"
        assert 1 - REL <= c.ratio_same_updates <= c.ratio * (1 + REL)


def test_time_limit_is_reported_not_waited_on():
    inst = oracle.random_instance(random.Random(5), updates=(5, 5), aggregators=(2, 2),
                                  p_change=1.0)
    c = oracle.compare([inst], time_limit=0.002)[0]
    for v in c.values():
        assert v.status in ("time-limit", "optimal")
        if v.status == "time-limit":
            assert v.ratio is None


# --- the checker catches broken plans ----------------------------------------------------------

def _solved():
    net = Network.uniform(4, RATE)
    ups = [Update(0, 1, SIZE, 10), Update(1, 2, SIZE, 10), Update(2, 3, SIZE, 10)]
    r = oracle.solve(ups, net, 0, v_init=10, objective="async")
    assert oracle.check_plan(r.plan, net) == []
    return r.plan, net


def test_checker_catches_an_exceeded_tau_max():
    plan, net = _solved()           # delays 1, 2, 3
    plan.tau_max = 2
    assert any("tau_max" in b for b in oracle.check_plan(plan, net))


def test_checker_catches_overbooked_capacity():
    plan, net = _solved()
    t = plan.direct[0]
    fast = replace(t, segments=tuple(Segment(s.t0, s.t1, 2 * s.rate) for s in t.segments))
    plan.direct[0] = fast
    assert any("capacity" in b for b in oracle.check_plan(plan, net))


def test_checker_catches_missing_bytes_and_early_commits():
    plan, net = _solved()
    t = plan.direct[-1]
    plan.direct[-1] = replace(t, segments=t.segments[:-1] + (
        Segment(t.segments[-1].t0, t.segments[-1].t1, t.segments[-1].rate / 2),))
    c = plan.commits[0]
    plan.commits[0] = replace(c, time=c.time / 2)
    bad = oracle.check_plan(plan, net)
    assert any("delivers" in b for b in bad)
    assert any("before its arrival" in b for b in bad)


def test_checker_catches_an_aggregate_leaving_early():
    net = Network.uniform(4, RATE)
    ups = [Update(0, 1, SIZE, 0), Update(1, 2, SIZE, 0), Update(2, 3, SIZE, 0)]
    plan = oracle.solve(ups, net, 0, aggregators=(3,), objective="sync").plan
    agg = plan.aggregates[0]
    shift = agg.transfer.start
    agg.transfer = replace(agg.transfer, start=0.0, segments=tuple(
        Segment(s.t0 - shift, s.t1 - shift, s.rate) for s in agg.transfer.segments))
    assert any("before its release" in b for b in oracle.check_plan(plan, net))


# --- input --------------------------------------------------------------------------------------

def test_bad_input_is_a_value_error():
    net = Network.uniform(3, RATE)
    ok = [Update(0, 1, SIZE, 0)]
    with pytest.raises(ValueError, match="objective"):
        oracle.solve(ok, net, 0, objective="fastest")
    with pytest.raises(ValueError, match="size"):
        oracle.solve([Update(0, 1, 0.0, 0)], net, 0)
    with pytest.raises(ValueError, match="host 7"):
        oracle.solve([Update(0, 7, SIZE, 0)], net, 0)
    with pytest.raises(ValueError, match="applied=3"):
        oracle.solve(ok, net, 0, applied=3)
    with pytest.raises(ValueError, match="tau_max"):
        oracle.solve(ok, net, 0, tau_max=-1)
    with pytest.raises(ValueError, match="time_limit"):
        oracle.solve(ok, net, 0, time_limit=0)
    dead = Network([RATE, [(0.0, RATE), (1.0, 0.0)], RATE], [RATE] * 3)
    with pytest.raises(ValueError, match="link 1"):
        oracle.solve(ok, dead, 0)
    with pytest.raises(ValueError, match="unique"):
        oracle.solve([Update(0, 1, SIZE, 0), Update(0, 2, SIZE, 0)], net, 0)
    with pytest.raises(ValueError, match="only="):
        oracle.solve(ok, net, 0, only=[5])
    other, _ = schedule([Update(1, 2, SIZE, 0)], net, 0)
    with pytest.raises(ValueError, match="reference"):
        oracle.solve(ok, net, 0, reference=other)


def test_missing_scipy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    with pytest.raises(ImportError, match=r"mlfabric\[oracle\]"):
        oracle.solve([Update(0, 1, SIZE, 0)], Network.uniform(2, RATE), 0)


# --- the report command ------------------------------------------------------------------------

def test_report_command(tmp_path, capsys):
    from mlfabric.bench import sched_oracle
    out = tmp_path / "oracle.json"
    assert sched_oracle.main(["--instances", "3", "--seed", "1", "--max-updates", "3",
                              "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "obj_async" in text and "obj_sync" in text and "median" in text
    data = json.loads(out.read_text())
    assert [s["objective"] for s in data["summary"]] == ["async", "async", "sync"]
    assert len(data["records"]) == 3
    for s in data["summary"]:
        if s["solved"]:
            assert 1 - REL <= s["min"] <= s["median"] <= s["p90"] <= s["max"]
            assert 0 <= s["fraction_optimal"] <= 1


def test_report_command_rejects_bad_arguments(capsys):
    from mlfabric.bench import sched_oracle
    for argv in (["--instances", "0"], ["--max-updates", "20"], ["--time-limit", "0"]):
        with pytest.raises(SystemExit):
            sched_oracle.main(argv)
