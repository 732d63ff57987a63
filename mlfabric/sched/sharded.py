"""A model split across servers S_1..S_m (paper §10.2): every update has one component per server,
all computed from the same model version, so all share one deadline (eq. 9). Ordering is Alg. 2 with
the components of an update reserved together and t_en(g) = max_j t_en(g^j) (eq. 18); every server
then applies the same updates in the same order, which keeps the update count uniform over all
parts of the model (the point of §10.2). Aggregation (Alg. 3) then runs per server on the shared
network. Output: one mlfabric.sched.plan.Plan per server, gathered in a ShardedPlan.

Where the paper leaves a choice open, this is what we do, and why:
- Components of one update are reserved in the servers' order (S_1 first), each on the network the
  previous ones left. They all leave through the worker's egress, so computing them independently
  would book that link twice; t_en(g) is the latest of these component ends (eq. 18).
- Positions, ties, stale and look-ahead drops follow mlfabric.sched.ordering exactly (see its
  header), with eq. 18 in place of the single-server t_en; with one server the two are identical.
- Aggregation runs one server after the other on the network the previous servers' plans left,
  slowest shard first: the one whose components, sent straight to it in the batch's order on the
  network alone, arrive last (ties: the servers' order). An update is applied everywhere only
  when its last component commits, so the slowest shard decides how fast versions advance; it
  gets first pick of the capacity and the others fit around it. (Alg. 2's own arrivals would be
  a biased measure: there the components of an update are reserved S_1 first, so later servers
  look slower than they are.)
- Aggregators given as a plain list serve every server, except hosts that are themselves servers
  of this model (their NICs are the bottleneck aggregation relieves); a mapping {server: hosts}
  is taken as given. Each server pre-assigns its aggregators with seed + its index, so the servers
  do not all load the same aggregator with their first aggregated group.
- A component may be 0 bytes (a sparse update that touches nothing on that shard): it takes no
  network time and arrives when the update is ready.
"""
from dataclasses import dataclass
from math import inf, isfinite

from . import aggregation, ordering
from .network import t_en as path_t_en
from .ordering import deadline
from .plan import DROP_REASONS, Plan, Transfer, Update
from .scheduler import MODES, commits_of


@dataclass(frozen=True)
class ShardedUpdate:
    """A worker's update to a sharded model: `sizes[j]` bytes for the j-th server (in the order the
    servers are given to the scheduler), computed from model `version`, ready at `ready`; `norms[j]`
    is the L2 norm of the j-th component (None: unknown, taken as inf like Update.norm, so a
    divergence bound assumes the worst)."""
    id: int
    worker: int
    sizes: tuple
    version: int
    ready: float = 0.0
    norms: tuple = None

    def __post_init__(self):
        try:
            sizes = tuple(float(s) for s in self.sizes)
        except TypeError:
            raise ValueError("update %r: sizes must be a sequence of bytes per server, got %r"
                             % (self.id, self.sizes)) from None
        if not sizes:
            raise ValueError("update %r: sizes is empty; give one size per server" % (self.id,))
        for s in sizes:
            if not (s >= 0 and isfinite(s)):
                raise ValueError("update %r: component sizes must be finite and >= 0, got %r"
                                 % (self.id, s))
        norms = (inf,) * len(sizes) if self.norms is None else tuple(float(n) for n in self.norms)
        if len(norms) != len(sizes):
            raise ValueError("update %r: %d norms for %d components"
                             % (self.id, len(norms), len(sizes)))
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "norms", norms)

    @property
    def size(self):
        """Bytes over all components."""
        return sum(self.sizes)

    def component(self, j):
        """The j-th component as a plain Update (same id, worker, version, ready)."""
        return Update(self.id, self.worker, self.sizes[j], self.version, self.ready, self.norms[j])


@dataclass
class ShardedOrdering:
    order: list       # applied update ids, by position (the same on every server)
    dropped: dict     # id -> DROP_* reason
    transfers: dict   # id -> tuple of Transfers, one per server (the tentative schedules)
    t_en: dict        # id -> eq. 18: the latest of its components' ends
    network: object   # the network after reserving every component


def _check_servers(servers, network):
    servers = tuple(servers)
    if not servers:
        raise ValueError("a sharded model needs at least one server, got none")
    for s in servers:
        if not (isinstance(s, int) and 0 <= s < network.hosts):
            raise ValueError("server %r is not a host of this network (0..%d)"
                             % (s, network.hosts - 1))
    if len(set(servers)) != len(servers):
        raise ValueError("servers must be distinct hosts, got %r" % (servers,))
    return servers


