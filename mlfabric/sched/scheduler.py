"""One batch through the scheduler (paper §5, §6): ordering (Alg. 2), then aggregation (Alg. 3),
assembled into a Plan with the server's commits. Replication (§5.3) runs after this on the Plan.

Modes (§6): 'async' orders with deadlines from tau_max and may drop; 'ssp' and 'sync' order shortest
first with no deadlines (their staleness is bounded by the workers' clocks, not by the network) and
drop nothing that can arrive; all three aggregate. For 'sync' the objective Alg. 3 minimises — the
last arrival at the server — is exactly obj_sync (eq. 16).

Engines: the same algorithms computed two ways. 'reference' runs the paper's plain loops in Python
(ordering.py, aggregation.py); 'fast' runs them in C++ (fast.py, csrc/sched_fast.cc) with shortcuts
that provably cannot change the answer, 'plain' the C++ without those shortcuts (the benchmark's
side-by-side). Tests hold all three to bit-identical plans, cut_through included. 'auto' takes
'fast' when it is built, unless norm_cap is finite: only the reference loops implement a cap.

The server applies in the order's sequence: a commit happens at max(arrival, previous commit), so
an update that arrives before its predecessor waits (Plan.server_wait reports how long, in total).

Slow-link drop (next_batch=, async only; not in the paper, which plans each batch alone): Alg. 2's
look-ahead drops a pick when the next update would finish first and leave the server idle, but
only within the batch. An update whose own path is slow (a NIC at a tenth of the rate: 0.8 s for
what takes 80 ms) ends last in its batch and then holds every later batch's commits behind it,
since batches apply in order: the server's link idles while everything planned after it waits,
which ages the models the workers fetch. So, before ordering, an update is dropped at its worker
(DROP_SLOW) when, alone on the network, it would reach the server later than the batch's fastest
would if sent a batch later (at next_batch): the paper's test, against the next batch.
`peers` widens that reference to other workers that pushed lately (the caller's choice): a batch
of slow senders alone, whose fastest would hold the server just as long, is dropped whole when
such a worker's update, sent at next_batch, would be in first. Liveness: a batch is dropped whole
only for a peer faster than all of it, and the caller names only workers that push (when they stop,
the batch's fastest is kept again).
"""
from math import inf, isfinite

from . import aggregation, fast, ordering
from ._records import fast_constructor
from .plan import DROP_SLOW, Commit, Plan


MODES = ("async", "ssp", "sync")
ENGINES = ("auto", "fast", "plain", "reference")


_commit = fast_constructor(Commit)  # small batches are common: see _records


def commits_of(direct, aggregates, after):
    """The server's commits for group 1 (in order) then the aggregates (in order), none before
    `after` (the previous batch's last commit: the server applies batches in order too)."""
    out, last = [], after
    for t in direct:
        last = max(last, t.end)
        out.append(_commit(last, t.ids, t.src))
    for a in aggregates:
        last = max(last, a.transfer.end)
        out.append(_commit(last, tuple(a.members), a.aggregator))
    return out


def _check_batch(updates, network, server, aggregators, tau_max, v_init, start, after):
    """Refuse, with the value named, what would make a plan silently wrong: an update that is
    neither applied nor dropped (a NaN deadline), a negative delay, transfers at NaN times."""
    if not tau_max >= 0:
        raise ValueError("tau_max must be >= 0, got %r" % (tau_max,))
    if not isfinite(v_init):
        raise ValueError("v_init must be a finite model version, got %r" % (v_init,))
    if not (isfinite(start) and start >= 0):
        raise ValueError("start must be a finite time >= 0, got %r" % (start,))
    if after is not None and not (isfinite(after) and after >= 0):
        raise ValueError("after must be a finite time >= 0, got %r" % (after,))
    hosts = network.hosts
    for h in (server, *aggregators):  # a plain int in range passes; the rest gets the detail
        if not (type(h) is int and 0 <= h < hosts):
            network._check_host(h)
    if len(set(aggregators)) != len(aggregators):
        raise ValueError("aggregators must be distinct hosts, got %r" % (list(aggregators),))
    for u in updates:  # one cheap test per update; the detail only when it fails
        w = u.worker
        if not (type(w) is int and 0 <= w < hosts and 0 <= u.size < inf and 0 <= u.ready < inf
                and -inf < u.version < inf):
            _refuse_update(u, network)


def _refuse_update(u, network):
    network._check_host(u.worker)
    if not (isfinite(u.size) and u.size >= 0):
        raise ValueError("update %r: size must be finite and >= 0, got %r" % (u.id, u.size))
    if not (isfinite(u.ready) and u.ready >= 0):
        raise ValueError("update %r: ready must be a finite time >= 0, got %r" % (u.id, u.ready))
    if not isfinite(u.version):  # a NaN deadline would leave it neither applied nor dropped
        raise ValueError("update %r: version must be a finite model version, got %r"
                         % (u.id, u.version))


