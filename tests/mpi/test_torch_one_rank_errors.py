"""One rank's bad input in a call of mlfabric.torch that the others make with good input: the
cases of tests/mpi_cases/torch_one_rank_errors_cases.py under real mpirun at 1 to 4 ranks. Every rank
must raise promptly (an error naming the bad rank on the others), never wait for the timeout."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_torch_one_rank_errors(n):
    run_cases("torch_one_rank_errors_cases", n, timeout=300)
