"""mlfabric.sim: accounting, delay bounds, determinism, presets, the fair-share solvers, the
monitor's lag, the stale-synchronous gate, replica divergence with real vectors, reports, the CLI.

Everything runs in this process on small settings (a few workers, small updates) so the file stays
well under a minute; assertions are invariants and comparisons with independent references, never
numbers the simulator produced before."""
import json
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

import mlfabric.sim.scheduled as scheduled
from mlfabric.sched import (DROP_REASONS, DROP_STALE, Network, Profile, Segment, Update,
                            schedule)
from mlfabric.sim import (COMPUTE_PRESETS, NET_PRESETS, POLICIES, ComputeTrace, NicTrace, SimConfig,
                          compare, network_traces, simulate)
from mlfabric.sim.accounts import DROPPED, PENDING, Gate
from mlfabric.sim.baselines import FairShareRun
from mlfabric.sim.buffering import BufferingServer
from mlfabric.sim.cli import main as cli_main
from mlfabric.sim.fairshare import StarShare, max_min_rates
from mlfabric.sched.network import t_en as path_t_en
from mlfabric.sched import view as monitor
from mlfabric.sched.view import SchedulerView
from mlfabric.emulate.presets import RATES_GBPS
from mlfabric.sim.scheduled import ScheduledRun
from mlfabric.sim.truth import TrueNetwork

SMALL = dict(workers=8, hosts=4, updates=12, size=20e6, aggregators=2)


def run(policy, **kw):
    cfg = SimConfig(**{**SMALL, **kw})
    r = (FairShareRun if policy in ("async", "buffered") else ScheduledRun)(cfg, policy)
    return r, r.simulate()


# --- accounting -----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,distribution", [(p, False) for p in POLICIES] + [
    ("mlfabric", True), ("mlfabric-sync", True)])
def test_every_pushed_update_is_applied_or_dropped_with_a_reason(policy, distribution):
    r, rep = run(policy, compute="C2", net="N3", tau_max=6, replica=True, div_max=8.0,
                 distribution=distribution)
    total = SMALL["workers"] * SMALL["updates"]
    assert rep.pushed == total and r.log.n_pushed == total
    assert all(r.log.pushed) and PENDING not in set(r.log.status)
    dropped = [u for u in range(total) if r.log.status[u] == DROPPED]
    assert sorted(r.log.reason) == dropped
    assert all(why in DROP_REASONS for why in r.log.reason.values())
    assert rep.applied + rep.dropped == total
    assert sum(rep.dropped_reasons.values()) == rep.dropped
    assert sum(rep.delay_hist.values()) == rep.applied
    assert rep.aggregated <= rep.applied
    if policy in ("async", "buffered"):
        assert rep.aggregated == 0 and rep.batches == 0
    # the server's final version counts what it applied (sync: one version per iteration)
    expect = SMALL["updates"] if policy == "mlfabric-sync" else rep.applied
    assert r.versions.current == expect
    # a model pull after every push but the last: direct pulls send exactly that many models out of
    # the server (plus chain-replication copies), distribution trees never more
    pulls = SMALL["workers"] * (SMALL["updates"] - 1) * SMALL["size"]
    copies = rep.replica_bytes if policy in ("async", "buffered") else 0.0
    if distribution:
        assert rep.server_out_bytes <= pulls
    else:
        assert rep.server_out_bytes == pytest.approx(pulls + copies)


# --- delay bounds ---------------------------------------------------------------------------------
def test_mlfabric_keeps_tau_max_where_vanilla_async_breaks_it():
    # 12 workers share the server, so delays sit near 12; C2 stragglers push vanilla past it
    kw = dict(workers=12, hosts=6, updates=30, compute="C2", net="N3", tau_max=12)
    ml, vanilla, buffered = compare(SimConfig(**{**SMALL, **kw}), ["mlfabric", "async", "buffered"])
    assert vanilla.delay_max > 12 and vanilla.over_tau_max > 0
    for rep in (ml, buffered):
        assert rep.delay_max <= 12 and rep.over_tau_max == 0
        assert max(rep.delay_hist) <= 12


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workers=st.integers(1, 7), per_host=st.integers(1, 3), updates=st.integers(1, 7),
       tau_max=st.integers(0, 9), compute=st.sampled_from(sorted(COMPUTE_PRESETS)),
       net=st.sampled_from(sorted(NET_PRESETS)), t_lag=st.sampled_from([0.0, 0.2, 3.0]),
       aggregators=st.integers(0, 3), seed=st.integers(0, 50))
