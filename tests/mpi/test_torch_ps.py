"""mlfabric.torch.PSOptimizer under real mpirun at 3, 4 and 5 ranks (cases in
tests/mpi_cases/torch_ps_cases.py): sync = SGD on the concatenated batch (float64, 1e-10), async
accounting and tau_max, misuse refused."""
import pytest

from tests.mpi_util import run_cases

pytest.importorskip("torch")


@pytest.mark.mpi
@pytest.mark.parametrize("n", [3, 4, 5])
def test_torch_ps_cases(n):
    run_cases("torch_ps_cases", n, timeout=180)
