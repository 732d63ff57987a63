"""Bounded-divergence replication (paper §3.3, §5.3, eq. 5-8, eq. 11; sync §6): the momentum lead
formula and its norm-only bound against an exact simulator over real vectors, and the replication
step over random multi-batch runs (hypothesis) — the bound at every batch end by eq. 11 and by the
exact norm, the replica's order a prefix of the server's with nothing lost or duplicated, capacity,
large and zero Div_max, and the delayed server transfer after a_e."""
from dataclasses import dataclass
from math import inf

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlfabric.sched import Network, Update, schedule
from mlfabric.sched.divergence import (Momentum, aggregate_weights, chunk_effect, divergence_bound,
                                       eq11, eq11_coefficients, exact_divergence, lead_bounds,
                                       lead_coefficients, next_history_bound)
from mlfabric.sched.replication import ReplicaPlan, ReplicaState, replicate
from tests.sched_util import breakpoints, check_bytes, check_capacity, link_load, traces

PROPS = settings(max_examples=40, deadline=None)
REL = 1e-9
gammas = st.floats(0.0, 0.999, allow_nan=False)


def vectors(dim):
    return st.lists(st.floats(-3.0, 3.0, allow_nan=False), min_size=dim, max_size=dim).map(
        lambda v: np.array(v))


def ref_bound(norms, gamma, h):
    """Eq. 11 for any lead written out with explicit powers (independent of divergence.py)."""
    L = len(norms)
    ch = sum(gamma ** k for k in range(1, L + 1))
    return (ch * h if ch else 0.0) + sum(
        n * sum(gamma ** j for j in range(L - i + 1)) for i, n in enumerate(norms, 1))


# --- the momentum model and the bound -------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(gammas, vectors(4), vectors(4), vectors(4), vectors(4))
def test_lead_of_two_is_eq7_and_catching_up_one_is_eq8(gamma, w0, h0, u1, u2):
    s = Momentum(w0, h0, gamma)
    r = s.copy()
    s.apply(u1)
    s.apply(u2)
    eq7 = (gamma + gamma ** 2) * h0 + (1 + gamma) * u1 + u2
    assert np.allclose(s.w - r.w, eq7)
    ch, c = lead_coefficients(2, gamma)
    assert np.isclose(ch, gamma + gamma ** 2) and np.allclose(c, [1 + gamma, 1])
    assert np.isclose(exact_divergence(h0, [u1, u2], gamma), np.linalg.norm(eq7))
    r.apply(u1)  # Fig. 3b: the replica gets u1 first; eq. 8
    assert np.allclose(s.w - r.w, gamma ** 2 * h0 + gamma * u1 + u2)
    assert np.isclose(exact_divergence(r.h, [u2], gamma), np.linalg.norm(s.w - r.w))


@settings(max_examples=50, deadline=None)
@given(gammas, st.floats(0, 5), st.floats(0, 5), st.floats(0, 5))
def test_eq11_is_the_expanded_square_of_the_triangle_bound(gamma, h, n1, n2):
    a1, a2, a3, a4, a5, a6 = eq11_coefficients(gamma)
    ch, (c1, c2) = (gamma + gamma ** 2), (1 + gamma, 1.0)
    assert np.allclose([a1, a2, a3], [ch ** 2, c1 ** 2, c2 ** 2])
    assert np.allclose([a4, a5, a6], [2 * ch * c1, 2 * c1 * c2, 2 * c2 * ch])  # a6: n2 * H
    assert np.isclose(eq11(h, n1, n2, gamma), divergence_bound([n1, n2], gamma, h))
    assert np.isclose(divergence_bound([n1, n2], gamma, h), ref_bound([n1, n2], gamma, h))


