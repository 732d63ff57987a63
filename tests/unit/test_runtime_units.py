"""The runtime's pure parts in one process: roles by rank, the job config's checks, the ledger's
summary, the divergence gate, the emulated NIC's calendars, the data plane's stream prefix."""
import math

import numpy as np
import pytest

from mlfabric.emulate import Emulation
from mlfabric.errors import MlfabricError
from mlfabric.runtime import Config, Ledger, Roles
from mlfabric.runtime.gate import DivergenceGate
from mlfabric.runtime.ledger import summarize


def test_roles_by_rank():
    r = Roles(8, servers=2, replicas=1)
    assert [r.role(i) for i in range(8)] == ["scheduler", "server", "server", "replica",
                                             "worker", "worker", "worker", "worker"]
    assert r.replica_of(1) == 3 and r.replica_of(2) is None and r.server_of(3) == 1
    assert r.worker_index(4) == 0 and r.worker_index(1) is None
    with pytest.raises(MlfabricError, match="at least 5"):
        Roles(4, servers=2, replicas=1)
    with pytest.raises(MlfabricError, match="replicas"):
        Roles(8, servers=1, replicas=2)


def test_config_refuses_what_it_cannot_do():
    with pytest.raises(MlfabricError, match="unknown mode"):
        Config(mode="bogus")
    with pytest.raises(MlfabricError, match="replicas"):
        Config(mode="async", replicas=1)
    with pytest.raises(MlfabricError, match="batch_interval"):
        Config(batch_interval=0)
    with pytest.raises(MlfabricError, match="checkpoint_dir"):
        Config(checkpoint_every=5)
    with pytest.raises(MlfabricError, match="applied_log_max must be an int >= 0 or None"):
        Config(applied_log_max=-1)
    with pytest.raises(MlfabricError, match="pull_objective must be one of makespan, mean"):
        Config(pull_objective="p99")
    with pytest.raises(ValueError, match="unknown network preset"):
        Emulation("C1", "N9")


def test_summary_balances_on_ids():
    w, s, sched = Ledger(), Ledger(), Ledger()
    w.pushed = {1, 2, 3, 4}
    s.applied = {1, 2}
    sched.dropped = {3: "stale"}
    out = summarize([sched, s, w])
    assert not out.balanced and out.missing == [4]
    sched.dropped[4] = "stale"
    out = summarize([sched, s, w])
    assert out.balanced and out.pushed == 4 and out.applied == 2 and out.dropped == {"stale": 2}
    s.applied.add(3)  # applied and dropped: counted, and refused
    assert summarize([sched, s, w]).twice == [3]


def test_summary_knows_a_dead_workers_pushes():
    s, sched = Ledger(), Ledger()
    dead = 5
    s.applied = {dead << 32 | 0}
    sched.dropped = {dead << 32 | 1: "worker-failed"}
    out = summarize([sched, s, None], dead={dead}, known={dead << 32 | 0, dead << 32 | 1})
    assert out.balanced and out.pushed == 2 and out.failed == [dead]


def test_divergence_gate_keeps_the_lead_within_div_max():
    norms = [0.4, 0.3, 0.5, 0.2, 0.9, 0.1]
    g = DivergenceGate(1.0)
    prefix = [0.0]
    for n in norms:
        need = g.commit([n])
        prefix.append(prefix[-1] + n)
        p = len(prefix) - 1
        assert prefix[p] - prefix[need] <= 1.0 + 1e-12          # within the bound
        assert need == 0 or prefix[p] - prefix[need - 1] > 1.0  # and no stricter than needed
    assert DivergenceGate(math.inf).commit([5.0, 7.0]) == 0


def test_emulated_nic_books_back_to_back():
    nic = Emulation(base_rate=1000.0).nic(None, 1, t0=0.0)
    assert nic.egress_rate(0.0) == 1000.0
    assert nic.take_egress(500, 10.0) == pytest.approx(10.5)
    assert nic.take_egress(500, 10.1) == pytest.approx(11.0)   # behind the first
    assert nic.take_egress(100, 20.0) == pytest.approx(20.1)   # idle calendar restarts at now
    assert nic.bytes_out == 1100
    free = Emulation(base_rate=None).nic(0, 1, t0=0.0)
    assert free.take_ingress(10 ** 9, 3.0) == 3.0 and not free.paced


def test_worker_nics_follow_the_preset_and_dedicated_ranks_do_not():
    em = Emulation("C0", "N3", base_rate=100.0, period=1.0, seed=3)
    rates = {em.nic(w, 4, 0.0).egress_rate(t) for w in range(4) for t in range(20)}
    assert rates == {10.0, 100.0}               # N3: 1 or 10 Gbps, scaled
    assert em.nic(None, 4, 0.0).egress_rate(7.0) == 100.0


