"""Horovod's contracts for mlfabric.torch's sparse allreduce handle, DistributedOptimizer's
sparse_as_dense and step() warning, and broadcast_optimizer_state of a fresh optimizer, under
real mpirun: the cases of tests/mpi_cases/torch_optim_conformance_cases.py at 1 to 3 ranks."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_optim_conformance(n):
    run_cases("torch_optim_conformance_cases", n, timeout=240)
