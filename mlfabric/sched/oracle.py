"""The exact oracle for one batch (paper §10.1): joint ordering and forwarding (aggregation) as a
mixed-integer linear program solved with scipy.optimize.milp (HiGHS), for tiny instances (about
<= 5 updates, <= 2 aggregators, a few hosts). It measures how far the heuristics of §5
(mlfabric.sched.schedule: Alg. 2 then Alg. 3) are from optimal: `compare` gives, per instance,
heuristic / optimum for obj_async (eq. 17) and obj_sync (eq. 16). It also owns an independent plan
checker (`check_plan`) and the random tiny instances of the benchmark. Pure computation, like the
rest of mlfabric.sched; scipy is imported only to solve (the `mlfabric[oracle]` extra).

The model (details in docs/sched/oracle.md). Structure: every applied update takes a position
1..m and a next hop, the server or an aggregator slot (one aggregate per slot, Alg. 3); position
p <= dl(g) = v(g) + tau_max - v_init (eq. 9), so tau = v_init + p - v(g) <= tau_max; an aggregate's
members take consecutive positions (plan.py), it is as large as its largest member and leaves the
aggregator after its last member arrived (r_a). Time: continuous event times T_1 <= ... <= T_K.
Async: per position p, len(aggregators) free split points then the commit c_p; sync: the split
points then the makespan. Each r_a sits on a split point (binary). A direct update at p must be
done by c_p, an aggregate by the commit of its first member, an inbound update by r_a. The fixed
times (start, releases max(ready, start), every capacity breakpoint) cut time into pieces of
constant capacity; T_k is written incrementally over them (binary "piece full"), so the length of
[T_{k-1}, T_k] inside piece j is linear. Bytes are variables per (transfer, interval, piece); each
link carries at most capacity x length on each such sub-interval.

Why comparing with it is sound (the tests assert heuristic >= optimum, and check both directions):
- Every plan is inside, not only the heuristic's: for any plan whose rates respect capacity at
  every instant, put the events at its commits (or makespan) and last arrivals at aggregators and
  integrate its rates over the sub-intervals; capacity is constant on each, so the integral of the
  load is <= capacity x length. The objective at that point is the plan's own (commits c_p =
  Plan.commits). No grid is involved, so transfers may end anywhere (the trap of time-indexed
  models: a transfer ending mid-slot). `OracleModel.encode` builds that point; tests check it.
- Every solution is a plan: on each sub-interval capacities are constant, so sending each transfer's
  bytes there at a constant rate never exceeds capacity at any instant; arrivals are then no later
  than the commits the solver chose, so the plan's objective is no worse. The plan is read back from
  bytes and times only, checked by check_plan, and its objective recomputed from it.

Choices where the paper is silent:
- Commits: the server applies in position order, c_p = max(arrival at p, c_{p-1}) as
  scheduler.commits_of; obj_async is the mean commit (Plan.mean_commit; eq. 17 when arrivals follow
  the order), obj_sync the last arrival (Plan.makespan, eq. 16). Links may be shared at any rates
  (the paper's r_g(t), of which time-sharing is a special case).
- Dropping (async): a mean over fewer updates is not comparable with one over more, so `solve` is
  lexicographic by default: the most updates that can be applied within tau_max (exact by earliest
  deadline first over positions, since any capacity eventually lets any set be sent), then the least
  mean commit at that count. `applied=m` fixes the count instead; `compare` uses the heuristic's
  count, so its ratio is about timing at equal work, and reports the maximum count beside it.
- Sync: no deadlines, no drops, as schedule(mode='sync').
- Horizon and cutoff: with a known feasible plan (the heuristic's, and the updates sent one after
  another in deadline order), no better plan has a transfer ending after start + m (mean - start)
  (async: commits are >= start) or after the makespan (sync); the model's times stop there, and
  its objective is bounded by the known plan's (scipy's milp takes no starting solution; this
  prunes the same way). prune=False drops that bound, to encode a plan that is worse.
- Restrictions: update sizes > 0; every link's capacity > 0 after its last breakpoint (else some
  plans never finish and the horizon has no bound). Core links and paths are modelled like NICs.
- Tolerance: HiGHS solves to a relative gap of 1e-7 and 1e-7 feasibility; the read-back drops bytes
  that the rounded binaries forbid (solver noise) and rescales the rest, a change near 1e-7.
"""
import random
import time
from dataclasses import dataclass
from math import inf, isfinite

from . import scheduler
from .network import GBPS, Network, Segment
from .ordering import deadline
from .plan import DROP_NOT_CHOSEN, DROP_STALE, Aggregate, Commit, Plan, Transfer, Update

OBJECTIVES = ("async", "sync")

MIP_REL_GAP = 1e-7


# --- public entry points -----------------------------------------------------------------------

@dataclass
class OracleResult:
    """The oracle's answer for one batch. `plan` is the optimal plan read back from the solver
    (None when the time limit hit before any solution); `value` its objective recomputed from the
    plan (mean commit or makespan); `lower_bound` the solver's proven bound (no plan applying
    `applied` updates does better); `status` 'optimal', 'time-limit' or 'solver-error' (HiGHS
    gave up on numerics; rare)."""
    objective: str
    status: str
    plan: object
    value: float
    lower_bound: float
    applied: int
    applied_max: int
    variables: int
    binaries: int
    constraints: int

    @property
    def optimal(self):
        return self.status == "optimal"


def solve(updates, network, server, *, aggregators=(), tau_max=inf, v_init=0, start=0.0,
          objective="async", applied=None, only=None, time_limit=10.0, reference=None):
    """Optimal plan of one batch for `objective` ('async': eq. 17 under tau_max; 'sync': eq. 16).
    Arguments as mlfabric.sched.schedule. Async only: `applied`, the number of updates to apply
    (None: the most that can be, lexicographic); `only`, ids the plan may apply (others are
    dropped). `reference`: a feasible plan of the same batch (e.g. the heuristic's), which
    tightens the horizon and the cutoff. Returns within about `time_limit` seconds."""
    model = build_model(updates, network, server, aggregators=aggregators, tau_max=tau_max,
                        v_init=v_init, start=start, objective=objective, applied=applied,
                        only=only, reference=reference)
    return model.solve(time_limit=time_limit)


