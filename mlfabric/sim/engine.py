"""The discrete-event core: a time-ordered queue of callbacks plus "sources" whose next event time
changes as they are used (the fair-share flow sets, whose next completion moves whenever a flow
starts or ends). Equal times run in the order they were scheduled (a sequence number breaks ties),
timed events before sources, so a run is a deterministic function of its inputs.
"""
import heapq
import sys
import time
from math import inf


class Engine:
    def __init__(self, progress=None):
        self.now = 0.0
        self._heap = []
        self._seq = 0
        self.sources = []
        self.events = 0
        self.progress = progress  # callable(now) every few thousand events, or None

    def at(self, t, fn, *args):
        """Run fn(t, *args) at time t (not before now: scheduling into the past is a bug)."""
        if t < self.now:
            if t < self.now - 1e-9:
                raise RuntimeError("event at t=%r scheduled at t=%r" % (t, self.now))
            t = self.now
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run(self):
        heap = self._heap
        sources = self.sources
        pop = heapq.heappop
        tick = 0
        if not sources:  # timed events only (the scheduled policies): the same order, less work
            progress = self.progress
            while heap:
                t, _, fn, args = pop(heap)
                self.now = t
                fn(t, *args)
                tick += 1
                if tick == 4096:
                    self.events += tick
                    tick = 0
                    if progress is not None:
                        progress(self.now)
            self.events += tick
            return
        while True:
            t_ev = heap[0][0] if heap else inf
            src, t_src = None, inf
            for s in sources:
                ts = s.next_time()
                if ts < t_src:
                    src, t_src = s, ts
            if t_src < t_ev:
                self.now = t_src
                src.fire(t_src)
            elif t_ev < inf:
                t, _, fn, args = pop(heap)
                self.now = t
                fn(t, *args)
            else:
                break
            self.events += 1
            tick += 1
            if tick == 4096:
                tick = 0
                if self.progress is not None:
                    self.progress(self.now)


class Progress:
    """A progress line on stderr at most every `every` seconds of wall time, for long runs."""

    def __init__(self, label, total, count, every=5.0, stream=None):
        self.label = label
        self.total = total
        self.count = count    # callable: how many updates are resolved so far
        self.every = every
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.shown = False

    def __call__(self, now):
        w = time.perf_counter()
        if w - self.last < self.every:
            return
        self.last = w
        self.shown = True
        done = self.count()
        self.stream.write("%s: %d/%d updates resolved (%.0f%%), simulated %.1f s, wall %.0f s\n"
                          % (self.label, done, self.total, 100.0 * done / max(1, self.total), now,
                             w - self.t0))
        self.stream.flush()