def _check_updates(updates, network, servers):
    by_id = {}
    for u in updates:
        if not isinstance(u, ShardedUpdate):
            raise ValueError("expected ShardedUpdate, got %r" % (u,))
        if len(u.sizes) != len(servers):
            raise ValueError("update %r has %d components for %d servers"
                             % (u.id, len(u.sizes), len(servers)))
        if not (isinstance(u.worker, int) and 0 <= u.worker < network.hosts):
            raise ValueError("update %r: worker %r is not a host of this network (0..%d)"
                             % (u.id, u.worker, network.hosts - 1))
        if u.id in by_id:
            raise ValueError("update ids must be unique within a batch, %r repeats" % (u.id,))
        by_id[u.id] = u
    return by_id


def components_t_en(network, u, servers, start=0.0):
    """eq. 18 for update `u`: its components sent in the servers' order, each taking the whole
    residual bottleneck rate left by the ones before (Fig. 4b). Returns (end, [(end_j, segments_j)
    per server]); end is inf (and the list None) when some component can never arrive. `network`
    is not modified."""
    t0 = max(u.ready, start)
    paths = [network.path(u.worker, s) for s in servers]
    # Only links on two or more component paths (the worker's egress, shared core links) see the
    # earlier components' reservations; every other link is read in place, never copied.
    seen, shared = set(), set()
    for p in paths:
        shared.update(k for k in p if k in seen)
        seen.update(p)
    copies = {k: network.links[k].copy() for k in shared}
    end, parts = t0, []
    for j, path in enumerate(paths):
        profiles = [copies[k] if k in copies else network.links[k] for k in path]
        end_j, segs = path_t_en(profiles, u.sizes[j], t0)
        if end_j == inf:
            return inf, None
        for k in path:
            if k in copies:
                for s in segs:
                    copies[k].subtract(s.t0, s.t1, s.rate)
        parts.append((end_j, segs))
        end = max(end, end_j)
    return end, parts


def order_sharded(updates, network, servers, *, v_init=0, tau_max=inf, start=0.0):
    """Alg. 2 over sharded `updates` with eq. 18 as t_en; the components of each applied update
    are reserved together. `network` is not modified."""
    servers = _check_servers(servers, network)
    by_id = _check_updates(updates, network, servers)
    dl = {u.id: deadline(u, tau_max, v_init) for u in by_id.values()}

    def t_en(uid, net):
        return components_t_en(net, by_id[uid], servers, start)

    def reserve(uid, net, parts):
        for s, (_, segs) in zip(servers, parts):
            if segs:
                net.reserve(by_id[uid].worker, s, segs)

    order, dropped, applied, nw = ordering.alg2(by_id, dl, network, t_en, reserve)
    transfers, ends = {}, {}
    for cur in order:
        u, (end, parts) = by_id[cur], applied[cur]
        transfers[cur] = tuple(
            Transfer(u.worker, s, u.sizes[j], segs[0].t0 if segs else end_j, end_j, segs,
                     "update", (cur,))
            for j, (s, (end_j, segs)) in enumerate(zip(servers, parts)))
        ends[cur] = end
    return ShardedOrdering(order, dropped, transfers, ends, nw)


def _aggregators_per_server(aggregators, servers, network):
    if isinstance(aggregators, dict):
        for s in aggregators:
            if s not in servers:
                raise ValueError("aggregators given for %r, which is not one of the servers %r"
                                 % (s, servers))
        per = {s: [a for a in aggregators.get(s, ()) if a != s] for s in servers}
    else:
        shared = [a for a in aggregators if a not in servers]
        per = {s: list(shared) for s in servers}
    for hosts in per.values():
        for a in hosts:
            if not (isinstance(a, int) and 0 <= a < network.hosts):
                raise ValueError("aggregator %r is not a host of this network (0..%d)"
                                 % (a, network.hosts - 1))
    return per


def arrival(plan, uid):
    """When update `uid` (its own transfer, or its aggregate) reaches `plan`'s server; None if it
    is not applied there."""
    for t in plan.direct:
        if uid in t.ids:
            return t.end
    for a in plan.aggregates:
        if uid in a.members:
            return a.transfer.end
    return None


