"""Model distribution (paper §10.3): a batch of pull requests answered with one model version.
Sending the model to every requester straight from the server makes the server's egress the
bottleneck, so the server sends it to a few distributors, which forward it to the requesters;
the first group of requesters is served directly by the server. The grouping is a variant of
Alg. 3 (mlfabric.sched.aggregation) in which t_en is the time of server -> distributor and
distributor -> worker transfers: for every size n of the direct group, distributors are filled
greedily, and the case where the last requester has the model earliest is kept.

The schedule of one case n, as the paper orders it (the model goes to the distributors first, then
the server serves its own group last):
  1. Requesters are ranked shortest transfer first from the server (Alg. 1 on the server's
     transfers); the first n form the direct group, the others are to be relayed.
  2. Distributors, in their random pre-assignment (§5.2), are sent the model one after the other.
     When one is sent the model, its horizon is when the server would finish its direct group
     sent after it; the distributor forwards the model to the next requesters in rank order as
     long as each would have it by that horizon, and the first that would not opens the next
     distributor (Alg. 3's constraint mirrored: a distributor never makes the batch end later
     than the server's own last send; each new distributor moves that end, and with it the next
     horizon, later, as t_max grows in Alg. 3). Requesters left when the distributors are used
     up make the case infeasible (n = all, everyone direct, is always feasible).
  3. The server sends the model to the direct group, in rank order.
The paper numbers the distributors so that "the k°-th" is served first and the others
"backwards"; here they are simply listed in the order the server sends to them.

Where the paper leaves a choice open, this is what we do, and why:
- n = 0 (no direct group): the horizon is vacuous, so the first distributor serves everyone, as
  the first aggregator takes every update in Alg. 3's case n = 0.
- A distributor that is itself a requester is served by its own inbound transfer, and forwards to
  the others; it opens only if it forwards to at least one other requester. A requester that
  already has its copy when its turn as distributor comes (from an earlier distributor) is
  skipped, as is one in the direct group (the server serves that group last, too late to relay):
  the tree stays two levels deep, server -> distributor -> worker, as in the paper, and nobody
  receives the model twice.
- Ties between cases go to the one that sends the fewest bytes out of the server, then to the one
  with the most direct transfers (no relay hop that does not help).
- objective="mean" (not in the paper) keeps the case whose requesters have the model earliest on
  average instead of the one whose last requester has it earliest: an asynchronous worker waits
  for its own copy, not for the batch's last (the paper's makespan fits a synchronous barrier).
- Requesters no path can ever reach (no capacity left on the way, for the rest of time) are
  listed as unserved rather than failing the whole batch.
- The server is never its own distributor (it is dropped from the list, as schedule() drops it
  from the aggregators).

Cut-through (cut_through=True, not in the paper; the runtime's data plane forwards a payload as
it arrives): a forward starts with its distributor's inbound transfer and never ends before it
(Network.t_en_relay). That makes one more shape worth trying, the pipeline: the server sends one
copy to the first requester, which passes it on to the next as it comes, and so on down the
order, every hop at the pace of the one before (a relay of a relay: a Distributor whose inbound
comes from another distributor). It is kept when its makespan is below every two-level case's
(ties too: the server sends one copy). It needs every requester to be a distributor, and at
most PIPELINE_MAX of them (the runtime nests each hop's forwards in the one before's key).
Its order (not the paper's; chain_order): every hop runs at the pace of the one before, so one
slow link makes the rest of the chain slow. The requesters go fastest inbound first (the direct
order's transfer times), and among equals those that forward fastest first: a requester whose
downlink is slow is served late in any case, but one whose uplink alone is slow, placed early,
would make the fast ones after it wait as long (30 workers under N3: a fetch 0.87 s, median, at
full-rate downlinks where the model alone takes 80 ms). With two rates (full, a tenth) that order
costs the fast nothing; with more levels it can miss a better one (a tenth-rate sender before a
half-rate receiver), and the pipeline is kept only where no two-level case does better.
(Serving the requesters whose uplink alone is slow straight from the server instead, off the
chain, was tried: in the runtime each such send holds the server's next pull batch, and fetches
at full-rate links took longer, 0.55 s against 0.29-0.36, median.)

The greedy tree (cut_through only; not in the paper): the requesters in the pipeline's order,
slow senders last (slow_senders: an egress under SLOW_EGRESS of the fastest requester's), each
get the model from whichever of the server and the requesters already served would deliver it
earliest on the network as reserved so far, except that a slow sender takes it from another slow
sender once one has it. Why: on the scheduler's view the relays' egress is often booked (the
runtime's pushes and aggregates use the same links), and then the pipeline waits on a booked hop
while the two-level cases fall back on the server sending to one requester after another (each
send holds its next pull batch: 30 workers under N3, five or six 80 ms sends in a row); the tree
goes around a booked relay. And why slow senders take it from each other: their updates reach
the server late (sched.scheduler drops them), so a fast relay's egress spent on them is taken
from the pushes of the workers whose updates count. It is kept only where it scores strictly
better than the case or pipeline kept.

objective="fast-first" (not in the paper; the runtime's for asynchronous modes) scores a tree by
the last delivery to the requesters that are neither slow senders nor paced by their own
downlink (their transfer from the server alone within PACED_FACTOR of the fastest's), then by
the makespan: under N3 half the downlinks are at a tenth of the rate, those deliveries take
0.8 s in any tree, and the makespan alone cannot tell a tree that has the fast requesters served
in 80 ms from one that takes five times that.
"""
from dataclasses import dataclass, field
from math import inf, isfinite