def test_bounded_policies_never_exceed_tau_max(workers, per_host, updates, tau_max, compute, net,
                                               t_lag, aggregators, seed):
    hosts = max(1, workers // per_host)
    cfg = SimConfig(workers=workers, hosts=hosts, updates=updates, tau_max=tau_max, size=5e6,
                    compute=compute, net=net, t_lag=t_lag, aggregators=min(aggregators, hosts),
                    period=1.0, seed=seed)
    for policy in ("mlfabric", "buffered"):
        rep = simulate(cfg, policy)
        assert rep.applied + rep.dropped == workers * updates
        assert rep.over_tau_max == 0 and rep.delay_max <= tau_max
        if policy == "buffered":  # buffering drops only updates whose bound is already broken
            assert set(rep.dropped_reasons) <= {DROP_STALE}


def test_sync_delays_are_one_iteration_and_ssp_respects_its_slack():
    r, rep = run("mlfabric-sync", compute="C2")
    assert rep.delay_hist == {1: rep.applied}
    check_gate(r, 0)
    r, rep = run("mlfabric-ssp", compute="C2", slack=1)
    check_gate(r, 1)


def check_gate(r, slack):
    """A worker's update i is ready only after every worker had i - slack updates resolved."""
    log, n = r.log, r.N
    for i in range(slack + 1, n):
        opened = max(log.done[w * n + i - slack - 1] for w in range(r.W))
        assert all(log.ready[w * n + i] >= opened for w in range(r.W))


def test_gate_releases_waiting_workers_in_order():
    released = []
    g = Gate(3, 1, lambda w, t: released.append((w, t)))
    assert g.allows(1) and not g.allows(2)
    g.wait(0, 2)
    for w in (0, 1):
        g.done(w, 1.0)
    assert released == []
    g.done(2, 2.0)  # now every worker has 1 processed: update 2 may start with slack 1
    assert released == [(0, 2.0)] and g.allows(2)


# --- determinism ----------------------------------------------------------------------------------
def _stable(rep):
    d = rep.to_dict()
    for k in ("wall_time", "sched_time_mean", "sched_time_max", "sched_time_total"):
        d.pop(k)
    return d


@pytest.mark.parametrize("policy", ["mlfabric", "mlfabric-ssp", "async", "buffered"])
def test_same_seed_same_run_other_seed_other_run(policy):
    kw = dict(compute="C2", net="N2", replica=True, div_max=10.0, vectors=8)
    a, b = simulate(policy=policy, **SMALL, **kw), simulate(policy=policy, **SMALL, **kw)
    c = simulate(policy=policy, **SMALL, **kw, seed=5)
    assert _stable(a) == _stable(b)
    assert _stable(a) != _stable(c)


def test_policies_see_the_same_stragglers_and_nic_rates():
    cfg = SimConfig(**SMALL, compute="C2", net="N3")
    a, b = ScheduledRun(cfg, "mlfabric"), FairShareRun(cfg, "async")
    assert [a.compute.time(w, i) for w in range(8) for i in range(12)] == \
        [b.compute.time(w, i) for w in range(8) for i in range(12)]
    assert np.array_equal(a.nic.period_rates(7), b.nic.period_rates(7))


# --- presets --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["N1", "N2", "N3"])
def test_nic_presets_draw_the_papers_rates_with_the_papers_probabilities(name):
    tr = NicTrace(name, links=200, base_rate=10 * 1e9 / 8, period=5.0, seed=3)
    rates = np.concatenate([tr.period_rates(k) for k in range(300)])  # 60,000 draws
    levels = np.array(RATES_GBPS) * 1e9 / 8  # the paper's {1, 2.5, 3.3, 5, 10} Gbps
    which = np.argmin(abs(rates[:, None] - levels[None, :]), axis=1)
    assert np.allclose(rates, levels[which], rtol=1e-12)
    freq = np.bincount(which, minlength=5) / len(rates)
    assert np.allclose(freq, NET_PRESETS[name].probs, atol=0.01)
    # redrawn every T: constant within a period, per link
    assert tr.rate(5, 10.0) == tr.rate(5, 14.99) == tr.period_rates(2)[5]


@pytest.mark.parametrize("name", ["C1", "C2", "C3"])
def test_compute_presets_slow_iterations_with_the_papers_r_and_s(name):
    p = COMPUTE_PRESETS[name]
    tr = ComputeTrace(name, workers=100, base_time=0.5, seed=9)
    times = np.array([tr.time(w, i) for w in range(100) for i in range(600)])
    assert set(np.unique(times)) <= {0.5, 0.5 * p.slowdown}
    assert abs((times > 0.5).mean() - p.prob) < 0.01
    norms = np.array([tr.norm(w, i) for w in range(10) for i in range(100)])
    assert norms.min() >= 0.5 and norms.max() <= 1.5


def test_traces_do_not_depend_on_the_order_they_are_read():
    a, b = ComputeTrace("C1", 4, 1.0, seed=1), ComputeTrace("C1", 4, 1.0, seed=1)
    fwd = [a.time(w, i) for w in range(4) for i in range(600)]
    back = [b.time(w, i) for w in reversed(range(4)) for i in reversed(range(600))][::-1]
    assert fwd == back
    x, y = NicTrace("N2", 6, 1.0, seed=2), NicTrace("N2", 6, 1.0, seed=2)
    assert np.array_equal(x.period_rates(700), (y.period_rates(3), y.period_rates(700))[1])


def test_network_traces_build_a_network():
    from mlfabric.sched import Network
    eg, ing = network_traces("N3", 3, 1250.0, until=60.0, seed=4)
    nw = Network(eg, ing)
    assert nw.hosts == 4 and nw.residual(nw.egress(3), 30.0) == 1250.0  # the dedicated server
    assert all(r in (125.0, 1250.0) for steps in eg[:3] for _, r in steps)


def test_presets_and_settings_are_checked():
    for bad in (dict(workers=0), dict(hosts=9, workers=8), dict(updates=1.5), dict(size=-1),
                dict(tau_max=-1), dict(tau_max=2.5), dict(gamma=1.0), dict(t_lag=-0.1),
                dict(compute="C9"), dict(net="N7"), dict(aggregators=5, hosts=4),
                dict(vectors=4, replica=False), dict(div_max=-1)):
        with pytest.raises(ValueError) as e:
            SimConfig(**{**SMALL, **bad})
        assert repr(list(bad.values())[0]) in str(e.value) or str(list(bad.values())[0]) in \
            str(e.value)
    with pytest.raises(ValueError, match="'fastest'"):
        simulate(policy="fastest", **SMALL)
    # the default aggregator count fits small clusters, also when other settings change
    assert SimConfig(workers=4, hosts=2).k == 2 and SimConfig().k == 4
    assert simulate(policy="mlfabric", workers=2, hosts=1, updates=2, size=1e6).applied == 4


# --- fair share -----------------------------------------------------------------------------------
def lexicographic_max_min(paths, cap):
    """Brute force: maximise the smallest rate with an LP, fix every flow that cannot exceed it
    (one LP per flow), repeat."""
    n, m = len(paths), len(cap)
    a = np.zeros((m, n))
    for f, p in enumerate(paths):
        for link in p:
            a[link, f] = 1
    fixed = {}
    while len(fixed) < n:
        free = [f for f in range(n) if f not in fixed]
        # variables: r_0..r_{n-1}, t; maximise t
        c = np.zeros(n + 1)
        c[-1] = -1
        a_ub = [np.append(a[i], 0) for i in range(m)] + [
            np.append(-np.eye(n)[f], 1) for f in free]
        b_ub = list(cap) + [0] * len(free)
        bounds = [(fixed[f], fixed[f]) if f in fixed else (0, None) for f in range(n)] + [(0, None)]
        t = -linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds).fun
        for f in free:
            c2 = np.zeros(n + 1)
            c2[f] = -1
            bounds2 = bounds[:-1] + [(t, t)]
            best = -linprog(c2, A_ub=a_ub, b_ub=b_ub, bounds=bounds2).fun
            if best <= t + 1e-7 * max(1, t):
                fixed[f] = t
    return np.array([fixed[f] for f in range(n)])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_water_filling_matches_brute_force_max_min(data):
    m = data.draw(st.integers(1, 5))
    cap = data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.5, 3.3, 5.0, 10.0]), min_size=m,
                             max_size=m))
    paths = data.draw(st.lists(st.lists(st.integers(0, m - 1), min_size=1, max_size=3, unique=True),
                               min_size=1, max_size=6))
    got = max_min_rates(paths, cap)
    assert np.allclose(got, lexicographic_max_min(paths, cap), rtol=1e-6, atol=1e-7)
    # the defining property: every flow has a saturated link where nobody gets more than it
    load = np.zeros(m)
    for f, p in enumerate(paths):
        load[list(p)] += got[f]
    assert np.all(load <= np.array(cap) * (1 + 1e-9) + 1e-9)
    for f, p in enumerate(paths):
        assert any(load[link] >= cap[link] * (1 - 1e-9) - 1e-9
                   and all(got[g] <= got[f] * (1 + 1e-9) + 1e-12
                           for g, q in enumerate(paths) if link in q) for link in p)