@settings(max_examples=60, deadline=None)
@given(gammas, st.integers(0, 20), st.integers(0, 10), st.data())
def test_exact_divergence_never_exceeds_the_bound(gamma, lead, warmup, data):
    """Random vectors, gamma in [0, 1), leads 0..20: the history bound H (from norms only) covers
    the true ||h||, and eq. 11 covers the true ||w_s - w_r||, which the simulator confirms."""
    vec = vectors(3)
    r = Momentum(np.zeros(3), None, gamma)
    H = 0.0
    for _ in range(warmup):
        u = data.draw(vec)
        r.apply(u)
        H = next_history_bound(H, np.linalg.norm(u), gamma)
        assert np.linalg.norm(r.h) <= H * (1 + REL) + 1e-12
    s = r.copy()
    us = [data.draw(vec) for _ in range(lead)]
    for u in us:
        s.apply(u)
    exact = np.linalg.norm(s.w - r.w)
    assert np.isclose(exact, exact_divergence(r.h, us, gamma), rtol=1e-7, atol=1e-9)
    norms = [np.linalg.norm(u) for u in us]
    bound = divergence_bound(norms, gamma, H)
    assert exact <= bound * (1 + REL) + 1e-9
    assert np.isclose(bound, ref_bound(norms, gamma, H), rtol=1e-9, atol=1e-12)
    # any real history within the bound (not only the simulator's) is covered too
    h = data.draw(vec)
    hn = np.linalg.norm(h)
    assert exact_divergence(h, us, gamma) <= divergence_bound(norms, gamma, hn) * (1 + REL) + 1e-9


@settings(max_examples=50, deadline=None)
@given(gammas, st.lists(st.floats(0, 4), max_size=12), st.floats(0, 4))
def test_lead_bounds_async_is_eq11_at_every_replica_position(gamma, norms, h):
    lb = lead_bounds(norms, gamma, h)
    H = h
    for p in range(len(norms) + 1):
        assert np.isclose(lb.history[p], H) and lb.partial[p] == 0.0
        assert np.isclose(lb.bound[p], ref_bound(norms[p:], gamma, H), rtol=1e-9, atol=1e-12)
        if p < len(norms):
            assert lb.bound[p] >= lb.bound[p + 1]  # catching up never raises the bound
            H = norms[p] + gamma * H
    assert lb.bound[-1] == 0.0


@settings(max_examples=50, deadline=None)
@given(gammas, st.data())
def test_lead_bounds_sync_covers_the_exact_divergence(gamma, data):
    """Sync steps (an iteration is one momentum step, its updates added linearly): for a replica at
    every position of a sequence with random step ends, exact <= bound, non-increasing."""
    vec = vectors(3)
    warm = data.draw(st.lists(vec, max_size=4))
    r = Momentum(np.zeros(3), None, gamma)
    H = 0.0
    for u in warm:
        r.apply(u)
        H = next_history_bound(H, np.linalg.norm(u), gamma)
    part = data.draw(st.lists(vec, max_size=2))  # the replica is inside an iteration already
    for u in part:
        r.apply(u, ends_step=False)
    us = data.draw(st.lists(vec, max_size=8))
    ends = data.draw(st.lists(st.booleans(), min_size=len(us), max_size=len(us)))
    norms = [np.linalg.norm(u) for u in us]
    lb = lead_bounds(norms, gamma, H, ends=ends, partial_norm=sum(np.linalg.norm(u) for u in part))
    s = r.copy()
    for u, e in zip(us, ends):
        s.apply(u, e)
    rep = r.copy()
    for p in range(len(us) + 1):
        exact = np.linalg.norm(s.w - rep.w)
        assert exact <= lb.bound[p] * (1 + REL) + 1e-9, (p, exact, lb.bound[p])
        assert np.linalg.norm(rep.h) <= lb.history[p] * (1 + REL) + 1e-9
        if p < len(us):
            assert lb.bound[p] >= lb.bound[p + 1] - 1e-12
            rep.apply(us[p], ends[p])
    assert lb.bound[-1] == 0.0


