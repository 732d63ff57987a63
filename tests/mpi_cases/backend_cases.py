"""Multi-rank cases for allreduce's backend choice (comm.collectives.BACKENDS): chosen_backend()
names what a call takes (the engine on one host, else an MPI algorithm by size, or the one
named), allreduce gives the same result on every backend, and an unknown algorithm= on one rank
is that rank's UnknownBackendError and a MismatchError naming it everywhere else. Run with
MLFABRIC_SHM=1 and =0 by tests/mpi/test_backends.py."""
import numpy as np
import pytest

import mlfabric as mf
from mlfabric.comm import algorithms, collectives as coll

from .common import setup  # noqa: F401


def case_auto_choice_and_named_ones():
    n, r = mf.size(), mf.rank()
    shm = coll.context.get().shm is not None
    for count in (2, 1000, 300_000):
        x = np.full(count, 1.0 + r, np.float32)
        want = "shm" if shm else algorithms.choose_allreduce(x.nbytes, n)
        assert coll.chosen_backend(x) == want, (count, coll.chosen_backend(x), want)
        expect = np.full(count, n * (n + 1) / 2, np.float32)
        for algorithm in ("auto", "ring", "rhd", "tree") + (("shm",) if shm else ()):
            assert coll.chosen_backend(x, algorithm) == (want if algorithm == "auto"
                                                         else algorithm)
            np.testing.assert_array_equal(mf.allreduce(x, algorithm=algorithm), expect)
    if not shm:
        with pytest.raises(mf.MlfabricError, match="algorithm='shm' needs every rank"):
            coll.chosen_backend(np.ones(2), "shm")


def case_unknown_algorithm_on_one_rank():
    n, r = mf.size(), mf.rank()
    bad = n - 1
    x = np.ones(4)
    if r == bad:
        with pytest.raises(coll.UnknownBackendError, match="unknown algorithm 'butterfly'; "
                           "expected one of auto, nccl, shm, tree, rhd, ring"):
            mf.allreduce(x, algorithm="butterfly")
    elif n > 1:
        with pytest.raises(mf.MismatchError, match=rf"rank\(s\) \[{bad}\] rejected"):
            mf.allreduce(x)
    np.testing.assert_array_equal(mf.allreduce(x), np.full(4, float(n)))  # in step again