def slow_links(updates, network, server, start, next_batch, tau_max, v_init, peers=()):
    """{id: DROP_SLOW} for the updates that, alone on `network`, would reach `server` later than
    the batch's fastest would if it were sent at `next_batch` instead, or than an update of the
    same size from one of `peers` sent then (module header). Their path is slow: a NIC below the
    rate, or booked with other transfers. Without a faster peer the batch's fastest is never
    dropped (a batch of slow senders still progresses), and the server's queue delays every
    update alike, so it trips no one. One already stale (no position left within tau_max), or
    that can never arrive, is left to Alg. 2 (DROP_STALE, DROP_NO_PATH): those say more."""
    ends = {}
    for u in updates:
        if u.version + tau_max - v_init >= 1:
            end = network.t_en(u.worker, server, u.size, max(u.ready, start))[0]
            if end < inf:
                ends[u.id] = end
    if not ends:
        return {}
    first = min(ends.values()) + (next_batch - start)
    size = max(u.size for u in updates)   # the largest: a peer is never favoured by its size
    for p in peers:
        first = min(first, network.t_en(p, server, size, next_batch)[0])
    return {uid: DROP_SLOW for uid, end in ends.items() if end > first}


def schedule(updates, network, server, *, aggregators=(), tau_max=inf, v_init=0, start=0.0,
             seed=0, mode="async", momentum=False, after=None, engine="auto", timings=None,
             norm_cap=inf, cut_through=False, next_batch=None, peers=()):
    """Plan one batch of `updates` (a list of Update) to `server` on `network` (not modified).
    `aggregators` are hosts that may aggregate for this server (in any order: they are pre-assigned
    to groups at random from `seed`). `momentum`: the server applies momentum (eq. 2), so an
    aggregate of several updates carries two weighted sums (twice the bytes) to be applied exactly
    as its members in order (ignored in sync mode, where an iteration is one step). `after`: the
    previous batch's last commit (default `start`). `engine`: see the module header; `timings` (a
    dict) receives the fast path's time split. `norm_cap`: the most an aggregate's members' norms
    may sum to (aggregation.py; a replicated server's Div_max); a finite cap runs the reference
    loops, which alone implement it. `cut_through`: aggregates stream out as their members come
    in, and the pipeline case is tried (aggregation.py); every engine implements it.
    `next_batch` (async only, >= start): when the next batch may start; an update slower than
    the batch's fastest sent then is dropped first (DROP_SLOW, module header). Default None: the
    paper's batch alone. `peers` (with next_batch): hosts of other workers that push, whose
    update sent at next_batch also counts as the batch's fastest would (module header).
    Returns (plan, network after the plan's reservations)."""
    if mode not in MODES:
        raise ValueError("mode must be one of %s, got %r" % (", ".join(MODES), mode))
    if engine not in ENGINES:
        raise ValueError("engine must be one of %s, got %r" % (", ".join(ENGINES), engine))
    _check_batch(updates, network, server, aggregators, tau_max, v_init, start, after)
    if mode != "async":
        tau_max = inf
    every = updates
    slow = {}
    if mode == "async" and next_batch is not None:
        if not (isfinite(next_batch) and next_batch >= start):
            raise ValueError("next_batch must be a finite time >= start (%r), got %r"
                             % (start, next_batch))
        if len({u.id for u in updates}) != len(updates):   # before any is filtered out
            raise ValueError("update ids must be unique within a batch")
        peers = list(peers)
        for p in peers:
            network._check_host(p)
            if p == server:
                raise ValueError("peers must be workers, not the server (%r)" % (server,))
        slow = slow_links(updates, network, server, start, next_batch, tau_max, v_init, peers)
        if slow:
            updates = [u for u in updates if u.id not in slow]
    aggs = aggregation.group_order([a for a in aggregators if a != server], seed)
    # a sync iteration is one momentum step whatever the grouping, so its sums stay plain
    momentum = bool(momentum) and mode != "sync"
    agg_scale = 2.0 if momentum else 1.0
    if not norm_cap >= 0:
        raise ValueError("norm_cap must be >= 0, got %r" % (norm_cap,))
    no_cap = norm_cap == inf   # the C++ engines do not implement a cap
    if engine == "auto":
        engine = "fast" if fast.available() and no_cap else "reference"
    if engine != "reference" and not no_cap:
        raise ValueError("engine=%r does not implement norm_cap; use 'reference' or 'auto'"
                         % (engine,))
    if engine == "reference":
        by_id = {u.id: u for u in updates}
        o = ordering.order_updates(updates, network, server, v_init=v_init, tau_max=tau_max,
                                   start=start)
        g = aggregation.aggregate(o.order, by_id, network, server, aggs, start=start,
                                  agg_scale=agg_scale, norm_cap=norm_cap,
                                  cut_through=cut_through)
        order, dropped, direct, aggregates, after_nw = (o.order, o.dropped, g.direct,
                                                        g.aggregates, g.network)
    else:
        order, dropped, direct, aggregates, after_nw = fast.plan_parts(
            updates, network, server, aggs, tau_max=tau_max, v_init=v_init, start=start,
            agg_scale=agg_scale, cut_through=cut_through, plain=engine == "plain",
            timings=timings)
    if slow:
        dropped = {**dropped, **slow}
    by_id = {u.id: u for u in every}
    plan = Plan(server=server, v_init=v_init, tau_max=tau_max, updates=by_id, order=order,
                dropped=dropped, direct=direct, aggregates=aggregates, start=start,
                momentum=momentum)
    plan.commits = commits_of(direct, aggregates, start if after is None else max(after, start))
    return plan, after_nw
