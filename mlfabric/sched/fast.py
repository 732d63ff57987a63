"""The scheduler's fast path (paper §5.1 Alg. 2, §5.2 Alg. 3; §7.4 measures the scheduler's
cost): ordering and aggregation in C++ (csrc/sched_fast.cc), computing exactly what
ordering.order_updates and aggregation.aggregate compute — same order, drops, groups and
segments, bit-identical floats — with or without cut_through (aggregates relayed cut-through,
Network.t_en_relay, and the pipeline case with its chain of upstream Aggregates). Not norm_cap:
scheduler.schedule runs the reference loops for a finite cap.

Owns: reading a batch and a Network once, one native call with the GIL released, and building
the result objects once at the end. It never changes the algorithms: each shortcut in C++ only
skips work that provably cannot change the answer (docs/sched/fast.md says why), and
plain=True runs the paper's loops for the side-by-side benchmark (`python -m mlfabric.bench
sched`).

Differences a caller can see, all deliberate:
- Grouping.cases: a case the fast path stopped early (its t_max reached the best makespan found
  so far, so it can never be chosen) holds inf, as an infeasible case does. The chosen case,
  n_direct, makespan and the groups are always the reference's; plain=True fills every case.
- Grouping.direct holds the very Transfer objects of Ordering.transfers: group 1 keeps the
  ordering's schedules (§5.2). Equal to the reference's, just not copies (Transfer is frozen).
- Bad input is refused up front with a ValueError, including what the reference would only trip
  over later or not at all: a send time max(ready, start) that is negative or NaN, a NaN size or
  deadline.
"""
import itertools
import time
from math import inf, isnan

from .aggregation import Grouping, pipeline_chain
from .network import Network, Profile, Segment
from .ordering import Ordering, deadline
from ._records import fast_constructor
from .plan import DROP_LOOKAHEAD, DROP_NO_PATH, DROP_STALE, Aggregate, Transfer

try:
    from .._C import sched_network_lists as _network_lists, sched_run as _run
except ImportError:  # a build without the scheduler's native part
    _run = _network_lists = None

_DROPS = (DROP_STALE, DROP_LOOKAHEAD, DROP_NO_PATH)  # codes of enum Drop in csrc/sched_fast.h


def available():
    """True when the native fast path is built into mlfabric._C."""
    return _run is not None


def schedule_fast(updates, network, server, aggs, *, tau_max=inf, v_init=0, start=0.0,
                  agg_scale=1.0, cut_through=False, plain=False):
    """Alg. 2 then Alg. 3 for `updates` (a list of Update) to `server` on `network` (not
    modified); `aggs` is the aggregators' pre-assigned group order (aggregation.group_order's
    output). Returns (ordering.Ordering, aggregation.Grouping), equal to
    order_updates(updates, network, server, v_init=, tau_max=, start=) and
    aggregate(order, {id: update}, network, server, aggs, start=, agg_scale=, cut_through=) (see
    the module header for Grouping.cases). plain=True: the paper's loops, without the exact
    shortcuts. Raises RuntimeError when the native part is not built (see available())."""
    res, batch = _native(updates, network, server, aggs, tau_max, v_init, start, agg_scale,
                         cut_through, plain, True)
    o = res.ordering(every_transfer=True)
    return o, res.grouping(o.transfers)


def plan_parts(updates, network, server, aggs, *, tau_max=inf, v_init=0, start=0.0,
               agg_scale=1.0, cut_through=False, plain=False, timings=None):
    """What scheduler.schedule needs for a Plan, on the fast path: (order, dropped, group 1's
    transfers, aggregates, network after the plan's reservations), built without the parts a Plan
    does not hold (the network after ordering alone, the tentative transfers of updates that end
    up aggregated). `timings`: a dict that receives the seconds spent reading the input, in Alg. 2
    and Alg. 3 (C++), in the rest of the native call (copies, export) and building the result."""
    res, batch = _native(updates, network, server, aggs, tau_max, v_init, start, agg_scale,
                         cut_through, plain, False, checked=True)  # only schedule() calls this
    t0 = time.perf_counter()
    o = res.ordering(every_transfer=False)
    g = res.grouping(o.transfers)
    if timings is not None:
        timings.update(input=res.seconds_input, order=res.seconds_order,
                       aggregate=res.seconds_aggregate,
                       native_rest=res.seconds_call - res.seconds_order - res.seconds_aggregate,
                       build=time.perf_counter() - t0)
    return o.order, o.dropped, g.direct, g.aggregates, g.network


# --- input ----------------------------------------------------------------------------------------

