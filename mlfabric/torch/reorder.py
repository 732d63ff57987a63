"""Async calls that ranks issue in different orders. Horovod runs a call once every rank has
submitted it, matched by name; mlfabric matches calls by order (each rank's next call, compared
in a control round: control.py). This module owns the rule that lets the two agree where a
program relies on names, the handle of an async call (Call), and the check that no named call
is issued twice while in flight on a rank (check_name_free: ValueError, as in Horovod).

The rule. An async call of CPU tensors may be set aside: when its first control round finds the
ranks' descriptors differ, its rank keeps it in flight (its handle pending) and goes on with its
next call. A rank's calls set aside are offered before its current call whenever the
descriptors differ again: in one more allgather (resolve), each rank gives its calls set aside
and its current call, and from that table every rank picks the same call to run, the first
(rank 0's first, then rank 1's, ...) that every active rank has among its candidates (a joined
rank takes part as joined); each rank runs its own call of those, then rounds go on for its
current call. Where no call is common to all, the ranks whose current call may be set aside set
it aside, and the others retry; where none may (blocking calls, synchronize() of a call set
aside, which runs it as a blocking call), no rank can make progress, and every rank raises the
MismatchError of the round, on its current call and on each call it had set aside. So calls
that agree run at once, in one round (order matching is the fast path), and fusion of async
allreduces is untouched (the table that a call set aside runs with offers no fusion).
Each process set has its own queue, so its own calls set aside (dispatch.State).
"""
import copy
import weakref

import numpy as np

from ..errors import MismatchError
from . import control as _control
from .control import ACTIVE, ASIDE_N, FUSE_H, FUSE_LEVELS, JOINED, KINDS, KIND, MOBILE, STATE, W

MAX_ASIDE = 15  # calls one rank may have set aside at a time; beyond, its async calls wait
K = MAX_ASIDE + 1  # candidates a rank gives in resolve's allgather
UNUSED = -3  # STATE of a candidate row that holds no call
ASIDE = object()  # what the queue's Handle of a call set aside holds (Call.wait looks further)


class SetAside(Exception):
    """Raised by control_round in an async call's job: its rank sets the call aside."""

    def __init__(self, desc):
        super().__init__("set aside")
        self.desc = desc


class Call:
    """The handle of an *_async call: its queue's Handle (or GpuCall), and, once set aside,
    what runs it later. wait() and done() as the queue's Handle."""
    __slots__ = ("st", "what", "fn", "inner", "mobile", "desc", "finished", "result", "error",
                 "polled", "__weakref__")

    def __init__(self, st, what, fn, mobile):
        self.st, self.what, self.fn, self.mobile = st, what, fn, mobile
        self.inner = self.desc = self.result = self.error = None
        self.finished = self.polled = False

    def run(self):
        """The call's job, as queued: ASIDE when the rank set it aside."""
        st = self.st
        outer, st.current = st.current, self
        try:
            return self.fn()
        except SetAside as exc:
            d = exc.desc.copy()
            d[MOBILE:W] = 0  # no fusion offer: its queue has moved on
            self.desc = d
            st.aside.append(self)
            return ASIDE
        finally:
            st.current = outer
            self.mobile = False

    def rerun(self):
        """Run the call set aside now (on its state's queue, in a round or in synchronize()),
        as a blocking call: it cannot be set aside again."""
        st = self.st
        outer, st.current = st.current, self
        try:
            self._finish(result=self.fn())
        except BaseException as exc:  # noqa: BLE001 - handed to its waiter
            self._finish(error=exc)
        finally:
            st.current = outer

    def _finish(self, result=None, error=None):
        self.result, self.error, self.finished = result, error, True

    def _aside(self):
        """Whether the queue's part of the call is over and it was set aside."""
        inner = self.inner
        handle = getattr(inner, "handle", inner)  # (a GpuCall's queue Handle)
        return handle.done() and handle._error is None and handle._result is ASIDE

    def wait(self):
        if not self._aside():
            result = self.inner.wait()
            if result is not ASIDE:
                return result
        while not self.finished:  # run it in order behind what was queued since
            self.st.run(self.what, self._flush)
        if self.error is not None:
            raise self.error
        return self.result

    def _flush(self):
        st = self.st
        if not self.finished and any(c is self for c in st.aside):
            st.aside.remove(self)
            self.rerun()

    def settled(self):
        """Whether the call has finished (done() without its try of a call set aside)."""
        return self.inner.done() and (not self._aside() or self.finished)

    def done(self):
        """Whether wait() would return at once. A call set aside runs in the rounds of its
        rank's later calls; with none queued, poll() queues one try of it (that may set it
        aside again), so a program that polls makes progress as one that waits."""
        if not self.inner.done():
            return False
        if not self._aside() or self.finished:
            return True
        if not self.polled and not self.st.queue.pending:
            self.polled = True
            self.st.submit(self.what, self._try)
        return False

    def _try(self):
        st = self.st
        self.polled = False
        if self.finished or not any(c is self for c in st.aside):
            return
        i = next(i for i, c in enumerate(st.aside) if c is self)
        del st.aside[i]
        outer, st.current = st.current, self
        self.mobile = True
        try:
            self._finish(result=self.fn())
        except SetAside:
            st.aside.insert(i, self)  # (its descriptor is the one kept)
        except BaseException as exc:  # noqa: BLE001 - handed to its waiter
            self._finish(error=exc)
        finally:
            st.current = outer
            self.mobile = False


