"""The bounded wait of every layer that waits on peers: poll a condition until it holds or a
deadline passes, without burning a core and without hanging on a dead or diverged peer.

Owns: the polling schedule (spin, then yield the core, then sleep with a doubling back-off), the
deadline (MLFABRIC_TIMEOUT seconds, _core.config.timeout_s(), or an explicit bound), the periodic
check whether a peer gave up (watch(): per thread), and the messages of the two ways a wait ends
badly: PeerTimeoutError naming the operation, the ranks still waited on and the bound's name
(late_error), or naming the reason a peer's notice gave (abort_error). It knows nothing of MPI:
callers pass what to poll (comm/p2p.py: MPI requests) and what to release on giving up.

Contract:
  wait_until(done, what, ...) blocks the calling thread until done() returns true (it returns
    None), or raises PeerTimeoutError at the deadline or when the check reports a reason; an
    on_timeout hook runs first (to cancel and park what the wait held) and may raise its own
    error instead. Whatever done(), the check or the hook raise propagates unchanged.
  poll(done, ...) is the same wait without an error: None when done() held, else a Stopped
    (why it stopped, the bound) whose error() is the PeerTimeoutError wait_until would raise,
    for callers that give up in their own way (comm/p2p.py: cancel and park MPI requests).
  Backoff paces a loop that does its own work between polls (the schedule only, no error).
All of it runs on the calling thread, and watch() is per thread (a check set on one thread
never applies to another's waits). done() is called first without any pause, so a condition
that already holds costs one call; the spin allocates nothing (the hot path of a small
collective's wait).
"""
import os
import threading
import time

from .._core import config as _config
from ..errors import PeerTimeoutError

# Polling schedule. Spin on done() for SPIN_S: a small message on shared memory or a fast network
# completes in microseconds, and giving up the core would cost more than that. Then keep polling
# but yield the core after each poll until YIELD_S: oversubscribed ranks need the CPU, and MPI
# moves large messages only while someone calls into it. Then sleep, starting at FIRST_NAP_S and
# doubling up to MAX_SLEEP_S: a peer still busy computing should not cost us a core.
SPIN_S = 50e-6
YIELD_S = 20e-3
FIRST_NAP_S = 20e-6
MAX_SLEEP_S = 1e-3
# How often a wait past its spin asks its check (see watch()) whether a peer gave up: the check
# may cost an MPI_Iprobe, so it does not run on every poll.
WATCH_S = 2e-3

BOUND = "MLFABRIC_TIMEOUT"  # the name of the default bound, as errors print it


class _Watch(threading.local):
    check = None  # the callable set by watch() on this thread (a class default: no AttributeError)


_watch = _Watch()
WATCHED = object()  # as a check: the one watch() set on this thread (at the time of the wait)


def watch(check):
    """Make this thread's waits ask check() every WATCH_S whether what they wait on became
    unusable (a peer gave up on it: check() returns why, else None); a reason ends the wait
    with PeerTimeoutError at once. None stops watching. Returns the previous check, to put back
    when the call that set it ends."""
    previous = _watch.check
    _watch.check = check
    return previous


def watched():
    """The check watch() set on this thread, or None."""
    return _watch.check


def describe(what):
    """what is a string, or a tuple (format, *args) formatted only when an error needs it (the
    fast path of a small collective cannot afford formatting a message it never shows)."""
    return what if isinstance(what, str) else what[0].format(*what[1:])


def late_error(what, late, timeout, bound=BOUND, exact=True):
    """The PeerTimeoutError of a wait on `what` that ran `timeout` seconds (the bound named
    `bound`) without the ranks `late` (exact: exactly those are late; else one or more of
    them, as for a collective request that involves them all)."""
    late = sorted(set(late))
    who = f"rank(s) {late}" if exact else f"one or more of rank(s) {late}"
    return PeerTimeoutError(
        f"{describe(what)}: no progress from {who} within {timeout:g} s "
        f"({bound}); a peer died, hangs, or is running a different collective. "
        "The communicator is unusable now.")


def abort_error(what, why):
    """The PeerTimeoutError of a wait on `what` ended by a peer's notice (`why`, from a check)."""
    return PeerTimeoutError(f"{describe(what)}: stopped waiting: {why}. The communicator is "
                            "unusable now.")


