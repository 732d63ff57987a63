"""The lowering of a mlfabric.sched.Plan into each rank's control messages
(mlfabric.runtime.lowering, messages.py), in one process: a small plan lowered by hand-checked
parts, the gate's and the replica's shares, a scheduled and replicated batch whose parts account
for every update, the readable form parsing back, and clear errors for what does not fit."""
import math

import pytest

from mlfabric.errors import MlfabricError
from mlfabric.runtime.gate import DivergenceGate
from mlfabric.runtime.lowering import lower
from mlfabric.runtime.messages import (DropUpdate, ExpectCommit, ReadyUpdate, SendUpdate,
                                       SumUpdates, handle_each, parse)
from mlfabric.sched import Network, Update, schedule
from mlfabric.sched.plan import Aggregate, Commit, Plan, Transfer
from mlfabric.sched.replication import ReplicaState, replicate


def uid(w, n):
    return w << 32 | n


U30, U40, U50, U51 = uid(3, 0), uid(4, 0), uid(5, 0), uid(5, 1)
HOSTS = [1, 3, 4, 5]   # host index -> rank: the server is rank 1


def tr(src, dst, start, end, size, what, *ids):
    return Transfer(src, dst, size, start, end, (), what, ids)


def small_plan():
    """u3.0 straight to the server; u4.0 and u5.0 summed at rank 3; u5.1 dropped (stale)."""
    updates = {U30: Update(U30, 3, 10.0, 0, norm=0.6), U40: Update(U40, 4, 10.0, 1, norm=0.5),
               U50: Update(U50, 5, 10.0, 1, norm=0.7), U51: Update(U51, 5, 10.0, 0, norm=0.1)}
    agg = Aggregate(1, 0, [U40, U50],
                    [tr(2, 1, 0.0, 0.5, 10.0, "update", U40), tr(3, 1, 0.0, 1.0, 10.0, "update",
                                                                U50)],
                    tr(1, 0, 1.0, 2.0, 10.0, "aggregate", U40, U50))
    plan = Plan(0, 5, math.inf, {}, order=[U30, U40, U50], dropped={U51: "stale"},
                direct=[tr(1, 0, 0.0, 1.0, 10.0, "update", U30)], aggregates=[agg],
                commits=[Commit(1.0, (U30,), 1), Commit(2.0, (U40, U50), 1)])
    return plan, updates


def test_a_small_plan_lowers_to_each_ranks_part():
    plan, updates = small_plan()
    parts = lower(plan, HOSTS, updates, 1, (7,))
    assert parts == {
        3: [SendUpdate(U30, 1, 1, 0.0, 10.0, True),
            SumUpdates((7, 0), 1, (U40, U50), 1.0, 10.0, None, (U40, U50))],
        4: [SendUpdate(U40, 3, 1, 0.0, 20.0, True)],
        5: [SendUpdate(U50, 3, 1, 0.0, 10.0, True), DropUpdate(U51, "stale")],
        1: [ExpectCommit(("u", U30), (U30,), (0,), 0, 3),
            ExpectCommit(("a", (7, 0)), (U40, U50), (1, 1), 0, 3),
            DropUpdate(U51, "stale")],
    }
    # sync: an aggregate carries its iteration; an allreduce's root is told no commits
    sync = lower(plan, HOSTS, updates, ("ar", 2, 1), ("ar", 2), sync=True, commits=False)
    assert sync[3][1] == SumUpdates(("ar", 2, 0), ("ar", 2, 1), (U40, U50), 1.0, 10.0, 1,
                                    (U40, U50))
    assert 1 not in sync and sync[4][0].dst == ("ar", 2, 1)
    # a replica follows: the worker keeps its update after this send
    assert not lower(plan, HOSTS, updates, 1, (7,), final=False)[4][0].final


def test_the_gate_is_asked_once_per_commit_in_order():
    plan, updates = small_plan()
    gate = DivergenceGate(1.0)
    parts = lower(plan, HOSTS, updates, 1, (7,), gate=gate)
    # 0.6 alone fits Div_max; after the aggregate (0.5 + 0.7) only a lead of u5.0's 0.7 does:
    # the replica must have applied the first two updates
    assert [m.need for m in parts[1] if isinstance(m, ExpectCommit)] == [0, 2]
    assert gate.prefix == pytest.approx([0.0, 0.6, 1.1, 1.8])


def test_every_message_reads_back_from_its_readable_form():
    plan, updates = small_plan()
    parts = lower(plan, HOSTS, updates, 1, (7,), gate=DivergenceGate(1.0))
    records = [m for ms in parts.values() for m in ms]
    records += [ExpectCommit(("a", (3, "r", 0)), (U40,), (None,), 0, 4, (math.inf,)),
                SumUpdates(("up", (7, 0), 0), ("ar", 2, 1), (U40,), 0.5, None, 2, (U40, U30),
                           via=4, upstream=(("up", (7, 0), 0), (U40,), 3)),
                ReadyUpdate(U51, 1, 4000, 3, math.inf, 12.25),
                ReadyUpdate(uid(4, 1 << 31 | 2), ("ar", 2, 5), 80, 2, 0.5, 0.125)]
    for m in records:
        assert parse(str(m)) == m, str(m)
    assert str(parts[3][0]) == "send id=u3.0 hop=1 dst=1 not_before=0.0 rate=10.0 final=True"
    assert str(parts[5][1]) == "drop id=u5.1 reason='stale'"
    assert str(records[-4]).endswith("norms=(inf,)")
    assert str(records[-2]) == "ready id=u5.1 server=1 size=4000 version=3 norm=inf sent=12.25"
    assert repr([parts[5][1]]) == "[drop id=u5.1 reason='stale']"   # a message body reads so