def test_water_filling_edge_cases():
    assert max_min_rates([(), (0,)], [4.0]).tolist() == [math.inf, 4.0]  # same-host flow
    assert max_min_rates([(0,), (0,)], [4.0], weights=[3, 1]).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="link 3"):
        max_min_rates([(3,)], [1.0])
    with pytest.raises(ValueError, match="capacities"):
        max_min_rates([(0,)], [-1.0])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_star_share_tracks_max_min_and_finishes_flows_when_a_resolve_each_event_does(data):
    leaves = data.draw(st.integers(1, 4))
    caps = data.draw(st.lists(st.sampled_from([1.0, 2.5, 5.0, 10.0]), min_size=leaves,
                              max_size=leaves))
    hub = data.draw(st.sampled_from([1.0, 4.0, 10.0, 40.0]))
    flow = st.tuples(st.integers(0, leaves - 1), st.sampled_from([1.0, 2.0, 7.0]),
                     st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0]))  # (leaf, bytes, start)
    flows = data.draw(st.lists(flow, min_size=1, max_size=8))
    starts = sorted((t, i) for i, (_, _, t) in enumerate(flows))
    # StarShare, driven like the simulator drives it
    s = StarShare(hub, caps)
    ends = {}
    pending = list(starts)
    t = 0.0
    while pending or len(s):
        nt = s.next_time()
        if pending and pending[0][0] <= nt:
            t, i = pending.pop(0)
            s.add(t, flows[i][0], flows[i][1], i)
            for f in s.flows:  # the incremental rates are the water-filling's
                ref = max_min_rates([(0, 1 + s.flows[g][0]) for g in sorted(s.flows)], [hub] + caps)
                assert np.allclose([s.rate(g) for g in sorted(s.flows)], ref, rtol=1e-9)
                break
        else:
            t = nt
            for i in s.pop_done(t):
                ends[i] = t
    # reference: re-solve at every event, advance every flow's bytes
    left = {i: flows[i][1] for i in range(len(flows))}
    active, ref_end, pending, t = [], {}, list(starts), 0.0
    while pending or active:
        paths = [(0, 1 + flows[i][0]) for i in active]
        rates = max_min_rates(paths, [hub] + caps) if active else []
        dt_done = min((left[i] / r for i, r in zip(active, rates)), default=math.inf)
        dt_next = pending[0][0] - t if pending else math.inf
        dt = min(dt_done, dt_next)
        for i, r in zip(active, rates):
            left[i] -= r * dt
        t += dt
        for i in [i for i in active if left[i] <= 1e-9]:
            active.remove(i)
            ref_end[i] = t
        while pending and pending[0][0] <= t + 1e-12:
            active.append(pending.pop(0)[1])
    assert set(ends) == set(ref_end)
    for i in ends:
        assert ends[i] == pytest.approx(ref_end[i], rel=1e-9, abs=1e-9)


