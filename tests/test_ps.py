"""mlfabric.ps under real mpirun: every training mode against float64 references, delay bounds,
accounting, replicas, bad input (the cases are in tests/mpi_cases/ps_cases.py), at several rank
counts, odd ones included."""
import pytest

from .mpi_util import run_cases


@pytest.mark.mpi
@pytest.mark.parametrize("n", [4, 5, 7])
def test_ps_cases(n):
    run_cases("ps_cases", n, timeout=240)
