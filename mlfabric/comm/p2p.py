"""Bounded-wait point-to-point messaging for mlfabric's collective algorithms over MPI.

Owns: the tag those algorithms use, the cut of a byte range into messages (segments), posting
non-blocking sends/receives on byte views of the caller's arrays, and the one wait they all go
through. That wait polls until a deadline of MLFABRIC_TIMEOUT seconds (_core.config.timeout_s())
and then raises PeerTimeoutError naming the operation and the ranks it was still waiting on, so a
dead or diverged peer becomes an error instead of a hang.

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
import os
import threading
import time

import numpy as np
from mpi4py import MPI

from .._core import config as _config
from ..errors import MlfabricError, PeerTimeoutError

# The tag of all algorithm traffic, so it never matches a user's send/recv on the same
# communicator (users must leave this tag alone). Below 32767, the smallest MPI_TAG_UB the
# standard allows.
TAG = 0x6D66  # "mf"

# Messages are cut into segments of at most this many bytes. Both ends derive the cut from the
# range length alone, so they always agree on it. Segments let a receiver reduce one piece while
# the next arrives, let a tree forward a piece before the whole vector is in, and bound the
# algorithms' scratch memory. Read at call time (tests shrink it); a multiple of 8.
SEGMENT_BYTES = 256 * 1024

# Polling schedule of wait(). Spin on Testall for SPIN_S: a small message on shared memory or a
# fast network completes in microseconds, and giving up the core would cost more than that. Then
# keep testing but yield the core after each test until YIELD_S: oversubscribed ranks need the
# CPU, and MPI moves large messages only while someone calls into it. Then sleep with a doubling
# back-off capped at MAX_SLEEP_S: a peer still busy computing should not cost us a core.
SPIN_S = 50e-6
YIELD_S = 20e-3
MAX_SLEEP_S = 1e-3
# How often a wait past its spin asks its watch (see watch()) whether a peer gave up: an
# MPI_Iprobe each time, so not on every test of the requests.
WATCH_S = 2e-3

_watch = threading.local()  # .check: the callable set by watch() on this thread, or absent

_abandoned = []  # requests parked by a timeout (they keep their buffers alive)


def abandoned():
    """Number of requests parked by timeouts so far (nonzero: a peer may be gone)."""
    return len(_abandoned)
timeouts = 0     # how many timeouts this process has seen


def watch(check):
    """Make this thread's waits ask check() every WATCH_S whether the communicator they wait on
    became unusable (a peer gave up on it: check() returns why, else None); a reason ends the
    wait with PeerTimeoutError at once. None stops watching. Returns the previous check, to put
    back when the call that set it ends."""
    previous = getattr(_watch, "check", None)
    _watch.check = check
    return previous


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


def describe(what):
    """what is a string, or a tuple (format, *args) formatted only when an error needs it (the
    fast path of a small collective cannot afford formatting a message it never shows)."""
    return what if isinstance(what, str) else what[0].format(*what[1:])


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
        _poll(reqs, peers, what, is_recv, timeout, bound, since)
    except MPI.Exception as e:
        raise MlfabricError(f"{describe(what)}: MPI error talking to rank(s) {sorted(set(peers))}: "
                            f"{e.Get_error_string()}") from e


def _poll(reqs, peers, what, is_recv, timeout=None, bound="MLFABRIC_TIMEOUT", since=None):
    testall = MPI.Request.Testall
    perf = time.perf_counter
    start = now = perf()
    spin_end = start + SPIN_S
    while now < spin_end:
        if testall(reqs):
            return
        now = perf()
    if timeout is None:
        timeout = _config.timeout_s()
    deadline = (start if since is None else since) + timeout
    yield_end = min(start + YIELD_S, deadline)
    sched_yield = os.sched_yield
    check = getattr(_watch, "check", None)
    next_check = now + WATCH_S if check is not None else float("inf")
    while now < yield_end:
        if testall(reqs):
            return
        sched_yield()
        now = perf()
        if now >= next_check:
            _ask(check, reqs, peers, is_recv, what)
            next_check = now + WATCH_S
    nap = 20e-6
    while now < deadline:
        if testall(reqs):
            return
        time.sleep(min(nap, deadline - now))
        nap = min(nap * 2, MAX_SLEEP_S)
        now = perf()
        if now >= next_check:
            _ask(check, reqs, peers, is_recv, what)
            next_check = now + WATCH_S
    if testall(reqs):
        return
    _give_up(reqs, peers, is_recv, what, timeout, bound)


def _ask(check, reqs, peers, is_recv, what):
    """End the wait (park, PeerTimeoutError) if check() says the communicator is unusable."""
    why = check()
    if why is None or _done(reqs):
        return
    park(reqs, is_recv if is_recv is not None else [False] * len(reqs))
    raise PeerTimeoutError(f"{describe(what)}: stopped waiting: {why}. The communicator is "
                           "unusable now.")


def _done(reqs):
    """Whether every request is complete (an MPI error counts as complete: wait() reports it)."""
    try:
        return MPI.Request.Testall(reqs)
    except MPI.Exception:
        return True


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
        _give_up(reqs, peers, is_recv, what, timeout)


def _give_up(reqs, peers, is_recv, what, timeout, bound="MLFABRIC_TIMEOUT"):
    global timeouts
    timeouts += 1
    one_each = len(peers) == len(reqs)
    late = []
    for i in park(reqs, is_recv if is_recv is not None else [False] * len(reqs)):
        late.extend([peers[i]] if one_each else peers)
    late = sorted(set(late))
    who = f"rank(s) {late}" if one_each else f"one or more of rank(s) {late}"
    raise PeerTimeoutError(
        f"{describe(what)}: no progress from {who} within {timeout:g} s "
        f"({bound}); a peer died, hangs, or is running a different collective. "
        "The communicator is unusable now.")
