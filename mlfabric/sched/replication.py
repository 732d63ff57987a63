"""Bounded-divergence replication (paper §5.3; sync SGD §6): after a batch's server schedule is
computed ("tentative"), schedule copies of the same updates, in the same order, to a replica through
its own k' aggregators, in the capacity the server left; keep (freeze) the prefix the replica
receives in time, punt the rest to the next batch, and when the replica would end the batch more
than Div_max away from the server, delay the server's last transfer until the replica has caught up
enough. Divergence is bounded from update norms only (eq. 11, divergence.py).

One batch:
1. The replica's sequence: the updates punted by earlier batches (in order), then this batch's
   applied order. Tentative replica schedule: Alg. 3 (aggregation.aggregate) to the replica with the
   replica's aggregators, on the network after the server's reservations.
2. T_last = the server's last commit of the batch. The replica is at position p(T): the updates of
   its commits at or before T. If the eq. 11 bound at T_last (server fully committed) is <= Div_max,
   freeze the replica commits done by T_last; punt the rest.
3. Otherwise a_e = the earliest replica commit after which the bound holds (the bound only falls as
   the replica advances, so "earliest" is well defined and a_e > T_last). Freeze up to a_e, punt the
   rest, and move the server's last transfer so it starts at a_e (Fig. 3b): the server's batch then
   ends after the replica has reached a_e.
Punted transfers keep no reservation: the network is rebuilt with the frozen ones only.

Choices where the paper is silent, and why:
- Freezing goes by replica commit, not by single transfer: an aggregate is frozen with its inbound
  transfers when the aggregate itself reaches the replica by the cut-off; a worker->aggregator
  transfer that arrived in time but whose aggregate would not is punted too. Otherwise an aggregator
  would hold a partial sum across batches and the next batch's grouping would depend on this one's.
- The bound is enforced at the batch's end (async and SSP): the paper checks at T_last only; between
  commits within a batch it may be exceeded.
- Sync (§6): an iteration is one momentum step (divergence.py), and the bound must hold only at the
  iteration's end. With sync=True, batches with iteration_end=False never delay the server (their
  replica transfers done by T_last are frozen, the rest punted); the batch that ends the iteration
  enforces the bound. The divergence reported mid-iteration compares the models with the open
  iteration's updates added linearly on both sides.
- If the bound cannot be restored (the replica's path has no capacity left, or the delayed server
  transfer could never finish), the server is not delayed: replica commits done by T_last are frozen
  and the ReplicaPlan says bound_met=False. Stalling the server forever would not help training.
- A batch without server commits has nothing to delay; if the bound is violated (Div_max lowered)
  the replica is caught up to a_e all the same.
- When some update can never reach the replica, every case of Alg. 3 is infinite: the all-direct
  case is kept as the tentative schedule (its finite prefix can still be frozen).
- The delayed transfer's old reservation is returned to the network (added back) so the next batch
  can use it; floating-point error of that addition is one rounding per link segment.
- Update ids must be unique across batches (punted updates travel with the next batch).
"""
from dataclasses import dataclass, field, replace
from math import inf, isnan

from . import aggregation
from .divergence import check_gamma, check_norm, lead_bounds
from .plan import Aggregate, Commit, Transfer
from .scheduler import commits_of


@dataclass
class ReplicaState:
    """Carried from batch to batch; ReplicaState() is the start state (replica = server, at rest).

    punted: Update objects applied at the server, not yet at the replica, in server order.
    lag: how many updates the replica is behind the server (= len(punted)).
    history_bound: H >= ||h|| at the replica (after its last completed step).
    partial_norm: sync only — sum of norms the replica has applied of its still-open iteration.
    open_step: sync only — the server's iteration is still open (its batch did not end it).
    step_ends: ids of punted updates that close a step (every one in async; iteration ends in sync).
    last_commit: when the replica applied its last update: later commits wait for it, so the replica
    applies in sequence order across batches too.
    """
    punted: list = field(default_factory=list)
    lag: int = 0
    history_bound: float = 0.0
    partial_norm: float = 0.0
    open_step: bool = False
    step_ends: frozenset = frozenset()
    last_commit: float = 0.0