from .aggregation import group_order
from .network import t_en as path_t_en
from .plan import Transfer


PIPELINE_MAX = 64


@dataclass(frozen=True)
class Delivery:
    """How `worker` gets the model: from `source` (the server, or a distributor) by `transfer`."""
    worker: int
    source: int
    transfer: Transfer


@dataclass
class Distributor:
    """A distributor used by the schedule: `inbound` brings it the model from the server (or, in
    a cut-through pipeline or tree, from another distributor: the same Transfer as that one's
    outbound); it then serves `workers` (itself first if it requested the model too) through
    `outbound`."""
    host: int
    inbound: Transfer
    workers: list
    outbound: list

    @property
    def ready(self):
        """When it has the whole model (store-and-forward: when it may start forwarding it;
        cut-through forwards start with the inbound transfer)."""
        return self.inbound.end


@dataclass
class Distribution:
    """The schedule answering one batch of pull requests with one model version."""
    server: int
    model_size: float
    version: object
    start: float
    order: list                # requesters, shortest transfer from the server first
    n_direct: int              # size of the direct group (the case kept; the tree's server sends)
    direct: list               # Transfers server -> worker of the direct group, in order
    distributors: list         # Distributor, in the order the server sends to them
    deliveries: dict           # worker -> Delivery, every served requester exactly once
    unserved: list = field(default_factory=list)
    cases: list = field(default_factory=list)   # makespan of every case n = 0..|order| (inf: none)
    pipeline: float = inf   # makespan of the cut-through pipeline (inf: not possible or not tried)
    tree: float = inf       # makespan of the greedy cut-through tree (inf: not tried)

    @property
    def makespan(self):
        """When the last requester has the model."""
        return max((d.transfer.end for d in self.deliveries.values()), default=self.start)

    @property
    def server_bytes(self):
        """Bytes that leave the server's NIC (distribution lowers this)."""
        return self.model_size * (len(self.direct) + sum(d.inbound.src == self.server
                                                         for d in self.distributors))

    def transfers(self):
        """Every transfer once: into each distributor and its forwards, then the direct group
        (in a pipeline a distributor's inbound is the previous one's forward)."""
        out, seen = [], set()
        for d in self.distributors:
            for t in (d.inbound, *d.outbound):
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        out.extend(self.direct)
        return out

    def __str__(self):
        v = "" if self.version is None else " v%s" % (self.version,)
        lines = ["distribution of model%s (%.6g bytes) from S%d to %d requesters: makespan %.6g s, "
                 "server bytes %.6g, %d direct, %d distributors"
                 % (v, self.model_size, self.server, len(self.deliveries) + len(self.unserved),
                    self.makespan, self.server_bytes, len(self.direct), len(self.distributors))]
        for d in self.distributors:
            lines.append("  %s%-4d -> d%-4d [%.6g, %.6g]  distributor for %s"
                         % ("S" if d.inbound.src == self.server else "d", d.inbound.src,
                            d.host, d.inbound.start, d.inbound.end,
                            ", ".join(("w%d (itself)" if w == d.host else "w%d") % w
                                      for w in d.workers)))
            for t in d.outbound:
                lines.append("      d%-4d -> w%-4d [%.6g, %.6g]" % (t.src, t.dst, t.start, t.end))
        for t in self.direct:
            lines.append("  S%-4d -> w%-4d [%.6g, %.6g]  direct" % (t.src, t.dst, t.start, t.end))
        if self.unserved:
            lines.append("  unserved (no capacity on any path, ever): %s"
                         % ", ".join("w%d" % w for w in self.unserved))
        return "\n".join(lines)