def max_applied(updates, tau_max=inf, v_init=0):
    """The most updates of a batch that can be applied within tau_max, and one such set in a valid
    order: earliest deadline first over positions (unit jobs with deadlines), which is exact
    because each update only needs a position p <= dl(g)."""
    chosen = []
    for u in sorted(updates, key=lambda u: (deadline(u, tau_max, v_init), u.id)):
        if deadline(u, tau_max, v_init) >= len(chosen) + 1:
            chosen.append(u.id)
    return len(chosen), chosen


def objective_value(plan, objective):
    """obj_async (mean commit over applied updates) or obj_sync (makespan) of a plan."""
    _check_objective(objective)
    return plan.mean_commit if objective == "async" else plan.makespan


# --- the model ---------------------------------------------------------------------------------

class _Rows:
    """A MILP under construction: variables (bounds, integrality, cost) and rows lo <= a.x <= hi."""

    def __init__(self):
        self.lb, self.ub, self.integer, self.cost = [], [], [], []
        self.rows = []

    def var(self, lb=0.0, ub=inf, integer=False, cost=0.0):
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(1 if integer else 0)
        self.cost.append(cost)
        return len(self.lb) - 1

    def binary(self):
        return self.var(0.0, 1.0, integer=True)

    def row(self, terms, lo=-inf, hi=inf):
        acc = {}
        for i, a in terms:
            acc[i] = acc.get(i, 0.0) + a
        self.rows.append((acc, lo, hi))