# --- monitor lag ----------------------------------------------------------------------------------
def test_monitor_reports_capacity_as_it_was_t_lag_ago_minus_planned_reservations():
    tr = NicTrace("N3", 4, 1000.0, period=1.0, seed=11)
    truth = TrueNetwork(tr, 2, 1, 1000.0)
    k = next(k for k in range(1, 50) if tr.period_rates(k)[0] != tr.period_rates(k - 1)[0])
    now = k * 1.0 + 0.1  # just after a change on host 0's egress
    fresh, lagged = SchedulerView(truth, 0.0), SchedulerView(truth, 0.5)
    assert fresh.reported(0, now) == truth.capacity(0, now) == tr.period_rates(k)[0]
    assert lagged.reported(0, now) == truth.capacity(0, now - 0.5) == tr.period_rates(k - 1)[0]
    assert (fresh.network([0, 2], now).residual(0, now)
            != lagged.network([0, 2], now).residual(0, now))
    # the scheduler's own bookings come off its view (and nothing else does)
    r = fresh.reported(0, now)
    fresh.book(0, 2, [Segment(now, now + 0.3, r / 4)])
    nw = fresh.network([0, 2], now)
    assert nw.residual(nw.egress(0), now + 0.1) == pytest.approx(0.75 * r)
    assert nw.residual(nw.egress(0), now + 0.4) == r
    assert nw.residual(nw.ingress(1), now + 0.1) == pytest.approx(1000.0 - r / 4)