def _transfer(src, dst, size, end, segs):
    return Transfer(src, dst, size, segs[0].t0 if segs else end, end, segs, "model", ())


def _check_host(network, h, what):
    if not (isinstance(h, int) and 0 <= h < network.hosts):
        raise ValueError("%s %r is not a host of this network (0..%d)"
                         % (what, h, network.hosts - 1))


def _last_end(network, src, dsts, size, start):
    """When `src` would have sent `size` bytes to each of `dsts`, one after the other (each
    reserved before the next), from `start`; `network` is not modified. Only links two of the
    paths share (src's egress, shared core links) are copied."""
    paths = [network.path(src, d) for d in dsts]
    seen, shared = set(), set()
    for p in paths:
        shared.update(k for k in p if k in seen)
        seen.update(p)
    copies = {k: network.links[k].copy() for k in shared}
    last = start
    for path in paths:
        end, segs = path_t_en([copies[k] if k in copies else network.links[k] for k in path],
                              size, start)
        if end == inf:
            return inf
        for k in path:
            if k in copies:
                for s in segs:
                    copies[k].subtract(s.t0, s.t1, s.rate)
        last = max(last, end)
    return last


def rank_direct(requests, network, server, size, start):
    """Alg. 1 on the server's transfers: requesters by shortest transfer from the server, each
    reserved before the next is picked; ties by request order. Requesters the server cannot reach
    directly come last, in request order."""
    nw = network.copy()
    left = list(requests)
    out = []
    while left:
        best = None
        for w in left:
            end, segs = nw.t_en(server, w, size, start)
            if best is None or end < best[1]:
                best = (w, end, segs)
        if best[1] == inf:
            return out + left
        w, _, segs = best
        if segs:
            nw.reserve(server, w, segs)
        out.append(w)
        left.remove(w)
    return out


def _case(n, order, network, server, dists, size, start, cut_through=False):
    """Case n: (makespan, direct transfers, Distributors, network after). makespan is inf (and
    the rest None) when the case cannot serve everyone. `network` is not modified."""
    direct_group = order[:n]
    requested = set(order)
    pending = list(order[n:])
    nw = network.copy()
    relays = []
    constrained = n > 0
    for d in dists:
        if not pending:
            break
        if d in requested and d not in pending:
            continue    # in the direct group (served last) or already served by a distributor
        trial = nw.copy()
        arr, segs = trial.send(server, d, size, start)
        if arr == inf:
            continue
        # store-and-forward: the forwards start once the model is in; cut-through: as it comes
        inbound_start = segs[0].t0 if segs else arr
        # The horizon: when the server would finish its direct group, sent after this distributor.
        horizon = _last_end(trial, server, direct_group, size, start) if constrained else inf
        members, outbound = [], []
        queue = pending
        if d in pending:
            members.append(d)   # served by its own inbound transfer
            queue = [w for w in pending if w != d]
        taken = 0
        for w in queue:
            if cut_through:
                end, wsegs = trial.t_en_relay(d, w, size, inbound_start, arr)
            else:
                end, wsegs = trial.t_en(d, w, size, arr)
            if end == inf or end > horizon:
                break
            if wsegs:
                trial.reserve(d, w, wsegs)
            members.append(w)
            outbound.append(_transfer(d, w, size, end, wsegs))
            taken += 1
        if not taken:
            continue
        nw = trial
        pending = queue[taken:]
        constrained = True
        relays.append(Distributor(d, _transfer(server, d, size, arr, segs), members, outbound))
    if pending:
        return inf, None, None, None
    direct = []
    for w in direct_group:
        end, segs = nw.send(server, w, size, start)
        if end == inf:
            return inf, None, None, None
        direct.append(_transfer(server, w, size, end, segs))
    makespan = max([t.end for t in direct] + [t.end for r in relays for t in r.outbound]
                   + [r.inbound.end for r in relays if r.host in r.workers] + [start])
    return makespan, direct, relays, nw