@settings(max_examples=40, deadline=None)
@given(gammas, st.data())
def test_an_aggregate_has_the_effect_of_its_members_in_order(gamma, data):
    """What the aggregator must send: applying its weighted sums equals applying the members one by
    one — async (two sums, closed form) and sync with any step ends (at most three sums)."""
    vec = vectors(3)
    us = data.draw(st.lists(vec, min_size=1, max_size=6))
    w0, h0 = data.draw(vec), data.draw(vec)
    # async, closed form
    ch, gm, a, b = aggregate_weights(len(us), gamma)
    seq = Momentum(w0, h0, gamma)
    for u in us:
        seq.apply(u)
    A = sum(ai * u for ai, u in zip(a, us))
    B = sum(bi * u for bi, u in zip(b, us))
    assert np.allclose(w0 + ch * h0 + A, seq.w) and np.allclose(gm * h0 + B, seq.h)
    # the plain sum S and B determine A
    S = sum(us)
    if gamma < 0.99:
        assert np.allclose((S - gamma * B) / (1 - gamma), A, atol=1e-6)
    # general step ends
    ends = data.draw(st.lists(st.booleans(), min_size=len(us), max_size=len(us)))
    acc0 = data.draw(vec)
    seq = Momentum(w0, h0, gamma)
    seq.acc = acc0.copy()
    for u, e in zip(us, ends):
        seq.apply(u, e)
    eff = chunk_effect(gamma, ends)
    w, h, acc = eff.receive(w0, h0, acc0, eff.sums(np.stack(us)))
    assert np.allclose(w, seq.w) and np.allclose(h, seq.h) and np.allclose(acc, seq.acc)
    if all(ends):
        assert not eff.members[2].any()  # async: the acc row is empty, two sums suffice


def test_one_weighted_sum_is_not_enough_under_momentum():
    _, _, a, b = aggregate_weights(3, 0.9)
    ratios = np.array(a) / np.array(b)
    assert not np.allclose(ratios, ratios[0])
    _, _, a, b = aggregate_weights(3, 0.0)  # no momentum: the plain sum carries the model
    assert a == [1.0, 1.0, 1.0]


def test_unknown_norms_force_catching_up():
    lb = lead_bounds([1.0, inf, 1.0], 0.0, 0.0)
    assert lb.bound[0] == inf and lb.bound[1] == inf and lb.bound[2] == 1.0 and lb.bound[3] == 0
    assert divergence_bound([], 0.5, inf) == 0.0  # no lead, no divergence, whatever the history


