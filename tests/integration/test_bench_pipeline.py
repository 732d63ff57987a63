"""Smoke tests of benchmarks/pipeline.py (issue 6's pipeline measurements): each subcommand at a
tiny size under real mpirun, bounded in time, checking the exit status, the JSON's structure and
what the benchmark must get right whatever the timing: the measured timeline follows every
rank's action list, the executor's stash and version counts equal validate()'s, the partitioner's
stages cover the model, mlfabric and torch.distributed.pipelining end one step at the same
weights. Timings are not asserted: they are what the benchmark is for."""
import os

import pytest

from mlfabric.bench.harness import ENVELOPE_KEYS

from tests.mpi_util import run_script_json

TIMEOUT = 90
META = {"command", "experiment", "ranks", "parameters", "compute", "git", "hostname", "cpu",
        "loadavg_before", "loadavg_after", "torch_version", "mlfabric_version"}


def bench(n, args, tmp_path):
    out = str(tmp_path / "out.json")
    doc, stdout = run_script_json(n, ["benchmarks/pipeline.py", *args, "--out", out, "-q"], out,
                                  TIMEOUT)
    meta = doc["meta"]
    assert META <= set(meta), META - set(meta)
    assert set(ENVELOPE_KEYS) <= set(meta), set(ENVELOPE_KEYS) - set(meta)
    assert meta["ranks"] == n and meta["experiment"] == args[0]
    assert meta["command"].startswith("mpirun -n %d python benchmarks/pipeline.py %s"
                                      % (n, args[0]))
    return doc, stdout


@pytest.mark.mpi
def test_bubbles(tmp_path):
    p = 3  # odd: interleaved needs m a multiple of p
    doc, out = bench(p, ["bubbles", "--t-f-ms", "1", "--m", "3", "--steady", "3", "--repeats",
                         "1", "--gantt", "flush/3"], tmp_path)
    runs = doc["runs"]
    assert [r["label"] for r in runs] == ["gpipe m=3", "flush m=3", "interleaved m=3 v=2",
                                          "1f1b 3 inputs", "2bw m=3 x 1 batches"]
    for r in runs:
        # the measured timeline has every action of every rank, in its list's order
        assert sorted(r["rows_ms"]) == [str(s) for s in range(p)]
        passes = sum(len(row) for row in r["rows_ms"].values())
        assert passes == p * (2 * r["microbatches"] * r["v"]) + p * r["batches"] \
            * (r["microbatches"] if r["schedule"] == "1f1b" else 1)
        for row in r["rows_ms"].values():
            starts = [s for _, s, _ in row]
            assert starts == sorted(starts) and all(e >= s for _, s, e in row)
        assert r["bubble"] > 0 and r["makespan_ms"] >= r["sim_makespan_ms"] * 0.9
        assert r["sim_bubble"] == pytest.approx(r["formula_bubble"])
        assert r["replay"]["makespan_ms"] > 0
        # the executor's counts are validate()'s
        assert r["peak_stash"] == r["validate_peak_stash"]
        assert r["peak_versions"] == r["validate_peak_versions"]
    flush = runs[1]
    assert flush["peak_stash"] == [3, 2, 1] and flush["peak_versions"] == [1, 1, 1]
    assert runs[0]["peak_stash"] == [3, 3, 3]
    assert max(runs[4]["peak_versions"]) <= 2       # 2BW: at most two weight versions
    targets = doc["results"]["targets"]
    assert {"bubble gpipe m=3", "bubble flush m=3", "bubble interleaved m=3 v=2",
            "steady idle 1f1b 3 inputs", "steady idle 2bw m=3 x 1 batches"} <= set(targets)
    assert all(targets["memory " + r["label"]]["met"] for r in runs)
    assert len(doc["meta"]["pngs"]) == 2 and all(os.path.getsize(x) > 0
                                                  for x in doc["meta"]["pngs"])
    assert "measured run of flush m=3" in out


@pytest.mark.mpi
def test_partition(tmp_path):
    n = 2
    doc, out = bench(n, ["partition", "--channels", "4", "--image", "8", "--hidden", "32",
                         "--microbatch", "2", "--inputs", "6", "--iterations", "2",
                         "--rounds", "2", "--profile-repeats", "1", "--bandwidth", "1e7"],
                     tmp_path)
    res = doc["results"]
    stages = res["partition"]["stages"]
    # contiguous stages covering the 7 layers, workers adding up to the ranks
    assert stages[0][0] == 0 and stages[-1][1] == 6
    assert all(a[1] + 1 == b[0] for a, b in zip(stages, stages[1:]))
    assert sum(s[2] for s in stages) == n
    assert len(res["profiles"]) == 7
    assert res["head_weight_bytes"] > 0.5 * res["weight_bytes"]
    assert res["dp_allreduce_paced_s"] == pytest.approx(
        2 * (n - 1) / n * res["weight_bytes"] / 1e7)
    for cfg in ("pipeline", "data parallel"):
        assert len(res["measured"][cfg]["samples_s_per_round"]) == 2
        assert res["predicted"][cfg]["partitioner_model_samples_s"] > 0
    assert [r["config"] for r in doc["runs"]] == ["data parallel", "pipeline", "pipeline",
                                                  "data parallel"]
    assert res["ratio_measured"] > 0
    assert "partitioner beats data parallelism" in res["targets"]


@pytest.mark.mpi
def test_torch(tmp_path):
    n = 2
    doc, out = bench(n, ["torch", "--t-f-ms", "1", "--m", "4", "--microbatch", "2",
                         "--steps", "1", "--rounds", "2", "--channels", "4", "--image", "8",
                         "--hidden", "32"], tmp_path)
    cases = doc["results"]["cases"]
    assert [(c["model"], c["schedule"]) for c in cases] == [
        ("synthetic", "gpipe"), ("synthetic", "1f1b"), ("real", "gpipe"), ("real", "1f1b")]
    for c in cases:
        # the same model, schedule and microbatches: one step from the same weights ends at the
        # same weights in both (float32, same accumulation order)
        assert c["max_abs_weight_change_first_step"] > 0
        assert c["max_abs_weight_diff_after_first_step"] < 1e-6
        assert c["first_step_loss"]["mlfabric"] == pytest.approx(c["first_step_loss"]["torch"],
                                                                 rel=1e-5)
        assert len(c["ratio_per_round"]) == 2 and c["ratio_median"] > 0
    assert cases[2]["boundaries"] and len(cases[2]["boundaries"]) == n - 1


@pytest.mark.mpi
def test_overhead(tmp_path):
    doc, out = bench(1, ["overhead", "--m", "2", "--microbatch", "2", "--steps", "2",
                         "--channels", "4", "--image", "8", "--hidden", "32"], tmp_path)
    res = doc["results"]
    assert len(res["per_step_ms"]["plain_ms"]) == len(res["per_step_ms"]["mlfabric_ms"]) == 2
    assert res["ratio"] == pytest.approx(res["plain_ms"] / res["mlfabric_ms"])
    assert "overhead: one process" in out
