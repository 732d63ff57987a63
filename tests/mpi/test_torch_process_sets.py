"""mlfabric.torch's process sets (Horovod's hvd.ProcessSet / add_process_set / process_set=)
under real mpirun: the multi-rank cases of tests/mpi_cases/torch_process_sets_cases.py at 1 to 4
ranks (odd sizes give sets of different sizes)."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_torch_process_sets(n):
    run_cases("torch_process_sets_cases", n, timeout=240)