def chain_order(order, network, server, size, start):
    """The pipeline's order (module header): by the time each requester alone would take to get
    the model from the server, then by its egress rate at `start`, fastest first; ties keep
    `order`'s."""
    def key(w):
        return (network.t_en(server, w, size, start)[0],
                -network.links[network.egress(w)].at(start))
    return sorted(order, key=key)


def _pipeline(order, network, server, dists, size, start):
    """The cut-through pipeline down `order` (module header): (makespan, Distributors, network
    after). makespan is inf when it cannot serve everyone: a requester that is no distributor
    (it would have to relay) or a path with no capacity."""
    if not 2 <= len(order) <= PIPELINE_MAX or not set(order) <= set(dists):
        return inf, None, None
    nw = network.copy()
    end, segs = nw.send(server, order[0], size, start)
    if end == inf:
        return inf, None, None
    inbound = _transfer(server, order[0], size, end, segs)
    relays = []
    for d, w in zip(order, order[1:]):
        end, segs = nw.send_relay(d, w, size, inbound.start, inbound.end)
        if end == inf:
            return inf, None, None
        hop = _transfer(d, w, size, end, segs)
        relays.append(Distributor(d, inbound, [d, w], [hop]))
        inbound = hop
    return inbound.end, relays, nw


def _tree(order, network, server, dists, size, start, slow):
    """The greedy cut-through tree (module header): each requester, in `order`, gets the model
    from whichever of the server and the distributors that already have it (or are getting it)
    would deliver it earliest on the network as reserved so far; a requester in `slow` (a slow
    sender) from another slow sender as soon as one has it. (makespan, direct Transfers,
    Distributors, network after); makespan is inf when some requester cannot be reached."""
    nw = network.copy()
    dset = set(dists)
    inbound, forwards, direct = {}, {}, []

    def earliest(w, parents, from_server):
        end, src, segs = inf, server, None
        if from_server:
            end, segs = nw.t_en(server, w, size, start)
        for p in parents:
            inb = inbound[p]
            e, sg = nw.t_en_relay(p, w, size, inb.start, inb.end)
            if e < end:
                end, src, segs = e, p, sg
        return end, src, segs

    for w in order:
        relays_now = [p for p in inbound if p in dset]
        end = inf
        if w in slow:   # from a slow sender that may relay, if one can reach it
            end, src, segs = earliest(w, [p for p in relays_now if p in slow], False)
        if end == inf:
            end, src, segs = earliest(w, relays_now, True)
        if end == inf:
            return inf, None, None, None
        if segs:
            nw.reserve(src, w, segs)
        tr = _transfer(src, w, size, end, segs)
        inbound[w] = tr
        (direct if src == server else forwards.setdefault(src, [])).append(tr)
    relays = [Distributor(p, inbound[p], [p] + [t.dst for t in outs], outs)
              for p, outs in forwards.items()]
    direct = [t for t in direct if t.dst not in forwards]
    return max((t.end for t in inbound.values()), default=start), direct, relays, nw


OBJECTIVES = ("makespan", "mean", "fast-first")