@dataclass
class ShardedPlan:
    """The schedule of one batch to a sharded model: `plans[j]` is the Plan of `servers[j]`; all
    share `order` and `dropped`. `aggregation_order` lists the servers in the order their
    aggregation was planned on the shared network."""
    servers: tuple
    v_init: int
    tau_max: float
    updates: dict            # id -> ShardedUpdate
    order: list
    dropped: dict
    plans: list
    aggregation_order: tuple
    start: float = 0.0

    def plan(self, server):
        """The Plan of one server."""
        return self.plans[self.servers.index(server)]

    def position(self, uid):
        return self.plans[0].position(uid)

    def delay(self, uid):
        """tau of an applied update: the same on every server, since the order is the same."""
        return self.plans[0].delay(uid)

    def arrival(self, uid):
        """eq. 18: when the last component of `uid` reaches its server (None if dropped)."""
        if uid not in self.order:
            return None
        return max(arrival(p, uid) for p in self.plans)

    def commit_time(self, uid):
        """When `uid` has been applied by every server (None if dropped)."""
        if uid not in self.order:
            return None
        return max(p.commit_time(uid) for p in self.plans)

    @property
    def makespan(self):
        """When the last server has applied the batch."""
        return max(p.makespan for p in self.plans)

    @property
    def server_bytes(self):
        return sum(p.server_bytes for p in self.plans)

    def transfers(self):
        out = []
        for p in self.plans:
            out.extend(p.transfers())
        return out

    def __str__(self):
        lines = ["sharded plan: servers %s, v_init %d, tau_max %s, %d applied, %d dropped, "
                 "makespan %.6g s, server bytes %.6g"
                 % (", ".join("S%d" % s for s in self.servers), self.v_init,
                    "inf" if self.tau_max == inf else "%g" % self.tau_max, len(self.order),
                    len(self.dropped), self.makespan, self.server_bytes)]
        for uid in self.order:
            u = self.updates[uid]
            per = ", ".join("S%d %.6g" % (s, arrival(p, uid))
                            for s, p in zip(self.servers, self.plans))
            lines.append("  #%-3d u%-5d w%-4d tau=%d  all parts at %.6g (%s)"
                         % (self.position(uid), uid, u.worker, self.delay(uid),
                            self.arrival(uid), per))
        for uid, why in sorted(self.dropped.items()):
            u = self.updates[uid]
            lines.append("  dropped u%d (w%d, v%d): %s" % (uid, u.worker, u.version,
                                                           DROP_REASONS.get(why, why)))
        lines.append("  aggregation planned for %s in that order"
                     % ", ".join("S%d" % s for s in self.aggregation_order))
        for s, p in zip(self.servers, self.plans):
            lines.append("  --- server S%d ---" % s)
            lines.extend("  " + line for line in str(p).splitlines())
        return "\n".join(lines)


def _server_plan(server, v_init, tau_max, comps, o, direct, aggregates, start):
    plan = Plan(server=server, v_init=v_init, tau_max=tau_max, updates=comps, order=list(o.order),
                dropped=dict(o.dropped), direct=direct, aggregates=aggregates, start=start)
    plan.commits = commits_of(direct, aggregates, start)
    return plan


def schedule_sharded(updates, network, servers, *, aggregators=(), tau_max=inf, v_init=0,
                     start=0.0, seed=0, mode="async"):
    """Plan one batch of ShardedUpdates to `servers` (S_1..S_m; update j-th sizes go to the j-th)
    on `network` (not modified). `aggregators`: hosts that may aggregate for every server, or
    {server: hosts}. Other arguments as in mlfabric.sched.schedule. Returns (ShardedPlan, network
    after every server's plan is reserved)."""
    if mode not in MODES:
        raise ValueError("mode must be one of %s, got %r" % (", ".join(MODES), mode))
    if not tau_max >= 0:
        raise ValueError("tau_max must be >= 0, got %r" % (tau_max,))
    if mode != "async":
        tau_max = inf
    servers = _check_servers(servers, network)
    updates = list(updates)
    o = order_sharded(updates, network, servers, v_init=v_init, tau_max=tau_max, start=start)
    by_id = {u.id: u for u in updates}
    per_aggs = _aggregators_per_server(aggregators, servers, network)

    comps = [{uid: u.component(j) for uid, u in by_id.items()} for j in range(len(servers))]

    # Slowest shard first (see the header): the last arrival of each server's components sent
    # straight to it, in the batch's order, on the network alone (DetAgg(|U|) with no aggregator).
    def alone(j):
        return aggregation.det_agg(len(o.order), o.order, comps[j], network, servers[j], [],
                                   start)[0]
    agg_order = sorted(range(len(servers)), key=lambda j: (-alone(j), j))

    nw = network
    plans = [None] * len(servers)
    try:
        for j in agg_order:
            s = servers[j]
            aggs = aggregation.group_order(per_aggs[s], seed + j)
            g = aggregation.aggregate(o.order, comps[j], nw, s, aggs, start=start)
            plans[j] = _server_plan(s, v_init, tau_max, comps[j], o, g.direct, g.aggregates, start)
            nw = g.network
    except ValueError:
        # Aggregating one server after another can leave a later server's components no capacity
        # that the ordering, reserving each update's components together, still had (a link that
        # dies mid-batch). Then the batch keeps the ordering's own transfers, with no aggregation:
        # they are feasible together by construction.
        agg_order = list(range(len(servers)))
        for j, s in enumerate(servers):
            direct = [o.transfers[uid][j] for uid in o.order]
            plans[j] = _server_plan(s, v_init, tau_max, comps[j], o, direct, [], start)
        nw = o.network
    sp = ShardedPlan(servers, v_init, tau_max, by_id, list(o.order), dict(o.dropped), plans,
                     tuple(servers[j] for j in agg_order), start)
    return sp, nw
