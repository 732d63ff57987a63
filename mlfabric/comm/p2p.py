"""Bounded-wait point-to-point messaging for mlfabric's collective algorithms over MPI.

Owns: the tag those algorithms use, the cut of a byte range into messages (segments), posting
non-blocking sends/receives on byte views of the caller's arrays, and the one wait they all go
through: comm/wait.py's bounded wait on MPI requests, which polls until a deadline of
MLFABRIC_TIMEOUT seconds (_core.config.timeout_s()) and then raises PeerTimeoutError naming the
operation and the ranks it was still waiting on, so a dead or diverged peer becomes an error
instead of a hang. Here: what giving up on MPI requests means (cancel, park) and which ranks
are late.

Contract: posting is non-blocking and copies nothing: the caller owns the buffers and must not touch
one until the wait on its request has returned. After a timeout, unfinished receives are cancelled
and every unfinished request (with the buffer it references) is parked here for the life of the
process, so MPI never writes into or reads from freed memory; `timeouts` counts these events so
callers can stop reusing buffers that a parked request may still touch. The communicator is
unusable after a timeout (messages of the failed collective may still be in flight): the caller
gives up on it (comm/abort.py), and a wait made under watch() polls whether a peer did, so it
fails as soon as a peer's notice comes rather than at its own deadline. One collective at a time
per communicator: all algorithm traffic shares TAG and relies on MPI's non-overtaking order
between two ranks.
"""
import functools

import numpy as np
from mpi4py import MPI

from ..errors import MlfabricError
from .wait import Stopped, describe, poll, watch  # noqa: F401 (watch, describe: p2p's API)

# The tag of all algorithm traffic, so it never matches a user's send/recv on the same
# communicator (users must leave this tag alone). Below 32767, the smallest MPI_TAG_UB the
# standard allows.
TAG = 0x6D66  # "mf"

# Messages are cut into segments of at most this many bytes. Both ends derive the cut from the
# range length alone, so they always agree on it. Segments let a receiver reduce one piece while
# the next arrives, let a tree forward a piece before the whole vector is in, and bound the
# algorithms' scratch memory. Read at call time (tests shrink it); a multiple of 8.
SEGMENT_BYTES = 256 * 1024

_abandoned = []  # requests parked by a timeout (they keep their buffers alive)


def abandoned():
    """Number of requests parked by timeouts so far (nonzero: a peer may be gone)."""
    return len(_abandoned)
timeouts = 0     # how many timeouts this process has seen


def others(comm):
    """Every rank of comm but the caller: the ranks a wait on a collective request waits for."""
    me = comm.Get_rank()
    return [r for r in range(comm.Get_size()) if r != me]


def as_bytes(arr, lo=0, hi=None):
    """uint8 view (no copy) of elements [lo, hi) of a 1-D contiguous array."""
    a = arr[lo:hi]
    return a if a.dtype == np.uint8 else a.view(np.uint8)


def segments(nbytes):
    """(start, stop) byte offsets of the messages that carry nbytes; none for 0 bytes."""
    seg = SEGMENT_BYTES
    if nbytes <= seg:
        return ((0, nbytes),) if nbytes else ()
    return tuple((s, min(s + seg, nbytes)) for s in range(0, nbytes, seg))


def isend(comm, buf, peer):
    """Post one send of the uint8 array buf to peer (no copy); returns the request."""
    return comm.Isend([buf, MPI.BYTE], peer, TAG)


def irecv(comm, buf, peer):
    """Post one receive from peer into the uint8 array buf; returns the request."""
    return comm.Irecv([buf, MPI.BYTE], peer, TAG)