class OracleModel:
    """The §10.1 MILP of one batch (see the module header). Units inside: bytes / the largest
    update size, time since `start` / (that size / the largest capacity), so the solver sees
    numbers near 1. `solve()` runs it; `encode(plan)` turns a plan into a point of the model (to
    check that the heuristic's plans are inside it); `check_point(x)` lists the rows a point
    violates."""

    def __init__(self, updates, network, server, slots, tau_max, v_init, start, objective, count,
                 applied_max, horizon, cutoff=inf, only=None):
        self.updates = {u.id: u for u in updates}
        self.network, self.server, self.slots = network, server, list(slots)
        self.tau_max, self.v_init, self.start = tau_max, v_init, start
        self.objective, self.m = objective, count
        self.applied_max = applied_max
        self.hops = [server] + self.slots
        self.B = max(u.size for u in updates)
        cmax = max(v for link in network.links for v in link.v)
        self.TU = self.B / cmax
        self.H = (horizon - start) / self.TU
        self.cutoff = (cutoff - start) / self.TU
        dl = {g: deadline(u, tau_max, v_init) for g, u in self.updates.items()}
        # Updates that can take some position 1..m (async; among `only` if given), or all (sync).
        self.cand = [g for g in sorted(self.updates) if objective == "sync" or
                     (dl[g] >= 1 and (only is None or g in only))]
        self.dl = dl
        self.size = {g: self.updates[g].size / self.B for g in self.cand}
        self.release = {g: self._scale(max(self.updates[g].ready, start)) for g in self.cand}
        self._pieces()
        self._build()

    def _scale(self, t):
        return (t - self.start) / self.TU

    def _unscale(self, s):
        return self.start + s * self.TU

    def _pieces(self):
        """Fixed times cutting [0, H] into pieces of constant capacity; C[l][j] per link, piece."""
        cuts = {0.0}
        for link in self.network.links:
            for t in link.t:
                s = self._scale(t)
                if 0.0 < s < self.H:
                    cuts.add(s)
        for r in self.release.values():
            if r < self.H:
                cuts.add(r)
        self.b = sorted(cuts) + [self.H]
        self.P = len(self.b) - 1
        rate_unit = self.B / self.TU
        # read at each piece's middle: a breakpoint scaled and back may land a hair before itself
        self.C = [[link.at(self._unscale((self.b[j] + self.b[j + 1]) / 2)) / rate_unit
                   for j in range(self.P)] for link in self.network.links]

    def _build(self):
        R = self.R = _Rows()
        G, D, m, P = self.cand, range(len(self.hops)), self.m, self.P
        A = range(1, len(self.hops))
        sync = self.objective == "sync"
        # positions and next hops: w[g, p, d] (async), y[g, d] (sync)
        self.w, self.y, self.blk = {}, {}, {}
        Y = {(g, d): [] for g in G for d in D}   # expression: g's next hop is d
        if not sync:
            for g in G:
                for p in range(1, m + 1):
                    if p <= self.dl[g]:
                        for d in D:
                            v = self.w[g, p, d] = R.binary()
                            Y[g, d].append((v, 1.0))
            for p in range(1, m + 1):
                R.row([(self.w[g, p, d], 1.0) for g in G for d in D if (g, p, d) in self.w], 1, 1)
            for g in G:
                R.row([t for d in D for t in Y[g, d]], 0, 1)
            # an aggregate's members take consecutive positions: blk[p, a] >= [its block starts
            # at p], at most one start per slot
            for a in A:
                for p in range(1, m + 1):
                    s = self.blk[p, a] = R.var(0.0, 1.0)
                    terms = [(s, 1.0)] + [(self.w[g, p, a], -1.0) for g in G if (g, p, a) in self.w]
                    terms += [(self.w[g, p - 1, a], 1.0) for g in G if (g, p - 1, a) in self.w]
                    R.row(terms, 0, inf)
                R.row([(self.blk[p, a], 1.0) for p in range(1, m + 1)], -inf, 1)
        else:
            for g in G:
                for d in D:
                    v = self.y[g, d] = R.binary()
                    Y[g, d].append((v, 1.0))
                R.row([(self.y[g, d], 1.0) for d in D], 1, 1)
        self.Y = Y
        # aggregator slots in use (0/1 without being declared integer: the rows force it)
        self.used = {a: R.var(0.0, 1.0) for a in A}
        for a in A:
            for g in G:
                R.row([(self.used[a], 1.0)] + [(v, -c) for v, c in Y[g, a]], 0, inf)
            R.row([(self.used[a], 1.0)] + [(v, -c) for g in G for v, c in Y[g, a]], -inf, 0)

        # Events T_1 <= ... <= T_K. Async: per position p a group of len(A) free split points
        # then the commit c_p; sync: len(A) split points then the makespan. The last arrival at
        # aggregator a, r_a, is placed on one split point (e[a, k]); direct updates and
        # aggregates need no event of their own: they must be done by their commit.
        self.gs = gs = len(A) + 1
        self.K = K = gs * (1 if sync else m)
        splits = [k for k in range(1, K + 1) if k % gs]
        self.e = {(a, k): R.binary() for a in A for k in splits}
        for a in A:
            R.row([(self.e[a, k], 1.0) for k in splits] + [(self.used[a], -1.0)], 0, 0)
        for k in splits:  # one r_a per split point, used in order within a group (no symmetry)
            R.row([(self.e[a, k], 1.0) for a in A], -inf, 1)
            if (k + 1) % gs:
                R.row([(self.e[a, k], 1.0) for a in A] + [(self.e[a, k + 1], -1.0) for a in A],
                      0, inf)

        def F(a, k):  # [r_a is at an event >= k]
            return [(self.e[a, kk], 1.0) for kk in splits if kk >= k]

        def group(k):  # the position whose commit closes the group of event k
            return (k + gs - 1) // gs

        # event times over the fixed pieces: T_k = sum_j delta[k, j], filled in order
        ln = [self.b[j + 1] - self.b[j] for j in range(P)]
        self.delta = {(k, j): R.var(0.0, ln[j]) for k in range(1, K + 1) for j in range(P)}
        self.full = {(k, j): R.binary() for k in range(1, K + 1) for j in range(P - 1)}
        for k in range(1, K + 1):
            for j in range(P - 1):
                R.row([(self.delta[k, j], 1.0), (self.full[k, j], -ln[j])], 0, inf)
                R.row([(self.delta[k, j + 1], 1.0), (self.full[k, j], -ln[j + 1])], -inf, 0)
                if k > 1:
                    R.row([(self.full[k, j], 1.0), (self.full[k - 1, j], -1.0)], 0, inf)
            if k > 1:
                for j in range(P):
                    R.row([(self.delta[k, j], 1.0), (self.delta[k - 1, j], -1.0)], 0, inf)

        def T(k):
            return [(self.delta[k, j], 1.0) for j in range(P)]

        def L(k, j):  # length of interval k, [T_{k-1}, T_k], inside piece j
            return [(self.delta[k, j], 1.0)] + ([(self.delta[k - 1, j], -1.0)] if k > 1 else [])

        # bytes per (transfer, interval, piece): after the release, before the transfer's end
        self.x = {}
        on_link = {}

        def bytes_of(f, d, k, path, release, ub):
            row = []
            for j in range(P):
                if self.b[j] >= release:
                    v = self.x[f, d, k, j] = R.var(0.0, ub)
                    row.append((v, 1.0))
                    for link in path:
                        on_link.setdefault((link, k, j), []).append(v)
            return row

        for g in G:
            u = self.updates[g]
            for d in D:
                path = self.network.path(u.worker, self.hops[d])
                if not path:
                    continue  # same host: no network time
                terms = []
                for k in range(1, K + 1):
                    row = bytes_of(("u", g), d, k, path, self.release[g], self.size[g])
                    terms += row
                    if row and d == 0 and not sync:  # direct: done by its commit
                        R.row(row + [(self.w[g, p, 0], -self.size[g])
                                     for p in range(group(k), m + 1) if (g, p, 0) in self.w],
                              -inf, 0)
                    elif row and d > 0:  # at the aggregator by its last arrival r_a
                        R.row(row + [(v, -self.size[g]) for v, _ in F(d, k)], -inf, 0)
                R.row(terms + [(v, -self.size[g] * c) for v, c in Y[g, d]], 0, 0)
            # a member that needs no network arrives at its release
            for a in A:
                for k in splits:
                    R.row(T(k) + [(self.e[a, k], -self.release[g])]
                          + [(v, -self.release[g] * c) for v, c in Y[g, a]], -self.release[g], inf)
            if sync:  # so does an update on the server's host
                R.row(T(K), self.release[g], inf)
        smax = max(self.size.values(), default=1.0)
        self.agg_size = {}
        for a in A:
            path = self.network.path(self.hops[a], self.server)
            sa = self.agg_size[a] = R.var(0.0, smax)
            terms = []
            for k in range(1, K + 1):
                row = bytes_of(("a", a), 0, k, path, 0.0, smax)
                terms += row
                # it leaves the aggregator after r_a ...
                R.row(row + [(v, smax) for v, _ in F(a, k)], -inf, smax)
                if not sync:  # ... and is done by the commit of its first member
                    R.row(row + [(self.blk[p, a], smax) for p in range(1, group(k))], -inf, smax)
            R.row(terms + [(sa, -1.0)], 0, 0)
            for g in G:  # as large as its largest member
                R.row([(sa, 1.0)] + [(v, -self.size[g] * c) for v, c in Y[g, a]], 0, inf)
            R.row([(sa, 1.0), (self.used[a], -smax)], -inf, 0)
        # capacity of every link on every sub-interval
        for (link, k, j), vs in on_link.items():
            c = self.C[link][j]
            R.row([(v, 1.0) for v in vs] + [(v, -c * a) for v, a in L(k, j)], -inf, 0)
        if sync:
            # obj_sync: everything is done by the last event, so the makespan is T_K; no worse
            # than the best known plan (prunes as an incumbent would: milp takes no start point)
            self.z = R.var(0.0, min(self.H, self.cutoff), cost=1.0)
            R.row([(self.z, 1.0)] + [(v, -a) for v, a in T(K)], 0, 0)
            return
        # obj_async: the commits are the group-closing events; each is no earlier than the
        # fastest its update's path allows, and their mean is no worse than the best known plan
        earliest = self._earliest()
        self.c = {p: R.var(0.0, self.H, cost=1.0 / m) for p in range(1, m + 1)}
        for p in range(1, m + 1):
            R.row([(self.c[p], 1.0)] + [(v, -a) for v, a in T(p * gs)], 0, 0)
            R.row([(self.c[p], 1.0)] + [(self.w[g, p, d], -earliest[g, d][1]) for g in G
                                        for d in D if (g, p, d) in self.w], 0, inf)
        R.row([(self.c[p], 1.0 / m) for p in range(1, m + 1)], -inf, self.cutoff)

    def _earliest(self):
        """(arrival at hop d, arrival at the server) of update g sent via hop d, at the largest
        capacity its links ever have: lower bounds that tighten the relaxation."""
        top = [max(link.v) for link in self.network.links]
        rate_unit = self.B / self.TU

        def leg(src, dst, size):
            path = self.network.path(src, dst)
            return size / (min(top[l] for l in path) / rate_unit) if path else 0.0

        out = {}
        for g in self.cand:
            u = self.updates[g]
            for d, h in enumerate(self.hops):
                at_hop = self.release[g] + leg(u.worker, h, self.size[g])
                out[g, d] = (at_hop, at_hop + (leg(h, self.server, self.size[g]) if d else 0.0))
        return out

    # --- solving ------------------------------------------------------------------------------

    def _arrays(self):
        import numpy as np
        from scipy.sparse import csr_array
        R = self.R
        data, rows, cols, lo, hi = [], [], [], [], []
        for i, (terms, a, b) in enumerate(R.rows):
            for j, v in terms.items():
                rows.append(i)
                cols.append(j)
                data.append(v)
            lo.append(a)
            hi.append(b)
        A = csr_array((data, (rows, cols)), shape=(len(R.rows), len(R.lb)))
        return (np.array(R.cost), np.array(R.integer), np.array(R.lb), np.array(R.ub), A,
                np.array(lo), np.array(hi))

    @property
    def size_info(self):
        return len(self.R.lb), sum(self.R.integer), len(self.R.rows)

    def solve(self, time_limit=10.0):
        """Run HiGHS for at most `time_limit` seconds; an OracleResult."""
        if not time_limit > 0:
            raise ValueError("time_limit must be > 0 seconds, got %r" % (time_limit,))
        nvar, nbin, nrow = self.size_info
        if self.m == 0:
            plan = self._plan_of(None)
            return OracleResult(self.objective, "optimal", plan,
                                objective_value(plan, self.objective), 0.0, 0, self.applied_max,
                                nvar, nbin, nrow)
        milp, Bounds, LinearConstraint = _scipy()
        deadline_at = time.monotonic() + time_limit
        presolve = True
        while True:
            c, integ, lb, ub, A, lo, hi = self._arrays()
            res = milp(c, integrality=integ, bounds=Bounds(lb, ub),
                       constraints=LinearConstraint(A, lo, hi),
                       options={"time_limit": max(deadline_at - time.monotonic(), 1e-3),
                                "mip_rel_gap": MIP_REL_GAP, "presolve": presolve,
                                "disp": False})
            if time.monotonic() >= deadline_at:
                break
            if res.status == 4 and presolve:
                # HiGHS sometimes rejects its own optimum after presolve for infeasibilities
                # of 1e-6 ("Solve error"); without presolve it then succeeds
                presolve = False
            elif res.status == 2 and self.cutoff < inf:
                # the known plan sits on the cutoff, within the solver's tolerance: drop it
                self.cutoff = inf
                self._build()
            else:
                break
        nvar, nbin, nrow = self.size_info
        bound = getattr(res, "mip_dual_bound", None)
        bound = self._unscale(bound) if bound is not None and isfinite(bound) else -inf
        if res.status == 0:
            status = "optimal"
        elif res.status == 1 or time.monotonic() >= deadline_at:
            status = "time-limit"
        elif res.status == 4:
            status = "solver-error"
        else:
            raise RuntimeError("the oracle's MILP is %s: a feasible plan always exists, so this "
                               "is a modelling bug" % res.message)
        plan = self._plan_of(res.x) if res.x is not None else None
        value = objective_value(plan, self.objective) if plan is not None else inf
        return OracleResult(self.objective, status, plan, value, bound, self.m, self.applied_max,
                            nvar, nbin, nrow)

    # --- reading a solution back -------------------------------------------------------------

    def _plan_of(self, x):
        """The Plan a solution vector describes, built from times and bytes only."""
        plan = Plan(server=self.server, v_init=self.v_init, tau_max=self.tau_max,
                    updates=dict(self.updates), start=self.start)
        if x is None:
            for g in self.updates:
                plan.dropped[g] = self._drop_reason(g)
            return plan
        x = [float(v) for v in x]   # plain floats in the plan, not numpy scalars
        D, K, P = range(len(self.hops)), self.K, self.P
        sync = self.objective == "sync"
        if not sync:
            at = {}  # position -> (update, hop)
            for (g, p, d), v in self.w.items():
                if x[v] > 0.5:
                    at[p] = (g, d)
            hop = {g: d for g, d in at.values()}
            rank = {g: p for p, (g, _) in at.items()}
        else:
            hop = {g: max(D, key=lambda d: x[self.y[g, d]]) for g in self.cand}
            rank = None  # sync: blocks are applied in arrival order, found below

        # event times, made monotone; sub-interval (k, j) = [T_{k-1}, T_k] inside piece j, with
        # end points computed once, so neighbouring segments meet exactly
        T = [0.0]
        for k in range(1, K + 1):
            T.append(max(T[-1], sum(x[self.delta[k, j]] for j in range(P))))

        kend = {a: k for (a, k), v in self.e.items() if x[v] > 0.5}
        gs = self.gs

        def allowed(f, d, k):
            """Whether the rounded solution lets flow f to hop d send in interval k."""
            group = (k + gs - 1) // gs
            if f[0] == "a":
                first = None if sync else min(rank[g] for g in hop if hop[g] == f[1])
                return kend[f[1]] < k and (sync or group <= first)
            if d > 0:
                return k <= kend[d]
            return sync or group <= rank[f[1]]

        def segments(f, d, target):
            """Segments of flow f to hop d. Bytes the solver left, within its tolerance, where the
            rounded solution forbids them are dropped and the rest scaled to exactly `target`
            bytes (a relative change of the order of the solver's tolerance)."""
            raw = []
            for k in range(1, K + 1):
                if not allowed(f, d, k):
                    continue
                for j in range(P):
                    v = self.x.get((f, d, k, j))
                    if v is None or x[v] <= 1e-12:
                        continue
                    lo, hi = max(T[k - 1], self.b[j]), min(T[k], self.b[j + 1])
                    # a stretch of ~0 length holds only tolerance-level bytes; keeping them
                    # would show as a huge rate over that instant
                    if hi - lo > 1e-9:
                        raw.append((self._unscale(lo), self._unscale(hi), x[v] * self.B))
            total = sum(r[2] for r in raw)
            if not raw or total <= 0:
                return ()
            return tuple(Segment(t0, t1, by * target / total / (t1 - t0))
                         for t0, t1, by in sorted(raw))

        def transfer(g, dst, d):
            u = self.updates[g]
            return _transfer(u.worker, dst, u.size, max(u.ready, self.start),
                             segments(("u", g), d, u.size), "update", (g,))

        # blocks: (key, arrival, ids, via, direct transfer or aggregate)
        blocks = []
        for g, d in hop.items():
            if d == 0:
                t = transfer(g, self.server, 0)
                blocks.append(((rank or {}).get(g), t.end, (g,), t.src, t))
        for d in sorted(set(hop.values()) - {0}):
            members = sorted((g for g in hop if hop[g] == d),
                             key=lambda g: rank[g] if rank is not None else g)
            inbound = [transfer(g, self.hops[d], d) for g in members]
            size = max(self.updates[g].size for g in members)
            t = _transfer(self.hops[d], self.server, size, max(t.end for t in inbound),
                          segments(("a", d), 0, size), "aggregate", tuple(members))
            agg = Aggregate(self.hops[d], self.server, members, inbound, t)
            blocks.append((rank[members[0]] if rank is not None else None, t.end, tuple(members),
                           self.hops[d], agg))
        blocks.sort(key=lambda b: (b[0], b[2]) if rank is not None else (b[1], b[2]))
        plan.order = [g for b in blocks for g in b[2]]
        for g in self.updates:
            if g not in hop:
                plan.dropped[g] = self._drop_reason(g)
        last = self.start
        for _, arrival, ids, via, what in blocks:
            if isinstance(what, Aggregate):
                plan.aggregates.append(what)
            else:
                plan.direct.append(what)
            last = max(last, arrival)
            plan.commits.append(Commit(last, ids, via))
        return plan

    def _drop_reason(self, g):
        if self.objective == "async" and self.dl[g] < 1:
            return DROP_STALE
        return DROP_NOT_CHOSEN

    # --- a plan as a point of the model ------------------------------------------------------

    def encode(self, plan):
        """The model's variable vector for `plan` (any plan of this batch applying the model's
        count, e.g. the heuristic's): closing events at its commits (async) or makespan (sync),
        split points at the last arrival at each aggregator, its rates integrated over every
        sub-interval. Raises ValueError if the plan does not fit the model's shape."""
        import numpy as np
        R = self.R
        x = np.zeros(len(R.lb))
        if len(plan.order) != self.m:
            raise ValueError("the plan applies %d updates, the model %d"
                             % (len(plan.order), self.m))
        hop_of, slot_of = {}, {}
        free = list(range(1, len(self.hops)))
        for agg in plan.aggregates:
            a = next((a for a in free if self.hops[a] == agg.aggregator), None)
            if a is None:
                raise ValueError("aggregator %r is not one of the model's slots" % agg.aggregator)
            free.remove(a)
            slot_of[id(agg)] = a
            for h in agg.members:
                hop_of[h] = a
        for g in plan.order:
            hop_of.setdefault(g, 0)
        pos = {g: p for p, g in enumerate(plan.order, 1)}
        for g, d in hop_of.items():
            if self.objective == "async":
                x[self.w[g, pos[g], d]] = 1
            else:
                x[self.y[g, d]] = 1
        if self.objective == "async":
            for a in range(1, len(self.hops)):
                for p in range(1, self.m + 1):
                    q = hop_of.get(plan.order[p - 1]) == a
                    qp = p > 1 and hop_of.get(plan.order[p - 2]) == a
                    x[self.blk[p, a]] = 1.0 if (q and not qp) else 0.0
        # transfers: (key of their bytes, transfer, hop); r_a: last arrival at each aggregator
        moves = [(("u", t.ids[0]), t, 0) for t in plan.direct]
        last_in = []
        for agg in plan.aggregates:
            a = slot_of[id(agg)]
            x[self.used[a]] = 1
            x[self.agg_size[a]] = agg.transfer.size / self.B
            moves += [(("u", t.ids[0]), t, a) for t in agg.inbound]
            moves.append((("a", a), agg.transfer, 0))
            last_in.append((self._scale(agg.ready), a))
        last_in.sort()
        gs = self.gs
        if self.objective == "sync":
            closing = [self._scale(plan.makespan)]
        else:
            closing = [self._scale(plan.commit_time(g)) for g in plan.order]
        # events: per group, the r_a that fall in it (after the previous closing event), then
        # unused split points at the last time, then the closing event
        times, prev = [], 0.0
        for p, close in enumerate(closing, 1):
            inside = [(s, a) for s, a in last_in if s <= close and (p == 1 or s > closing[p - 2])]
            for i, (s, a) in enumerate(inside):
                x[self.e[a, (p - 1) * gs + i + 1]] = 1
                times.append(s)
            times += [times[-1] if inside else prev] * (gs - 1 - len(inside))
            times.append(close)
            prev = close
        for k, s in enumerate(times, 1):
            for j in range(self.P):
                x[self.delta[k, j]] = min(max(s - self.b[j], 0.0), self.b[j + 1] - self.b[j])
                if j < self.P - 1:
                    x[self.full[k, j]] = 1.0 if s >= self.b[j + 1] else 0.0
        bounds = [0.0] + times
        for f, t, d in moves:
            for k in range(1, self.K + 1):
                for j in range(self.P):
                    lo = max(bounds[k - 1], self.b[j])
                    hi = min(bounds[k], self.b[j + 1])
                    if hi <= lo:
                        continue
                    got = sum(s.rate * (min(hi, self._scale(s.t1)) - max(lo, self._scale(s.t0)))
                              for s in t.segments if self._scale(s.t1) > lo and
                              self._scale(s.t0) < hi) * self.TU / self.B
                    if got > 0:
                        v = self.x.get((f, d, k, j))
                        if v is None:
                            raise ValueError("transfer %r sends before its release" % (t,))
                        x[v] = got
        if self.objective == "async":
            for p in range(1, self.m + 1):
                x[self.c[p]] = self._scale(plan.commit_time(plan.order[p - 1]))
        else:
            x[self.z] = self._scale(plan.makespan)
        return x

    def check_point(self, x, tol=1e-6):
        """Rows, bounds and integrality a point violates (strings); [] when it is feasible."""
        R = self.R
        bad = []
        for i, v in enumerate(x):
            if v < R.lb[i] - tol or v > R.ub[i] + tol:
                bad.append("variable %d = %r outside [%r, %r]" % (i, v, R.lb[i], R.ub[i]))
            if R.integer[i] and abs(v - round(v)) > tol:
                bad.append("variable %d = %r is not integral" % (i, v))
        for n, (terms, lo, hi) in enumerate(R.rows):
            s = sum(a * x[j] for j, a in terms.items())
            scale = tol * max(1.0, max((abs(a * x[j]) for j, a in terms.items()), default=0.0))
            if s < lo - scale or s > hi + scale:
                bad.append("row %d: %r not in [%r, %r]" % (n, s, lo, hi))
        return bad

    def value_of(self, x):
        """The model's objective at point x, in seconds."""
        return self._unscale(sum(c * v for c, v in zip(self.R.cost, x)))


