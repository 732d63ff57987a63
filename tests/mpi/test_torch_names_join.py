"""mlfabric.torch's async calls issued in different orders (matched as Horovod matches names),
names in flight, and allgather / alltoall / broadcast beside a joined rank, under real mpirun:
the cases of tests/mpi_cases/torch_names_join_cases.py at 1 to 3 ranks."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_names_join(n):
    run_cases("torch_names_join_cases", n, timeout=240)
