"""Smoke tests of benchmarks/paper/ (the paper's §7 comparisons at this machine's scale): each
script at its --quick size under real mpirun, bounded in time, writing valid JSON that its
REPRODUCTION.md section renders; RR-Sync run on the runtime matches synchronous training computed
in one process; reproduce.py builds the report from fixture JSONs. Timings are not asserted: they
are what the benchmarks are for."""
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.mpi_util import ROOT, mpi_env, run_mpi, run_script_json

TIMEOUT = 120
META = {"command", "script", "git", "cpu", "hostname", "timestamp", "mpi_library",
        "total_wall_s", "quick"}


def load_reproduce():
    path = os.path.join(ROOT, "benchmarks", "paper", "reproduce.py")
    spec = importlib.util.spec_from_file_location("paper_reproduce", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench(n, script, tmp_path, *args):
    out = str(tmp_path / (os.path.splitext(script)[0] + ".json"))
    doc, _ = run_script_json(n, ["benchmarks/paper/" + script, "--quick", *args, "--out", out],
                             out, TIMEOUT)
    assert META <= set(doc["meta"]), META - set(doc["meta"])
    assert doc["meta"]["command"].startswith(
        f"mpirun --oversubscribe -n {n} python benchmarks/paper/{script} --quick")
    assert doc["meta"]["quick"] is True
    return doc, out


def check_balanced(job, workers):
    s = job["summary"]
    assert s["balanced"] and s["missing"] == 0 and s["twice"] == 0, job["mode"]
    assert s["pushed"] == s["applied"] + s["dropped_total"]
    # a job run for a time (mlfabric-A in Table 2) gives each worker its own count
    its = job["worker_iterations"]
    assert len(its) == workers and all(n >= 1 for n in its), its
    if job.get("duration_s") is None:
        assert its == [job["iterations"]] * workers, its
    assert s["pushed"] == sum(its)
    assert len(job["dropped_updates"]) == (s["dropped_total"] if job["mode"] != "rr-sync" else 0)


def check_points(job, workers):
    pts = job["points"]
    assert [p["t"] for p in pts] == sorted(p["t"] for p in pts)
    assert {p["worker"] for p in pts} == set(range(workers))
    assert len(pts) == sum(job["worker_iterations"])       # every iteration's model recorded
    t = job["target"]
    hit = next((p for p in pts if p["value"] >= t["target"]), None)
    assert t["first_touch_t"] == (hit["t"] if hit else None)
    if not t["window_s"]:
        assert t["reached"] == (hit is not None)
        if hit:
            assert t["t"] == hit["t"] and t["iteration"] == hit["iteration"]
    elif t["reached"]:                   # held on average: never before it was first touched
        assert hit is not None and t["t"] >= hit["t"], (t, hit)


def rr_matches_offline(job, curve, tol):
    """RR-Sync on the runtime computes synchronous training: the model every worker holds at
    iteration i (>= 1) scores what the one-process run scored after i iterations."""
    by_it = {}
    for p in job["points"]:
        by_it.setdefault(p["iteration"], set()).add(round(p["value"], 9))
    for i, values in by_it.items():
        assert len(values) == 1, f"RR-Sync workers held different models at iteration {i}"
        if i >= 1:
            assert abs(values.pop() - curve[i - 1]) <= tol, (i, curve[i - 1])


@pytest.mark.mpi
@pytest.mark.parametrize("dilate", [1, 2])
def test_table2_quick(tmp_path, dilate):
    n = 7                                           # odd: 5 workers
    doc, out = bench(n, "table2.py", tmp_path, "--dilate", str(dilate))
    workers = n - 2
    m = doc["meta"]
    assert m["workers"] == workers and m["tau_max"] == workers
    # --dilate stretches every time of the setting alike: --quick's 20 ms compute, 0.2 MB at
    # 50 MB/s, 0.05 s window; the NIC rate period (5 s) in every job's emulation
    assert m["dilate"] == dilate and m["compute_ms"] == pytest.approx(20.0 * dilate)
    assert m["base_rate"] == pytest.approx(50e6 / dilate)
    assert m["window_s"] == pytest.approx(0.05 * dilate)
    for job in doc["jobs"]:
        assert job["compute_s"] == pytest.approx(0.02 * dilate)
        assert job["batch_interval"] == pytest.approx(0.1 * dilate)
        assert job["t_lag"] == pytest.approx(0.2 * dilate)
        assert job["emulation"]["base_rate"] == pytest.approx(50e6 / dilate)
        assert job["emulation"]["period"] == pytest.approx(5.0 * dilate)
    assert list(doc["cells"]) == ["C2-N1"]
    cell = doc["cells"]["C2-N1"]
    assert cell["paper_speedup"] == 2.96
    assert cell["direction"] in ("as the paper", "opposite", "undetermined")
    if cell["speedup"] is not None:
        assert math.isclose(cell["speedup"], cell["t_rr_sync"] / cell["t_mlfabric_A"])
    assert sorted(j["mode"] for j in doc["jobs"]) == ["mlfabric-A", "rr-sync"]
    for job in doc["jobs"]:
        assert job["workers"] == workers and job["emulation"]["compute"] == "C2"
        check_balanced(job, workers)
        check_points(job, workers)
        assert all(0.0 <= p["value"] <= 1.0 for p in job["points"])
    rr = next(j for j in doc["jobs"] if j["mode"] == "rr-sync")
    assert rr["iterations"] == doc["offline"]["crossing"] + doc["meta"]["margin"]
    a = next(j for j in doc["jobs"] if j["mode"] == "mlfabric-A")
    assert a["duration_s"] == pytest.approx(doc["meta"]["a_duration_s"]["C2-N1"])
    assert cell["t_rr_sync_ideal"] is None or cell["t_rr_sync_ideal"] > 0
    # float32 sums in a different order may move a few of the 2,400 test samples across a
    # decision boundary
    rr_matches_offline(rr, doc["offline"]["curve"], tol=0.003)
    assert os.path.getsize(os.path.splitext(out)[0] + ".png") > 0
    assert "| C2-N1 | 2.96 |" in "\n".join(load_reproduce().section_table2(doc, out))


@pytest.mark.mpi
def test_fig7_lda_quick(tmp_path):
    doc, out = bench(8, "fig7_lda.py", tmp_path)
    workers = 6
    assert list(doc["rows"]) == ["rr-sync", "mlfabric-A-30", "mlfabric-A-60", "async"]
    taus = [j["tau_max"] for j in doc["jobs"]]
    assert taus[1:3] == [workers, 2 * workers]
    for job in doc["jobs"]:
        check_balanced(job, workers)
        check_points(job, workers)
    vanilla = doc["jobs"][3]["summary"]
    assert vanilla["dropped_total"] == 0 and vanilla["aggregated"] == 0
    # LDA counts are integers summed exactly in float64: RR-Sync's models are the one-process
    # run's, bit for bit, so their held-out log-likelihoods agree to rounding
    rr_matches_offline(doc["jobs"][0], doc["offline"]["curve"], tol=1e-9)
    assert doc["rows"]["rr-sync"]["paper_iterations"] == 145
    assert "| rr-sync | 145 | 182 |" in "\n".join(load_reproduce().section_lda(doc, out))


@pytest.mark.mpi
def test_sync_iteration_quick(tmp_path):
    doc, out = bench(8, "sync_iteration.py", tmp_path)
    p = doc["presets"]["C2-N1"]
    assert [j["mode"] for j in p["jobs"]] == ["mlfabric-S", "rr-sync", "tr-sync"]
    for job in p["jobs"]:
        assert job["summary"]["balanced"] and job["workers"] == 6
    m = p["per_mode_s"]
    assert math.isclose(p["s_over_rr"], m["mlfabric-S"] / m["rr-sync"])
    assert math.isclose(p["s_over_tr"], m["mlfabric-S"] / m["tr-sync"])
    assert p["ps_modes_command"].startswith("mpirun -n 8 python benchmarks/ps_modes.py sync")
    assert "| C2-N1 | S 16% faster" in "\n".join(load_reproduce().section_sync(doc, out))


@pytest.mark.mpi
def test_fig9_replica_quick(tmp_path):
    n = 7                                           # odd: scheduler, server, replica, 4 workers
    doc, out = bench(n, "fig9_replica.py", tmp_path)
    res = doc["results"]
    assert [r["div_max_units"] for r in res["rows"]] == [0.0, "inf"]
    for r in res["rows"]:
        assert r["replicated"] == r["applied"]       # tau_max = inf: nothing dropped
        assert 0 < r["replica_update_bytes"] <= r["unaggregated_bytes"]
    assert res["reference"]["replica_update_bytes"] == res["reference"]["expected"]
    assert res["paper_plateau_saving"] == 5.6 and doc["meta"]["workers"] == n - 3
    assert os.path.getsize(os.path.splitext(out)[0] + ".png") > 0
    load_reproduce().section_fig9(doc, out)


def one_process_quick(script, tmp_path, name):
    """Run a one-process paper script at --quick into tmp_path/name; (its JSON, the path)."""
    out = str(tmp_path / name)
    proc = subprocess.run([sys.executable, "benchmarks/paper/" + script, "--quick", "--out",
                           out], cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout
    with open(out) as f:
        return json.load(f), out


def test_sched_cost_quick(tmp_path):
    doc, out = one_process_quick("sched_cost.py", tmp_path, "sched_cost.json")
    assert [r["updates"] for r in doc["results"]] == [10, 30]
    assert all(r["match"] and r["paper_ms"] == 5.0 for r in doc["results"])
    assert doc["meta"]["command"] == "python benchmarks/paper/sched_cost.py --quick --out " + out
    load_reproduce().section_sched(doc, out)


def test_lr_grid_quick(tmp_path):
    """The learning-rate grid: every rate has the synchronous count (a multiple of the workers:
    whole iterations) and each delay range's draws; the section shows them."""
    doc, out = one_process_quick("lr_grid.py", tmp_path, "lr-grid.json")
    assert [r["lr"] for r in doc["rows"]] == [0.08, 0.04]
    for r in doc["rows"]:
        assert r["sync"] is None or (r["sync"] > 0 and r["sync"] % 6 == 0), r
        ranges = [k for k in r if k.startswith("uniform")]
        assert len(ranges) == 2 and all(len(r[k]) == 1 for k in ranges), r
        assert all(x is None or 0 < x <= 60 for k in ranges for x in r[k]), r
    # the quick target is within reach: some counts are numbers
    assert any(r["sync"] for r in doc["rows"]), doc["rows"]
    assert any(x for r in doc["rows"] for k in r if k.startswith("uniform") for x in r[k])
    text = "\n".join(load_reproduce().section_lr_grid(doc, out))
    assert "| 0.08 | " in text and "asynchronous, delay uniform [0, tau_max)" in text


@pytest.mark.mpi
def test_bad_command_line():
    proc = run_mpi(2, ["benchmarks/paper/table2.py", "--cells", "C9-N1"], timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.count("--cells must be among") == 1, proc.stdout   # rank 0 alone


def load_common():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "paper"))
    try:
        import common
    finally:
        sys.path.pop(0)
    return common


def test_a_target_touched_by_a_spike_is_not_held():
    common = load_common()
    # 0.5, a 50 ms spike to 0.9 at t = 1, back to 0.5, then 0.8 from t = 2 on; target 0.7:
    # touched at 1.0, held (0.5 s average) once 0.5 (0.5 - x) + 0.8 x >= 0.35, x = 1/3 s past 2
    pts = [{"t": 0.0, "value": 0.5, "iteration": 0}, {"t": 1.0, "value": 0.9, "iteration": 1},
           {"t": 1.05, "value": 0.5, "iteration": 2}, {"t": 2.0, "value": 0.8, "iteration": 3},
           {"t": 4.0, "value": 0.8, "iteration": 4}]
    assert common.first_at_or_above(pts, 0.7)["t"] == 1.0
    hit = common.held_at_or_above(pts, 0.7, 0.5)
    assert hit["t"] == pytest.approx(2.0 + 1 / 3, abs=0.011) and hit["iteration"] == 3
    assert hit["value"] >= 0.7
    assert common.held_at_or_above(pts, 0.85, 0.5) is None          # never held
    # the window is clipped to the history: a start above the target is held at once
    assert common.held_at_or_above([{"t": 0.2, "value": 0.8, "iteration": 0}], 0.7, 1.0)["t"] \
        == pytest.approx(0.2)
    # window 0 keeps the first touch
    assert common.reached_at(pts, 0.7, 0.0)["t"] == 1.0


def test_ring_ideal_is_compute_plus_the_ring_at_its_slowest_link():
    common = load_common()
    from mlfabric.emulate import Emulation
    # no stragglers, constant rates: 2(N-1)/N of the payload at the base rate, after the compute
    flat = common.ring_ideal(Emulation("C0", "N0", base_rate=50e6), 6, 0.1, 4e6, 3)
    step = 0.1 + 2 * 5 / 6 * 4e6 / 50e6
    assert flat == pytest.approx([step, 2 * step, 3 * step])
    # stragglers and slow links only ever lengthen it, iteration by iteration
    for preset in ("C2", "N3"):
        em = Emulation(preset if preset[0] == "C" else "C0", preset if preset[0] == "N" else "N0",
                       base_rate=50e6)
        slow = common.ring_ideal(em, 6, 0.1, 4e6, 20)
        gaps = [b - a for a, b in zip([0.0] + slow, slow)]
        assert all(g >= step - 1e-12 for g in gaps) and max(gaps) > 1.5 * step, gaps


# --- reproduce.py from fixture JSONs -------------------------------------------------------------

def meta(script, **kw):
    return {"command": f"mpirun --oversubscribe -n 8 python benchmarks/paper/{script}",
            "git": {"commit": "0123456789abcdef", "modified": []}, "timestamp": "T",
            "total_wall_s": 12.0, "quick": False, "base_rate": 50e6, **kw}


def cell(paper, speedup, direction, t_a, t_rr, **kw):
    return {"paper_speedup": paper, "speedup": speedup, "direction": direction,
            "t_mlfabric_A": t_a, "t_rr_sync": t_rr, "a_reached": t_a is not None,
            "rr_reached": t_rr is not None, "rr_iteration_s": 0.4, "rr_wait_s": 0.3,
            "a_worker_iteration_s": 0.5, "a_wait_s": 0.4, "a_applied_per_s": 8.0,
            "rr_applied_per_s": 14.0, "a_dropped": 10, "a_pushed": 100,
            "a_updates_to_target": 120 if t_a else None, "rr_updates_to_target": 96, **kw}


FIXTURES = {
    "table2": {"meta": meta("table2.py", target=0.95, workers=6, tau_max=6.0, compute_ms=100.0,
                            rr_iterations=19, a_iterations=36,
                            task={"params": 9610, "pretrain_iterations": 12,
                                  "dataset": "synthetic",
                                  "payload_bytes": 4e6}),
               "offline": {"start_accuracy": 0.914, "crossing": 16},
               "cells": {"C1-N1": cell(1.74, 0.6, "opposite", 10.0, 6.0),
                         "C2-N1": cell(2.96, 1.3, "as the paper", 6.0, 7.8),
                         "C2-N3": cell(2.32, None, "undetermined", None, 25.0,
                                       bound="<= 0.42")}},
    "fig7_lda": {"meta": meta("fig7_lda.py", workers=6, preset="C1-N1", compute_ms=180.0,
                              target=-4.27, task={"docs": 1200, "doc_len": 60, "vocab": 1000,
                                                  "topics": 20, "payload_bytes": 2.8e6}),
                 "offline": {"plateau": -4.25},
                 "rows": {"rr-sync": {"paper_iterations": 145, "paper_s": 182.0,
                                      "paper_time_vs_rr": 1.0, "iterations": 29, "t": 14.0,
                                      "reached": True, "job_s": 16.0, "time_vs_rr": 1.0,
                                      "iteration_s": 0.48, "wait_s": 0.28, "dropped": 0,
                                      "pushed": 192, "best": -4.26, "dropped_iterations": []},
                          "mlfabric-A-30": {"paper_iterations": 188, "paper_s": 139.0,
                                            "paper_time_vs_rr": 0.76, "iterations": None,
                                            "t": None, "reached": False, "job_s": 22.7,
                                            "time_vs_rr": None, "iteration_s": 0.37,
                                            "wait_s": 0.17, "dropped": 110, "pushed": 348,
                                            "best": -4.77, "dropped_iterations": [0, 3, 5]}}},
    "sync_iteration": {"meta": meta("sync_iteration.py", workers=6, servers=1,
                                    model_bytes=4e6, compute_ms=100.0, iterations=8, rounds=2),
                       "presets": {"C2-N1": {"per_mode_s": {"mlfabric-S": 0.78, "rr-sync": 0.49,
                                                            "tr-sync": 0.55},
                                             "s_over_rr": 0.78 / 0.49, "s_over_tr": 0.78 / 0.55,
                                             "s_wait_reduction_vs_tr": -0.5},
                                   "C1-N1": {"per_mode_s": {"mlfabric-S": 0.41, "rr-sync": 0.405,
                                                            "tr-sync": 0.48},
                                             "s_over_rr": 0.41 / 0.405, "s_over_tr": 0.41 / 0.48,
                                             "s_wait_reduction_vs_tr": 0.2}}},
    "table2-30": {"meta": meta("table2.py", target=0.76, workers=30, tau_max=30.0,
                               compute_ms=100.0, rr_iterations=15, a_factor=2.2,
                               a_duration_s={"C1-N1": 11.0, "C2-N1": 14.0}, window_s=0.5,
                               task={"params": 9610, "pretrain_iterations": 6,
                                     "dataset": "synthetic", "payload_bytes": 1e6}),
                  "offline": {"start_accuracy": 0.653, "crossing": 10},
                  "cells": {"C1-N1": cell(1.74, 1.02, "as the paper", 9.8, 10.0,
                                          t_rr_sync_ideal=8.82, speedup_vs_rr_ideal=0.9,
                                          direction_vs_rr_ideal="opposite",
                                          rr_ideal_iteration_s=0.6),
                            "C2-N1": cell(2.96, 1.6, "as the paper", 6.0, 9.6,
                                          t_rr_sync_ideal=8.4, speedup_vs_rr_ideal=1.4,
                                          direction_vs_rr_ideal="as the paper",
                                          rr_ideal_iteration_s=0.7)}},
    # a repeat of the 30-worker command: reported beside it, with the median
    "table2-30-repeat2": {"meta": meta("table2.py", target=0.76, workers=30),
                       "cells": {"C1-N1": cell(1.74, 0.8, "opposite", 12.0, 9.6),
                                 "C2-N1": cell(2.96, None, "undetermined", None, 9.0,
                                               bound="<= 0.5")}},
    # the 30-worker command with every time 3x the paper's (--dilate 3): a section of its own
    "table2-30-dilated": {"meta": meta("table2.py", target=0.76, workers=30, tau_max=30.0,
                                       compute_ms=300.0, base_rate=50e6 / 12, dilate=3.0,
                                       rr_iterations=15, a_factor=2.2,
                                       a_duration_s={"C1-N2": 50.0}, window_s=1.5,
                                       task={"params": 9610, "pretrain_iterations": 6,
                                             "dataset": "synthetic", "payload_bytes": 1e6}),
                          "offline": {"start_accuracy": 0.653, "crossing": 10},
                          "cells": {"C1-N2": cell(1.23, 0.67, "opposite", 39.95, 26.7,
                                                  t_rr_sync_ideal=25.33,
                                                  speedup_vs_rr_ideal=0.63,
                                                  direction_vs_rr_ideal="opposite",
                                                  rr_ideal_iteration_s=2.46),
                                    "C2-N1": cell(2.96, 0.87, "opposite", 32.6, 28.3,
                                                  speedup_vs_rr_ideal=0.68)}},
    # fig9_replica: left out, so the report must say it was not run
    "sched_cost": {"meta": meta("sched_cost.py"),
                   "results": [{"updates": 1000, "paper_ms": 1460.0, "ms_median": 8.0,
                                "ms_reference": 15486.0, "speedup_vs_paper": 182.5,
                                "match": True}]},
}


def test_reproduce_builds_the_report_from_fixtures(tmp_path):
    for name, doc in FIXTURES.items():
        with open(tmp_path / (name + ".json"), "w") as f:
            json.dump(doc, f)
    text = load_reproduce().build_report(str(tmp_path))
    assert "**Scale-down**" in text and "50 MB/s stands for 10 Gbps" in text
    expected = [
        # Table 2: every cell beside the paper's, the opposite one flagged, the bound given
        "| C1-N1 | 1.74 | 0.60 | - | **no** | 10.00 | 6.00 | - |",
        "| C2-N1 | 2.96 | 1.30 | - | yes |",
        "| C2-N3 | 2.32 | <= 0.42 | - | undetermined | not reached | 25.00 |",
        "in 1 of 3 settings (C2-N1); the other way in 1 (C1-N1)",
        # at 30 workers: against RR-Sync's ideal too, and a ratio within 3% of 1 is a tie
        "| C1-N1 | 1.74 | 1.02 | 0.90 | tie (within 3%) | 9.80 | 10.00 | 8.82 |",
        "| C2-N1 | 2.96 | 1.60 | 1.40 | yes |",
        "a tie (within 3%) in 1 (C1-N1)",
        "Against RR-Sync's ideal (no CPU overhead), mlfabric-A is faster in 1 of 2 (C2-N1)",
        # the two worker counts side by side, with the chance of a straggler per iteration
        "## Table 2: why the number of workers decides its direction",
        "C1 (r = 0.1) 47% vs 96%",
        "| C1-N1 | 1.74 | 0.60 / 0.91 |",     # the median of the 30-worker runs
        # a repeated command: each run and the median
        "| C1-N1 | 1.74 | 1.02 | 0.80 | 0.91 | **no** |",
        "| C2-N1 | 2.96 | 1.60 | <= 0.5 | 0.80 | **no** |",
        "Over 2 runs, the median speedup is in the paper's direction in 0 of 2 settings",
        # dilated: said in the heading, times as run (a 1 MB transfer: 240 ms, compute 300 ms)
        "## Table 2 with 30 workers (the paper's count), time dilated 3x: mlfabric-A vs "
        "RR-Sync, time to a target accuracy, 2 settings (§7.1)",
        "Every time of the setting runs 3x the paper's (`--dilate 3`)",
        "updates padded to 1.0 MB (240 ms at the base rate); compute 300 ms",
        "| C1-N2 | 1.23 | 0.67 | 0.63 | **no** | 39.95 | 26.70 | 25.33 |"]
    for line in expected:
        assert line in text, line
    # the paper's baseline against an ideal ring, from its §2 slowdown (8x in C2-N1): the
    # arithmetic as printed, and ours in the same terms (the median of 1.4 and a run where
    # mlfabric-A never reached the target: 0.70)
    got = re.search(r"speedup of 2\.96 is 2\.96 x ([0-9.]+) / 8 = \*\*([0-9.]+)x against an "
                    r"ideal ring\*\*", text)
    assert got, text
    ring_slow, vs_ring = map(float, got.groups())
    assert 1 < ring_slow < 8 and vs_ring == pytest.approx(2.96 * ring_slow / 8, abs=0.006)
    assert "Ours against the ideal ring in C2-N1, the same comparison: 0.70 (30 workers, " \
        "median of 2 runs); 0.68 (30 workers, time dilated 3x, median of 1 run)." in text
    assert "| rr-sync | 145 | 182 | 1.00 | 29 | 14.00 | 1.00 |" in text
    assert "| mlfabric-A-30 | 188 | 139 | 0.76 | not reached | > 22.7 |" in text
    assert "mlfabric-A-30 dropped 110 updates" in text
    assert "| C2-N1 | S 16% faster than RR-Sync | 0.780 | 0.490 | 0.550 | 1.59x | 1.42 | +50.0% " \
        "| **no** |" in text
    # within 3% of RR-Sync: a tie, not a direction
    assert "| C1-N1 | RR-Sync 1.2-2x faster | 0.410 | 0.405 | 0.480 | 1.01x | 0.85 | -20.0% " \
        "| tie (within 3%) |" in text
    assert "profiles where mlfabric-S's iteration goes" in text   # behind Tr-Sync in C2-N1
    assert "| 1000 | 1460 | 8.000 | 15486.0 | 182x | yes |" in text
    # every section names its JSON and command
    for name, doc in FIXTURES.items():
        if name.endswith("-repeat2"):    # cited as a repeat, by its file
            continue
        assert "`%s`" % doc["meta"]["command"] in text
        # cited as the repo sees it (relative to the checkout, wherever that is)
        json_path = os.path.join(str(tmp_path), name + ".json")
        assert "`%s`" % os.path.relpath(json_path, ROOT) in text
    assert "Not run:" in text and "--run fig9_replica" in text


def test_reproduce_rejects_unknown_benchmarks(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/paper/reproduce.py", "--run", "table3",
                           "--results", str(tmp_path), "--out", str(tmp_path / "R.md")],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "unknown table3" in proc.stdout, proc.stdout
    assert not os.path.exists(tmp_path / "R.md")


def test_push_side_numbers_of_table2_profile():
    """The push side of Table 2's profile, from a job's accounting: offered load over the
    server link's base rate, the link's busy share of the commit span, updates per commit; jobs
    of other modes, or without commits, are left out."""
    rep = load_reproduce()
    payload, rate = 1e6, 12.5e6
    job = {"mode": "mlfabric-A", "cell": "C1-N1", "duration_s": 2.0,
           "target": {"commit_span_s": 1.6},
           "server_commits": [[1, 0.1], [3, 0.5], [2, 0.9], [2, 1.7]],
           "summary": {"pushed": 12, "applied": 8, "dropped_total": 4,
                       "server_bytes_in": 4 * payload}}
    doc = {"meta": {"base_rate": rate, "task": {"payload_bytes": payload}},
           "jobs": [job, {**job, "mode": "rr-sync"}, {**job, "server_commits": []}]}
    (cell, offered, busy, per_commit, dropped), = rep.push_side(doc)
    assert cell == "C1-N1" and dropped == pytest.approx(4 / 12)
    assert offered == pytest.approx(12 * payload / 2.0 / rate)
    assert busy == pytest.approx(4 * payload / rate / 1.6)
    assert per_commit == 2.0


def test_lda_runs_lists_each_mode_per_run(tmp_path):
    """Fig. 7's repeats (X-repeat2.json beside X.json): one row per mode, one column per run, the
    iterations to the target and the time against RR-Sync's, or 'not reached', and vanilla
    async's first commit where the runs recorded their jobs; no repeats, no table."""
    rep = load_reproduce()

    def rows(iterations, vs_rr):
        return {"rr-sync": {"reached": True, "iterations": 29, "time_vs_rr": 1.0},
                "mlfabric-A-60": {"reached": iterations is not None, "iterations": iterations,
                                  "time_vs_rr": vs_rr}}
    path = tmp_path / "fig7_lda.json"
    (tmp_path / "fig7_lda-repeat2.json").write_text(json.dumps({"rows": rows(None, None)}))
    text = "\n".join(rep.lda_runs({"rows": rows(35, 0.88)}, str(path)))
    assert "| rr-sync | 29 (1.00) | 29 (1.00) |" in text
    assert "| mlfabric-A-60 | 35 (0.88) | not reached |" in text
    assert "first commit" not in text          # no jobs recorded: no row for the race
    assert rep.lda_runs({"rows": rows(35, 0.88)}, str(tmp_path / "alone.json")) == []
    # vanilla async's first commit per run (its start-up race), "-" where a run has no record
    jobs = [{"label": "mlfabric-A-60", "server_commits": [[3, 0.2]]},
            {"label": "async", "server_commits": [[1, 0.3061], [1, 0.8]]}]
    text = "\n".join(rep.lda_runs({"rows": rows(35, 0.88), "jobs": jobs}, str(path)))
    assert "| async's first commit, s | 0.306 | - |" in text


def test_staleness_side_of_table2_profile():
    """The staleness budget of Table 2's profile, from the scheduler's record: the median lag
    when planned (from the histogram), the share planned with no position left within tau_max,
    the medians of the updates in flight, of a fetch's wait and whole request, and of an
    update's plan-to-applied and its lateness, and the pull admission's deferrals and parkings
    per get (None in JSONs from before they were recorded);
    jobs of other modes, or without the record (older JSONs), are left out."""
    rep = load_reproduce()
    st = {"lag_at_plan": {"1": 2, "4": 3, "6": 4, "9": 1},   # 10 updates: median lag 4 or 6
          "in_flight_at_plan": {"median": 3.0}, "pull_wait": {"median": 0.1},
          "get_latency": {"median": 0.4, "n": 20}, "commit_latency": {"median": 0.25},
          "commit_late": {"median": 0.07}, "deferred_pulls": 5, "parked_pulls": 2}
    job = {"mode": "mlfabric-A", "summary": {"staleness": st}}
    older = {"mode": "mlfabric-A", "summary": {"staleness": {
        k: v for k, v in st.items() if not k.startswith(("commit", "deferred", "parked"))}}}
    doc = {"jobs": [job, {**job, "mode": "rr-sync"}, {"mode": "mlfabric-A", "summary": {}},
                    older]}
    (median, over, flight, wait, fetch, commit, late, deferred, parked), old = \
        rep.staleness_side(doc, 6.0)
    assert median == 4                        # the 5th of 10 in lag order
    assert over == pytest.approx(5 / 10)      # lags 6 and 9 leave no position within tau_max 6
    assert (flight, wait, fetch, commit, late) == (3.0, 0.1, 0.4, 0.25, 0.07)
    assert deferred == pytest.approx(5 / 20)  # 5 deferrals over 20 gets
    assert parked == pytest.approx(2 / 20)
    assert old[:5] == (median, over, flight, wait, fetch) and old[5:] == (None,) * 4


def test_a_ceiling_solves_its_lag_equation_and_flags_cells_above_it():
    """mlfabric-A's ceiling (reproduce.a_ceiling). The runtime's pipeline: a commit travels one
    transfer t, one commit a batch b, so rate * (2t + c + b/2) = tau_max and m = rate * b.
    Alg. 3's groups: rate = m / t and rate * (m t + t + c + b/2) = tau_max. Cells whose ideal
    ring applies more per second than the pipeline's ceiling are named (RR-Sync ideal =
    workers / ideal iteration), and the staleness record's plan-to-applied is quoted."""
    rep = load_reproduce()
    rate, m = rep.a_ceiling(30, 0.08, 0.11, 0.1)
    assert rate * (2 * 0.08 + 0.11 + 0.05) == pytest.approx(30) and m == pytest.approx(rate * 0.1)
    assert 93 < rate < 94.5                   # 9.4 updates per commit
    assert rep.a_ceiling(30, 0.2, 0.11, 0.1)[1] == pytest.approx(
        rep.a_ceiling(30, 0.2, 0.11, 0.1)[0] * 0.2)   # the server's link paces the commits
    groups, mg = rep.a_ceiling(30, 0.08, 0.11, 0.1, pipeline=False)
    assert groups == pytest.approx(mg / 0.08)
    assert groups * (mg * 0.08 + 0.08 + 0.11 + 0.05) == pytest.approx(30)
    assert 50 < groups < 54                   # 4.2 updates per commit
    # more room (a larger bound, a shorter compute) means a higher ceiling
    for pipe in (True, False):
        assert (rep.a_ceiling(60, 0.08, 0.11, 0.1, pipe)[0] > rep.a_ceiling(30, 0.08, 0.11, 0.1,
                                                                             pipe)[0]
                > rep.a_ceiling(30, 0.08, 0.3, 0.1, pipe)[0])
    doc = {"meta": {"workers": 30, "tau_max": 30.0, "base_rate": 12.5e6,
                    "task": {"payload_bytes": 1e6}},
           "cells": {"C1-N1": {"rr_ideal_iteration_s": 0.2, "compute_s_mean": 0.11,
                               "a_applied_per_s": 38.0, "rr_applied_per_s": 45.0},
                     "C2-N2": {"rr_ideal_iteration_s": 1.0, "compute_s_mean": 0.13,
                               "a_applied_per_s": 28.0, "rr_applied_per_s": 27.0}},
           "jobs": [{"mode": "mlfabric-A", "summary": {"staleness": {
               "lag_at_plan": {"3": 1}, "commit_latency": {"median": 0.25},
               "commit_late": {"median": 0.09}}}}]}
    text = "\n".join(rep.table2_ceiling(doc))
    assert "| C1-N1 | 150.0 | %.1f (9.4 per commit) | %.1f (4.2) | 38.0 | 45.0 |" % (
        rate, groups) in text
    assert "| C2-N2 | 30.0 |" in text
    assert "above mlfabric-A's pipeline ceiling (C1-N1)" in text
    assert "plan-to-applied took a median 0.25 s (one transfer is 80 ms), 0.09 s of it" in text
    only = "\n".join(rep.table2_ceiling({**doc, "cells": {"C2-N2": doc["cells"]["C2-N2"]}}))
    assert "The ideal ring's rate is below mlfabric-A's pipeline ceiling in every setting" in only
    assert rep.table2_ceiling({"meta": doc["meta"], "cells": {"C1-N1": {}}}) == []


def test_meta_records_the_git_state_the_run_began_with(monkeypatch):
    """A paper script's JSON names the code that ran: the git state begin() read at the start,
    not the tree's when the JSON is written minutes later (someone may be editing it); a script
    that never called begin() reads it when it writes."""
    common = load_common()
    import mlfabric.bench.harness as harness
    monkeypatch.setattr(harness, "git_state", lambda: {"commit": "now", "modified": []})
    monkeypatch.setattr(common, "_GIT_AT_START", [{"commit": "start", "modified": []}])
    assert common.base_meta("table2.py", [], 4)["git"]["commit"] == "start"
    monkeypatch.setattr(common, "_GIT_AT_START", [])
    assert common.base_meta("sched_cost.py", [], None)["git"]["commit"] == "now"


# --- the committed results and the documents that cite them ---------------------------------------

RESULT_PATH = re.compile(r"benchmarks/results/[A-Za-z0-9_./{},-]*")
SKIP_DIRS = {".git", ".venv", "build", "node_modules", "__pycache__", "_build"}


def expand_braces(path):
    """`a{,-x,-y}.json` -> a.json, a-x.json, a-y.json (the documents cite repeats that way)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",")
            for p in expand_braces(path[:m.start()] + alt + path[m.end():])]


def cited_result_paths(text):
    return {p for m in RESULT_PATH.findall(text) for p in expand_braces(m.rstrip(".,"))}


def test_every_result_path_in_the_docs_and_code_exists():
    """A `benchmarks/results/...` path named in any Markdown or Python file of the repository is a
    file or folder that exists: renaming or removing a result updates its citations."""
    dangling = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in files:
            if not name.endswith((".md", ".py")):
                continue
            path = os.path.join(top, name)
            with open(path, errors="replace") as f:
                text = f.read()
            dangling += ["%s: %s" % (os.path.relpath(path, ROOT), p)
                         for p in sorted(cited_result_paths(text))
                         if not os.path.exists(os.path.join(ROOT, p))]
    assert not dangling, dangling


def test_every_committed_result_is_cited():
    """benchmarks/results/ holds only what BENCHMARKS.md and REPRODUCTION.md cite."""
    text = ""
    for doc in ("BENCHMARKS.md", "REPRODUCTION.md"):
        with open(os.path.join(ROOT, doc)) as f:
            text += f.read()
    cited = cited_result_paths(text)
    results = os.path.join(ROOT, "benchmarks", "results")
    kept = {os.path.relpath(os.path.join(top, name), ROOT)
            for top, _, files in os.walk(results) for name in files}
    assert not kept - cited, sorted(kept - cited)


def test_report_notes_come_from_the_template():
    """The prose that is no number lives in REPRODUCTION.template.md: the header and the notes
    placed under a section by file name."""
    rep = load_reproduce()
    header, notes = rep.template()
    assert header.startswith("# ") and "{results}" in header and "**Scale-down**" in header
    assert {"table2-30-lr.json", "table2-30.json", "table2-30-dilated-lr.json",
            "fig7-first-commit"} <= set(notes)
    assert all(note and "\n" not in note for note in notes.values())


def test_wrap_fills_paragraphs_and_keeps_tables_and_code_spans():
    rep = load_reproduce()
    row = "| " + " | ".join(["cell"] * 40) + " |"
    long_span = "`mpirun -n 32 python benchmarks/paper/table2.py " + "--x 1 " * 10 + "`"
    text = rep.wrap("# " + "heading " * 20 + "\n\n" + "word " * 60 + long_span + " end\n\n" + row)
    lines = text.split("\n")
    assert lines[0].startswith("# ") and row in lines
    assert long_span in text                          # a code span is never split
    assert all(len(x) <= rep.WIDTH or x.startswith(("|", "#")) or long_span in x for x in lines)


def test_committed_reproduction_is_what_the_generator_writes(tmp_path):
    """REPRODUCTION.md is generated: running reproduce.py on the committed results writes it
    byte for byte (no timestamp of its own; every line of prose filled)."""
    out = tmp_path / "R.md"
    proc = subprocess.run([sys.executable, "benchmarks/paper/reproduce.py", "--out", str(out)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout
    with open(os.path.join(ROOT, "REPRODUCTION.md")) as f:
        committed = f.read()
    assert out.read_text() == committed
    assert max(len(line) for line in committed.split("\n")) <= 200