class Backoff:
    """The polling schedule for a loop that does its own work between polls:

        back = Backoff(timeout)
        while not ready():
            if not back.pause():
                ...  # the deadline passed

    pause() does nothing during the first SPIN_S, yields the core until YIELD_S, then sleeps
    (FIRST_NAP_S doubling up to max_sleep, never past the deadline). timeout: seconds (None:
    MLFABRIC_TIMEOUT; 0 or less: nothing past the spin; nan: ValueError); since: the
    time.perf_counter() reading the bound counts from (a wait in phases shares one bound;
    default now); start: the reading the phases count from (default now). Attributes: timeout,
    deadline, now (the reading at the last pause)."""

    __slots__ = ("timeout", "deadline", "now", "_spin_end", "_yield_end", "_nap", "_max_sleep")

    def __init__(self, timeout=None, since=None, start=None, max_sleep=MAX_SLEEP_S):
        now = time.perf_counter() if start is None else start
        if timeout is None:
            timeout = _config.timeout_s()
        elif timeout != timeout:  # nan: no reading would ever pass the deadline
            raise ValueError("a wait's timeout must be a number of seconds, got nan")
        self.timeout = timeout
        self.deadline = (now if since is None else since) + self.timeout
        self.now = now
        self._spin_end = now + SPIN_S
        self._yield_end = min(now + YIELD_S, self.deadline)
        self._nap = FIRST_NAP_S
        self._max_sleep = max_sleep

    def pause(self):
        """Give way before the next poll as the phase calls for; False (without pausing) once
        the deadline has passed."""
        now = self.now = time.perf_counter()
        if now >= self.deadline:
            return False
        if now >= self._yield_end:
            nap = self._nap
            time.sleep(min(nap, self.deadline - now))
            self._nap = min(nap * 2, self._max_sleep)
        elif now >= self._spin_end:
            os.sched_yield()
        return True

    def expired(self):
        """Whether the deadline has passed (reads the clock)."""
        return time.perf_counter() >= self.deadline


class Stopped:
    """Why poll() stopped before done() held: `reason`, None when the deadline passed, else the
    reason the check gave; `timeout`, the bound in seconds."""

    __slots__ = ("reason", "timeout")

    def __init__(self, reason, timeout):
        self.reason, self.timeout = reason, timeout

    def __repr__(self):
        return f"Stopped({self.reason!r}, {self.timeout!r})"

    def error(self, what, late, bound=BOUND, exact=True):
        """The PeerTimeoutError to raise: abort_error for a reason, else late_error (see there
        for late, bound and exact)."""
        if self.reason is not None:
            return abort_error(what, self.reason)
        return late_error(what, late, self.timeout, bound, exact)


def poll(done, timeout=None, since=None, check=WATCHED, every=WATCH_S):
    """Poll done() on the schedule until it returns true (then None), for at most `timeout`
    seconds (None: MLFABRIC_TIMEOUT) counted from `since` (a time.perf_counter() reading;
    default now): a wait in phases shares one bound. check: called every `every` seconds once
    the spin is over; it returns None to go on, a reason (a peer gave up) to stop, or raises
    its own error; by default (WATCHED) the check watch() set on this thread; None: no check.
    Stopping (the deadline passed, or the check gave a reason, and done() still false) returns
    a Stopped; nothing is raised but what done() or check() raise. For callers that give up in
    their own way; the rest use wait_until()."""
    # The spin is the hot path (a small collective's wait): locals only, no allocation; the
    # rest, slow by design, is out of line.
    perf = time.perf_counter
    start = now = perf()
    spin_end = start + SPIN_S
    while now < spin_end:
        if done():
            return None
        now = perf()
    return _poll_on(done, Backoff(timeout, since, start),
                    _watch.check if check is WATCHED else check, every)


def _poll_on(done, back, check, every):
    """Past the spin: poll done() paced by back, asking check() every `every` seconds."""
    next_check = back.now + every if check is not None else float("inf")
    while back.pause():
        if done():
            return None
        if back.now >= next_check:
            why = check()
            if why is not None and not done():
                return Stopped(why, back.timeout)
            next_check = back.now + every
    return None if done() else Stopped(None, back.timeout)


def wait_until(done, what, peers=(), timeout=None, bound=BOUND, since=None, on_timeout=None,
               check=WATCHED, every=WATCH_S):
    """Block until done() returns true (then None), as poll() does (timeout, since, check,
    every), raising PeerTimeoutError where poll()
    would stop. what: the operation (a string or a lazy tuple, see describe()); peers: the ranks
    waited on.

    Giving up, first on_timeout(why) runs (why: the check's reason, None at the deadline): it
    releases what the wait held and returns the ranks still late (None: unknown) or raises its
    own error. Then PeerTimeoutError: abort_error(what, why) for a reason; at the deadline
    late_error naming the ranks on_timeout returned (exactly those), else one or more of
    `peers` (the ranks of a collective request), and `bound`."""
    stop = poll(done, timeout, since, check, every)
    if stop is None:
        return
    late = on_timeout(stop.reason) if on_timeout is not None else None
    if late is None:
        raise stop.error(what, peers, bound, exact=len(set(peers)) <= 1)
    raise stop.error(what, late, bound)