@pytest.mark.parametrize("call, match", [
    (lambda: lead_coefficients(2, 1.0), "gamma"),
    (lambda: lead_coefficients(2, -0.1), "gamma"),
    (lambda: lead_coefficients(2, float("nan")), "gamma"),
    (lambda: lead_coefficients(-1, 0.5), "lead"),
    (lambda: divergence_bound([-1.0], 0.5), "norm"),
    (lambda: divergence_bound([1.0], 0.5, float("nan")), "history_bound"),
    (lambda: lead_bounds([1.0, 2.0], 0.5, ends=[True]), "ends"),
    (lambda: Momentum([0.0], gamma=1.5), "gamma"),
])
def test_bad_divergence_input_is_rejected(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- replication: Fig. 3 in numbers ---------------------------------------------------------------
def fig3():
    """Server 0, replica 1 behind a 1/s NIC, workers 2 and 3; u0 then u1 (10 bytes, norm 1) reach
    the server at 1 and 2. To the replica, u0 arrives at 11 and u1 at 20 (their workers' NICs are
    busy with the server's copies first). gamma = 0.5, H = 0: at T_last = 2 the replica has
    nothing, so div = H1 + H2 = 1 + 1.5 = 2.5; after u0 it is gamma H1 + 1 = 1.5; after u1, 0."""
    nw = Network([10.0] * 4, [10.0, 1.0, 10.0, 10.0])
    us = [Update(0, 2, 10.0, 0, norm=1.0), Update(1, 3, 10.0, 0, norm=1.0)]
    plan, after = schedule(us, nw, 0)
    assert [(c.time, c.ids) for c in plan.commits] == [(1.0, (0,)), (2.0, (1,))]
    return nw, plan, after


def test_fig3_bound_met_at_t_last_punts_without_delay():
    nw, plan, after = fig3()
    new, nw2, st_ = replicate(plan, after, 1, [], ReplicaState(), div_max=3.0, gamma=0.5)
    rp = new.replica
    assert rp.delayed is None and rp.punted == [0, 1] and not rp.frozen
    assert np.isclose(rp.divergence, 2.5) and rp.t_last == 2.0
    assert new.commits == plan.commits
    assert st_.lag == 2 and [u.id for u in st_.punted] == [0, 1] and st_.history_bound == 0.0
    # nothing of the punted transfers stays reserved
    assert nw2.links[nw2.ingress(1)].steps() == after.links[after.ingress(1)].steps()


def test_fig3_bound_violated_delays_the_last_server_transfer_after_a_e():
    nw, plan, after = fig3()
    new, nw2, st_ = replicate(plan, after, 1, [], ReplicaState(), div_max=2.0, gamma=0.5)
    rp = new.replica
    # a_e: u0 at the replica at 11 brings the bound to 1.5 <= 2; u1 is punted
    assert rp.a_e == 11.0 and rp.applied == [0] and rp.punted == [1]
    assert np.isclose(rp.divergence, 1.5) and rp.bound_met
    # the server's copy of u1 now starts at 11 and takes 1 s at 10/s
    d = rp.delayed
    assert (d.src, d.dst, d.ids, d.start, d.end) == (3, 0, (1,), 11.0, 12.0)
    assert new.commits[-1].time == 12.0 and new.commits[0] == plan.commits[0]
    assert plan.commits[-1].time == 2.0  # the input plan is not modified
    # the old reservation of u1 (h3 egress over [1, 2]) is returned, the new one taken
    eg3 = nw2.links[nw2.egress(3)]
    assert eg3.at(1.5) == 10.0 and eg3.at(11.5) == 0.0
    # the replica's ingress carries u0 only (rate 1 over [1, 11])
    assert nw2.links[nw2.ingress(1)].steps() == [(0.0, 1.0), (1.0, 0.0), (11.0, 1.0)]
    assert np.isclose(st_.history_bound, 1.0) and st_.lag == 1
    # tighter: the replica must get both; the server waits for 20
    new, _, st_ = replicate(plan, after, 1, [], ReplicaState(), div_max=1.0, gamma=0.5)
    assert new.replica.a_e == 20.0 and new.replica.delayed.start == 20.0 and st_.lag == 0
    assert new.replica.divergence == 0.0
    text = str(new)
    assert "delayed server transfer u1" in text and "a_e = 20" in text


# --- replication over random multi-batch runs -----------------------------------------------------
@dataclass
class Run:
    network: Network
    gamma: float
    server_aggs: list
    replica_aggs: list
    batches: list  # per batch: (start, [Update], {id: vector})
    tau_max: float


@st.composite
def runs(draw, max_batches=3, max_updates=5, dim=3):
    hosts = draw(st.integers(4, 7))
    nw = Network([draw(traces()) for _ in range(hosts)], [draw(traces()) for _ in range(hosts)])
    others = list(range(2, hosts))
    server_aggs = draw(st.lists(st.sampled_from(others), unique=True, max_size=2))
    replica_aggs = draw(st.lists(st.sampled_from([h for h in others if h not in server_aggs]
                                                 or [2]), unique=True, max_size=2))
    replica_aggs = [h for h in replica_aggs if h not in server_aggs]
    gamma = draw(gammas)
    batches, uid, start = [], 0, 0.0
    for _ in range(draw(st.integers(1, max_batches))):
        us, vecs = [], {}
        for _ in range(draw(st.integers(0, max_updates))):
            # nonzero vectors: a positive norm, so Div_max = 0 really requires catching up
            v = np.array(draw(st.lists(st.floats(0.1, 3.0), min_size=dim, max_size=dim)))
            v = v * np.array(draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=dim,
                                           max_size=dim)))
            vecs[uid] = v
            us.append(Update(uid, draw(st.sampled_from(others + [1])),
                             draw(st.sampled_from([1.0, 2.0, 5.0, 10.0])),
                             version=draw(st.integers(0, 3)) + uid // 2,
                             ready=start + draw(st.sampled_from([0.0, 0.0, 0.3])),
                             norm=float(np.linalg.norm(v))))
            uid += 1
        batches.append((start, us, vecs))
        start += draw(st.sampled_from([0.5, 1.0, 3.0]))
    tau = draw(st.one_of(st.just(inf), st.integers(2, 8)))
    return Run(nw, gamma, server_aggs, replica_aggs, batches, tau)


