"""mlfabric.pipeline schedules, validator, timing and pictures (single process, no MPI).

Checks the invariants of the PipeDream thesis (digest pipeline-001): every generated schedule
runs without deadlock; makespan (m+p-1)(t_f+t_b) for GPipe and Flush and m(t_f+t_b) +
(p-1)(t_f+t_b)/v interleaved; bubble (p-1)/m and (p-1)/(vm); 1F1B order and NOAM; stashed
activations and live weight versions; the 2BW, stashing and vertical-sync version rules; 1F1B-RR
routing; steady state without idle time; the text form; deadlock and bad-input errors; the text
Gantt chart and the PNG. Microbatches and stages are 0-indexed (the thesis's input k is k-1).
"""
import itertools
import subprocess
import sys

import pytest

from mlfabric.pipeline import (Action, Schedule, ScheduleError, by_name, flush, format_actions,
                               gantt, gpipe, interleaved, noam, one_f_one_b, parse_actions, plot,
                               simulate, two_bw, validate, weight_versions)

PS = range(1, 9)
MS = (1, 2, 3, 5, 8, 9, 16)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _all_schedules(p):
    """Every generator at p stages over several m (odd ones too), batches and chunks."""
    out = []
    for m in MS:
        out += [gpipe(p, m), gpipe(p, m, 2), flush(p, m), flush(p, m, 3), one_f_one_b(p, m),
                one_f_one_b(p, m, vertical_sync=True)]
        if m >= p:
            out += [two_bw(p, m, 1), two_bw(p, m, 3)]
        if m % p == 0:
            out += [interleaved(p, m, v, b) for v in (1, 2, 3) for b in (1, 2)]
    return out


def _passes(actions):
    """A rank's list without its optimizer steps, as text."""
    return " ".join(a.label() for a in actions if a.kind != "S")


def _steps_before(sched):
    """(piece, k, kind) -> optimizer steps its rank ran before it, counted independently."""
    out = {}
    for lst in sched.actions.values():
        n = 0
        for a in lst:
            if a.kind == "S":
                n += 1
            else:
                out[(sched.vstage(a), a.microbatch, a.kind)] = n
    return out


# --- every schedule runs -----------------------------------------------------------------------

@pytest.mark.parametrize("p", PS)
def test_every_generated_schedule_validates(p):
    for s in _all_schedules(p):
        stats = validate(s)
        assert stats.actions == sum(len(a) for a in s.actions.values())
        # every microbatch reaches every piece, forward and backward, exactly once
        seen = [(a.kind, s.vstage(a), a.microbatch) for lst in s.actions.values() for a in lst
                if a.kind != "S"]
        assert sorted(seen) == sorted(itertools.product("BF", range(s.pieces),
                                                        range(s.microbatches)))


# --- makespan and bubble -------------------------------------------------------------------------

@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("t_f,t_b", [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0), (0.7, 2.9)])
def test_makespan_and_bubble_gpipe_flush(p, t_f, t_b):
    for m in MS:
        for batches in (1, 2):
            for gen in (gpipe, flush):
                t = simulate(gen(p, m, batches), t_f, t_b)
                assert t.makespan == pytest.approx(batches * (m + p - 1) * (t_f + t_b))
                assert t.bubble_fraction == pytest.approx((p - 1) / m)
                assert t.idle_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_bubble_example_from_digest():
    # derived in the digest: p=4, m=8 gives 0.375, with v=2 0.1875
    assert simulate(flush(4, 8)).bubble_fraction == pytest.approx(0.375)
    assert simulate(interleaved(4, 8, 2)).bubble_fraction == pytest.approx(0.1875)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("t_f,t_b", [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)])
def test_makespan_and_bubble_interleaved(p, t_f, t_b):
    for m in (p, 2 * p, 3 * p):
        for v in (1, 2, 3, 4):
            for batches in (1, 2):
                t = simulate(interleaved(p, m, v, batches), t_f, t_b)
                want = m * (t_f + t_b) + (p - 1) * (t_f + t_b) / v
                assert t.makespan == pytest.approx(batches * want)
                assert t.bubble_fraction == pytest.approx((p - 1) / (v * m))