@dataclass
class ReplicaPlan:
    """The replica's side of one batch.

    frozen: the kept transfers (worker->replica, worker->replica-aggregator, aggregator->replica),
    in reservation order. commits: the replica's applications, in order (Commit(time, ids, via)).
    punted: update ids carried to the next batch, in order. divergence: the eq. 11 bound on
    ||w_s - w_r|| at the batch's end (server fully committed). delayed: the server Transfer that was
    moved to start at a_e, or None.
    """
    frozen: list
    commits: list
    punted: list
    divergence: float
    delayed: object = None
    replica: int = -1
    div_max: float = inf
    t_last: float = 0.0          # the server's last commit of the batch, before any delay
    a_e: float = None            # the replica commit that restored the bound, when after T_last
    direct: list = field(default_factory=list)      # frozen transfers straight to the replica
    aggregates: list = field(default_factory=list)  # frozen Aggregates to the replica
    enforced: bool = True        # False: sync batch that does not end its iteration
    bound_met: bool = True       # divergence <= div_max (always when enforced, unless impossible)

    def transfers(self):
        """All frozen transfers."""
        return list(self.frozen)

    @property
    def applied(self):
        """Update ids applied at the replica in this batch, in order."""
        return [u for c in self.commits for u in c.ids]

    @property
    def replica_bytes(self):
        """Bytes that reach the replica's NIC (aggregation lowers this)."""
        return sum(t.size for t in self.frozen if t.dst == self.replica)

    def __str__(self):
        state = ("bound met" if self.bound_met else "BOUND NOT MET") if self.enforced else (
            "not enforced mid-iteration")
        lines = ["replica h%d: Div_max %s, divergence at batch end %.6g (%s), %d applied, "
                 "%d punted, replica bytes %.6g, T_last %.6g"
                 % (self.replica, _fmt(self.div_max), self.divergence, state, len(self.applied),
                    len(self.punted), self.replica_bytes, self.t_last)]
        if self.delayed is not None:
            lines.append("  delayed server transfer %s h%d -> S%d to [%.6g, %.6g], after a_e = %.6g"
                         % (_ids(self.delayed.ids), self.delayed.src, self.delayed.dst,
                            self.delayed.start, self.delayed.end, self.a_e))
        for t in self.direct:
            lines.append("  %s h%-4d -> R%-4d [%.6g, %.6g]" % (_ids(t.ids), t.src, t.dst, t.start,
                                                                t.end))
        for a in self.aggregates:
            lines.append("  aggregate at h%d of %d updates -> R%d [%.6g, %.6g]"
                         % (a.aggregator, len(a.members), a.dst, a.transfer.start, a.transfer.end))
            for t in a.inbound:
                lines.append("      %s h%-4d -> h%-4d [%.6g, %.6g]" % (_ids(t.ids), t.src, t.dst,
                                                                    t.start, t.end))
        if self.punted:
            lines.append("  punted: " + " ".join("u%d" % u for u in self.punted))
        return "\n".join(lines)


def _ids(ids):
    return ",".join("u%d" % u for u in ids)


def _fmt(x):
    return "inf" if x == inf else "%g" % x


