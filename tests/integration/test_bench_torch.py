"""Smoke test of benchmarks/torch_optimizer.py (DistributedOptimizer's step time, fusion, and DDP
on gloo side by side) at a tiny size under real mpirun, bounded in time: the exit status, the
JSON's structure, and what the benchmark checks about its own results (every reduction equal to
the float64 mean over ranks; hvd and both DDPs end at the same weights). Timings are not
asserted: they are what the benchmark is for."""

import pytest

from tests.mpi_util import run_mpi, run_script_json

TIMEOUT = 60
TINY = ["--inputs", "16", "--hidden", "16", "--layers", "2", "--batches", "4,2", "--steps", "2",
        "--rounds", "2", "--count", "10", "--small", "8,32", "--iters", "2", "--threads", "1"]


def bench(n, args, tmp_path):
    out = str(tmp_path / "out.json")
    return run_script_json(n, ["benchmarks/torch_optimizer.py", *args, "--out", out], out,
                           TIMEOUT)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_tiny_run(n, tmp_path):
    doc, out = bench(n, [*TINY, "--bucket-mib", "1"], tmp_path)
    meta = doc["meta"]
    assert meta["command"].startswith(f"mpirun -n {n} python benchmarks/torch_optimizer.py")
    assert meta["ranks"] == n and meta["threads_per_rank"] == 1
    assert {"git", "hostname", "cpu", "loadavg_before", "loadavg_after", "torch_version",
            "fusion_threshold_bytes"} <= set(meta)
    assert doc["wrong"] is False

    variants = ["alone", "local", "hvd", "ddp-gloo", "ddp-mlfabric", "hvd@1MiB"]
    assert [r["batch"] for r in doc["step"]] == [4, 2]
    for r in doc["step"]:
        assert list(r["variants"]) == variants
        for v in r["variants"].values():
            assert len(v["per_round_ms"]) == 2 and v["median_ms"] > 0
            assert set(v["split_ms"]) == {"forward", "backward", "sync", "update"}
        # only the DistributedOptimizer variants wait in synchronize()
        assert r["variants"]["ddp-gloo"]["split_ms"]["sync"] == 0
        assert len(r["variants"]["hvd"]["split_ms_per_rank"]) == n
        assert len(r["variants"]["alone"]["split_ms_per_rank"]) == 1
        # same steps on the same data: hvd, DDP on gloo and DDP on mlfabric agree
        diffs = r["max_abs_weight_diff"]
        assert set(diffs) == {"hvd vs ddp-gloo", "hvd vs ddp-mlfabric", "hvd vs hvd@1MiB",
                              "hvd rank 0 vs others"}
        assert max(diffs.values()) < 1e-5, diffs
        assert r["wrong"] == 0
        assert r["ratios"]["ddp-gloo / hvd"] > 0

    assert [(r["count"], r["elements"]) for r in doc["fusion"]] == [(10, 8), (10, 32)]
    for r in doc["fusion"]:
        assert r["total_bytes"] == 10 * r["elements"] * 4
        assert set(r["variants"]) == {"one", "grouped", "cat+one", "unfused", "unfused-async",
                                      "opt-N", "local-N", "opt-1", "local-1", "local-N+one"}
        assert all(v["median_us"] > 0 for v in r["variants"].values())
        assert set(r["wrong"]) == {"one", "grouped", "cat+one", "unfused", "unfused-async",
                                   "opt-N", "opt-1", "local-N+one"}
        assert r["optimizer_added_us"]["one after backward"] is not None
        assert not any(r["wrong"].values()), r["wrong"]
        assert r["ratios"]["grouped / one"] > 0

    t = doc["targets"]
    assert t["scaling"]["batch"] == 4              # the largest batch is the compute-bound one
    assert set(t["vs_gloo"]["per_batch"]) == {"4", "2"}
    assert set(t["fusion"]["per_size"]) == {"8", "32"}
    assert "# targets" in out


@pytest.mark.mpi
@pytest.mark.parametrize("args,message", [
    (["--experiments", "steps"], "--experiments must be among"),
    (["--batches", "0"], "needs integers >= 1"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])
def test_bad_command_line(args, message):
    proc = run_mpi(2, ["benchmarks/torch_optimizer.py", *args], timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.count(message) == 1, proc.stdout     # said once, by rank 0


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_grouped_tiny_run(n, tmp_path):
    """benchmarks/torch_grouped.py at a tiny size: every variant of both ops timed and checked
    against its expectation (the benchmark's own check: `wrong` all zero)."""
    out = str(tmp_path / "grouped.json")
    doc, _ = run_script_json(n, ["benchmarks/torch_grouped.py", "--count", "10", "--small",
                                 "8,32", "--iters", "2", "--rounds", "2", "--out", out], out,
                             TIMEOUT)
    assert doc["meta"]["command"].startswith(f"mpirun -n {n} python benchmarks/torch_grouped.py")
    assert doc["wrong"] is False
    assert [(r["op"], r["elements"]) for r in doc["results"]] == [
        ("allgather", 8), ("allgather", 32), ("reducescatter", 8), ("reducescatter", 32)]
    for r in doc["results"]:
        assert set(r["variants"]) == {"one", "grouped", "unfused"}
        assert all(len(v["per_round_us"]) == 2 and v["median_us"] > 0
                   for v in r["variants"].values())
        assert r["wrong"] == {"one": 0, "grouped": 0, "unfused": 0}
        assert r["ratios"]["grouped / one"] > 0


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_sparse_tiny_run(n, tmp_path):
    """benchmarks/torch_sparse.py at a tiny size: the three variants timed, the sparse and dense
    DistributedOptimizers ending at the same weights (the benchmark's own check)."""
    out = str(tmp_path / "sparse.json")
    doc, _ = run_script_json(n, ["benchmarks/torch_sparse.py", "--vocab", "50,500", "--dim",
                                 "4", "--rows", "16", "--iters", "2", "--rounds", "2", "--out",
                                 out], out, TIMEOUT)
    assert doc["meta"]["command"].startswith(f"mpirun -n {n} python benchmarks/torch_sparse.py")
    assert doc["wrong"] is False
    assert [r["vocab"] for r in doc["results"]] == [50, 500]
    for r in doc["results"]:
        assert set(r["variants"]) == {"local", "sparse", "dense"}
        assert all(len(v["per_round_ms"]) == 2 and v["median_ms"] > 0
                   for v in r["variants"].values())
        assert r["max_weight_diff_sparse_vs_dense"] <= 1e-5 and r["ratios"]["dense / sparse"] > 0