class _Batch:
    """The batch as per-update lists in ascending id order (the reference's tie-break order)."""

    def __init__(self, updates, network, server, aggs, tau_max, v_init, start, checked=False):
        """checked: scheduler.schedule has already refused bad values (its _check_batch), so
        only what this class computes is left to do."""
        if not isinstance(network, Network):
            raise ValueError("network must be a mlfabric.sched.Network, got %s"
                             % type(network).__name__)
        if not tau_max >= 0:
            raise ValueError("tau_max must be >= 0, got %r" % (tau_max,))
        hosts = network.hosts
        for h in [] if checked else [server, *aggs]:
            if not (isinstance(h, int) and 0 <= h < hosts):
                network._check_host(h)  # raises the reference's error
        if server in aggs:
            raise ValueError("the server's host %d cannot be one of its aggregators" % server)
        by_id = {u.id: u for u in updates}
        if len(by_id) != len(updates):
            raise ValueError("update ids must be unique within a batch")
        self.by_id = by_id
        self.ids = sorted(by_id)
        ups = [by_id[i] for i in self.ids]
        self.worker = [u.worker for u in ups]
        for w in () if checked else self.worker:
            if not (isinstance(w, int) and 0 <= w < hosts):
                network._check_host(w)
        self.size = [u.size for u in ups]
        self.send_at = [max(u.ready, start) for u in ups]  # Python's max, as the reference's
        self.deadline = [deadline(u, tau_max, v_init) for u in ups]
        for u, s, d in () if checked else zip(ups, self.send_at, self.deadline):
            if not s >= 0:
                raise ValueError("update %r: its send time max(ready, start) must be >= 0, got %r"
                                 % (u.id, s))
            if isnan(u.size) or isnan(d):
                raise ValueError("update %r: size %r and deadline %r must not be NaN"
                                 % (u.id, u.size, d))


def _native(updates, network, server, aggs, tau_max, v_init, start, agg_scale, cut_through,
            plain, order_network, checked=False):
    if _run is None:
        raise RuntimeError("mlfabric was built without the scheduler's fast path "
                           "(mlfabric._C.sched_run); use mlfabric.sched.schedule")
    if not agg_scale >= 1.0:
        raise ValueError("agg_scale must be >= 1, got %r" % (agg_scale,))
    t0 = time.perf_counter()
    aggs = list(aggs)
    batch = _Batch(updates, network, server, aggs, tau_max, v_init, start, checked)
    links = network.links
    link_t, link_v = [p.t for p in links], [p.v for p in links]
    t1 = time.perf_counter()
    # Network keeps its core paths as {(src, dst): link indices}; there is no public accessor.
    raw = _run(network.hosts, link_t, link_v, network._core_paths, server, float(start),
               batch.worker, batch.size, batch.send_at, batch.deadline, aggs, float(agg_scale),
               bool(cut_through), bool(plain), order_network)
    res = _Results(raw, batch, network, server, agg_scale)
    res.seconds_input, res.seconds_call = t1 - t0, time.perf_counter() - t1
    return res, batch


# --- output ---------------------------------------------------------------------------------------

_segment = fast_constructor(Segment)
_xfer = fast_constructor(Transfer)


def _transfer(src, dst, size, end, segs, what, ids):
    return _xfer(src, dst, size, segs[0].t0 if segs else end, end, segs, what, ids)


class _Table:
    """A transfer table of the native result: transfer j ends at end[j]; its segments are the
    (t0, t1, rate) triples flat[3 * off[j] : 3 * off[j + 1]]."""

    def __init__(self, raw, name):
        self.end = raw[name + "_end"]
        self.off = raw[name + "_off"]
        self.flat = raw[name + "_segs"]

    def segments(self, j):
        f, a, b = self.flat, 3 * self.off[j], 3 * self.off[j + 1]
        if b - a == 3:  # the common case: one segment
            return (_segment(f[a], f[a + 1], f[a + 2]),)
        return tuple([_segment(f[i], f[i + 1], f[i + 2]) for i in range(a, b, 3)])


def _profiles(ts, vs):
    links = []
    for t, v in zip(ts, vs):
        p = Profile.__new__(Profile)
        p.t = t
        p.v = v
        links.append(p)
    return links


def _network(template, ts, vs):
    """A Network like `template` (hosts, core paths) holding these links (as Network.copy)."""
    nw = Network.__new__(Network)
    nw.hosts = template.hosts
    nw.links = _profiles(ts, vs)
    nw._core_paths = template._core_paths
    return nw


