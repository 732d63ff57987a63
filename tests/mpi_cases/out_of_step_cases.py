"""Ranks that fall out of step: every call afterwards is an error, on every rank, never a result
made of another call's messages. MLFABRIC_TIMEOUT is 2 s here; the job runs with
MLFABRIC_SHM=0 (the MPI path, as across hosts) and with the shared-memory engine.

- A rank arrives late, after its peers timed out waiting for it: the calls they had queued
  behind the one that timed out and their retries fail at once (not after a timeout each, and
  not on the late rank's messages); the late rank's own calls fail too, its broadcast as root
  included.
- A receive times out: its retry never takes the late sender's message; the sender hears of it.
- A rank fails to allocate a call's result before the call starts: its peers hear of it as a
  rejection (a MismatchError naming it), and the next call is in step again.
- mlfabric.torch: a rank whose call fails after the ranks agreed on it (a MemoryError copying
  the tensor for the wire) tells its peers, which fail at once instead of waiting a timeout.
- Calls on one communicator from two threads at once: a ConcurrentCallError, never a wrong sum.

Each case ends on a fresh context (finalize, init): the one it broke stays unusable by design."""
import os
import threading
import time

import numpy as np
import pytest

import mlfabric as mf
from mlfabric._core import buffers as _buffers
from mlfabric.comm import collectives

from .common import setup  # noqa: F401

T = float(os.environ.get("MLFABRIC_TIMEOUT", "2"))


def _fresh():
    mf.finalize()
    mf.init()


def _calls(r, n, late):
    """Calls of every kind, each (name, fn): what a rank retries after an error."""
    return [
        ("allreduce", lambda: mf.allreduce(np.full(1000, 100.0 * (r + 1)))),
        ("broadcast", lambda: mf.broadcast(np.full(10, float(r)), root=late)),
        ("allgather", lambda: mf.allgather(np.full(3, float(r)))),
        ("reduce", lambda: mf.reduce(np.full(5, 1.0), root=0)),
        ("reduce_scatter", lambda: mf.reduce_scatter(np.ones((2 * n, 2)))),
        ("barrier", mf.barrier),
        ("alltoall", lambda: mf.alltoall(np.ones((n, 2)))),
    ]


def case_a_late_rank_meets_errors_not_stale_messages():
    n, r = mf.size(), mf.rank()
    late = n - 1
    try:
        if r == late:
            time.sleep(2 * T)  # its peers give up on the first call at T
            for name, call in [("allreduce", lambda: mf.allreduce(np.full(1000, 1.0 + r)))] + \
                    _calls(r, n, late):
                t0 = time.monotonic()
                with pytest.raises(mf.PeerTimeoutError):
                    got = call()
                    print(f"rank {r}: late {name} returned {got!r}", flush=True)
                assert time.monotonic() - t0 < T + 1.5, (name, time.monotonic() - t0)
            return
        first = mf.allreduce_async(np.full(1000, 1.0 + r))
        queued = [mf.allreduce_async(np.full(1000, 10.0 + r)),
                  mf.broadcast_async(np.zeros(10), root=late),
                  mf.allgather_async(np.full(2, float(r)))]
        with pytest.raises(mf.PeerTimeoutError, match="no progress|timed out"):
            first.wait()
        t0 = time.monotonic()
        for h in queued:  # behind the call that timed out: none runs, none waits a bound again
            with pytest.raises(mf.PeerTimeoutError, match="unusable"):
                h.wait()
        for name, call in _calls(r, n, late):
            with pytest.raises(mf.PeerTimeoutError, match="unusable"):
                call()
        assert time.monotonic() - t0 < T, time.monotonic() - t0
    finally:
        _fresh()


def case_a_retried_receive_never_takes_the_late_message():
    n, r = mf.size(), mf.rank()
    try:
        if r == 1:
            time.sleep(1.5 * T)
            with pytest.raises(mf.PeerTimeoutError, match="gave up|unusable"):
                # rank 0's notice is here by now (on one host, at once): had it not been
                # heard, the first send would complete (eager), and nobody receive it
                mf.send(np.full(4, 7.0), 0)
                mf.send(np.full(4, 8.0), 0)
                mf.barrier()
        elif r == 0:
            x = np.zeros(4)
            with pytest.raises(mf.PeerTimeoutError, match="no progress"):
                mf.recv(x, 1)
            time.sleep(T)  # the late message is here by now
            with pytest.raises(mf.PeerTimeoutError, match="unusable"):
                mf.recv(x, 1)
            assert (x == 0).all(), x
    finally:
        _fresh()


class _NoMemory:
    """numpy, and mlfabric's buffer module, on a rank where every new array is a MemoryError."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def empty_like(self, *args, **kwargs):
        raise MemoryError("no memory for the result (this test)")


def case_a_result_that_cannot_be_allocated_is_a_rejection():
    n, r = mf.size(), mf.rank()
    x = np.full(1000, 1.0 + r)
    want = np.full(1000, n * (n + 1) / 2)
    for attempt in range(2):
        if r == 0:
            saved = collectives.np, collectives._buffers
            collectives.np, collectives._buffers = _NoMemory(np), _NoMemory(_buffers)
            try:
                with pytest.raises(MemoryError):
                    mf.allreduce(x)
            finally:
                collectives.np, collectives._buffers = saved
        else:
            with pytest.raises(mf.MismatchError, match=r"rank\(s\) \[0\]"):
                mf.allreduce(x)
        np.testing.assert_array_equal(mf.allreduce(x), want)  # in step again


def case_calls_from_two_threads_at_once_are_an_error():
    n, r = mf.size(), mf.rank()
    start = threading.Barrier(2)
    errors, wrong = [], []

    def loop(k):
        x = np.full(64, (k + 1) * (r + 1.0))
        want = (k + 1) * n * (n + 1) / 2
        start.wait()
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            try:
                got = mf.allreduce(x)
            except mf.MlfabricError as exc:  # this thread's call met the other's (see
                # ConcurrentCallError), or a peer's engine reports that failure
                errors.append(exc)
                return
            if not (got == want).all():
                wrong.append(got[0])
    try:
        threads = [threading.Thread(target=loop, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10 * T)
        assert not any(t.is_alive() for t in threads)
        assert not wrong, f"{len(wrong)} wrong sums, e.g. {wrong[:3]}"
        assert errors, "two threads called allreduce at once for 2 s and nothing was raised"
        assert any(isinstance(e, mf.ConcurrentCallError) for e in errors) or \
            any("gave up" in str(e) or "unusable" in str(e) for e in errors), errors
    finally:
        _fresh()


def case_a_torch_call_failing_after_its_control_round_tells_the_peers():
    import torch

    import mlfabric.torch as hvd
    from mlfabric.torch import ops
    hvd.init()
    n, r = mf.size(), mf.rank()
    x = torch.full((1000,), 1.0 + r)
    saved = ops._wire_copy

    def no_memory(*args):
        raise MemoryError("no memory for the wire copy (this test)")
    try:
        torch.testing.assert_close(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0),
                                   torch.full((1000,), float(n * (n + 1))))
        if r == 0:
            ops._wire_copy = no_memory
        t0 = time.monotonic()
        with pytest.raises(MemoryError if r == 0 else mf.MlfabricError,
                           match="wire copy" if r == 0 else "rank 0|gave up"):
            hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0)
        assert time.monotonic() - t0 < T, time.monotonic() - t0  # told, not timed out
        with pytest.raises(mf.MlfabricError, match="unusable|gave up"):
            hvd.allreduce(x, op=hvd.Sum)
    finally:
        ops._wire_copy = saved
        hvd.shutdown()
        _fresh()
