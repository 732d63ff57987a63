"""The control channel (mlfabric.runtime.control) under real mpirun at 2, 3 and 5 ranks: ordered,
counted messages, a gap reported as an error, close() leaving nothing behind for the next job,
and back-to-back jobs under a flood of monitor reports. The cases are in
mpi_cases/control_cases.py."""
import pytest

from tests.mpi_util import run_cases


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 5])
def test_control_channel(n):
    run_cases("control_cases", n, timeout=150)