div_maxes = st.one_of(st.just(0.0), st.just(inf), st.floats(0.0, 30.0))


def check_residual(original, final, transfers):
    """The network returned after all batches is the original minus the load of the plans'
    transfers: punted replica transfers and a delayed transfer's old slot hold no reservation."""
    ts = breakpoints(original, transfers)
    ts = sorted(set(ts) | {t for p in final.links for t in p.t})
    for a, b in zip(ts, ts[1:] + [ts[-1] + 1.0]):
        mid = (a + b) / 2
        load = link_load(original, transfers, mid)
        for k in range(len(original.links)):
            cap = original.links[k].at(mid)
            assert abs(final.links[k].at(mid) - (cap - load[k])) <= 1e-9 * max(cap, 1.0), (k, mid)


def drive(run, div_max, *, mode="async", iteration_ends=None):
    """Schedule and replicate every batch, carrying network and state, and check each batch:
    prefix order, eq. 11 (independent reference) and the exact divergence (momentum simulator over
    the updates' vectors). Returns the per-batch (plan before, plan after) pairs."""
    sync = mode == "sync"
    nw, state = run.network, ReplicaState()
    dim = 3
    server, replica = Momentum(np.zeros(dim), None, run.gamma), Momentum(np.zeros(dim), None,
                                                                         run.gamma)
    server_seq, replica_seq, transfers, out = [], [], [], []
    vec, H = {}, 0.0  # H: the test's own bound on the replica's history (async)
    iter_of, members, closed, next_close = {}, {}, set(), [0]  # sync bookkeeping
    v_init, last_replica_commit = 0, 0.0

    def close_ready():  # sync: the replica ends an iteration once it holds all of it and it ended
        while next_close[0] in closed and all(u in applied_r for u in members[next_close[0]]):
            if members[next_close[0]]:
                replica.end_step()
            next_close[0] += 1

    applied_r = set()
    for b, (start, us, vecs) in enumerate(run.batches):
        vec.update(vecs)
        end = True if iteration_ends is None else iteration_ends[b]
        plan, after = schedule(us, nw, 0, aggregators=run.server_aggs, tau_max=run.tau_max,
                               v_init=v_init, start=start, seed=b, mode=mode,
                               momentum=run.gamma > 0)
        before_ids = [u.id for u in state.punted]
        new, nw, state = replicate(plan, after, 1, run.replica_aggs, state, div_max=div_max,
                                   gamma=run.gamma, seed=b, sync=sync, iteration_end=end)
        rp = new.replica
        out.append((plan, new))
        v_init += len(plan.order)
        # the server's model: its commits in order
        it = sum(1 for e in (iteration_ends or [])[:b] if e)
        for c in new.commits:
            for u in c.ids:
                server.apply(vec[u], ends_step=not sync)
                iter_of[u] = it
                members.setdefault(it, []).append(u)
        if sync and end:
            members.setdefault(it, [])
            if members[it]:  # an iteration without updates is no momentum step
                server.end_step()
            closed.add(it)
        # nothing lost, nothing duplicated: applied here + punted = punted before + this batch
        assert new.order == plan.order
        assert rp.applied + rp.punted == before_ids + plan.order
        assert [u.id for u in state.punted] == rp.punted and state.lag == len(rp.punted)
        server_seq += plan.order
        replica_seq += rp.applied
        assert replica_seq == server_seq[:len(replica_seq)]
        # the replica applies in sequence order in time too, across batches
        times = [last_replica_commit] + [c.time for c in rp.commits]
        assert times == sorted(times) and state.last_commit == times[-1]
        last_replica_commit = times[-1]
        assert server_seq[len(replica_seq):] == rp.punted
        # the replica's model: its commits in order (an aggregate = its members in order)
        H_start = H
        for u in rp.applied:
            replica.apply(vec[u], ends_step=not sync)
            applied_r.add(u)
            H = np.linalg.norm(vec[u]) + run.gamma * H
            if sync:
                close_ready()
        if sync:
            close_ready()
        exact = np.linalg.norm(server.w - replica.w)
        assert exact <= rp.divergence * (1 + REL) + 1e-9, (exact, rp.divergence)
        if not sync:
            ref = ref_bound([vec_norm(vec, u) for u in rp.punted], run.gamma, H)
            assert np.isclose(rp.divergence, ref, rtol=1e-9, atol=1e-12)
            assert np.linalg.norm(replica.h) <= state.history_bound * (1 + REL) + 1e-9
        if rp.enforced:
            assert rp.bound_met and rp.divergence <= div_max and exact <= div_max * (1 + REL) + 1e-9
        else:
            assert rp.delayed is None
        check_delay(plan, new, rp)
        if not sync and rp.a_e is not None:
            # a_e is the earliest: with the replica one commit short the bound would not hold
            short = len(rp.applied) - len(rp.commits[-1].ids)
            seq = before_ids + plan.order
            Hs = H_start
            for u in seq[:short]:
                Hs = vec_norm(vec, u) + run.gamma * Hs
            assert ref_bound([vec_norm(vec, u) for u in seq[short:]], run.gamma, Hs) > div_max
        transfers += new.transfers()
        check_bytes(new.transfers())
        str(new)
    check_capacity(run.network, transfers)
    check_residual(run.network, nw, transfers)
    return out, state