def test_monitor_lag_changes_the_plans_and_costs_real_time_not_order():
    kw = dict(compute="C1", net="N3", period=1.0, tau_max=8)
    fresh, lagged = run("mlfabric", t_lag=0.0, **kw)[1], run("mlfabric", t_lag=2.0, **kw)[1]
    assert _stable(fresh) != _stable(lagged)
    assert lagged.delay_max <= 8 and fresh.delay_max <= 8


def test_true_network_extends_its_trace_before_reserving_past_it():
    tr = NicTrace("N3", 2, 100.0, period=1.0, seed=2)
    truth = TrueNetwork(tr, 1, 1, 100.0)
    horizon = truth.horizon
    end, segs = truth.send(0, 1, 100.0 * 3 * horizon, 0.0)  # needs far more than the horizon
    assert end > horizon and truth.horizon >= end
    sent = sum(s.rate * (s.t1 - s.t0) for s in segs)
    assert sent == pytest.approx(100.0 * 3 * horizon)
    for s in segs:  # at every instant it used exactly the true capacity of host 0's egress
        assert s.rate == min(tr.rate(0, s.t0), 100.0)


# --- server-side buffering ------------------------------------------------------------------------
def test_buffering_holds_fresh_arrivals_until_the_stale_update_arrives():
    # Fig. 1: j was computed from an old version and arrives last; the others must wait for it
    applied, dropped = [], []
    srv = BufferingServer(4, lambda t, u, v: applied.append((u, v)),
                          lambda t, u, why: dropped.append(u))
    srv.v = 5
    srv.pushed("j", 2)  # deadline 6: must be the very next update
    for g in ("a", "b", "c"):
        srv.pushed(g, 5)  # deadline 9
    for g in ("a", "b"):
        srv.arrived(0.0, g, 5)
    assert applied == [] and srv.held == 2
    srv.arrived(1.0, "j", 2)
    srv.arrived(2.0, "c", 5)
    assert applied == [("j", 6), ("a", 7), ("b", 8), ("c", 9)] and not dropped
    assert all(v - (2 if u == "j" else 5) <= 4 for u, v in applied)


def test_buffering_drops_only_broken_bounds():
    applied, dropped = [], []
    srv = BufferingServer(1, lambda t, u, v: applied.append(u), lambda t, u, why: dropped.append(u))
    srv.v = 3
    srv.pushed("old", 1)  # deadline 2 < 4: broken already
    srv.pushed("new", 3)
    srv.arrived(0.0, "new", 3)
    srv.arrived(0.0, "old", 1)
    assert applied == ["new"] and dropped == ["old"]


# --- replica --------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["mlfabric", "mlfabric-sync", "async"])
@pytest.mark.parametrize("div_max", [3.0, 12.0])
def test_exact_divergence_stays_under_the_bound(policy, div_max):
    r, rep = run(policy, replica=True, div_max=div_max, vectors=16, compute="C2", net="N2")
    assert rep.divergence_checks > 0 and rep.divergence_exact is not None
    assert rep.divergence_violations == 0
    assert rep.divergence_exact <= rep.divergence_bound * (1 + 1e-9) + 1e-12
    if policy.startswith("mlfabric"):
        assert rep.replica_bytes > 0
        if rep.bound_unmet == 0:
            assert rep.divergence_bound <= div_max * (1 + 1e-12)
    else:  # chain replication: every update goes through the server's egress to the replica
        assert rep.replica_bytes == rep.applied * SMALL["size"] and rep.replica_lag == 0