def build_model(updates, network, server, *, aggregators=(), tau_max=inf, v_init=0, start=0.0,
                objective="async", applied=None, only=None, reference=None, prune=True):
    """The OracleModel of one batch (see solve for the arguments). prune=True bounds the objective
    by the best known plan (faster; the model then holds every plan at least as good as that one);
    prune=False holds every plan within the horizon, e.g. to encode a worse plan."""
    _check_objective(objective)
    updates = list(updates)
    _check_batch(updates, network, server, tau_max, start)
    slots = [a for a in aggregators if a != server]
    for a in slots:
        network._check_host(a)
    if reference is not None:
        # it bounds the search: a plan that is not one of this batch could cut off the optimum
        wrong = ([] if set(reference.updates) == {u.id for u in updates}
                 else ["it schedules updates %r" % sorted(reference.updates)])
        wrong = wrong or check_plan(reference, network)
        if wrong:
            raise ValueError("reference is not a valid plan of this batch: %s" % "; ".join(wrong))
    if objective == "sync":
        if applied not in (None, len(updates)):
            raise ValueError("obj_sync applies every update; applied=%r is not %d"
                             % (applied, len(updates)))
        tau_max = inf
        chosen = [u.id for u in sorted(updates, key=lambda u: u.id)]
        count = len(updates)
        if only is not None:
            raise ValueError("obj_sync applies every update; only=%r is not for it" % (only,))
    else:
        most_all, _ = max_applied(updates, tau_max, v_init)
        if only is not None:
            only = set(only)
            ids = {u.id for u in updates}
            if not only <= ids:
                raise ValueError("only=%r names updates not in the batch: %r"
                                 % (sorted(only), sorted(only - ids)))
        most, chosen = max_applied([u for u in updates if only is None or u.id in only],
                                   tau_max, v_init)
        count = most if applied is None else applied
        if not (isinstance(count, int) and 0 <= count <= most):
            raise ValueError("applied=%r: between 0 and %d updates of this batch can be applied "
                             "within tau_max=%r" % (applied, most, tau_max))
    horizon, cutoff = _horizon(updates, network, server, chosen[:count], objective, start,
                               reference)
    return OracleModel(updates, network, server, slots, tau_max, v_init, start, objective, count,
                       most_all if objective == "async" else count, horizon,
                       cutoff if prune else inf, only)


