"""The mlfabric.torch timeline's allreduce backends under real mpirun
(tests/mpi_cases/torch_timeline_cases.py): with the shared-memory engine, and without it at 2
ranks (tree, rhd) and 3 (tree, ring)."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n,shm", [(3, "1"), (2, "0"), (3, "0")])
def test_timeline_names_allreduce_backends(n, shm):
    run_cases("torch_timeline_cases", n, timeout=180, env={"MLFABRIC_SHM": shm})
