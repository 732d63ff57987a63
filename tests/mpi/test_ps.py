"""mlfabric.ps under real mpirun: every training mode against float64 references, delay bounds,
accounting, replicas, bad input (the cases are in tests/mpi_cases/ps_cases.py), at several rank
counts, odd ones included."""
import pytest

from tests.mpi_util import run_cases, run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("n", [4, 5, 7])
def test_ps_cases(n):
    run_cases("ps_cases", n, timeout=240)


INIT_ALONE = """
import time, mlfabric
from mpi4py import MPI
from mlfabric import ps
if MPI.COMM_WORLD.rank == 0:
    t0 = time.monotonic()
    try:
        ps.init()
    except mlfabric.PeerTimeoutError as e:
        print("TIMEOUT %.1f %s" % (time.monotonic() - t0, e), flush=True)
    else:
        print("NO ERROR", flush=True)
else:
    time.sleep(4)  # never calls ps.init
"""


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_ps_init_on_one_rank_alone_times_out(n):
    """ps.init is collective; a rank calling it where the others never do (or a second time on
    its own) gets a PeerTimeoutError within MLFABRIC_TIMEOUT (its agreement round is an MPI
    allgather on the user's communicator, which used to wait forever); the job still ends."""
    proc = run_mpi(n, ["-c", INIT_ALONE], timeout=90, env={"MLFABRIC_TIMEOUT": "2"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith(("TIMEOUT", "NO ERROR"))),
                None)
    assert line is not None and line.startswith("TIMEOUT"), proc.stdout
    waited = float(line.split()[1])
    assert 1.5 < waited < 10, line
    assert f"not every rank of its communicator ({n} ranks) called init() within " \
           "MLFABRIC_TIMEOUT=2s" in line, line
