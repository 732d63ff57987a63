"""Server-side buffering (paper §3.1.1, Fig. 1b), the alternative to ordering in the network:
updates travel uncontrolled (fair-shared links) and the server holds back arrivals that would make
an update still on its way exceed tau_max, applying them after it. Delays stay <= tau_max; the price
is freshness: pulls served meanwhile do not see the held updates.

The rule (the paper states the goal, not the rule; this is the least holding that keeps the bound):
- An update g has deadline d(g) = v(g) + tau_max, the last server version it may create.
- The server knows every pushed update (the push request precedes the bytes) and their deadlines.
  Pending updates = in flight + buffered; those with d >= v + 1 can still make it ("protected").
- An arrival whose bound is already broken (d < v + 1) is dropped (only then); others are buffered
  and the buffer is released earliest deadline first: the earliest-deadline buffered update is
  applied if it is the earliest protected update overall (earliest deadline first is optimal, so
  holding it cannot help anyone), or if every other protected update can still meet its deadline
  after it, i.e. their sorted deadlines d_(1) <= d_(2) <= ... satisfy d_(k) >= v + 1 + k. Otherwise
  it waits for an in-flight update to arrive. If the earliest-deadline buffered update cannot go,
  no later one can (fewer updates would fit before every deadline), so checking it alone suffices.
With tau_max = inf every arrival is applied at once, which is vanilla async.
"""
import heapq
from bisect import bisect_left, insort
from math import inf

import numpy as np

from mlfabric.sched import DROP_STALE


class BufferingServer:
    def __init__(self, tau_max, apply, drop):
        self.tau_max = tau_max
        self.v = 0
        self.inflight = []   # sorted deadlines of pushed updates still on their way
        self.pending = []    # sorted deadlines of in-flight and buffered updates
        self.buffer = []     # heap of (deadline, uid)
        self.apply = apply   # apply(t, uid, version_after)
        self.drop = drop     # drop(t, uid, reason)
        self.held = 0        # arrivals that had to wait in the buffer

    def pushed(self, uid, version):
        d = version + self.tau_max
        insort(self.inflight, d)
        insort(self.pending, d)

    def arrived(self, t, uid, version):
        d = version + self.tau_max
        del self.inflight[bisect_left(self.inflight, d)]
        heapq.heappush(self.buffer, (d, uid))
        if uid not in self._release(t):
            self.held += 1

    def _forget(self, d):
        del self.pending[bisect_left(self.pending, d)]

    def _release(self, t):
        """Apply or drop what the rule lets go; returns the uids resolved."""
        buf = self.buffer
        out = []
        while buf:
            d, uid = buf[0]
            if d < self.v + 1:
                heapq.heappop(buf)
                self._forget(d)
                self.drop(t, uid, DROP_STALE)
            elif self._may_apply(d):
                heapq.heappop(buf)
                self._forget(d)
                self.v += 1
                self.apply(t, uid, self.v)
            else:
                break
            out.append(uid)
        return out

    def _may_apply(self, d):
        nxt = self.v + 1
        j = bisect_left(self.inflight, nxt)
        if j == len(self.inflight) or d <= self.inflight[j]:
            return True  # the earliest protected update: EDF applies it first
        pend = self.pending
        j0 = bisect_left(pend, nxt)
        n = len(pend) - j0 - 1  # protected updates other than this one
        if pend[j0] >= nxt + n:
            return True  # even the earliest of them has room for all of them: feasible
        rest = np.array(pend[j0:], dtype=float)
        k = bisect_left(pend, d) - j0  # this update's place; the ones after it move up one
        slack = rest - np.arange(1, len(rest) + 1)
        return bool(slack[:k].min(initial=inf) >= nxt and slack[k + 1:].min(initial=inf) + 1 >= nxt)
