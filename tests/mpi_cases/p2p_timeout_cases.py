"""Receives nobody serves in time (MLFABRIC_TIMEOUT is 2 s in the harness): the torch backend's
p2p futures fail within the bound without holding up collectives; an irecv whose sender comes
too late raises PeerTimeoutError, and the late message is never written into the receiver's
array (both of the receive's requests are cancelled, not only the one waited on), nor taken by
a retry: after a timeout the communicator is unusable on every rank (the late sender's next call
fails too). Each case ends on a fresh context (finalize, init)."""
import time

import numpy as np
import pytest
from mpi4py import MPI

import mlfabric as mf

from .common import setup  # noqa: F401


def _fresh():
    mf.finalize()
    mf.init()


def case_torch_receive_futures_nobody_serves_fail_within_the_bound():
    """The torch backend's p2p futures (completed by one polling thread) of receives nobody
    serves fail with PeerTimeoutError about MLFABRIC_TIMEOUT after they were asked for, and
    meanwhile a collective's future completes (they hold none of the threads it needs)."""
    import os

    import torch
    import torch.distributed as dist

    import mlfabric.torch  # noqa: F401 - registers the backend
    from mlfabric.torch import backend
    n, r = mf.size(), mf.rank()
    for var in backend._ENV_VARS:
        os.environ.pop(var, None)
    dist.init_process_group("mlfabric")
    try:
        futs = []
        if r == 1:
            futs = [dist.irecv(torch.zeros(2), 0, tag=100 + i).get_future() for i in range(40)]
        t0 = time.monotonic()
        t = torch.ones(3)
        dist.all_reduce(t, async_op=True).get_future().wait()
        assert (t == n).all() and time.monotonic() - t0 < 1.5, time.monotonic() - t0
        for f in futs:
            with pytest.raises(mf.PeerTimeoutError, match="recv from rank 0"):
                f.wait()
        assert time.monotonic() - t0 < 3 * 2 + 2  # one bound (2 s), not one per receive
    finally:
        dist.destroy_process_group()
        _fresh()


def case_torch_work_wait_timeout_bounds_a_receive():
    """torch's Work.wait(timeout), shorter than MLFABRIC_TIMEOUT, ends a receive nobody serves
    at that bound: PeerTimeoutError naming it; the Work is then complete, its error kept, and
    the message sent later (once rank 1 says so: no race with the bound) is never written into
    the tensor. A receive served in time returns, also when its timeout is longer than
    MLFABRIC_TIMEOUT (that bound stays in force then)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import mlfabric.torch  # noqa: F401 - registers the backend
    from mlfabric.torch import backend
    n, r = mf.size(), mf.rank()
    for var in backend._ENV_VARS:
        os.environ.pop(var, None)
    dist.init_process_group("mlfabric")
    try:
        if r == 0:
            dist.send(torch.full((4,), 5.0), 1, tag=7)
            MPI.COMM_WORLD.recv(source=1, tag=9)   # rank 1's receive has timed out by now
            # rank 1 gave up on the communicator: this rank hears of it at its next call
            with pytest.raises(mf.PeerTimeoutError, match="gave up|unusable"):
                dist.isend(torch.full((4,), 9.0), 1, tag=8).wait()
        elif r == 1:
            got = torch.zeros(4)
            assert dist.irecv(got, 0, tag=7).wait(timedelta(seconds=10))
            assert (got == 5.0).all(), got
            late = torch.zeros(4)
            work = dist.irecv(late, 0, tag=8)
            with pytest.raises(mf.PeerTimeoutError, match=r"within 0\.2 s \(Work.wait's timeout\)"):
                work.wait(timedelta(milliseconds=200))
            assert work.is_completed()
            with pytest.raises(mf.PeerTimeoutError, match="recv from rank 0"):
                work.wait()
            MPI.COMM_WORLD.send(None, dest=0, tag=9)   # only now may rank 0 send the late message
            time.sleep(1.5)   # had it been sent, it would be here by now
            with pytest.raises(mf.PeerTimeoutError, match="unusable"):   # a retry neither
                dist.recv(late, 0, tag=8)
            assert not late.any(), late
    finally:
        dist.destroy_process_group()
        _fresh()


def case_late_sender_never_writes_after_a_timeout():
    n, r = mf.size(), mf.rank()
    try:
        if r == 0:
            time.sleep(3)  # past rank 1's bound: rank 1 gave up on the communicator
            with pytest.raises(mf.PeerTimeoutError, match="gave up|unusable"):
                mf.isend(np.full(8, 7.0), 1, tag=1).wait()
        elif r == 1:
            x = np.zeros(8)
            with pytest.raises(mf.PeerTimeoutError, match="recv from rank 0"):
                mf.irecv(x, 0, tag=1).wait()
            time.sleep(2)  # a late message would have come by now
            with pytest.raises(mf.PeerTimeoutError, match="unusable"):
                mf.recv(x, 0, tag=1)
            assert not x.any(), x
    finally:
        _fresh()


def case_a_receive_has_one_bound_for_header_and_payload():
    """A receive waits for the sender's header, then its payload, within one bound for both:
    a header that comes late (rank 0 sends only the header, 1 s after rank 1 began waiting)
    leaves the payload the rest of the bound, not a bound of its own. Both the default bound
    (MLFABRIC_TIMEOUT, 2 s here) and Request.wait(timeout) (torch's Work.wait(timeout)): each
    ends about its bound after the wait began, where one bound per phase ended 1 s later."""
    from mlfabric.comm import collectives as coll
    from mlfabric.comm import context
    n, r = mf.size(), mf.rank()
    go = np.zeros(1)
    took = {}   # checked once both rounds are done: rank 0 waits for each round's go
    for tag, timeout in ((3, None), (4, 1.5)):
        comm = context.get().comm  # each round on a fresh context: a timeout ends one
        if r == 0:
            comm.Recv(go, 1, coll._user_tag(10 + tag))   # rank 1 is waiting now
            time.sleep(1.0)
            header = coll._meta_of(coll._buffers.wrap(np.zeros(8)), 0)
            comm.Send(header, 1, coll._user_tag(tag))   # the payload never comes
        elif r == 1:
            x = np.zeros(8)
            req = mf.irecv(x, 0, tag=tag)
            comm.Send(go, 0, coll._user_tag(10 + tag))
            t0 = time.monotonic()
            with pytest.raises(mf.PeerTimeoutError, match="recv from rank 0"):
                req.wait(timeout)
            took[2.0 if timeout is None else timeout] = time.monotonic() - t0
        _fresh()
    for bound, t in took.items():
        assert bound - 0.1 <= t < bound + 0.6, took   # one bound per phase: bound + 1 s
