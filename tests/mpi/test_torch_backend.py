"""The torch.distributed backend "mlfabric" (mlfabric/torch/backend.py) under real mpirun at 1, 2
and 3 ranks (its subgroups and all_to_all also at 4): every collective through torch.distributed
against a float64 reference, one rank's bad input as an error on every rank, DDP over mlfabric
against DDP over gloo in the same job (tests/mpi_cases/torch_backend_cases.py)."""
import pytest

from tests.mpi_util import run_cases

pytestmark = pytest.mark.mpi

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_backend(n):
    run_cases("torch_backend_cases", n, timeout=240)


def test_torch_backend_subgroups_of_two_ranks():
    """At 4 ranks the even and odd groups have two ranks each (at 2 and 3, one or two)."""
    run_cases("torch_backend_cases", 4, pattern="subgroups", timeout=180)


def test_torch_backend_all_to_all_at_four_ranks():
    """all_to_all with unequal splits, sizes that disagree, splits that do not fit: at 4 ranks."""
    run_cases("torch_backend_cases", 4, pattern="all_to_all", timeout=180)