def test_stream_prefix_counts_chunks_in_order_only():
    """A cut-through forward may send only bytes that arrived in order from the start: chunk
    completions seen out of order do not advance it until the gap is filled; a failed flow
    reads VOID."""
    from mlfabric.runtime import dataplane as dpm

    class Req:
        def __init__(self):
            self.done = False

        def Test(self):
            return self.done

    f = dpm._RxFlow(1, ("k",), 2, np.dtype(np.uint8), (250,), 250, 100, 0.0)
    stream = dpm.Stream(1, ("k",), f.data(), f)
    reqs = [Req() for _ in range(3)]
    f.reqs = [(r, i) for i, r in enumerate(reqs)]
    assert stream.available() == 0
    reqs[1].done = True  # the second chunk is seen first
    dpm._retire_rx(f, 1.0)
    assert (f.received, f.prefix, stream.available()) == (1, 0, 0)
    reqs[0].done = True
    dpm._retire_rx(f, 2.0)
    assert (f.received, f.prefix, stream.available()) == (2, 2, 200)
    reqs[2].done = True
    dpm._retire_rx(f, 3.0)
    assert (f.received, stream.available(), f.reqs, f.last) == (3, 250, [], 3.0)
    f.void = "its sender died"
    assert stream.available() == dpm.VOID


def test_streaming_sum_follows_the_slowest_member():
    """An aggregate streamed out while its members come in (relay.StreamingSum): ready bytes are
    the smallest prefix among the members, cut to whole elements, summed exactly as the whole
    sum; a member that fails makes it VOID; members must agree on dtype and shape."""
    from mlfabric.runtime import dataplane as dpm
    from mlfabric.runtime.relay import StreamingSum

    rng = np.random.default_rng(3)
    n = 1001
    vals = [rng.standard_normal(n) for _ in range(3)]
    flows = []
    parts = [vals[0].copy()]   # one member whole already (the aggregator's own update)
    for v in vals[1:]:
        f = dpm._RxFlow(1, ("u",), 2, np.dtype(np.float64), (n,), v.nbytes, 1000, 0.0)
        flows.append(f)
        parts.append(dpm.Stream(1, ("u",), f.data(), f))

    def arrive(f, nbytes, v):   # the first nbytes of v are in, in order
        f.buf[:nbytes] = v.view(np.uint8)[:nbytes]
        f.prefix = nbytes // f.chunk if nbytes < f.nbytes else f.nchunks

    s = StreamingSum(parts)
    assert s() == 0
    arrive(flows[0], 3000, vals[1])
    assert s() == 0                                 # the other stream has nothing yet
    arrive(flows[1], 5000, vals[2])
    assert s() == 3000 // 8 * 8                     # the slower one, whole elements only
    arrive(flows[0], flows[0].nbytes, vals[1])
    assert s() == 5000 // 8 * 8
    arrive(flows[1], flows[1].nbytes, vals[2])
    assert s() == s.total.nbytes
    np.testing.assert_allclose(s.total, vals[0] + vals[1] + vals[2], rtol=1e-15, atol=0)
    flows[1].void = "its sender died"
    assert s() == dpm.VOID
    with pytest.raises(ValueError, match="disagree"):
        StreamingSum([np.zeros(3), np.zeros(4)])


def test_timing_profiles_keep_the_latest_samples_only():
    from mlfabric.runtime.ledger import PROFILE_KEPT
    lg = Ledger()
    lg.get_latency.extend(float(i) for i in range(PROFILE_KEPT + 500))
    assert len(lg.get_latency) == PROFILE_KEPT and lg.get_latency[0] == 500.0
    lg.delays[3] += 2
    lg.delays[5] += 1
    assert summarize([lg]).max_delay == 5


def test_the_summary_arriving_as_a_wait_times_out_is_returned_not_an_error():
    # the race that failed CI once: the bounded wait gives up just as the daemon sets the summary
    import types
    from mlfabric.errors import PeerTimeoutError
    from mlfabric.ps.api import _wait_for_summary
    from mlfabric.runtime.core import Future

    class LateFuture(Future):
        def wait(self, timeout=None):
            if not self.done():
                self.set("the summary")   # set right after the wait gave up
                raise PeerTimeoutError("gave up")
            return super().wait(timeout)

    rt = types.SimpleNamespace(summary=LateFuture("the end of the job (finish)"))
    assert _wait_for_summary(rt) == "the summary"
    failed = Future("the end of the job (finish)")
    failed.fail(MlfabricError("the job failed"))
    with pytest.raises(MlfabricError, match="the job failed"):
        _wait_for_summary(types.SimpleNamespace(summary=failed))


