"""The public collectives under real mpirun at 1, 2, 3 and 4 ranks (tests/mpi_cases/), on
MPI_COMM_WORLD and on communicators derived from it."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives(n):
    run_cases("collectives_cases", n, timeout=600)


@pytest.mark.parametrize("comm,n", [("dup", 3), ("split", 5)])
def test_collectives_on_a_derived_communicator(comm, n):
    # The same cases on a duplicate of MPI_COMM_WORLD, and on a split into two groups (ranks in
    # reverse order) that run side by side: 5 ranks give groups of 3 and 2.
    run_cases("collectives_cases", n, timeout=600, env={"MLFABRIC_TEST_COMM": comm})


@pytest.mark.parametrize("n", [2])
def test_allreduce_staged_path_only(n):
    # The single-copy path (two ranks, 2-64 MiB) off: those calls take the staged pipeline.
    run_cases("collectives_cases", n, pattern="case_allreduce", timeout=300,
              env={"MLFABRIC_CMA_MAX": "0"})


@pytest.mark.parametrize("n", [2])
def test_allreduce_small_pipeline_steps(n):
    # Tiny blocks and the fewest slots: every call wraps around the staging slots many times.
    run_cases("collectives_cases", n, pattern="case_allreduce", timeout=300,
              env={"MLFABRIC_SHM_BLOCK": "4096", "MLFABRIC_SHM_SLOTS": "2", "MLFABRIC_CMA_MAX": "0"})


@pytest.mark.parametrize("n", [3])
def test_allreduce_single_copy_path(n):
    # With more than two ranks the single-copy path only takes calls over 64 MiB by default;
    # lowered here so the cases' large calls go through it (where the kernel allows it).
    run_cases("collectives_cases", n, pattern="case_allreduce", timeout=300,
              env={"MLFABRIC_CMA_MIN": "65536"})
