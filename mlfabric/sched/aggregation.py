"""In-network aggregation (paper §5.2, Alg. 3), as the paper's plain loops: for every n = 0..|U| the
first n ordered updates go straight to the server (the same schedules Alg. 2 computed), and the rest
stream, in order, through the aggregators, a group each; the case whose last arrival at the server is
earliest wins. `mlfabric.sched.fast` computes the same choice in C++ (with pruning that cannot change
the answer), cut_through and its pipeline case included; tests hold the two to identical output.

The constraint that keeps the server's NIC busy: a group must have finished arriving at its aggregator
by t_max, the time the server has received all earlier groups; the next update that would arrive later
closes the group, whose sum is then sent to the server, and opens the next aggregator's group. Where
the paper leaves a choice open:
- No earlier group (n = 0): the constraint is vacuous, so the first aggregator takes every update.
- An aggregator whose first update already misses t_max takes nothing; the next one is tried.
- Updates left when every aggregator is used: that case cannot keep the server busy, so it is
  infeasible (n = |U|, everything direct, is always feasible).
- An aggregate is as large as its largest member (the members are same-shaped gradients) times
  `agg_scale` when it has two members or more: 2 when the server applies momentum, because then the
  aggregator must send two weighted sums for the server to end exactly where applying the members
  one by one would (see docs/sched/replication.md); 1 for plain sums. It leaves the aggregator when
  its last member has arrived.
- Aggregators are pre-assigned to groups in a random order from `seed` (§5.2), once per batch.
- `norm_cap` (not in the paper; default inf = the paper's rule): an update whose norm would take
  its group's summed member norms above the cap closes the group, as a late arrival does. A
  replicated server uses Div_max: a commit is applied at once, so a server or replica commit that
  weighs more than Div_max would put the two models more than Div_max apart for as long as the
  other side has not applied it, whatever the order (a single update heavier than Div_max still
  goes alone). Only the reference loops take a cap (scheduler.schedule picks them when one is set).
- `cut_through` (not in the paper; default False = the paper's rule, an aggregate leaves when its
  last member has arrived): the aggregator streams the sum out as its members come in, chunk by
  chunk (the runtime's data plane does), so the aggregate starts with its last member's inbound
  transfer and never ends before that member has arrived (Network.t_en_relay). The constraint on
  the group is unchanged. The C++ engines implement it too (mlfabric.sched.fast), to the bit.
- With cut_through one more case is tried, the pipeline (a reduce chain): the hosts of the batch,
  the one whose updates are ready first first, pass one running sum down the line, each adding its
  own updates as the sum streams through, the last sending it to the server. Every hop goes at
  the pace of the one before (Network.t_en_relay), so the server gets the whole batch in about one
  transfer time, as one commit (an Aggregate with `upstream` levels). It is kept when its makespan
  is at most the best case's (it sends the server the fewest bytes). It needs at least two hosts,
  every host after the first an aggregator, and the batch's norms within norm_cap.
"""
import random
from dataclasses import dataclass
from math import inf

from .plan import Aggregate, Transfer


@dataclass
class Grouping:
    n_direct: int     # size of group 1 (straight to the server)
    direct: list      # Transfers of group 1, in order
    aggregates: list  # Aggregate per later group, in order
    network: object   # the network after all of it is reserved
    makespan: float   # last arrival at the server
    cases: list       # makespan of every case n = 0..|U| (inf: infeasible)
    pipeline: float = inf  # makespan of the cut-through pipeline (inf: not possible, not tried)


def group_order(aggregators, seed):
    """The random pre-assignment of aggregators to groups 2..k+1: random.Random(seed).shuffle's
    permutation. For int seeds below 2**64 it is computed in C++ (csrc/sched_send.cc: CPython's
    Mersenne Twister and shuffle draws), without a Random object per batch (~5 us, as much as
    Alg. 2 and Alg. 3 take on a typical small batch)."""
    if _shuffle_seeded is not None and type(seed) is int and -_SEED_LIMIT < seed < _SEED_LIMIT:
        return _shuffle_seeded(aggregators, -seed if seed < 0 else seed)
    return group_order_python(aggregators, seed)