def test_the_pull_gate_waits_for_sends_not_paced_by_a_slow_receiver():
    from mlfabric.runtime.server import gating
    # the scheduler names the receivers whose downlinks pace the server's sends (pulls.py): a
    # lone send to such a receiver, or a batch of them, holds nothing; a send to any other
    # receiver holds, even one planned slow because the server's uplink is booked
    assert gating([2], [2]) == {}
    assert gating([2, 3], [2, 3]) == {}
    assert gating([2, 3, 4], [4]) == {2: 1, 3: 1}
    assert gating([2], []) == {2: 1}
    assert gating([2, 2, 3], [3]) == {2: 2}   # counted per send, not per rank
    assert gating([], [2]) == {}


# --- a peer's failure met mid-handler (ULFM) --------------------------------------------------------
class _FakeRequest:
    def Test(self):
        return True


class _FakeComm:
    """A control communicator of 4 ranks on which rank `dead` died: ULFM refuses sends to it."""
    size, rank = 4, 0

    def __init__(self, dead):
        self.dead, self.posted = dead, []

    def isend(self, obj, dst, tag):
        from mpi4py import MPI
        if dst == self.dead:
            raise MPI.Exception(MPI.ERR_PROC_FAILED)
        self.posted.append((dst, obj))
        return _FakeRequest()


def test_a_send_to_a_rank_that_died_unnoticed_is_dropped_and_kept_for_the_daemon():
    # a handler sending to several ranks (a promotion's news, a plan's parts) must reach the
    # live ones after the dead one; the failure is kept for the daemon to acknowledge
    from mlfabric.runtime.control import Channel
    ch = Channel(_FakeComm(dead=1))
    for r in (1, 2, 3):
        ch.send(r, "promote", (1, 2, None))
    assert [(dst, kind) for dst, (_, kind, _) in ch.comm.posted] == [(2, "promote"),
                                                                       (3, "promote")]
    assert list(ch.sent) == [0, 0, 1, 1]   # sequence numbers stay dense for the live ranks
    e = ch.take_failure()
    assert e is not None and ch.take_failure() is None


def _daemon_with(role, messages, dead=1):
    """A Daemon over a fake runtime whose control channel hands out `messages` once."""
    import types
    from mlfabric.runtime.control import Channel
    from mlfabric.runtime.daemon import Daemon
    ch = Channel(_FakeComm(dead))
    ch._inbox = list(messages)

    def receive():   # what came, and what put_back() returned
        out, ch._inbox = ch._inbox, []
        return out
    ch.receive = receive
    dp = types.SimpleNamespace(progress=lambda now: [], take_voided=lambda: [],
                               wake_in=lambda now: 0.0)
    rt = types.SimpleNamespace(rank=0, role="scheduler", channel=ch, dp=dp, failed=set(),
                               requests=__import__("queue").SimpleQueue(),
                               wakeup=__import__("threading").Event())
    d = Daemon.__new__(Daemon)
    d.rt, d.role, d.stop, d.debug = rt, role, False, False
    d.reporter = types.SimpleNamespace(due=lambda now: False)
    d._data, d._voided = [], []
    return d


class _Recorder:
    def __init__(self, raise_on=None):
        self.seen, self.raise_on = [], raise_on

    def on_ctrl(self, src, kind, body):
        self.seen.append((src, kind))
        if kind == self.raise_on:
            from mlfabric.runtime.daemon import MPI
            raise MPI.Exception(MPI.ERR_PROC_FAILED)

    def tick(self, now):
        pass


def test_a_failure_met_by_a_handler_loses_none_of_the_messages_already_taken():
    # the scheduler took [pulls from the server that just died, done, ready] at once; handling
    # the first met the death (its MPI call raised): the others are handled at the next pass
    # (were dropped: the job then waited forever for the worker's 'done')
    from mlfabric.runtime.daemon import MPI
    role = _Recorder(raise_on="pulls")
    d = _daemon_with(role, [(1, "pulls", None), (3, "done", 12), (2, "ready", [])])
    with pytest.raises(MPI.Exception):
        d._turn()
    d._turn()
    assert role.seen == [(1, "pulls"), (3, "done"), (2, "ready")]


