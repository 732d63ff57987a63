"""Bounded-wait point-to-point messaging for mlfabric's collective algorithms over MPI.

Owns: the tag those algorithms use, the split of a byte range into messages (segments), posting
non-blocking sends/receives on byte views of the caller's arrays, and the one wait they all go
through. That wait polls until a deadline of MLFABRIC_TIMEOUT seconds (mlfabric._config.timeout_s())
and then raises PeerTimeoutError naming the operation and the ranks it was still waiting on, so a
dead or diverged peer becomes an error instead of a hang.

Contract: posting is non-blocking and copies nothing: the caller owns the buffers and must not touch
a buffer until the wait on its request has returned. After a timeout the unfinished receives are
cancelled and every unfinished request (with the buffer it holds) is parked here for the life of the
process, so MPI never writes into or reads from freed memory; the communicator is unusable afterwards
(messages of the failed collective may still be in flight). One collective at a time per
communicator and thread: all algorithm traffic shares TAG and relies on MPI's non-overtaking order.
"""
import os
import time

import numpy as np
from mpi4py import MPI

from .. import _config
from ..errors import PeerTimeoutError

# The tag of all algorithm traffic, so it never matches a user's send/recv on the same
# communicator (user code must leave this tag alone). Below 32767, the smallest MPI_TAG_UB the
# standard allows.
TAG = 0x6D66  # "mf"

# Messages are cut into segments of at most this many bytes. Both ends derive the cut from the
# range length alone, so they always agree on it; segments let a receiver reduce one piece while
# the next one arrives and bound the scratch memory of the algorithms (two segments).
SEGMENT_BYTES = 256 * 1024

# Polling schedule of wait(): test in a tight loop for SPIN_S (a small message on shared memory
# completes in a few microseconds, and sleeping would cost more than that), then keep testing but
# yield the core after each test until YIELD_S (oversubscribed ranks need the CPU, and MPI only
# moves large messages while somebody calls into it), then sleep with a back-off capped at
# MAX_SLEEP_S (a peer that is still computing should not cost us a core).
SPIN_S = 50e-6
YIELD_S = 20e-3
MAX_SLEEP_S = 1e-3

# Requests (with the buffers they reference) abandoned by a timeout; see the module docstring.
_abandoned = []


def as_bytes(arr, lo=0, hi=None):
    """uint8 view (no copy) of elements [lo, hi) of a 1-D contiguous array."""
    a = arr[lo:hi]
    return a.view(np.uint8) if a.dtype != np.uint8 else a


def segments(nbytes, seg=SEGMENT_BYTES):
    """The (start, stop) byte offsets of the messages that carry nbytes; none for 0 bytes."""
    return [(s, min(s + seg, nbytes)) for s in range(0, nbytes, seg)]


class Batch:
    """Requests posted together and waited on together: reqs[i] talks to peers[i], and recv[i]
    says whether it is a receive (only receives are cancelled on a timeout)."""

    __slots__ = ("comm", "reqs", "peers", "recv")

    def __init__(self, comm):
        self.comm = comm
        self.reqs, self.peers, self.recv = [], [], []

    def send(self, buf, peer):
        """Post the segmented sends of the uint8 array buf to peer (no copy)."""
        for s, e in segments(buf.size):
            self.reqs.append(self.comm.Isend([buf[s:e], MPI.BYTE], peer, TAG))
            self.peers.append(peer)
            self.recv.append(False)

    def recv_into(self, buf, peer):
        """Post the segmented receives from peer into the uint8 array buf (matches send())."""
        for s, e in segments(buf.size):
            self.reqs.append(self.comm.Irecv([buf[s:e], MPI.BYTE], peer, TAG))
            self.peers.append(peer)
            self.recv.append(True)

    def recv_one(self, buf, peer):
        """Post one receive of the uint8 array buf (at most one segment) from peer; returns its
        index for wait_one()."""
        assert buf.size <= SEGMENT_BYTES
        self.reqs.append(self.comm.Irecv([buf, MPI.BYTE], peer, TAG))
        self.peers.append(peer)
        self.recv.append(True)
        return len(self.reqs) - 1

    def wait_one(self, i, what):
        """Wait for request i only (the others keep going)."""
        wait([self.reqs[i]], [self.peers[i]], what, [self.recv[i]])

    def wait(self, what):
        """Wait for every request posted so far, then forget them."""
        wait(self.reqs, self.peers, what, self.recv)
        self.reqs, self.peers, self.recv = [], [], []


def wait(reqs, peers, what, is_recv=None):
    """Wait until every request in reqs has completed, for at most timeout_s() seconds.

    peers[i] is the rank reqs[i] talks to, is_recv[i] whether it is a receive (default: all are).
    On timeout, raise PeerTimeoutError naming `what` and the ranks whose requests are unfinished
    (receives are cancelled, all unfinished requests parked)."""
    if not reqs:
        return
    testall = MPI.Request.Testall
    if testall(reqs):
        return
    start = time.perf_counter()
    now = start
    spin_end = start + SPIN_S
    while now < spin_end:
        if testall(reqs):
            return
        now = time.perf_counter()
    timeout = _config.timeout_s()
    deadline = start + timeout
    yield_end = min(start + YIELD_S, deadline)
    while now < yield_end:
        if testall(reqs):
            return
        os.sched_yield()
        now = time.perf_counter()
    nap = 20e-6
    while now < deadline:
        if testall(reqs):
            return
        time.sleep(min(nap, deadline - now))
        nap = min(nap * 2, MAX_SLEEP_S)
        now = time.perf_counter()
    if testall(reqs):
        return
    _give_up(reqs, peers, [True] * len(reqs) if is_recv is None else is_recv, what, timeout)


def _give_up(reqs, peers, is_recv, what, timeout):
    late = []
    for req, peer, recv in zip(reqs, peers, is_recv):
        if req == MPI.REQUEST_NULL or req.Test():
            continue
        late.append(peer)
        if recv:
            # Cancelling a receive is well defined: it completes as cancelled and a message that
            # comes later is matched by nobody. Cancelling a send is deprecated in MPI 4 and
            # unreliable, so a send is only parked: it may still complete if the peer turns up.
            try:
                req.Cancel()
                req.Test()
            except MPI.Exception:
                pass
        if req != MPI.REQUEST_NULL:
            _abandoned.append(req)  # keeps the request and the buffer it references alive
    late = sorted(set(late))
    raise PeerTimeoutError(
        f"{what}: no progress from rank(s) {late} within {timeout:g} s (MLFABRIC_TIMEOUT); a peer "
        "died, hangs, or is running a different collective. The communicator is unusable now.")
