"""Max-min fair sharing of links by concurrent flows: what TCP-like transports converge to when
nothing schedules them. The simulator's uncontrolled baselines (vanilla async and server-side
buffering, paper §3.1.1 / Fig. 1a) move their bytes this way; mlfabric's policies time-share links
through the scheduler's reservations instead (§5.1).

Two solvers:
- max_min_rates: water-filling for any flows over any links (progressive filling: every flow not yet
  held by a saturated link grows at the same pace; when a link saturates, its flows are frozen).
- StarShare: the same allocation, kept up to date incrementally as flows come and go, for the
  simulator's traffic pattern: every flow crosses one shared hub link (the server's NIC direction)
  and one leaf link of its own host (that host's NIC direction). Flows on the same leaf are
  identical, so each leaf is a class with one rate: min(leaf capacity / flows on it, lambda), where
  lambda is the hub's water level. Each class (and the set of hub-limited classes, which all run at
  lambda) keeps a virtual clock of bytes served per flow; a flow ends when the clock passes its
  finish tag. Starting or ending a flow costs O(log n), not a full re-solve, which is what makes
  1,000 workers affordable. The tests hold StarShare to max_min_rates at random states.
"""
import heapq
from math import inf

import numpy as np


def max_min_rates(paths, capacity, weights=None):
    """Max-min fair rate of every flow.

    paths: one sequence of link indices per flow (the links it crosses; an empty path is a transfer
    within one host and is unconstrained: rate inf). capacity: bytes/s per link (finite, >= 0).
    weights: optional multiplicity per flow (a class of w identical flows); the returned rate is per
    flow. Returns a numpy array of rates."""
    cap = np.array(capacity, dtype=float)
    if cap.ndim != 1 or not np.all(np.isfinite(cap)) or np.any(cap < 0):
        raise ValueError("link capacities must be finite and >= 0, got %r" % (capacity,))
    n = len(paths)
    w = np.ones(n) if weights is None else np.array(weights, dtype=float)
    if w.shape != (n,) or np.any(w <= 0):
        raise ValueError("weights must be one positive number per flow, got %r" % (weights,))
    flow_of, link_of = [], []
    for f, p in enumerate(paths):
        for link in p:
            if not (isinstance(link, (int, np.integer)) and 0 <= link < len(cap)):
                raise ValueError("flow %d crosses link %r; links are 0..%d"
                                 % (f, link, len(cap) - 1))
            flow_of.append(f)
            link_of.append(link)
    flow_of = np.array(flow_of, dtype=np.int64)
    link_of = np.array(link_of, dtype=np.int64)
    rate = np.zeros(n)
    frozen = np.zeros(n, dtype=bool)
    empty = np.bincount(flow_of, minlength=n) == 0
    rate[empty] = inf
    frozen[empty] = True
    left = cap.copy()
    while not frozen.all():
        live = ~frozen[flow_of]
        load = np.bincount(link_of[live], weights=w[flow_of[live]], minlength=len(cap))
        used = load > 0
        share = np.full(len(cap), inf)
        share[used] = left[used] / load[used]
        lam = share.min()
        saturated = used & (share <= lam * (1 + 1e-12))
        hit = np.zeros(n, dtype=bool)
        hit[flow_of[live & saturated[link_of]]] = True
        rate[hit] = lam
        frozen |= hit
        took = hit[flow_of]
        left -= np.bincount(link_of[took], weights=w[flow_of[took]] * lam, minlength=len(cap))
        np.maximum(left, 0.0, out=left)
    return rate


_HUB, _LEAF = 1, 2


class FlowSource:
    """A StarShare as an event source for engine.Engine: fire(t) ends the flows due at t and calls
    done(t, fid) for each."""

    def __init__(self, share, done):
        self.share = share
        self.done = done

    def next_time(self):
        return self.share.next_time()

    def fire(self, t):
        for fid in self.share.pop_done(t):
            self.done(t, fid)


class _Leaf:
    """A leaf-limited class: its own clock (bytes served per flow) at its own rate."""
    __slots__ = ("clock", "rate", "heap")

    def __init__(self, rate):
        self.clock = 0.0
        self.rate = rate
        self.heap = []