def test_a_send_refused_by_a_death_is_acknowledged_after_the_handler_completes():
    # a handler whose send meets the death completes (every live rank gets its message), then
    # the daemon takes the failure as if an MPI call had raised it
    from mlfabric.runtime.daemon import MPI

    class Fanout(_Recorder):
        def on_ctrl(self, src, kind, body):
            super().on_ctrl(src, kind, body)
            for r in (1, 2, 3):
                d.rt.channel.send(r, "promote", body)
    role = Fanout()
    d = _daemon_with(role, [(2, "promoted", 7), (3, "done", 12)])
    with pytest.raises(MPI.Exception) as info:
        d._turn()
    assert info.value.Get_error_class() == MPI.ERR_PROC_FAILED
    assert role.seen == [(2, "promoted"), (3, "done")]
    assert sorted({dst for dst, _ in d.rt.channel.comm.posted}) == [2, 3]


def _scheduler(size=6, timeout=2.0, monkeypatch=None):
    """A SchedulerRole of a replicated mlfabric-A job over a fake runtime whose channel keeps
    what is sent."""
    import types
    from mlfabric.runtime.scheduler import SchedulerRole
    monkeypatch.setenv("MLFABRIC_TIMEOUT", str(timeout))
    roles = Roles(size, 1, 1)
    infos = [{"version": 0} if r in roles.server_ranks else
             {"tau_max": math.inf, "div_max": 1.0} for r in range(size)]
    sent = []
    channel = types.SimpleNamespace(send=lambda dst, kind, body=None: sent.append((dst, kind)),
                                    heard=np.full(size, 1e18))
    rt = types.SimpleNamespace(config=Config(replicas=1), roles=roles, infos=infos, size=size,
                               failed=set(), channel=channel, ledger=Ledger(), now=lambda: 0.0)
    sched = SchedulerRole(rt)
    sched.sent = sent
    return sched


def test_a_promotion_the_replica_never_confirms_is_an_error_not_a_wait(monkeypatch):
    from mlfabric.errors import PeerTimeoutError
    s = _scheduler(monkeypatch=monkeypatch)
    s.rt.failed.add(1)
    s.peers_failed([1], [])
    assert (2, "promote") in s.sent and 1 in s.promoting
    s._bounds(s.promoting[1] + 1.0)       # within MLFABRIC_TIMEOUT: waits
    with pytest.raises(PeerTimeoutError, match="replica \\(rank 2\\) has not confirmed its "
                                               "promotion"):
        s._bounds(s.promoting[1] + 2.5)


def test_a_replica_that_dies_while_promoted_is_a_clear_error(monkeypatch):
    s = _scheduler(monkeypatch=monkeypatch)
    s.rt.failed.add(1)
    s.peers_failed([1], [])
    s.rt.failed.add(2)
    with pytest.raises(MlfabricError, match="died while being promoted"):
        s.peers_failed([2], [])


def test_an_end_that_makes_no_progress_is_an_error_naming_what_it_waits_for(monkeypatch):
    from mlfabric.errors import PeerTimeoutError
    s = _scheduler(monkeypatch=monkeypatch)
    t0 = 1000.0
    s._bounds(t0)
    s._bounds(t0 + 10.0)     # workers still training: no bound on how long they take
    for w in s.workers:
        s.done[w] = 1
    s.ready_ids.add(3 << 32)  # reported, never resolved
    s._bounds(t0 + 11.0)
    s._bounds(t0 + 12.5)
    s.resolved.add(3 << 32)   # progress restarts the clock
    s._bounds(t0 + 13.0)
    s._bounds(t0 + 14.5)
    with pytest.raises(PeerTimeoutError, match="made no progress .* waiting for: "
                                               "unresolved updates per worker"):
        s._bounds(t0 + 15.5)


def test_a_daemon_meeting_a_failure_at_every_pass_fails_instead_of_spinning(monkeypatch):
    # a pass that raises before its timed work every time (the scheduler's liveness messages,
    # its end) left the job silent while the loop still looked alive: now an error
    import time
    from mlfabric.errors import PeerTimeoutError
    from mlfabric.runtime.daemon import MPI
    monkeypatch.setenv("MLFABRIC_TIMEOUT", "0.3")
    d = _daemon_with(_Recorder(), [])

    def receive():
        raise MPI.Exception(MPI.ERR_PROC_FAILED_PENDING)
    d.rt.channel.receive = receive
    d._peers_failed = lambda: None   # acknowledged; nothing new
    d.last_turn = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="no pass of this rank's daemon completed"):
        d._loop()
    assert time.monotonic() - d.last_turn < 5.0