def replicate(plan, network, replica, aggregators, state, *, div_max, gamma, seed=0, sync=False,
              iteration_end=True, norm_cap=inf):
    """§5.3 for one batch.

    plan: the server's tentative Plan (scheduler.schedule); network: the network after the server's
    reservations (not modified); replica: its host; aggregators: the replica's k' aggregator hosts;
    state: the ReplicaState carried from the previous batch; div_max: Div_max (L2, in the model's
    units; inf: never delay); gamma: the server's momentum; seed: the random pre-assignment of the
    replica's aggregators (§5.2); sync: the bound must hold only at an iteration's end (§6), and
    iteration_end says whether this batch ends one. norm_cap: the most a replica aggregate's
    members' norms may sum to (aggregation.py; the runtime passes Div_max so that no single commit
    at the replica can open a gap wider than Div_max; default inf, the paper's grouping).

    Returns (plan, network, state): a new Plan whose `replica` is the ReplicaPlan and whose last
    server transfer and commit are moved when delayed (the input plan is not modified); the network
    after everything; the next ReplicaState."""
    gamma = check_gamma(gamma)
    div_max = _check_div_max(div_max)
    if gamma > 0 and not sync and not plan.momentum and any(len(a.members) > 1
                                                            for a in plan.aggregates):
        # the server would apply plain sums: its model would not be the sequential one that the
        # divergence bound (and the replica, applying other groupings) assumes
        raise ValueError("gamma=%r: the server plan must be made with schedule(momentum=True), "
                         "so its aggregates apply exactly as their members in order" % (gamma,))
    aggs = _check_hosts(plan, network, replica, aggregators)
    seq, ends, h0, p0, open_after = _sequence(plan, state, sync, iteration_end, gamma)
    walk = lead_bounds([u.norm for u in seq], gamma, h0, ends=ends, partial_norm=p0)

    # 1. tentative replica schedule: the same order, Alg. 3 to the replica, after the server's
    # with momentum (and outside sync's plain per-iteration sums) an aggregate carries two weighted
    # sums, so it applies exactly like its members in order (divergence.aggregate_weights)
    agg_scale = 2.0 if gamma > 0 and not sync else 1.0
    t_direct, t_aggregates = _tentative(seq, network, replica, aggs, seed, plan.start, agg_scale,
                                        norm_cap)
    order = [u.id for u in seq]
    groups = [(t, None) for t in t_direct] + [(a.transfer, a) for a in t_aggregates]
    # in the order groups are listed; none before the replica's last commit of earlier batches
    commits = commits_of(t_direct, t_aggregates, max(plan.start, state.last_commit))
    pos, p = [], 0  # the replica's position (updates applied) after each commit
    for c in commits:
        p += len(c.ids)
        pos.append(p)

    # 2. the check at T_last, the server fully committed, the replica where it is by then
    t_last = plan.makespan
    keep = sum(1 for c in commits if c.time <= t_last)  # commit times never go back
    enforced = not sync or iteration_end
    a_e = None
    if enforced and walk.bound[pos[keep - 1] if keep else 0] > div_max:
        # 3. the earliest replica commit that restores the bound; it comes after T_last because the
        # bound only falls as the replica advances
        e = next((k for k in range(keep, len(commits))
                  if commits[k].time < inf and walk.bound[pos[k]] <= div_max), None)
        if e is not None:
            keep, a_e = e + 1, commits[e].time

    new_plan = replace(plan, order=list(plan.order), dropped=dict(plan.dropped),
                       direct=list(plan.direct), aggregates=list(plan.aggregates),
                       commits=list(plan.commits))
    nw, frozen, direct, aggregates = _freeze(network, groups, keep)
    delayed = None
    if a_e is not None and plan.commits:
        moved = _delay_last(new_plan, nw, a_e)
        if moved is None:  # the server could never finish after a_e: keep its plan, bound not met
            keep, a_e = sum(1 for c in commits if c.time <= t_last), None
            nw, frozen, direct, aggregates = _freeze(network, groups, keep)
        else:
            delayed, nw = moved
    p_f = pos[keep - 1] if keep else 0
    div = walk.bound[p_f]
    new_plan.replica = ReplicaPlan(
        frozen=frozen, commits=commits[:keep], punted=order[p_f:], divergence=div,
        delayed=delayed, replica=replica, div_max=div_max, t_last=t_last, a_e=a_e, direct=direct,
        aggregates=aggregates, enforced=enforced, bound_met=div <= div_max)
    punted = seq[p_f:]
    nxt = ReplicaState(punted=punted, lag=len(punted), history_bound=walk.history[p_f],
                       partial_norm=walk.partial[p_f], open_step=open_after,
                       step_ends=frozenset(u.id for u, e in zip(punted, ends[p_f:]) if e),
                       last_commit=max([state.last_commit] + [c.time for c in commits[:keep]]))
    return new_plan, nw, nxt


# --- the steps ------------------------------------------------------------------------------------
def _tentative(seq, network, replica, aggs, seed, start, agg_scale, norm_cap):
    """Alg. 3 to the replica: (direct transfers, Aggregates). When some update can never reach the
    replica (its path has no capacity left, ever), every case of Alg. 3 is infinite; then the
    all-direct case is kept, whose finite prefix is still worth freezing (aggregation.aggregate
    expects a finite case, as the server's updates without a path were dropped by ordering)."""
    updates = {u.id: u for u in seq}
    order = [u.id for u in seq]
    aggs = aggregation.group_order(aggs, seed)
    end, rec = aggregation.det_agg(len(order), order, updates, network, replica, aggs, start,
                                   record=True, agg_scale=agg_scale)
    if end == inf:
        return rec[0], rec[1]
    g = aggregation.aggregate(order, updates, network, replica, aggs, start=start,
                              agg_scale=agg_scale, norm_cap=norm_cap)
    return g.direct, g.aggregates


def _freeze(network, groups, keep):
    """The network with the first `keep` replica commits' transfers reserved, and those transfers.
    They are a prefix of Alg. 3's reservation order, so each is feasible without the punted ones."""
    nw = network.copy()
    frozen, direct, aggregates = [], [], []
    for t, a in groups[:keep]:
        for x in (a.inbound if a is not None else ()):
            nw.reserve(x.src, x.dst, x.segments)
            frozen.append(x)
        nw.reserve(t.src, t.dst, t.segments)
        frozen.append(t)
        if a is None:
            direct.append(t)
        else:
            aggregates.append(a)
    return nw, frozen, direct, aggregates


