"""The lowering of one batch's mlfabric.sched.Plan into each daemon's part of it (messages.py
records): per worker rank what to send where and when, and what to drop; per aggregator what to
sum; for the server (and the replica) the commits it applies, in order. Plain data in, plain data
out: no MPI, no scheduler state (the divergence gate, if given, is booked in commit order).

The plan's hosts are indices into `hosts` (the scheduler's batch network: `hosts[i]` is a rank);
`updates` maps each update id the plan names to its Update with the worker as a rank.
"""
from ..errors import MlfabricError
from .messages import DropUpdate, ExpectCommit, SendUpdate, SumUpdates, uid_text


def rate_of(tr):
    """The planned average rate of a transfer (bytes/s); None for an empty one."""
    if tr is None:
        return None
    d = tr.end - tr.start
    return tr.size / d if d > 0 and tr.size > 0 else None


def assignments_of(a, key, dst, hosts, version):
    """How the daemons carry plan aggregate `a` (a sched Aggregate) to `dst` under `key`:
    ([(aggregator rank, SumUpdates)], [(update id, the rank it is sent to, its Transfer)]). One
    SumUpdates per aggregator of a cut-through pipeline; a partial sum's key is ('up', key,
    level)."""
    levels = a.levels()
    out, sends, upstream = [], [], None
    for j, lv in enumerate(levels):
        last = j == len(levels) - 1
        k = key if last else ("up", key, j)
        own = tuple(t.ids[0] for t in lv.inbound if t.what == "update")
        sends += [(t.ids[0], hosts[lv.aggregator], t) for t in lv.inbound if t.what == "update"]
        rank = hosts[lv.aggregator]
        out.append((rank, SumUpdates(k, dst, own, lv.transfer.start, rate_of(lv.transfer),
                                     version, tuple(lv.members),
                                     None if last else hosts[lv.dst], upstream)))
        upstream = (k, tuple(lv.members), rank)
    return out, sends


def lower(plan, hosts, updates, dst, keys, *, final=True, sync=False, gate=None, replica=None,
          replica_planned=0, commits=True):
    """Each rank's part of `plan`: {rank: [record, ...]}, a rank's records of each kind in the
    order they are to be handled (deliver() in scheduler.py sends them grouped by kind).

    dst: where the batch is bound (the logical server id; ('ar', call, root) for an allreduce),
    the server itself being rank hosts[plan.server]. keys: the prefix of the batch's aggregate
    keys (aggregate j is keys + (j,), the replica's keys + ('r', j)). final: no replica copy
    follows, so a worker frees an update after its send. sync: an aggregate carries its
    members' iteration as its version. gate: the server's divergence gate (gate.py), asked for
    each commit's replica count. replica: the replica's rank, when plan.replica is planned;
    replica_planned: the replica commits planned before this plan (the batch's last server
    commit waits until the replica has applied this plan's too). commits: whether the server
    is told its commits (an allreduce's root sums what comes instead)."""
    _check(plan, hosts, updates, replica)
    parts = {}

    def to(rank, record):
        parts.setdefault(rank, []).append(record)
    srank = hosts[plan.server]
    expect = []
    for tr in plan.direct:
        uid = tr.ids[0]
        u = updates[uid]
        to(u.worker, SendUpdate(uid, srank, dst, tr.start, rate_of(tr), final))
        need = gate.commit((u.norm,)) if gate else 0
        expect.append(ExpectCommit(("u", uid), (uid,), (u.version,), need, u.worker))
    sums = []
    for k, a in enumerate(plan.aggregates):
        key = keys + (k,)
        version = updates[a.members[0]].version if sync else None
        levels, inputs = assignments_of(a, key, dst, hosts, version)
        for uid, hop, tr in inputs:
            to(updates[uid].worker, SendUpdate(uid, hop, dst, tr.start, rate_of(tr), final))
        sums += levels
        need = gate.commit([updates[u].norm for u in a.members]) if gate else 0
        expect.append(ExpectCommit(("a", key), tuple(a.members),
                                   tuple(updates[u].version for u in a.members), need,
                                   hosts[a.aggregator]))
    rp = plan.replica
    if rp is not None:
        replica_sums, replica_expect = _replica_part(rp, hosts, updates, keys, replica, to)
        sums += replica_sums
        if expect:  # §5.3: the batch's last commit waits for the replica's planned catch-up
            last = expect[-1]
            floor = replica_planned + len(rp.applied)
            expect[-1] = ExpectCommit(last.key, last.ids, last.versions, max(last.need, floor),
                                      last.via)
        if replica_expect:
            parts.setdefault(replica, []).extend(replica_expect)
    for rank, s in sums:
        to(rank, s)
    if commits and expect:
        parts.setdefault(srank, []).extend(expect)
    for uid, why in plan.dropped.items():
        to(updates[uid].worker, DropUpdate(uid, why))
        if commits:
            to(srank, DropUpdate(uid, why))
    return parts