def check_name_free(st, what):
    """ValueError (on this rank only: nothing was issued) when a call of this kind and name
    is still in flight on this rank, as Horovod's; else nothing. Unnamed calls are not checked."""
    if getattr(what, "named", False):
        ref = st.in_flight.get(what)
        call = ref() if ref is not None else None
        if call is not None and not call.settled():
            raise ValueError(f"{what}: a call of the same kind and name is still in flight on "
                             "this rank (an *_async call not yet finished); names of calls in "
                             "flight must be unique, as in Horovod")


def in_flight(st, what, call):
    """Record a named async call, for check_name_free."""
    if getattr(what, "named", False):
        if len(st.in_flight) > 4096:
            for key in [k for k, ref in st.in_flight.items() if ref() is None]:
                del st.in_flight[key]
        st.in_flight[what] = weakref.ref(call)


def resolve(st, desc, table, msg, what, waits):
    """After a control round (table; msg, its MismatchError's message, or None) where some rank
    has calls set aside, or whose descriptors describe different calls (waits) and some rank
    may set its call aside: the table of the call this rank runs next, if it is its current
    call (desc); else None (the caller retries), having run one of its calls set aside; or
    SetAside; or the MismatchError of a program that cannot make progress (or, where the
    calls are one call whose arguments differ, table: the caller raises msg). Every rank takes
    part (one more allgather) and decides alike."""
    n, me = len(table), st.ctx.rank
    mine = np.zeros((K, W), np.int64)
    mine[:, STATE] = UNUSED
    for i, c in enumerate(st.aside):
        mine[i] = c.desc
    mine[len(st.aside)] = desc
    cands = _control.exchange(st, mine.reshape(-1), what).reshape(n, K, W)
    picked = _match(cands)
    if picked is not None:
        chosen, idx = picked
        chosen[:, MOBILE:FUSE_H + FUSE_LEVELS] = 0  # (no fusion offer: see fusion.fused_job)
        j = idx[me]
        if j == len(st.aside):
            return chosen
        call = st.aside.pop(j)
        st.preagreed = chosen
        try:
            call.rerun()
        finally:
            st.preagreed = None
        return None
    if not waits:
        return table
    if table[:, MOBILE].any():
        if table[me, MOBILE]:
            raise SetAside(desc)
        return None
    text = (f"{msg} (no rank could go on: the calls each rank has issued and waits for, "
            f"{_offered(cands)}. A call runs once every rank has issued it; async calls may be "
            "issued in different orders, but here each rank waits for a call the others have "
            "not issued)")
    err = _control.mismatched(st, what, text)
    for c in st.aside:  # they could never run: the ranks' calls no longer line up
        c._finish(error=_own_copy(err, c.what))
    st.aside.clear()
    if desc[STATE] == JOINED:
        return table  # a joined rank stays joined (the table still disagrees)
    raise err


def _match(cands):
    """(the table of the call every rank runs next, each rank's index of it among its
    candidates) or None: the same on every rank (it depends on cands alone)."""
    n = len(cands)
    used = [[j for j in range(K) if cands[r, j, STATE] != UNUSED] for r in range(n)]
    for p in range(n):
        for i in used[p]:
            pivot = cands[p, i]
            if pivot[STATE] != ACTIVE:
                continue
            idx = []
            for r in range(n):
                pick = next((j for j in used[r] if cands[r, j, STATE] == ACTIVE and
                             _control.disagreement(np.stack([pivot, cands[r, j]]), "") is None),
                            None)
                if pick is None:
                    pick = next((j for j in used[r] if cands[r, j, STATE] == JOINED), None)
                if pick is None:
                    break
                idx.append(pick)
            else:
                chosen = cands[np.arange(n), idx].copy()
                if _control.disagreement(chosen, "") is None:
                    return chosen, idx
    return None


def _offered(cands):
    """Each rank's candidates, for a message: 'rank 0: allreduce [17, 17]; barrier, ...'."""
    parts = []
    for r, rows in enumerate(cands):
        shown = []
        for d in rows:
            if d[STATE] == UNUSED:
                continue
            if d[STATE] == JOINED:
                shown.append("join")
                continue
            kind = KINDS[int(d[KIND])]
            shown.append(kind if kind == "barrier" else f"{kind} {list(_control.shape_of(d))}")
        parts.append(f"rank {r}: {', '.join(shown)}")
    return "; ".join(parts)


def _own_copy(exc, what):
    """exc for another call (`what`): a copy whose message leads with that call's name."""
    err = copy.copy(exc)
    if len(err.args) == 1 and isinstance(err.args[0], str):
        err.args = (f"{what}: {err.args[0]}",)
    err.__cause__ = exc
    return err


def abandon(st):
    """At shutdown: the calls set aside fail (the ranks no longer run calls)."""
    for c in st.aside:
        c._finish(error=MismatchError(
            f"{c.what}: mlfabric was shut down before every rank issued this call"))
    st.aside.clear()


__all__ = ["Call", "SetAside", "check_name_free", "in_flight", "resolve", "abandon", "ASIDE_N"]
