"""Ranks out of step with their peers (a late rank, a timed-out receive, a failed allocation,
calls from two threads at once) get errors on every rank, never a result made of another call's
messages: tests/mpi_cases/out_of_step_cases.py under real mpirun, on the MPI path and on the
shared-memory engine."""
import pytest

from tests.mpi_util import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("shm", ["0", "1"])
@pytest.mark.parametrize("n", [2, 3])
def test_out_of_step_ranks_get_errors(n, shm):
    proc = run_mpi(n, ["-m", "tests.mpi_cases.runner", "out_of_step_cases"], timeout=240,
                   env={"MLFABRIC_TIMEOUT": "2", "MLFABRIC_SHM": shm})
    assert "out_of_step_cases: 5 passed, 0 failed" in proc.stdout, proc.stdout
    # A job that had a timeout may end without MPI_Finalize (a request the timeout abandoned can
    # hold it up): then the exit is bounded, said on stderr, and mpirun reports a failure.
    assert proc.returncode == 0 or "exit not done" in proc.stdout, proc.stdout