def group_order_python(aggregators, seed):
    """group_order in Python (the reference of the native permutation)."""
    aggs = list(aggregators)
    random.Random(seed).shuffle(aggs)
    return aggs


try:
    from .._C import shuffle_seeded as _shuffle_seeded
except ImportError:  # a build without the native part
    _shuffle_seeded = None
_SEED_LIMIT = 2 ** 64


def _native_shuffle_agrees():
    """The native permutation assumes CPython's random (Mersenne Twister, shuffle through
    _randbelow_with_getrandbits); checked once against this interpreter's random module."""
    for n, seed in ((2, 0), (4, 1), (5, 12345), (9, 2 ** 32 - 1), (7, 2 ** 32 + 5),
                    (16, 2 ** 64 - 1), (33, 1000003 * 7 + 11)):
        if _shuffle_seeded(range(n), seed) != group_order_python(range(n), seed):
            return False
    return True


if _shuffle_seeded is not None and not _native_shuffle_agrees():
    _shuffle_seeded = None


def _transfer(src, dst, size, end, segs, what, ids):
    return Transfer(src, dst, size, segs[0].t0 if segs else end, end, segs, what, ids)


def det_agg(n, order, updates, network, server, aggs, start, record=False, agg_scale=1.0,
            norm_cap=inf, cut_through=False):
    """DetAgg(n): makespan of case n, and with record=True the groups (direct, aggregates, network).
    `network` is not modified."""
    nw = network.copy()
    t_max = start
    direct, aggregates = [], []
    for uid in order[:n]:
        u = updates[uid]
        end, segs = nw.send(u.worker, server, u.size, max(u.ready, start))
        t_max = max(t_max, end)
        if record:
            direct.append(_transfer(u.worker, server, u.size, end, segs, "update", (uid,)))
    i = n
    constrained = n > 0
    for agg in aggs:
        if i >= len(order):
            break
        members, inbound, weight = [], [], 0.0
        while i < len(order):
            u = updates[order[i]]
            if members and weight + u.norm > norm_cap:
                break
            end, segs = nw.t_en(u.worker, agg, u.size, max(u.ready, start))
            if end == inf or (constrained and end > t_max):
                break
            weight += u.norm
            if segs:
                nw.reserve(u.worker, agg, segs)
            members.append(u.id)
            inbound.append(_transfer(u.worker, agg, u.size, end, segs, "update", (u.id,)))
            i += 1
        if not members:
            continue
        size = max(updates[m].size for m in members) * (agg_scale if len(members) > 1 else 1.0)
        ready = max(t.end for t in inbound)
        if cut_through:  # the sum streams out as every member's bytes come in
            end, segs = nw.send_relay(agg, server, size, max(t.start for t in inbound), ready)
        else:
            end, segs = nw.send(agg, server, size, ready)
        if end == inf:
            return inf, None
        t_max = max(t_max, end)
        constrained = True
        if record:
            aggregates.append(Aggregate(agg, server, members, inbound,
                                        _transfer(agg, server, size, end, segs, "aggregate",
                                                  tuple(members))))
    if i < len(order):
        return inf, None
    if not record:
        return t_max, None
    return t_max, (direct, aggregates, nw)


def pipeline(order, updates, network, server, aggs, start, agg_scale=1.0, norm_cap=inf):
    """The cut-through pipeline case (module header): (makespan, the last Aggregate, network
    after); (inf, None, None) when it is not possible. `network` is not modified."""
    hosts = pipeline_hosts(order, updates, start)
    if (len(hosts) < 2 or not set(hosts[1:]) <= set(aggs) or server in hosts
            or sum(updates[u].norm for u in order) > norm_cap):
        return inf, None, None
    nw = network.copy()

    def hop(src, dst, size, what, ids, into):
        if into is None:        # one of the first host's updates
            end, segs = nw.send(src, dst, size, max(updates[ids[0]].ready, start))
        else:                   # a running sum, streamed as what it sums comes in
            end, segs = nw.send_relay(src, dst, size, max(t.start for t in into),
                                      max(t.end for t in into))
        return None if end == inf else _transfer(src, dst, size, end, segs, what, ids)
    last = pipeline_chain(hosts, order, updates, server, agg_scale,
                          lambda uid: max(updates[uid].ready, start), hop)
    return (inf, None, None) if last is None else (last.transfer.end, last, nw)


