"""The pipeline executor and its PyTorch front end (mlfabric.pipeline.executor, .stage) and
scripts/train_pipeline.py.

Multi-rank: tests/mpi_cases/pipeline_cases.py under real mpirun at 2, 3 and 4 ranks (float64
models against single-process references: Flush / GPipe / interleaved = synchronous SGD, 2BW =
W(t+1) = W(t) - lr grad f(W(t-1)), PipeDream stashing and vertical sync, 1F1B-RR routing and a
replicated stage's allreduce, memory counts, errors on every rank). The script: the loss falls
for every schedule at 4 ranks. Single process: cutting a model into pieces and naming schedules.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.mpi_util import ROOT, mpi_env, run_cases, run_mpi

torch = pytest.importorskip("torch")

from mlfabric.pipeline.partition import Partition, Stage  # noqa: E402
from mlfabric.pipeline.stage import make_schedule, split_layers, stage_modules  # noqa: E402

SCRIPT = os.path.join("scripts", "train_pipeline.py")


# --- multi-rank -----------------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_pipeline_cases(n):
    out = run_cases("pipeline_cases", n, timeout=200)
    assert "pipeline_cases: 13 passed, 0 failed" in out, out


def _result(out):
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.mpi
@pytest.mark.parametrize("schedule, extra", [
    ("gpipe", []), ("flush", []), ("2bw", []), ("interleaved", ["--chunks", "2"]),
    ("1f1b", []),
])
def test_train_pipeline_loss_falls(schedule, extra):
    proc = run_mpi(4, [SCRIPT, "--schedule", schedule, "--epochs", "3", "--dataset", "synthetic",
                       "--samples", "600", *extra], timeout=240)
    assert proc.returncode == 0, proc.stdout
    r = _result(proc.stdout)
    assert r["schedule"] == schedule and r["ranks"] == 4 and len(r["losses"]) == 3, r
    assert r["final_loss"] < r["first_loss"], r
    assert "pipeline %s [" % schedule in proc.stdout       # the progress bar
    assert proc.stdout.count("epoch ") >= 3
    # weight versions per rank as the policies promise
    limit = {"gpipe": 1, "flush": 1, "interleaved": 1, "2bw": 2, "1f1b": 4}[schedule]
    assert max(r["peak_versions"]) <= limit, r
    if schedule == "1f1b":
        assert r["peak_versions"] == [4, 3, 2, 1], r   # p - s at stage s


@pytest.mark.parametrize("args, match", [
    (["--schedule", "flush", "--chunks", "2"], "--chunks is for --schedule interleaved"),
    (["--schedule", "flush", "--batch-size", "10", "--microbatches", "4"],
     "must be a multiple of --microbatches"),
    (["--schedule", "2bw", "--vertical-sync"], "are for --schedule 1f1b"),
    (["--schedule", "pipedream"], "invalid choice"),
])
def test_train_pipeline_rejects_bad_options(args, match):
    proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=mpi_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode != 0 and match in proc.stdout, proc.stdout


# --- single process -----------------------------------------------------------------------------

def _layers(n):
    return [torch.nn.Linear(2, 2) for _ in range(n)]


def _sizes(pieces):
    return [len(pc) for pc in pieces]


def test_split_layers_even_by_boundaries_and_by_partition():
    layers = _layers(7)
    assert _sizes(split_layers(layers, 3)) == [3, 2, 2]
    assert _sizes(split_layers(torch.nn.Sequential(*layers), 7)) == [1] * 7
    pieces = split_layers(layers, 3, boundaries=[1, 5])
    assert _sizes(pieces) == [1, 4, 2]
    assert pieces[1][0] is layers[1] and pieces[2][1] is layers[6]  # the same modules, in order
    part = Partition([Stage(0, 3, 1), Stage(4, 6, 2)], noam=3, predicted_time_per_sample=1.0,
                     predicted_throughput=1.0)
    assert _sizes(split_layers(layers, 2, partition=part)) == [4, 3]


@pytest.mark.parametrize("kw, match", [
    (dict(pieces=8), "cannot cut 7 layers into 8 pieces"),
    (dict(pieces=3, boundaries=[2]), "boundaries must be 2 ints"),
    (dict(pieces=3, boundaries=[3, 3]), "increase strictly"),
    (dict(pieces=3, boundaries=[0, 3]), "increase strictly"),
    (dict(pieces=3, boundaries=[2, 7]), "increase strictly"),
    (dict(pieces=0), "pieces must be an int >= 1"),
    (dict(pieces=2, partition="0-3,4-6"), "must be a mlfabric.pipeline.partition.Partition"),
    (dict(pieces=2, partition=Partition([Stage(0, 2, 1), Stage(3, 6, 1)], 1, 1.0, 1.0),
          boundaries=[3]), "not both"),
    (dict(pieces=2, partition=Partition([Stage(0, 2, 1), Stage(4, 6, 1)], 1, 1.0, 1.0)),
     "cover layers 0..6 in order"),
    (dict(pieces=3, partition=Partition([Stage(0, 2, 1), Stage(3, 6, 1)], 1, 1.0, 1.0)),
     "the partition has 2 stages, the schedule 3 pieces"),
])
def test_split_layers_rejects_bad_cuts(kw, match):
    with pytest.raises(ValueError, match=match):
        split_layers(_layers(7), **kw)


def test_split_layers_rejects_what_is_not_a_model():
    with pytest.raises(ValueError, match="nn.Sequential or a list of modules"):
        split_layers(torch.nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="non-empty list of torch modules"):
        split_layers([torch.nn.Linear(2, 2), "relu"], 1)


def test_stage_modules_gives_each_rank_its_chunks():
    sched = make_schedule("interleaved", 2, 4, chunks=3)
    pieces = split_layers(_layers(6), sched.pieces)
    assert stage_modules(pieces, sched, 0) == [pieces[0], pieces[2], pieces[4]]
    assert stage_modules(pieces, sched, 1) == [pieces[1], pieces[3], pieces[5]]
    with pytest.raises(ValueError, match="runs 6 pieces"):
        stage_modules(pieces[:5], sched, 0)


def test_make_schedule_names():
    assert make_schedule("gpipe", 3, 2, batches=2).policy == "flush"
    assert make_schedule("2bw", 3, 4, batches=2).policy == "2bw"
    s = make_schedule("1f1b", 3, 2, batches=3, replicas=(2, 1))
    assert (s.p, s.m, s.replicas, s.policy) == (2, 6, (2, 1), "stash")
    assert make_schedule("1f1b", 3, 4, vertical_sync=True).policy == "vertical"
    assert make_schedule("interleaved", 2, 4, chunks=2).v == 2
    for name, kw, match in [("pipedream", {}, "unknown schedule"),
                            ("flush", dict(chunks=2), "chunks=2 is for the interleaved"),
                            ("flush", dict(replicas=(2, 1)), "come with the 1f1b schedule"),
                            ("1f1b", dict(replicas=(2, 2)), "place 4 ranks, but there are 3"),
                            ("gpipe", dict(vertical_sync=True), "vertical_sync is a 1f1b")]:
        with pytest.raises(ValueError, match=match):
            make_schedule(name, 3, 4, **kw)


ONE_RANK_ON_COMM_SELF = """
import torch
from mpi4py import MPI
from mlfabric.pipeline import PipelineExecutor, flush
ex = PipelineExecutor(flush(1, 2), [torch.nn.Linear(3, 2).double()],
                      torch.nn.functional.mse_loss, comm=MPI.COMM_SELF)
x = [torch.randn(2, 3, dtype=torch.float64) for _ in range(2)]
y = [torch.randn(2, 2, dtype=torch.float64) for _ in range(2)]
print("losses", sorted(ex.run(x, y)))
"""


def test_an_executor_on_a_communicator_other_than_the_world():
    # MPI_TAG_UB is an attribute of COMM_WORLD only: on COMM_SELF (or a split) it reads None
    proc = subprocess.run([sys.executable, "-c", ONE_RANK_ON_COMM_SELF], cwd=ROOT, env=mpi_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0 and "losses [0, 1]" in proc.stdout, proc.stdout