def test_tighter_div_max_replicates_more_bytes_no_looser():
    loose = run("mlfabric", replica=True, div_max=math.inf)[1]
    tight = run("mlfabric", replica=True, div_max=1.0)[1]
    assert tight.replica_lag <= loose.replica_lag
    assert tight.divergence_bound <= 1.0 + 1e-12 or tight.bound_unmet > 0


def test_a_replica_without_the_replication_module_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(scheduled, "_replication", None)
    with pytest.raises(RuntimeError, match="replication"):
        ScheduledRun(SimConfig(**SMALL, replica=True), "mlfabric")


# --- report and CLI -------------------------------------------------------------------------------
def test_report_metrics_are_consistent():
    rep = run("mlfabric", compute="C2", tau_max=5)[1]
    d = json.loads(rep.to_json())
    assert d["policy"] == "mlfabric" and d["config"]["tau_max"] == 5
    delays = [k for k, c in rep.delay_hist.items() for _ in range(c)]
    assert rep.delay_mean == pytest.approx(np.mean(delays))
    assert rep.delay_var == pytest.approx(np.var(delays))
    assert rep.updates_per_s == pytest.approx(rep.applied / rep.sim_time)
    assert 0 < rep.server_util <= 1 and 0 < rep.server_out_util <= 1
    capacity = SimConfig().base_rate * rep.sim_time
    assert rep.server_util == pytest.approx(rep.server_bytes / capacity)
    assert rep.batches > 0 and rep.sched_time_max >= rep.sched_time_mean > 0
    assert json.loads(simulate(policy="async", **SMALL, div_max=math.inf).to_json())[
        "config"]["div_max"] == "inf"
    assert "mlfabric" in str(rep)


def test_cli_prints_policies_side_by_side_and_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = cli_main(["--workers", "6", "--hosts", "3", "--updates", "5", "--size-mb", "10",
                   "--policy", "mlfabric,async,buffered", "--compute", "C2", "--net", "N2",
                   "--tau-max", "6", "--aggregators", "2", "--replica", "--div-max", "5",
                   "--vectors", "4", "--json", str(out), "--plot", str(png), "--quiet"])
    assert rc == 0
    head = capsys.readouterr().out.splitlines()[0].split()
    assert head == ["metric", "mlfabric", "async", "buffered"]
    d = json.loads(out.read_text())
    assert set(d["reports"]) == {"mlfabric", "async", "buffered"}
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert cli_main(["--workers", "2", "--policy", "nope", "--quiet"]) == 2


def test_progress_line_on_stderr_for_long_runs(capsys):
    cfg = SimConfig(**SMALL)
    r = FairShareRun(cfg, "async", progress=True)
    r.prog.every = 0.0
    r.engine.progress(1.0)
    assert "async:" in capsys.readouterr().err


def test_seeded_layout_is_stable():
    cfg = SimConfig(workers=40, hosts=20, aggregators=4, replica=True, seed=random.randrange(5))
    a, b = cfg.aggregator_hosts()
    assert a == SimConfig(**{**cfg.as_dict()}).aggregator_hosts()[0]
    assert len(a) == len(b) == 4 and not set(a) & set(b) and cfg.server not in a + b


# --- the simulator's fast paths: each gives exactly what the plain computation gives ------------
@pytest.mark.parametrize("kw", [
    dict(),
    dict(compute="C2", net="N3", period=1.0, replica=True, div_max=4.0, vectors=8),
    dict(distribution=True, t_lag=0.0),
    dict(policy="mlfabric-sync", net="N2"),
])
def test_pruning_past_breakpoints_never_changes_a_run(monkeypatch, kw):
    kw = dict(kw)
    policy = kw.pop("policy", "mlfabric")
    reports = []
    for every in (math.inf, 0.0, 1.0):  # never, every batch, the default
        monkeypatch.setattr(scheduled, "_PRUNE_EVERY", every)
        reports.append(_stable(run(policy, **kw)[1]))
    assert reports[0] == reports[1] == reports[2]