class StarShare:
    """Flows that each cross the hub link and one leaf link, max-min fairly shared, over time.

    add(t, leaf, size, fid) starts a flow; next_time() is when the next flow ends (inf if none);
    pop_done(t) ends the flows done by t and returns their ids; set_capacity(t, hub, leaves)
    changes capacities. Times never go back. rate(fid) is a flow's current rate."""

    def __init__(self, hub_capacity, leaf_capacities, t=0.0):
        self.t = float(t)
        self.hub = float(hub_capacity)
        self.cap = [float(c) for c in leaf_capacities]
        self._cap_np = np.array(self.cap)
        n = len(self.cap)
        self.m = [0] * n               # flows per leaf
        self.mode = [0] * n            # 0 idle, _HUB (rate lambda) or _LEAF (rate cap/m)
        self.members = [None] * n      # fids per active leaf
        self.lam = inf                 # the hub's water level
        self.vg = 0.0                  # clock of the hub-limited flows (all at lam)
        self.n_hub = 0                 # flows in hub-limited classes
        self.leaf = {}                 # leaf-limited class -> _Leaf
        self.s_leaf = 0.0              # capacity taken by leaf-limited classes
        self.gheap = []                # (tag, gen, fid) of hub-limited flows
        # Bound heaps. hmin: (theta, leaf) entries whose least per hub-limited class is <= its
        # true theta; lmax: (-theta, leaf) entries whose largest per leaf-limited class is >= it.
        # An entry is pushed only when theta moves the other way (a flow joins a hub-limited class,
        # leaves a leaf-limited one, or capacity moves), so most changes push nothing; an entry
        # that reaches the top is checked against the true theta and renewed if it is loose.
        self.hmin = []
        self.lmax = []
        self.flows = {}                # fid -> [leaf, tag, gen]
        self._gen = 0
        self._active = 0
        self._next = None              # cached next_time(); None after any change

    # --- queries ------------------------------------------------------------------------------
    def __len__(self):
        return len(self.flows)

    def rate(self, fid):
        c = self.flows[fid][0]
        return self.lam if self.mode[c] == _HUB else self.leaf[c].rate

    def next_time(self):
        """When the next flow ends at the current rates (inf if none can)."""
        if self._next is not None:
            return self._next
        best = inf
        g = self.gheap
        while g and not self._valid(g[0]):
            heapq.heappop(g)
        if g and self.lam > 0:
            best = self.t + max(0.0, g[0][0] - self.vg) / self.lam
        for rec in self.leaf.values():
            h = rec.heap
            while h and not self._valid(h[0]):
                heapq.heappop(h)
            if h and rec.rate > 0:
                e = self.t + max(0.0, h[0][0] - rec.clock) / rec.rate
                if e < best:
                    best = e
        self._next = best
        return best

    # --- changes ------------------------------------------------------------------------------
    def add(self, t, leaf, size, fid):
        """Start flow `fid` of `size` bytes on `leaf` at time t."""
        if fid in self.flows:
            raise ValueError("flow %r is already running" % (fid,))
        self.advance(t)
        c = leaf
        if self.m[c] == 0:
            self.members[c] = set()
            self.mode[c] = _HUB
            self._active += 1
        self.m[c] += 1
        self.members[c].add(fid)
        self._gen += 1
        if self.mode[c] == _HUB:
            self.n_hub += 1
            tag = self.vg + size
            heapq.heappush(self.gheap, (tag, self._gen, fid))
        else:
            rec = self.leaf[c]
            rec.rate = self.cap[c] / self.m[c]
            tag = rec.clock + size
            heapq.heappush(rec.heap, (tag, self._gen, fid))
        self.flows[fid] = [c, tag, self._gen]
        if self.mode[c] == _HUB:
            self._bound(c)  # theta fell: the hub bound must follow
        self._rebalance()

    def pop_done(self, t):
        """Advance to t and end every flow with (almost) nothing left; returns their ids."""
        due = self.next_time() <= t
        self.advance(t)
        done = []
        g = self.gheap
        eps = self.lam * 1e-9 + 1e-3 if self.lam < inf else 1e-3
        while g and (not self._valid(g[0]) or g[0][0] - self.vg <= eps):
            e = heapq.heappop(g)
            if self._valid(e):
                done.append(e[2])
        for rec in self.leaf.values():
            h = rec.heap
            eps = rec.rate * 1e-9 + 1e-3
            while h and (not self._valid(h[0]) or h[0][0] - rec.clock <= eps):
                e = heapq.heappop(h)
                if self._valid(e):
                    done.append(e[2])
        if due and not done:
            # rounding left a few bytes on the flow next_time() said ends now: end it anyway, or
            # the event loop would ask again at the same instant forever
            done.append(self._earliest())
        for fid in done:
            self._remove(fid)
        if done:
            self._rebalance()
        return done

    def _earliest(self):
        best, heap = inf, None
        if self.gheap and self.lam > 0:
            best, heap = (self.gheap[0][0] - self.vg) / self.lam, self.gheap
        for rec in self.leaf.values():
            if rec.heap and rec.rate > 0:
                x = (rec.heap[0][0] - rec.clock) / rec.rate
                if x < best:
                    best, heap = x, rec.heap
        return heapq.heappop(heap)[2]

    def set_capacity(self, t, hub, leaves):
        """New capacities from time t (hub: a number; leaves: one per leaf)."""
        self.advance(t)
        self.hub = float(hub)
        new = np.asarray(leaves, dtype=float)
        for c in np.nonzero(new != self._cap_np)[0].tolist():
            self.cap[c] = float(new[c])
            if self.mode[c] == _LEAF:
                self.leaf[c].rate = self.cap[c] / self.m[c]
            if self.mode[c]:
                self._bound(c)
        self._cap_np = new.copy()
        self.s_leaf = sum(self.cap[c] for c in self.leaf)
        self._rebalance()

    def advance(self, t):
        """Bring every clock to time t (rates unchanged)."""
        self._next = None
        dt = t - self.t
        if dt < 0:
            if dt < -1e-9:
                raise ValueError("time went back from %r to %r" % (self.t, t))
            return
        if dt:
            if self.n_hub and self.lam < inf:
                self.vg += self.lam * dt
            for rec in self.leaf.values():
                rec.clock += rec.rate * dt
            self.t = t

    # --- internals ----------------------------------------------------------------------------
    def _valid(self, entry):
        f = self.flows.get(entry[2])
        return f is not None and f[2] == entry[1]

    def _theta(self, c):
        return self.cap[c] / self.m[c]

    def _bound(self, c):
        """Push c's current theta to the heap of its mode."""
        if self.mode[c] == _HUB:
            heapq.heappush(self.hmin, (self.cap[c] / self.m[c], c))
        else:
            heapq.heappush(self.lmax, (-self.cap[c] / self.m[c], c))
        if len(self.hmin) + len(self.lmax) > 4 * self._active + 64:
            self.hmin = [(self._theta(c), c) for c in range(len(self.m)) if self.mode[c] == _HUB]
            self.lmax = [(-self._theta(c), c) for c in self.leaf]
            heapq.heapify(self.hmin)
            heapq.heapify(self.lmax)

    def _remove(self, fid):
        c = self.flows.pop(fid)[0]
        self.members[c].discard(fid)
        self.m[c] -= 1
        if self.mode[c] == _HUB:
            self.n_hub -= 1
        if self.m[c] == 0:
            if self.mode[c] == _LEAF:
                del self.leaf[c]
                self.s_leaf = sum(self.cap[k] for k in self.leaf)
            self.mode[c] = 0
            self.members[c] = None
            self._active -= 1
            return
        if self.mode[c] == _LEAF:
            self.leaf[c].rate = self._theta(c)
            self._bound(c)  # theta rose: the leaf bound must follow

    def _to_leaf(self, c):
        rec = _Leaf(self._theta(c))
        for fid in self.members[c]:
            f = self.flows[fid]
            self._gen += 1
            f[1] = f[1] - self.vg          # bytes left, on the class's fresh clock
            f[2] = self._gen
            heapq.heappush(rec.heap, (f[1], f[2], fid))
        self.mode[c] = _LEAF
        self.n_hub -= self.m[c]
        self.leaf[c] = rec
        self.s_leaf = sum(self.cap[k] for k in self.leaf)
        self._bound(c)

    def _to_hub(self, c):
        rec = self.leaf.pop(c)
        for fid in self.members[c]:
            f = self.flows[fid]
            self._gen += 1
            f[1] = self.vg + (f[1] - rec.clock)
            f[2] = self._gen
            heapq.heappush(self.gheap, (f[1], f[2], fid))
        self.mode[c] = _HUB
        self.n_hub += self.m[c]
        self.s_leaf = sum(self.cap[k] for k in self.leaf)
        self._bound(c)

    def _level(self):
        if self.n_hub:
            return (self.hub - self.s_leaf) / self.n_hub
        return inf if self.s_leaf <= self.hub * (1 + 1e-12) else -inf

    def _rebalance(self):
        """Move classes between hub- and leaf-limited until every hub-limited class could take more
        than lambda on its leaf and every leaf-limited one is held below lambda by its leaf."""
        h, x, mode, pop = self.hmin, self.lmax, self.mode, heapq.heappop
        for _ in range(4 * self._active + 8):
            lam = self._level()
            moved = False
            while h:
                th, c = h[0]
                if mode[c] != _HUB:
                    pop(h)
                elif th >= lam:
                    break
                elif self._theta(c) < lam:
                    pop(h)
                    self._to_leaf(c)
                    moved = True
                    break
                else:  # a loose bound: renew it
                    heapq.heapreplace(h, (self._theta(c), c))
            if moved:
                h, x = self.hmin, self.lmax
                continue
            while x:
                th, c = x[0]
                if mode[c] != _LEAF:
                    pop(x)
                elif -th <= lam * (1 + 1e-12):
                    break
                elif self._theta(c) > lam * (1 + 1e-12):
                    pop(x)
                    self._to_hub(c)
                    moved = True
                    break
                else:
                    heapq.heapreplace(x, (-self._theta(c), c))
            if not moved:
                break
            h, x = self.hmin, self.lmax
        lam = self._level()
        self.lam = max(lam, 0.0) if self.n_hub else inf
