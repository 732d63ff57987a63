"""init() on a sub-communicator, finalize() and init() again, and the rank/size queries."""
import numpy as np
import pytest
from mpi4py import MPI

import mlfabric as mf


def case_sub_communicator_then_world():
    world = MPI.COMM_WORLD
    color = world.rank % 2
    sub = world.Split(color, world.rank)
    mf.init(sub)
    assert mf.size() == sub.size and mf.rank() == sub.rank
    assert mf.local_size() == sub.size and mf.local_rank() == sub.rank  # one host here
    got = mf.allreduce(np.array([world.rank], np.int64))
    assert got[0] == sum(r for r in range(world.size) if r % 2 == color)
    if sub.size != world.size:
        with pytest.raises(mf.MlfabricError, match="another communicator"):
            mf.init(MPI.COMM_WORLD)
    mf.finalize()
    assert not mf.initialized()
    sub.Free()
    mf.init()
    assert mf.size() == world.size
    s = mf.shared_zeros(10, np.float32)
    s += 1
    mf.allreduce(s, out=s)
    assert (s == world.size).all()
    mf.finalize()
    mf.init()