def pipeline_hosts(order, updates, start):
    """The pipeline's hosts: those of the batch, the one whose updates are all ready first first
    (ties: as they first appear in the order)."""
    hosts, ready = [], {}
    for uid in order:
        h, r = updates[uid].worker, max(updates[uid].ready, start)
        if h not in ready:
            hosts.append(h)
        ready[h] = max(ready.get(h, r), r)
    hosts.sort(key=ready.__getitem__)   # stable
    return hosts


def pipeline_chain(hosts, order, updates, server, agg_scale, send_at, hop):
    """The pipeline's Aggregate chain down `hosts` (module header): the last level, its upstream
    levels linked; None if some hop has no capacity. Each transfer comes from hop(src, dst, size,
    what, ids, into) in order: the first host's updates to the second ('update', into None), then
    each host's running sum to the next ('aggregate', into: the transfers it sums); None for no
    capacity. Shared by pipeline() (hop computes on the network) and the fast path (hop reads
    the native result); a host's own updates join with no network, at send_at(uid)."""
    position = {uid: i for i, uid in enumerate(order)}
    mine = {h: [] for h in hosts}       # host -> its updates, in order
    for uid in order:
        mine[updates[uid].worker].append(uid)
    inbound = [hop(hosts[0], hosts[1], updates[uid].size, "update", (uid,), None)
               for uid in mine[hosts[0]]]
    if None in inbound:
        return None
    members, upstream = list(mine[hosts[0]]), None
    for i, h in enumerate(hosts[1:], 1):
        into = inbound + [_transfer(h, h, updates[uid].size, send_at(uid), (), "update", (uid,))
                          for uid in mine[h]]
        members = sorted(members + mine[h], key=position.__getitem__)
        dst = hosts[i + 1] if i + 1 < len(hosts) else server
        size = max(updates[m].size for m in members) * agg_scale
        out = hop(h, dst, size, "aggregate", tuple(members), into)
        if out is None:
            return None
        upstream = Aggregate(h, dst, list(members), into, out, upstream)
        inbound = [out]
    return upstream


def aggregate(order, updates, network, server, aggs, *, start=0.0, agg_scale=1.0, norm_cap=inf,
              cut_through=False):
    """Alg. 3: enumerate the |U|+1 cases and keep the first with the least makespan. `updates` maps
    id -> Update; `aggs` is the pre-assigned aggregator order (see group_order); `norm_cap`: the
    most an aggregate's members' norms may sum to (module header); `cut_through` (module
    header): an aggregate streams out as its members come in."""
    if server in aggs:
        raise ValueError("the server's host %d cannot be one of its aggregators" % server)
    if not agg_scale >= 1.0:
        raise ValueError("agg_scale must be >= 1, got %r" % (agg_scale,))
    if not norm_cap >= 0:
        raise ValueError("norm_cap must be >= 0, got %r" % (norm_cap,))
    cases = [det_agg(n, order, updates, network, server, aggs, start, agg_scale=agg_scale,
                     norm_cap=norm_cap, cut_through=cut_through)[0]
             for n in range(len(order) + 1)]
    best = min(range(len(cases)), key=lambda n: (cases[n], n))
    if cases[best] == inf:
        raise ValueError("some of updates %r can never reach host %d: no capacity on the path"
                         % (order, server))
    chain = inf
    if cut_through:
        chain, last, chain_nw = pipeline(order, updates, network, server, aggs, start,
                                         agg_scale=agg_scale, norm_cap=norm_cap)
        if chain <= cases[best]:   # (cases[best] is DetAgg(best)'s makespan)
            return Grouping(0, [], [last], chain_nw, chain, cases, chain)
    makespan, (direct, aggregates, nw) = det_agg(best, order, updates, network, server, aggs,
                                                 start, record=True, agg_scale=agg_scale,
                                                 norm_cap=norm_cap, cut_through=cut_through)
    return Grouping(best, direct, aggregates, nw, makespan, cases, chain)
