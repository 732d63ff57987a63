"""scripts/train.py, the main job, under real mpirun: every mode meant to converge reaches 95% test
accuracy on digits with 4 ranks; the metrics file, the plot and the final summary are written;
bad options fail at once with a clear message."""
import json
import os
import subprocess
import sys

import pytest

from tests.mpi_util import ROOT, mpi_env, run_mpi, shared_memory_btl

pytest.importorskip("torch")
pytest.importorskip("sklearn")

SCRIPT = os.path.join("scripts", "train.py")
ULFM = ("--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true")  # mpirun's, for --elastic


def result(out):
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["allreduce", "ps-sync", "ps-async", "ssp", "vanilla"])
def test_every_mode_reaches_95_percent_on_digits_with_4_ranks(mode, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run_mpi(4, [SCRIPT, "--mode", mode, "--quiet", "--metrics", str(metrics)],
                   timeout=240)
    assert proc.returncode == 0, proc.stdout
    r = result(proc.stdout)
    assert r["mode"] == mode and r["test_accuracy"] >= 0.95, r
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert [row["epoch"] for row in rows[:-1]] == list(range(10)) and rows[-1]["final"]
    assert rows[-2]["test_accuracy"] == r["test_accuracy"]
    if mode == "allreduce" and not _gpus_for(4):
        assert r["device"] == "cpu", r   # auto: no GPU of its own for every rank
    if mode != "allreduce":
        # nothing lost: every pushed update applied (no tau_max given, so none is stale)
        assert r["balanced"] and r["pushed"] == r["applied"] == 2 * r["steps"], r
        # the server's model once both workers are done, not only the reporting worker's view
        assert r["final_test_accuracy"] >= 0.95, r


@pytest.mark.mpi
def test_odd_rank_count_with_stragglers_network_and_a_plot(tmp_path):
    # 5 ranks: scheduler, server, 3 workers; C1 stragglers and N1 paced links, 2 epochs
    png = tmp_path / "acc.png"
    proc = run_mpi(5, [SCRIPT, "--mode", "ps-async", "--tau-max", "8", "--epochs", "2",
                       "--stragglers", "C1", "--network", "N1", "--compute-ms", "2",
                       "--plot", str(png)], timeout=240)
    assert proc.returncode == 0, proc.stdout
    r = result(proc.stdout)
    assert r["workers"] == 3 and r["balanced"], r
    assert r["pushed"] == r["applied"] + sum(r["dropped"].values()), r
    assert r["max_delay"] <= 8, r
    assert png.stat().st_size > 1000
    assert "train ps-async [" in proc.stdout   # the progress bar


@pytest.mark.parametrize("args, match", [
    (["--network", "N1"], "--network emulates NIC rates"),
    (["--replicas", "1"], "--replicas is for the parameter-server modes"),
    (["--epochs", "0"], "--epochs and --batch-size must be >= 1"),
    (["--mode", "nonsense"], "invalid choice"),
    (["--mode", "ps-async", "--device", "cuda"], "--device cuda is for --mode allreduce"),
    (["--mode", "ps-sync", "--elastic"], "--elastic is for --mode allreduce"),
    (["--kill-rank", "1@2"], "--kill-rank is for trying --elastic"),
    (["--elastic", "--kill-rank", "1"], "--kill-rank takes RANK@EPOCH"),
    (["--replace", "1"], "--replace N (N >= 0) is for --elastic"),
    # options only some roles read, refused on every rank before MPI (not after a timeout)
    (["--mode", "ps-async", "--tau-max", "-1"], "--tau-max must be >= 1"),
    (["--mode", "ps-async", "--tau-max", "0"], "would drop every update"),
    (["--mode", "ps-async", "--servers", "0"], "--servers must be >= 1"),
    (["--mode", "ps-async", "--replicas", "-1"], "--replicas must be >= 0"),
    (["--mode", "ssp", "--slack", "-1"], "--slack must be >= 0"),
    (["--mode", "ps-async", "--batch-interval", "0"], "--batch-interval must be a positive"),
    (["--mode", "ps-async", "--network", "N1", "--base-rate", "-5"], "--base-rate must be > 0"),
    (["--mode", "ps-async", "--base-rate", "1e6"], "without --network the data plane is not"),
    (["--mode", "ps-async", "--lr", "nan"], "--lr must be >= 0"),
    (["--momentum", "-0.5"], "--momentum must be >= 0"),
    (["--mode", "ps-async", "--compute-ms", "-5"], "--compute-ms must be >= 0"),
    (["--mode", "ps-async", "--stragglers", "C2", "--compute-ms", "0"], "leaves none"),
    (["--metrics", "/nonexistent/m.jsonl"], "is not a folder this process can write to"),
    (["--metrics", "scripts"], "--metrics scripts is a folder"),   # (else rank 0 alone failed)
    # ignored by the allreduce mode: refused, not silently dropped
    (["--servers", "2"], "--servers is for the parameter-server modes"),
    (["--batch-interval", "1"], "--batch-interval is for the parameter-server modes"),
    (["--base-rate", "1e6"], "--base-rate is for the parameter-server modes"),
    # a victim that never comes (rank < 0, or an epoch never run) is refused, not a no-op
    (["--elastic", "--epochs", "3", "--kill-rank", "1@3"], "so no rank would die"),
    (["--elastic", "--kill-rank=-1@1"], "so no rank would die"),
    (["--mode", "vanilla", "--tau-max", "1"], "--tau-max is for --mode ps-async"),
    (["--mode", "ps-async", "--slack", "3"], "--slack is for --mode ssp"),
    (["--mode", "ps-async", "--div-max", "1"], "--div-max bounds the replicas' divergence"),
    (["--model", "resnet"], "invalid choice"),
])
def test_bad_options_fail_before_any_mpi(args, match):
    _assert_refused(args, match)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any file")
def test_a_metrics_file_it_cannot_write_fails_before_any_mpi(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("")
    metrics.chmod(0o444)
    _assert_refused(["--metrics", str(metrics)], "cannot write to that file")


def _assert_refused(args, match):
    proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=mpi_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=60)
    assert proc.returncode == 2 and match in proc.stdout, proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("args, mpirun_args, match", [
    # ps_init's refusal: too few ranks for the roles
    (["--mode", "ps-async"], (), "train.py: 2 ranks are too few for 1 scheduler"),
    # a victim beyond the job's size, known only once MPI runs
    (["--elastic", "--kill-rank", "2@0"], ULFM, "train.py: --kill-rank 2@0: this job has ranks"),
])
def test_errors_known_under_mpi_fail_every_rank_in_one_line(args, mpirun_args, match):
    proc = run_mpi(2, [SCRIPT, *args, "--epochs", "1", "--quiet"], timeout=120,
                   env={"MLFABRIC_TIMEOUT": "20"}, mpirun_args=mpirun_args)
    assert proc.returncode != 0, proc.stdout
    assert proc.stdout.count(match) == 2 and "Traceback" not in proc.stdout, proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("mode, n, batch", [("ps-sync", 5, 479), ("ssp", 5, 479),
                                            ("allreduce", 5, 41)])
def test_shards_of_unequal_batch_counts_take_equal_steps(mode, n, batch):
    """Shards one sample apart that straddle a batch boundary (1438 digits over 3 workers:
    479, 479, 480 at batch 479; over 5 ranks at batch 41: 7 and 8 batches): every worker takes
    the largest shard's steps (a shorter one repeats a batch), so the modes that wait for every
    worker's step finish instead of waiting for a step never taken."""
    proc = run_mpi(n, [SCRIPT, "--mode", mode, "--epochs", "2", "--batch-size", str(batch),
                       "--quiet"], timeout=240, env={"MLFABRIC_TIMEOUT": "60"})
    assert proc.returncode == 0, proc.stdout
    r = result(proc.stdout)
    assert r["steps"] == 2 * (2 if mode != "allreduce" else 8), r
    if mode != "allreduce":
        assert r["balanced"] and r["pushed"] == r["applied"] == 3 * r["steps"], r


def _gpus_for(ranks):
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= ranks


@pytest.mark.mpi
@pytest.mark.skipif(_gpus_for(1), reason="for machines without a GPU")
def test_device_cuda_without_a_gpu_fails_on_every_rank():
    proc = run_mpi(2, [SCRIPT, "--device", "cuda", "--epochs", "1", "--quiet"], timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert proc.stdout.count("--device cuda needs a GPU for every rank") == 2, proc.stdout


@pytest.mark.mpi
def test_elastic_training_survives_a_killed_rank():
    """--elastic under ULFM: rank 1 of 4 dies as epoch 3 starts; the 3 others redo that epoch on
    re-split shards and still reach 95% on digits, with rank 0's summary naming 3 ranks."""
    proc = run_mpi(4, [SCRIPT, "--elastic", "--kill-rank", "1@3", "--quiet"], timeout=240,
                   env={"MLFABRIC_TIMEOUT": "10"}, mpirun_args=ULFM)
    assert "3 rank(s) go on from epoch 3" in proc.stdout, proc.stdout
    assert proc.returncode == 0, proc.stdout  # the survivors' exit too
    r = result(proc.stdout)
    assert r["ranks"] == 3 and r["test_accuracy"] >= 0.95, r


@pytest.mark.mpi
def test_elastic_training_replaces_a_killed_rank():
    """--elastic --replace 1: rank 1 of 4 dies as epoch 3 starts; a new process replaces it
    (spawned by the survivors, joining at its hvd.init()), so 4 ranks finish the training, still
    reaching 95% on digits."""
    proc = run_mpi(4, [SCRIPT, "--elastic", "--kill-rank", "1@3", "--replace", "1", "--quiet"],
                   timeout=300, env={# Finalize with a spawned replacement connected takes
                                     # 10-25 s on a loaded 2-core machine; past the exit
                                     # watchdog's bound (MLFABRIC_TIMEOUT) the ranks leave
                                     # without it and mpirun reports the job failed (a known
                                     # gap, not the behaviour under test)
                                     "MLFABRIC_TIMEOUT": "45",
                                     # shared memory does not connect separate jobs
                                     "OMPI_MCA_btl": f"self,{shared_memory_btl()},tcp"},
                   mpirun_args=ULFM)
    assert "4 rank(s) go on from epoch 3 (replacements included)" in proc.stdout, proc.stdout
    assert proc.returncode == 0, proc.stdout
    r = result(proc.stdout)
    assert r["ranks"] == 4 and r["test_accuracy"] >= 0.95, r


@pytest.mark.mpi
def test_elastic_metrics_go_on_when_rank_0_dies(tmp_path):
    """--elastic --metrics: rank 0 of 3 dies as epoch 1 starts; the new rank 0 appends the
    epochs after it and the summary to the file the dead one began, and carries the progress
    bar to its end (the dead one drew it to the middle)."""
    metrics = tmp_path / "m.jsonl"
    proc = run_mpi(3, [SCRIPT, "--elastic", "--kill-rank", "0@1", "--epochs", "2",
                       "--metrics", str(metrics)], timeout=120, env={"MLFABRIC_TIMEOUT": "10"},
                   mpirun_args=ULFM)
    assert proc.returncode == 0, proc.stdout
    r = result(proc.stdout)
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert [row.get("epoch") for row in rows] == [0, 1, None], rows
    assert rows[-1] == r and r["ranks"] == 2, rows
    bars = [ln for ln in proc.stdout.splitlines() if ln.startswith("train allreduce [")]
    total = int(bars[0].split("] ")[1].split("/")[1].split()[0])
    assert any(f"] {total}/{total} " in ln for ln in bars), bars