def _horizon(updates, network, server, ids, objective, start, reference):
    """(horizon, cutoff): the best objective value of a known feasible plan, and a time by which
    every transfer of any plan at least as good has ended. Known plans: `ids` sent one after
    another straight to the server (always feasible), and `reference` if it applies as many."""
    if not ids:
        return start + 1.0, inf
    plans = [_sequential_plan(updates, network, server, ids, start)]
    if reference is not None and len(reference.order) == len(ids):
        plans.append(reference)
    m = len(ids)
    cutoff = min(objective_value(p, objective) for p in plans)
    # async: commits are >= start, so the last of m with mean <= cutoff is <= start + m (cutoff
    # - start); sync: nothing ends after the makespan
    h = start + m * (cutoff - start) if objective == "async" else cutoff
    for p in plans:
        h = max([h] + [t.end for t in p.transfers()] + [c.time for c in p.commits])
    # Slack well above the solver's tolerances. Within about 1e-6 of a bound, HiGHS's presolve
    # may move the optimum onto the bound (seen: a known optimal plan came back 1e-6 late).
    return h + 1e-3 * (h - start) + 1e-12, cutoff + 1e-3 * (cutoff - start) + 1e-12


def _transfer(src, dst, size, release, segs, what, ids):
    """A Transfer from its segments; one that needs no network arrives at its release."""
    if not segs:
        return Transfer(src, dst, size, release, release, (), what, ids)
    return Transfer(src, dst, size, segs[0].t0, segs[-1].t1, segs, what, ids)


