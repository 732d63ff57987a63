"""Smoke tests of benchmarks/ps_modes.py (the training modes side by side): each experiment at a
tiny size under real mpirun, bounded in time, checking the exit status, the JSON's structure and
that every job's accounting balanced (pushed = applied + dropped, no id missing or twice). Timings
are not asserted: they are what the benchmark is for."""
import os

import pytest

from mlfabric.bench.harness import ENVELOPE_KEYS

from tests.mpi_util import run_mpi, run_script_json

TIMEOUT = 120
TINY = ["--size", "4096", "--iterations", "3", "--compute-ms", "1"]
HOST_FIELDS = {"command", "experiment", "ranks", "workers", "preset", "base_rate", "model_bytes",
               "regime", "git", "hostname", "cpu_count", "timestamp", "mpi_library",
               "mlfabric_version"}


def bench(n, args, tmp_path):
    out = str(tmp_path / "out.json")
    return run_script_json(n, ["benchmarks/ps_modes.py", *args, "--out", out], out, TIMEOUT)


def check_common(doc, n, experiment, jobs):
    meta = doc["meta"]
    assert HOST_FIELDS <= set(meta), HOST_FIELDS - set(meta)
    assert set(ENVELOPE_KEYS) <= set(meta), set(ENVELOPE_KEYS) - set(meta)
    assert meta["experiment"] == experiment and meta["ranks"] == n
    assert meta["command"].startswith("mpirun -n %d python benchmarks/ps_modes.py %s"
                                      % (n, experiment))
    assert len(doc["jobs"]) == jobs
    for job in doc["jobs"]:
        s = job["summary"]
        assert s["balanced"], job
        assert s["missing"] == 0 and s["twice"] == 0
        assert s["pushed"] == s["applied"] + s["dropped_total"]
        assert s["pushed"] == job["workers"] * 3      # every worker's 3 iterations were pushed
        assert job["wall_s"] > 0
    assert doc["results"]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [4, 5])
def test_sync(n, tmp_path):
    doc, out = bench(n, ["sync", *TINY, "--rounds", "2"], tmp_path)
    check_common(doc, n, "sync", 6)
    # rounds alternate the order, so a drift of the machine hits every mode alike
    assert [j["mode"] for j in doc["jobs"]] == ["mlfabric-S", "tr-sync", "rr-sync",
                                                "rr-sync", "tr-sync", "mlfabric-S"]
    for job in doc["jobs"]:
        assert job["workers"] == n - 2                  # scheduler and server sit out alike
        assert job["iteration_s"]["n"] == job["workers"] * 2   # iteration 0 is warm-up
    res = doc["results"]
    assert set(res["per_mode"]) == {"mlfabric-S", "tr-sync", "rr-sync"}
    for key in ("mlfabric-S / tr-sync", "mlfabric-S / rr-sync"):
        assert len(res["ratios"][key]["per_round"]) == 2
        assert res["ratios"][key]["of_means"] > 0
    assert "mlfabric-S / tr-sync" in out


@pytest.mark.mpi
def test_async(tmp_path):
    doc, out = bench(5, ["async", *TINY, "--rounds", "1"], tmp_path)
    check_common(doc, 5, "async", 2)
    assert [j["mode"] for j in doc["jobs"]] == ["mlfabric-A", "async"]
    for job in doc["jobs"]:
        assert job["commit_rate_over_wall"] > 0
        assert sum(c[0] for c in job["server_commits"]) == job["summary"]["applied"]
    vanilla = doc["jobs"][1]["summary"]
    assert vanilla["dropped_total"] == 0 and vanilla["aggregated"] == 0
    assert set(doc["results"]["ratios"]) == {"mlfabric-A / async"}


@pytest.mark.mpi
def test_replica(tmp_path):
    doc, out = bench(5, ["replica", *TINY, "--div-max", "0,2,inf"], tmp_path)
    check_common(doc, 5, "replica", 4)              # three Div_max values + the reference
    rows = doc["results"]["rows"]
    assert [r["div_max_units"] for r in rows] == [0.0, 2.0, "inf"]
    nbytes = doc["results"]["update_bytes"]
    for r, job in zip(rows, doc["jobs"]):
        assert job["settings"]["replicas"] == 1
        assert r["replicated"] == r["applied"]       # tau_max = inf: nothing dropped
        assert r["unaggregated_bytes"] == r["replicated"] * nbytes
        assert 0 < r["replica_update_bytes"] <= r["unaggregated_bytes"]
    ref = doc["results"]["reference"]
    assert ref["replica_update_bytes"] == ref["expected"]   # aggregators=0: one copy per update
    assert os.path.getsize(str(tmp_path / "out.png")) > 0


@pytest.mark.mpi
def test_control(tmp_path):
    doc, out = bench(4, ["control", *TINY], tmp_path)
    check_common(doc, 4, "control", 2)
    for job in doc["jobs"]:
        c = job["control"]
        assert c["batches"] >= 1
        for leg in ("ready_latency_s", "plan_time_s", "plan_latency_s"):
            assert c[leg]["n"] >= 1 and c[leg]["median"] >= 0, leg
    assert set(doc["results"]["round_trip"]) == {"mlfabric-A", "mlfabric-S"}


@pytest.mark.mpi
@pytest.mark.parametrize("args,message", [
    (["sync"], "too few"),                                  # 2 ranks: no room for a worker
    (["sync", "--preset", "C9-N1"], "unknown compute preset"),
    (["async", "--modes", "rr-sync"], "modes must be among"),
])
def test_bad_command_line(args, message, tmp_path):
    proc = run_mpi(2, ["benchmarks/ps_modes.py", *args], timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.count(message) == 1, proc.stdout     # said once, by rank 0