def _delay_last(plan, network, a_e):
    """Move the plan's last server transfer (that of its last commit) to start at a_e: its old
    reservation is returned, the new one taken. Updates `plan` in place and returns (transfer,
    network), or None (plan untouched) when it could never finish."""
    last = plan.commits[-1]
    t = plan.aggregates[-1].transfer if plan.aggregates else plan.direct[-1]
    assert tuple(t.ids) == tuple(last.ids), "the last commit is the last group's"
    nw = network.copy()
    path = nw.path(t.src, t.dst)
    for k in path:
        for s in t.segments:
            nw.links[k].subtract(s.t0, s.t1, -s.rate)  # give the old reservation back
    end, segs = nw.t_en(t.src, t.dst, t.size, a_e)
    if end == inf:
        return None
    if segs:
        nw.reserve(t.src, t.dst, segs)
    moved = Transfer(t.src, t.dst, t.size, segs[0].t0 if segs else end, end, segs, t.what, t.ids)
    if plan.aggregates:
        a = plan.aggregates[-1]
        plan.aggregates[-1] = Aggregate(a.aggregator, a.dst, list(a.members), list(a.inbound),
                                        moved)
    else:
        plan.direct[-1] = moved
    before = plan.commits[-2].time if len(plan.commits) > 1 else plan.start
    plan.commits[-1] = Commit(max(end, before), last.ids, last.via)
    return moved, nw


def _sequence(plan, state, sync, iteration_end, gamma):
    """The replica's sequence (punted, then the batch's order), which updates close a step, the
    replica's (history bound, partial norm) before it, and whether the server's step is open
    after."""
    if not isinstance(state, ReplicaState):
        raise ValueError("state must be a ReplicaState (ReplicaState() to start), got %r"
                         % (state,))
    punted = list(state.punted)
    if state.lag != len(punted):
        raise ValueError("state.lag is %r but %d updates are punted: the replica lags by exactly "
                         "the punted updates" % (state.lag, len(punted)))
    h0 = check_norm(state.history_bound, "state.history_bound")
    if not float(state.last_commit) >= 0:
        raise ValueError("state.last_commit must be a time >= 0, got %r" % (state.last_commit,))
    p0 = check_norm(state.partial_norm, "state.partial_norm")
    ids = [u.id for u in punted]
    if len(set(ids)) != len(ids):
        raise ValueError("state.punted lists an update twice: %r" % (ids,))
    clash = sorted(set(ids) & set(plan.updates))
    if clash:
        raise ValueError("update ids %r are both punted from an earlier batch and in this one: ids "
                         "must be unique across batches" % (clash,))
    batch = [plan.updates[u] for u in plan.order]
    for u in punted + batch:
        check_norm(u.norm, "the norm of update %r" % (u.id,))
    if not sync:
        if state.open_step or p0:
            raise ValueError("state has an open sync iteration (open_step=%r, partial_norm=%r) but "
                             "sync=False" % (state.open_step, p0))
        return punted + batch, [True] * (len(punted) + len(batch)), h0, p0, False
    if punted and (punted[-1].id in state.step_ends) == bool(state.open_step):
        raise ValueError("state.open_step=%r contradicts step_ends for the last punted update %r"
                         % (state.open_step, punted[-1].id))
    if not punted and not state.open_step and p0:
        raise ValueError("state.partial_norm is %r but the replica is caught up and no iteration "
                         "is open" % (p0,))
    ends = [u.id in state.step_ends for u in punted] + [False] * len(batch)
    if iteration_end:
        if batch:
            ends[-1] = True
        elif state.open_step and punted:
            ends[-1] = True
        elif state.open_step:  # the replica holds the whole open iteration: both close it now
            h0, p0 = p0 + (gamma * h0 if gamma else 0.0), 0.0
    open_after = not iteration_end and (bool(state.open_step) or bool(batch))
    return punted + batch, ends, h0, p0, open_after


def _check_div_max(div_max):
    try:
        d = float(div_max)
    except (TypeError, ValueError):
        raise ValueError("div_max must be a number >= 0, got %r" % (div_max,)) from None
    if isnan(d) or d < 0:
        raise ValueError("div_max must be >= 0 (inf: never delay), got %r" % (div_max,))
    return d


def _check_hosts(plan, network, replica, aggregators):
    def host(h, what):
        if not (isinstance(h, int) and not isinstance(h, bool) and 0 <= h < network.hosts):
            raise ValueError("%s %r is not a host of this network (0..%d)"
                             % (what, h, network.hosts - 1))
    if plan.replica is not None:
        raise ValueError("this plan already has a replica schedule")
    host(replica, "replica")
    if replica == plan.server:
        raise ValueError("the replica cannot be on the server's host %d" % replica)
    aggs = list(aggregators)
    for a in aggs:
        host(a, "replica aggregator")
    if len(set(aggs)) != len(aggs):
        raise ValueError("replica aggregators listed twice: %r" % (aggs,))
    if replica in aggs:
        raise ValueError("the replica's host %d cannot be one of its aggregators" % replica)
    if plan.server in aggs:
        raise ValueError("the server's host %d cannot aggregate for the replica" % plan.server)
    return aggs