# A requester whose egress is under SLOW_EGRESS times the fastest requester's is a slow sender:
# its next update would reach the server late (sched.scheduler drops such updates). One whose
# transfer from the server alone takes more than PACED_FACTOR times the fastest requester's is
# paced by its own downlink, whatever the tree.
SLOW_EGRESS = 0.5
PACED_FACTOR = 2.0
# "Under a share" forgives float rounding: the paper's NIC levels include exactly half the base
# rate (5 of 10 Gbps), which must stay on the fast side however the rates were scaled (a base
# rate of 12.5e6 / 3 puts that level a rounding error under half: --dilate 3 turned it slow).
ROUNDING = 1e-9


def under_share(rate, reference, share):
    """Is `rate` under `share` of `reference` by more than float rounding?"""
    return rate < share * reference * (1.0 - ROUNDING)


def slow_senders(requests, network, size, start):
    """The requesters whose egress alone would carry `size` bytes from `start` at under
    SLOW_EGRESS of the fastest's average rate. Over a transfer, not at the instant `start`: on
    the scheduler's view a full-rate egress may be booked for a moment (the worker's own push),
    which does not make it a slow sender."""
    took = {w: path_t_en([network.links[network.egress(w)]], size, start)[0] - start
            for w in requests}
    quickest = min(took.values(), default=inf)
    # w's rate is under SLOW_EGRESS of the quickest's: the quickest's time under that share
    # of w's
    return {w for w, t in took.items() if under_share(quickest, t, SLOW_EGRESS)}


def _ends(direct, relays):
    """When each requester of a case has the model (each counted once: in a pipeline, a hop is
    one worker's delivery and the next relay's inbound)."""
    ends = {t.dst: t.end for t in direct}
    for r in relays:
        if r.host in r.workers:
            ends[r.host] = r.inbound.end
        for t in r.outbound:
            ends[t.dst] = t.end
    return ends


def _mean_end(direct, relays):
    """Mean time at which the requesters of a case have the model."""
    ends = _ends(direct, relays)
    return sum(ends.values()) / len(ends) if ends else 0.0


def _fast_links(order, network, server, size, start, slow):
    """The requesters that are neither slow senders nor paced by their own downlink: those whose
    next update the server can have soonest ("fast-first" objective)."""
    solo = {w: network.t_en(server, w, size, start)[0] - start for w in order}
    fastest = min(solo.values(), default=inf)
    # within PACED_FACTOR of the fastest: its rate not under 1 / PACED_FACTOR of the fastest's
    return {w for w, t in solo.items()
            if not under_share(fastest, t, 1.0 / PACED_FACTOR) and w not in slow}


