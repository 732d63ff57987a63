"""Multi-rank cases run with a small /dev/shm (tests/mpi/test_small_shm.py mounts a 64 MiB tmpfs there,
Docker's default): a shared allocation that does not fit is an error on every rank naming /dev/shm
and how to enlarge it, the job goes on afterwards, owners that can do without shared memory fall
back to private memory, and nothing waits unboundedly.

`python -m tests.mpi_cases.small_shm_cases mpi-fails` (not a case: its job cannot end cleanly)
makes MPI's allocation fail on one rank after the ranks agreed there was room (the free space
misread as plenty): that rank gets ShmAllocError, and its finalize() and exit stay bounded."""
import os
import sys
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import mlfabric as mf
from mlfabric.comm import context
from mlfabric.comm import shm

from .common import torch


def setup():
    mf.init()
    if torch is not None:
        torch.set_num_threads(1)  # the ranks share the machine's cores


def _free():
    return shm.free_bytes(shm.backing_dir())


def _expect_space_error(fn):
    """fn() raises ShmSpaceError, an MlfabricError naming /dev/shm and how to get room."""
    with pytest.raises(mf.MlfabricError) as info:
        fn()
    assert isinstance(info.value, shm.ShmSpaceError), repr(info.value)
    msg = str(info.value)
    for needle in ("/dev/shm", "free", "--shm-size", "MLFABRIC_SHM=0"):
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def _still_works(x=None):
    n = mf.size()
    assert (mf.allreduce(np.ones(1000)) == n).all()
    small = mf.shared_zeros(1000)
    assert mf.is_shared(small)
    small[:] = mf.rank() + 1
    mf.allreduce(small, out=small)
    assert (small == n * (n + 1) / 2).all()


def case_setup_is_what_the_test_means():
    assert context.get().shm is not None, "the engine's segment should fit in 64 MiB"
    assert 0 < _free() <= 64 << 20, f"/dev/shm has {_free()} bytes free: not the small tmpfs"


def case_too_large_is_an_error_on_every_rank():
    # a 16M-parameter model's gradients (64 MiB per rank): more than /dev/shm holds
    msg = _expect_space_error(lambda: mf.shared_empty(16 << 20, np.float32))
    assert "shared_empty" in msg and f"{mf.size()} ranks x 64.0 MiB" in msg, msg
    if torch is not None:
        _expect_space_error(lambda: mf.shared_empty((4096, 4096), torch.float32))
    _still_works()


def case_space_is_taken_when_allocated():
    # Two buffers that each fit in what is free, but not both: the first takes its space at
    # once, so the second is refused (not both granted and the job killed by SIGBUS as they are
    # written); the first stays fully usable.
    n = mf.size()
    free = MPI.COMM_WORLD.allreduce(_free(), op=MPI.MIN)
    each = int(free * 0.55) // n // 8
    x = mf.shared_empty(each, np.float64)
    assert mf.is_shared(x)
    if tuple(map(int, os.uname().release.split(".")[:2])) < (5, 14):
        x[:] = 0  # no MADV_POPULATE_WRITE before Linux 5.14: the space is taken as it is written
    taken = free - MPI.COMM_WORLD.allreduce(_free(), op=MPI.MIN)
    assert taken >= n * each * 8, (taken, n * each * 8)
    _expect_space_error(lambda: mf.shared_empty(each, np.float64))
    x[:] = mf.rank() + 1.0
    y = mf.allreduce(x)
    assert y[0] == n * (n + 1) / 2 and y[-1] == y[0]
    _still_works()


def case_distributed_optimizer_falls_back_to_private_buckets():
    if torch is None:
        return  # (pytest.skip would end the rank, not the case)
    import mlfabric.torch as hvd
    n, r = mf.size(), mf.rank()
    model = torch.nn.Linear(4096, 4096)  # 16.8M parameters: 64 MiB of gradients per rank
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters())
    said = [str(w.message) for w in seen if "gradient buckets" in str(w.message)]
    if r == 0:
        assert said and "/dev/shm" in said[0] and "--shm-size" in said[0], \
            [str(w.message) for w in seen]
    assert not any(mf.is_shared(b.flat) for b in opt._mlf_buckets)
    x = torch.full((1, 4096), float(r + 1))
    model(x).sum().backward()
    opt.step()
    want = (n + 1) / 2  # d sum(Wx + b) / dW = x, averaged over the ranks
    assert torch.allclose(model.weight.grad, torch.full_like(model.weight.grad, want))
    assert torch.allclose(model.bias.grad, torch.ones_like(model.bias.grad))
    del opt
    _still_works()


def case_no_room_for_the_engine_runs_on_the_mpi_path():
    # open_transport() on a host whose /dev/shm cannot hold the engine's segment (64 MiB
    # pipeline blocks: over 256 MiB per rank): None on every rank, and a warning naming it
    comm = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    before = os.environ.get("MLFABRIC_SHM_BLOCK")
    os.environ["MLFABRIC_SHM_BLOCK"] = str(64 << 20)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = shm.open_transport(comm)
    finally:
        if before is None:
            del os.environ["MLFABRIC_SHM_BLOCK"]
        else:
            os.environ["MLFABRIC_SHM_BLOCK"] = before
    assert got is None
    said = [str(w.message) for w in seen]
    if comm.rank == 0:
        assert any("without shared memory" in s and "/dev/shm" in s for s in said), said
    comm.Free()
    _still_works()


def case_init_with_no_room_for_the_engine_does_not_hang():
    # last: re-initialises. Without room for the engine's segment init() either runs without
    # shared memory or raises ShmSpaceError, the same on every rank; then init works again.
    mf.finalize()
    os.environ["MLFABRIC_SHM_BLOCK"] = str(64 << 20)
    try:
        try:
            mf.init()
        except shm.ShmSpaceError as exc:
            assert "/dev/shm" in str(exc) and "MLFABRIC_SHM=0" in str(exc), str(exc)
            outcome = "error"
        else:
            assert context.get().shm is None
            assert (mf.allreduce(np.ones(10)) == mf.size()).all()
            mf.finalize()
            outcome = "fallback"
    finally:
        del os.environ["MLFABRIC_SHM_BLOCK"]
    outcomes = MPI.COMM_WORLD.allgather(outcome)
    assert len(set(outcomes)) == 1, outcomes
    mf.init()
    assert context.get().shm is not None
    _still_works()


def mpi_fails():
    """See the module's docstring: rank 0 says what it got, then finalize() must return."""
    mf.init()
    shm.free_bytes = lambda path: 1 << 50  # the check passes; Open MPI's own then fails
    rank = mf.rank()
    try:
        mf.shared_empty(16 << 20, np.float32)
    except mf.MlfabricError as exc:
        print(f"rank {rank}: {type(exc).__name__}: {exc}", flush=True)
    mf.finalize()
    print(f"rank {rank}: finalized", flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["mpi-fails"]:
    mpi_fails()