def _sequential_plan(updates, network, server, ids, start):
    """A feasible plan: `ids` in this order, all direct, each taking the residual rate (t_en)."""
    by_id = {u.id: u for u in updates}
    nw = network.copy()
    plan = Plan(server=server, v_init=0, tau_max=inf, updates=by_id, order=list(ids), start=start)
    for g in ids:
        u = by_id[g]
        rel = max(u.ready, start)
        end, segs = nw.send(u.worker, server, u.size, rel)
        plan.direct.append(Transfer(u.worker, server, u.size, segs[0].t0 if segs else end, end,
                                    segs or (), "update", (g,)))
    plan.commits = scheduler.commits_of(plan.direct, [], start)
    return plan


# --- validation --------------------------------------------------------------------------------

def _check_objective(objective):
    if objective not in OBJECTIVES:
        raise ValueError("objective must be one of %s, got %r" % (", ".join(OBJECTIVES), objective))


def _check_batch(updates, network, server, tau_max, start):
    if not isinstance(network, Network):
        raise ValueError("network must be a mlfabric.sched.Network, got %r" % (type(network),))
    network._check_host(server)
    if not updates:
        raise ValueError("the oracle needs at least one update")
    if len({u.id for u in updates}) != len(updates):
        raise ValueError("update ids must be unique within a batch")
    for u in updates:
        if not isinstance(u, Update):
            raise ValueError("updates must be mlfabric.sched.Update, got %r" % (u,))
        if not u.size > 0:
            raise ValueError("the oracle needs update sizes > 0, update %r has size %r"
                             % (u.id, u.size))
        network._check_host(u.worker)
    if not tau_max >= 0:
        raise ValueError("tau_max must be >= 0, got %r" % (tau_max,))
    if not (isfinite(start) and start >= 0):
        raise ValueError("start must be a finite time >= 0, got %r" % (start,))
    for k, link in enumerate(network.links):
        if not link.v[-1] > 0:
            raise ValueError("link %d has no capacity after t=%g: the oracle needs every link's "
                             "capacity positive from its last breakpoint on" % (k, link.t[-1]))