class _LinksOnFirstUse:
    """Network.links of a _PlannedNetwork: its Profiles, exported from the native result and
    built when first read, then an ordinary instance attribute (this descriptor defines no
    __set__, so the instance's own `links` shadows it from then on)."""

    def __get__(self, nw, cls=None):
        if nw is None:
            return self
        d = nw.__dict__
        ts, vs = _network_lists(d.pop("_native_links"))
        links = d["links"] = _profiles(ts, vs)
        return links


class _PlannedNetwork(Network):
    """The network after a plan's reservations, as scheduler.schedule returns it: a Network whose
    link Profiles are built only when a caller reads them. A simulator that does not replicate
    never does, and at ~1.4 updates per batch exporting and building ~13 Profiles is a sixth of
    schedule()."""

    links = _LinksOnFirstUse()

    def __getstate__(self):  # copy and pickle see a plain network's state (links built)
        self.links
        return self.__dict__


def _planned_network(template, native_links):
    nw = Network.__new__(_PlannedNetwork)
    nw.hosts = template.hosts
    nw._native_links = native_links
    nw._core_paths = template._core_paths
    return nw


class _Results:
    """Builds ordering.Ordering and aggregation.Grouping from the native call's flat lists."""

    def __init__(self, raw, batch, network, server, agg_scale):
        self.raw, self.batch, self.network, self.server = raw, batch, network, server
        self.agg_scale = agg_scale
        self.seconds_order = raw["seconds_order"]
        self.seconds_aggregate = raw["seconds_aggregate"]

    def ordering(self, every_transfer):
        """every_transfer=False: only group 1's transfers and no network (what a Plan holds)."""
        raw, ids, by_id = self.raw, self.batch.ids, self.batch.by_id
        order = [ids[i] for i in raw["order"]]
        dropped = {ids[i]: _DROPS[w] for i, w in zip(raw["drop_idx"], raw["drop_why"])}
        table = _Table(raw, "o")
        count = len(order) if every_transfer else raw["n_direct"]
        transfers = {}
        for j in range(count):
            u = by_id[order[j]]
            transfers[u.id] = _transfer(u.worker, self.server, u.size, table.end[j],
                                        table.segments(j), "update", (u.id,))
        network = (_network(self.network, raw["o_net_t"], raw["o_net_v"]) if every_transfer
                   else None)
        return Ordering(order, dropped, transfers, network)

    def grouping(self, transfers):
        raw, by_id, server = self.raw, self.batch.by_id, self.server
        order = [self.batch.ids[i] for i in raw["order"]]
        if raw["makespan"] == inf:  # as aggregation.aggregate: no case is feasible
            raise ValueError("some of updates %r can never reach host %d: no capacity on the path"
                             % (order, server))
        n_direct = raw["n_direct"]
        inbound, out = _Table(raw, "in"), _Table(raw, "at")
        aggregates = []
        i = n_direct  # members are consecutive positions after group 1
        k = 0         # their inbound transfers, in the same order
        for j, (agg, count) in enumerate(zip(raw["agg_host"], raw["agg_count"])):
            members = order[i:i + count]
            into = []
            for uid in members:  # (the hot loop at small batches: _transfer inlined)
                u, end, segs = by_id[uid], inbound.end[k], inbound.segments(k)
                into.append(_xfer(u.worker, agg, u.size, segs[0].t0 if segs else end, end, segs,
                                  "update", (uid,)))
                k += 1
            i += count
            # as aggregation.det_agg computes it, from the same objects (first maximum)
            size = (max(by_id[m].size for m in members)
                    * (self.agg_scale if len(members) > 1 else 1.0))
            aggregates.append(Aggregate(agg, server, members, into,
                                        _transfer(agg, server, size, out.end[j], out.segments(j),
                                                  "aggregate", tuple(members))))
        if raw["pipeline_chosen"]:  # it replaces the groups (n_direct 0, none above)
            aggregates.append(self._pipeline(order))
        direct = [transfers[uid] for uid in order[:n_direct]]
        return Grouping(n_direct, direct, aggregates,
                        _planned_network(self.network, raw["g_net"]),
                        raw["makespan"], raw["cases"], raw["pipeline"])

    def _pipeline(self, order):
        """The last Aggregate of the chosen pipeline, its upstream levels linked, built by
        aggregation.pipeline_chain from the native result: the chain's hosts in order and its
        transfers (the first host's updates to the second, then each level's sum)."""
        table, rows = _Table(self.raw, "pp"), itertools.count()
        send_at = dict(zip(self.batch.ids, self.batch.send_at))

        def hop(src, dst, size, what, ids, into):
            j = next(rows)
            return _transfer(src, dst, size, table.end[j], table.segments(j), what, ids)
        return pipeline_chain(self.raw["pipe_hosts"], order, self.batch.by_id, self.server,
                              self.agg_scale, send_at.__getitem__, hop)