def vec_norm(vec, u):
    return float(np.linalg.norm(vec[u]))


def server_transfers(p):
    out = list(p.direct)
    for a in p.aggregates:
        out += list(a.inbound) + [a.transfer]
    return out


def check_delay(plan, new, rp):
    """Without a delay the server's plan is untouched and, unless the replica had to catch up past
    T_last with no server transfer left to move, it froze only what it had by T_last; with one, only
    the last server transfer moved, and it starts after a_e, the replica's last frozen commit."""
    assert rp.t_last == plan.makespan
    if rp.delayed is None:
        assert server_transfers(new) == server_transfers(plan) and new.commits == plan.commits
        if rp.a_e is None:
            assert all(c.time <= rp.t_last for c in rp.commits)
        else:
            assert not plan.commits
        return
    assert rp.delayed.start >= rp.a_e > rp.t_last
    assert rp.a_e == rp.commits[-1].time
    assert new.commits[-1].time == rp.delayed.end and new.commits[:-1] == plan.commits[:-1]
    assert new.commits[-1].ids == plan.commits[-1].ids == rp.delayed.ids
    old_last = plan.aggregates[-1].transfer if plan.aggregates else plan.direct[-1]
    assert server_transfers(new) == [rp.delayed if t is old_last else t
                                     for t in server_transfers(plan)]


@PROPS
@given(runs(), div_maxes)
def test_replication_invariants(run, div_max):
    drive(run, div_max)


@settings(max_examples=30, deadline=None)
@given(runs(), st.sampled_from([inf, 1e12]))
def test_large_div_max_never_delays(run, div_max):
    for plan, new in drive(run, div_max)[0]:
        assert new.replica.delayed is None and new.replica.a_e is None
        assert new.commits == plan.commits


@settings(max_examples=30, deadline=None)
@given(runs())
def test_zero_div_max_catches_the_replica_up_every_batch(run):
    out, state = drive(run, 0.0)
    for plan, new in out:
        assert new.replica.punted == [] and new.replica.divergence == 0.0
    assert state.lag == 0 and state.punted == []


@settings(max_examples=30, deadline=None)
@given(runs(max_batches=4), div_maxes, st.data())
def test_sync_bound_holds_at_iteration_ends_only(run, div_max, data):
    """Sync SGD (§6): an iteration spans one or more batches and is one momentum step; batches that
    do not end it never delay the server, the one that ends it enforces Div_max."""
    n = len(run.batches)
    ends = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    ends[-1] = True
    out, state = drive(run, div_max, mode="sync", iteration_ends=ends)
    for (plan, new), e in zip(out, ends):
        assert new.replica.enforced == e
    assert not state.open_step


