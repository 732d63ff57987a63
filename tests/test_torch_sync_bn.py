"""mlfabric.torch.SyncBatchNorm (Horovod's hvd.SyncBatchNorm) under real mpirun: the multi-rank
cases of tests/mpi_cases/torch_sync_bn.py at 1 to 4 ranks."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_torch_sync_bn(n):
    run_cases("torch_sync_bn", n, timeout=180)
