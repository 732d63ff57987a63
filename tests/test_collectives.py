"""The public collectives under real mpirun at 1, 2, 3 and 4 ranks (tests/mpi_cases/)."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives(n):
    run_cases("collectives_cases", n, timeout=600)
