"""Update ordering (paper §5.1): shortest transfer first (Alg. 1), deadlines from tau_max (eq. 9,
§5.1.2) and the look-ahead drop (Alg. 2, §5.1.3), as the paper's plain loops: every iteration
recomputes t_en for every remaining update. `mlfabric.sched.fast` computes the same order in C++
with a lazy heap; tests hold the two to identical output.

Where the paper leaves a choice open, this is what we do, and why:
- Positions, not loop counts: the deadline test uses the position the next applied update will
  take. The paper's loop index equals it until an update is dropped; after a drop the loop index runs
  ahead, which would force deadlines one position early for no gain.
- Several updates due at the same position: the one that finishes first is taken; the others can no
  longer meet their bound and are dropped as stale at the next position (tau_max is never exceeded).
- The look-ahead drop applies to updates picked for their deadline, as §5.1.3's text says (the
  pseudo-code tests every pick, but a shortest-first pick never finishes after the next pick: t_en
  only grows as capacity is reserved).
- Ties on t_en go to the lower update id, so plans are reproducible.
"""
from dataclasses import dataclass
from math import inf

from .plan import DROP_LOOKAHEAD, DROP_NO_PATH, DROP_STALE, Transfer


@dataclass
class Ordering:
    order: list       # applied update ids, by position
    dropped: dict     # id -> DROP_* reason
    transfers: dict   # id -> Transfer straight to the server (the tentative schedule)
    network: object   # the network after reserving those transfers


def deadline(u, tau_max, v_init):
    """dl(g) = v(g) + tau_max - v_init (eq. 9): the last position g may take."""
    return u.version + tau_max - v_init


def alg2(ids, dl, network, t_en, reserve):
    """Alg. 2's loop over update ids (ascending: the tie-break) with deadlines `dl` (id -> last
    position). `t_en(id, net)` -> (end, parts) measures an update on a network (parts: whatever
    `reserve(id, net, parts)` needs to take its capacity); `network` is not modified. Shared by the
    single server (below) and sharded servers (sharded.py, eq. 18). Returns (order, dropped,
    {id: (end, parts)} of the applied, network after their reservations)."""
    nw = network.copy()
    remaining = sorted(ids)
    order, dropped, applied = [], {}, {}

    def pick(pos, cands, net):
        """ShrtDline: the update due at `pos` if any, else the shortest; (id, forced, end, parts)."""
        due = [g for g in cands if dl[g] <= pos]
        best = None
        for g in due or cands:
            end, parts = t_en(g, net)
            if best is None or end < best[2]:
                best = (g, bool(due), end, parts)
        return best

    while remaining:
        pos = len(order) + 1
        for g in [g for g in remaining if dl[g] < pos]:
            dropped[g] = DROP_STALE
        remaining = [g for g in remaining if dl[g] >= pos]
        if not remaining:
            break
        cur, forced, end, parts = pick(pos, remaining, nw)
        if end == inf and forced:  # the due update can never arrive; the others still may
            dropped[cur] = DROP_NO_PATH
            remaining = [g for g in remaining if g != cur]
            continue
        if end == inf:  # the shortest has no capacity, so none has: nothing left can arrive
            for g in remaining:
                dropped[g] = DROP_NO_PATH
            break
        rest = [g for g in remaining if g != cur]
        after = nw.copy()
        reserve(cur, after, parts)
        live = [g for g in rest if dl[g] >= pos + 1]  # the others are stale at the next position
        if forced and live:
            # look ahead: would the next pick finish before this one?
            nxt = pick(pos + 1, live, after)
            if end > nxt[2]:
                dropped[cur] = DROP_LOOKAHEAD
                remaining = rest
                continue
        order.append(cur)
        applied[cur] = (end, parts)
        nw = after
        remaining = rest
    return order, dropped, applied, nw


def order_updates(updates, network, server, *, v_init=0, tau_max=inf, start=0.0):
    """Alg. 2 (Alg. 1 when tau_max is inf) over `updates` to `server`. `network` is not modified."""
    by_id = {u.id: u for u in updates}
    if len(by_id) != len(updates):
        raise ValueError("update ids must be unique within a batch")
    dl = {u.id: deadline(u, tau_max, v_init) for u in updates}

    def t_en(uid, net):
        u = by_id[uid]
        return net.t_en(u.worker, server, u.size, max(u.ready, start))

    def reserve(uid, net, segs):
        net.reserve(by_id[uid].worker, server, segs)

    order, dropped, applied, nw = alg2(by_id, dl, network, t_en, reserve)
    transfers = {}
    for g in order:
        u, (end, segs) = by_id[g], applied[g]
        transfers[g] = Transfer(u.worker, server, u.size, segs[0].t0 if segs else end, end,
                                segs, "update", (g,))
    return Ordering(order, dropped, transfers, nw)