def distribute(requests, network, server, model_size, *, distributors=(), start=0.0, seed=0,
               version=None, cut_through=False, objective="makespan"):
    """Answer pull `requests` (requesting hosts) with one model of `model_size` bytes, ready at
    the server at `start`, through `distributors` (hosts; pre-assigned in a random order from
    `seed`) on `network` (not modified). `version` is only recorded. cut_through: distributors
    forward the model as it arrives (Network.t_en_relay; the runtime's data plane does) instead
    of once it is whole (the paper's store-and-forward, the default). objective: "makespan" (the
    paper's: the last requester's delivery), "mean" (the requesters' mean delivery) or
    "fast-first" (the last delivery to the requesters that are neither slow senders nor paced
    by their own downlink, then the makespan: module header). Returns (Distribution, network
    after its reservations)."""
    _check_host(network, server, "server")
    if objective not in OBJECTIVES:
        raise ValueError("objective must be one of %s, got %r" % (", ".join(OBJECTIVES), objective))
    if not (isinstance(model_size, (int, float)) and model_size > 0 and isfinite(model_size)):
        raise ValueError("model_size must be a finite number of bytes > 0, got %r" % (model_size,))
    requests = list(requests)
    for w in requests:
        _check_host(network, w, "requester")
        if w == server:
            raise ValueError("the server %d cannot request its own model" % server)
    if len(set(requests)) != len(requests):
        raise ValueError("each host requests the model once per batch, got %r" % (requests,))
    dists = list(distributors)
    for d in dists:
        _check_host(network, d, "distributor")
    if len(set(dists)) != len(dists):
        raise ValueError("distributors must be distinct hosts, got %r" % (dists,))
    dists = group_order([d for d in dists if d != server], seed)

    # Reservations end, so a path with capacity at some time after `start` keeps it: what the
    # empty network cannot reach, no schedule reaches.
    def reachable(w):
        if network.t_en(server, w, model_size, start)[0] < inf:
            return True
        return any(network.t_en(server, d, model_size, start)[0] < inf
                   and network.t_en(d, w, model_size, start)[0] < inf for d in dists)
    unserved = [w for w in requests if not reachable(w)]
    order = rank_direct([w for w in requests if w not in unserved], network, server, model_size,
                        start)

    # (pull planning is latency-critical: computed only where the tree or the objective uses it)
    slow = (slow_senders(order, network, model_size, start)
            if cut_through or objective == "fast-first" else set())
    fast = (_fast_links(order, network, server, model_size, start, slow)
            if objective == "fast-first" else ())

    def cost(run):
        makespan, direct, relays, _ = run
        if makespan == inf:
            return (inf, inf) if objective == "fast-first" else inf
        if objective == "makespan":
            return makespan
        if objective == "mean":
            return _mean_end(direct, relays)
        ends = _ends(direct, relays)
        return (max((ends[w] for w in fast if w in ends), default=start), makespan)

    def best_case(order):
        runs = [_case(n, order, network, server, dists, model_size, start, cut_through)
                for n in range(len(order) + 1)]
        # least cost, then fewest sends out of the server, then the most direct transfers
        best = min(range(len(runs)),
                   key=lambda n: (cost(runs[n]), n + len(runs[n][2] or ()), -n))
        return best, runs
    best, runs = best_case(order)
    if runs[best][0] == inf:
        # Only when some requester is reachable through a distributor alone and no case relays
        # it: serve the others and report those as unserved.
        direct_only = [w for w in order if network.t_en(server, w, model_size, start)[0] < inf]
        unserved += [w for w in order if w not in direct_only]
        order = direct_only
        best, runs = best_case(order)
    if runs[best][0] == inf:
        # A link with capacity for a while only (a NIC that dies mid-batch) can serve some of the
        # requesters, not all: serve directly, in order, those it still can (a requester that gets
        # no capacity reserves none, so the others' sends are unchanged) and list the rest.
        trial, served = network.copy(), []
        for w in order:
            end, _ = trial.send(server, w, model_size, start)
            (served if end < inf else unserved).append(w)
        order = served
        best, runs = best_case(order)
    _, direct, relays, nw = runs[best]
    pipeline = tree = inf
    if cut_through and not unserved:
        chained = chain_order(order, network, server, model_size, start)
        pipeline, chain, chain_nw = _pipeline(chained, network, server, dists, model_size, start)
        kept = runs[best]
        if pipeline < inf and cost((pipeline, [], chain, chain_nw)) <= cost(kept):
            kept = (pipeline, [], chain, chain_nw)
            best, direct, relays, nw = 0, [], chain, chain_nw
        if len(order) <= PIPELINE_MAX:  # (the runtime nests each hop's forwards, as a pipeline's)
            # the greedy tree (slow senders last), kept only where it does strictly better
            greedy = _tree(sorted(chained, key=lambda w: w in slow), network, server, dists,
                           model_size, start, slow)
            tree = greedy[0]
            if tree < inf and cost(greedy) < cost(kept):
                direct, relays, nw = greedy[1], greedy[2], greedy[3]
                best = len(direct)
    deliveries = {}
    for r in relays:
        for w in r.workers:
            if w == r.host and w not in deliveries:
                deliveries[w] = Delivery(w, r.inbound.src, r.inbound)
        for t in r.outbound:
            deliveries[t.dst] = Delivery(t.dst, r.host, t)
    for t in direct:
        deliveries[t.dst] = Delivery(t.dst, server, t)
    dist = Distribution(server, float(model_size), version, start, order, best, direct, relays,
                        deliveries, sorted(unserved), [r[0] for r in runs], pipeline, tree)
    return dist, nw
