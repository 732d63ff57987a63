"""Parameter-server jobs under real mpirun (run by tests/mpi/test_ps.py): every mode's numerics
against float64 references, delay bounds, accounting, replicas, bad input. Each case is a whole
job (init, register, train, finish) on every rank."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import mlfabric.ps as ps
from mlfabric.emulate import Emulation
from mlfabric.errors import MlfabricError
from mlfabric.ps.driver import default_update, run_job, shards
from mlfabric.runtime.roles import Roles
from mlfabric.sched.plan import DROP_SLOW, DROP_STALE

from .common import take_part

WORLD = MPI.COMM_WORLD
SIZE = 1003  # not a multiple of anything
FAST = Emulation(base_rate=200e6)  # paced, but quick


def _reference(roles, iterations, ids=None, size=SIZE, seed=0):
    """float64 model0 + the sum of the updates (all, or those whose id is in `ids`)."""
    upd = default_update(size, np.float64, seed)
    total = np.zeros(size)
    for w in roles.worker_ranks:
        for i in range(iterations):
            if ids is None or (w << 32 | i) in ids:
                total += upd(w, i, None)
    return total


def _check_summary(res):
    s = res.summary
    assert s.balanced, s
    assert s.pushed == s.applied + sum(s.dropped.values()), s


def _server_ids(res):
    return {u for ids, *_ in res.applied_log for u in ids}


def _check_model_is_applied_sum(res, size):
    """On the server: its model is exactly the float64 sum of the default updates it applied."""
    if res.role == "server":
        upd = default_update(size, np.float64)
        ref = sum((upd(u >> 32, u & 0xFFFFFFFF, None) for u in _server_ids(res)),
                  np.zeros(size))
        np.testing.assert_allclose(res.model, ref, rtol=1e-12, atol=1e-14)


def case_sync_equals_float64_reference():
    for servers in (1, 2) if WORLD.size >= 5 else (1,):
        res = run_job("mlfabric-S", size=SIZE, iterations=4, servers=servers, emulation=FAST,
                      batch_interval=0.02)
        roles = Roles(WORLD.size, servers)
        _check_summary(res)
        assert res.summary.applied == 4 * len(roles.worker_ranks) * servers
        ref = _reference(roles, 4)
        if res.role == "server":
            a, b = shards(SIZE, servers)[roles.server_ranks.index(WORLD.rank)]
            np.testing.assert_allclose(res.model, ref[a:b], rtol=1e-12, atol=1e-14)
        if res.role == "worker":  # its last get: the model after every iteration
            np.testing.assert_allclose(res.model, _reference(roles, 3), rtol=1e-12, atol=1e-14)


def case_cut_through_relays_sum_exactly():
    """Cut-through (the default) and store-and-forward relays give the float64 reference's model;
    with cut-through, models pass on from their headers and aggregates stream out as their
    members come (multi-chunk payloads: 1.6 MB at 50 MB/s), and neither happens without it."""
    size, emu = 200_003, Emulation(base_rate=50e6)
    roles = Roles(WORLD.size, 1)
    # both jobs first, on every rank: a check failing on some ranks between the two jobs would
    # leave the others alone in the second job's collective start-up
    runs = {cut: run_job("mlfabric-S", size=size, iterations=3, emulation=emu,
                         batch_interval=0.02, cut_through=cut) for cut in (True, False)}
    for cut, res in runs.items():
        _check_summary(res)
        if res.role == "server":
            np.testing.assert_allclose(res.model, _reference(roles, 3, size=size), rtol=1e-12,
                                       atol=1e-14)
        if res.role == "worker":
            np.testing.assert_allclose(res.model, _reference(roles, 2, size=size), rtol=1e-12,
                                       atol=1e-14)
        relayed = res.summary.relayed
        if cut:
            assert relayed.get("forward", 0) > 0 and relayed.get("sum", 0) > 0, relayed
        else:
            assert not relayed, relayed


def case_async_delays_within_tau_max():
    tau = 2
    res = run_job("mlfabric-A", size=SIZE, iterations=6, tau_max=tau, emulation=FAST,
                  batch_interval=0.02)
    _check_summary(res)
    assert res.summary.max_delay is None or res.summary.max_delay <= tau, res.summary
    if res.role == "server":
        applied = _server_ids(res)
        ref = _reference(Roles(WORLD.size), 6, applied)
        np.testing.assert_allclose(res.model, ref, rtol=1e-12, atol=1e-14)
        versions = [v for _, v, *_ in res.applied_log]
        assert versions == sorted(versions)


def case_a_worker_learns_which_of_its_updates_were_dropped():
    # tau_max = 0 and pushes without gets: every update is stale (even a lone worker's update
    # has delay 1: it takes the model one version past the one it was computed from); every
    # worker hears of exactly its own dropped ids, and they complete the server's applied ids
    # (none) to everything pushed
    role = ps.init("mlfabric-A", emulation=FAST, batch_interval=0.02)
    upd = default_update(SIZE, np.float64)
    pushed, dropped, applied = [], [], []
    if role == "worker":
        ps.register_as_worker(tau_max=0)
        ps.get(1)
        pushed = [ps.push(1, upd(WORLD.rank, i, None)) for i in range(4)]
        summary = ps.finish()
        dropped = ps.dropped()
        assert all(uid in pushed for uid, _ in dropped), (dropped, pushed)
        assert all(why == "stale" for _, why in dropped), dropped
        assert summary.dropped.get("stale", 0) >= len(dropped) > 0, summary
    elif role == "server":
        ps.register_as_server(np.zeros(SIZE))
        ps.serve()
        applied = [u for ids, *_ in ps.applied_log() for u in ids]
    else:
        ps.serve()
    everything = WORLD.allgather((pushed, [u for u, _ in dropped], applied))
    all_pushed = sorted(u for p, _, _ in everything for u in p)
    all_dropped = [u for _, d, _ in everything for u in d]
    all_applied = [u for _, _, a in everything for u in a]
    assert sorted(all_dropped + all_applied) == all_pushed
    assert not all_applied, all_applied


def case_vanilla_async_applies_everything():
    res = run_job("async", size=SIZE, iterations=5, emulation=FAST)
    _check_summary(res)
    assert res.summary.applied == res.summary.pushed == 5 * len(Roles(WORLD.size).worker_ranks)
    if res.role == "server":
        np.testing.assert_allclose(res.model, _reference(Roles(WORLD.size), 5), rtol=1e-12,
                                   atol=1e-14)


def case_applied_log_keeps_the_last_commits():
    """applied_log_max bounds what a server keeps for applied_log(): the last commits, in order;
    the model and the accounts are unaffected."""
    full = run_job("async", size=SIZE, iterations=5, emulation=FAST)
    res = run_job("async", size=SIZE, iterations=5, emulation=FAST, applied_log_max=3)
    _check_summary(res)
    assert res.summary.applied == full.summary.applied
    if res.role == "server":
        assert len(full.applied_log) == full.summary.applied > 3
        assert len(res.applied_log) == 3
        assert [e[1] for e in res.applied_log] == [e[1] for e in full.applied_log[-3:]]
        np.testing.assert_allclose(res.model, full.model, rtol=1e-12, atol=1e-14)


def case_async_job_runs_for_a_duration():
    """duration_s: workers run for a time, not a quota. The first worker is slow (30 ms per
    update, the others 2 ms): it does fewer iterations, nobody starts one after the deadline,
    and the server's model is the float64 sum of exactly the updates pushed. A synchronous mode
    refuses duration_s on every rank, before any communication."""
    roles = Roles(WORLD.size)
    slow = roles.worker_ranks[0]
    base = default_update(SIZE, np.float64)

    def update(rank, i, model):
        time.sleep(0.03 if rank == slow else 0.002)
        return base(rank, i, model)

    duration = 0.5
    res = run_job("async", size=SIZE, iterations=10**6, duration_s=duration, update_fn=update,
                  emulation=FAST)
    _check_summary(res)
    done = WORLD.allgather(len(res.iter_times) if res.role == "worker" else None)
    counts = {r: done[r] for r in roles.worker_ranks}
    assert all(n >= 1 for n in counts.values()), counts
    if len(counts) > 1:
        assert counts[slow] < min(n for r, n in counts.items() if r != slow), counts
    if res.role == "worker":
        # it stopped at its first iteration boundary past the deadline: not before, and its
        # last iteration began before it
        assert res.wall >= duration, res.wall
        assert sum(res.iter_times[:-1]) < duration, res.iter_times
    assert res.summary.pushed == sum(counts.values()), (res.summary, counts)
    if res.role == "server":
        ref = np.zeros(SIZE)
        for r, n in counts.items():
            for i in range(n):
                ref += base(r, i, None)
        np.testing.assert_allclose(res.model, ref, rtol=1e-12, atol=1e-14)
    for mode in ("mlfabric-S", "ssp", "rr-sync"):
        try:
            run_job(mode, size=SIZE, iterations=2, duration_s=1.0, emulation=FAST)
        except ValueError as e:
            assert "duration_s" in str(e), e
        else:
            raise AssertionError("%s accepted duration_s" % mode)


def case_ssp_applies_everything():
    res = run_job("ssp", size=SIZE, iterations=5, slack=1, emulation=FAST, batch_interval=0.02)
    _check_summary(res)
    assert res.summary.applied == res.summary.pushed
    if res.role == "server":
        np.testing.assert_allclose(res.model, _reference(Roles(WORLD.size), 5), rtol=1e-12,
                                   atol=1e-14)


def case_allreduce_baselines_equal_reference():
    for mode in ("rr-sync", "tr-sync"):
        res = run_job(mode, size=SIZE, iterations=3, emulation=FAST)
        if res.role == "worker":
            np.testing.assert_allclose(res.model, _reference(Roles(WORLD.size), 3), rtol=1e-12,
                                       atol=1e-14)


def case_push_wrong_shape_or_dtype_is_refused_at_the_worker():
    role = ps.init("mlfabric-A", emulation=FAST, batch_interval=0.02)
    if role == "worker":
        ps.register_as_worker()
        for bad in (np.zeros(SIZE + 1), np.zeros(SIZE, np.float32), [0.0] * SIZE):
            try:
                ps.push(1, bad)
            except (ValueError, TypeError) as e:
                assert "nothing was sent" in str(e) or "numpy array" in str(e), e
            else:
                raise AssertionError("push of %r accepted" % type(bad))
        try:
            ps.push(0, np.zeros(SIZE))
        except MlfabricError as e:
            assert "not a server" in str(e)
        else:
            raise AssertionError("push to the scheduler accepted")
        try:
            ps.serve()
        except MlfabricError as e:
            assert "finish" in str(e)
        else:
            raise AssertionError("serve() on a worker accepted")
        s = ps.finish()
    elif role == "server":
        model = np.zeros(SIZE)
        ps.register_as_server(model)
        s = ps.serve()
        assert not model.any()  # nothing applied
    else:
        s = ps.serve()
    assert s.pushed == 0 and s.applied == 0 and s.balanced, s


def case_calls_before_registering_are_errors():
    ps.init("mlfabric-A")
    for call in (lambda: ps.push(1, np.zeros(3)), lambda: ps.get(1), ps.finish):
        try:
            call()
        except MlfabricError as e:
            assert "register" in str(e), e
        else:
            raise AssertionError("accepted before registering")
    api = ps.api
    api._state.update(config=None, role=None)  # leave no half-started job behind


def case_replica_equals_server_and_divergence_is_bounded():
    if WORLD.size < 4:
        return
    div_max = 1.0  # about three updates' worth (each has norm ~ 0.01 * sqrt(SIZE) ~ 0.32)
    res = run_job("mlfabric-A", size=SIZE, iterations=6, replicas=1, div_max=div_max,
                  emulation=FAST, batch_interval=0.02)
    _check_summary(res)
    logs = WORLD.allgather((res.role, res.applied_log, res.model))
    server = next(x for x in logs if x[0] == "server")
    replica = next(x for x in logs if x[0] == "replica")
    np.testing.assert_allclose(replica[2], server[2], rtol=1e-12, atol=1e-14)
    assert res.summary.replicated == res.summary.applied
    s_order = [u for ids, *_ in server[1] for u in ids]
    r_order = [u for ids, *_ in replica[1] for u in ids]
    assert s_order == r_order  # the replica applies in the server's order
    # divergence measured exactly: at each server commit, the server's model minus the replica's
    # (same host, one clock) is the sum of the updates the replica has not applied yet; the
    # divergence gate keeps it within Div_max at every commit (stronger than the paper's check at
    # batch ends, §5.3: a server may die at any instant)
    upd = default_update(SIZE, np.float64)
    vec = {u: upd(u >> 32, u & 0xFFFFFFFF, None) for u in s_order}
    r_times = [(t, n) for _, n, t, _ in replica[1]]
    ends = [(version, t) for _, version, t, _ in server[1]]
    assert any(needed > 0 for *_, needed in server[1]), "no server commit was gated on the replica"
    worst = 0.0
    for version, t in ends:
        have = max([n for tr, n in r_times if tr <= t], default=0)
        lead = s_order[have:version]
        d = float(np.linalg.norm(sum((vec[u] for u in lead), np.zeros(SIZE))))
        worst = max(worst, d)
        assert d <= div_max + 1e-12, (d, div_max, version, have)
    if WORLD.rank == 0:
        print("replica: worst divergence at a server commit %.3f (div_max %.3f)" % (worst, div_max))


def case_checkpoint_then_resume():
    import os
    import tempfile
    from mlfabric.runtime import checkpoint
    d = WORLD.bcast(tempfile.mkdtemp(prefix="mlfabric-ckpt-") if WORLD.rank == 0 else None)
    roles = Roles(WORLD.size)
    upd = default_update(SIZE, np.float64)
    res = run_job("mlfabric-A", size=SIZE, iterations=5, emulation=FAST, batch_interval=0.02,
                  checkpoint_every=3, checkpoint_dir=d)
    _check_summary(res)
    WORLD.Barrier()
    saved, version = checkpoint.load(d, 1)
    if res.role == "server":  # the checkpoint is the model after exactly `version` updates
        order = [u for ids, *_ in res.applied_log for u in ids]
        assert version % 3 == 0 or version == len(order), version
        ref = sum((upd(u >> 32, u & 0xFFFFFFFF, None) for u in order[:version]), np.zeros(SIZE))
        np.testing.assert_allclose(saved, ref, rtol=1e-12, atol=1e-14)
    WORLD.Barrier()
    res2 = run_job("mlfabric-A", size=SIZE, iterations=2, emulation=FAST, batch_interval=0.02,
                   checkpoint_dir=d, resume=True, seed=1)
    _check_summary(res2)
    if res2.role == "server":
        upd1 = default_update(SIZE, np.float64, seed=1)
        applied = [u for ids, *_ in res2.applied_log for u in ids]
        ref = saved + sum((upd1(u >> 32, u & 0xFFFFFFFF, None) for u in applied), np.zeros(SIZE))
        np.testing.assert_allclose(res2.model, ref, rtol=1e-12, atol=1e-14)
        assert res2.applied_log[0][1] > version  # versions continue from the checkpoint's
    assert len(roles.worker_ranks) >= 1 and os.path.isdir(d)


def case_paced_async_keeps_delays_within_tau_max():
    """A slow emulated network (400 KB updates at 20 MB/s: 20 ms each) and a tight tau_max, where
    stale drops and aggregation happen (how many depends on timing, so it is printed, not
    asserted): every applied delay stays within tau_max, the model is exactly the sum of what was
    applied, and the accounts balance. With every objective of the pull trees (the paper's
    makespan, the mean delivery, the fast requesters first)."""
    size, tau = 50_000, 1
    for objective in ("makespan", "mean", "fast-first"):
        res = run_job("mlfabric-A", size=size, iterations=4, tau_max=tau,
                      emulation=Emulation(base_rate=20e6), batch_interval=0.05,
                      pull_objective=objective)
        _check_summary(res)
        s = res.summary
        assert s.max_delay is None or s.max_delay <= tau, s
        _check_staleness_profile(s, tau)
        if res.role == "server":
            applied = _server_ids(res)
            assert len(applied) == s.applied
            upd = default_update(size, np.float64)
            ref = sum((upd(u >> 32, u & 0xFFFFFFFF, None) for u in applied), np.zeros(size))
            np.testing.assert_allclose(res.model, ref, rtol=1e-12, atol=1e-14)
        if WORLD.rank == 0:
            print("paced async, pull trees by %s: %s" % (objective, s))


def case_pull_admission_defers_models_whose_updates_cannot_meet_tau_max():
    """mlfabric-A's pull admission (runtime/pulls.py _admit) with tau_max = 1: a model is handed
    out only while no update is ahead of the one computed from it (in flight, reported or being
    computed), one requester at least per pull batch; with 3 or more workers asking at once some
    requests must wait for a later batch, and none ever does with the admission off. Either way
    every applied delay is within tau_max, the accounts balance and the model is exactly the sum
    of what was applied."""
    size, tau = 50_000, 1
    workers = len(Roles(WORLD.size).worker_ranks)
    # both jobs first, on every rank (a failed check between them would strand the others)
    runs = {on: run_job("mlfabric-A", size=size, iterations=4, tau_max=tau,
                        emulation=Emulation(base_rate=20e6), batch_interval=0.05,
                        pull_admission=on) for on in (True, False)}
    for on, res in runs.items():
        _check_summary(res)
        s = res.summary
        assert s.max_delay is None or s.max_delay <= tau, s
        _check_staleness_profile(s, tau)
        deferred = s.control["deferred_pulls"]
        if not on:
            assert deferred == 0, s.control
        elif workers >= 3:
            assert deferred > 0, s.control
        _check_model_is_applied_sum(res, size)
        if WORLD.rank == 0:
            print("pull admission %s: %d requests deferred, %s" % (on, deferred, s.dropped))


def case_async_drops_the_updates_of_slow_links_only():
    """N3 (half the NIC directions at a tenth of the rate), one period for the whole job, a bound
    too loose to drop anything stale, the pull admission off: the scheduler drops at their
    workers updates whose sender's egress is slow (800 KB at 2 MB/s: 0.4 s, where a full-rate sender's, a 200 ms batch
    later, would be in after 240 ms), never one from a full-rate sender; every drop has that
    reason, the accounts balance and the model is the sum of what was applied."""
    size = 100_000
    # seed 14: at 2, 3 and 5 workers, full-rate senders and slow ones whose ingress is mostly
    # full rate, so that both keep the same pace and their updates share batches
    emu = Emulation("C0", "N3", base_rate=20e6, period=60.0, seed=14)
    roles = Roles(WORLD.size)
    workers = len(roles.worker_ranks)
    # the admission off: it would park the slow senders' gets instead (the case after this)
    res = run_job("mlfabric-A", size=size, iterations=8, tau_max=1000, emulation=emu,
                  compute_s=0.02, batch_interval=0.2, t_lag=0.02, pull_admission=False)
    _check_summary(res)
    s = res.summary
    assert set(s.dropped) <= {DROP_SLOW}, s
    mine = ps.dropped() if res.role == "worker" else []
    slow = False
    if res.role == "worker":
        k = roles.worker_index(WORLD.rank)
        nic = emu.nic(k, workers, time.monotonic())
        slow = nic.egress_rate() < emu.base_rate / 2
        if not slow:     # a full-rate sender is never slower than the next batch
            assert mine == [], (WORLD.rank, mine)
    everyone = [x for x in WORLD.allgather((res.role, slow, len(mine))) if x[0] == "worker"]
    if workers >= 2:
        assert {sl for _, sl, _ in everyone} == {True, False}, everyone
    # slow senders lose updates (one batched with a full-rate sender's is dropped; one alone in
    # its batch is its fastest, and kept), and the summary counts exactly the workers' drops
    if workers >= 2:
        assert sum(n for _, sl, n in everyone if sl) > 0, everyone
    assert s.dropped.get(DROP_SLOW, 0) == sum(n for *_, n in everyone), (everyone, s)
    _check_model_is_applied_sum(res, size)


def case_pull_admission_parks_slow_uplinks_while_fast_ones_push():
    """The setting above with the pull admission on (runtime/pulls.py _admit): a worker whose
    uplink is slow is not handed a model while one with a fast uplink pushes (its update would
    be dropped for the slow link), and asks again; once the fast senders are done it is served,
    so every worker still runs all its iterations (no hang) and its updates then go in, alone
    or with other slow senders'. Parking happens exactly when there are both kinds; fewer
    updates are dropped for a slow link than with the admission off (same seeded links); the
    accounts balance and the model is the sum of what was applied."""
    size, iterations = 100_000, 8
    emu = Emulation("C0", "N3", base_rate=20e6, period=60.0, seed=14)
    roles = Roles(WORLD.size)
    workers = len(roles.worker_ranks)
    runs = {on: run_job("mlfabric-A", size=size, iterations=iterations, tau_max=1000,
                        emulation=emu, compute_s=0.02, batch_interval=0.2, t_lag=0.02,
                        pull_admission=on) for on in (True, False)}
    for on, res in runs.items():
        _check_summary(res)
        assert set(res.summary.dropped) <= {DROP_SLOW}, res.summary
        if res.role == "worker":
            assert len(res.iter_times) == iterations, res.iter_times
        _check_model_is_applied_sum(res, size)
    on, off = runs[True].summary, runs[False].summary
    parked = on.control["parked_pulls"]
    assert off.control["parked_pulls"] == 0, off.control["parked_pulls"]
    if workers >= 2:   # seed 14 gives both kinds at 2, 3 and 5 workers (the case above)
        assert parked > 0, parked
        assert on.dropped.get(DROP_SLOW, 0) < off.dropped.get(DROP_SLOW, 0), (on, off)
    else:              # a lone worker has no faster peer: never parked
        assert parked == 0, parked
    if WORLD.rank == 0:
        print("parked %d gets (the longest %.2f s); dropped for a slow link: %d with the "
              "admission, %d without" % (parked, on.control["parked_longest_s"],
                                         on.dropped.get(DROP_SLOW, 0),
                                         off.dropped.get(DROP_SLOW, 0)))


def case_a_parked_get_is_served_within_its_cap():
    """A get is parked at most PARK_MAX_SHARE of MLFABRIC_TIMEOUT (runtime/pulls.py), so a worker
    whose uplink stays slow still fetches now and then, and never nears the timeout: with the
    cap at 30 ms (set on the scheduler) and fast workers pushing for longer than that, a parked
    get is served within the cap plus the server's re-ask interval (t_lag) and the control
    path's delays, and the slow workers fetch while the fast ones push - so their updates are
    dropped for the slow link again. Every update is still accounted for."""
    from mlfabric.runtime import pulls
    emu = Emulation("C0", "N3", base_rate=20e6, period=60.0, seed=14)
    workers = len(Roles(WORLD.size).worker_ranks)
    share = pulls.PARK_MAX_SHARE
    if WORLD.rank == 0:
        from mlfabric._core import config as _config
        pulls.PARK_MAX_SHARE = 0.03 / _config.timeout_s()
    try:
        res = run_job("mlfabric-A", size=100_000, iterations=8, tau_max=1000, emulation=emu,
                      compute_s=0.02, batch_interval=0.2, t_lag=0.02)
    finally:
        pulls.PARK_MAX_SHARE = share
    _check_summary(res)
    s = res.summary
    parked = {k: s.control[k] for k in ("parked_pulls", "parked_longest_s")}
    if workers >= 2:   # both kinds of uplink (seed 14, the cases above)
        assert parked["parked_pulls"] > 0, parked
        assert 0.03 <= parked["parked_longest_s"] < 0.5, parked
        assert s.dropped.get(DROP_SLOW, 0) > 0, s


def _check_staleness_profile(s, tau):
    """The scheduler's staleness profile (every rank gets the summary): each pushed update's lag
    when planned counted once; a lag of tau_max or more (the versions planned since its model)
    leaves no position within the bound, so at least that many were dropped stale, and every
    applied update had a lag under tau_max; nothing planned is ever ahead of v_init, and the
    updates in flight at a plan are between none and all of those pushed; each applied update
    has one plan-to-applied time, none negative (the same clock), and its lateness against the
    planned arrival is at most that time."""
    lag = s.control["lag_at_plan"]
    assert sum(lag.values()) == s.pushed, (lag, s)
    assert min(lag) >= 0, lag
    assert sum(n for k, n in lag.items() if k >= tau) <= s.dropped.get(DROP_STALE, 0), (lag, s)
    assert sum(n for k, n in lag.items() if k < tau) >= s.applied, (lag, s)
    flight = s.control["in_flight_at_plan"]
    assert flight and all(0 <= x <= s.pushed for x in flight), flight
    latency, late = s.control["commit_latency"], s.control["commit_late"]
    assert len(latency) == len(late) == s.applied, (len(latency), len(late), s)
    assert all(x >= 0 for x in latency), latency
    assert all(b <= a for a, b in zip(latency, late)), (latency, late)


def case_allreduce_through_push_and_get():
    """Table 1's AllReduce: roots drawn per call, aggregation and distribution planned by the
    scheduler; every worker gets the float64 sum, for several shapes, on a paced network."""
    role = ps.init("mlfabric-A", emulation=Emulation(base_rate=50e6), batch_interval=0.02)
    roles = Roles(WORLD.size)

    def work():
        for k, shape in enumerate([(5,), (1000, 3), (70_001,), (0,)]):
            x = np.random.default_rng([k, WORLD.rank]).standard_normal(shape)
            ref = sum(np.random.default_rng([k, w]).standard_normal(shape)
                      for w in roles.worker_ranks)
            y = ps.allreduce(x)
            np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
            assert y.shape == shape
    _, s = take_part(role, work)
    assert s.balanced and s.pushed == 0, s  # allreduce contributions are not PS updates


def case_allreduce_mismatch_is_an_error_everywhere():
    role = ps.init("mlfabric-A", emulation=FAST, batch_interval=0.02)
    roles = Roles(WORLD.size)
    n = 10 + (WORLD.rank == roles.worker_ranks[-1])  # the last worker passes 11

    def work():
        ps.allreduce(np.ones(n))
        ps.allreduce(np.ones(n))  # (a root that got only matching shapes the first time)
    try:
        take_part(role, work)
    except MlfabricError as e:
        assert "disagree" in str(e), e
        return
    if len(roles.worker_ranks) > 1:
        raise AssertionError("mismatched allreduce accepted")


def case_workers_taking_different_step_counts():
    """Worker k takes 2 + k steps (push, then get). ps-sync: the first worker to finish short
    would leave the others' next iteration waiting for its update forever: a clear error on
    every rank at once, naming the ranks. SSP: a finished worker no longer holds the others
    back (the gate waits for the workers still training), and every update is applied."""
    roles = Roles(WORLD.size)
    workers = roles.worker_ranks
    if len(workers) < 2:
        return
    steps = 2 + roles.worker_index(WORLD.rank) if WORLD.rank in workers else 0

    def work():
        for _ in range(steps):
            ps.push(1, np.full(3, 0.01))
            ps.get(1)

    role = ps.init("mlfabric-S", emulation=FAST, batch_interval=0.02)
    with pytest.raises(MlfabricError, match=r"finished after \[2\] update\(s\).*same number "
                                            "of steps"):
        take_part(role, work)
    ps.api._state.update(rt=None, config=None, role=None, handler=None)
    WORLD.Barrier()
    role = ps.init("ssp", slack=1, emulation=FAST, batch_interval=0.02)
    _, summary = take_part(role, work)
    want = sum(2 + k for k in range(len(workers)))
    assert summary.pushed == summary.applied == want and summary.balanced, summary


def case_wrong_role_or_disagreeing_settings_fail_on_every_rank():
    import os
    old = os.environ.get("MLFABRIC_TIMEOUT")
    os.environ["MLFABRIC_TIMEOUT"] = "2"   # the ranks left waiting give up quickly
    try:
        # a worker that registers as a server: its own clear error at once; the others are not
        # left hanging at start-up
        role = ps.init("mlfabric-A")
        last = Roles(WORLD.size).worker_ranks[-1]
        try:
            if WORLD.rank == last:
                ps.register_as_server(np.zeros(3))
            elif role == "worker":
                ps.register_as_worker()
            elif role == "server":
                ps.register_as_server(np.zeros(3))
            else:
                ps.serve()
        except MlfabricError as e:
            if WORLD.rank == last:
                assert "is the worker" in str(e) and "not a server" in str(e), e
            else:
                assert "not every rank registered" in str(e), e
        else:
            raise AssertionError("a rank registering the wrong role went unnoticed")
        ps.api._state.update(rt=None, config=None, role=None, handler=None)
        WORLD.Barrier()
        # workers that disagree on tau_max: the same error on every rank
        role = ps.init("mlfabric-A")
        try:
            if role == "worker":
                ps.register_as_worker(tau_max=WORLD.rank)
            elif role == "server":
                ps.register_as_server(np.zeros(3))
            else:
                ps.serve()
        except MlfabricError as e:
            assert "disagree on tau_max" in str(e) or len(Roles(WORLD.size).worker_ranks) == 1, e
        else:
            assert len(Roles(WORLD.size).worker_ranks) == 1, "disagreeing tau_max accepted"
            ps.api._state.update(rt=None)
        ps.api._state.update(rt=None, config=None, role=None, handler=None)
        WORLD.Barrier()
        # a bad bound on one worker, a bound the mode does not enforce: refused in the
        # start-up's agreement, so every rank fails at once with the same words
        for mode, taus, needle in (("mlfabric-A", {last: -1.0}, "tau_max must be a number >= 0"),
                                   ("mlfabric-A", {last: "4"}, "tau_max must be a number >= 0"),
                                   ("ssp", {}, "only mode 'mlfabric-A' bounds staleness")):
            role = ps.init(mode)
            with pytest.raises(MlfabricError, match=needle):
                if role == "worker":
                    ps.register_as_worker(tau_max=taus.get(WORLD.rank, 3))
                elif role == "server":
                    ps.register_as_server(np.zeros(3))
                else:
                    ps.serve()
            ps.api._state.update(rt=None, config=None, role=None, handler=None)
            WORLD.Barrier()
    finally:
        if old is None:
            del os.environ["MLFABRIC_TIMEOUT"]
        else:
            os.environ["MLFABRIC_TIMEOUT"] = old
        WORLD.Barrier()