def test_communication_time_adds_per_hop():
    # one t_comm per hop, p-1 hops forward and p-1 back
    for p, m in ((3, 4), (5, 7)):
        t = simulate(gpipe(p, m), 1.0, 2.0, t_comm=0.25)
        assert t.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * 0.25)


# --- orders -----------------------------------------------------------------------------------

def test_one_f_one_b_order_p4():
    s = one_f_one_b(4, 8)
    assert _passes(s.actions[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert _passes(s.actions[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    # PipeDream updates after every backward
    assert format_actions(s.actions[3][:6]) == "F0 B0 S F1 B1 S"
    assert noam([1, 1, 1, 1]) == 4


@pytest.mark.parametrize("p", PS)
def test_one_f_one_b_warm_up_and_last_stage(p):
    m = 2 * p + 1
    for s in (one_f_one_b(p, m), flush(p, m), two_bw(p, m, 2)):
        for st in range(p):
            lst = [a for a in s.actions[st] if a.kind != "S"]
            first_b = next(i for i, a in enumerate(lst) if a.kind == "B")
            # stage st admits p - st inputs before its first backward, forwards in order
            assert first_b == min(p - st, s.m)
            assert [a.microbatch for a in lst if a.kind == "F"] == list(range(s.microbatches))
        last = [a.kind for a in s.actions[p - 1] if a.kind != "S"]
        assert "".join(last[:2 * m]) == "FB" * m


def test_interleaved_order_p2_v2():
    # Megatron: virtual microbatch i runs F on chunk (i mod pv)//p, B on chunk v-1 minus that
    s = interleaved(2, 4, 2)
    assert format_actions(s.actions[0], True) == (
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0 S")
    assert format_actions(s.actions[1], True) == (
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0 S")


# --- memory ----------------------------------------------------------------------------------

@pytest.mark.parametrize("p", PS)
def test_stash_counts(p):
    for m in MS:
        for s in (flush(p, m, 2), one_f_one_b(p, m)):
            stats = validate(s)
            for st in range(p):
                assert stats.peak_stash[st] == min(p - st, m)
        assert all(n == m for n in validate(gpipe(p, m, 2)).peak_stash.values())
        if m >= p:
            stats = validate(two_bw(p, m, 2))
            assert all(stats.peak_stash[st] <= p - st for st in range(p))


@pytest.mark.parametrize("p", PS)
def test_live_weight_versions(p):
    for m in MS:
        for s in (gpipe(p, m, 2), flush(p, m, 3)):
            assert set(validate(s).peak_versions.values()) == {1}
        if m % p == 0:
            assert set(validate(interleaved(p, m, 2, 2)).peak_versions.values()) == {1}
        if m >= p:
            v2 = validate(two_bw(p, m, 3)).peak_versions
            assert max(v2.values()) <= 2
            # after the first step, batch 1 still uses version 0 (the shadow) next to version 1
            assert v2[0] == 2
        for vs in (False, True):
            pd = validate(one_f_one_b(p, m, vertical_sync=vs)).peak_versions
            assert max(pd.values()) <= p
    # enough inputs: the input stage of PipeDream holds exactly p versions
    assert validate(one_f_one_b(p, 3 * p)).peak_versions[0] == p


# --- weight versions ---------------------------------------------------------------------------

@pytest.mark.parametrize("p", PS)
def test_two_bw_version_rule(p):
    for m in [x for x in MS if x >= p]:
        s = two_bw(p, m, 4)
        vers = weight_versions(s)
        before = _steps_before(s)
        for (q, k), (vf, vb) in vers.items():
            assert vf == vb == max(k // m - 1, 0)
            # the version exists when the forward runs and is at most one behind the newest
            assert before[(q, k, "F")] - 1 <= vf <= before[(q, k, "F")]
            assert before[(q, k, "B")] - 1 <= vb <= before[(q, k, "B")]
    # thesis Fig. 3.2 (p = m = 4): input 9 (our 8) is the first to use the new version
    vers = weight_versions(two_bw(4, 4, 3))
    assert [vers[(0, k)][0] for k in range(12)] == [0] * 8 + [1] * 4


@pytest.mark.parametrize("p", PS)
def test_stashing_versions(p):
    m = 3 * p + 1
    s = one_f_one_b(p, m)
    vers = weight_versions(s)
    before = _steps_before(s)
    for st in range(p):
        for k in range(m):
            vf, vb = vers[(st, k)]
            assert vf == vb                                  # the backward uses the stash
            assert vf == before[(st, k, "F")]                # the forward uses the latest
            assert vf == max(k - (p - 1 - st), 0)            # delay p-1-s steps at stage s
            if k >= p:
                # the latest weights moved on by the backward: stashing was needed
                assert before[(st, k, "B")] > vb or st == p - 1


@pytest.mark.parametrize("p", PS)
def test_vertical_sync_versions(p):
    m = 3 * p + 1
    vers = weight_versions(one_f_one_b(p, m, vertical_sync=True))
    for st in range(p):
        for k in range(m):
            assert vers[(st, k)] == (max(k - (p - 1), 0),) * 2


def test_flush_versions_are_batch_index():
    for s in (gpipe(3, 5, 3), flush(4, 6, 2), interleaved(2, 4, 3, 3)):
        for (q, k), (vf, vb) in weight_versions(s).items():
            assert vf == vb == k // s.m


# --- 1F1B-RR --------------------------------------------------------------------------------------

def test_rr_routing_and_noam():
    for reps in ([2, 1], [1, 2], [3, 1, 2], [2, 2, 1, 3], [1, 3]):
        p, m = len(reps), 23
        s = one_f_one_b(p, m, replicas=reps)
        validate(s)
        assert s.ranks == sum(reps)
        assert s.pieces_of(s.ranks - 1) == (p - 1,)
        for r, lst in s.actions.items():
            pl = s.placement[r]
            for a in lst:
                if a.kind != "S":
                    assert a.microbatch % reps[pl.stage] == pl.replica
                    assert s.rank_of(pl.stage, a.microbatch) == r
        # each input-stage replica admits NOAM = ceil(workers / r_0) inputs before a backward
        for r in s.stage_ranks(0):
            passes = [a.kind for a in s.actions[r] if a.kind != "S"]
            assert passes.index("B") == noam(reps) == -(-sum(reps) // reps[0])


def test_rr_replica_without_input():
    s = one_f_one_b(2, 1, replicas=[2, 1])
    assert s.actions[1] == ()
    t = simulate(s)
    assert t.makespan == pytest.approx(6.0) and t.rows[1] == []
    assert t.steady_window is None and "rank 1 (stage 0, replica 1)" in gantt(t)


def test_rr_no_deadlock_any_small_replication():
    for p in (1, 2, 3):
        for reps in itertools.product((1, 2, 3), repeat=p):
            for m in (1, 2, 5, 12):
                validate(one_f_one_b(p, m, replicas=list(reps)))


def test_rr_fig_2_7_with_3_to_2_backward_forward_ratio():
    # Fig. 2.7: stage 0 twice as slow as stage 1 and replicated twice; backward:forward 3:2
    s = one_f_one_b(2, 60, replicas=[2, 1])
    t = simulate(s, t_f=[2.0, 1.0], t_b=[3.0, 1.5])
    assert t.steady_idle == pytest.approx(0.0, abs=1e-12)
    assert t.idle_fraction < 0.05
    assert t.makespan == pytest.approx(60 * 2.5 + 5.0, rel=0.05)


# --- steady state ------------------------------------------------------------------------------

@pytest.mark.parametrize("p", PS)
def test_steady_state_idle(p):
    m_total = 25 * p
    for s in (one_f_one_b(p, m_total), two_bw(p, 5 * p, 5)):
        for t_f, t_b in ((1.0, 2.0), (2.0, 3.0)):
            t = simulate(s, t_f, t_b)
            assert t.idle_fraction < 0.05
            if p > 1:
                assert t.steady_idle < 0.05


# --- text form --------------------------------------------------------------------------------

def test_parse_actions():
    assert parse_actions("F0 F1 B0 F2 B1 S", stage=2) == [
        Action("F", 2, 0), Action("F", 2, 1), Action("B", 2, 0), Action("F", 2, 2),
        Action("B", 2, 1), Action("S", 2)]
    assert parse_actions("F3.1 B12.0") == [Action("F", 0, 3, 1), Action("B", 0, 12, 0)]
    assert format_actions(parse_actions("F3.1 B3.0 S"), chunks=True) == "F3.1 B3.0 S"
    assert format_actions(parse_actions("F3 B3 S")) == "F3 B3 S"


@pytest.mark.parametrize("p", (1, 2, 3, 5, 8))
def test_text_round_trip(p):
    scheds = _all_schedules(p) + [one_f_one_b(p, 7, replicas=[1 + (i % 3) for i in range(p)])]
    for s in scheds:
        assert Schedule.from_text(s.to_text()) == s
        for r, lst in s.actions.items():
            stage = s.placement[r].stage
            assert tuple(parse_actions(format_actions(lst, s.v > 1), stage)) == lst
        grid = str(s).splitlines()
        assert len(grid) == 1 + s.ranks and grid[0] == s.header()


def test_schedule_from_minimal_text():
    s = Schedule.from_text("schedule mine p=2 m=2\nrank 0: F0 F1 B0 B1 S\nrank 1: F0 B0 F1 B1 S")
    assert s.policy == "flush" and s.replicas == (1, 1)
    assert s.actions[1][0] == Action("F", 1, 0)
    # lockstep: r0 F0 | r0 F1, r1 F0 | r1 B0 | r0 B0, r1 F1 | r1 B1 | r0 B1, r1 S | r0 S
    assert validate(s).steps == 7


# --- errors -----------------------------------------------------------------------------------

def test_deadlock_names_stuck_ranks():
    # rank 1 wants B1 before it ran F1: it waits on itself, and ranks 0 and 2 wait on it
    s = Schedule("bad", 3, 2, {0: "F0 F1 B0 B1 S", 1: "F0 B1 F1 B0 S", 2: "F0 B0 F1 B1 S"})
    with pytest.raises(ScheduleError) as e:
        validate(s)
    err = e.value
    assert err.stuck == {0: Action("B", 0, 0), 1: Action("B", 1, 1), 2: Action("F", 2, 1)}
    assert err.step == 4
    msg = str(err)
    assert "deadlocks at step 4" in msg and "stuck ranks 0, 1, 2" in msg
    assert "rank 1 (stage 1) stuck at position 1 (B1)" in msg
    assert "comes later in its own list" in msg
    assert ">>       4  B0! B1! F1!" in msg
    with pytest.raises(ScheduleError):
        simulate(s)


def test_deadlock_two_ranks_waiting_on_each_other():
    s = Schedule("cross", 2, 2, {0: "F0 B1 F1 B0 S", 1: "F1 F0 B0 B1 S"})
    with pytest.raises(ScheduleError) as e:
        validate(s)
    assert sorted(e.value.stuck) == [0, 1]
    assert "rank 0" in str(e.value) and "rank 1" in str(e.value)


@pytest.mark.parametrize("acts,words", [
    ({0: "F0 F1 B0 S", 1: "F0 B0 F1 B1 S"}, "never runs backward"),
    ({0: "F0 F0 F1 B0 B1 S", 1: "F0 B0 F1 B1 S"}, "runs twice"),
    ({0: "F0 F1 F2 B0 B1 S", 1: "F0 B0 F1 B1 S"}, "microbatch 2, but there are 2"),
    ({0: "F0 F1 B0 B1 S", 1: "F0 B0 F1 B1 S S"}, "2 optimizer steps"),
    ({0: "F0 B0 S F1 B1", 1: "F0 B0 F1 B1 S"}, "batch 0 must run between step 0 and step 1"),
    ({0: "F0 F1 B0 B1 S", 1: "F0 B0 F1 B1.1 S"}, "chunk 1, but v=1"),
])
def test_malformed_schedules(acts, words):
    with pytest.raises(ScheduleError, match=words):
        validate(Schedule("bad", 2, 2, acts))


def test_backward_on_other_replica_rejected():
    s = one_f_one_b(2, 4, replicas=[2, 1])
    acts = dict(s.actions)
    # swap the lists of the two stage-0 replicas' backwards: B0 moves to replica 1
    acts[0] = tuple(a for a in acts[0] if not (a.kind == "B" and a.microbatch == 0))
    acts[1] = acts[1] + (Action("B", 0, 0), Action("S", 0))
    bad = Schedule("rr", 2, 4, acts, replicas=(2, 1), policy="stash")
    with pytest.raises(ScheduleError, match="forward on rank 0, backward on rank 1"):
        validate(bad)


def test_policy_violations():
    with pytest.raises(ScheduleError, match="steps right after every backward"):
        validate(Schedule("x", 1, 2, {0: "F0 B0 F1 B1 S"}, policy="stash"))
    # 2bw: a forward that would need a version not made yet (batch 2 before batch 0 stepped)
    with pytest.raises(ScheduleError, match="uses weight version 1"):
        validate(Schedule("x", 1, 1, {0: "F0 F1 F2 B0 S B1 S B2 S"}, batches=3, policy="2bw"))
    # 2bw: a forward of batch 0 after two steps: version 0 is no longer one of the two kept
    with pytest.raises(ScheduleError, match="only versions 1 and 2 are kept"):
        validate(Schedule("x", 2, 1, {0: "F1 F2 B1 S B2 S F0 B0 S", 1: "F1 B1 S F2 B2 S F0 B0"},
                          batches=3, policy="2bw"))


@pytest.mark.parametrize("call,words", [
    (lambda: gpipe(0, 4), "p must be an int >= 1"),
    (lambda: gpipe(2, 0), "m must be an int >= 1"),
    (lambda: gpipe(2.0, 4), "p must be an int"),
    (lambda: flush(True, 4), "p must be an int"),
    (lambda: flush(2, 4, 0), "batches must be an int >= 1"),
    (lambda: one_f_one_b(2, 0), "m_total must be an int >= 1"),
    (lambda: one_f_one_b(2, 4, replicas=[1]), "replicas must list one int >= 1 per stage"),
    (lambda: one_f_one_b(2, 4, replicas=[1, 0]), "replicas must list one int >= 1 per stage"),
    (lambda: one_f_one_b(2, 4, replicas=[2, 1], vertical_sync=True), "straight pipeline"),
    (lambda: two_bw(4, 3, 2), "m >= p"),
    (lambda: interleaved(4, 6, 2), "m to be a multiple of p"),
    (lambda: interleaved(2, 4, 0), "v must be an int >= 1"),
    (lambda: by_name("zigzag", p=2, m=2), "unknown schedule 'zigzag'"),
    (lambda: parse_actions("F0 X1"), "bad action 'X1'"),
    (lambda: Action("F", 0), "F needs a microbatch"),
    (lambda: Action("S", 0, 3), "has no microbatch"),
    (lambda: simulate(gpipe(2, 2), t_f=0), "t_f must be a number > 0"),
    (lambda: simulate(gpipe(2, 2), t_b=[1.0]), "t_b must be a number > 0 or one per stage"),
    (lambda: simulate(gpipe(2, 2), t_comm=-1), "t_comm must be a number >= 0"),
    (lambda: validate("F0 B0"), "validate takes a Schedule"),
    (lambda: Schedule("x", 2, 2, {0: "F0 B0"}), "actions must map every rank"),
    (lambda: Schedule("x", 2, 2, {0: "", 1: ""}, policy="lazy"), "policy must be one of"),
    (lambda: Schedule.from_text("rank 0: F0"), "starts with 'schedule NAME"),
    (lambda: Schedule.from_text("schedule x p=2"), "must give p= and m="),
])
def test_bad_arguments(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_by_name():
    assert by_name("gpipe", p=3, m=4) == gpipe(3, 4)
    assert by_name("PipeDream-Flush", p=3, m=4, batches=2) == flush(3, 4, 2)
    assert by_name("1f1b", p=3, m_total=5, replicas=[1, 2, 1]) == one_f_one_b(3, 5, [1, 2, 1])
    assert by_name("2bw", p=2, m=2, batches=3) == two_bw(2, 2, 3)
    assert by_name("interleaved", p=2, m=4, v=2) == interleaved(2, 4, 2)


# --- pictures ---------------------------------------------------------------------------------

def test_gantt_text_gpipe():
    # p=2, m=2, t_f=1, t_b=2: stage 1 runs F0 F1 at 1..3, B0 B1 at 3..7; stage 0 B0 B1 at 5..9
    text = gantt(simulate(gpipe(2, 2), 1.0, 2.0)).splitlines()
    assert "makespan 9" in text[0] and "bubble 0.5" in text[0]
    assert text[1] == "rank 0 (stage 0)  F0 F1 .  .  .  B0 B0 B1 B1|"
    assert text[2] == "rank 1 (stage 1)  .  F0 F1 B0 B0 B1 B1|.  ."
    assert text[-1].startswith("peak stashed activations per stage: s0=2 s1=2")


def test_gantt_text_rows_and_units():
    t = simulate(interleaved(2, 4, 2), 1.0, 2.0)  # chunk passes take 0.5 and 1.0
    text = gantt(t)
    rows = [ln for ln in text.splitlines() if ln.startswith("rank ")]
    assert len(rows) == 2
    assert "0.5 per column" in text.splitlines()[0]
    assert rows[0].split()[4] == "F0.0"
    assert str(t) == text
    with pytest.raises(ValueError, match="unit must be a number > 0"):
        gantt(t, unit=0)
    with pytest.raises(ValueError, match="takes a Timeline"):
        gantt(gpipe(2, 2))


@pytest.mark.parametrize("sched", [gpipe(3, 4), interleaved(2, 4, 2, 2),
                                   one_f_one_b(2, 9, replicas=[2, 1])],
                         ids=["gpipe", "interleaved", "1f1b-rr"])
def test_plot_writes_png(tmp_path, sched):
    path = tmp_path / "timeline.png"
    assert plot(simulate(sched), str(path)) == str(path)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 2000


def test_package_import_is_light():
    code = ("import sys, mlfabric.pipeline; "
            "bad = [m for m in ('torch', 'mpi4py', 'matplotlib') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_lockstep_and_grid_public():
    """validate.lockstep gives every action its lockstep step (GPipe p=2, m=2: F0 F1 on rank 0 in
    steps 0-1, rank 1 one step behind, then the backward passes mirrored), and validate.grid
    draws a prefix of the run with a rank's next action marked (the executor's failure grid)."""
    from mlfabric.pipeline.validate import grid, lockstep
    sched = gpipe(2, 2)
    rounds, step_of = lockstep(sched)
    assert len(step_of) == sum(len(a) for a in sched.actions.values())
    assert sorted(set(step_of.values())) == list(range(len(rounds)))
    assert [step_of[(0, i)] for i in range(2)] == [0, 1]
    assert [step_of[(1, i)] for i in range(2)] == [1, 2]
    for (r, i), t in step_of.items():
        assert rounds[t][r] is sched.actions[r][i]
    text = grid(sched, rounds[:2], {1: sched.actions[1][1]})
    assert ">>" in text and "!" in text and text.count("\n") >= 3