def _profile_steps(p):
    return list(zip(p.t, p.v))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_true_network_send_is_network_send_and_extension_is_the_trace(data):
    """TrueNetwork.send (t_en and NetUp called per link, the trace extended in numpy) against a
    plain mlfabric.sched.Network built from the whole trace up front, sending the same transfers."""
    seed = data.draw(st.integers(0, 50))
    tr = NicTrace(data.draw(st.sampled_from(["N1", "N2", "N3"])), 6, 100.0, period=1.0, seed=seed)
    truth = TrueNetwork(tr, 3, 1, 100.0)
    sends = data.draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3),
                                         st.floats(1.0, 3000.0), st.floats(0.0, 5.0)),
                               min_size=1, max_size=25))
    t = 0.0
    plan = []
    for src, dst, size, gap in sends:
        t += gap
        plan.append((src, dst, size, t))
    done = [truth.send(*x) for x in plan]
    other = TrueNetwork(tr, 3, 1, 100.0)  # send_end: the same ends, the same links
    assert [other.send_end(*x) for x in plan] == [e for e, _ in done]
    assert ([_profile_steps(p) for p in other.net.links]
            == [_profile_steps(p) for p in truth.net.links])
    until = truth.horizon
    egress = [tr.steps(h, until - 0.5) for h in range(3)] + [[(0.0, 100.0)]]
    ingress = [tr.steps(3 + h, until - 0.5) for h in range(3)] + [[(0.0, 100.0)]]
    ref = Network(egress, ingress)
    assert done == [ref.send(*x) for x in plan]
    assert ([_profile_steps(p) for p in truth.net.links] == [_profile_steps(p) for p in ref.links])
    for link in range(8):
        assert truth.capacities(t)[link] == truth.capacity(link, t)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_monitor_view_is_its_steps_as_a_profile_cached_or_not(data):
    tr = NicTrace("N3", 6, 100.0, period=1.0, seed=data.draw(st.integers(0, 20)))
    view = SchedulerView(TrueNetwork(tr, 3, 1, 100.0), data.draw(st.sampled_from([0.0, 0.7])))
    now = 0.0
    for _ in range(data.draw(st.integers(1, 12))):
        now += data.draw(st.sampled_from([0.0, 0.05, 0.4, 1.3]))
        src, dst = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
        t0 = now + data.draw(st.floats(0.0, 2.0))
        segs, at = [], t0
        for _ in range(data.draw(st.integers(0, 3))):
            d = data.draw(st.sampled_from([0.25, 0.5, 1.0, math.inf]))
            segs.append(Segment(at, at + d, data.draw(st.sampled_from([10.0, 25.0, 60.0]))))
            if d == math.inf:
                break
            at += d
        view.book(src, dst, segs)
        if data.draw(st.booleans()):
            view.prune(now)
        hosts = data.draw(st.permutations([0, 1, 2, 3]))
        nw = view.network(hosts, now)
        for i, h in enumerate(hosts):
            for link, mine in ((h, nw.egress(i)), (view.hosts + h, nw.ingress(i))):
                assert _profile_steps(nw.links[mine]) == Profile(view.steps(link, now)).steps()
                res = view.residual(link, now)
                assert res.t[0] == 0.0 and list(zip(res.t, res.v)) == view.steps(link, now)
        # schedule() plans on the view without touching it (the view hands out its cached links)
        before = [_profile_steps(p) for p in nw.links]
        ups = [Update(1, 1, 500.0, 0, now), Update(2, 2, 800.0, 0, now)]
        schedule(ups, nw, 0, aggregators=[3], tau_max=5, start=now)
        assert [_profile_steps(p) for p in nw.links] == before


def test_fast_update_constructor_is_update():
    u = scheduled._update(7, 2, 1e6, 3, 0.5, 1.25)
    assert u == Update(7, 2, 1e6, 3, 0.5, 1.25) and hash(u) == hash(Update(7, 2, 1e6, 3, 0.5, 1.25))
    with pytest.raises(Exception):
        u.size = 1.0  # still frozen