def _replica_part(rp, hosts, updates, keys, replica, to):
    """The replica's frozen transfers (sched.replication's ReplicaPlan): copies from workers
    (each an update's last send: the worker may then free it), its aggregators' sums, its
    commits in order with their norms. Returns ([(rank, SumUpdates)], [ExpectCommit])."""
    via = {}
    for tr in rp.direct:
        uid = tr.ids[0]
        to(updates[uid].worker, SendUpdate(uid, replica, replica, tr.start, rate_of(tr), True))
        via[(uid,)] = (("u", uid), updates[uid].worker)
    sums = []
    for k, a in enumerate(rp.aggregates):
        for tr in a.inbound:
            uid = tr.ids[0]
            to(updates[uid].worker, SendUpdate(uid, hosts[a.aggregator], replica, tr.start,
                                               rate_of(tr), True))
        key = keys + ("r", k)
        members = tuple(a.members)
        sums.append((hosts[a.aggregator], SumUpdates(key, replica, members, a.transfer.start,
                                                     rate_of(a.transfer), None, members)))
        via[members] = (("a", key), hosts[a.aggregator])
    expect = []
    for c in rp.commits:
        ids = tuple(c.ids)
        if ids not in via:
            raise MlfabricError("lower: the replica's commit of %s matches none of its planned "
                                "transfers or aggregates" % (_ids(ids),))
        key, frm = via[ids]
        expect.append(ExpectCommit(key, ids, (None,) * len(ids), 0, frm,
                                   tuple(updates[u].norm for u in ids)))
    return sums, expect


def _check(plan, hosts, updates, replica):
    """A plan this lowering cannot carry is an error naming what does not fit."""
    n = len(hosts)
    if not 0 <= plan.server < n:
        raise MlfabricError("lower: the plan's server is host %r, but only %d hosts are given"
                            % (plan.server, n))
    transfers = plan.transfers()
    for tr in transfers:
        if not (0 <= tr.src < n and 0 <= tr.dst < n):
            raise MlfabricError("lower: transfer of %s from host %d to host %d: hosts are 0..%d"
                                % (_ids(tr.ids), tr.src, tr.dst, n - 1))
    named = {u for tr in transfers if tr.what.endswith("update") for u in tr.ids}
    named.update(plan.dropped)
    aggregates = list(plan.aggregates)
    if plan.replica is not None:
        aggregates += plan.replica.aggregates
        named.update(u for c in plan.replica.commits for u in c.ids)
    for a in aggregates:
        named.update(a.members)
    missing = sorted(u for u in named if u not in updates)
    if missing:
        raise MlfabricError("lower: the plan names update(s) %s that are not among the %d "
                            "updates given" % (_ids(missing), len(updates)))
    if plan.replica is not None and replica is None:
        raise MlfabricError("lower: the plan has a replica part but no replica rank is given")


def _ids(ids):
    return ", ".join(uid_text(u) for u in ids)
