"""Pipeline errors that involve several ranks, under real mpirun:

- ranks that build different models or schedules (different cuts, layer counts, layer shapes,
  microbatch counts) get MismatchError on every rank at construction, naming what differs and
  which ranks passed what (tests/mpi_cases/pipeline_errors_cases.py, at 2, 3 and 5 ranks);
- a stage killed mid-training (SIGKILL, or os._exit) under ULFM: every survivor raises
  StageDiedError naming the dead rank and stage and what it was doing, promptly, and exits
  (tests/mpi_cases/pipeline_killed_stage_job.py).

Single process: a layer's signature and the wording of a disagreement.
"""
import re

import pytest

from tests.mpi_util import run_cases, run_mpi

pytest.importorskip("torch")

ULFM = ("--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true")


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 5])
def test_ranks_that_build_different_models_fail_on_every_rank(n):
    out = run_cases("pipeline_errors_cases", n, timeout=180)
    assert "pipeline_errors_cases: 6 passed, 0 failed" in out, out


@pytest.mark.mpi
@pytest.mark.parametrize("n, victim, when, how", [
    (2, 1, "forward", "sigkill"),   # the last stage: the first waits for its gradient
    (3, 1, "forward", "sigkill"),   # a middle stage: both neighbours wait for it
    (3, 1, "step", "sigkill"),      # in its last action: the others may be agreeing
    (4, 0, "forward", "sigkill"),   # the first stage
    (5, 2, "step", "exit"),         # by os._exit(1)
])
def test_a_killed_stage_is_named_on_every_survivor(n, victim, when, how):
    # a process that exits (rather than being killed) is found by ULFM's heartbeat detector only,
    # after mpi_ft_detector_timeout (10 s by default; shorter ones misfire on a loaded host): the
    # waits while training outlast it there. SIGKILL is reported at once.
    wait_s = ["30"] if how == "exit" else []
    proc = run_mpi(n, ["-m", "tests.mpi_cases.pipeline_killed_stage_job", str(victim), when, how,
                       *wait_s], timeout=180, env={"MLFABRIC_TIMEOUT": "10"}, mpirun_args=ULFM)
    out = proc.stdout
    assert "RESULT FAIL" not in out, out
    assert out.count("RESULT ok") == n - 1, out  # every survivor, and only survivors
    for r in range(n):
        if r != victim:
            assert "ERROR rank %d: StageDiedError: " % r in out, out
    if how == "sigkill":  # promptly
        took = [float(t) for t in re.findall(r"RESULT ok rank \d+ \(([\d.]+) s\)", out)]
        assert len(took) == n - 1 and max(took) < 5, out


# --- single process -------------------------------------------------------------------------------

def test_layer_signature_names_class_submodules_shapes_dtypes():
    import torch
    from mlfabric.pipeline.stage import layer_signature
    seq = torch.nn.Sequential(torch.nn.Linear(5, 6).double(), torch.nn.Tanh())
    assert layer_signature(seq) == \
        "Sequential[Linear, Tanh](0.weight 6x5 float64, 0.bias 6 float64)"
    bn = torch.nn.BatchNorm1d(3)
    bn.weight.requires_grad_(False)
    assert layer_signature(bn) == (
        "BatchNorm1d(weight 3 float32 frozen, bias 3 float32, running_mean 3 float32 buffer, "
        "running_var 3 float32 buffer, num_batches_tracked scalar int64 buffer)")
    assert layer_signature(torch.nn.LazyLinear(3)) == \
        "LazyLinear(weight uninitialized, bias uninitialized)"


def test_disagreement_names_each_field_that_differs_and_who_passed_what():
    from mlfabric.pipeline.executor import _disagreement
    sched = ["the schedule", "schedule flush p=3 m=2", None]
    per_rank = [[sched, ["the cuts", [1, 2], None], ["the layers", ["A", "B", "C"], "layer"]],
                [sched, ["the cuts", [1, 2], None], ["the layers", ["A", "X", "C"], "layer"]],
                [sched, ["the cuts", [2, 3], None], ["the layers", ["A", "B", "C"], "layer"]]]
    text = _disagreement(per_rank)
    assert text.startswith("pipeline construction: ranks disagree on the cuts: [1, 2] on "
                           "rank(s) [0, 1]; [2, 3] on rank(s) [2]\n"
                           "ranks disagree on the layers (first at layer 1): B on rank(s) "
                           "[0, 2]; X on rank(s) [1]\n"), text
    assert "schedule" not in text.splitlines()[0] and "broadcast" in text, text
    # a field one rank did not give at all
    text = _disagreement([[sched], [sched, ["the cuts", [1], None]]])
    assert "ranks disagree on the cuts: (not given) on rank(s) [0]; [1] on rank(s) [1]" in text
