"""mlfabric.torch.SyncBatchNorm (Horovod's hvd.SyncBatchNorm) under real mpirun: the multi-rank
cases of tests/mpi_cases/torch_sync_bn_cases.py at 1 to 4 ranks; its timeout case alone at 2 and 3."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_torch_sync_bn(n):
    run_cases("torch_sync_bn_cases", n, timeout=180)


@pytest.mark.parametrize("n", [2, 3])
def test_torch_sync_bn_mode_mismatch_times_out(n):
    """A rank in eval mode with no further collective: the training ranks' PeerTimeoutError (a
    timeout leaves mlfabric unusable, so alone in its job, with a short MLFABRIC_TIMEOUT)."""
    run_cases("torch_sync_bn_cases", n, pattern="case_timeout", timeout=120,
              env={"MLFABRIC_TIMEOUT": "3", "SYNC_BN_TIMEOUT_CASE": "1"})