def _scipy():
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError as e:
        raise ImportError("mlfabric.sched.oracle needs scipy >= 1.9 (scipy.optimize.milp); "
                          "install the extra: pip install 'mlfabric[oracle]'") from e
    return milp, Bounds, LinearConstraint


# --- independent plan checker --------------------------------------------------------------------

def check_plan(plan, network, *, tol=1e-5):
    """Everything wrong with `plan` as a schedule on `network` (strings; [] when it is valid),
    computed from the plan's transfers and the network alone: every update applied once or dropped,
    delays <= tau_max, aggregate members at consecutive positions and the aggregate as large as
    its largest member, no byte sent before its release (max(ready, start); an aggregate: after its
    last member arrived), every transfer's bytes delivered, no link over capacity at any instant,
    and commits in order at max(arrival, previous commit) or later."""
    bad = []
    ups = plan.updates
    if len(set(plan.order)) != len(plan.order):
        bad.append("an update is applied twice: %r" % (plan.order,))
    if set(plan.order) & set(plan.dropped):
        bad.append("updates both applied and dropped: %r"
                   % sorted(set(plan.order) & set(plan.dropped)))
    if set(plan.order) | set(plan.dropped) != set(ups):
        bad.append("updates neither applied nor dropped: %r"
                   % sorted(set(ups) - set(plan.order) - set(plan.dropped)))
    pos = {g: p for p, g in enumerate(plan.order, 1)}
    for g, p in pos.items():
        tau = plan.v_init + p - ups[g].version
        if tau > plan.tau_max:
            bad.append("update %r at position %d has delay %r > tau_max %r" % (g, p, tau,
                                                                              plan.tau_max))
    # which block carries each applied update, and when it arrives at the server
    blocks = []
    for t in plan.direct:
        if t.dst != plan.server or len(t.ids) != 1 or t.src != ups[t.ids[0]].worker:
            bad.append("direct transfer %r is not from its worker to the server" % (t,))
        blocks.append((t.ids, t.end, t.src))
    carried = [i for t in plan.direct for i in t.ids]
    for a in plan.aggregates:
        carried += list(a.members)
        ps = [pos.get(g) for g in a.members]
        if None in ps or ps != list(range(ps[0], ps[0] + len(ps))):
            bad.append("aggregate at %r: members %r are not at consecutive positions"
                       % (a.aggregator, a.members))
        if [t.ids for t in a.inbound] != [(g,) for g in a.members]:
            bad.append("aggregate at %r: inbound transfers do not match its members" % a.aggregator)
        for t in a.inbound:
            if t.src != ups[t.ids[0]].worker or t.dst != a.aggregator:
                bad.append("inbound transfer %r is not from its worker to aggregator %r"
                           % (t, a.aggregator))
        if a.transfer.src != a.aggregator or a.transfer.dst != plan.server:
            bad.append("aggregate transfer %r is not from %r to the server" % (a.transfer,
                                                                             a.aggregator))
        if a.transfer.size < max(ups[g].size for g in a.members) * (1 - tol):
            bad.append("aggregate at %r is smaller than its largest member" % a.aggregator)
        blocks.append((tuple(a.members), a.transfer.end, a.aggregator))
    if sorted(carried) != sorted(plan.order):
        bad.append("applied updates %r but transfers carry %r" % (sorted(plan.order),
                                                                  sorted(carried)))
    # each transfer: release, bytes, end
    releases = {}
    for t in plan.direct:
        releases[id(t)] = max(ups[t.ids[0]].ready, plan.start)
    for a in plan.aggregates:
        for t in a.inbound:
            releases[id(t)] = max(ups[t.ids[0]].ready, plan.start)
        releases[id(a.transfer)] = max([t.end for t in a.inbound] + [plan.start])
    transfers = list(plan.direct) + [t for a in plan.aggregates for t in a.inbound + [a.transfer]]
    for t in transfers:
        rel = releases[id(t)]
        eps = tol * max(1.0, abs(rel), abs(t.end))
        path = network.path(t.src, t.dst)
        if not path:
            if t.end < rel - eps:
                bad.append("transfer %r arrives before its release %r" % (t.ids, rel))
            continue
        sent = 0.0
        prev = -inf
        for s in t.segments:
            if s.t0 < rel - eps:
                bad.append("transfer %r sends at %r, before its release %r" % (t.ids, s.t0, rel))
            if s.t0 < prev - eps or s.t1 < s.t0 or s.rate < 0:
                bad.append("transfer %r has overlapping or negative segments" % (t.ids,))
            if s.t1 > t.end + eps:
                bad.append("transfer %r sends at %r, after its end %r" % (t.ids, s.t1, t.end))
            prev = s.t1
            sent += s.rate * (s.t1 - s.t0)
        if sent < t.size * (1 - tol):
            bad.append("transfer %r delivers %r of %r bytes" % (t.ids, sent, t.size))
    # capacity of every link at every instant, up to tol of the largest transfer in bytes per
    # stretch (the solver's own tolerance; a modelling error moves far more)
    slack = tol * max((t.size for t in transfers), default=0.0)
    load = {}
    for t in transfers:
        for link in network.path(t.src, t.dst):
            load.setdefault(link, []).extend(t.segments)
    for link, segs in load.items():
        prof = network.links[link]
        cuts = sorted({s.t0 for s in segs} | {s.t1 for s in segs}
                      | {x for x in prof.t if segs and x < max(s.t1 for s in segs)})
        for lo, hi in zip(cuts, cuts[1:]):
            if hi <= lo:
                continue
            mid = (lo + hi) / 2
            used = sum(s.rate for s in segs if s.t0 <= mid < s.t1)
            cap = prof.at(mid)
            if (used - cap * (1 + tol)) * (hi - lo) > slack:
                bad.append("link %d carries %r > capacity %r over [%r, %r]" % (link, used, cap,
                                                                               lo, hi))
    # commits: the order's blocks, in order, never before arrival, never going back in time
    arrival = {ids: (end, via) for ids, end, via in blocks}
    if [g for c in plan.commits for g in c.ids] != list(plan.order):
        bad.append("commits %r do not follow the order %r" % ([c.ids for c in plan.commits],
                                                              plan.order))
    last = plan.start
    for c in plan.commits:
        eps = tol * max(1.0, abs(c.time))
        if c.ids not in arrival:
            bad.append("commit %r is not one transfer's or aggregate's updates" % (c.ids,))
            continue
        end, via = arrival[c.ids]
        if c.time < end - eps or c.time < last - eps:
            bad.append("commit %r at %r before its arrival %r or the previous commit %r"
                       % (c.ids, c.time, end, last))
        if c.via != via:
            bad.append("commit %r says via %r, it arrives from %r" % (c.ids, c.via, via))
        last = max(last, c.time)
    return bad