def test_bad_input_is_a_clear_error():
    plan, updates = small_plan()
    del updates[U51]
    with pytest.raises(MlfabricError, match=r"names update\(s\) u5.1 that are not among"):
        lower(plan, HOSTS, updates, 1, (7,))
    plan, updates = small_plan()
    with pytest.raises(MlfabricError, match="from host 3 to host 1: hosts are 0..2"):
        lower(plan, HOSTS[:3], updates, 1, (7,))
    with pytest.raises(MlfabricError, match="kind must be one of ready, send, sum, expect, drop"):
        parse("bogus id=1")
    with pytest.raises(MlfabricError, match="does not fit SendUpdate"):
        parse("send id=u3.0 hop=1")
    with pytest.raises(MlfabricError, match="is not a literal"):
        parse("drop id=u3.0 reason=stale")


def test_a_failing_message_is_named_in_its_readable_form():
    m = SendUpdate(U30, 1, 1, 0.0, None, True)

    def handle(record):
        raise KeyError(record.id)
    with pytest.raises(MlfabricError, match=r"worker rank 3: plan message `send id=u3.0 hop=1 "
                                            r"dst=1 not_before=0.0 rate=None final=True` failed: "
                                            r"KeyError"):
        handle_each("worker rank 3", [m], handle)


def test_a_scheduled_replicated_batch_accounts_for_every_update():
    """A batch planned by mlfabric.sched for 4 workers with a replica: each applied update is
    sent to the server once (kept for its replica copy) and to the replica at most once, the
    server's commits are the plan's order, the replica's its frozen prefix with norms."""
    n = 7                          # host 0 the server, 1 the replica, 2-6 workers
    nw = Network([[(0.0, 10.0)]] * n, [[(0.0, 10.0)]] * n)
    ranks = [1, 2, 3, 4, 5, 6, 7]  # host i is rank i + 1
    ups = [Update(uid(w + 1, k), w, 5.0, 0, norm=0.3) for w in range(2, 7) for k in range(2)]
    plan, after = schedule(ups, nw, 0, aggregators=[2, 3, 4], seed=3)
    plan, _, _ = replicate(plan, after, 1, [5, 6], ReplicaState(), div_max=1.0, gamma=0.0)
    updates = {u.id: Update(u.id, ranks[u.worker], u.size, u.version, norm=u.norm) for u in ups}
    parts = lower(plan, ranks, updates, 1, (0,), final=False, gate=DivergenceGate(1.0),
                  replica=2, replica_planned=4)
    sends = [m for ms in parts.values() for m in ms if isinstance(m, SendUpdate)]
    to_server = sorted(m.id for m in sends if m.dst == 1)
    to_replica = [m.id for m in sends if m.dst == 2]
    assert to_server == sorted(plan.order) and not any(m.final for m in sends if m.dst == 1)
    assert sorted(to_replica) == sorted(plan.replica.applied)
    assert all(m.final for m in sends if m.dst == 2)
    commits = [m for m in parts[1] if isinstance(m, ExpectCommit)]
    assert [u for c in commits for u in c.ids] == [u for u in plan.order]
    assert commits[-1].need >= 4 + len(plan.replica.applied)
    rcommits = parts.get(2, [])
    assert [u for c in rcommits for u in c.ids] == plan.replica.applied
    assert all(c.norms == (0.3,) * len(c.ids) for c in rcommits)
    for ms in parts.values():
        for m in ms:
            assert parse(str(m)) == m


def test_a_worker_names_the_send_it_cannot_carry_out():
    """A plan part naming an update this worker does not hold (an internal error) fails with
    the message in its readable form, not a bare KeyError."""
    import types

    from mlfabric.runtime.ledger import profile
    from mlfabric.runtime.worker import WorkerRole
    w = WorkerRole.__new__(WorkerRole)
    w.rt = types.SimpleNamespace(rank=3, now=lambda: 1.0)
    w.outbox, w.plan_latency = {}, profile()
    with pytest.raises(MlfabricError, match=r"worker rank 3: plan message `send id=u3.9 hop=1 "
                                            r"dst=1 not_before=0.5 rate=None final=True`: update "
                                            r"u3.9 is not waiting here"):
        w.on_ctrl(0, "send", (0.5, [SendUpdate(uid(3, 9), 1, 1, 0.5, None, True)]))


def test_a_server_names_the_commit_whose_payload_does_not_fit():
    from mlfabric.runtime.server import ApplyInOrder
    order = ApplyInOrder()
    order.replica_count = math.inf
    order.add_plan([ExpectCommit(("a", (7, 0)), (U40, U50), (1, 1), 0, 3)])
    order.arrive(("a", (7, 0)), (U40, U30), None)
    with pytest.raises(MlfabricError, match=r"plan message `expect key=\('a', \(7, 0\)\) ids="
                                            r"\(u4.0, u5.0\) .*carries update\(s\) u3.0"):
        list(order.due())
