"""init/finalize on sub-communicators under real mpirun."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 3, 4])
def test_init_finalize(n):
    run_cases("init_cases", n, timeout=120)
