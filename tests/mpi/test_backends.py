"""The allreduce backend table (comm.collectives.BACKENDS), one process, no MPI job: its order,
the choice algorithm='auto' makes for each kind of call (the same as the size rules of
comm.algorithms.choose_allreduce), and the errors of a named backend that cannot take a call."""
import logging
from types import SimpleNamespace

import pytest

from mlfabric.comm import algorithms, collectives as coll
from mlfabric.errors import MlfabricError


def _call(nbytes=8, size=2, shm=False, gpu=False):
    """_choose's (ctx, xb, gpu) for a call of nbytes on size ranks."""
    ctx = SimpleNamespace(shm=object() if shm else None, size=size)
    xb = SimpleNamespace(nbytes=nbytes, count=nbytes // 4, code=0)
    return ctx, xb, () if gpu else None


def test_order_and_names():
    assert [b.name for b in coll.BACKENDS] == ["nccl", "shm", "tree", "rhd", "ring"]
    assert coll.ALGORITHMS == ("auto", "nccl", "shm", "tree", "rhd", "ring")


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8, 64])
def test_auto_over_mpi_follows_the_size_rules(size):
    for nbytes in (0, 8, 2048, 2049, 16 << 10, (16 << 10) + 1, 1 << 20, 4 << 20, (4 << 20) + 1,
                   1 << 30):
        chosen = coll._choose(*_call(nbytes, size), "auto").name
        assert chosen == algorithms.choose_allreduce(nbytes, size), (nbytes, size)


def test_auto_takes_nccl_for_gpu_arrays_and_the_engine_on_one_host():
    assert coll._choose(*_call(gpu=True), "auto").name == "nccl"
    assert coll._choose(*_call(gpu=True, shm=True), "auto").name == "nccl"
    for nbytes in (8, 1 << 30):
        assert coll._choose(*_call(nbytes, shm=True), "auto").name == "shm"


def test_a_named_mpi_algorithm_runs_whatever_the_size():
    for name in ("ring", "rhd", "tree"):
        for nbytes in (8, 1 << 30):
            assert coll._choose(*_call(nbytes, 3), name).name == name
            assert coll._choose(*_call(nbytes, 3, shm=True), name).name == name


@pytest.mark.parametrize("bad", ["butterfly", None, "", ["ring"], "AUTO"])
def test_an_unknown_name_lists_the_known_ones(bad):
    with pytest.raises(MlfabricError, match="unknown algorithm") as info:
        coll._choose(*_call(), bad)
    assert isinstance(info.value, ValueError)
    for name in coll.ALGORITHMS:
        assert name in str(info.value)


def test_a_named_backend_that_cannot_take_the_call():
    with pytest.raises(MlfabricError, match="algorithm='shm' needs every rank on one host"):
        coll._choose(*_call(), "shm")
    with pytest.raises(ValueError, match="algorithm='nccl' moves GPU arrays"):
        coll._choose(*_call(shm=True), "nccl")
    for name in ("shm", "ring", "rhd", "tree"):
        with pytest.raises(ValueError, match="GPU arrays move over NCCL"):
            coll._choose(*_call(gpu=True, shm=True), name)
    assert coll._choose(*_call(gpu=True), "nccl").name == "nccl"


def test_the_choice_is_logged_at_debug_level(caplog):
    with caplog.at_level(logging.DEBUG, logger="mlfabric"):
        coll._choose(*_call(1 << 20, 4), "auto")
    assert any("rhd" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlfabric"):
        coll._choose(*_call(1 << 20, 4), "auto")
    assert not caplog.records


@pytest.mark.mpi
@pytest.mark.parametrize("n,shm", [(2, "1"), (3, "0")])
def test_backend_choice_under_mpirun(n, shm):
    from tests.mpi_util import run_cases
    run_cases("backend_cases", n, timeout=300, env={"MLFABRIC_SHM": shm})
