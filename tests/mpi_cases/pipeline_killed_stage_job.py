"""One pipeline job in which a stage is killed mid-training, run under
`mpirun --with-ft ulfm --mca mpi_ft_detector true` by tests/mpi/test_pipeline_errors.py.

usage: python -m tests.mpi_cases.pipeline_killed_stage_job VICTIM WHEN HOW [WAIT_S]
  VICTIM  the rank (= stage) that dies, in the second train_step
  WHEN    forward (in its forward of microbatch 0: its peers wait for it) or step (in its
          optimizer step, its last action: peers may have run all theirs and be agreeing on
          the outcome)
  HOW     sigkill (SIGKILL itself) or exit (os._exit(1))
  WAIT_S  MLFABRIC_TIMEOUT while training (default: as set): a process that exits, rather than
          being killed, is found by ULFM's heartbeat detector only (after its
          mpi_ft_detector_timeout, 10 s by default), so the waits must outlast that

Each survivor must raise StageDiedError (a PipelineTimeoutError, so a PeerTimeoutError and an
MlfabricError) naming the dead rank and its stage and what the survivor was doing, before its
wait ran out (so it is the death that was reported, not a timeout). Every survivor prints
'RESULT ok rank R' or 'RESULT FAIL rank R <why>', then its error as 'ERROR ...'.
"""
import os
import signal
import sys
import time
import traceback

import torch
from mpi4py import MPI

from mlfabric._core import config as _config
from mlfabric.errors import MlfabricError, PeerTimeoutError
from mlfabric.pipeline import flush
from mlfabric.pipeline.executor import PipelineTimeoutError
from mlfabric.pipeline.stage import PipelineModel

from .pipeline_cases import data, layers, loss_fn, sgd

WORLD = MPI.COMM_WORLD
P, R = WORLD.Get_size(), WORLD.Get_rank()


def die(how):
    sys.stdout.flush()
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


class Tripwire(torch.nn.Module):
    """The identity, except that on the victim's rank its third call (microbatch 0 of the
    second run: two microbatches per run) ends the process."""

    def __init__(self, victim, how):
        super().__init__()
        self.victim, self.how, self.calls = victim, how, 0

    def forward(self, x):
        self.calls += 1
        if R == self.victim and self.how and self.calls == 3:
            die(self.how)
        return x


def dying_sgd(victim, how):
    """SGD whose second step ends the process on the victim's rank."""
    def factory(params):
        opt = sgd()(params)
        step, calls = opt.step, []

        def dying_step(*args, **kw):
            calls.append(1)
            if R == victim and len(calls) == 2:
                die(how)
            return step(*args, **kw)
        opt.step = dying_step
        return opt
    return factory


def main():
    victim, when, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    mods = layers(P)
    # piece `victim` gets the tripwire: layers victim and victim + 1, every other piece one
    mods.insert(victim + 1, Tripwire(victim, how if when == "forward" else None))
    cuts = [s + 1 + (s >= victim) for s in range(P - 1)]
    model = PipelineModel(mods, schedule=flush(P, 2), boundaries=cuts, loss_fn=loss_fn,
                          optimizer=dying_sgd(victim, how if when == "step" else None))
    assert isinstance(model.modules[0][-1], Tripwire) == (R == victim)
    x, y = data(4)
    model.train_step(x, y)
    WORLD.Barrier()
    exit_timeout = os.environ.get("MLFABRIC_TIMEOUT")
    if len(sys.argv) > 4:
        os.environ["MLFABRIC_TIMEOUT"] = sys.argv[4]
    wait_s = _config.timeout_s()
    t0 = time.monotonic()
    err = None
    try:
        model.train_step(x, y)
        model.train_step(x, y)
    except Exception as e:  # noqa: BLE001 - judged below
        err, took = e, time.monotonic() - t0
    if exit_timeout is not None:  # the exit's bound (mlfabric._core.exit_guard) as the test set it
        os.environ["MLFABRIC_TIMEOUT"] = exit_timeout
    if err is None:
        print("RESULT FAIL rank %d: no error after rank %d died" % (R, victim), flush=True)
        return
    text = str(err)
    try:
        assert type(err).__name__ == "StageDiedError", "%s: %s" % (type(err).__name__, text)
        assert isinstance(err, PipelineTimeoutError) and isinstance(err, PeerTimeoutError) \
            and isinstance(err, MlfabricError), type(err).__mro__
        assert err.dead == [victim] and err.origin == victim and err.rank == R, \
            (err.dead, err.origin, err.rank)
        assert "rank %d (stage %d) died" % (victim, victim) in text, text
        # what the survivor was doing: an action and what it waited for, or the agreement
        assert "pipeline flush failed on rank %d (stage %d)" % (R, R) in text, text
        assert " waiting for " in text or "agreeing on the outcome" in text, text
        assert "restart the job" in text, text
        assert took < wait_s and "found when the wait ran out" not in text, \
            "took %.1f s: %s" % (took, text)
        print("RESULT ok rank %d (%.2f s)" % (R, took), flush=True)
    except AssertionError:
        print("RESULT FAIL rank %d\n%s" % (R, traceback.format_exc()), flush=True)
    print("ERROR rank %d: %s: %s" % (R, type(err).__name__, text.splitlines()[0]), flush=True)
    # the pipeline is unusable afterwards, with a clear message (and no MPI call)
    try:
        model.train_step(x, y)
    except MlfabricError as e:
        if "unusable after an earlier failure" not in str(e):
            print("RESULT FAIL rank %d: reuse said %s" % (R, e), flush=True)


if __name__ == "__main__":
    main()
