"""Megatron-style tensor parallelism and the scatter/gather of stage outputs
(mlfabric/pipeline/tensor_parallel.py) under real mpirun: tensor-parallel groups of 2 and 3 ranks
and, on 4 ranks, two groups of 2 side by side that also pass stage outputs to each other. The
cases are in mpi_cases/tensor_parallel_cases.py. Nothing here imports mpi4py, so the pytest
process itself never initializes MPI."""
import pytest

from tests.mpi_util import run_cases


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_tensor_parallel(n):
    run_cases("tensor_parallel_cases", n, timeout=120)