def test_engine_without_sources_runs_events_in_the_same_order():
    from mlfabric.sim.engine import Engine

    class Never:  # a source that never fires: forces the general loop
        def next_time(self):
            return math.inf

    def trace(with_source):
        eng, seen = Engine(), []
        if with_source:
            eng.sources = [Never()]

        def ev(t, name, more):
            seen.append((t, name))
            for dt, nm in more:
                eng.at(t + dt, ev, nm, ())

        rnd = random.Random(3)
        for i in range(40):
            eng.at(rnd.choice([0.0, 0.5, 1.0]), ev, i, [(rnd.choice([0.0, 0.25]), -i)])
        eng.run()
        return seen, eng.events, eng.now

    assert trace(False) == trace(True)


@pytest.mark.skipif(monitor._book_add is None, reason="mlfabric._C without book_add")
@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 3.5]),
                                   st.sampled_from([0.0, 0.25, 1.0, 2.0, math.inf]),
                                   st.sampled_from([0.0, 10.0, 25.0, 0.1, 60.0])),
                         max_size=4), min_size=1, max_size=10),
       st.sampled_from([0.0, 30.0, 100.0]))
def test_native_book_and_view_are_the_python_bit_for_bit(bookings, r):
    """The view's booking (Book.add per segment) and its residual Profile, in C++ on the book's
    lists, against the Python: the same lists, float for float."""
    fast, slow = monitor.Book(), monitor.Book()
    for segs in bookings:
        segs = [Segment(t0, t0 + d, rate) for t0, d, rate in segs]
        assert monitor._book_add(fast.t, fast.v, segs) == len(segs)
        for s in segs:
            slow.add(s.t0, s.t1, s.rate)
        assert [x.hex() for x in fast.t] == [x.hex() for x in slow.t]
        assert [x.hex() for x in fast.v] == [x.hex() for x in slow.v]
    for k in range(len(slow.t)):
        t, v = monitor._view_residual(slow.t, slow.v, k, r)
        ref = Profile([(0.0, max(0.0, r - slow.v[k]))]
                      + [(slow.t[j], max(0.0, r - slow.v[j])) for j in range(k + 1, len(slow.t))])
        assert [x.hex() for x in t] == [x.hex() for x in ref.t]
        assert [x.hex() for x in v] == [x.hex() for x in ref.v]


@pytest.mark.skipif(monitor._view_links is None, reason="mlfabric._C without view_links")
@settings(max_examples=30, deadline=None)
@given(st.data())
def test_native_view_network_is_the_python_loop(data):
    """SchedulerView.network's per-link loop in C++ against the Python loop: the same Profiles
    (float for float) and the same cache reuse, batch after batch."""
    seed = data.draw(st.integers(0, 20))
    views = [SchedulerView(TrueNetwork(NicTrace("N3", 6, 100.0, period=1.0, seed=seed), 3, 1,
                                       100.0), 0.3) for _ in range(2)]
    now, seen = 0.0, [[], []]
    for _ in range(data.draw(st.integers(1, 10))):
        now += data.draw(st.sampled_from([0.0, 0.05, 0.4, 1.3]))
        src, dst = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
        t0 = now + data.draw(st.floats(0.0, 2.0))
        segs = [Segment(t0, t0 + d, 25.0) for d in data.draw(st.lists(
            st.sampled_from([0.25, 1.0]), max_size=2))]
        hosts = data.draw(st.permutations([0, 1, 2, 3]))
        prune = data.draw(st.booleans())
        for i, view in enumerate(views):
            view.book(src, dst, segs)
            if prune:
                view.prune(now)
            if i == 1:
                mp = pytest.MonkeyPatch()
                mp.setattr(monitor, "_view_links", None)
            try:
                nw = view.network(hosts, now)
            finally:
                if i == 1:
                    mp.undo()
            seen[i].append([([x.hex() for x in p.t], [x.hex() for x in p.v]) for p in nw.links])
            # a pull's walk on the view's residuals, in C++ on the books, against the Python
            size = data.draw(st.sampled_from([0.0, 10.0, 60.0, 400.0]))
            at = now + data.draw(st.sampled_from([0.0, 0.3, 2.0]))
            end, walked = view.t_en((src, 4 + dst), now, size, at)
            ref = path_t_en(view.residuals((src, 4 + dst), now), size, at)
            assert (end.hex(), walked) == (ref[0].hex(), ref[1])
            seen[i].append([id(p) for p in nw.links] == [id(c[3]) for c in
                                                          (view._cache[k] for k in
                                                           [*hosts, *[4 + h for h in hosts]])])
    assert seen[0] == seen[1]