def test_a_batch_without_server_commits_still_catches_the_replica_up():
    # Div_max lowered after a batch that punted everything: nothing to delay, the replica catches up
    nw, plan, after = fig3()
    new, nw2, st_ = replicate(plan, after, 1, [], ReplicaState(), div_max=inf, gamma=0.5)
    assert st_.lag == 2
    empty, after2 = schedule([], nw2, 0, v_init=2, start=3.0)
    new2, _, st2 = replicate(empty, after2, 1, [], st_, div_max=0.0, gamma=0.5)
    rp = new2.replica
    assert rp.delayed is None and rp.a_e == rp.commits[-1].time and rp.applied == [0, 1]
    assert st2.lag == 0 and rp.divergence == 0.0 and rp.bound_met


def test_when_the_bound_cannot_be_restored_the_server_is_not_stalled():
    # the replica's NIC dies at t=1: nothing can reach it, so no replica commit restores the bound
    nw = Network([10.0] * 4, [10.0, [(0.0, 1.0), (1.0, 0.0)], 10.0, 10.0])
    us = [Update(0, 2, 10.0, 0, norm=1.0), Update(1, 3, 10.0, 0, norm=1.0)]
    plan, after = schedule(us, nw, 0)
    new, _, st_ = replicate(plan, after, 1, [], ReplicaState(), div_max=0.5, gamma=0.5)
    rp = new.replica
    assert not rp.bound_met and rp.delayed is None and new.commits == plan.commits
    assert rp.punted == [0, 1] and st_.lag == 2 and "BOUND NOT MET" in str(rp)
    # the replica could catch up at 11, but the server's last path (h3's NIC) is dead by then
    nw = Network([10.0, 10.0, 10.0, [(0.0, 10.0), (5.0, 0.0)]], [10.0, 1.0, 10.0, 10.0])
    plan, after = schedule(us, nw, 0)
    new, nw2, _ = replicate(plan, after, 1, [], ReplicaState(), div_max=2.0, gamma=0.5)
    rp = new.replica
    assert not rp.bound_met and rp.delayed is None and rp.a_e is None and rp.punted == [0, 1]
    assert new.commits == plan.commits and not rp.frozen
    assert nw2.links[nw2.ingress(1)].steps() == after.links[after.ingress(1)].steps()


def test_inputs_are_not_modified_and_runs_are_reproducible():
    nw, plan, after = fig3()
    steps = [list(p.steps()) for p in after.links]
    a = replicate(plan, after, 1, [], ReplicaState(), div_max=2.0, gamma=0.5)
    b = replicate(plan, after, 1, [], ReplicaState(), div_max=2.0, gamma=0.5)
    assert [list(p.steps()) for p in after.links] == steps and plan.replica is None
    assert a[0].replica.frozen == b[0].replica.frozen and a[2] == b[2]


def test_punted_updates_travel_with_the_next_batch_and_aggregate_there():
    # a slow replica NIC: the first batch is punted whole, the next batch sends old and new together
    nw = Network([10.0] * 6, [10.0, 2.0, 10.0, 10.0, 10.0, 10.0])
    b1 = [Update(i, 2 + i % 2, 10.0, 0, norm=1.0) for i in range(2)]
    b2 = [Update(2 + i, 2 + i % 2, 10.0, 2, ready=0.5, norm=1.0) for i in range(2)]
    plan, after = schedule(b1, nw, 0)
    new, nw, st_ = replicate(plan, after, 1, [5], ReplicaState(), div_max=inf, gamma=0.9)
    assert new.replica.punted == [0, 1] and st_.lag == 2
    plan2, after2 = schedule(b2, nw, 0, v_init=2, start=0.5)
    new2, _, st2 = replicate(plan2, after2, 1, [5], st_, div_max=0.0, gamma=0.9)
    rp = new2.replica
    assert rp.applied == [0, 1, 2, 3] and st2.lag == 0
    assert rp.replica_bytes < sum(u.size for u in b1 + b2)  # aggregated at h5 on the way


