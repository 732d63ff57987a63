"""The scaling of mlfabric.torch's reductions as Horovod's (integer Average and factors, float16
through float32, every form and a joined rank), reducescatter's gradient conventions and
errors, under real mpirun: tests/mpi_cases/torch_scaling_cases.py at 1 to 3 ranks."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_scaling(n):
    run_cases("torch_scaling_cases", n, timeout=300)