# --- heuristic against optimum -----------------------------------------------------------------

@dataclass(frozen=True)
class Instance:
    """One batch to schedule: the arguments of mlfabric.sched.schedule."""
    updates: tuple
    network: Network
    server: int
    aggregators: tuple = ()
    tau_max: float = inf
    v_init: int = 0
    start: float = 0.0
    seed: int = 0

    def kwargs(self):
        return dict(aggregators=self.aggregators, tau_max=self.tau_max, v_init=self.v_init,
                    start=self.start)


@dataclass
class Comparison:
    """Heuristic against optimum on one instance for one objective. `ratio` = heuristic / optimum
    (>= 1; None when the solver timed out), both at the heuristic's applied count;
    `applied_max` is the most updates any plan can apply within tau_max (lexicographic first
    stage: the heuristic is lexicographically optimal only if applied == applied_max and ratio
    is 1). Async only: `optimum_same_updates` applies exactly the heuristic's updates (not just
    as many), so `ratio_same_updates` leaves out the choice of what to drop."""
    objective: str
    status: str
    heuristic: float
    optimum: float
    lower_bound: float
    applied: int
    applied_max: int
    heuristic_plan: object = None
    oracle_plan: object = None
    status_same_updates: str = None
    optimum_same_updates: float = None

    @property
    def ratio(self):
        if self.status != "optimal":
            return None
        return _ratio(self.heuristic, self.optimum)

    @property
    def ratio_same_updates(self):
        if self.status_same_updates != "optimal":
            return None
        return _ratio(self.heuristic, self.optimum_same_updates)


def _ratio(h, opt):
    if abs(h - opt) <= 1e-12 + 1e-9 * abs(h):
        return 1.0  # equal up to rounding (both 0 when every update is on the server's host)
    return h / opt if opt > 0 else inf


def compare_one(inst, objective, *, time_limit=10.0):
    """Comparison of schedule(mode=objective) with the oracle at the heuristic's applied count."""
    _check_objective(objective)
    plan, _ = scheduler.schedule(list(inst.updates), inst.network, inst.server, seed=inst.seed,
                                 mode=objective, **inst.kwargs())
    h = objective_value(plan, objective)
    model = build_model(inst.updates, inst.network, inst.server, objective=objective,
                        applied=len(plan.order) if objective == "async" else None,
                        reference=plan, **inst.kwargs())
    res = model.solve(time_limit=time_limit)
    out = Comparison(objective, res.status, h, res.value, res.lower_bound, len(plan.order),
                     res.applied_max, plan, res.plan)
    if objective == "async":
        same = build_model(inst.updates, inst.network, inst.server, objective=objective,
                           only=plan.order, reference=plan, **inst.kwargs()).solve(time_limit)
        out.status_same_updates, out.optimum_same_updates = same.status, same.value
    return out


def compare(instances, *, objectives=OBJECTIVES, time_limit=10.0):
    """Per instance, {objective: Comparison} of the heuristic (mlfabric.sched.schedule) against
    the optimum; instances whose solve hits `time_limit` have status 'time-limit' and ratio None."""
    return [{obj: compare_one(inst, obj, time_limit=time_limit) for obj in objectives}
            for inst in instances]


# --- random tiny instances -----------------------------------------------------------------------

RATES_GBPS = (1, 2.5, 3.3, 5, 10)   # the NIC rates of the paper's emulation (§7)
SIZES_MB = (5, 10, 20, 25)
CHANGE_TIMES = (0.01, 0.03)         # seconds; a shared grid keeps the number of pieces small


def random_instance(rng, *, updates=(2, 5), aggregators=(0, 2), hosts=(3, 5), p_change=0.25,
                    p_late=0.2, tau_max=(1, 4)):
    """A tiny random batch drawn from `rng` (random.Random or a seed): `hosts` hosts (server 0),
    NIC rates from the §7 set, each NIC direction changing rate once with probability p_change at
    a time from CHANGE_TIMES, `updates` updates of SIZES_MB from random non-server workers,
    computed 0..tau_max versions behind v_init (so deadlines bind; tau_max behind fits no position
    and is stale), ready at 0 or, with probability p_late, 5 or 15 ms later; 0..2 aggregators
    among the non-server hosts."""
    rng = rng if isinstance(rng, random.Random) else random.Random(rng)
    nh = rng.randint(*hosts)

    def trace():
        r = rng.choice(RATES_GBPS) * GBPS
        if rng.random() < p_change:
            return [(0.0, r), (rng.choice(CHANGE_TIMES), rng.choice(RATES_GBPS) * GBPS)]
        return r

    net = Network([trace() for _ in range(nh)], [trace() for _ in range(nh)])
    server = 0
    others = list(range(1, nh))
    aggs = tuple(rng.sample(others, min(len(others), rng.randint(*aggregators))))
    tmax = rng.randint(*tau_max)
    v_init = 10
    n = rng.randint(*updates)
    ups = tuple(Update(i, rng.choice(others), rng.choice(SIZES_MB) * 1e6,
                       v_init - rng.randint(0, tmax), rng.choice(CHANGE_TIMES) / 2
                       if rng.random() < p_late else 0.0)
                for i in range(n))
    return Instance(ups, net, server, aggs, tmax, v_init, 0.0, rng.randrange(1 << 30))
