"""mlfabric.comm.algorithms under real mpirun at 1-5 ranks; the cases (every algorithm x op x
dtype, roots, allgather, reduce-scatter, dispatch errors, bounded waits) are in
mpi_cases/algorithms_cases.py.
Nothing here imports mpi4py, so the pytest process itself never initializes MPI."""
import pytest

from tests.mpi_util import run_cases


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_algorithms(n):
    run_cases("algorithms_cases", n, timeout=120)