def test_norm_cap_splits_the_replica_aggregates():
    # the same punted-then-caught-up batch: uncapped, h5 aggregates all four copies of norm 1;
    # with norm_cap=1.5 no replica commit holds more than one of them, and all four still arrive
    nw0 = Network([10.0] * 6, [10.0, 2.0, 10.0, 10.0, 10.0, 10.0])
    b1 = [Update(i, 2 + i % 2, 10.0, 0, norm=1.0) for i in range(2)]
    b2 = [Update(2 + i, 2 + i % 2, 10.0, 2, ready=0.5, norm=1.0) for i in range(2)]
    for cap, most in ((inf, 4), (1.5, 1)):
        plan, after = schedule(b1, nw0, 0)
        new, nw, st_ = replicate(plan, after, 1, [5], ReplicaState(), div_max=inf, gamma=0.0,
                                 norm_cap=cap)
        plan2, after2 = schedule(b2, nw, 0, v_init=2, start=0.5)
        new2, _, _ = replicate(plan2, after2, 1, [5], st_, div_max=0.0, gamma=0.0, norm_cap=cap)
        rp = new2.replica
        assert rp.applied == [0, 1, 2, 3]
        assert max(len(c.ids) for c in rp.commits) == most, (cap, rp.commits)


@pytest.mark.parametrize("kw, match", [
    (dict(replica=0), "server's host"),
    (dict(replica=9), "replica 9"),
    (dict(aggregators=[1]), "replica's host"),
    (dict(aggregators=[0]), "server's host"),
    (dict(aggregators=[2, 2]), "twice"),
    (dict(aggregators=[7]), "aggregator 7"),
    (dict(div_max=-1.0), "div_max"),
    (dict(div_max=float("nan")), "div_max"),
    (dict(gamma=1.0), "gamma"),
    (dict(state=ReplicaState(lag=3)), "lag"),
    (dict(state=ReplicaState(history_bound=-1.0)), "history_bound"),
    (dict(state=ReplicaState(punted=[Update(0, 2, 1.0, 0)], lag=1)), "unique across batches"),
    (dict(state=ReplicaState(open_step=True)), "sync=False"),
    (dict(state=ReplicaState(last_commit=-1.0)), "last_commit"),
    (dict(state="start"), "ReplicaState"),
])
def test_bad_replication_input_is_rejected(kw, match):
    nw, plan, after = fig3()
    args = dict(plan=plan, network=after, replica=1, aggregators=[], state=ReplicaState(),
                div_max=1.0, gamma=0.5)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        replicate(**args)


def test_a_plan_is_replicated_once():
    nw, plan, after = fig3()
    new, nw2, _ = replicate(plan, after, 1, [], ReplicaState(), div_max=1.0, gamma=0.5)
    with pytest.raises(ValueError, match="already"):
        replicate(new, nw2, 1, [], ReplicaState(), div_max=1.0, gamma=0.5)
    assert isinstance(new.replica, ReplicaPlan)
    assert new.transfers()[-len(new.replica.frozen):] == new.replica.frozen


def test_momentum_needs_a_server_plan_whose_aggregates_carry_both_sums():
    nw = Network.uniform(6, 10.0)
    us = [Update(i, 2 + i % 3, 10.0, version=0, norm=1.0) for i in range(4)]
    plan, after = schedule(us, nw, 0, aggregators=[5])
    assert any(len(a.members) > 1 for a in plan.aggregates)
    with pytest.raises(ValueError, match="momentum=True"):
        replicate(plan, after, 1, [], ReplicaState(), div_max=1.0, gamma=0.9)
    plan, after = schedule(us, nw, 0, aggregators=[5], momentum=True)
    assert plan.momentum
    replicate(plan, after, 1, [], ReplicaState(), div_max=1.0, gamma=0.9)
    # sync: an iteration is one step, plain sums are right
    plan, after = schedule(us, nw, 0, aggregators=[5], mode="sync", momentum=True)
    assert not plan.momentum
    replicate(plan, after, 1, [], ReplicaState(), div_max=1.0, gamma=0.9, sync=True)