class Batch:
    """Requests posted together and waited on together: reqs[i] talks to peers[i]; recv[i] says
    whether it is a receive (only receives are cancelled on a timeout)."""

    __slots__ = ("comm", "reqs", "peers", "recv")

    def __init__(self, comm):
        self.comm = comm
        self.reqs, self.peers, self.recv = [], [], []

    def add(self, req, peer, is_recv):
        self.reqs.append(req)
        self.peers.append(peer)
        self.recv.append(is_recv)

    def send(self, buf, peer):
        """Post the segmented sends of the uint8 array buf (any size) to peer."""
        for s, e in segments(buf.size):
            self.add(isend(self.comm, buf[s:e], peer), peer, False)

    def recv_into(self, buf, peer):
        """Post the segmented receives from peer into the uint8 array buf (matching send())."""
        for s, e in segments(buf.size):
            self.add(irecv(self.comm, buf[s:e], peer), peer, True)

    def wait(self, what):
        """Wait for every request posted so far (bounded, see wait()), then forget them."""
        if self.reqs:
            wait(self.reqs, self.peers, what, self.recv)
            self.reqs, self.peers, self.recv = [], [], []


def wait(reqs, peers, what, is_recv=None, timeout=None, bound="MLFABRIC_TIMEOUT", since=None):
    """Wait until every request in reqs has completed, for at most timeout_s() seconds (or
    `timeout`, named `bound` in the error: torch's Work.wait(timeout)), counted from `since` (a
    time.perf_counter() reading; default now): a wait in phases (a receive's header, then its
    payload) shares one bound.

    peers: the ranks waited on, either one per request (peers[i] is the rank reqs[i] talks to) or,
    for requests that involve many ranks (a non-blocking collective), any list of ranks. is_recv:
    one flag per request, True for a point-to-point receive, which is cancelled on a timeout; by
    default nothing is cancelled (cancelling a collective's request is erroneous in MPI). On
    timeout, raise PeerTimeoutError naming `what` (see describe()) and the ranks whose requests
    are unfinished; unfinished requests are parked. An MPI error on a request (a truncated
    message: the peers disagree on sizes) is raised as MlfabricError naming `what` and peers."""
    try:
        if MPI.Request.Testall(reqs):
            return
        stop = poll(functools.partial(MPI.Request.Testall, reqs), timeout, since)
        if stop is not None:
            _stopped(stop, reqs, peers, is_recv, what, bound)
    except MPI.Exception as e:
        raise MlfabricError(f"{describe(what)}: MPI error talking to rank(s) {sorted(set(peers))}: "
                            f"{e.Get_error_string()}") from e


def park(reqs, is_recv):
    """Give up on requests: cancel the unfinished receives and keep every unfinished request
    (with the buffer it references) for the life of the process, so MPI never writes into or
    reads from freed memory. The indices of the unfinished ones."""
    unfinished = []
    for i, (req, recv) in enumerate(zip(reqs, is_recv)):
        try:
            if req == MPI.REQUEST_NULL or req.Test():
                continue
        except MPI.Exception:  # it completed, in error: nothing left to touch the buffer
            continue
        unfinished.append(i)
        if recv:
            # Cancelling a receive is well defined: it completes as cancelled, and a message that
            # comes later is matched by nobody. Cancelling a send is deprecated in MPI 4 and
            # unreliable, so a send is only parked: it may still complete if the peer turns up.
            try:
                req.Cancel()
                req.Test()
            except MPI.Exception:
                pass
        if req != MPI.REQUEST_NULL:
            _abandoned.append(req)  # mpi4py requests hold a reference to their buffer
    return unfinished


def give_up(reqs, peers, is_recv, what, timeout):
    """End a wait on reqs that ran `timeout` seconds elsewhere (a poller's): as wait() does at
    its deadline, park what is unfinished and raise PeerTimeoutError (nothing if all are done)."""
    if any(req != MPI.REQUEST_NULL for req in reqs):
        _stopped(Stopped(None, timeout), reqs, peers, is_recv, what)


def _stopped(stop, reqs, peers, is_recv, what, bound="MLFABRIC_TIMEOUT"):
    """End a wait that stopped (a wait.Stopped): park what is unfinished and raise its
    PeerTimeoutError, naming the ranks of the unfinished requests (for a collective's requests:
    one or more of peers). A deadline counts in `timeouts`, a peer's notice does not."""
    global timeouts
    if stop.reason is None:
        timeouts += 1
    unfinished = park(reqs, is_recv if is_recv is not None else [False] * len(reqs))
    if len(peers) == len(reqs):
        raise stop.error(what, [peers[i] for i in unfinished], bound)
    raise stop.error(what, peers, bound, exact=False)
